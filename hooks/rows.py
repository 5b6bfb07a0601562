"""One engine step's rows, assembled from what the worker copied out: numpy only, so the trace writer's process
can unpickle and assemble it without torch or vLLM.

# T tokens in the step, R requests in the step, L recorded MoE layers, K top-k, C candidates, d_i drafts of
# request i
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from moetrace.trace.schema import TOKEN_PHASES
from moetrace.writer.ring import RingRows, SharedRows
from moetrace.trace.files import StepCapture

PREFILL, DECODE, VERIFY = (np.int8(TOKEN_PHASES.index(p)) for p in ("prefill", "decode", "verify"))
NOT_A_DRAFT = -1


@dataclass(frozen=True)
class PackedLayout:
    """Columns of a step's packed int32 block [T, W]: ids [L·K], weights [L·K] (float32 bits), candidate ids and
    scores [L·C] each (float32 bits), position [1], token [1] when token ids are kept."""

    layers: int
    top_k: int
    candidates: int
    token_ids: bool

    @property
    def routing_width(self) -> int:
        return self.layers * 2 * (self.top_k + self.candidates)

    @property
    def width(self) -> int:
        return self.routing_width + 1 + int(self.token_ids)

    def unpack(self, packed: npt.NDArray[np.int32]) -> dict[str, npt.NDArray[np.generic]]:
        host = self.unpack_routing(packed)
        host["positions"] = packed[:, self.routing_width]
        if self.token_ids:
            host["tokens"] = packed[:, self.routing_width + 1]
        return host

    def unpack_routing(self, packed: npt.NDArray[np.int32]) -> dict[str, npt.NDArray[np.generic]]:
        """The routing fields [T, L, K or C] of a block's first ``routing_width`` columns (``RoutingCapture.collect``'s
        block)."""
        num_tokens = packed.shape[0]
        widths = {"ids": self.top_k, "weights": self.top_k, "cand_ids": self.candidates,
                  "cand_scores": self.candidates}
        host: dict[str, npt.NDArray[np.generic]] = {}
        start = 0
        for name, width in widths.items():
            if width:
                block = np.ascontiguousarray(packed[:, start : start + self.layers * width])
                block = block.view(np.float32) if name in ("weights", "cand_scores") else block
                host[name] = block.reshape(num_tokens, self.layers, width)
                start += self.layers * width
        return host


@dataclass
class StepRecord:
    """What the worker knows of one step once its device copies have landed."""

    step: int
    t_start_ns: int
    t_end_ns: int
    requests: npt.NDArray[np.uint32]  # [R] request index within the run
    query_start: npt.NDArray[np.int64]  # [R + 1]
    num_prompt_tokens: npt.NDArray[np.int64]  # [R]
    drafts: npt.NDArray[np.int64]  # [R] d_i
    kept: npt.NDArray[np.int64]  # [R] tokens each request kept: accepted drafts + 1 (0 when nothing sampled)
    packed: npt.NDArray[np.int32] | RingRows  # [T, W], or where it lies in the ring shared with the writer process
    layout: PackedLayout
    new_requests: tuple[str, ...] = ()  # vLLM's ids of the requests first seen in this step, in index order
    sequence_limit: npt.NDArray[np.int64] | None = None  # [R] prompt + max_tokens (0 or None: none given)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as raw bytes (a few µs, against about 30 for numpy's own pickling of eight small arrays): this
        runs on vLLM's engine thread once per step. Rows left in the shared ring go as where they lie."""
        packed = self.packed
        limit = np.zeros(len(self.requests), np.int64) if self.sequence_limit is None else self.sequence_limit
        per_request = np.concatenate((self.query_start, self.num_prompt_tokens, self.drafts, self.kept, limit),
                                     dtype=np.int64)
        return (_step_record, (self.step, self.t_start_ns, self.t_end_ns, self.requests.astype(np.uint32).tobytes(),
                               per_request.tobytes(),
                               packed if isinstance(packed, RingRows) else packed.astype(np.int32).tobytes(),
                               self.layout, self.new_requests))  # one layout object for every step: pickled once

    def take_rows(self, ring: SharedRows | None) -> None:
        """Writer process: copy the step's rows out of the shared ring (releasing them), if they lie there."""
        if isinstance(self.packed, RingRows):
            if ring is None:
                raise RuntimeError("a step's rows lie in a ring that the writer process was not given")
            self.packed = ring.take(self.packed)

    def assemble(self) -> StepCapture:
        """The step's rows: each request's last d_i + 1 tokens are its verification window (anchor, drafts).

        A request-step whose first token lies at the request's last position (prompt + max_tokens - 1) ran after
        its request had finished: async scheduling schedules a step before the last one's tokens are known, and
        vLLM drops what such a step sampled and counts none of its drafts. Its rows are left out, and counted
        (``StepCapture.discarded``)."""
        assert not isinstance(self.packed, RingRows), "take_rows first"
        host = self.layout.unpack(self.packed)
        positions = host["positions"].astype(np.int64)
        query_start, drafts, kept = self.query_start, self.drafts, self.kept[: len(self.requests)]
        requests, num_prompt_tokens = self.requests, self.num_prompt_tokens
        discarded = (0, 0)
        if self.sequence_limit is not None and len(self.requests):
            spans = np.diff(query_start)
            first = positions[np.minimum(query_start[:-1], max(len(positions) - 1, 0))]
            done = (self.sequence_limit > 0) & (spans > 0) & (first >= self.sequence_limit - 1)
            if done.any():
                token_done = np.repeat(done, spans)
                discarded = (int(done.sum()), int(token_done.sum()))
                host = {name: values[~token_done] for name, values in host.items()}
                positions = positions[~token_done]
                query_start = np.concatenate(([0], np.cumsum(spans[~done])))
                drafts, kept, requests = drafts[~done], kept[~done], requests[~done]
                num_prompt_tokens = num_prompt_tokens[~done]
        num_reqs = len(requests)
        num_tokens = int(query_start[-1])
        per_req_tokens = np.diff(query_start)
        accepted = np.where(drafts > 0, np.clip(kept - 1, 0, drafts), 0)
        token_req = np.repeat(np.arange(num_reqs), per_req_tokens)
        # Offset of each token from the end of its request's span: the last d_i + 1 tokens are the window.
        from_end = query_start[1:][token_req] - 1 - np.arange(num_tokens)
        window_drafts = drafts[token_req]
        in_window = from_end <= window_drafts
        draft_pos = np.where(in_window & (window_drafts > 0), window_drafts - from_end, 0)
        phase = np.where(
            positions < num_prompt_tokens[token_req], PREFILL, np.where(window_drafts > 0, VERIFY, DECODE)
        ).astype(np.int8)
        is_draft = draft_pos > 0
        token_accepted = np.where(is_draft, (draft_pos <= accepted[token_req]).astype(np.int8), NOT_A_DRAFT)
        return StepCapture(
            step=self.step,
            request=requests[token_req],
            position=positions.astype(np.uint32),
            phase=phase,
            draft_pos=draft_pos.astype(np.uint8),
            token=host["tokens"].astype(np.uint32) if "tokens" in host else None,
            accepted=token_accepted.astype(np.int8),
            experts=host["ids"].astype(np.uint16),
            weights=host["weights"].astype(np.float32),
            cand_experts=host["cand_ids"].astype(np.uint16) if "cand_ids" in host else None,
            cand_scores=host["cand_scores"].astype(np.float32) if "cand_scores" in host else None,
            steps_rows={
                "step": np.full(num_reqs, self.step, dtype=np.uint32),
                "request": requests,
                "num_tokens": per_req_tokens.astype(np.uint32),
                "num_drafts": drafts.astype(np.uint32),
                "num_accepted": accepted.astype(np.uint32),
                "batch_size": np.full(num_reqs, len(self.requests), dtype=np.uint32),  # the engine's, as it ran
                "t_start_ns": np.full(num_reqs, self.t_start_ns, dtype=np.int64),
                "t_end_ns": np.full(num_reqs, self.t_end_ns, dtype=np.int64),
            },
            new_requests=self.new_requests,
            discarded=discarded,
        )


def _step_record(step: int, t_start_ns: int, t_end_ns: int, requests: bytes, per_request: bytes,
                 packed: bytes | RingRows, layout: PackedLayout, new_requests: tuple[str, ...] = ()) -> StepRecord:
    """``StepRecord.__reduce__``'s inverse: [R] uint32 requests; [R+1] query starts, then [R] prompt lengths, drafts,
    kept counts and sequence limits, int64; the [T, width] int32 block, or where it lies in the shared ring."""
    num_reqs = len(requests) // 4
    values = np.frombuffer(per_request, dtype=np.int64)
    ends = np.cumsum([num_reqs + 1, num_reqs, num_reqs, num_reqs, num_reqs])
    query_start, num_prompt_tokens, drafts, kept, limit = np.split(values, ends[:-1])
    return StepRecord(step, t_start_ns, t_end_ns, np.frombuffer(requests, dtype=np.uint32), query_start,
                      num_prompt_tokens, drafts, kept, packed if isinstance(packed, RingRows) else
                      np.frombuffer(packed, dtype=np.int32).reshape(-1, layout.width), layout, new_requests, limit)
