"""Routing replayed from a recorded trace: every token of a model with dummy weights (whose routers pick alike for
every token) is routed as a token of a recorded run was, through the router wrapper that records it.

# T tokens in a forward (T_pad under a CUDA graph), E experts, C candidates the trace kept per token, N the trace's
# routed tokens (one row each, requests one after another), Lt the trace's MoE layers

The trace (``moetrace record --candidates C``, C >= the model's top-k) becomes a bank on the device: per routed
token and layer, its C candidate experts and their selection scores (the last row at each request and position:
the token the request kept). A request of the engine replays a request of the trace: the i-th request of a
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

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import polars as pl
import torch

from moetrace.hooks.planned import PlannedBuffer, PlannedStep

FLOOR = -1.0e4  # the logit of an expert outside a token's recorded candidates: no router picks it while C >= top-k


@dataclass(frozen=True)
class RoutingBank:
    """A trace's routed tokens on the device: candidate ids [N, Lt, C] (int64) and scores [N, Lt, C], and each
    request's first row and length [R]."""

    ids: torch.Tensor
    scores: torch.Tensor
    starts: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]

    @property
    def layers(self) -> int:
        return int(self.ids.shape[1])


def load_bank(path: Path, num_experts: int, top_k: int, device: torch.device) -> RoutingBank:
    """The bank of the trace at ``path`` for a model of ``num_experts`` experts and top-``top_k``; ``ValueError``
    saying why the trace cannot be replayed into it."""
    from moetrace.errors import UserError
    from moetrace.trace.reader import open_trace

    try:
        trace = open_trace(path)
    except UserError as exc:
        raise ValueError(str(exc)) from None
    model = trace.manifest.model
    if model.num_experts != num_experts:
        raise ValueError(f"{path}: its model has {model.num_experts} experts, this one {num_experts}")
    candidates = trace.manifest.capture.candidates
    if candidates < top_k:
        raise ValueError(f"{path}: it keeps {candidates} candidates per token; replaying into a top-{top_k} router "
                         f"needs at least {top_k} (record it with --candidates {2 * top_k})")
    rows = (trace.routing().select("step", "request", "position", "layer", "cand_experts", "cand_scores")
            .sort("step").group_by("request", "position", "layer").last()  # the token each request kept
            .sort("request", "position", "layer").collect())
    layers = rows["layer"].n_unique()
    if rows.height == 0 or rows.height % layers:
        raise ValueError(f"{path}: no routed tokens, or tokens routed in only some layers")
    tokens = rows.height // layers
    per_request = rows.filter(pl.col("layer") == rows["layer"][0]).group_by("request", maintain_order=True).len()
    lengths = per_request["len"].to_numpy().astype(np.int64)
    shape = (tokens, layers, candidates)
    return RoutingBank(
        ids=torch.from_numpy(rows["cand_experts"].to_numpy().astype(np.int64).reshape(shape)).to(device),
        scores=torch.from_numpy(rows["cand_scores"].to_numpy().astype(np.float32).reshape(shape)).to(device),
        starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        lengths=lengths,
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
