"""One ``RunAnalysis`` per TRACE argument (``analyse_run``), section by section in the order the report shows them:
the routing summary, acceptance, the routing's agreement with the steps table, budgets, what one step reads, the
prediction and its decision, placements, the self-check, the decision by context, crossovers and replayed
policies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from moetrace.analysis.acceptance import acceptance_by_position, acceptance_summary, measured_speedup, step_times
from moetrace.analysis.adaptive import schedule_against_table, schedule_per_batch
from moetrace.analysis.budgets import WindowSample, smallest_budgets
from moetrace.analysis.consistency import disagreement, routing_gaps
from moetrace.analysis.context import BUCKET_LABELS, bucket_index, context_tables
from moetrace.analysis.decision import against_trace, crossover, unpredicted
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.growth import COUNTERFACTUAL, MEASURED, WindowRows, growth_table, rejected_only_experts
from moetrace.analysis.measured_steps import MeasuredSteps
from moetrace.analysis.routing_summary import RoutingSummary, SummaryRequest, summarise_routing
from moetrace.analysis.shape import ModelShape
from moetrace.analysis.traffic import step_bytes
from moetrace.errors import UserError
from moetrace.report.checks import self_check
from moetrace.report.contexts import StepsAt, decide_at_contexts
from moetrace.report.distributed import partitioned_summary
from moetrace.report.inputs import Run, expert_placement, model_shape, parallel_size
from moetrace.report.measured import (
    decode_periods,
    decoding_step_contexts,
    measured_steps,
    passed_baselines,
    recorded_phases,
    recorded_steps,
    sync_trace,
    with_k0_steps_of,
)
from moetrace.report.placements import placement_scores
from moetrace.report.policies import replayed_policies
from moetrace.report.summary import (
    Options,
    RunAnalysis,
    budget_curves_per_k,
    prediction_deployment,
    run_prediction,
    schedule_inputs,
    schedule_trace,
    scheduled_ks,
    step_inputs,
    summary_request,
    unpriced_batches,
)
from moetrace.trace.reader import Trace


def analyse_run(run: Run, options: Options) -> RunAnalysis:
    trace = run.primary
    shape = model_shape(trace, options.shape_preset)
    tp = parallel_size(trace.manifest.parallel.tp, "tp", options.tp)
    ep = parallel_size(trace.manifest.parallel.ep, "ep", options.ep)
    placement = expert_placement(trace, ep, options.placement_file)
    request = summary_request(trace, shape.num_experts, options.max_k, placement, run.routing_rows[trace.k])
    summary, rows = _routing(trace, request, options)
    growth = growth_table(summary.growth, summary.proposals, shape.num_experts, shape.top_k, request.ks, trace.k)
    by_position, per_k = _acceptance(run)
    disagreements = _disagreements(run, summary)
    sample = WindowSample(summary.accepted, summary.stepped, request.share, trace.k, summary.proposals)
    curves, budget_share = budget_curves_per_k(run, sample, range(1, options.max_k + 1), shape)
    if trace.lacks("router_weights"):  # budgets are by routing-weight coverage
        curves = curves.clear()
    at_k = curves.filter(pl.col("k") == max(options.k, 1)).drop("k")
    timing = _timing(run, options)
    scheduled = schedule_trace(run)
    ran = decode_periods(scheduled) if scheduled is not None else None  # the concurrencies the schedule ran at
    schedule_at = [] if ran is None else ran["batch"].to_list()
    batches = sorted({1, *options.batches, *(timing.measured or {}), *schedule_at} - set(timing.unpriced))
    inputs = step_inputs(run, sample, shape, placement, options, batches)
    one_token = inputs.filter((pl.col("batch") == 1) & (pl.col("k") == 0))["ranks_touched"]
    bytes_table = step_bytes(inputs.filter(pl.col("batch") == 1), deployment_for(shape, tp, ep),
                             float(one_token.item()) if len(one_token) else 1.0)
    forecast = _forecast(run, sample, inputs, shape, tp, ep, options, batches, timing, disagreements, schedule_at)
    placements, placement_note = placement_scores(trace, rows, ep)
    fixed_k = ~pl.col("k").is_in(list(scheduled_ks(run)))  # an adaptive schedule's trace ran no fixed k
    checked = (against_trace(forecast.speedups, timing.steps.filter(fixed_k), None if timing.sync is None else
                             recorded_phases([timing.sync]))
               if timing.steps is not None and forecast.speedups is not None else None)
    analysis = RunAnalysis(
        run=run, shape=shape, tp=tp, ep=ep, growth=growth,
        rejected_only=rejected_only_experts(summary.rejected_only), unions=inputs, step_bytes=bytes_table,
        acceptance_by_position=by_position, acceptance_per_k=per_k, disagreements=disagreements,
        budget_source=MEASURED if trace.k == max(options.k, 1) else COUNTERFACTUAL, budget_curves=curves,
        budget_share=budget_share, budgets=smallest_budgets(at_k.lazy(), options.coverage), load=summary.load,
        k=options.k, prediction=forecast.prediction, prediction_basis=forecast.basis, speedups=forecast.speedups,
        against_trace=checked, decision=forecast.decision, prediction_note=forecast.note, placements=placements,
        placement_note=placement_note,
    )
    analysis.checks = self_check(forecast.speedups, forecast.basis, per_k.filter(fixed_k), inputs, bytes_table)
    if scheduled is not None and ran is not None:
        k0 = next((t for t in run.traces if t.k == 0), None)
        analysis.schedule_k = scheduled.k
        analysis.schedule = schedule_against_table(
            schedule_per_batch(scheduled.steps(), ran, scheduled.k, None if k0 is None else decode_periods(k0)),
            forecast.schedule, forecast.speedups, scheduled.k)

    def speedups_from(steps: _Timing) -> pl.DataFrame | None:  # the prediction from another set of measured steps
        return _forecast(run, sample, inputs, shape, tp, ep, options, batches, steps, disagreements, []).speedups

    _by_context(analysis, sample, trace, request, options, timing, disagreements, speedups_from)
    _crossovers_and_policies(analysis, checked, options, timing)
    return analysis


def _routing(trace: Trace, request: SummaryRequest, options: Options) -> tuple[RoutingSummary, WindowRows | None]:
    """The routing summary (``analysis.routing_summary``): one pass over the rows, or each partition as a Ray task
    (``--ray``: then no rows come back for the placements)."""
    if options.ray is not None and trace.parts:
        return partitioned_summary(trace, request, options.ray), None
    return summarise_routing(trace.routing(), trace.steps(), request)


def _acceptance(run: Run) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Acceptance by draft position and per k (with each k's step time, where its trace timed steps)."""
    by_position = pl.concat(
        [acceptance_by_position(t.steps(), t.k).with_columns(k=pl.lit(t.k, pl.Int32)) for t in run.traces]
    )
    per_k = measured_speedup(pl.concat(
        [pl.concat([acceptance_summary(t.steps()), step_times(t.steps())], how="horizontal")
         .with_columns(k=pl.lit(t.k, pl.Int32))
         .with_columns(step_ms=pl.lit(None, pl.Float64) if t.lacks("step_timing") else pl.col("step_ms"))
         for t in run.traces]
    ).select("k", pl.exclude("k")).lazy())
    return by_position, per_k


def _disagreements(run: Run, summary: RoutingSummary) -> dict[int, str]:
    """Per k, how that trace's routing rows disagree with its steps table (where they do)."""
    trace = run.primary
    gaps = {t.k: summary.gaps if t is trace else routing_gaps(t.routing(), t.steps(),
                                                             t.manifest.capture.one_request_in > 1)
            for t in run.traces}
    return {k: found for k, table in gaps.items() if (found := disagreement(table)) is not None}


@dataclass(frozen=True)
class _Timing:
    """What the sweep's own steps measured (``--profile measured``; all None, empty otherwise): its steps, the
    ``--k0-sync`` trace, per concurrency the steps as the cost model takes them and the k=0 trace's step where it
    passed through one, and the concurrencies no prediction can price (with why)."""

    steps: pl.DataFrame | None
    sync: Trace | None
    measured: dict[int, MeasuredSteps] | None
    passed: dict[int, float]
    unpriced: dict[int, str]


def _timing(run: Run, options: Options, steps_in: Callable[[Trace], pl.DataFrame] | None = None,
            whole: _Timing | None = None) -> _Timing:
    """What the sweep's steps measured; with ``steps_in`` (a trace's decoding steps of one context bucket) and the
    ``whole`` sweep's timing, the k=0 step (and the ``--k0-sync`` trace's) measured over those steps alone, at the
    concurrencies the whole sweep ran at."""
    if steps_in is None or whole is None:
        steps = recorded_steps(run) if options.measured_baseline else None
        sync = sync_trace(run, options.k0_sync) if steps is not None and options.k0_sync else None
        ran_at = None
    else:
        assert whole.steps is not None and whole.measured is not None
        k0 = next(t for t in run.traces if t.k == 0)
        steps, sync, ran_at = with_k0_steps_of(whole.steps, k0, steps_in(k0)), whole.sync, set(whole.measured)
    measured = (measured_steps(run, steps, options.max_k, sync,
                               None if steps_in is None or sync is None else steps_in(sync), ran_at)
                if steps is not None and options.predicts else None)
    passed = {} if steps is None or measured is None else passed_baselines(steps, measured)
    unpriced = unpriced_batches(run, options.batches) if measured is not None else {}
    return _Timing(steps, sync, measured, passed, unpriced)


@dataclass(frozen=True)
class _Forecast:
    """The prediction (at one request), the predicted steps per (batch, k), the decision and the prediction's
    basis; ``note``: why there is none, where there is not; ``schedule``: an adaptive schedule priced alike
    (``report.summary.Prediction``)."""

    speedups: pl.DataFrame | None = None
    prediction: pl.DataFrame | None = None
    decision: pl.DataFrame | None = None
    basis: dict[str, Any] | None = None
    note: str | None = None
    schedule: pl.DataFrame | None = None


def _forecast(run: Run, sample: WindowSample, inputs: pl.DataFrame, shape: ModelShape, tp: int, ep: int,
              options: Options, batches: list[int], timing: _Timing, disagreements: dict[int, str],
              schedule_at: list[int]) -> _Forecast:
    """The prediction and its decision, where one is asked for and the format can be priced, and the adaptive
    schedule priced alike at the concurrencies it ran at (``schedule_at``; not under uniform routing, which prices
    no trace's steps); a preset that cannot price this deployment leaves a note, a prediction the user asked for
    that cannot be made raises."""
    note = shape.unpriced_note()
    if note is not None:
        return _Forecast(decision=unpredicted(options.batches, note) if options.predicts else None, note=note)
    if not options.predicts:
        return _Forecast()
    trace = run.primary
    _, _, pred_ep, _ = prediction_deployment(shape, tp, ep, options)
    placement = expert_placement(trace, pred_ep, options.placement_file)
    pred_inputs = inputs if pred_ep == ep else step_inputs(run, sample, shape, placement, options, batches)
    schedule = (schedule_inputs(run, sample, shape, placement, pred_inputs, schedule_at)
                if schedule_at and options.routing == "measured" else None)
    try:
        found = run_prediction(run, pred_inputs, shape, tp, ep, options, timing.measured, timing.passed,
                               timing.unpriced, disagreements, schedule)
    except UserError as exc:
        if options.preset is None:  # the user asked for this prediction
            raise
        note = f"no prediction: {exc} (give --calibration or --profile for this deployment)"
        return _Forecast(decision=unpredicted(options.batches, note), note=note)
    return _Forecast(found.speedups, found.table, found.decision, found.basis, schedule=found.schedule)


def _by_context(analysis: RunAnalysis, sample: WindowSample, trace: Trace, request: SummaryRequest, options: Options,
                timing: _Timing, disagreements: dict[int, str],
                speedups_from: Callable[[_Timing], pl.DataFrame | None]) -> None:
    """The primary trace's measurements per context bucket, and, with ``--context``, the decision at each context:
    with ``--profile measured``, its k=0 step from the sweep's own steps in that context's bucket where it ran
    there."""
    analysis.by_context = context_tables(sample.stepped.lazy(), trace.steps(), trace.k,
                                         trace.manifest.model.moe_layers[0])
    analysis.by_context_share = request.share
    if options.contexts and analysis.speedups is not None:
        measured = _measured_at(analysis.run, options, timing, speedups_from) if options.measured_baseline else {}
        analysis.context_decision = decide_at_contexts(
            analysis.speedups, options.contexts,
            prediction_deployment(analysis.shape, analysis.tp, analysis.ep, options)[0], options.calibration,
            analysis.by_context.get("acceptance"), options.batches, disagreements, timing.unpriced, measured)


def _measured_at(run: Run, options: Options, timing: _Timing,
                 speedups_from: Callable[[_Timing], pl.DataFrame | None]) -> dict[int, StepsAt]:
    """Per ``--context``: where the sweep's k=0 trace ran ``MIN_BASELINE_STEPS`` or more decode step pairs in that
    context's bucket at a concurrency the whole sweep ran at (and the ``--k0-sync`` trace at one of those, when
    given), the prediction with the k=0 step measured there, moved from those steps' mean context; else why not (it
    is moved from the whole sweep's)."""
    k0 = next((t for t in run.traces if t.k == 0), None)
    if k0 is None or not timing.measured:
        return {}
    by_trace: dict[Path, pl.DataFrame] = {}

    def decoding_steps(trace: Trace) -> pl.DataFrame:  # one pass over each trace's routing for every bucket
        if trace.path not in by_trace:
            by_trace[trace.path] = decoding_step_contexts(trace)
        return by_trace[trace.path]

    found: dict[int, StepsAt] = {}
    for bucket in sorted({bucket_index(context) for context in options.contexts}):
        def steps_in(trace: Trace, bucket: int = bucket) -> pl.DataFrame:
            return decoding_steps(trace).filter(pl.col("bucket") == bucket)

        label = BUCKET_LABELS[bucket]
        try:
            bucket_timing = _timing(run, options, steps_in, timing)
            speedups = speedups_from(bucket_timing)
        except UserError as exc:  # too few of its steps there to measure from: moved from the whole sweep's
            found[bucket] = StepsAt(label, why=f"at {label} tokens: {exc}")
            continue
        assert bucket_timing.steps is not None and bucket_timing.measured is not None
        used = steps_in(k0).filter(pl.col("requests").is_in(list(bucket_timing.measured)))
        pairs = bucket_timing.steps.filter((pl.col("k") == 0) & pl.col("batch").is_in(list(bucket_timing.measured)))
        by_batch = dict(used.group_by("requests").agg(pl.col("context").mean()).iter_rows())
        found[bucket] = StepsAt(label, speedups, float(used["context"].mean()),  # type: ignore[arg-type]
                                int(pairs["decode_steps"].sum()), by_batch=by_batch)
    return {context: found[bucket_index(context)] for context in options.contexts}


def _crossovers_and_policies(analysis: RunAnalysis, checked: pl.DataFrame | None, options: Options,
                             timing: _Timing) -> None:
    """The concurrency above which no k pays, predicted and (``--profile measured``) measured, and the k-choosing
    policies replayed on the sweep."""
    speedups = analysis.speedups
    if speedups is None:
        return
    measured_speedups = (None if checked is None or checked.is_empty() else
                         checked.select("batch", "k", speedup="measured_speedup"))
    analysis.crossovers = {
        "predicted": crossover(speedups, [b for b in options.batches if b not in timing.unpriced], "predicted"),
        "measured": None if measured_speedups is None else crossover(
            measured_speedups, sorted(set(measured_speedups["batch"].to_list())), "measured")}
    analysis.policies = replayed_policies(analysis.run, speedups, analysis.decision, options.max_k)
