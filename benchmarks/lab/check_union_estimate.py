"""Estimated against measured unions where a sweep recorded: per k and concurrency, the unique experts a layer of
one step reads (mean over layers), measured over the trace's own steps of B requests, beside the estimate the report
makes where no step of B requests was recorded (``analysis.concurrency``), forced here at every B. Baseline: the
measured union; the ratio is estimate / measured.

    python benchmarks/lab/check_union_estimate.py SWEEP [--batches 8,16] [--per-request]

``--per-request``: every request its own prompt (one request-step from each of B requests, whatever their prompts).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import polars as pl

import moetrace.analysis.concurrency as concurrency
from moetrace.analysis.placement import linear_placement
from moetrace.report.inputs import open_run
from moetrace.report.step_reads import recorded_ks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--batches", default="8,16")
    parser.add_argument("--per-request", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    run = open_run(args.sweep, 0)
    model = run.primary.manifest.model
    recorded = {k: replace(traced, prompts={}) if args.per_request else traced
                for k, traced in recorded_ks(run).items()}
    placement = linear_placement(model.num_experts, 1)

    def means(unions: pl.DataFrame) -> pl.DataFrame:
        return unions.group_by("k", "batch").agg(pl.col("unique_experts").mean(), pl.col("source").first(),
                                                 pl.col("steps").min())

    ks = sorted(recorded)
    measured = means(concurrency.batch_unions(recorded, model.num_experts, model.top_k, placement, ks,
                                              batches)).filter(pl.col("source") == "measured")
    concurrency.MIN_MEASURED_STEPS = 1 << 62  # the estimate at every B
    estimated = means(concurrency.batch_unions(recorded, model.num_experts, model.top_k, placement, ks, batches))
    table = (measured.select("k", "batch", "steps", measured="unique_experts")
             .join(estimated.select("k", "batch", estimated="unique_experts"), on=["k", "batch"])
             .with_columns(ratio=pl.col("estimated") / pl.col("measured")).sort("k", "batch"))
    print(f"{args.sweep}: {'one request-step per request' if args.per_request else 'one request-step per prompt'}")
    with pl.Config(tbl_rows=-1, float_precision=3):
        print(table)


if __name__ == "__main__":
    main()
