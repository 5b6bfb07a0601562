"""Benchmark: ``moetrace report --ray`` over an always-on recording's partitions, at 1 and 2 local Ray workers,
against the one-machine report of the same partitions, in the same run; then the wall time a day of traffic
(8·10⁹ routing rows) would take on 8, 32 and 128 workers at the measured per-worker rate.

    python benchmarks/bench_report_ray.py [--partitions 8] [--tokens 25000] [--layers 60] [--json OUT]

The recording: --partitions hourly partitions, each bench_growth's Kimi-shaped plain-decoding trace (384 experts,
top-8, 64 requests; --tokens × --layers rows) with its steps table, generated once into the cache directory. Each
mode runs in its own child process: the one-machine report (``moetrace report ROOT --json``); per worker count W,
a new local Ray cluster of W CPUs (``ray.init(num_cpus=W)``) that runs the partition summaries alone (the map:
rows per second per worker, each worker's peak memory), then the whole report with --ray (no cache), then again
(every summary from its partition's cache). Every report's JSON must equal the one-machine report's, or the run
fails. The projection: rows / (W × the per-worker rate) + the driver's time (the report's wall less its map, as
measured here: its window sample is capped, but its steps-table work grows with the steps rows; not projected).
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from bench_growth import generate
from bench_report_scale import add_steps

DAY_ROWS = 8_000_000_000
PROJECTED_WORKERS = (8, 32, 128)
REPORT_ARGS = ["--k", "3", "--acceptance", "0.7", "--json"]


def recording(cache: Path, partitions: int, tokens: int, layers: int) -> Path:
    root = cache / f"always-on-{partitions}x{tokens}x{layers}"
    for hour in range(partitions):
        part = root / "date=2026-12-05" / f"hour={hour:02d}"
        if not (part / "steps").exists():
            print(f"generating partition {hour + 1}/{partitions} ({tokens * layers:,} rows) ...", flush=True)
            shutil.rmtree(part, ignore_errors=True)
            generate(part, tokens, layers)
            add_steps(part, tokens)
    return root


def drop_caches(root: Path) -> None:
    from moetrace.report.distributed import cache_root

    shutil.rmtree(cache_root(root), ignore_errors=True)


def timed_report(root: Path, scratch: Path, *extra: str) -> tuple[float, dict[str, Any]]:
    from click.testing import CliRunner

    from moetrace.cli import main

    started = time.perf_counter()
    result = CliRunner().invoke(main, ["report", str(root), *REPORT_ARGS, "-o", str(scratch / "report.html"), *extra])
    wall = time.perf_counter() - started
    if result.exit_code != 0:
        sys.exit(f"report {' '.join(extra)} failed: {result.output[-2000:]}")
    report: dict[str, Any] = json.loads(result.stdout)
    report.pop("dashboard")  # where each child wrote it
    return wall, report


def child_one_machine(root: Path, scratch: Path) -> dict[str, Any]:
    from moetrace.report.inputs import open_run

    wall, report = timed_report(root, scratch)
    run = open_run(root, 3)
    return {"report_s": wall, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rows": run.routing_rows[run.primary.k], "report": report}


def child_ray(root: Path, scratch: Path, workers: int) -> dict[str, Any]:
    import ray

    from moetrace.analysis.placement import linear_placement
    from moetrace.report.distributed import summarised_partitions
    from moetrace.report.inputs import open_run
    from moetrace.report.windows import summary_request

    ray.init(num_cpus=workers, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    drop_caches(root)
    run = open_run(root, 3)
    trace = run.primary
    experts = trace.manifest.model.num_experts
    request = summary_request(trace, experts, 8, linear_placement(experts, 1), run.routing_rows[trace.k])
    started = time.perf_counter()
    results = summarised_partitions(trace, request, "auto")
    map_s = time.perf_counter() - started
    drop_caches(root)
    report_s, report = timed_report(root, scratch, "--ray", "auto")
    cached_s, cached_report = timed_report(root, scratch, "--ray", "auto")
    return {
        "workers": workers, "map_s": map_s, "report_s": report_s, "cached_report_s": cached_s,
        "rows": run.routing_rows[trace.k],
        "tasks": [{"rows": r.rows, "seconds": r.seconds, "peak_rss_bytes": r.peak_rss_bytes} for r in results],
        "report": report, "cached_report": cached_report,
    }


def in_child(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "child", *args], capture_output=True, text=True,
                          cwd=Path(__file__).parent)
    if done.returncode != 0:
        sys.exit(f"child {' '.join(args)} failed: {done.stderr.strip()[-3000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def same_report(mine: dict[str, Any], expected: dict[str, Any], label: str) -> None:
    if mine != expected:
        sys.exit(f"{label}: the report differs from the one-machine report")


@click.group(invoke_without_command=True)
@click.option("--partitions", default=8, show_default=True)
@click.option("--tokens", default=25_000, show_default=True, help="Decoded tokens per partition.")
@click.option("--layers", default=60, show_default=True)
@click.option("--cache", type=click.Path(path_type=Path), default=Path(tempfile.gettempdir()) / "moetrace-bench")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
@click.pass_context
def main(context: click.Context, partitions: int, tokens: int, layers: int, cache: Path,
         json_out: Path | None) -> None:
    if context.invoked_subcommand is not None:
        return
    root = recording(cache, partitions, tokens, layers)
    one = in_child("one-machine", str(root))
    rows = one["rows"]
    print(f"{partitions} partitions, {rows:,} rows. one machine: report {one['report_s']:.1f} s, peak "
          f"{one['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    measured = []
    for workers in (1, 2):
        found = in_child("ray", str(root), str(workers))
        same_report(found.pop("report"), one["report"], f"--ray at {workers} worker(s)")
        same_report(found.pop("cached_report"), one["report"], f"--ray at {workers} worker(s), from the cache")
        tasks = found["tasks"]
        found["rows_per_s_per_worker"] = rows / found["map_s"] / workers
        found["task_rows_per_s"] = sum(t["rows"] for t in tasks) / sum(t["seconds"] for t in tasks)
        found["peak_rss_bytes_per_worker"] = max(t["peak_rss_bytes"] for t in tasks)
        found["driver_s"] = found["report_s"] - found["map_s"]
        measured.append(found)
        print(f"{workers} worker(s): map {found['map_s']:.1f} s = {found['rows_per_s_per_worker'] / 1e6:.2f}M rows/s "
              f"per worker ({found['task_rows_per_s'] / 1e6:.2f}M inside a task), worker peak "
              f"{found['peak_rss_bytes_per_worker'] / 2**30:.2f} GiB; report {found['report_s']:.1f} s = "
              f"{one['report_s'] / found['report_s']:.2f}x the one-machine report's speed; from the cache "
              f"{found['cached_report_s']:.1f} s = {one['report_s'] / found['cached_report_s']:.2f}x", flush=True)
    widest = measured[-1]
    projection = {str(n): DAY_ROWS / (widest["rows_per_s_per_worker"] * n) + widest["driver_s"]
                  for n in PROJECTED_WORKERS}
    print(f"projected for {DAY_ROWS:.0e} rows at {widest['rows_per_s_per_worker'] / 1e6:.2f}M rows/s per worker "
          f"+ {widest['driver_s']:.1f} s of driver: " +
          ", ".join(f"{n} workers {seconds / 60:.1f} min" for n, seconds in projection.items()))
    if json_out is not None:
        command = f"benchmarks/bench_report_ray.py --partitions {partitions} --tokens {tokens} --layers {layers}"
        json_out.write_text(json.dumps({
            "command": f"{command} --json {json_out}", "rows": rows, "partitions": partitions,
            "one_machine": {key: value for key, value in one.items() if key != "report"},
            "ray": measured, "projected_day_s": projection, "day_rows": DAY_ROWS,
        }, indent=1) + "\n")


@main.command("child", hidden=True)
@click.argument("mode")
@click.argument("root", type=click.Path(path_type=Path))
@click.argument("workers", type=int, required=False)
def child(mode: str, root: Path, workers: int | None) -> None:
    with tempfile.TemporaryDirectory(prefix="moetrace-report-") as scratch:
        found = (child_one_machine(root, Path(scratch)) if mode == "one-machine" else
                 child_ray(root, Path(scratch), workers or 1))
    print(json.dumps(found))


if __name__ == "__main__":
    main()
