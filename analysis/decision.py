"""Which k to run at each concurrency: predicted speedup per (batch, k) from the batch-union cost model, and the k
that maximises it (0, "do not speculate", when no k beats plain decoding).

At concurrency B a verification step reads the union of B requests' windows (``analysis.concurrency``) and moves
B × the tokens a request-step reads (anchor + drafts proposed) through every all-reduce; each request still gains
its own accepted drafts, so the speedup is tokens per step per request over the step-time ratio to k = 0 at the
same B.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import polars as pl

from moetrace.analysis.cost import MeasuredSteps, predict
from moetrace.analysis.deployment import Deployment
from moetrace.analysis.profile import Profile
from moetrace.analysis.sources import Source
from moetrace.trace.schema import TIMED_CALLS

DEFAULT_BATCHES = (1, 8, 32, 128)


MIN_WINDOWS = 30
"""A recommendation rests on at least this many decoding request-steps (windows) at every k it compares, k = 0
included: fewer, and the table says so instead of recommending."""


def speedup_per_batch(inputs: pl.DataFrame, deployment: Deployment, profile: Profile | None,
                      calibration: Mapping[str, Any] | None, anchor: tuple[float, float],
                      measured: Mapping[int, MeasuredSteps] | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Per (batch, k): the prediction table of ``analysis.cost.predict`` with the inputs' other columns beside it.
    ``inputs``: batch, k, tokens (what the step moves), unique_experts, busiest_rank_experts (per layer, one step of
    ``batch`` requests), tokens_per_step (per request) and their sources and sample sizes. ``measured``: per batch,
    what the sweep's own steps measured there (``analysis.cost.MeasuredSteps``); only those batches are then
    predicted."""
    frames = []
    basis: dict[str, Any] = {}
    joined = inputs.sort("batch", "k")
    if measured is not None:
        joined = joined.filter(pl.col("batch").is_in(list(measured)))
    for (batch,), per_k in joined.group_by("batch", maintain_order=True):
        size = int(str(batch))
        table, basis = predict(per_k, replace(deployment, batch=size), profile, calibration, anchor,
                               None if measured is None else measured[size])
        beside = per_k.drop(*(name for name in table.columns if name != "k"), strict=False)
        frames.append(table.with_columns(batch=pl.lit(size, pl.Int32)).join(beside.drop("batch"), on="k"))
    basis.pop("batch", None)
    return pl.concat(frames).select("batch", pl.exclude("batch")), basis


def recommended_k(speedups: pl.DataFrame, disagreements: Mapping[int, str] | None = None) -> pl.DataFrame:
    """Per batch: the k with the largest predicted speedup among the k whose acceptance is not extrapolated, k = 0
    when none exceeds 1 (ties: the smaller k); ``larger_k_may_pay`` when an extrapolated k is predicted to do
    better (record larger k to know). ``windows``: the fewest decoding request-steps behind any k compared;
    ``steps``: measured steps behind the chosen k's union. ``status`` is "ok", or why no k is recommended: fewer
    than ``MIN_WINDOWS`` windows at a k compared, or the routing rows disagree with the steps table at a k
    compared (``disagreements``: k → what disagrees); then ``k`` and ``speedup`` are null and ``best_k`` says what
    the figures would have picked."""
    compared = speedups.filter(pl.col("acceptance_source") != Source.EXTRAPOLATED.value)
    chosen = (
        compared.sort("batch", pl.col("speedup").neg(), "k")
        .group_by("batch", maintain_order=True)
        .first()
        .select("batch", pl.when(pl.col("speedup") > 1.0).then(pl.col("k")).otherwise(0).alias("best_k"))
    )
    beyond = speedups.filter(pl.col("acceptance_source") == Source.EXTRAPOLATED.value).group_by("batch").agg(
        beyond=pl.col("speedup").max())
    sample = compared.group_by("batch").agg(windows=pl.col("request_steps").min(), ks=pl.col("k"))
    found = (
        chosen.join(speedups, left_on=["batch", "best_k"], right_on=["batch", "k"])
        .join(beyond, on="batch", how="left")
        .join(sample, on="batch")
        .with_columns(larger_k_may_pay=pl.col("beyond").fill_null(0.0) > pl.col("speedup"))
    )
    rows = []
    for row in found.sort("batch").to_dicts():
        problems = [f"routing and steps disagree at k={k}: {what}" for k, what in sorted((disagreements or {}).items())
                    if k in row["ks"]]
        if row["windows"] < MIN_WINDOWS:
            problems.insert(0, f"too few windows: {row['windows']} decoding request-steps at a k compared "
                               f"(a recommendation needs {MIN_WINDOWS})")
        ok = not problems
        rows.append({"batch": row["batch"], "k": row["best_k"] if ok else None, "best_k": row["best_k"],
                     "speedup": row["speedup"] if ok else None, "tokens_per_step": row["tokens_per_step"],
                     "step_ratio": row["step_ratio"], "unique_experts": row["unique_experts"],
                     "uniform_bound": row["uniform_bound"], "union_source": row["union_source"],
                     "acceptance_source": row["acceptance_source"], "larger_k_may_pay": row["larger_k_may_pay"],
                     "windows": row["windows"], "steps": row["steps"],
                     "status": "ok" if ok else "; ".join(problems)})
    schema = {"batch": pl.Int32(), "k": pl.Int32(), "best_k": pl.Int32(), "speedup": pl.Float64(),
              "tokens_per_step": pl.Float64(), "step_ratio": pl.Float64(), "unique_experts": pl.Float64(),
              "uniform_bound": pl.Float64(), "union_source": pl.String(), "acceptance_source": pl.String(),
              "larger_k_may_pay": pl.Boolean(), "windows": pl.Int64(), "steps": pl.Int64(), "status": pl.String()}
    return pl.DataFrame(rows, schema=schema, orient="row")


def batches_from(values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(values)))
    if not out or out[0] < 1:
        raise ValueError("concurrency values must be at least 1")
    return out


PHASE_COLUMNS = tuple(f"{call}_ms" for call in TIMED_CALLS)  # vLLM's calls a recorded step is timed in


def growth_over_k0(measured: pl.DataFrame, reference: pl.DataFrame | None = None) -> pl.DataFrame:
    """``measured`` (k, batch, period_ms and the ``PHASE_COLUMNS`` per recorded trace and concurrency) with what each
    step grew against the k = 0 step at the same batch: baseline_ms (that step), step_growth_ms, forward_growth_ms
    and sampling_growth_ms (null where k = 0 or the phase was not recorded). The phases grow against
    ``reference`` (batch, forward_ms, sampling_ms: a k = 0 trace run as the k > 0 steps were, e.g. with async
    scheduling off, whose own price is counted apart), by default against ``measured``'s k = 0 rows."""
    baseline = measured.filter(pl.col("k") == 0).select(
        "batch", baseline_ms=pl.col("period_ms"), baseline_tokens_per_step=pl.col("tokens_per_step"),
        baseline_prefill_ms_per_token=pl.col("prefill_ms_per_token"))
    phases = measured.filter(pl.col("k") == 0) if reference is None else reference
    phases = phases.select("batch", forward_k0=pl.col("forward_ms"), sampling_k0=pl.col("sampling_ms"))
    return (measured.join(baseline, on="batch", how="left").join(phases, on="batch", how="left")
            .with_columns(step_growth_ms=pl.col("period_ms") - pl.col("baseline_ms"),
                          forward_growth_ms=pl.col("forward_ms") - pl.col("forward_k0"),
                          sampling_growth_ms=pl.col("sampling_ms") - pl.col("sampling_k0"))
            .drop("forward_k0", "sampling_k0"))


def against_trace(speedups: pl.DataFrame, measured: pl.DataFrame,
                  reference: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per (batch, k > 0) that the sweep recorded: the predicted step and speedup beside those its traces measured
    on the machine that recorded them, what the prediction leaves out per step (measured − predicted step), and
    where the recorded step grew against k = 0 (``growth_over_k0``): in vLLM's forward, in its sampling (the
    rejection sampler), and the drafter's own time. ``measured``: k, batch, period_ms, tokens_per_step,
    prefill_ms_per_token (``analysis.acceptance.decode_step_periods`` of each trace, k = 0 included: the speedup is
    over it, at the same batch, each trace's own prefill time per token included as ``analysis.cost.
    end_to_end_speedup`` includes it), and the ``PHASE_COLUMNS`` (null where not timed); ``reference``: as
    ``growth_over_k0`` takes it."""
    per_token = pl.col("period_ms") / pl.col("tokens_per_step") + pl.col("prefill_ms_per_token")
    baseline_per_token = (pl.col("baseline_ms") / pl.col("baseline_tokens_per_step")
                          + pl.col("baseline_prefill_ms_per_token"))
    at_k = (growth_over_k0(measured, reference).filter((pl.col("k") > 0) & pl.col("baseline_ms").is_not_null())
            .with_columns(measured_speedup=baseline_per_token / per_token))
    return (
        speedups.select("batch", "k", predicted_step_ms="step_ms", predicted_tokens_per_step="tokens_per_step",
                        predicted_speedup="speedup")
        .join(at_k.select("batch", "k", "measured_speedup", "step_growth_ms", "forward_growth_ms",
                          "sampling_growth_ms", "drafting_ms", measured_step_ms="period_ms",
                          measured_tokens_per_step="tokens_per_step"), on=["batch", "k"])
        .with_columns(error=(pl.col("predicted_speedup") - pl.col("measured_speedup")) / pl.col("measured_speedup"),
                      unexplained_ms=pl.col("measured_step_ms") - pl.col("predicted_step_ms"))
        .sort("batch", "k")
    )
