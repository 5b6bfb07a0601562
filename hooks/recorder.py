"""Per-worker recorder: binds the routing buffers to the target model and turns each engine step into rows.

# T tokens in the step, R requests in the batch, L recorded MoE layers, K top-k, d_i drafts of request i

Both of vLLM's model runners are recorded (``vllm_api.RunnerV1`` and ``RunnerV2`` say which calls are wrapped
and where a step's batch lives): a step begins (V1: ``_update_states``; V2: ``execute_model``), a call says which
CUDA graph its forward replays, the forward runs, ``sample_tokens`` runs the rejection sampler, and the drafter
runs after both. Each of the three is timed (the manifest's ``phases``: host time, and on CUDA the device time
between events around it, per batch size) on every step on the CPU and one step in ``TIMED_STEP_EVERY_ON_CUDA`` on
a GPU (``--time-phases-every``), so a trace says where its steps' time went. The timed steps follow a Weyl
sequence: spread evenly, never in step with a periodic workload (a fixed every-Nth step would time nothing but
prefills when requests last N steps). On V1 no hook lies beneath the forward (see ``HookPoint``: a few Python frames
more beneath a PIECEWISE forward cost it a page fault per layer).

Under sync scheduling the GPU idles from vLLM's sync after sampling until the next forward is launched, so
whatever a hook does there slows every step; everything else runs while the GPU is busy (and is hidden, but in
steps whose host work outlasts the GPU's: prefills, forwards outside CUDA graphs). Before the launch the hooks only
note the step; after vLLM's sync they count the host lists of sampled tokens and queue the step. The rest happens
once the forward is launched, as ``sample_tokens`` begins: what lives on the host (request order, query starts,
drafts per request) is copied because the runner reuses those arrays; what lives on the device (routing rows,
positions, token ids) is packed into one block (``torch.cat`` of views) that the GPU writes, without blocking, on
vLLM's stream, straight into a ring of pinned rows that the writer process maps too (``StepCopier``,
``SharedRows``), so vLLM's own sync covers it. With async scheduling vLLM's own device count of kept tokens is
copied too, and an event after it says when the step is ready. Once a later step's forward is launched the step is
handed to the writer process, in a batch of steps (``TraceWriter.forward_ready``): one pickle of their few host
arrays and where their rows lie, one pipe write; the writer process copies the rows out of the ring and assembles
and encodes them (``StepRecord.assemble``): recording adds no host sync to a step, the engine thread never touches
the routing rows, and no thread in the engine process competes with the engine loop for the GIL while steps flow.
The manifest's ``engine_thread_us_per_step`` says what each hook cost.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from moetrace.hooks.capture import (
    RoutingCapture,
    router_info,
    unwrap_logits_entry,
    unwrap_router,
    wrap_logits_entry,
    wrap_router,
)
from moetrace.hooks.manifest import worker_manifest
from moetrace.hooks.vllm_api import ForwardPlan, HookPoint, StepInputs, WorkerApi, require_fields
from moetrace.hooks.rows import PackedLayout, StepRecord
from moetrace.schema import TIMED_CALLS
from moetrace.writer import RingRows, SharedRows, TraceWriter, ring_capacity

log = logging.getLogger("moetrace")
_HOOK_MARK = "_moetrace_hook"


class UnsupportedRunner(RuntimeError):
    """The worker's model runner is one moetrace cannot record from."""


class Recorder:
    """Records one worker's target-model routing into one trace directory."""

    def __init__(self, api: WorkerApi, runner: Any, vllm_config: Any, settings: dict[str, Any]) -> None:
        self.model_runner = api.model_runner(runner)
        if self.model_runner.name == "v2" and int(vllm_config.parallel_config.data_parallel_size) > 1:
            raise UnsupportedRunner("moetrace records Model Runner V2 without data parallelism only "
                                    "(set VLLM_USE_V2_MODEL_RUNNER=0)")
        self.runner = runner
        self.runners = api.target_moe_runners(runner.model)
        if not self.runners:
            raise UnsupportedRunner("the target model has no MoE layers to record")
        # Kernels that fuse routing never call the router: their routing is recomputed from the router logits
        # (settings may ask for that path everywhere, to check it against the wrapped one).
        force = bool(settings.get("recompute_from_logits", False))
        self.entries = [logits_entry(r) if r.is_monolithic or force else None for r in self.runners]
        for entry in self.entries:
            if entry is not None:
                require_fields(entry[0], (entry[1],), "MoE layer")
        infos = [router_info(r) for r in self.runners]
        self.top_k = infos[0].top_k
        self.candidates = int(settings.get("candidates", 0))
        self.token_ids = bool(settings.get("token_ids", True))
        device = next(runner.model.parameters()).device
        self.capture = RoutingCapture(
            int(runner.max_num_tokens), len(infos), self.top_k, self.candidates, device, graph_key=api.graph_key
        )
        self.mechanisms: dict[str, int] = {}  # forwards recorded per capture mechanism
        self.layout = PackedLayout(len(infos), self.top_k, self.candidates, self.token_ids)
        self.packing = PackingColumns(self.token_ids)
        self.sampled_on_host = self.model_runner.sampled_on_host()
        # The step under way: what was scheduled (and the step call's keyword arguments), and how to read which CUDA
        # graph its forward replays (a ForwardPlan read by a function of the graph call's result and arguments)
        self._scheduled: Any = None
        self._step_kwargs: dict[str, Any] | None = None
        self._plan: tuple[Callable[..., ForwardPlan], Any, tuple[Any, ...], dict[str, Any]] | None = None
        self.dp_rank = int(vllm_config.parallel_config.data_parallel_rank)
        manifest = worker_manifest(vllm_config, infos, settings)
        manifest["capture"]["recomputed_from_logits"] = any(entry is not None for entry in self.entries)
        manifest["capture"]["async_scheduling"] = not self.sampled_on_host  # vLLM turns it off for some drafters
        manifest["capture"]["model_runner"] = self.model_runner.name
        self.timing_every = int(settings.get("time_phases_every") or (
            TIMED_STEP_EVERY_ON_CUDA if self.capture.cuda else 1))
        manifest["capture"]["phases_timed_every"] = self.timing_every
        self.ring = SharedRows.create(ring_capacity(self.layout.width, int(runner.max_num_tokens)), self.layout.width)
        self.copier = StepCopier(device, self.ring, int(runner.max_num_tokens))
        manifest["capture"]["host_copy"] = self.copier.path
        self.writer = TraceWriter(
            Path(settings["out"]),
            manifest,
            [i.layer for i in infos],
            self.top_k,
            self.candidates,
            rotate_seconds=float(settings.get("rotate_seconds", 10.0)),
            rows=self.ring,
        )
        self.request_index: dict[str, int] = {}
        self._guarded = Guard(self._stop)
        self.step = 0
        # A recording window under `vllm serve`: close after this many steps or seconds (None: until shutdown).
        self.window_steps: int | None = settings.get("steps")
        self.window_seconds: float | None = settings.get("seconds")
        self._windowed = self.window_steps is not None or self.window_seconds is not None
        self._first_step_at: float | None = None
        self._window_ends = False  # the step under way is the window's last: close once it is queued
        self._close_lock = threading.Lock()
        self._closed: dict[str, Any] | None = None
        self._pending: PendingStep | None = None
        self.own_ns = {"step": 0, "graph": 0, "hand_over": 0, "layout": 0, "sample": 0, "sample_tokens": 0,
                       "phase_timing": 0}
        self.phases = {phase: PhaseTiming(self.capture.cuda) for phase in TIMED_CALLS}
        self._timing_phase = 0.0  # a Weyl sequence: steps timed evenly, never in step with a periodic workload
        self._time_next = False  # whether the next step is timed: decided once a forward is launched
        self._advance_timing()
        self._timing = False  # whether the step under way is timed (its phases and the hooks' own time)
        self._phases_in_flight = False  # whether a timed step's events may not have been read yet
        self._batch = 0  # requests scheduled in the timed step under way
        self._t_start = 0  # when the step under way began (ns since the epoch)
        self._forward_began = 0  # the timed step's start (perf_counter_ns), and the events around its forward
        self._forward_events: tuple[torch.cuda.Event, torch.cuda.Event] | tuple[()] | None = None
        self._roles: dict[str, Callable[..., Any]] = {
            "step": self.step_begins, "sample": self.sample, "sample_tokens": self.sample_tokens,
            "drafting": self.propose_draft_tokens, "capture_model": self.capture_model}
        self._installed: list[tuple[HookPoint, Any]] = []  # each hook, and the instance attribute it replaced
        self._timed_only: list[HookPoint] = []  # hooked only while a timed step is under way
        self.install()

    def install(self) -> None:
        """Wrap the routers and the runner's step calls; installing twice, or after close, changes nothing."""
        if self._closed is not None:
            return
        for slot, (moe, entry) in enumerate(zip(self.runners, self.entries)):
            if entry is None:
                wrap_router(moe.router, slot, self.capture)
            else:
                wrap_logits_entry(entry[0], entry[1], moe.router, slot, self.capture)
        points = self.model_runner.hook_points()
        self._timed_only = [point for point in points if point.timed_only]
        for point in points:
            if not point.timed_only:
                self._hook(point)

    def _hook(self, point: HookPoint) -> None:
        replaced = vars(point.owner).get(point.name)
        if getattr(replaced, _HOOK_MARK, False):
            return
        original = getattr(point.owner, point.name)
        if point.plan is None:
            hook = functools.partial(self._roles[point.role], original)
        else:
            planned = self.forward_planned_at_launch if point.plan_at_launch else self.forward_planned
            hook = functools.partial(planned, original, point.plan)
        setattr(hook, _HOOK_MARK, True)
        setattr(point.owner, point.name, hook)
        self._installed.append((point, replaced))

    def _unhook(self, point: HookPoint, replaced: Any) -> None:
        if replaced is None:
            vars(point.owner).pop(point.name, None)  # the class's method shows through again
        else:
            setattr(point.owner, point.name, replaced)

    def _unhook_timed_only(self) -> None:
        """Remove the hooks installed for the timed step under way (``HookPoint.timed_only``)."""
        for entry in [entry for entry in self._installed if entry[0].timed_only]:
            self._installed.remove(entry)
            self._unhook(*entry)

    def uninstall(self) -> None:
        """Restore the runner and routers as they were; the writer stays open until ``close``."""
        for moe, entry in zip(self.runners, self.entries):
            unwrap_router(moe.router)
            if entry is not None:
                unwrap_logits_entry(entry[0])
        for point, replaced in reversed(self._installed):
            self._unhook(point, replaced)
        self._installed = []
        self._pending = self._forward_events = self._scheduled = self._step_kwargs = self._plan = None
        self.capture.begin_step()  # the last forward's router outputs are not held while unhooked

    def close(self) -> dict[str, Any]:
        """Unhook and close the trace; idempotent, and safe from any thread."""
        with self._close_lock:
            if self._closed is None:
                self.uninstall()
                self.copier.release()
                self._closed = self.writer.close(
                    {"requests": list(self.request_index), "capture_mechanisms": self.mechanisms,
                     "engine_thread_us_per_step": self.engine_thread_us_per_step(),
                     "phases": {phase: timing.summary() for phase, timing in self.phases.items()}})
            return self._closed

    def _window_over(self) -> bool:
        if self._first_step_at is None:
            self._first_step_at = time.monotonic()
        return (self.window_steps is not None and self.step >= self.window_steps) or (
            self.window_seconds is not None and time.monotonic() - self._first_step_at >= self.window_seconds)

    # -- engine-thread hooks: never raise into the engine ------------------------------------------------------

    def step_begins(self, original: Callable[..., Any], scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """A step begins (``HookPoint`` role ``step``): note when, and what was scheduled; forget the last forward's
        routing if its routers ran. Under sync scheduling the GPU idles from vLLM's sync until the forward is
        launched, so nothing else happens here but on timed steps: whether the step is recorded is read once its
        forward is launched."""
        with self._guarded:
            self._t_start = time.monotonic_ns()  # step bounds: CLOCK_MONOTONIC, one clock for a host's processes
            self._scheduled, self._step_kwargs, self._plan = scheduler_output, kwargs, None
            if self.capture.ran:  # outside CUDA graphs the routers' Python ran and kept references to their outputs
                self.capture.begin_step()
            if self._time_next or self._timing:  # a timed step begins, or the last one ended without sampling
                self._begin_timed_step()
        return original(scheduler_output, *args, **kwargs)

    def _begin_timed_step(self) -> None:
        """A timed step begins (``_time_next``): its forward phase is timed from here on, and its drafting hooked, if
        it is a request's step."""
        timed, self._time_next, self._timing = self._time_next, False, False
        if timed and self.writer.failed is None and self._is_recorded():
            self.own_ns["step"] += time.monotonic_ns() - self._t_start
            began = time.perf_counter_ns()
            for point in self._timed_only:
                self._hook(point)
            self._forward_events = self.phases["forward"].start()
            self._forward_began = time.perf_counter_ns()
            self.own_ns["phase_timing"] += self._forward_began - began
            self._timing = True

    def _advance_timing(self) -> None:
        """Decide whether the next step is timed (one in ``timing_every``), once the forward is launched: before it,
        under sync scheduling, the GPU idles."""
        self._timing_phase = (self._timing_phase + GOLDEN_RATIO_CONJUGATE) % 1.0
        self._time_next = self._timing_phase * self.timing_every < 1.0

    def _is_recorded(self) -> bool:
        """Whether the step under way is a request's: V2 runs its dummy batches (profiling, idle DP ranks) through
        execute_model too, and warms its kernels up with batches of requests of its own."""
        scheduled = self._scheduled
        return scheduled is not None and bool(scheduled.total_num_scheduled_tokens) and not (
            self._step_kwargs and self._step_kwargs.get("dummy_run", False)) and not self.model_runner.is_warmup(
                scheduled)

    def forward_planned(self, original: Callable[..., Any], plan: Callable[..., ForwardPlan], *args: Any,
                        **kwargs: Any) -> Any:
        """Note which CUDA graph (if any) the forward replays, and every DP rank's tokens in it: vLLM says so only in
        this call (its arguments, its result, or its forward context), read as it returns."""
        result = original(*args, **kwargs)
        with self._guarded:
            if self.writer.failed is None:
                began = time.perf_counter_ns() if self._timing else 0
                self._plan = (_already_read, plan(result, *args, **kwargs), (), {})
                if self._timing:
                    self.own_ns["graph"] += time.perf_counter_ns() - began
        return result

    def forward_planned_at_launch(self, original: Callable[..., Any], plan: Callable[..., ForwardPlan], *args: Any,
                                  **kwargs: Any) -> Any:
        """As ``forward_planned``, for a plan of the call's result and arguments alone (``HookPoint.plan_at_launch``):
        kept as it is, and read once the forward is launched (until then, under sync scheduling, the GPU idles)."""
        result = original(*args, **kwargs)
        self._plan = (plan, result, args, kwargs)
        return result

    def forward_launched(self) -> None:
        """The GPU runs the step's forward (called as sampling begins, under the caller's guard): hand the last steps
        over, then queue this step's copy."""
        if self._timing and self._forward_events is not None:
            ended = time.perf_counter_ns()
            self._batch = len(self._scheduled.num_scheduled_tokens)
            self.phases["forward"].end(self._batch, self._forward_events, ended - self._forward_began)
            self.own_ns["phase_timing"] += time.perf_counter_ns() - ended
        self._forward_events = None
        began = time.perf_counter_ns() if self._timing else 0
        self.writer.forward_ready()
        if self._phases_in_flight:  # a timed step's events: read once they have completed
            for timing in self.phases.values():
                timing.read_done()
            self._phases_in_flight = any(timing.in_flight for timing in self.phases.values())
        handed = time.perf_counter_ns() if self._timing else 0
        self._pending = None
        plan, self._plan = self._plan, None
        if self.writer.failed is None and self._is_recorded():
            read, result, args, kwargs = plan if plan is not None else (_already_read, (None, None), (), {})
            self._pending = self._layout(*read(result, *args, **kwargs))
            if self._windowed:  # here, not between vLLM's sync and the next launch
                self._window_ends = self._window_over()
        self._scheduled = self._step_kwargs = None
        self._advance_timing()
        if self._timing:
            self.own_ns["hand_over"] += handed - began
            self.own_ns["layout"] += time.perf_counter_ns() - handed

    def capture_model(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Model Runner V2 builds its CUDA-graph manager after load: hook it now, before its graphs are captured."""
        with self._guarded:
            self.install()
            self.model_runner.name_full_graphs(self.capture.name_captured)
        return original(*args, **kwargs)

    def sample(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs inside ``sample_tokens``, while the GPU still runs the forward: notes when the step ended, and with
        async scheduling also counts the tokens each request kept (accepted drafts + 1) on the device, copied
        without blocking."""
        sampled = self._timed("sampling", original, *args, **kwargs)
        with self._guarded:
            began = time.perf_counter_ns() if self._timing else 0
            pending = self._pending
            if pending is not None and self.writer.failed is None:
                if not self.sampled_on_host:
                    pending.kept = to_host(self.model_runner.kept_on_device(sampled)[: len(pending.requests)])
                    pending.copied = copied_event()  # now after both copies
                pending.t_end = time.monotonic_ns()
            if self._timing:
                self.own_ns["sample"] += time.perf_counter_ns() - began
        return sampled

    def propose_draft_tokens(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Hooked for a timed step only (``HookPoint.timed_only``): vLLM's sync has passed, so on other steps the
        drafter is called with no hook between."""
        with self._guarded:
            self._unhook_timed_only()
        return self._timed("drafting", original, *args, **kwargs)

    def _timed(self, phase: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``call``, timed as ``phase`` when the step under way is a timed one (``timing_every``): never
        raises into the engine."""
        if not self._timing:
            return call(*args, **kwargs)
        timing = self.phases[phase]
        began = time.perf_counter_ns()
        events = None
        with self._guarded:
            if self.writer.failed is None:
                events = timing.start()
        called = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            returned = time.perf_counter_ns()
            with self._guarded:
                if events is not None:
                    timing.end(self._batch, events, returned - called)
            self.own_ns["phase_timing"] += called - began + time.perf_counter_ns() - returned

    def sample_tokens(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Called once the step's forward is launched (``forward_launched`` runs first). vLLM has synced by the time
        it returns (sync scheduling), and its output holds each request's sampled tokens on the host: count the kept
        tokens there (the scheduler trims those lists later) and queue the step (handed over once the next forward
        is launched, or by the writer's idle forwarder). The GPU idles from vLLM's sync to the next launch, so
        nothing else is done after it."""
        with self._guarded:
            self.forward_launched()
        output = original(*args, **kwargs)
        with self._guarded:
            began = time.perf_counter_ns() if self._timing else 0
            pending, self._pending = self._pending, None
            if pending is not None and pending.t_end:  # (the writer drops what it is given once recording failed)
                if pending.kept is None:
                    pending.kept = self.model_runner.kept_on_host(output)
                    if pending.kept is None:
                        raise RuntimeError("vLLM's sample_tokens returned no host lists of sampled tokens")
                    pending.t_end = time.monotonic_ns()  # vLLM has synced: the step's GPU work (our copy too) is done
                self.writer.submit(pending)
                if self._window_ends:  # the engine runs on unhooked; the trace is closed beside it
                    self.uninstall()
                    threading.Thread(target=self.close, name="moetrace-close").start()
            if self._timing:
                self.own_ns["sample_tokens"] += time.perf_counter_ns() - began
                self._timing, self._phases_in_flight = False, True
        return output

    def engine_thread_us_per_step(self) -> dict[str, float]:
        """What each hook added to the engine thread, in µs per recorded step (its own work, vLLM's excluded),
        measured on the timed steps."""
        steps = max(self.phases["forward"].calls, 1)
        return {name: round(ns / steps / 1e3, 2) for name, ns in self.own_ns.items()}

    def _stop(self, exc: BaseException | str) -> None:
        reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        log.warning("moetrace: recording stopped, the engine keeps serving (%s)", reason)
        if self.writer.failed is None:
            self.writer.failed = reason
        try:
            self.uninstall()  # the engine runs on exactly as without moetrace
        except Exception as again:
            log.warning("moetrace: unhooking after that failed too (%s: %s)", type(again).__name__, again)

    # -- batch layout ---------------------------------------------------------------------------------------

    def _layout(self, replayed: Hashable | None, tokens_across_dp: list[int] | None) -> PendingStep:
        """Copy what this step's rows need before the runner's arrays are reused by the next step; ``replayed`` names
        the CUDA graph its forward replayed (None: none), ``tokens_across_dp`` every DP rank's tokens (None
        without DP)."""
        if self.capture.failed is not None:
            raise RuntimeError(self.capture.failed)
        inputs = self.model_runner.step_inputs()
        num_tokens = int(inputs.query_start[-1])
        mechanism, routing = self.capture.collect(num_tokens, replayed, tokens_across_dp, self.dp_rank)
        columns = self.packing.columns(replayed if mechanism == "graph" else None, routing, inputs, num_tokens)
        where = self.ring.reserve(columns[0].shape[0])  # a padded forward's padding rows are packed too
        if where is None:
            raise RuntimeError(f"the writer process fell behind the engine: its ring of "
                               f"{SharedRows.nbytes(self.ring.capacity, self.ring.width) >> 20} MiB is full")
        self.copier.copy(columns, where)
        self.mechanisms[mechanism] = self.mechanisms.get(mechanism, 0) + 1
        self.step += 1
        return PendingStep(
            step=self.step - 1,
            t_start=self._t_start,
            requests=np.array([self.request_index.setdefault(r, len(self.request_index)) for r in inputs.req_ids],
                              dtype=np.uint32),
            query_start=inputs.query_start,
            num_prompt_tokens=inputs.num_prompt_tokens,
            drafts=inputs.drafts,
            packed=RingRows(where.offset, num_tokens, where.end),  # padding rows, if any, left out
            layout=self.layout,
        )


class Guard:
    """The one guard around moetrace's own work in every hook (``with recorder._guarded:``): an exception stops
    recording, said in the log and the manifest, and never reaches vLLM (vLLM's own calls run outside it). A plain
    context manager, not a generator: entered several times a step on the engine thread."""

    __slots__ = ("stop",)

    def __init__(self, stop: Callable[[BaseException], None]) -> None:
        self.stop = stop

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None
                 ) -> bool:
        if isinstance(exc, Exception):
            self.stop(exc)
            return True  # swallowed: the engine carries on unhooked
        return False


def _already_read(plan: ForwardPlan) -> ForwardPlan:
    """How a plan read as its call returned is read again once the forward is launched."""
    return plan


# A GPU step of a few ms is timed one in 64: each CUDA event record costs it 35 µs on some hosts (gVisor), three of
# them while the GPU idles; thousands of steps still give each phase's median hundreds of timed calls.
TIMED_STEP_EVERY_ON_CUDA = 64
GOLDEN_RATIO_CONJUGATE = 0.6180339887498949


class PhaseTiming:
    """What one runner call costs per step, per batch size (requests scheduled): host time of the call and, on CUDA,
    the device time between two events recorded around it, read once they have completed (never waited for inside
    a step). Only the recorder's timed steps are timed. Medians: the first calls carry one-off costs (the n-gram
    proposer's JIT compile takes a second)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.calls = 0
        self.host_ms: dict[int, list[float]] = {}
        self.device_ms: dict[int, list[float]] = {}
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
        self.host_ms.setdefault(batch, []).append(host_ns / 1e6)
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
            self.device_ms.setdefault(batch, []).append(first.elapsed_time(last))
            self._free.append((first, last))

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per batch size: calls, and the host and device medians in ms (device: None off CUDA)."""
        self.read_done(wait=True)
        return {
            str(batch): {
                "calls": len(host),
                "host_ms_median": float(np.median(host)),
                "device_ms_median": float(np.median(self.device_ms[batch])) if self.device_ms.get(batch) else None,
            }
            for batch, host in sorted(self.host_ms.items())
        }


def logits_entry(moe: Any) -> tuple[Any, str]:
    """Where a MoE layer hands its router logits on: to the fused kernel (monolithic), else to the router."""
    return (moe.routed_experts, "forward_monolithic") if moe.is_monolithic else (moe.router, "select_experts")


def int32_column(values: torch.Tensor) -> torch.Tensor:
    """Non-negative values below 2**31 [T] as an int32 column [T, 1]: a view where they are int32 or int64 (its low
    words: little-endian), so packing positions costs no kernel."""
    if values.dtype == torch.int64 and values.is_contiguous():
        return values.view(torch.int32).view(-1, 2)[:, :1]
    return values.to(torch.int32).unsqueeze(1)


class PackingColumns:
    """Which columns a step is packed from, side by side, [N, w] each with the step's T rows first: routing,
    positions, token ids (one int32 block, floats by their bits, so one kernel brings the whole step to the host).
    Where a CUDA graph padded the forward (N > T), the padding rows are packed too and dropped from the host block:
    slicing every column would cost µs per view (some hosts take 3-4 µs a tensor view). A CUDA graph's list is made
    once and reused while the capture hands out the same columns and the runner the same buffers (Model Runner
    V1's persistent ones); otherwise each step gets a list of its own (the capture's may be one it keeps)."""

    def __init__(self, token_ids: bool) -> None:
        self.token_ids = token_ids
        self._kept: dict[Hashable, tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}

    def columns(self, graph: Hashable | None, routing: list[torch.Tensor], inputs: StepInputs, num_tokens: int
                ) -> list[torch.Tensor]:
        """The columns of a step whose routing the capture collected (``routing``, [N, w] each), ``graph`` the CUDA
        graph whose columns they are (None: the forward replayed none, or its routing was not the graph's)."""
        kept = self._kept.get(graph) if graph is not None else None
        if kept is not None and kept[0] is routing and kept[1] is inputs.positions and kept[2] is inputs.input_ids:
            columns = kept[3]
        else:
            rows = routing[0].shape[0]
            padded = routing
            if min(inputs.positions.shape[0], inputs.input_ids.shape[0]) < rows:  # the runner's arrays hold T rows
                padded, rows = [column[:num_tokens] for column in routing], num_tokens
            columns = [*padded, int32_column(inputs.positions[:rows])]
            if self.token_ids:
                columns.append(int32_column(inputs.input_ids[:rows]))
            if graph is not None and padded is routing:  # a list cut to this step's tokens is this step's only
                self._kept[graph] = (routing, inputs.positions, inputs.input_ids, columns)
        if columns[0].shape[0] < num_tokens:
            raise RuntimeError(f"the routers saw {columns[0].shape[0]} rows for the step's {num_tokens} tokens")
        return columns


class StepCopier:
    """Brings each step's columns to the host as one int32 block [T, W], written where the recorder reserved rows
    for it in the ring shared with the writer process (``SharedRows``), without blocking, in as few CUDA calls as
    can be: each one costs the engine thread tens of µs on some hosts (gVisor), paid in full by steps whose host
    work outlasts the GPU's (prefills, PIECEWISE graphs). On CUDA the ring is registered as pinned memory once, at
    load, and, where the GPU can address it at the host's own address (unified addressing), the columns are packed
    (one ``torch.cat``) straight into it: the GPU writes across the bus, one kernel, no copy. Else packed into a
    device buffer allocated once and copied into the ring (``device-copy``), or, where the ring could not be
    registered, copied with a wait (``pageable-copy``: correct, but a host sync per step). Everything runs on vLLM's
    own stream, right after the forward: stream order keeps a later step from overwriting what the pack reads (the
    runner's input buffers, a CUDA graph's outputs, router outputs once freed), and vLLM's own sync after sampling
    covers it (with async scheduling an event after it says when the step is ready). (A stream of its own, with
    events to order it, spared the GPU about 4 µs per step but cost the engine thread about three times the host
    time, measured on an H200.)"""

    def __init__(self, device: torch.device, ring: SharedRows, max_rows: int) -> None:
        self._host = torch.from_numpy(ring.rows)  # [capacity, W] in the memory both processes map
        self._block: torch.Tensor | None = None  # the device buffer packed into before a copy
        self._mapped: torch.Tensor | None = None  # the ring as a CUDA tensor, written by the pack itself
        self._registered = False
        if device.type != "cuda":
            return
        self._registered = register_pinned(self._host)
        self._mapped = mapped_on_device(self._host, device) if self._registered else None
        if self._mapped is None:
            self._block = torch.empty((max_rows, ring.width), dtype=torch.int32, device=device)

    @property
    def path(self) -> str:
        """How steps reach the ring: ``mapped`` (packed straight into it), ``device-copy`` (packed on the device,
        then copied without a wait), ``pageable-copy`` (copied with a wait) or ``host`` (no GPU)."""
        if self._mapped is not None:
            return "mapped"
        return "host" if self._block is None else "device-copy" if self._registered else "pageable-copy"

    def copy(self, columns: list[torch.Tensor], where: RingRows) -> None:
        """``columns`` [N, w_i] side by side into the ring's rows from ``where.offset`` (N rows reserved there)."""
        rows = columns[0].shape[0]
        if self._mapped is not None:
            torch.cat(columns, dim=1, out=self._mapped[where.offset : where.offset + rows])
        elif self._block is None:
            torch.cat(columns, dim=1, out=self._host[where.offset : where.offset + rows])
        else:
            packed = torch.cat(columns, dim=1, out=self._block[:rows])
            self._host[where.offset : where.offset + rows].copy_(packed, non_blocking=self._registered)

    def release(self) -> None:
        """Unregister the ring (once no step can still be written into it): pinned memory is the host's to keep."""
        if self._registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())  # type: ignore[no-untyped-call]
            self._registered = False
        self._mapped = self._block = None


def register_pinned(host: torch.Tensor) -> bool:
    """Page-lock ``host``'s memory for the GPU (``cudaHostRegister``); False where the driver refuses."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    error = cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
    return bool(error == cudart.cudaError.success)


class _CudaArray:
    """A pinned host tensor's memory described as device memory (``__cuda_array_interface__``): under unified
    addressing a pinned host pointer is also a device pointer."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # the view made from this keeps it, and so the memory, alive
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i4", "version": 2,
                                         "data": (host.data_ptr(), False), "strides": None}


def device_pointer(host_pointer: int) -> int | None:
    """Where the GPU addresses registered host memory (the driver's ``cuMemHostGetDevicePointer``), None where
    the driver cannot be asked."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        pointer = ctypes.c_uint64()
        status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(host_pointer), 0)
    except (OSError, AttributeError):
        return None
    return int(pointer.value) if status == 0 else None


def mapped_on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``host`` (registered pinned memory, int32) as a CUDA tensor over the same memory, or None where that is not
    possible here: the GPU must address it at the host's own address (a kernel writing through another address
    would break the CUDA context, so that is asked of the driver first), then checked once, at load, by a kernel
    writing a row and the host reading it back."""
    if torch.version.cuda is None or device_pointer(host.data_ptr()) != host.data_ptr():
        return None
    try:
        mapped = torch.as_tensor(_CudaArray(host), device=device)
        if mapped.data_ptr() != host.data_ptr() or not mapped.is_cuda:
            return None
        row = torch.arange(1, host.shape[1] + 1, dtype=torch.int32, device=device).unsqueeze(0)
        torch.cat([row[:, :1], row[:, 1:]], dim=1, out=mapped[:1])
        torch.cuda.synchronize(device)
        return mapped if torch.equal(host[:1], row.cpu()) else None
    except (RuntimeError, TypeError, ValueError):
        return None


def copied_event() -> torch.cuda.Event:
    """Recorded after a step's device-to-host copies: done once they have landed (no timing: cheaper)."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in fresh pinned host memory, without blocking (PyTorch's caching host allocator
    reuses a block only once the copy into it has completed); host tensors are returned as they are."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass
class PendingStep:
    """One step as the engine thread left it: host arrays copied, device copies in flight. Under async scheduling
    it is ready once the event recorded after the last copy has completed; without an event (sync scheduling, and
    the CPU) it is submitted only once vLLM's ``sample_tokens`` has returned host lists, that is after vLLM synced
    the stream that the copies were queued on."""

    step: int
    t_start: int
    requests: npt.NDArray[np.uint32]  # [R]
    query_start: npt.NDArray[np.int64]  # [R + 1]
    num_prompt_tokens: npt.NDArray[np.int64]  # [R]
    drafts: npt.NDArray[np.int64]  # [R]
    packed: RingRows  # where its [T, W] int32 block (see PackedLayout) lands in the ring shared with the writer
    layout: PackedLayout
    copied: torch.cuda.Event | None = None
    kept: torch.Tensor | list[int] | None = None  # [R] accepted drafts + 1 (host lists, or a copy in flight)
    t_end: int = 0

    def is_ready(self) -> bool:
        return self.copied is None or bool(self.copied.query())  # type: ignore[no-untyped-call]

    def ready(self) -> StepRecord:
        assert self.kept is not None
        if self.copied is not None:
            self.copied.synchronize()
        return StepRecord(self.step, self.t_start, self.t_end, self.requests, self.query_start, self.num_prompt_tokens,
                          self.drafts, np.asarray(self.kept, dtype=np.int64), self.packed, self.layout)
