"""How long vLLM's calls take on the recorder's timed steps (host time, and device time between CUDA events read
once they have completed, never waited for inside a step)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# A GPU step of a few ms is timed one in 64: each CUDA event record costs it 35 µs on some hosts (gVisor), three of
# them while the GPU idles; thousands of steps still give each phase's median hundreds of timed calls.
TIMED_STEP_EVERY_ON_CUDA = 64
GOLDEN_RATIO_CONJUGATE = 0.6180339887498949
# Timed calls kept per batch size: a recording that runs for days (always on under `vllm serve`) keeps a uniform
# sample of this many, so its memory stays flat (the sample median's rank in the whole: within 0.8%, one standard
# error)
KEPT_PER_BATCH = 4096


class Reservoir:
    """A uniform sample of at most ``size`` of the values added (Vitter's algorithm R, seeded: reproducible), and
    how many were added."""

    __slots__ = ("size", "count", "values", "_random")

    def __init__(self, size: int = KEPT_PER_BATCH) -> None:
        self.size, self.count = size, 0
        self.values: list[float] = []
        self._random = np.random.default_rng(0)

    def add(self, value: float) -> None:
        self.count += 1
        if len(self.values) < self.size:
            self.values.append(value)
            return
        slot = int(self._random.integers(self.count))
        if slot < self.size:
            self.values[slot] = value


class PhaseTiming:
    """What one runner call costs per step, per batch size (requests scheduled): host time of the call and, on CUDA,
    the device time between two events recorded around it, read once they have completed (never waited for inside
    a step). Only the recorder's timed steps are timed. Medians: the first calls carry one-off costs (the n-gram
    proposer's JIT compile takes a second)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.calls = 0
        self.host_ms: dict[int, Reservoir] = {}
        self.device_ms: dict[int, Reservoir] = {}
        self._in_flight: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._free: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # read pairs, reused: creating one costs

    def start(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | tuple[()]:
        self.calls += 1
        if not self.cuda:
            return ()
        events = self._free.pop() if self._free else (
            torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
        events[0].record()
        return events

    def end(self, batch: int, events: tuple[torch.cuda.Event, torch.cuda.Event] | tuple[()], host_ns: int) -> None:
        self.host_ms.setdefault(batch, Reservoir()).add(host_ns / 1e6)
        if events:
            events[1].record()
            self._in_flight.append((batch, *events))

    @property
    def in_flight(self) -> bool:
        """Whether a call's events wait to be read."""
        return bool(self._in_flight)

    def read_done(self, wait: bool = False) -> None:
        """Keep the device time of every call whose events have completed (``wait``: all of them, at close)."""
        while self._in_flight and (wait or self._in_flight[0][2].query()):  # type: ignore[no-untyped-call]
            batch, first, last = self._in_flight.pop(0)
            last.synchronize()
            self.device_ms.setdefault(batch, Reservoir()).add(first.elapsed_time(last))
            self._free.append((first, last))

    def summary(self, wait: bool = True) -> dict[str, dict[str, Any]]:
        """Per batch size: calls, and the host and device medians in ms (device: None off CUDA), over at most
        ``KEPT_PER_BATCH`` of the calls, a uniform sample of them; ``wait``: for the device times of calls still in
        flight (at close), else those completed so far."""
        self.read_done(wait=wait)
        return {
            str(batch): {
                "calls": host.count,
                "host_ms_median": float(np.median(host.values)),
                "device_ms_median": float(np.median(self.device_ms[batch].values)) if batch in self.device_ms else None,
            }
            for batch, host in sorted(self.host_ms.items())
        }
