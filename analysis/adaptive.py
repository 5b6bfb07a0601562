"""An adaptive schedule against the static table. A trace whose engine chose, request-step by request-step, how many
of the drafter's K drafts to verify (vLLM's adaptive verification: DSpark's confidence-scheduled verification,
vLLM PR #47808; ``SpecInfo.adaptive``) ran no fixed k: what the schedule did at each concurrency it ran at is
measured from its steps table, each request-step at its own k. The static table (one k per concurrency, vLLM's
``num_speculative_tokens_per_batch_size``) is predicted from the same trace at every fixed k ≤ K
(``acceptance.acceptance_per_k`` and ``concurrency.batch_unions`` with the trace scheduled). Both are priced by one
cost model, the schedule at its own reads (the unique experts its steps read, the tokens its request-steps verified,
K drafted): which pays more is read on one basis."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from moetrace.analysis.acceptance import decode_steps
from moetrace.analysis.decision import recommended_k
from moetrace.analysis.policies import MIN_GAIN
from moetrace.analysis.predicates import decoding
from moetrace.analysis.sources import Source, least_direct

SCHEDULE, TABLE, NEITHER = "adaptive schedule", "static table", "neither"  # which pays more (``pays_more``)


def schedule_per_batch(steps: pl.LazyFrame, periods: pl.DataFrame, trace_k: int,
                       baseline: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per concurrency of ``periods`` (``acceptance.decode_step_periods`` of the trace, at the concurrencies it ran
    at), what the schedule did over its steps of that many requests, every one decoding: their request-steps, the
    drafts each verified (``mean_drafts``, the k it used, and ``drafts_share``, the share that verified 0, 1, ...
    ``trace_k``), the tokens each gained (``tokens_per_step``), the mean step from start to the next step's start
    (``step_ms``, ``periods``' pairs: ``decode_steps``) and tokens per request per ms over those of the sweep's k=0
    trace at the same concurrency (``measured_speedup``; ``baseline``: its ``decode_step_periods``, null where it
    did not measure that concurrency or none is given)."""
    by_step = decode_steps(steps).filter(pl.col("decoding")).select(
        "dp_rank", "step", batch=pl.col("requests").cast(pl.Int32))
    drafts = pl.col("num_drafts")
    used = (steps.filter(decoding()).join(by_step, on=["dp_rank", "step"])
            .group_by("batch")
            .agg(request_steps=pl.len().cast(pl.Int64), mean_drafts=drafts.mean().cast(pl.Float64),
                 drafts_share=pl.concat_list([(drafts == d).mean().cast(pl.Float64) for d in range(trace_k + 1)]),
                 tokens_per_step=(pl.col("num_accepted") + 1).mean().cast(pl.Float64))
            .collect())
    k0 = (pl.DataFrame(schema={"batch": pl.Int32, "k0_step_ms": pl.Float64}) if baseline is None
          else baseline.select("batch", k0_step_ms="period_ms"))
    return (periods.select("batch", "decode_steps", step_ms="period_ms")
            .join(used, on="batch").join(k0, on="batch", how="left")
            .with_columns(measured_speedup=pl.when(pl.col("step_ms") > 0)  # steps of no duration time nothing
                          .then(pl.col("tokens_per_step") / pl.col("step_ms") * pl.col("k0_step_ms")))
            .drop("k0_step_ms").sort("batch"))


SCHEDULE_COLUMNS: dict[str, pl.DataType] = {
    "unique_experts": pl.Float64(), "union_source": pl.String(), "predicted_step_ms": pl.Float64(),
    "predicted_speedup": pl.Float64(), "speedup_source": pl.String(), "table_k": pl.Int32(),
    "table_speedup": pl.Float64(), "table_status": pl.String(), "pays_more": pl.String()}


def schedule_against_table(schedule: pl.DataFrame, priced: pl.DataFrame | None, static: pl.DataFrame | None,
                           trace_k: int) -> pl.DataFrame:
    """``schedule`` (``schedule_per_batch``) with, per concurrency: the schedule priced at its own reads
    (``priced``: ``decision.speedup_per_batch`` of its k = 0 and k = ``trace_k`` rows: the ``unique_experts`` per
    layer its steps read, each request-step at its own k, with their ``union_source``; ``predicted_step_ms``,
    ``predicted_speedup`` and ``speedup_source``, the least direct of its union and step), the static table's k
    there among the fixed k ≤ ``trace_k`` (``static``: the predicted speedups per (batch, k), chosen by
    ``decision.recommended_k``'s rule; ``table_k`` null and ``table_status`` why where it recommends none) with its
    ``table_speedup``, and ``pays_more``: the one whose predicted speedup beats the other's by at least ``MIN_GAIN``,
    else "neither"; null where either is not predicted."""
    batches = schedule["batch"].to_list()
    found = {row["batch"]: row for row in
             (priced.filter(pl.col("k") == trace_k).to_dicts() if priced is not None else [])}
    table = {row["batch"]: row for row in
             (recommended_k(static.filter(pl.col("k") <= trace_k), batches).to_dicts() if static is not None
              else [])}
    rows = []
    for row in schedule.to_dicts():
        mine, theirs = found.get(row["batch"]), table.get(row["batch"]) or {}
        speedup = None if mine is None else mine["speedup"]
        sources = [] if mine is None else [mine["union_source"], *([mine["step_source"]] if mine["step_source"]
                                                                    else [])]
        rows.append({**row, "unique_experts": None if mine is None else mine["unique_experts"],
                     "union_source": None if mine is None else mine["union_source"],
                     "predicted_step_ms": None if mine is None else mine["step_ms"],
                     "predicted_speedup": speedup,
                     "speedup_source": least_direct(Source(value) for value in sources).value if sources else None,
                     "table_k": theirs.get("k"), "table_speedup": theirs.get("speedup"),
                     "table_status": theirs.get("status", "nothing predicts the static table"),
                     "pays_more": pays_more(speedup, theirs.get("speedup"))})
    return pl.DataFrame(rows, schema={**schedule.schema, **SCHEDULE_COLUMNS}, orient="row")


def pays_more(schedule: float | None, table: float | None) -> str | None:
    """Which of the schedule's and the static table's predicted speedups pays more by at least ``MIN_GAIN`` (the
    replayed policies' margin: one cost model prices both, and a timed comparison does not resolve less)."""
    if schedule is None or table is None:
        return None
    if schedule >= table * (1 + MIN_GAIN):
        return SCHEDULE
    if table >= schedule * (1 + MIN_GAIN):
        return TABLE
    return NEITHER


def schedule_verdict(rows: Sequence[dict[str, object]]) -> list[str]:
    """Per concurrency of ``rows`` (``schedule_against_table``'s, as dicts), which pays more, in one line."""
    lines = []
    for row in rows:
        at = f"B={row['batch']}"
        if row["pays_more"] is None:
            why = ("the schedule is not priced" if row["predicted_speedup"] is None
                   else f"no static table: {row['table_status']}")
            lines.append(f"{at}: not compared: {why}")
            continue
        said = (f"the adaptive schedule {row['predicted_speedup']:.2f}x (k used {row['mean_drafts']:.2f} on "
                f"average), the static table k={row['table_k']} {row['table_speedup']:.2f}x")
        lines.append(f"{at}: {row['pays_more']} pays more: {said}" if row["pays_more"] != NEITHER
                     else f"{at}: neither pays more beyond {MIN_GAIN:.0%}: {said}")
    return lines
