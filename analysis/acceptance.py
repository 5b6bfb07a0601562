"""How many drafts verification accepts: per draft position, and mean accepted length per step."""

from __future__ import annotations

import polars as pl


def acceptance_by_position(routing: pl.LazyFrame) -> pl.DataFrame:
    """Per draft position 1..k: drafts proposed, accepted, and the acceptance rate (one row per token: the first
    recorded layer stands for all)."""
    return (
        routing.filter(
            (pl.col("phase").cast(pl.String) == "verify")
            & (pl.col("draft_pos") > 0)
            & (pl.col("layer") == pl.col("layer").min())
        )
        .group_by("draft_pos")
        .agg(proposed=pl.len().cast(pl.Int64), accepted=pl.col("accepted").fill_null(False).sum().cast(pl.Int64))
        .with_columns(acceptance_rate=pl.col("accepted") / pl.col("proposed"))
        .sort("draft_pos")
        .collect()
    )


def acceptance_summary(steps: pl.LazyFrame) -> pl.DataFrame:
    """One row: verification windows (request-steps with drafts), mean drafts and mean accepted length per window,
    and tokens gained per decoding request-step (1 + accepted; prefill chunks excluded)."""
    decoding = steps.filter(pl.col("num_tokens") == pl.col("num_drafts") + 1)
    with_drafts = pl.col("num_drafts") > 0
    return decoding.select(
        verify_windows=with_drafts.sum().cast(pl.Int64),
        mean_drafts=pl.col("num_drafts").filter(with_drafts).mean().cast(pl.Float64),
        mean_accepted=pl.col("num_accepted").filter(with_drafts).mean().cast(pl.Float64),
        tokens_per_step=(pl.col("num_accepted").mean() + 1).cast(pl.Float64),
    ).collect()


def step_times(steps: pl.LazyFrame) -> pl.DataFrame:
    """One row over the steps in which every request was decoding (no prefill chunk): how many, their median
    duration in ms (recorded wall-clock bounds: from vLLM's ``execute_model`` to its sync after sampling, drafting
    included) and median requests per step."""
    per_step = (
        steps.group_by("step")
        .agg(
            decoding=(pl.col("num_tokens") == pl.col("num_drafts") + 1).all(),
            duration_ms=((pl.col("t_end_ns") - pl.col("t_start_ns")).first() / 1e6),
            requests=pl.len(),
        )
        .filter(pl.col("decoding"))
    )
    return per_step.select(
        decode_steps=pl.len().cast(pl.Int64),
        step_ms=pl.col("duration_ms").median().cast(pl.Float64),
        requests_per_step=pl.col("requests").median().cast(pl.Float64),
    ).collect()


def decode_step_periods(steps: pl.LazyFrame) -> pl.DataFrame:
    """Per concurrency (``batch``: requests per step): the median time from one decode step's start to the next's,
    host scheduling between them included, over consecutive steps of the same requests count in which every
    request was decoding; how many such pairs there were; and the tokens each request gained per step in them
    (1 + accepted drafts). This is what each request waits per step, and what it gets for it."""
    per_step = (
        steps.group_by("step")
        .agg(decoding=(pl.col("num_tokens") == pl.col("num_drafts") + 1).all(), requests=pl.len(),
             t_start_ns=pl.col("t_start_ns").first(), kept=(pl.col("num_accepted") + 1).sum())
        .sort("step")
    )
    following = [pl.col(name).shift(-1).alias(f"next_{name}")
                 for name in ("step", "decoding", "requests", "t_start_ns")]
    return (
        per_step.with_columns(following)
        .filter(pl.col("decoding") & pl.col("next_decoding") & (pl.col("next_step") == pl.col("step") + 1)
                & (pl.col("next_requests") == pl.col("requests")))
        .group_by(batch=pl.col("requests").cast(pl.Int32))
        .agg(decode_steps=pl.len().cast(pl.Int64),
             period_ms=((pl.col("next_t_start_ns") - pl.col("t_start_ns")) / 1e6).median().cast(pl.Float64),
             tokens_per_step=(pl.col("kept").sum() / pl.col("requests").sum()).cast(pl.Float64))
        .sort("batch")
        .collect()
    )


def measured_speedup(per_k: pl.LazyFrame) -> pl.DataFrame:
    """``per_k`` (k, tokens_per_step, step_ms, one row per recorded k) with ``measured_speedup``: tokens per request
    per second at k over the same at k = 0, on the machine that recorded (null without a k = 0 recording)."""
    rate = pl.col("tokens_per_step") / pl.col("step_ms")
    baseline = rate.filter(pl.col("k") == 0).first()
    return per_k.with_columns(measured_speedup=rate / baseline).collect()
