"""Benchmark: counterfactual growth (unique experts per layer for k=1..8) on a Kimi-shaped plain-decoding trace,
against DuckDB's UNNEST + COUNT(DISTINCT) on the same Parquet files, in the same run.

    python benchmarks/bench_growth.py [--tokens 1000000] [--layers 60] [--repeat 3] [--duckdb-limit 600]

The trace (384 experts, top-8, random distinct experts per token) is generated once into the cache directory.
Each engine runs in its own child process so that its peak memory (max RSS) is its own. moetrace runs --repeat
times and its median time is reported. DuckDB runs once, one query per k, and is stopped after --duckdb-limit seconds
(at 60M rows it needs about half an hour on 2 cores): if it is stopped, the ratio printed is a lower bound (the limit
over moetrace's time), and the results are compared for the ks DuckDB finished. Results that differ fail the run.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    """Token-major rows like the recorder writes them (step, then request, then layer), with the recorder's Parquet
    options (moetrace.trace.files.PARQUET_OPTIONS)."""
    from moetrace.trace.schema import FOOTER_SCHEMA_KEY, TOKEN_PHASES, SCHEMA_VERSION, routing_schema
    from moetrace.trace.files import PARQUET_OPTIONS

    rng = np.random.default_rng(0)
    schema = routing_schema(TOP_K).with_metadata({FOOTER_SCHEMA_KEY: SCHEMA_VERSION.encode()})
    (root / "routing").mkdir(parents=True, exist_ok=True)
    steps = tokens // REQUESTS
    steps_per_file = max(1, ROWS_PER_FILE // (REQUESTS * layers))
    # Weights are never read by the benchmark: one block of sorted random weights, repeated.
    block = np.sort(rng.random((1 << 16, TOP_K), dtype=np.float32), axis=1)[:, ::-1].astype(np.float16)
    phases = pa.array(TOKEN_PHASES)
    for part, first in enumerate(range(0, steps, steps_per_file)):
        count = min(steps_per_file, steps - first)
        rows = count * REQUESTS * layers
        step = np.repeat(np.arange(first, first + count, dtype=np.uint32), REQUESTS * layers)
        request = np.tile(np.repeat(np.arange(REQUESTS, dtype=np.uint32), layers), count)
        # 8 distinct experts: a random start plus 7 random strides of 1..47 (sum < 384, so no wrap-around repeat)
        experts = rng.integers(1, 48, size=(rows, TOP_K), dtype=np.uint16)
        experts[:, 0] = rng.integers(0, NUM_EXPERTS, size=rows, dtype=np.uint16)
        np.cumsum(experts, axis=1, out=experts)
        np.remainder(experts, NUM_EXPERTS, out=experts)
        weights = np.resize(block, (rows, TOP_K))
        table = pa.Table.from_pydict(
            {
                "step": step,
                "request": request,
                "position": step + 100,
                "phase": pa.DictionaryArray.from_arrays(np.full(rows, TOKEN_PHASES.index("decode"), np.int8), phases),
                "draft_pos": np.zeros(rows, np.uint8),
                "token": pa.nulls(rows, pa.uint32()),
                "accepted": pa.nulls(rows, pa.bool_()),
                "layer": np.tile(np.arange(layers, dtype=np.uint16), count * REQUESTS),
                "experts": pa.FixedSizeListArray.from_arrays(pa.array(experts.reshape(-1)), TOP_K),
                "weights": pa.FixedSizeListArray.from_arrays(pa.array(weights.reshape(-1)), TOP_K),
            },
            schema=schema,
        )
        pq.write_table(
            table,
            root / "routing" / f"part-{part:05d}.parquet",
            row_group_size=262_144,
            **PARQUET_OPTIONS,
        )
    manifest = {
        "schema": SCHEMA_VERSION, "complete": True,
        "model": {"name": "bench", "num_experts": NUM_EXPERTS, "top_k": TOP_K, "moe_layers": list(range(layers)),
                  "hidden_size": 7168},
        "spec": {"method": None, "k": 0}, "parallel": {"tp": 1, "ep": 1},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def run_moetrace(root: Path) -> list[dict[str, object]]:
    from moetrace.analysis.growth import counterfactual_window_sums, window_means
    from moetrace.analysis.placement import linear_placement
    from moetrace.trace.reader import open_trace

    trace = open_trace(root)
    frame = window_means(counterfactual_window_sums(trace.routing(), NUM_EXPERTS, KS, linear_placement(NUM_EXPERTS, 1),
                                                    trace.k))
    return frame.select("layer", "k", "unique_experts").to_dicts()


def duckdb_query(root: Path, k: int) -> str:
    files = str(root / "routing" / "*.parquet")
    return f"""
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


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def child(engine: str, root: Path) -> None:
    """Prints one JSON line per finished piece of work: moetrace's whole result, or DuckDB's result for one k (so
    that a DuckDB run stopped at the time limit still reports the ks it finished)."""
    import duckdb
    import polars  # noqa: F401  (imports are not part of the timing)

    start, cpu = time.perf_counter(), cpu_seconds()
    if engine == "moetrace":
        rows = run_moetrace(root)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "cpu": cpu_seconds() - cpu, "peak_bytes": peak_bytes(), "rows": rows}))
        return
    for k in KS:
        relation = duckdb.sql(duckdb_query(root, k))
        assert relation is not None
        rows = [dict(zip(("layer", "k", "unique_experts"), row)) for row in relation.fetchall()]
        seconds = time.perf_counter() - start
        line = {"k": k, "seconds": seconds, "cpu": cpu_seconds() - cpu, "peak_bytes": peak_bytes(), "rows": rows}
        print(json.dumps(line), flush=True)


def measure(engine: str, root: Path, limit: float | None = None) -> tuple[list[dict[str, Any]], bool]:
    """Run one engine in a child process; its JSON lines, and whether it finished within ``limit`` seconds."""
    command = [sys.executable, __file__, "--child", engine, "--trace", str(root)]
    with tempfile.TemporaryFile("w+") as out:
        process = subprocess.Popen(command, stdout=out, text=True)
        try:
            finished = process.wait(timeout=limit) == 0
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            finished = False
        out.seek(0)
        lines = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
    if limit is None and not finished:
        raise SystemExit(f"{engine} failed")
    return lines, finished


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> tuple[list[int], float]:
    """The ks both engines finished, and the largest difference in unique experts over their (layer, k) rows."""
    mine = {(r["layer"], r["k"]): float(r["unique_experts"]) for r in ours}
    other = {(r["layer"], r["k"]): float(r["unique_experts"]) for r in theirs}
    ks = sorted({k for _, k in other})
    if not ks:
        return [], 0.0
    wanted = {key for key in mine if key[1] in ks}
    if wanted != set(other):
        return ks, float("inf")
    return ks, max(abs(mine[key] - other[key]) for key in wanted)


@click.command()
@click.option("--tokens", default=1_000_000, show_default=True, help="Decoded tokens (rows = tokens × layers).")
@click.option("--layers", default=60, show_default=True, help="MoE layers.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=Path.home() / ".cache" / "moetrace" / "bench",
              show_default=True, help="Where the generated trace is kept between runs.")
@click.option("--repeat", default=3, show_default=True, help="moetrace runs (the median is reported).")
@click.option("--duckdb-limit", default=600.0, show_default=True,
              help="Stop DuckDB after this many seconds (0: no limit); the ratio is then a lower bound.")
@click.option("--child", "child_engine", type=click.Choice(["moetrace", "duckdb"]), hidden=True)
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), hidden=True)
def bench(
    tokens: int, layers: int, cache_dir: Path, repeat: int, duckdb_limit: float, child_engine: str | None,
    trace_path: Path | None,
) -> None:
    """Time growth for k=1..8: moetrace (streamed expert bitsets) against DuckDB UNNEST + COUNT DISTINCT."""
    if child_engine is not None and trace_path is not None:
        child(child_engine, trace_path)
        return
    root = trace_dir(cache_dir, tokens, layers)
    if not (root / "manifest.json").exists():
        start = time.perf_counter()
        generate(root, tokens, layers)
        print(f"generated {root} in {time.perf_counter() - start:.1f} s")
    rows = (tokens // REQUESTS) * REQUESTS * layers
    print(f"rows: {rows:,} ({tokens:,} tokens x {layers} layers), k = 1..8, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} (other work on the machine slows both engines)")
    runs = [measure("moetrace", root)[0][-1] for _ in range(max(repeat, 1))]
    seconds = statistics.median(run["seconds"] for run in runs)
    peak = max(run["peak_bytes"] for run in runs)
    each = ", ".join(f"{run['seconds']:.2f}" for run in runs)
    cpu = statistics.median(run["cpu"] for run in runs)
    print(f" moetrace: {seconds:7.2f} s (median of {len(runs)}: {each}; CPU time {cpu:.2f} s), "
          f"peak memory {peak / 2**30:5.2f} GiB")
    lines, finished = measure("duckdb", root, duckdb_limit or None)
    theirs = [row for line in lines for row in line["rows"]]
    ks, worst = compare(runs[0]["rows"], theirs)
    duck_peak = max((line["peak_bytes"] for line in lines), default=0) / 2**30
    if finished:
        duck = lines[-1]["seconds"]
        print(f"   duckdb: {duck:7.2f} s (CPU time {lines[-1]['cpu']:.2f} s), peak memory {duck_peak:5.2f} GiB")
        print(f"duckdb / moetrace time: {duck / seconds:.1f}x")
    else:
        done = f"k = {', '.join(map(str, ks))} in {lines[-1]['seconds']:.0f} s" if lines else "no k"
        print(f"   duckdb: not finished after {duckdb_limit:.0f} s (limit; it finished {done}), "
              f"peak memory so far {duck_peak:5.2f} GiB")
        print(f"duckdb / moetrace time: >= {duckdb_limit / seconds:.1f}x (lower bound: DuckDB stopped at the limit)")
    if not ks:
        raise SystemExit("no DuckDB result to compare with: raise --duckdb-limit")
    if worst > 1e-9:
        raise SystemExit(f"RESULTS DIFFER for k in {ks} (max difference {worst})")
    print(f"results agree for k = {', '.join(map(str, ks))} (max difference {worst:.1e})")


if __name__ == "__main__":
    bench()
