"""Trace size: bytes on disk per routing row (top-8, weights included) and which columns dominate.

    python benchmarks/bench_trace_size.py [--num-prompts 32] [--max-tokens 128] [--trace DIR]

Measures two traces written by the same TraceWriter: a real recording of the default model (n-gram k=3; its
random network routes with strong locality, which compresses well) and a worst case of uniform-random routing
(ids uniform over 384 experts, weights renormalised random scores). Sums each column's compressed size from the
Parquet footers. Baseline: the same rows as a naive fixed-width record (uint32 step/request/position/token,
uint8 phase/draft_pos/accepted, uint16 layer, int32 ids, float32 weights) = 85 bytes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

NAIVE_ROW_BYTES = 4 * 4 + 3 * 1 + 2 + 8 * 4 + 8 * 4


def column_bytes(files: list[Path]) -> tuple[int, Counter[str]]:
    rows, per_column = 0, Counter[str]()
    for path in files:
        meta = pq.read_metadata(path)
        rows += meta.num_rows
        for group in range(meta.num_row_groups):
            row_group = meta.row_group(group)
            for column in range(row_group.num_columns):
                chunk = row_group.column(column)
                per_column[chunk.path_in_schema.split(".")[0]] += chunk.total_compressed_size
    return rows, per_column


def uniform_random_trace(directory: Path, tokens: int, seed: int = 0) -> Path:
    """Decode steps of 32 requests whose routing is uniform random: the entropy worst case for ids and weights."""
    import numpy as np

    from moetrace.trace.schema import SCHEMA_VERSION
    from moetrace.trace.files import StepCapture
    from moetrace.writer.process import TraceWriter

    rng = np.random.default_rng(seed)
    layers, top_k, experts, batch = list(range(1, 61)), 8, 384, 32
    manifest = {"schema": SCHEMA_VERSION, "run_id": "uniform", "complete": False,
                "model": {"num_experts": experts, "top_k": top_k, "moe_layers": layers, "hidden_size": 7168},
                "spec": {"method": "none", "k": 0}, "parallel": {"tp": 1, "ep": 1}}
    writer = TraceWriter(directory, manifest, layers, top_k)
    for step in range(tokens // batch):
        ids = np.argsort(rng.random((batch, len(layers), experts)), axis=-1)[..., :top_k].astype(np.uint16)
        scores = rng.random((batch, len(layers), top_k)).astype(np.float32)
        writer.submit(StepCapture(
            step=step, request=np.arange(batch, dtype=np.uint32),
            position=np.full(batch, 100 + step, np.uint32), phase=np.full(batch, 1, np.int8),
            draft_pos=np.zeros(batch, np.uint8), token=rng.integers(0, 50000, batch).astype(np.uint32),
            accepted=np.full(batch, -1, np.int8), experts=ids, weights=scores / scores.sum(-1, keepdims=True),
            cand_experts=None, cand_scores=None,
            steps_rows={"step": np.full(batch, step, np.uint32), "request": np.arange(batch, dtype=np.uint32),
                        "num_tokens": np.ones(batch, np.uint32), "num_drafts": np.zeros(batch, np.uint32),
                        "num_accepted": np.zeros(batch, np.uint32), "batch_size": np.full(batch, batch, np.uint32),
                        "t_start_ns": np.zeros(batch, np.int64), "t_end_ns": np.zeros(batch, np.int64)},
        ))
        writer.forward_ready()
    writer.close()
    return directory


def report(title: str, trace: Path) -> None:
    files = sorted((trace / "routing").glob("*.parquet"))
    rows, per_column = column_bytes(files)
    on_disk = sum(f.stat().st_size for f in files)
    print(f"\n{title}: {rows:,} routing rows in {len(files)} files, {on_disk:,} bytes on disk")
    print(f"{'column':<14} {'bytes/row':>9} {'share':>6}")
    total_columns = sum(per_column.values())
    for name, size in per_column.most_common():
        print(f"{name:<14} {size / rows:>9.2f} {100 * size / total_columns:>5.1f}%")
    per_row = on_disk / rows
    print(f"bytes per routing row: {per_row:.2f} (target <= 20); naive fixed-width row {NAIVE_ROW_BYTES} bytes; "
          f"ratio {per_row / NAIVE_ROW_BYTES:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--uniform-tokens", type=int, default=32 * 512)
    parser.add_argument("--trace", type=Path, help="measure an existing trace instead of recording one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moetrace-size-") as scratch:
        trace = args.trace
        if trace is None:
            subprocess.run(
                [sys.executable, "-m", "moetrace", "record", "--k", "3", "--num-prompts", str(args.num_prompts),
                 "--max-tokens", str(args.max_tokens), "--batch-size", "32", "--out", scratch],
                check=True, stdout=subprocess.DEVNULL,
            )
            (trace,) = [p for p in Path(scratch).iterdir() if p.is_dir()]
        report(f"recorded ({trace.name})", trace)
        report("uniform-random routing, 60 layers",
               uniform_random_trace(Path(scratch) / "uniform", args.uniform_tokens))


if __name__ == "__main__":
    main()
