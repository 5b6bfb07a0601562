"""On the GPU host, with env.sh sourced and both streams unpacked (setup.sh run): does vLLM 0.34 import and find its
GPU kernels on torch 2.14, the host's triton 3.6 and the kit's dependencies? No model is loaded. Each check prints
one line, ok or the error; the exit status is the number that failed.

    python3 benchmarks/lab/gpu-kit-034/probe_vllm.py
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os

from probe import check  # this folder is the script's first on sys.path

# What vLLM imports on the offline LLM path and under `vllm serve` (the emulation's roots; see README.md).
MODULES = [
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.sample.sampler",
    "vllm.v1.worker.gpu.spec_decode.ngram.speculator",
    "vllm.v1.worker.gpu.spec_decode.eagle.speculator",
    "vllm.v1.worker.gpu.spec_decode.mtp.speculator",
    "vllm.model_executor.models.deepseek_v2",
    "vllm.model_executor.models.deepseek_mtp",
    "vllm.model_executor.models.deepseek_eagle",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.v1.attention.backends.mla.flashattn_mla",
    "vllm.v1.attention.backends.mla.flashmla",
    "vllm.v1.attention.backends.mla.triton_mla",
    "vllm.v1.attention.backends.mla.prefill.flash_attn",
    "vllm.compilation.backends",
    "vllm.v1.structured_output.backend_xgrammar",
    "vllm.entrypoints.openai.api_server",
    "model_hosting_container_standards.sagemaker",
    "moetrace.hooks.plugin",
    "moetrace.cli",
]


def versions() -> str:
    import torch
    import triton
    import vllm

    return (f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}, torch {torch.__version__}, "
            f"triton {triton.__version__} from {os.path.dirname(triton.__file__)}, {torch.cuda.get_device_name(0)}")


def vision_audio() -> str:
    # the host's torchvision 0.26 cannot load on torch 2.14 (the kit carries 0.29.0); its torchaudio 2.11 is
    # built on torch's stable ABI and is expected to load: transformers imports both when they are installed
    import torch
    import torchvision

    said = f"torchvision {torchvision.__version__} from {os.path.dirname(torchvision.__file__)}, " \
           f"nms op {hasattr(torch.ops.torchvision, 'nms')}"
    try:
        import torchaudio

        said += f"; torchaudio {torchaudio.__version__} loads"
    except Exception as exc:  # reported, and it fails the check: vLLM's import chain reaches it
        raise RuntimeError(f"{said}; torchaudio fails: {exc!r}") from exc
    return said


def platform() -> str:
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    # None off a GPU: the AttributeError is then this check's failure
    return f"{type(current_platform).__name__}, capability {cap.major}.{cap.minor}"  # type: ignore[union-attr]


def extensions() -> str:
    # vLLM loads _moe_C inside contextlib.suppress(ImportError): load each one here so a failure shows
    names = ["vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C",
             "vllm._flashmla_C", "vllm._flashmla_extension_C", "vllm._deepselect_C", "vllm.cumem_allocator"]
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed.append(f"{name}: {exc!r}"[:300])
    if failed:
        raise RuntimeError(" | ".join(failed))
    return f"{len(names)} loaded"


def kernels() -> str:
    import torch
    import vllm._custom_ops as ops  # noqa: F401  (loads _C and _moe_C)
    from vllm.platforms import current_platform

    # None off a GPU, as in platform()
    cap = current_platform.get_device_capability().to_int()  # type: ignore[union-attr]
    block_fp8 = ops.cutlass_scaled_mm_supports_block_fp8(cap)
    marlin = hasattr(torch.ops._moe_C, "moe_wna16_marlin_gemm")
    grouped_topk = hasattr(torch.ops._moe_C, "grouped_topk")
    return f"_C loaded (CUTLASS block-FP8 on sm{cap}: {block_fp8}), _moe_C Marlin MoE {marlin}, " \
           f"grouped_topk {grouped_topk}"


def flash_attention() -> str:
    from vllm.vllm_flash_attn.flash_attn_interface import (
        FA2_AVAILABLE,
        fa_version_unsupported_reason,
        is_fa_version_supported,
    )

    if not is_fa_version_supported(3):
        raise RuntimeError(f"FA3 unsupported: {fa_version_unsupported_reason(3)}")
    return f"FA3 supported; FA2 carried: {FA2_AVAILABLE} (removed from the slim wheel)"


def flashmla() -> str:
    from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported, is_flashmla_sparse_supported

    return f"FlashMLA dense {is_flashmla_dense_supported()}, sparse {is_flashmla_sparse_supported()}"


def imports() -> str:
    failed = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
    if failed:
        raise RuntimeError(" | ".join(failed))
    return f"{len(MODULES)} modules"


def plugin() -> str:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    names = sorted(ep.name for ep in eps)
    if "moetrace" not in names:
        raise RuntimeError(f"moetrace's vllm.general_plugins entry point not found (found {names})")
    return f"vllm.general_plugins: {names}"


def switches() -> str:
    import vllm.envs as envs

    return (f"VLLM_USE_FLASHINFER_SAMPLER={int(envs.VLLM_USE_FLASHINFER_SAMPLER)} "
            f"VLLM_USE_DEEP_GEMM={int(envs.VLLM_USE_DEEP_GEMM)}")


def main() -> int:
    import torch  # noqa: F401  (first: a torch that cannot load stops the probe rather than failing every check)

    checks = [("versions", versions), ("torchvision/torchaudio", vision_audio), ("platform", platform),
              ("extensions", extensions), ("kernels", kernels), ("flash attention", flash_attention),
              ("flashmla", flashmla), ("imports", imports), ("plugin", plugin), ("switches", switches)]
    return sum(not check(name, run) for name, run in checks)


if __name__ == "__main__":
    raise SystemExit(main())
