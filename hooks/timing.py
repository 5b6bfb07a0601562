"""How long vLLM's calls take on the recorder's timed steps (host time, and device time between CUDA events read
once they have completed, never waited for inside a step), and what the recorder's own hooks cost there."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from moetrace.trace.schema import TIMED_CALLS

# What the recorder's own hooks cost the engine thread, each (the manifest's ``engine_thread_us_per_step``)
OWN_COSTS = ("step", "graph", "hand_over", "layout", "sample", "sample_tokens", "phase_timing")
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

    def medians(self, wait: bool = True) -> dict[str, dict[str, Any]]:
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


class StepTimer:
    """Which steps are timed, one in ``every`` (a Weyl sequence: spread evenly, never in step with a periodic workload;
    a fixed every-Nth step would time nothing but prefills when requests last N steps), vLLM's calls on them
    (``phases``) and the recorder's own time on the engine thread (``own_ns``, per hook). Whether a step is timed is
    decided once its forward is launched: before it, under sync scheduling, the GPU idles."""

    def __init__(self, cuda: bool, every: int) -> None:
        self.every = every
        self.phases = {phase: PhaseTiming(cuda) for phase in TIMED_CALLS}
        self.own_ns = dict.fromkeys(OWN_COSTS, 0)
        self._weyl = 0.0
        self.next = False  # whether the next step is timed
        self.on = False  # whether the step under way is timed (its phases and the hooks' own time)
        self.in_flight = False  # whether a timed step's events may not have been read yet
        self.batch = 0  # requests scheduled in the timed step under way
        self._forward_began = 0  # the timed step's forward phase: its start (perf_counter_ns) and events
        self._forward_events: tuple[torch.cuda.Event, torch.cuda.Event] | tuple[()] | None = None
        self.advance()

    def advance(self) -> None:
        """Decide whether the next step is timed."""
        self._weyl = (self._weyl + GOLDEN_RATIO_CONJUGATE) % 1.0
        self.next = self._weyl * self.every < 1.0

    def start_forward(self) -> None:
        """A timed step begins: its forward phase is timed from here on."""
        self._forward_events = self.phases["forward"].start()
        self._forward_began = time.perf_counter_ns()
        self.on = True

    def end_forward(self, batch: int) -> None:
        """The timed step's forward is launched, with ``batch`` requests; read the events of earlier timed steps that
        have completed."""
        if self.on and self._forward_events is not None:
            ended = time.perf_counter_ns()
            self.batch = batch
            self.phases["forward"].end(batch, self._forward_events, ended - self._forward_began)
            self.own_ns["phase_timing"] += time.perf_counter_ns() - ended
        self._forward_events = None
        if self.in_flight:
            for timing in self.phases.values():
                timing.read_done()
            self.in_flight = any(timing.in_flight for timing in self.phases.values())

    def end_step(self) -> None:
        """The timed step under way has sampled: its events are read once they have completed."""
        self.on, self.in_flight = False, True

    def forget_forward(self) -> None:
        self._forward_events = None

    def timed(self, phase: str, guard: AbstractContextManager[None], recording: bool, call: Callable[..., Any],
              *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``call``, timed as ``phase`` on a timed step (when ``recording``); whatever the timing raises goes to
        ``guard``, never into the engine."""
        if not self.on:
            return call(*args, **kwargs)
        timing = self.phases[phase]
        began = time.perf_counter_ns()
        events = None
        with guard:
            if recording:
                events = timing.start()
        called = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            returned = time.perf_counter_ns()
            with guard:
                if events is not None:
                    timing.end(self.batch, events, returned - called)
            self.own_ns["phase_timing"] += called - began + time.perf_counter_ns() - returned

    def us_per_step(self) -> dict[str, float]:
        """What each hook added to the engine thread, in µs per recorded step (its own work, vLLM's excluded),
        measured on the timed steps."""
        steps = max(self.phases["forward"].calls, 1)
        return {name: round(ns / steps / 1e3, 2) for name, ns in self.own_ns.items()}

    def manifest_phases(self, final: bool) -> dict[str, dict[str, dict[str, Any]]]:
        """The manifest's ``phases`` (``PhaseTiming.medians``); ``final``: at close, waiting for events in flight."""
        return {phase: timing.medians(wait=final) for phase, timing in self.phases.items()}
