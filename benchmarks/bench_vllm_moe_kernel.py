"""vLLM's own fused-MoE kernel (``fused_experts``: Triton, unquantised bf16, what vLLM ran on the Kimi-K2 TP=8 slice)
against the calibration's kernel (``torch._grouped_mm``, ``moetrace.calibrate.experts``) at the same per-GPU shape:
one expert layer's time for T tokens routed top-8 over U unique experts.

    python benchmarks/bench_vllm_moe_kernel.py --out vllm-moe-kernel.json     # on a GPU with vLLM installed

Baseline: ``torch._grouped_mm`` over the same experts and rows, same weights, same run. Both are captured in a CUDA
graph and timed by events over replays (``moetrace.calibrate.experts.time_calls``). Prints per point the two times
and their ratio, and each kernel's fit ``c0 + per_expert·U + per_row·rows`` (rows = 8T).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetrace.calibrate.experts import ExpertPool, time_calls

HIDDEN, WIDTH, EXPERTS, TOP_K = 7168, 256, 384, 8  # Kimi-K2's TP=8 slice: every expert at width 2048/8
TOKENS = (1, 3, 5, 16, 48, 80)
UNIQUE = (8, 16, 24, 32, 48, 64, 96, 128, 160)


def routed_ids(tokens: int, unique: int, first: int, device: torch.device) -> torch.Tensor:
    """[tokens, TOP_K] expert ids over exactly ``unique`` experts starting at ``first`` (each token's 8 distinct:
    token i takes pool slots 8i..8i+7 modulo ``unique``)."""
    slots = (torch.arange(tokens * TOP_K, device=device) % unique).view(tokens, TOP_K)
    return ((slots + first) % EXPERTS).to(torch.int32)


def vllm_call(pool: ExpertPool, tokens: int, unique: int) -> Any:
    from vllm.model_executor.layers.fused_moe import fused_experts

    x = (torch.randn(tokens, HIDDEN, device=pool.device) * 0.1).to(torch.bfloat16)
    weights = torch.full((tokens, TOP_K), 1.0 / TOP_K, device=pool.device, dtype=torch.float32)
    starts = pool.windows(unique)
    ids = [routed_ids(tokens, unique, s, pool.device) for s in starts]

    def call(i: int) -> object:
        return fused_experts(x, pool.w13, pool.w2, weights, ids[i % len(ids)])

    return call


def fit(points: list[dict[str, Any]], key: str) -> dict[str, float]:
    design = np.array([[1.0, p["unique"], p["tokens"] * TOP_K] for p in points])
    coef, *_ = np.linalg.lstsq(design, np.array([p[key] for p in points]), rcond=None)
    return {"c0_us": float(coef[0]), "per_expert_us": float(coef[1]), "per_row_us": float(coef[2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=16)
    parser.add_argument("--replays", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU (vLLM's fused-MoE kernel is Triton on CUDA)")
    device = torch.device("cuda")
    pool = ExpertPool(HIDDEN, WIDTH, EXPERTS, "bf16", device)
    points = []
    from vllm.config import VllmConfig, set_current_vllm_config

    try:
        with set_current_vllm_config(VllmConfig()):  # vLLM's kernels read the current config (defaults here)
            measure(pool, device, args, points)
    except Exception as exc:  # keep what was measured before it
        print(f"stopped: {type(exc).__name__}: {exc}", flush=True)
    if not points:
        sys.exit("error: no point measured")
    write(args, points)


def measure(pool: ExpertPool, device: torch.device, args: argparse.Namespace, points: list[dict[str, Any]]) -> None:
    for tokens in TOKENS:
        for unique in (u for u in UNIQUE if u <= TOP_K * tokens):
            grouped, _ = pool.layer_call(unique, tokens * TOP_K)
            base_us, base_mode = time_calls(grouped, device, args.reps, args.replays)
            vllm_us, vllm_mode = time_calls(vllm_call(pool, tokens, unique), device, args.reps, args.replays)
            points.append({"tokens": tokens, "unique": unique, "grouped_mm_us": base_us, "vllm_us": vllm_us,
                           "timing": [base_mode, vllm_mode]})
            print(f"T={tokens:3d} U={unique:3d}  torch._grouped_mm {base_us:7.1f} us  vLLM fused_experts "
                  f"{vllm_us:7.1f} us  ratio {vllm_us / base_us:.2f}", flush=True)


def write(args: argparse.Namespace, points: list[dict[str, Any]]) -> None:
    doc = {"shape": {"hidden": HIDDEN, "width": WIDTH, "experts": EXPERTS, "top_k": TOP_K},
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python benchmarks/bench_vllm_moe_kernel.py " + " ".join(sys.argv[1:]),
           "points": points, "fit_grouped_mm": fit(points, "grouped_mm_us"), "fit_vllm": fit(points, "vllm_us")}
    try:
        import vllm

        doc["vllm_version"] = vllm.__version__
    except ImportError:
        pass
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print("fit torch._grouped_mm:", doc["fit_grouped_mm"])
    print("fit vLLM fused_experts:", doc["fit_vllm"])


if __name__ == "__main__":
    main()
