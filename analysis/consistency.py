"""Whether a trace's routing rows agree with its steps table: every decoding request-step the steps table lists
should have all its tokens in the routing rows (a truncated or lost routing file leaves request-steps without
them, and figures from the rest would rest on a part of the run that nobody chose)."""

from __future__ import annotations

import polars as pl

from moetrace.analysis.predicates import decoding, not_prefill

KEYS = ["dp_rank", "step", "request"]


def routing_gaps(routing: pl.LazyFrame, steps: pl.LazyFrame, sampled_requests: bool = False) -> pl.DataFrame:
    """One row: decoding request-steps in the steps table, how many of them lack some of their tokens in the
    routing rows (``missing``: counted on the first recorded layer), and routed request-steps the steps table
    does not list (``unlisted``). ``sampled_requests``: the routing rows are of some requests only (one request in
    N), so only the request-steps of requests with routing rows are listed."""
    # the first layer found first: as a filter's own aggregate, Polars held every row's keys to take it (0.8 GB at
    # 60M rows)
    first_layer = routing.select(pl.col("layer").min()).collect().item()
    routed = (routing.filter(not_prefill() & (pl.col("layer") == first_layer))
              .group_by(KEYS).agg(routed_tokens=pl.len()))
    listed = steps.filter(decoding()).select(*KEYS, "num_tokens")
    if sampled_requests:
        listed = listed.join(routing.select("dp_rank", "request").unique(), on=["dp_rank", "request"], how="semi")
    return listed.join(routed, on=KEYS, how="full", coalesce=True).select(
        request_steps=pl.col("num_tokens").is_not_null().sum().cast(pl.Int64),
        missing=(pl.col("num_tokens").is_not_null()
                 & (pl.col("routed_tokens").fill_null(0) != pl.col("num_tokens"))).sum().cast(pl.Int64),
        unlisted=pl.col("num_tokens").is_null().sum().cast(pl.Int64),
    ).collect()


def disagreement(gaps: pl.DataFrame) -> str | None:
    """What ``routing_gaps`` found wrong, in a few words; None when the rows agree."""
    row = gaps.row(0, named=True)
    found = []
    if row["missing"]:
        found.append(f"{row['missing']} of {row['request_steps']} decoding request-steps lack routing rows")
    if row["unlisted"]:
        found.append(f"{row['unlisted']} routed request-steps are not in the steps table")
    return ", ".join(found) or None
