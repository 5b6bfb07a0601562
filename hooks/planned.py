"""Per-token facts planned on the host before a forward and read on the device inside it (under CUDA graphs too).

# T_max the most tokens in a forward, R requests in the step
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch


class PlannedStep(NamedTuple):
    """A step's tokens as the runner has laid them out before its forward: request r's tokens are
    query_start[r]:query_start[r+1] [R + 1], of which drafts[r] [R] are drafts it verifies."""

    query_start: npt.NDArray[np.int64]
    drafts: npt.NDArray[np.int64]
    req_ids: list[str]


class PlannedBuffer:
    """An int64 device buffer [..., T_max] at a fixed address (a CUDA graph reads it at every replay), written before
    each forward from one of two host buffers in turn (pinned on CUDA; the last copy may still be in flight under
    async scheduling): no host sync, nothing allocated per forward."""

    def __init__(self, shape: tuple[int, ...], fill: int, device: torch.device) -> None:
        self.fill = fill
        pinned = torch.device(device).type == "cuda"
        self._host = [torch.full(shape, fill, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self.device = torch.full(shape, fill, dtype=torch.int64, device=device)

    @contextmanager
    def planning(self) -> Iterator[npt.NDArray[np.int64]]:
        """The next host buffer, reset to ``fill``, as a numpy view to write the plan into; copied to the device
        buffer (without blocking) as the block ends."""
        host = self._host[self._turn]
        self._turn ^= 1
        host.fill_(self.fill)
        yield host.numpy()
        self.device.copy_(host, non_blocking=True)
