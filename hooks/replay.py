"""Routing replayed from a recorded trace: every token of a model with dummy weights (whose routers pick alike for
every token) is routed as a token of a recorded run was, through the router wrapper that records it.

# T tokens in a forward (T_pad under a CUDA graph), E experts, C candidates the trace kept per token, N the trace's
# routed tokens (one row each, requests one after another), Lt the trace's MoE layers

The trace (``moetrace record --candidates C``, C >= the model's top-k) becomes a bank on the device: per routed
token and layer, its C candidate experts and their selection scores (the last row at each request and position:
the token the request kept), in the router logits' dtype with each token's candidates kept in their recorded order
(``strictly_ordered``). A request of the engine replays a request of the trace: the i-th request of a
recording, the trace's request i mod R; its token at position p replays that request's p-th routed token (p modulo
the request's length); the model's MoE layer l replays the trace's layer l mod Lt. Before each forward
``ReplayedRouting.plan`` writes each token's first bank row and its request's length into device buffers at fixed
addresses (``hooks.planned``); inside the forward ``logits`` gathers each token's row (from the runner's own device
positions, so exact under async scheduling) and hands the router logits that hold the recorded candidates' scores
and ``FLOOR`` elsewhere: the router's own top-k, normalisation and scaling, and any budget, run on them. Routers
lose their selection bias (set to 0 in place), so their choice is the recorded one; the weights are the router's
of those scores, not the recorded weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from moetrace.hooks.options import replay_refusal
from moetrace.hooks.planned import PlannedBuffer, PlannedStep
from moetrace.trace.manifest import Manifest
from moetrace.trace.schema import MANIFEST_NAME, ROUTING_DIR

# The logit of an expert outside a token's recorded candidates: no router picks it over one (C >= top-k, and recorded
# selection scores lie far above), yet its sigmoid or softmax stays a positive float32, so a budget that leaves a
# token only such experts (its group kept none of its candidates) weighs them evenly instead of dividing 0 by 0.
FLOOR = -60.0


@dataclass(frozen=True)
class RoutingBank:
    """A trace's routed tokens on the device: candidate ids [N, Lt, C] (int64) and scores [N, Lt, C] (in the router
    logits' dtype, ``strictly_ordered``), and each request's first row and length [R]."""

    ids: torch.Tensor
    scores: torch.Tensor
    starts: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]

    @property
    def layers(self) -> int:
        return int(self.ids.shape[1])


def strictly_ordered(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scores`` [..., C] (a token's candidates, best first) rounded to ``dtype``, each below the one before it: where
    rounding ties two (bfloat16 keeps 8 bits, so scores 0.004 apart tie), the later takes the next value below. The
    router's top-k of them is then the recorded first K, as on the engine it was recorded on. On the host:
    ``nextafter`` is not on every device for every dtype."""
    rounded = scores.cpu().to(dtype)
    lowest = torch.tensor(float("-inf"), dtype=dtype)
    columns = [rounded[..., 0]]
    for column in range(1, rounded.shape[-1]):
        columns.append(torch.minimum(rounded[..., column], torch.nextafter(columns[-1], lowest)))
    return torch.stack(columns, dim=-1).to(scores.device)


def load_bank(path: Path, num_experts: int, top_k: int, device: torch.device, dtype: torch.dtype) -> RoutingBank:
    """The bank of the trace at ``path`` for a model of ``num_experts`` experts and top-``top_k`` whose router
    logits are ``dtype``; ``ValueError`` saying why the trace cannot be replayed into it. Read with pyarrow (the
    engine side imports no polars)."""
    try:
        manifest = Manifest.from_document(json.loads((path / MANIFEST_NAME).read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable moetrace trace ({exc})") from None
    refused = replay_refusal(manifest, num_experts, top_k)
    if refused is not None:
        raise ValueError(f"{path}: {refused}")
    candidates = manifest.capture.candidates
    files = sorted((path / ROUTING_DIR).glob("*.parquet"))  # closed files only (open ones end in .inprogress)
    if not files:
        raise ValueError(f"{path}: no routing files")
    table = pa.concat_tables(pq.read_table(file, columns=["step", "request", "position", "layer", "cand_experts",
                                                          "cand_scores"]) for file in files)
    step, request, position, layer = (table[name].to_numpy().astype(np.int64)
                                      for name in ("step", "request", "position", "layer"))
    # the last row (by step) at each request, position and layer: the token the request kept
    order = np.lexsort((step, layer, position, request))
    key = np.stack([request[order], position[order], layer[order]])
    last = order[np.append(np.any(key[:, 1:] != key[:, :-1], axis=0), True)]
    layers = len(np.unique(layer))
    tokens = len(last) // layers
    if len(last) % layers or np.any(layer[last].reshape(tokens, layers) != np.unique(layer)):
        raise ValueError(f"{path}: tokens routed in only some layers")
    shape = (tokens, layers, candidates)
    ids = table["cand_experts"].combine_chunks().flatten().to_numpy().reshape(-1, candidates)[last]
    scores = table["cand_scores"].combine_chunks().flatten().to_numpy().reshape(-1, candidates)[last]
    if scores.size and float(scores.min()) <= FLOOR / 2:
        raise ValueError(f"{path}: selection scores down to {float(scores.min()):.3g} lie too near the floor that "
                         f"keeps other experts out ({FLOOR})")
    _, lengths = np.unique(request[last[::layers]], return_counts=True)
    return RoutingBank(
        ids=torch.from_numpy(ids.astype(np.int64).reshape(shape)).to(device),
        scores=strictly_ordered(torch.from_numpy(scores.astype(np.float32).reshape(shape)), dtype).to(device),
        starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        lengths=lengths.astype(np.int64),
    )


class ReplayedRouting:
    """Which bank rows the next forward's tokens replay: planned on the host, gathered inside the forward."""

    def __init__(self, bank: RoutingBank, max_tokens: int, positions: torch.Tensor) -> None:
        self.bank = bank
        self.positions = positions  # [>= T_max] the runner's device positions, at a fixed address
        device = bank.ids.device
        self.starts = PlannedBuffer((max_tokens,), 0, device)  # each token's request's first row
        self.lengths = PlannedBuffer((max_tokens,), 1, device)  # and its routed tokens
        self.requests: dict[str, int] = {}  # vLLM's request id -> the trace's request it replays
        self.seen = 0

    def restart(self) -> None:
        """A new recording begins: its first request replays the trace's first."""
        self.requests.clear()
        self.seen = 0

    def plan(self, step: PlannedStep | None, finished: Iterable[str]) -> None:
        """Before the forward of ``step`` (None: no request's step, every token replays row 0)."""
        for request in finished:
            self.requests.pop(request, None)
        with self.starts.planning() as starts, self.lengths.planning() as lengths:
            if step is None:
                return
            replayed = np.empty(len(step.req_ids), dtype=np.int64)
            for index, request in enumerate(step.req_ids):
                if request not in self.requests:
                    self.requests[request] = self.seen % len(self.bank.lengths)
                    self.seen += 1
                replayed[index] = self.requests[request]
            counts = np.diff(step.query_start)
            tokens = int(step.query_start[-1])
            starts[:tokens] = np.repeat(self.bank.starts[replayed], counts)
            lengths[:tokens] = np.repeat(self.bank.lengths[replayed], counts)

    def logits(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] for MoE layer ``slot``: the replayed tokens' candidate scores, ``FLOOR`` elsewhere."""
        tokens = like.shape[0]
        rows = self.starts.device[:tokens] + self.positions[:tokens].long() % self.lengths.device[:tokens]  # [T]
        layer = slot % self.bank.layers
        replayed = torch.full_like(like, FLOOR)
        return replayed.scatter_(1, self.bank.ids[rows, layer], self.bank.scores[rows, layer].to(like.dtype))


def replayed_routing(path: Path, num_experts: int, top_k: int, max_num_tokens: int, positions: torch.Tensor,
                     device: torch.device, dtype: torch.dtype) -> ReplayedRouting:
    """The routing of the trace at ``path``, ready to replay on an engine of ``max_num_tokens`` tokens a step whose
    runner keeps token positions in ``positions`` and whose router logits are ``dtype``; ``ValueError`` naming why
    it cannot."""
    try:
        bank = load_bank(path, num_experts, top_k, device, dtype)
    except ValueError as exc:
        raise ValueError(f"cannot replay routing from {exc}") from None
    return ReplayedRouting(bank, max_num_tokens, positions)
