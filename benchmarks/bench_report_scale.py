"""Benchmark: the whole ``moetrace report`` (terminal tables, --json and the dashboard) on a large trace, against
one full scan of the same routing files with Polars, in the same run.

    python benchmarks/bench_report_scale.py [--tokens 1000000] [--layers 60]     # 60M rows: the target size
    python benchmarks/bench_report_scale.py --guard benchmarks/results/report-scale-guard.json   # CI: 3M rows

The trace is bench_growth's Kimi-shaped plain-decoding trace (384 experts, top-8, 64 requests), plus its steps
table, generated once into the cache directory. The report runs in a child process (its peak memory is its own
max RSS) with ``--acceptance 0.7`` (a plain-decoding trace has no drafts to measure) and writes its dashboard and
JSON to a scratch folder. Baseline: a child that scans every routing file once (sum of all expert ids), the least
any analysis of all rows must do: the median of three such scans, one before the report and two after. Targets at
60M rows: the report in at most 6× the scan's time and 3 GiB.

``--guard FILE`` (``scripts/test.sh`` runs it): the size, ratio and peak FILE commits; exit 1 where the report's time
over the scan's, or its peak memory, grew past FILE's margin over them.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench_growth import REQUESTS, generate, trace_dir

SCAN = """
import sys, polars as pl
files = sys.argv[1] + "/routing/*.parquet"
print(pl.scan_parquet(files).select(pl.col("experts").arr.sum().sum()).collect().item())
"""


def add_steps(root: Path, tokens: int) -> None:
    """One steps row per (step, request), as the recorder writes them for plain decoding."""
    from moetrace.trace.schema import FOOTER_SCHEMA_KEY, SCHEMA_VERSION, STEPS_SCHEMA

    steps = tokens // REQUESTS
    count = steps * REQUESTS
    schema = STEPS_SCHEMA.with_metadata({FOOTER_SCHEMA_KEY: SCHEMA_VERSION.encode()})
    table = pa.Table.from_pydict({
        "step": np.repeat(np.arange(steps, dtype=np.uint32), REQUESTS),
        "request": np.tile(np.arange(REQUESTS, dtype=np.uint32), steps),
        "num_tokens": np.ones(count, np.uint32),
        "num_drafts": np.zeros(count, np.uint32),
        "num_accepted": np.zeros(count, np.uint32),
        "batch_size": np.full(count, REQUESTS, np.uint32),
        "t_start_ns": np.repeat(np.arange(steps, dtype=np.int64) * 10_000_000, REQUESTS),
        "t_end_ns": np.repeat(np.arange(steps, dtype=np.int64) * 10_000_000 + 9_000_000, REQUESTS),
    }, schema=schema)
    (root / "steps").mkdir(exist_ok=True)
    pq.write_table(table, root / "steps" / "part-00000.parquet")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["model"].update(num_layers=len(manifest["model"]["moe_layers"]) + 1, shared_experts=1, expert_width=2048,
                             expert_weight_bits=4, quant_group_size=32)
    (root / "manifest.json").write_text(json.dumps(manifest))


TARGET_ROWS, TARGET_RATIO, TARGET_GIB = 60_000_000, 6.0, 3.0  # the report in at most 6 scans' time and 3 GiB


def timed_child(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} failed: {done.stderr.strip()[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 2**20


@click.command()
@click.option("--tokens", default=1_000_000, show_default=True, help="Decoded tokens (rows = tokens × layers).")
@click.option("--layers", default=60, show_default=True)
@click.option("--cache", type=click.Path(path_type=Path), default=Path(tempfile.gettempdir()) / "moetrace-bench")
@click.option("--guard", type=click.Path(path_type=Path, exists=True), default=None,
              help="Committed figures (tokens, layers, ratio, peak_gib, margin): fail past their margin.")
def main(tokens: int, layers: int, cache: Path, guard: Path | None) -> None:
    committed = json.loads(guard.read_text()) if guard else None
    if committed is not None:
        tokens, layers = int(committed["tokens"]), int(committed["layers"])
    root = trace_dir(cache, tokens, layers)
    if not (root / "steps").exists():
        print(f"generating {tokens * layers:,} rows into {root} ...", flush=True)
        generate(root, tokens, layers)
        add_steps(root, tokens)
    scan = [sys.executable, "-c", SCAN, str(root)]
    with tempfile.TemporaryDirectory(prefix="moetrace-report-") as scratch:
        first_scan_s, scan_gib = timed_child(scan)  # first: the children's peak is the scan's alone
        report_s, report_gib = timed_child([
            sys.executable, "-m", "moetrace", "report", str(root), "--k", "3", "--acceptance", "0.7", "--json",
            "-o", str(Path(scratch) / "report.html")])
    # the scan's median of one run before the report and two after: this VM's speed drifts by a fifth from one
    # minute to the next, and one scan of a few seconds caught it alone
    scans = sorted([first_scan_s, timed_child(scan)[0], timed_child(scan)[0]])
    scan_s, rows, ratio = scans[1], tokens * layers, report_s / scans[1]
    met = ("met" if ratio <= TARGET_RATIO and report_gib <= TARGET_GIB else "NOT met") if rows >= TARGET_ROWS else (
        f"set for {TARGET_ROWS:,} rows")
    print(f"rows {rows:,}: report {report_s:.1f} s, peak {report_gib:.2f} GiB; one Polars scan {scan_s:.1f} s "
          f"(median of {', '.join(f'{s:.1f}' for s in scans)}), peak {scan_gib:.2f} GiB; report / scan = {ratio:.1f}× "
          f"(targets: {TARGET_RATIO:g}×, {TARGET_GIB:g} GiB: {met})")
    if committed is not None:
        margin = float(committed["margin"])
        slid = [f"{what} {now:.2f} past {margin:g} × the committed {then:.2f}" for what, now, then in (
            ("report / scan", ratio, float(committed["ratio"])),
            ("peak GiB", report_gib, float(committed["peak_gib"]))) if now > margin * then]
        if slid:
            sys.exit(f"{guard}: the report slid: {'; '.join(slid)} (find what grew, or commit new figures)")
        print(f"{guard}: within {margin:g} × the committed ratio and peak")


if __name__ == "__main__":
    main()
