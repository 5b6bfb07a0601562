"""``--profile measured``: what a sweep's own recorded steps measured on the machine that recorded it (decode step
periods, vLLM's timed calls, the ``--k0-sync`` trace), gathered per concurrency as
``analysis.measured_steps.MeasuredSteps``."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from moetrace.analysis.acceptance import decode_step_periods, decode_steps
from moetrace.analysis.context import request_step_contexts, step_contexts
from moetrace.analysis.measured_steps import MeasuredSteps, per_k_from_nearest
from moetrace.trace.drafters import MODEL_DRAFTERS
from moetrace.analysis.decision import PHASE_COLUMNS, across_batches, growth_over_k0
from moetrace.errors import UserError
from moetrace.trace.reader import SWEEP_MODEL_KEYS, Trace, first_difference, open_trace
from moetrace.report.inputs import Run

MIN_BASELINE_STEPS = 5  # decode step pairs a measured k=0 step time rests on
# A concurrency the sweep ran at: its k=0 trace has at least this share of the decode step pairs it has at its most
# measured concurrency. The few steps a round passes through as it fills and drains (a closed loop at 16 drains
# through 14, 11, 8, ... a handful of steps each, their vLLM calls timed once or twice) are not measured enough to
# predict from: those concurrencies are estimated from the ones the sweep ran at, as any other.
RAN_AT_SHARE = 0.1
MIN_PHASE_CALLS = 3  # timed calls a phase's median rests on
# A concurrency the sweep passed through but did not run at: its k=0 decode step is measured where at least this many
# step pairs of the k=0 trace ran it (a closed loop at 16 with 3 rounds drains through each of 15 … 1 for about 20
# to 30 k=0 steps; a server's trace spreads over many); the mean of fewer steps than this is left to the estimate.
MIN_PASSED_STEPS = 20


def recorded_steps(run: Run) -> pl.DataFrame:
    """Every trace's decode steps per concurrency (``analysis.acceptance.decode_step_periods``, with k), where at
    least ``MIN_BASELINE_STEPS`` step pairs measured them, with what those steps spent in vLLM's calls
    (``recorded_phases``): the baseline and the check of --profile measured."""
    untimed = [str(t.path) for t in run.traces if t.lacks("step_timing")]
    if untimed:
        raise UserError(f"{untimed[0]}: imported without step timing: nothing measured to predict from (give "
                        f"--calibration or --profile instead of --profile measured)")
    per_trace = [decode_periods(t).with_columns(k=pl.lit(t.k, pl.Int32)) for t in run.traces]
    return pl.concat(per_trace).join(recorded_phases(run.traces), on=["k", "batch"], how="left")


def with_k0_steps_of(steps: pl.DataFrame, k0: Trace, baseline_steps: pl.DataFrame) -> pl.DataFrame:
    """``steps`` (``recorded_steps``) whose k=0 rows' step periods, pairs and tokens are those of the k=0 trace
    ``k0``'s steps ``baseline_steps`` alone (one context bucket's, ``decoding_step_contexts``): the k=0 step at that
    context. Everything else stays the whole trace's (vLLM's timed calls are not kept per step; prefill is paid
    over every step); a concurrency those steps did not measure keeps its row (its phases are what the k > 0 steps
    grow against) with no step."""
    measured_there = decode_periods(k0, baseline_steps.lazy()).select("batch", "decode_steps", "period_ms",
                                                                       "tokens_per_step")
    at_k0 = steps.filter(pl.col("k") == 0).drop("decode_steps", "period_ms", "tokens_per_step").join(
        measured_there, on="batch", how="left").with_columns(pl.col("decode_steps").fill_null(0))
    return pl.concat([at_k0.select(steps.columns), steps.filter(pl.col("k") != 0)])


def decode_periods(trace: Trace, only: pl.LazyFrame | None = None) -> pl.DataFrame:
    """``analysis.acceptance.decode_step_periods`` of ``trace`` (its decode steps ``only``, where given) at the
    concurrencies with at least ``MIN_BASELINE_STEPS`` step pairs (fewer measure no step time worth predicting
    from)."""
    return decode_step_periods(trace.steps(), only).filter(pl.col("decode_steps") >= MIN_BASELINE_STEPS)


def decoding_step_contexts(trace: Trace) -> pl.DataFrame:
    """The steps of ``trace`` in which every request decoded (``dp_rank, step``, ``requests``), with their requests'
    mean ``context`` and its ``bucket`` (``analysis.context.step_contexts``); a step none of whose requests the
    routing sampled (``one_request_in``) has none."""
    steps = trace.steps()
    contexts = request_step_contexts(trace.routing(), trace.manifest.model.moe_layers[0])
    decoding = decode_steps(steps).filter("decoding").select("dp_rank", "step", pl.col("requests").cast(pl.Int32))
    return step_contexts(steps, contexts).join(decoding, on=["dp_rank", "step"]).collect()


def phase_ms(trace: Trace, phase: str, timing: dict[str, Any]) -> float:
    """What one timed vLLM call costs a step: the longer of its host and device medians (the step waits for the
    longer), except a model drafter's call under async scheduling, whose host work (inputs, attention metadata,
    launches) runs while the device still computes the target's forward: there the device time."""
    host, device = float(timing["host_ms_median"]), timing.get("device_ms_median")
    if phase == "drafting" and device is not None and trace.manifest.capture.async_scheduling is True:
        return float(device)
    return max(host, float(device or 0.0))


def recorded_phases(traces: Sequence[Trace]) -> pl.DataFrame:
    """Per (k, batch): ms per step in vLLM's forward, sampling and drafting calls (``PHASE_COLUMNS``), from each
    trace's manifest ``phases`` (``phase_ms``); null where a trace did not time them (a trace without drafts has no
    drafting) or timed fewer than ``MIN_PHASE_CALLS`` calls (a median of one or two calls can be a one-off: a new
    input shape compiling)."""
    rows = [{"k": trace.k, "batch": int(batch), "phase": f"{phase}_ms", "ms": phase_ms(trace, phase, timing)}
            for trace in traces
            for phase, per_batch in trace.manifest.phases.items()
            for batch, timing in per_batch.items() if int(timing.get("calls", 0)) >= MIN_PHASE_CALLS]
    schema = {"k": pl.Int32, "batch": pl.Int32, **{name: pl.Float64 for name in PHASE_COLUMNS}}
    if not rows:
        return pl.DataFrame(schema=schema)
    wide = pl.DataFrame(rows).pivot(on="phase", index=["k", "batch"], values="ms")
    return wide.with_columns(pl.lit(None, pl.Float64).alias(name) for name in PHASE_COLUMNS
                             if name not in wide.columns).select(pl.col(name).cast(t) for name, t in schema.items())


def measured_baselines(run: Run, steps: pl.DataFrame, ran_at: Collection[int] | None = None) -> dict[int, float]:
    """The k=0 trace's decode step (start to start, ms) at each concurrency the sweep ran at (``RAN_AT_SHARE``;
    ``steps``: ``recorded_steps``); with ``ran_at`` (the whole sweep's, where ``steps`` hold one context bucket's
    k=0 steps), of those only: a concurrency a round drains through at long context is not one it ran at."""
    baseline = next((trace for trace in run.traces if trace.k == 0), None)
    if baseline is None:
        raise UserError(f"{run.path}: --profile measured needs a k=0 trace in the sweep (its steps are the baseline)")
    k0 = steps.filter(pl.col("k") == 0)
    most = int(k0["decode_steps"].max() or 0)  # type: ignore[arg-type]
    found = {int(row["batch"]): float(row["period_ms"]) for row in k0.to_dicts()
             if row["decode_steps"] >= max(RAN_AT_SHARE * most, 1) and (ran_at is None or row["batch"] in ran_at)}
    if not found:
        raise UserError(f"{baseline.path}: no run of {MIN_BASELINE_STEPS}+ decode steps at any concurrency to "
                        f"measure the k=0 step at")
    return found


def passed_baselines(steps: pl.DataFrame, ran_at: Collection[int]) -> dict[int, float]:
    """The k=0 trace's decode step (start to start, ms) at the concurrencies it passed through but did not run at
    (``ran_at``: ``measured_baselines``' keys), where ``MIN_PASSED_STEPS`` step pairs or more measured it: what the
    step costs there on the machine that recorded it, not a calibrated estimate (``steps``: ``recorded_steps``)."""
    k0 = steps.filter((pl.col("k") == 0) & (pl.col("decode_steps") >= MIN_PASSED_STEPS))
    return {int(row["batch"]): float(row["period_ms"]) for row in k0.to_dicts() if int(row["batch"]) not in ran_at}


def engine_slots(run: Run) -> int | None:
    """The most requests the sweep's engines ran at once (``max_num_seqs``, the manifests' batch size; None where a
    trace does not say): a step of more requests than that was never measured, nor near it."""
    sizes = [trace.manifest.batch_size for trace in run.traces]
    return None if any(size is None for size in sizes) else max(int(size or 0) for size in sizes)


def sync_trace(run: Run, path: Path) -> Trace:
    """``--k0-sync``: the trace at ``path``, checked to be a k=0 recording of the sweep's model with async scheduling
    off, beside a sweep whose k=0 ran with it on and whose k>0 traces ran with it off (as vLLM drafts n-gram)."""
    trace = open_trace(path)
    if trace.k != 0:
        raise UserError(f"{path}: --k0-sync needs one trace recorded at k=0")
    if trace.lacks("step_timing"):
        raise UserError(f"{path}: imported without step timing: --k0-sync needs its steps timed")
    if trace.manifest.capture.async_scheduling is True:
        raise UserError(f"{path}: recorded with async scheduling on; --k0-sync needs it off")
    k0 = next(t for t in run.traces if t.k == 0)
    if k0.manifest.capture.async_scheduling is False:
        raise UserError(f"{path}: the sweep's k=0 trace ran with async scheduling off already: no --k0-sync needed")
    differs = first_difference(run.primary.manifest.document, trace.manifest.document, SWEEP_MODEL_KEYS)
    if differs is not None:
        key, mine, theirs = differs
        raise UserError(f"{path}: not the sweep's model: {key} {theirs!r}, the sweep has {mine!r}")
    drafting = [t for t in run.traces if t.k > 0 and t.manifest.capture.async_scheduling is True]
    if drafting:
        raise UserError(f"{path}: --k0-sync, but {drafting[0].path} drafted with async scheduling on")
    return trace


def scheduling_costs(trace: Trace, baselines: dict[int, float], only: pl.DataFrame | None = None
                     ) -> dict[int, float]:
    """Per concurrency of ``baselines`` (the sweep's k=0 step, ms): how much longer a k=0 decode step took in
    ``sync_trace``, recorded with async scheduling off, which vLLM switches off to draft with n-gram: what every
    k>0 step pays for that switch; at a concurrency the sync trace did not run, ``across_batches`` of the ones both
    ran. ``only``: the sync trace's steps of the context bucket ``baselines`` were measured in."""
    found = {int(row["batch"]): float(row["period_ms"])
             for row in decode_periods(trace, None if only is None else only.lazy()).to_dicts()}
    both = {batch: found[batch] - baseline for batch, baseline in baselines.items() if batch in found}
    if not both:
        raise UserError(f"{trace.path}: no run of {MIN_BASELINE_STEPS}+ decode steps at a concurrency the sweep's k=0 "
                        f"trace ran at ({', '.join(map(str, sorted(baselines)))}; has: "
                        f"{', '.join(map(str, sorted(found))) or 'none'})")
    return {batch: across_batches(both, batch) for batch in baselines}


def measured_per_k(steps: pl.DataFrame, column: str, batches: Sequence[int], max_k: int,
                   scale_with_k: bool) -> dict[int, dict[int, float]] | None:
    """Per concurrency of ``batches``: ``column`` of ``recorded_steps`` (ms per step) at every k up to ``max_k``, from
    what the sweep's k > 0 traces measured at that concurrency, or at the nearest one that has it
    (``analysis.measured_steps.per_k_from_nearest`` across k); None when no trace measured it."""
    timed = steps.filter(pl.col("k") > 0).drop_nulls(column)
    if timed.is_empty():
        return None
    recorded = sorted(set(timed["batch"].to_list()))
    out = {}
    for batch in batches:
        at = timed.filter(pl.col("batch") == min(recorded, key=lambda b: (abs(b - batch), b)))
        out[batch] = per_k_from_nearest(dict(zip(at["k"].to_list(), at[column].to_list())), range(max_k + 1),
                                        scale_with_k)
    return out


def measured_steps(run: Run, steps: pl.DataFrame, max_k: int, sync: Trace | None,
                   sync_only: pl.DataFrame | None = None, ran_at: Collection[int] | None = None
                   ) -> dict[int, MeasuredSteps]:
    """Per concurrency the sweep's k=0 trace ran at, for k up to ``max_k``: what the sweep's own steps measured
    there (``analysis.measured_steps.MeasuredSteps``; ``steps``: ``recorded_steps``; ``sync``: the ``--k0-sync``
    trace, the k=0 steps run as the k>0 steps were, against which their phases grow; ``sync_only``: its steps of
    the context bucket ``steps`` measured the k=0 step in; ``ran_at``: ``measured_baselines``')."""
    baselines = measured_baselines(run, steps, ran_at)
    method = str(run.primary.manifest.spec.method)
    grew = growth_over_k0(steps, None if sync is None else recorded_phases([sync]))
    drafting = measured_per_k(steps, "drafting_ms", list(baselines), max_k, method in MODEL_DRAFTERS)
    sampling = measured_per_k(grew, "sampling_growth_ms", list(baselines), max_k, scale_with_k=False)
    scheduling = None if sync is None else scheduling_costs(sync, baselines, sync_only)
    out = {}
    prefill: dict[int, dict[int, float]] = {}
    for row in steps.drop_nulls("prefill_ms_per_token").to_dicts():
        prefill.setdefault(int(row["batch"]), {})[int(row["k"])] = float(row["prefill_ms_per_token"])
    for batch, baseline in baselines.items():
        # the forward's growth at this concurrency only: what it grew beyond the calibrated MoE depends on the
        # experts a step of this many requests reads
        forward = grew.filter((pl.col("batch") == batch) & (pl.col("k") > 0)).drop_nulls("forward_growth_ms")
        out[batch] = MeasuredSteps(baseline, dict(zip(forward["k"].to_list(), forward["forward_growth_ms"].to_list())),
                                   None if sampling is None else sampling[batch],
                                   None if drafting is None else drafting[batch],
                                   None if scheduling is None else scheduling[batch], prefill.get(batch, {}))
    return out
