"""Benchmark: counterfactual growth (unique experts per layer for k=1..8) on a Kimi-shaped plain-decoding trace,
against DuckDB's UNNEST + COUNT(DISTINCT) on the same Parquet files, in the same run.

    python benchmarks/bench_growth.py [--tokens 1000000] [--layers 60]

The trace (384 experts, top-8, random distinct experts per token) is generated once into the cache directory.
Each engine runs in its own child process so that its peak memory (max RSS) is its own; the results of both are
compared, and the time ratio DuckDB / moetrace is printed.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

NUM_EXPERTS = 384
TOP_K = 8
REQUESTS = 64
KS = range(1, 9)
ROWS_PER_FILE = 4_000_000


def trace_dir(cache: Path, tokens: int, layers: int) -> Path:
    return cache / f"kimi-decode-{tokens}x{layers}"


def generate(root: Path, tokens: int, layers: int) -> None:
    """Token-major rows like the recorder writes them: step, then request, then layer."""
    from moetrace.schema import FOOTER_SCHEMA_KEY, PHASES, SCHEMA_VERSION, routing_schema

    rng = np.random.default_rng(0)
    schema = routing_schema(TOP_K).with_metadata({FOOTER_SCHEMA_KEY: SCHEMA_VERSION.encode()})
    (root / "routing").mkdir(parents=True, exist_ok=True)
    steps = tokens // REQUESTS
    steps_per_file = max(1, ROWS_PER_FILE // (REQUESTS * layers))
    for part, first in enumerate(range(0, steps, steps_per_file)):
        count = min(steps_per_file, steps - first)
        rows = count * REQUESTS * layers
        step = np.repeat(np.arange(first, first + count, dtype=np.uint32), REQUESTS * layers)
        request = np.tile(np.repeat(np.arange(REQUESTS, dtype=np.uint32), layers), count)
        # 8 distinct experts: a random start plus 8 random strides of 1..47 (sum < 384, so no wrap-around repeat)
        strides = rng.integers(1, 48, size=(rows, TOP_K), dtype=np.int64)
        strides[:, 0] = rng.integers(0, NUM_EXPERTS, size=rows)
        experts = (np.cumsum(strides, axis=1) % NUM_EXPERTS).astype(np.uint16)
        weights = np.sort(rng.random((rows, TOP_K), dtype=np.float32), axis=1)[:, ::-1].astype(np.float16)
        table = pa.Table.from_pydict(
            {
                "step": step,
                "request": request,
                "position": step + 100,
                "phase": pa.DictionaryArray.from_arrays(np.full(rows, PHASES.index("decode"), np.int8), pa.array(PHASES)),
                "draft_pos": np.zeros(rows, np.uint8),
                "token": pa.nulls(rows, pa.uint32()),
                "accepted": pa.nulls(rows, pa.bool_()),
                "layer": np.tile(np.arange(layers, dtype=np.uint16), count * REQUESTS),
                "experts": pa.FixedSizeListArray.from_arrays(pa.array(experts.reshape(-1)), TOP_K),
                "weights": pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(weights).reshape(-1)), TOP_K),
            },
            schema=schema,
        )
        pq.write_table(table, root / "routing" / f"part-{part:05d}.parquet", compression="zstd", row_group_size=262_144)
    manifest = {
        "schema": SCHEMA_VERSION, "complete": True,
        "model": {"name": "bench", "num_experts": NUM_EXPERTS, "top_k": TOP_K, "moe_layers": list(range(layers)),
                  "hidden_size": 7168},
        "spec": {"method": None, "k": 0}, "parallel": {"tp": 1, "ep": 1},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def run_moetrace(root: Path) -> list[dict[str, object]]:
    from moetrace.analysis.growth import counterfactual_growth
    from moetrace.analysis.placement import linear_placement
    from moetrace.reader import open_trace

    trace = open_trace(root)
    frame = counterfactual_growth(trace.routing(), NUM_EXPERTS, KS, linear_placement(NUM_EXPERTS, 1))
    return frame.select("layer", "k", "unique_experts").to_dicts()


def run_duckdb(root: Path) -> list[dict[str, object]]:
    import duckdb

    files = str(root / "routing" / "*.parquet")
    results: list[dict[str, object]] = []
    for k in KS:
        query = f"""
            WITH picks AS (
                SELECT layer, request, position // {k + 1} AS w, position, unnest(experts) AS expert
                FROM read_parquet('{files}')
                WHERE phase = 'decode' OR (phase = 'verify' AND (draft_pos = 0 OR accepted))
            ), windows AS (
                SELECT layer, count(DISTINCT expert) AS unique_experts, count(DISTINCT position) AS tokens
                FROM picks GROUP BY layer, request, w
            )
            SELECT layer, {k} AS k, avg(unique_experts) AS unique_experts
            FROM windows WHERE tokens = {k + 1} GROUP BY layer ORDER BY layer
        """
        results += [dict(zip(("layer", "k", "unique_experts"), row)) for row in duckdb.sql(query).fetchall()]
    return results


def child(engine: str, root: Path) -> None:
    import duckdb  # noqa: F401  (imports are not part of the timing)
    import polars  # noqa: F401

    start = time.perf_counter()
    rows = run_moetrace(root) if engine == "moetrace" else run_duckdb(root)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_bytes": peak, "rows": rows}))


def measure(engine: str, root: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", engine, "--trace", str(root)], capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@click.command()
@click.option("--tokens", default=1_000_000, show_default=True, help="Decoded tokens (rows = tokens × layers).")
@click.option("--layers", default=60, show_default=True, help="MoE layers.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=Path.home() / ".cache" / "moetrace" / "bench",
              show_default=True, help="Where the generated trace is kept between runs.")
@click.option("--child", "child_engine", type=click.Choice(["moetrace", "duckdb"]), hidden=True)
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), hidden=True)
def bench(tokens: int, layers: int, cache_dir: Path, child_engine: str | None, trace_path: Path | None) -> None:
    """Time growth for k=1..8: moetrace (Polars + expert bitsets) against DuckDB UNNEST + COUNT DISTINCT."""
    if child_engine is not None and trace_path is not None:
        child(child_engine, trace_path)
        return
    root = trace_dir(cache_dir, tokens, layers)
    if not (root / "manifest.json").exists():
        start = time.perf_counter()
        generate(root, tokens, layers)
        print(f"generated {root} in {time.perf_counter() - start:.1f} s")
    rows = (tokens // REQUESTS) * REQUESTS * layers
    ours, theirs = measure("moetrace", root), measure("duckdb", root)
    mine = {(r["layer"], r["k"]): r["unique_experts"] for r in ours["rows"]}  # type: ignore[attr-defined]
    other = {(r["layer"], r["k"]): r["unique_experts"] for r in theirs["rows"]}  # type: ignore[attr-defined]
    worst = max(abs(float(mine[key]) - float(other[key])) for key in mine) if mine.keys() == other.keys() else None
    print(f"rows: {rows:,} ({tokens:,} tokens x {layers} layers), k = 1..8")
    for name, result in (("moetrace", ours), ("duckdb", theirs)):
        print(f"{name:>9}: {result['seconds']:7.2f} s, peak memory {int(result['peak_bytes']) / 2**30:5.2f} GiB")  # type: ignore[call-overload]
    print(f"duckdb / moetrace time: {float(theirs['seconds']) / float(ours['seconds']):.1f}x")  # type: ignore[arg-type]
    print("results agree" if worst is not None and worst < 1e-9 else f"RESULTS DIFFER (max difference {worst})")


if __name__ == "__main__":
    bench()
