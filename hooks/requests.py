"""The requests a recorder has seen: each one's index in the trace and where it ends (prompt + max_tokens), kept
for the requests still running only, so a server that runs for days holds no more than it runs at once (the writer
process keeps every id)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from moetrace.hooks.vllm_api import sequence_limits


class RequestBook:
    """vLLM's request id -> its index in the trace under way (``restart``: a new trace counts from 0), and -> prompt
    + max_tokens across traces (a request-step that begins at the last position is one vLLM runs after the request
    finished, and drops)."""

    __slots__ = ("index", "limit", "seen")

    def __init__(self) -> None:
        self.limit: dict[str, int] = {}
        self.restart()

    def restart(self) -> None:
        self.index: dict[str, int] = {}
        self.seen = 0

    def scheduled(self, scheduler_output: Any) -> None:
        """A step begins: note each new request's end, and forget those finished since the last step (no more rows
        to come)."""
        self.limit.update(sequence_limits(scheduler_output))
        for finished in scheduler_output.finished_req_ids:
            self.index.pop(finished, None)
            self.limit.pop(finished, None)

    def of_step(self, req_ids: Sequence[str]
                ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.int64], tuple[str, ...]]:
        """The step's requests [R] (in ``req_ids`` order): their trace indices, their ends (0: none given), and the
        ids the trace has not seen before (indexed now)."""
        new = tuple(r for r in req_ids if r not in self.index)
        for request in new:
            self.index[request] = self.seen
            self.seen += 1
        return (np.array([self.index[r] for r in req_ids], dtype=np.uint32),
                np.array([self.limit.get(r, 0) for r in req_ids], dtype=np.int64), new)
