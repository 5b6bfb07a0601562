"""Trace size: bytes on disk per routing row (top-8, weights included) and which columns dominate.

    python benchmarks/bench_trace_size.py [--num-prompts 32] [--max-tokens 128] [--trace DIR]

Records the default model with n-gram k=3 (or reads --trace), then sums each column's compressed size from the
Parquet footers. Baseline: the same rows as a naive fixed-width record (uint32 step/request/position/token,
uint8 phase/draft_pos/accepted, uint16 layer, int32 ids and float32 weights) = 76 bytes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

NAIVE_ROW_BYTES = 4 * 4 + 3 * 1 + 2 + 8 * 4 + 8 * 4 - 9  # see the docstring: 76


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
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
        files = sorted((trace / "routing").glob("*.parquet"))
        rows, per_column = column_bytes(files)
        on_disk = sum(f.stat().st_size for f in files)
    print(f"{rows:,} routing rows in {len(files)} files, {on_disk:,} bytes on disk")
    print(f"{'column':<14} {'bytes/row':>9} {'share':>6}")
    total_columns = sum(per_column.values())
    for name, size in per_column.most_common():
        print(f"{name:<14} {size / rows:>9.2f} {100 * size / total_columns:>5.1f}%")
    per_row = on_disk / rows
    print(f"bytes per routing row: {per_row:.2f} (target <= 20); naive fixed-width row {NAIVE_ROW_BYTES} bytes; "
          f"ratio {per_row / NAIVE_ROW_BYTES:.3f}")


if __name__ == "__main__":
    main()
