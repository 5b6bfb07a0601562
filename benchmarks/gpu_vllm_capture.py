"""Graph capture records the truth: eager against compiled (CUDA graphs) on a GPU vLLM, and both against a
float32 reference routing computed from the same router logits; with ``--tp 2``, a tensor-parallel run against
a one-GPU run the same way.

    python benchmarks/gpu_vllm_capture.py --json benchmarks/results/gpu-vllm-capture.json
    python benchmarks/gpu_vllm_capture.py --tp 2 --json benchmarks/results/gpu-vllm-tp2.json   # 2 GPUs

Records the embedded default model twice with ``moetrace record`` (bf16 on the GPU, n-gram k=3, top-16
candidates): eager, and ``--compiled`` (vLLM's torch.compile with FULL_AND_PIECEWISE CUDA graphs); with ``--tp N``,
compiled on one GPU and compiled at TP=N (rank 0 records; its all-reduces change the sums' rounding). Compares
the in-sequence rows up to where greedy decoding diverges; every row whose expert set differs must be a near-tie
(the swapped experts' selection scores within 2 bf16 ulps of the K-th score, in both runs). Then checks every row
of both runs against the top-8 of its own float32 selection scores. Exits 1 on any unexplained row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def record(out: Path, args: argparse.Namespace, extra: list[str]) -> Path:
    command = [sys.executable, "-m", "moetrace", "record", "--k", str(args.k), "--max-tokens", str(args.max_tokens),
               "--num-prompts", str(args.num_prompts), "--batch-size", str(args.batch_size),
               "--candidates", str(args.candidates), "--out", str(out)]
    done = subprocess.run(command + extra, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"recording failed ({out.name}): {done.stderr.strip()[-2000:]}")
    (trace,) = [p for p in out.iterdir() if p.is_dir()]
    return trace


def counters_equal(trace_dir: Path) -> bool:
    """The trace's drafts and accepted tokens equal vLLM's own spec-decode counters for the run."""
    import polars as pl

    from moetrace.reader import open_trace

    trace = open_trace(trace_dir)
    counters = trace.manifest["vllm_counters"]
    verified = trace.steps().filter(pl.col("num_drafts") > 0).collect()
    return bool(verified.height == counters["num_drafts"]
                and verified["num_drafts"].sum() == counters["num_draft_tokens"]
                and verified["num_accepted"].sum() == counters["num_accepted_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--tp", type=int, default=1, help="compare compiled at this TP against compiled on one GPU")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from moetrace.compare import compare_runs, reference_check
    from moetrace.hooks.vllm_api import vllm_version
    from moetrace.host import gpu_inventory

    with tempfile.TemporaryDirectory(prefix="moetrace-capture-") as scratch:
        # run A, the reference, then run B against it
        a_name, b_name = ("compiled", f"tp{args.tp}") if args.tp > 1 else ("eager", "compiled")
        runs = {a_name: record(Path(scratch) / a_name, args, [] if args.tp == 1 else ["--compiled"]),
                b_name: record(Path(scratch) / b_name, args, ["--compiled", "--tp", str(args.tp)])}
        manifests = {name: json.loads((d / "manifest.json").read_text()) for name, d in runs.items()}
        result: dict[str, Any] = {
            "vllm_version": vllm_version(),
            "device": (gpu_inventory()["gpus"] or ["cpu"])[0],
            "runs": {"a": a_name, "b": b_name},
            **compare_runs(runs[a_name], runs[b_name]),
            "reference": {name: reference_check(d) for name, d in runs.items()},
            "capture_mechanisms": {name: m.get("capture_mechanisms") for name, m in manifests.items()},
            "tp": {name: m["parallel"]["tp"] for name, m in manifests.items()},
            "dtype": manifests[b_name]["model"]["dtype"],
            "complete": {name: m["complete"] for name, m in manifests.items()},
            "acceptance_equals_vllm_counters": {name: counters_equal(d) for name, d in runs.items()},
            "command": "python benchmarks/gpu_vllm_capture.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    unexplained = result["rows_unexplained"] + sum(r["rows_reference_unexplained"]
                                                   for r in result["reference"].values())
    agreed = all(result["acceptance_equals_vllm_counters"].values())
    sys.exit(1 if unexplained or not result["rows_compared"] or not agreed else 0)


if __name__ == "__main__":
    main()
