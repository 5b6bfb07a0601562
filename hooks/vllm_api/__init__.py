"""Every vLLM internal moetrace touches, in one package, resolved once when recording starts.

vLLM's worker internals (runner classes and their fields, the MoE runner and router, the forward context) change
between releases. Nothing else in moetrace imports them: it asks this package, which resolves each symbol when a
worker starts recording and, where one is missing, says in one line which symbol, which vLLM was found and which
releases are supported (``resolve``: ``SUPPORTED``, ``TESTED``: 0.26 on an H200, 0.32's CPU build, 0.34 on an H100).

Two model runners (``runners``): V1 (``vllm.v1.worker.gpu_model_runner``, and the CPU runner that subclasses it;
removed in 0.34) and V2 (``vllm.v1.worker.gpu.model_runner``, vLLM's default on GPUs from 0.3x, and the CPU runner
that subclasses it). ``RunnerV1`` and ``RunnerV2`` say, for each, which calls the recorder wraps (``HookPoint``) and
where a step's layout lives (``StepInputs``).

``CONTRACT`` lists every internal as data: ``tools/vllm_contract.py`` checks it against the sources of each release
in ``CHECKED`` (docs/vllm-releases.md), and ``REFUSED`` names, per release and runner, what that check found gone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cache
from typing import Any

from moetrace.hooks.vllm_api.resolve import (SUPPORTED, TESTED, CHECKED, RUNNER_FIELDS, INPUT_BATCH_FIELDS,
                                             RUNNER_V2_FIELDS, INPUT_BATCH_V2_FIELDS, GRAPH_MANAGER_V2_FIELDS,
                                             PLANNING_V2_FIELDS, WARMUP_PATH, WARMUP_REQUEST_PREFIXES,
                                             SCHEDULER_OUTPUT_FIELDS, NEW_REQUEST_FIELDS, ROUTER_FIELDS,
                                             MOE_RUNNER_FIELDS, RUNNER_V1_PATH, CPU_RUNNER_V1_PATH, RUNNER_V2_PATH,
                                             CPU_RUNNER_V2_PATH, SCHEDULER_OUTPUT_PATH, MOE_RUNNER_PATH,
                                             CUDAGRAPH_MODE_PATH, GET_FORWARD_CONTEXT_PATH,
                                             FORWARD_CONTEXT_AVAILABLE_PATH, TP_RANK_PATH, PP_GROUP_PATH,
                                             WORKER_PATH, ENGINE_ARGS_PATH, PLATFORM_PATH, REFUSED, VllmApiError,
                                             vllm_version, supported, missing, release_of, unchecked, refuse_gone,
                                             symbol, first_symbol, EXPERT_MAP_PATHS, expert_placement,
                                             EPLB_POLICY_PATH, EPLB_LOGICAL_MAPS_PATH, eplb_placement,
                                             sequence_limits, require_fields)
from moetrace.hooks.vllm_api.runners import (ForwardPlan, HookPoint, StepInputs, RunnerV1, RunnerV2,
                                             GraphsNamingCaptures)

__all__ = ["SUPPORTED", "TESTED", "CHECKED", "RUNNER_FIELDS", "INPUT_BATCH_FIELDS", "RUNNER_V2_FIELDS",
           "INPUT_BATCH_V2_FIELDS", "GRAPH_MANAGER_V2_FIELDS", "PLANNING_V2_FIELDS", "WARMUP_PATH",
           "WARMUP_REQUEST_PREFIXES", "SCHEDULER_OUTPUT_FIELDS", "NEW_REQUEST_FIELDS", "ROUTER_FIELDS",
           "MOE_RUNNER_FIELDS", "RUNNER_V1_PATH", "CPU_RUNNER_V1_PATH", "RUNNER_V2_PATH", "CPU_RUNNER_V2_PATH",
           "SCHEDULER_OUTPUT_PATH", "MOE_RUNNER_PATH", "CUDAGRAPH_MODE_PATH", "GET_FORWARD_CONTEXT_PATH",
           "FORWARD_CONTEXT_AVAILABLE_PATH", "TP_RANK_PATH", "PP_GROUP_PATH", "WORKER_PATH", "ENGINE_ARGS_PATH",
           "PLATFORM_PATH", "REFUSED", "VllmApiError", "vllm_version", "supported", "missing", "release_of",
           "unchecked", "refuse_gone", "symbol", "first_symbol", "EXPERT_MAP_PATHS", "expert_placement",
           "EPLB_POLICY_PATH", "EPLB_LOGICAL_MAPS_PATH", "eplb_placement", "sequence_limits", "require_fields",
           "ForwardPlan", "HookPoint", "StepInputs", "RunnerV1", "RunnerV2", "GraphsNamingCaptures", "WorkerApi",
           "worker_api", "worker_class", "engine_arg_exists", "on_cuda", "Reads", "CONTRACT", "KIMI_K3_RELEASES",
           "KIMI_K3_CONTRACT"]

log = logging.getLogger("moetrace")


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
    (``tools/vllm_contract.py``): the class or symbol at the first of ``paths`` a release has (one that moved keeps
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

# Kimi-K3 as the releases of ``KIMI_K3_RELEASES`` serve it (``vllm/models/kimi_k3/``), checked apart from CONTRACT
# (older releases have no K3): its latent-MoE runner subclasses the MoE runner (the recorder finds its layers so)
# and routes through the grouped top-k router the capture wraps (unless ``moe_backend=deep_gemm_mega_moe``, where
# the model routes before the runner: SM100 only); the config keys the manifest reads; the speculative options the
# manifest reads (synthetic acceptance, DSpark's adaptive verification); its MTP and DSpark drafters.
KIMI_K3_RELEASES = ("0.34",)
KIMI_K3_CONTRACT = (
    Reads("kimi_k3", ("vllm.models.kimi_k3.nvidia.latent_moe_runner.LatentMoERunner",), MOE_RUNNER_FIELDS),
    Reads("kimi_k3", ("vllm.model_executor.layers.fused_moe.router.grouped_topk_router.GroupedTopKRouter",),
          ROUTER_FIELDS),
    Reads("kimi_k3", ("vllm.transformers_utils.configs.kimi_linear.KimiLinearConfig",),
          ("num_experts", "num_experts_per_token", "num_shared_experts", "routed_expert_hidden_size",
           "moe_intermediate_size", "linear_attn_config")),
    Reads("kimi_k3", ("vllm.config.speculative.SpeculativeConfig",),
          ("num_speculative_tokens", "rejection_sample_method", "synthetic_acceptance_rates",
           "enable_adaptive_verification")),
    Reads("kimi_k3", ("vllm.models.kimi_k3.nvidia.mtp.KimiK3MTP",)),
    Reads("kimi_k3", ("vllm.models.kimi_k3.nvidia.dspark_mla.K3DSparkForCausalLM",)),
)
