"""Does vLLM's fused-MoE kernel take the time the calibration's table says, under the routing an engine recorded?

The calibration (``moetrace calibrate --vllm-kernel``) times vLLM's ``fused_experts`` at (unique experts, routed
rows) with token i routed to slots top_k·i … top_k·i + top_k − 1 modulo the experts: an expert's rows sit top-k·
(experts ÷ top_k) rows apart. Where tokens × top-k × 4 ≤ experts (12 tokens or fewer for 384 experts) vLLM 0.26
skips its block alignment and runs one block per routed row, so the kernel's time follows the rows and how close
together the rows of one expert run (their weight tiles shared in L2). This times, on one GPU with vLLM 0.26, per
token count T (Kimi-K2 TP=8's per-rank expert shape: hidden 7168, width 256, 384 experts, top-8, bf16):

- ``trace``: the top-k ids of recorded decode steps of T tokens, one (step, layer) per call, as the trace orders
  them (request by request, position by position: vLLM's order within a step);
- ``trace-shuffled``: the same ids with the tokens in a random order (the same unique experts and rows per expert,
  the rows of one expert no longer close together);
- ``calibration``: the calibration's routing at the trace's median unique experts for that T.

Usage:
  python benchmarks/lab/bench_moe_routing_gpu.py extract TRACE_DIR ... -o routing.npz   (here, from traces)
  python benchmarks/lab/bench_moe_routing_gpu.py time routing.npz --json OUT.json         (on the GPU)
Wrote ``benchmarks/results/moe-routing-h100.json`` (2026-12-05, an H100, vLLM 0.26.0) from the traces of the fourth
n-gram hold-out (``h200_next_checks.sh holdout-32``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

TOKEN_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32)
SAMPLES = 16  # (step, layer) id matrices per token count


def extract(traces: list[Path], out: Path) -> None:
    """Top-k id matrices [T, top_k] of decode steps with T tokens (no prefill in the step) from the traces'
    routing tables: the first ``SAMPLES`` such steps per T, one layer of each (a different layer each step); saved
    in ``out`` as arrays named ``<trace folder>_T<n>``."""
    import numpy as np
    import polars as pl

    arrays: dict[str, Any] = {}
    for trace in traces:
        found: dict[int, list[Any]] = {}
        routing = pl.scan_parquet(trace / "routing" / "*.parquet")
        prefill_steps = routing.filter(pl.col("phase") == "prefill").select("step").unique()
        decode = routing.join(prefill_steps, on="step", how="anti")
        sizes = decode.filter(pl.col("layer") == pl.col("layer").min()).group_by("step").len().rename(
            {"len": "tokens"})
        chosen = (sizes.filter(pl.col("tokens").is_in(TOKEN_COUNTS)).sort("step")
                  .with_columns(pl.int_range(pl.len()).over("tokens").alias("nth"))
                  .filter(pl.col("nth") < SAMPLES).collect())
        layers = sorted(decode.select("layer").unique().collect()["layer"].to_list())
        rows = (decode.join(chosen.lazy().select("step", "tokens", "nth"), on="step")
                .sort("step", "layer", "request", "position").collect())
        for (step, layer), group in rows.group_by(["step", "layer"], maintain_order=True):
            nth = int(group["nth"][0])
            if layer != layers[(nth * 7) % len(layers)]:  # one layer per step, a different one each step
                continue
            tokens = int(group["tokens"][0])
            found.setdefault(tokens, []).append(np.stack(group["experts"].to_list()).astype(np.int32))
        arrays.update({f"{trace.name}_T{t}": np.stack(mats) for t, mats in sorted(found.items())})
    np.savez_compressed(out, **arrays)
    print({name: array.shape for name, array in arrays.items()})


def time_routing(npz: Path, out: Path | None, reps: int = 8, replays: int = 7) -> None:
    import numpy as np
    import torch

    from moetrace.calibrate.experts import ExpertPool, time_calls, vllm_kernel_context

    hidden, width, experts, top_k = 7168, 256, 384, 8
    device = torch.device("cuda")
    pool = ExpertPool(hidden, width, experts, "bf16", device)
    reason = pool.fused_moe_check(top_k)
    if reason:
        raise SystemExit(f"vLLM's fused_experts cannot run: {reason}")
    from vllm.model_executor.layers.fused_moe import fused_experts

    data = np.load(npz)
    generator = torch.Generator(device="cpu").manual_seed(0)
    results = []
    with vllm_kernel_context():
        for name in data.files:
            ids_all = torch.from_numpy(data[name]).to(device)  # [samples, T, top_k]
            samples, tokens, _ = ids_all.shape
            x = (torch.randn(tokens, hidden, device=device) * 0.1).to(torch.bfloat16)
            weights = torch.full((tokens, top_k), 1.0 / top_k, device=device, dtype=torch.float32)
            shuffled = torch.stack([ids[torch.randperm(tokens, generator=generator).to(device)] for ids in ids_all])
            unique = [int(ids.unique().numel()) for ids in ids_all]
            rows_per_expert = [float(torch.bincount(ids.flatten()).max()) for ids in ids_all]
            row: dict[str, Any] = {"trace": name.rsplit("_T", 1)[0], "tokens": tokens, "rows": tokens * top_k,
                                   "samples": samples, "unique_median": statistics.median(unique),
                                   "largest_rows_per_expert_median": statistics.median(rows_per_expert)}
            for label, id_sets in (("trace", ids_all), ("trace-shuffled", shuffled)):
                def call(i: int, id_sets: torch.Tensor = id_sets) -> object:
                    return fused_experts(x, pool.w13, pool.w2, weights, id_sets[i % samples].contiguous())
                row[f"{label}_us"], row["timing"] = time_calls(call, device, max(reps, samples), replays)
            spread = max(top_k, min(experts, round(statistics.median(unique))))
            row["calibration_experts"] = spread
            row["calibration_us"], _ = time_calls(pool.fused_moe_call(spread, tokens, top_k), device, reps, replays)
            results.append(row)
            print(json.dumps(row), flush=True)
    doc = {"device": torch.cuda.get_device_name(device), "shape": {"hidden": hidden, "width": width,
           "experts": experts, "top_k": top_k}, "command": "python benchmarks/lab/bench_moe_routing_gpu.py "
           + " ".join(sys.argv[1:]), "rows": results}
    if out is not None:
        out.write_text(json.dumps(doc, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("extract")
    ex.add_argument("traces", type=Path, nargs="+")
    ex.add_argument("-o", "--out", type=Path, required=True)
    tm = sub.add_parser("time")
    tm.add_argument("npz", type=Path)
    tm.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "extract":
        extract(args.traces, args.out)
    else:
        time_routing(args.npz, args.json)


if __name__ == "__main__":
    main()
