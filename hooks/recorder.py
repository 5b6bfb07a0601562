"""Per-worker recorder: binds the routing buffers to the target model and turns each engine step into rows.

# T tokens in the step, R requests in the step, L recorded MoE layers, K top-k, d_i drafts of request i

Both of vLLM's model runners are recorded (``vllm_api.RunnerV1`` and ``RunnerV2`` say which calls are wrapped and
where a step's input batch lives): a step begins, a call says which CUDA graph its forward replays, the forward runs,
``sample_tokens`` runs the rejection sampler, and the drafter runs after both; each is timed on the timed steps
(``timing.StepTimer``). Under sync scheduling the GPU idles from vLLM's sync after sampling until the next forward
is launched, so whatever a hook does there slows every step: before the launch the hooks only note the step, after
vLLM's sync they count the host lists of sampled tokens and queue the step. The rest happens once the forward is
launched, as ``sample_tokens`` begins: what lives on the host is copied (the runner reuses those arrays); what lives
on the device (routing rows, positions, token ids) is packed into one block that the GPU writes, without blocking,
on vLLM's stream, into a ring of pinned rows the writer process maps too (``transfer.StepCopier``), so vLLM's own
sync covers it. Once a later step's forward is launched, steps are handed to the writer process together (one
pickle, one pipe write), which assembles and encodes their rows: recording adds no host sync to a step, and the
engine thread never touches the routing rows. docs/capture.md tells the design in full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, cast

from moetrace.hooks.capture import RoutingCapture, logits_entries, router_info, unwrap_layers, wrap_layers
from moetrace.hooks.hookset import Guard, HookSet
from moetrace.hooks.manifest import worker_manifest
from moetrace.hooks.options import RecordingOptions, UnsupportedRunner
from moetrace.hooks.partitioning import Partitions, StopAfter
from moetrace.hooks.planned import PlannedStep
from moetrace.hooks.requests import RequestBook
from moetrace.hooks.rerouting import EngineFacts, Rerouting, budget_sizes
from moetrace.hooks.sampling import StepBursts
from moetrace.hooks.vllm_api import ForwardPlan, RunnerV1, RunnerV2, WorkerApi
from moetrace.hooks.rows import PackedLayout
from moetrace.hooks.timing import TIMED_STEP_EVERY_ON_CUDA, StepTimer
from moetrace.hooks.transfer import PackingColumns, PendingStep, StepCopier, copied_event, to_host
from moetrace.writer.metrics import MetricsState
from moetrace.writer.ring import RingRows, SharedRows, ring_capacity
from moetrace.writer.process import TraceWriter

log = logging.getLogger("moetrace")
# How often the writer process is told the manifest sections the recorder adds at close: a trace whose engine was
# killed is closed by its writer process, with the sections it was told last.
SECTIONS_EVERY_NS = 10_000_000_000


class Recorder:
    """Records one worker's target-model routing into one trace directory."""

    def __init__(self, api: WorkerApi, runner: Any, vllm_config: Any, options: RecordingOptions) -> None:
        self.model_runner = api.model_runner(runner)
        if self.model_runner.name == "v2" and int(vllm_config.parallel_config.data_parallel_size) > 1:
            raise UnsupportedRunner("moetrace records Model Runner V2 without data parallelism only "
                                    "(Model Runner V1 records it: VLLM_USE_V2_MODEL_RUNNER=0, vLLM 0.33 and earlier)")
        self.runner = runner
        self.requests = RequestBook()
        self.runners = api.target_moe_runners(runner.model)
        if not self.runners:
            raise UnsupportedRunner("the target model has no MoE layers to record")
        self.entries = logits_entries(self.runners, options.recompute_from_logits)
        infos = [router_info(r) for r in self.runners]
        self.top_k, self.candidates, self.token_ids = infos[0].top_k, options.candidates, options.token_ids
        device = self.device = next(runner.model.parameters()).device
        self.capture = RoutingCapture(
            int(runner.max_num_tokens), len(infos), self.top_k, self.candidates, device, graph_key=api.graph_key
        )
        parallel = vllm_config.parallel_config
        self.options, self._vllm_config, self._infos = options, vllm_config, infos
        # always on under `vllm serve`: a complete trace per period under one root (``hooks.partitioning``)
        self.partitions = None if options.partition_seconds is None else Partitions(options)
        if self.partitions is not None:
            options = self.partitions.options_for(options)
        # sampled: request steps outside the bursts run unrecorded (``hooks.sampling``); across partitions
        self.bursts = None if options.sample_steps is None else StepBursts(
            options.sample_steps, float(options.sample_every_seconds or 0.0))
        self._sampled = True  # whether the step under way is in a burst
        rerouted = options.budget is not None or options.replay_routing is not None
        self.rerouting = None if not rerouted else Rerouting(options, EngineFacts(
            [moe.router for moe in self.runners], infos, int(runner.max_num_tokens), int(runner.max_num_reqs),
            self.model_runner.positions(), (int(parallel.data_parallel_size), int(parallel.tensor_parallel_size)),
            any(entry is not None for entry in self.entries), device, vllm_config.model_config.dtype))
        self.layout = PackedLayout(len(infos), self.top_k, self.candidates, self.token_ids)
        self.packing = PackingColumns(self.token_ids)
        self.sampled_on_host = self.model_runner.sampled_on_host()
        # The step under way: what was scheduled (and the step call's keyword arguments), and how to read which CUDA
        # graph its forward replays (a ForwardPlan read by a function of the graph call's result and arguments)
        self._scheduled: Any = None
        self._step_kwargs: dict[str, Any] | None = None
        self._plan: tuple[Callable[..., ForwardPlan], Any, tuple[Any, ...], dict[str, Any]] | None = None
        self.dp_rank = int(parallel.data_parallel_rank)
        self._close_lock = threading.Lock()
        # the live metrics' values, kept from one trace to the next (partitions, bursts): each writer process maps it
        self._metrics_state: MetricsState | None = None
        self._open_trace(options)
        if self.partitions is not None:
            self.partitions.watch_cap(lambda: self._closed is None)
        self._guarded = Guard(self._stop)
        self.hooks = HookSet({
            "step": self.step_begins, "sample": self.sample, "sample_tokens": self.sample_tokens,
            "drafting": self.propose_draft_tokens, "capture_model": self.capture_model, "plan": self.inputs_prepared,
            "planned": self.forward_planned, "planned_at_launch": self.forward_planned_at_launch})
        self.install()

    def _open_trace(self, options: RecordingOptions, launch_beside: bool = False) -> None:
        """Start the trace ``options`` names (its directory, run id, workload, budget) and its step state;
        ``launch_beside``: its writer process starts beside the engine thread (``TraceWriter``)."""
        self.options = options
        self.mechanisms: dict[str, int] = {}  # forwards recorded per capture mechanism
        self.timer = StepTimer(self.capture.cuda, int(options.time_phases_every or (
            TIMED_STEP_EVERY_ON_CUDA if self.capture.cuda else 1)))
        sizes = budget_sizes(options, self._infos)
        if self.rerouting is not None:
            self.rerouting.restart(sizes)
        self.ring = SharedRows.create(ring_capacity(self.layout.width, int(self.runner.max_num_tokens)),
                                      self.layout.width)
        self.copier = StepCopier(self.device, self.ring, int(self.runner.max_num_tokens))
        manifest = worker_manifest(self._vllm_config, self._infos, options, sizes, capture={
            "model_runner": self.model_runner.name,
            "recomputed_from_logits": any(entry is not None for entry in self.entries),
            "async_scheduling": not self.sampled_on_host,  # vLLM turns it off for some drafters
            "phases_timed_every": self.timer.every,
            "host_copy": self.copier.path})
        if options.metrics_port is not None and self._metrics_state is None:  # one for every trace it records into
            self._metrics_state = MetricsState.create(len(self._infos), self._infos[0].num_experts,
                                                      int(manifest["spec"]["k"]))
        self.writer = TraceWriter(
            Path(options.out), manifest, [i.layer for i in self._infos], self.top_k, self.candidates,
            rotate_seconds=float(options.rotate_seconds), rows=self.ring, metrics_state=self._metrics_state,
            metrics_port=None if options.metrics_port is None else options.metrics_port + self.dp_rank,
            launch_beside=launch_beside)
        self.requests.restart()
        self.step = 0
        # under `vllm serve`: close after this many steps or seconds (None: at shutdown)
        self.stop_after = None if options.steps is None and options.seconds is None else StopAfter(
            options.steps, options.seconds)
        self._last_step = False  # the step under way is the last (``stop_after``): close once it is queued
        self._partition_ends = False  # the partition's period is over: the next step starts the next partition
        self._sections_due_ns = 0  # when the writer process is next told the closing sections (its first step)
        self._closed: dict[str, Any] | None = None
        self._pending: PendingStep | None = None
        self._t_start = 0  # when the step under way began (ns since the epoch)

    def next_trace(self, options: RecordingOptions) -> dict[str, Any]:
        """Close this trace and go on recording into the one ``options`` names, with its budget, between steps (the
        driver's ``moetrace_next_trace``): the hooks, CUDA graphs and any replay stay as they are, so one engine
        records a sweep of budgets. Returns the closed trace's manifest; ``ValueError`` for options only a new
        engine could take."""
        changed = self.options.engine_changes(options)
        if changed:
            raise ValueError(f"a new trace keeps the engine's {', '.join(changed)}: only a new engine changes them")
        if options.budget is not None and (self.rerouting is None or self.rerouting.budgets is None):
            raise ValueError("a budget needs an engine that started with one (its CUDA graphs hold the budget's work)")
        budget_sizes(options, self._infos)  # a budget this model cannot take: refused before the trace under way closes
        with self._close_lock:
            if self._closed is not None:
                raise ValueError("the recording is closed")
            closed = self._close_trace()
            self._open_trace(options)
        return closed

    def install(self) -> None:
        """Wrap the routers and the runner's step calls; installing twice, or after close, changes nothing."""
        if self._closed is not None:
            return
        rerouting = self.rerouting
        wrap_layers(self.runners, self.entries, self.capture, None if rerouting is None else rerouting.of_layer)
        points = self.model_runner.hook_points()
        if self.rerouting is not None:
            points += self.model_runner.plan_points()
        self.hooks.install(points)

    def uninstall(self) -> None:
        """Restore the runner and routers as they were; the writer stays open until ``close``."""
        unwrap_layers(self.runners, self.entries)
        self.hooks.uninstall()
        self.timer.forget_forward()
        self._pending = self._scheduled = self._step_kwargs = self._plan = None
        self.capture.begin_step()  # the last forward's router outputs are not held while unhooked

    def close(self) -> dict[str, Any]:
        """Unhook and close the trace, once every partition still closing has closed; idempotent, and safe from any
        thread."""
        with self._close_lock:
            if self._closed is None:
                self.uninstall()
                self._closed = self._close_trace()
        if self.partitions is not None:
            self.partitions.join()
        with self._close_lock:  # every writer process has mapped it by now (each close joined its launch)
            if self._metrics_state is not None:
                self._metrics_state.close()
                self._metrics_state = None
        return self._closed

    def _close_trace(self) -> dict[str, Any]:
        """Close the trace under way (the hooks stay as they are) and return its manifest."""
        self.copier.release()
        return self.writer.close(self._closing_sections())

    def _closing_sections(self, final: bool = True) -> dict[str, Any]:
        """What the recorder adds to the manifest of the trace under way at its close (``final``), or so far (the
        device times of calls still in flight not waited for)."""
        sections: dict[str, Any] = {
            "capture_mechanisms": dict(self.mechanisms),
            "engine_thread_us_per_step": self.timer.us_per_step(),
            "phases": self.timer.manifest_phases(final)}
        if self.partitions is not None and self.partitions.switch_ms is not None:
            sections["partition"] = {"switch_ms": round(self.partitions.switch_ms, 3)}
        return sections

    def _next_partition(self) -> None:
        """Record on into the next partition, between steps, while this one closes on a thread of its own
        (``Partitions.close_beside``) and the new one's writer process starts on another: the engine thread waits
        for neither."""
        assert self.partitions is not None
        began = time.perf_counter()
        with self._close_lock:
            if self._closed is not None:
                return
            self.copier.release()
            writer, sections = self.writer, self._closing_sections()
            self._open_trace(self.partitions.options_for(self.options), launch_beside=True)
            self.partitions.close_beside(writer, sections)
            self.partitions.switch_ms = (time.perf_counter() - began) * 1e3
            # told now, not at its first forward: a switch on a step without one (nothing scheduled) may open the
            # last partition, which the writer process closes alone when `vllm serve` kills the engine
            self.writer.note_sections(self._closing_sections(final=False))

    def _stop_beside_the_engine(self) -> None:
        """Unhook now, on the engine thread, and close the trace on a thread of its own: the engine runs on."""
        self.uninstall()
        threading.Thread(target=self.close, name="moetrace-close").start()

    # -- engine-thread hooks: never raise into the engine ------------------------------------------------------

    def step_begins(self, original: Callable[..., Any], scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """A step begins (``HookPoint`` role ``step``): note when, and what was scheduled; forget the last forward's
        routing if its routers ran. Under sync scheduling the GPU idles from vLLM's sync until the forward is
        launched, so nothing else happens here but on timed steps: whether the step is recorded is read once its
        forward is launched."""
        with self._guarded:
            if self._partition_ends and self._pending is None:  # every step so far handed over, none launched
                self._next_partition()
            self._t_start = time.monotonic_ns()  # step bounds: CLOCK_MONOTONIC, one clock for a host's processes
            self._scheduled, self._step_kwargs, self._plan = scheduler_output, kwargs, None
            if self.bursts is not None:
                self._sampled = self._is_request_step() and self.bursts.admits(time.monotonic())
            self.requests.scheduled(scheduler_output)
            if self.capture.ran:  # outside CUDA graphs the routers' Python ran and kept references to their outputs
                self.capture.begin_step()
            if self.timer.next or self.timer.on:  # a timed step begins, or the last one ended without sampling
                self._begin_timed_step()
        return original(scheduler_output, *args, **kwargs)

    def _begin_timed_step(self) -> None:
        """A timed step begins (``StepTimer.next``): its forward phase is timed from here on, and its drafting
        hooked, if it is a request's step."""
        timer = self.timer
        timed, timer.next, timer.on = timer.next, False, False
        if timed and self.writer.failed is None and self._is_recorded():
            timer.own_ns["step"] += time.monotonic_ns() - self._t_start
            began = time.perf_counter_ns()
            self.hooks.hook_timed_only()
            timer.start_forward()
            timer.own_ns["phase_timing"] += time.perf_counter_ns() - began

    def _is_recorded(self) -> bool:
        """Whether the step under way is recorded: a request's step, in a sampled burst if sampled."""
        return self._sampled and self._is_request_step()

    def _is_request_step(self) -> bool:
        """Whether the step under way is a request's: V2 runs its dummy steps (profiling, idle DP ranks) through
        execute_model too, and warms its kernels up with steps of requests of its own."""
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
                began = time.perf_counter_ns() if self.timer.on else 0
                self._plan = (_already_read, plan(result, *args, **kwargs), (), {})
                if self.timer.on:
                    self.timer.own_ns["graph"] += time.perf_counter_ns() - began
        return result

    def forward_planned_at_launch(self, original: Callable[..., Any], plan: Callable[..., ForwardPlan], *args: Any,
                                  **kwargs: Any) -> Any:
        """As ``forward_planned``, for a plan of the call's result and arguments alone (``HookPoint.plan_at_launch``):
        kept as it is, and read once the forward is launched (until then, under sync scheduling, the GPU idles)."""
        result = original(*args, **kwargs)
        self._plan = (plan, result, args, kwargs)
        if self.rerouting is not None:  # planned per token before the forward
            with self._guarded:
                runner = cast(RunnerV1, self.model_runner)  # V1's graph hook (V2 plans in ``inputs_prepared``)
                self._plan_tokens(runner.planned_step(self._scheduled, kwargs.get("num_tokens")))
        return result

    def inputs_prepared(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Model Runner V2 has laid the step's input batch out (``HookPoint`` role ``plan``, hooked under a budget or a
        replay): plan its tokens before the forward."""
        input_batch = original(*args, **kwargs)
        with self._guarded:
            self._plan_tokens(cast(RunnerV2, self.model_runner).planned_step(input_batch))
        return input_batch

    def _plan_tokens(self, step: PlannedStep | None) -> None:
        """Plan the next forward's rerouting (``Rerouting.plan``); None: no request's step."""
        assert self.rerouting is not None
        self.rerouting.plan(step, () if self._scheduled is None else self._scheduled.finished_req_ids)

    def forward_launched(self) -> None:
        """The GPU runs the step's forward (called as sampling begins, under the caller's guard): hand the last steps
        over, then queue this step's copy."""
        timer = self.timer
        timer.end_forward(len(self._scheduled.num_scheduled_tokens) if timer.on and self._scheduled is not None else 0)
        began = time.perf_counter_ns() if timer.on else 0
        self.writer.forward_ready()
        if self._t_start >= self._sections_due_ns:
            self._sections_due_ns = self._t_start + SECTIONS_EVERY_NS
            self.writer.note_sections(self._closing_sections(final=False))
        handed = time.perf_counter_ns() if timer.on else 0
        self._pending = None
        plan, self._plan = self._plan, None
        if self.writer.failed is None and self._is_recorded():
            read, result, args, kwargs = plan if plan is not None else (_already_read, (None, None), (), {})
            self._pending = self._layout(*read(result, *args, **kwargs))
            if self.stop_after is not None:  # here, not between vLLM's sync and the next launch
                self._last_step = self.stop_after.reached(self.step)
        self._scheduled = self._step_kwargs = None
        timer.advance()
        if timer.on:
            timer.own_ns["hand_over"] += handed - began
            timer.own_ns["layout"] += time.perf_counter_ns() - handed

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
        sampled = original(*args, **kwargs) if not self.timer.on else self.timer.timed(  # (untimed: nothing more)
            "sampling", self._guarded, self.writer.failed is None, original, *args, **kwargs)
        with self._guarded:
            began = time.perf_counter_ns() if self.timer.on else 0
            pending = self._pending
            if pending is not None and self.writer.failed is None:
                if not self.sampled_on_host:
                    pending.kept = to_host(self.model_runner.kept_on_device(sampled)[: len(pending.requests)])
                    pending.copied = copied_event()  # now after both copies
                pending.t_end = time.monotonic_ns()
            if self.timer.on:
                self.timer.own_ns["sample"] += time.perf_counter_ns() - began
        return sampled

    def propose_draft_tokens(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Hooked for a timed step only (``HookPoint.timed_only``): vLLM's sync has passed, so on other steps the
        drafter is called with no hook between."""
        with self._guarded:
            self.hooks.unhook_timed_only()
        return self.timer.timed("drafting", self._guarded, self.writer.failed is None, original, *args, **kwargs)

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
            began = time.perf_counter_ns() if self.timer.on else 0
            pending, self._pending = self._pending, None
            if pending is not None and pending.t_end:  # (the writer drops what it is given once recording failed)
                if pending.kept is None:
                    pending.kept = self.model_runner.kept_on_host(output)
                    if pending.kept is None:
                        raise RuntimeError("vLLM's sample_tokens returned no host lists of sampled tokens")
                    pending.t_end = time.monotonic_ns()  # vLLM has synced: the step's GPU work (our copy too) is done
                self.writer.submit(pending)
                if self._last_step or (self.partitions is not None and self.partitions.stop_at_cap.is_set()):
                    self._stop_beside_the_engine()
                elif self.partitions is not None and self.partitions.due():
                    self._partition_ends = True  # switched at the next step's start, once nothing is in flight
            if self.timer.on:
                self.timer.own_ns["sample_tokens"] += time.perf_counter_ns() - began
                self.timer.end_step()
        return output

    def _stop(self, exc: BaseException | str) -> None:
        reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        log.warning("moetrace: recording stopped, the engine keeps serving (%s)", reason)
        if self.writer.failed is None:
            self.writer.failed = reason
        try:
            self.uninstall()  # the engine runs on exactly as without moetrace
        except Exception as again:
            log.warning("moetrace: unhooking after that failed too (%s: %s)", type(again).__name__, again)

    # -- step layout ----------------------------------------------------------------------------------------

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
        requests, sequence_limit, new = self.requests.of_step(inputs.req_ids)
        return PendingStep(
            step=self.step - 1, t_start=self._t_start, requests=requests, sequence_limit=sequence_limit,
            new_requests=new, query_start=inputs.query_start, num_prompt_tokens=inputs.num_prompt_tokens,
            drafts=inputs.drafts, layout=self.layout,
            packed=RingRows(where.offset, num_tokens, where.end))  # padding rows, if any, left out


def _already_read(plan: ForwardPlan) -> ForwardPlan:
    """How a plan read as its call returned is read again once the forward is launched."""
    return plan

