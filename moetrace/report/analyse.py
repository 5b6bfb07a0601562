"""One ``RunAnalysis`` per TRACE argument (``analyse_run``), section by section in the order the report shows them:
the routing summary, acceptance, the routing's agreement with the steps table, budgets, what one step reads, the
prediction and its decision, placements, the self-check, the decision by context, crossovers and replayed
policies. ``report.payload`` shapes what it finds into the payload every renderer reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from moetrace.analysis.acceptance import acceptance_by_position, acceptance_totals, measured_speedup, step_times
from moetrace.analysis.adaptive import schedule_against_table, schedule_per_batch
from moetrace.analysis.budgets import WindowSample, smallest_budgets
from moetrace.analysis.consistency import disagreement, routing_gaps
from moetrace.analysis.context import BUCKET_LABELS, bucket_index, context_tables
from moetrace.analysis.decision import against_trace, crossover
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.growth import COUNTERFACTUAL, MEASURED, growth_table, rejected_only_experts
from moetrace.analysis.window_rows import WindowRows
from moetrace.analysis.routing_summary import RoutingSummary, SummaryRequest, summarise_routing
from moetrace.analysis.shape import ModelShape
from moetrace.analysis.traffic import step_bytes
from moetrace.errors import UserError
from moetrace.report.checks import self_check
from moetrace.report.contexts import ContextDecision, StepsAt, decide_at_contexts
from moetrace.report.distributed import partitioned_summary
from moetrace.report.inputs import Run, expert_placement, model_shape, parallel_size
from moetrace.report.measured import decode_periods, decoding_step_contexts, recorded_phases
from moetrace.report.options import Options
from moetrace.report.placements import EplbPolicy, placement_scores
from moetrace.report.policies import PolicyReplay, replayed_policies
from moetrace.report.prediction import Timing, forecast, measured_timing, prediction_deployment
from moetrace.report.step_reads import schedule_trace, scheduled_ks, step_inputs
from moetrace.report.windows import budget_curves_per_k, summary_request
from moetrace.trace.manifest import Manifest
from moetrace.trace.reader import Trace


@dataclass
class RunAnalysis:
    """What ``analyse_run`` found for one TRACE argument, section by section (``report.payload`` shapes it)."""

    run: Run
    shape: ModelShape
    tp: int
    ep: int
    growth: pl.DataFrame
    rejected_only: pl.DataFrame
    unions: pl.DataFrame  # what one step reads per (batch, k): analysis.concurrency.union_means, with acceptance
    step_bytes: pl.DataFrame
    acceptance_by_position: pl.DataFrame
    acceptance_per_k: pl.DataFrame
    disagreements: dict[int, str]  # k → how that trace's routing rows disagree with its steps table
    budget_source: str
    budget_curves: pl.DataFrame  # with a k column: one curve set per k in 1..max_k
    budget_share: float  # smallest share of windows behind a budget curve (1.0: all windows)
    budgets: pl.DataFrame  # smallest budget per layer at --k
    load: pl.DataFrame

    k: int  # the --k the figures are for
    prediction: pl.DataFrame | None = None  # predicted step per k at one request (analysis.cost.predict)
    prediction_basis: dict[str, Any] | None = None
    speedups: pl.DataFrame | None = None  # predicted step per (batch, k) (analysis.decision)
    against_trace: pl.DataFrame | None = None  # --profile measured: the prediction beside the sweep's own steps
    decision: pl.DataFrame | None = None  # recommended k per batch
    prediction_note: str | None = None  # why the preset could not predict
    placements: pl.DataFrame | None = None  # under EP: placements scored on held-out windows (report.placements)
    placement_note: str | None = None  # why they were not
    checks: list[str] = field(default_factory=list)  # the self-check's warnings (``self_check``)
    # the concurrency above which no k pays (``analysis.decision.crossover``): "predicted" over --batch, and
    # "measured" over the concurrencies the sweep recorded (--profile measured; else None)
    crossovers: dict[str, dict[str, Any] | None] | None = None
    policies: PolicyReplay | None = None  # k-choosing policies replayed per --batch (``analysis.policies``)
    # the primary trace's measurements per context bucket (``analysis.context``), and the share of steps they read
    by_context: dict[str, pl.DataFrame] = field(default_factory=dict)
    by_context_share: float = 1.0
    context_decision: ContextDecision | None = None  # --context: the decision per (context, batch)
    # an adaptive schedule's trace: what it did per concurrency beside the static table (``analysis.adaptive``)
    schedule: pl.DataFrame | None = None
    schedule_k: int | None = None  # the k its drafter drafted (the most it verified)

    @property
    def manifest(self) -> Manifest:
        return self.run.primary.manifest

    @property
    def source_at_k(self) -> str:
        return MEASURED if self.run.primary.k >= self.k else COUNTERFACTUAL


def analyse_run(run: Run, options: Options, eplb: EplbPolicy) -> RunAnalysis:
    """Every section of the report for ``run``, at ``options``; ``eplb``: vLLM's EPLB policy, the baseline placements
    are scored against under --ep (``report.placements``)."""
    trace = run.primary
    shape = model_shape(trace, options.shape_preset)
    tp = parallel_size(trace.manifest.parallel.tp, "tp", options.tp)
    ep = parallel_size(trace.manifest.parallel.ep, "ep", options.ep)
    placement = expert_placement(trace, ep, options.placement_file)
    request = summary_request(trace, shape.num_experts, options.max_k, placement, run.routing_rows[trace.k])
    summary, rows = _routing(trace, request, options, placing=ep > 1 and trace.k > 0)
    placements, placement_note = placement_scores(trace, rows, ep, eplb)
    del rows  # every row's experts (2 GB at 60M rows): let go before the windowed analyses take their own
    growth = growth_table(summary.growth, summary.proposals, shape.num_experts, shape.top_k, request.ks, trace.k)
    by_position, per_k = _acceptance(run)
    disagreements = _disagreements(run, summary)
    sample = WindowSample(summary.accepted, summary.stepped, request.share, trace.k, summary.proposals)
    curves, budget_share = budget_curves_per_k(run, sample, range(1, options.max_k + 1), shape)
    if trace.lacks("router_weights"):  # budgets are by routing-weight coverage
        curves = curves.clear()
    at_k = curves.filter(pl.col("k") == max(options.k, 1)).drop("k")
    timing = measured_timing(run, options)
    scheduled = schedule_trace(run)
    ran = decode_periods(scheduled) if scheduled is not None else None  # the concurrencies the schedule ran at
    schedule_at = [] if ran is None else ran["batch"].to_list()
    batches = sorted({1, *options.batches, *(timing.measured or {}), *schedule_at} - set(timing.unpriced))
    inputs = step_inputs(run, sample, shape, placement, options, batches)
    one_token = inputs.filter((pl.col("batch") == 1) & (pl.col("k") == 0))["ranks_touched"]
    bytes_table = step_bytes(inputs.filter(pl.col("batch") == 1), deployment_for(shape, tp, ep),
                             float(one_token.item()) if len(one_token) else 1.0)
    predicted = forecast(run, sample, inputs, shape, tp, ep, options, batches, timing, disagreements, schedule_at)
    fixed_k = ~pl.col("k").is_in(list(scheduled_ks(run)))  # an adaptive schedule's trace ran no fixed k
    checked = (against_trace(predicted.speedups, timing.steps.filter(fixed_k), None if timing.sync is None else
                             recorded_phases([timing.sync]))
               if timing.steps is not None and predicted.speedups is not None else None)
    analysis = RunAnalysis(
        run=run, shape=shape, tp=tp, ep=ep, growth=growth,
        rejected_only=rejected_only_experts(summary.rejected_only), unions=inputs, step_bytes=bytes_table,
        acceptance_by_position=by_position, acceptance_per_k=per_k, disagreements=disagreements,
        budget_source=MEASURED if trace.k == max(options.k, 1) else COUNTERFACTUAL, budget_curves=curves,
        budget_share=budget_share, budgets=smallest_budgets(at_k.lazy(), options.coverage), load=summary.load,
        k=options.k, prediction=predicted.prediction, prediction_basis=predicted.basis, speedups=predicted.speedups,
        against_trace=checked, decision=predicted.decision, prediction_note=predicted.note, placements=placements,
        placement_note=placement_note,
    )
    analysis.checks = self_check(predicted.speedups, predicted.basis, per_k.filter(fixed_k), inputs, bytes_table)
    if scheduled is not None and ran is not None:
        k0 = next((t for t in run.traces if t.k == 0), None)
        analysis.schedule_k = scheduled.k
        analysis.schedule = schedule_against_table(
            schedule_per_batch(scheduled.steps(), ran, scheduled.k, None if k0 is None else decode_periods(k0)),
            predicted.schedule, predicted.speedups, scheduled.k)

    def speedups_from(steps: Timing) -> pl.DataFrame | None:  # the prediction from another set of measured steps
        return forecast(run, sample, inputs, shape, tp, ep, options, batches, steps, disagreements, []).speedups

    _by_context(analysis, sample, trace, request, options, timing, disagreements, speedups_from)
    _crossovers_and_policies(analysis, checked, options, timing)
    return analysis


def _routing(trace: Trace, request: SummaryRequest, options: Options,
             placing: bool) -> tuple[RoutingSummary, WindowRows | None]:
    """The routing summary (``analysis.routing_summary``): one pass over the rows, or each partition as a Ray task
    (``--ray``: then no rows come back for the placements); the rows themselves where ``placing`` (the placements
    are compared on them)."""
    if options.ray is not None and trace.parts:
        return partitioned_summary(trace, request, options.ray), None
    return summarise_routing(trace.routing(), trace.steps(), request, keep_rows=placing)


def _acceptance(run: Run) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Acceptance by draft position and per k (with each k's step time, where its trace timed steps)."""
    by_position = pl.concat(
        [acceptance_by_position(t.steps(), t.k).with_columns(k=pl.lit(t.k, pl.Int32)) for t in run.traces]
    )
    per_k = measured_speedup(pl.concat(
        [pl.concat([acceptance_totals(t.steps()), step_times(t.steps())], how="horizontal")
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


def _by_context(analysis: RunAnalysis, sample: WindowSample, trace: Trace, request: SummaryRequest, options: Options,
                timing: Timing, disagreements: dict[int, str],
                speedups_from: Callable[[Timing], pl.DataFrame | None]) -> None:
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


def _measured_at(run: Run, options: Options, timing: Timing,
                 speedups_from: Callable[[Timing], pl.DataFrame | None]) -> dict[int, StepsAt]:
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
            bucket_timing = measured_timing(run, options, steps_in, timing)
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
                             timing: Timing) -> None:
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
