"""Runs every analysis over each TRACE argument and gathers the results into one summary (the JSON form is what
``--json`` prints; the terminal tables and the dashboard render the same data)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.acceptance import (
    acceptance_by_position,
    acceptance_per_k,
    acceptance_summary,
    decode_step_periods,
    measured_speedup,
    step_times,
)
from moetrace.analysis.budgets import WindowSample, budget_curves, smallest_budgets, window_sample
from moetrace.analysis.concurrency import RecordedK, batch_unions, union_means, uniform_unions
from moetrace.analysis.consistency import disagreement, routing_gaps
from moetrace.analysis.cost import MODEL_DRAFTERS, MeasuredSteps, per_k_from_nearest
from moetrace.analysis.decision import (
    DEFAULT_BATCHES,
    PHASE_COLUMNS,
    against_trace,
    growth_over_k0,
    recommended_k,
    speedup_per_batch,
)
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.growth import (
    COUNTERFACTUAL,
    MEASURED,
    PER_BATCH,
    PER_REQUEST,
    best_window_estimate,
    decode_and_verify,
    growth,
    rejected_only_experts,
)
from moetrace.analysis.load import expert_load
from moetrace.analysis.profile import Profile
from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.analysis.sources import least_direct_expr
from moetrace.analysis.traffic import step_bytes
from moetrace.errors import UserError
from moetrace.reader import SWEEP_MODEL_KEYS, Trace, first_difference, open_trace
from moetrace.report.inputs import PredictionPreset, Run, expert_placement, model_shape, parallel_size

RANDOM_WEIGHTS_NOTE = "routing of a random-weight model: says nothing about a trained model's routing"


@dataclass(frozen=True)
class Options:
    k: int
    max_k: int
    coverage: float
    shape_preset: str | None
    tp: int | None
    ep: int | None
    placement_file: Path | None
    calibration: dict[str, Any] | None = None  # a moetrace-calibration/1 document
    calibration_path: Path | None = None
    profile: Profile | None = None
    acceptance: float | None = None  # per-draft acceptance rate given instead of the measured one
    routing: str = "measured"  # or "uniform": unique experts of uniformly random routing
    batches: tuple[int, ...] = DEFAULT_BATCHES  # concurrencies the decision is made for
    preset: PredictionPreset | None = None  # the shipped deployment assumption, used without calibration/profile
    measured_baseline: bool = False  # --profile measured: the sweep's own k=0 step times instead of a profile
    k0_sync: Path | None = None  # --k0-sync: a k=0 trace recorded with async scheduling off

    @property
    def predicts(self) -> bool:
        return self.calibration is not None or self.profile is not None


@dataclass
class RunAnalysis:
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

    k: int  # the --k the summary is for
    prediction: pl.DataFrame | None = None  # predicted step per k at one request (analysis.cost.predict)
    prediction_basis: dict[str, Any] | None = None
    speedups: pl.DataFrame | None = None  # predicted step per (batch, k) (analysis.decision)
    against_trace: pl.DataFrame | None = None  # --profile measured: the prediction beside the sweep's own steps
    decision: pl.DataFrame | None = None  # recommended k per batch
    prediction_note: str | None = None  # why the preset could not predict
    checks: list[str] = field(default_factory=list)  # the self-check's warnings (``self_check``)

    @property
    def manifest(self) -> dict[str, Any]:
        return self.run.primary.manifest

    @property
    def source_at_k(self) -> str:
        return MEASURED if self.run.primary.k >= self.k else COUNTERFACTUAL


# Budget curves per layer and k from at most this many windows per layer (and about this many over all layers):
# above it they come from a deterministic sample (4M rows took 22 s per k on 2 cores, so 60M rows took minutes per
# k); the report says so.
MIN_BASELINE_STEPS = 5  # decode step pairs a measured k=0 step time rests on
MIN_PHASE_CALLS = 3  # timed calls a phase's median rests on
MAX_BUDGET_WINDOWS = 5_000
MAX_BUDGET_WINDOWS_ALL_LAYERS = 30_000


def trace_windows(run: Run) -> WindowSample:
    """The rows every windowed analysis (budgets, batch unions) cuts its windows from, read once."""
    trace = run.primary
    candidates = int(trace.manifest.get("capture", {}).get("candidates") or 0) > 0
    return window_sample(trace.routing(), trace.k, ["experts", "weights",
                                                    *(["cand_experts", "cand_scores"] if candidates else [])])


def budget_curves_per_k(run: Run, sample: WindowSample, ks: range, expert_bytes: int) -> tuple[pl.DataFrame, float]:
    """Budget curves (with a k column) of the primary trace: its verification windows at its own k, counterfactual
    windows of accepted tokens at any other k. Also the smallest share of windows a k was computed from."""
    trace = run.primary
    use_candidates = "cand_experts" in sample.accepted.columns
    layers = len(trace.manifest["model"]["moe_layers"])
    per_layer = min(MAX_BUDGET_WINDOWS, max(500, MAX_BUDGET_WINDOWS_ALL_LAYERS // max(layers, 1)))
    frames, shares = [], []
    for k in ks:
        windows, share = sample.windows(k, trace.k == k, per_layer)
        frames.append(budget_curves(windows, expert_bytes, use_candidates).with_columns(k=pl.lit(k, pl.Int32)))
        shares.append(share)
    return pl.concat(frames), min(shares, default=1.0)


def sample_note(share: float) -> str | None:
    if share >= 1.0:
        return None
    return (f"budget curves come from a deterministic sample of at most {MAX_BUDGET_WINDOWS:,} windows per layer "
            f"(down to {share:.1%} of the windows)")


def step_inputs(run: Run, sample: WindowSample, shape: ModelShape, placement: npt.NDArray[np.int64],
                options: Options) -> pl.DataFrame:
    """Per (batch, k), for k = 0..max_k and batch 1 and every --batch: what one step reads (``union_means`` of
    ``analysis.concurrency``, or uniform routing's) beside the acceptance at k (``acceptance_per_k``), and the
    tokens the step moves (batch × tokens a request-step reads). The one table the cost model, the bytes, the
    decision and the self-check take."""
    ks, batches = range(options.max_k + 1), sorted({1, *options.batches})
    if options.routing == "uniform":
        unions = uniform_unions(shape.num_experts, shape.top_k, placement, ks, batches)
    else:
        recorded = {t.k: RecordedK(sample if t is run.primary else window_sample(t.routing(), t.k, ["experts"]),
                                   t.steps()) for t in run.traces}
        unions = batch_unions(sample, recorded, shape.num_experts, shape.top_k, placement, ks, batches)
    acceptance = acceptance_per_k({t.k: t.steps() for t in run.traces}, ks, options.acceptance)
    return (union_means(unions).join(acceptance, on="k")
            .with_columns(tokens=pl.col("batch").cast(pl.Float64) * pl.col("tokens_read")).sort("batch", "k"))


def prediction_deployment(trace_shape: ModelShape, tp: int, ep: int,
                          options: Options) -> tuple[ModelShape, int, int, list[str]]:
    """The shape and parallelism the prediction is for: the trace's, or, under the shipped preset, the preset's
    where the user gave none and the trace routes like it (same experts and top-k)."""
    preset = options.preset
    if preset is None or options.shape_preset is not None:
        return trace_shape, tp, ep, []
    shape = SHAPE_PRESETS[preset.shape]
    preset_tp, preset_ep = options.tp or preset.tp, options.ep or 1
    if (shape.num_experts, shape.top_k) != (trace_shape.num_experts, trace_shape.top_k):
        return trace_shape, preset_tp, preset_ep, [
            f"prediction preset {preset.name}: the trace routes over {trace_shape.num_experts} experts "
            f"top-{trace_shape.top_k}, not {preset.shape}'s: priced at the trace's own shape with "
            f"{preset.shape}'s calibration"]
    return shape, preset_tp, preset_ep, []


def recorded_steps(run: Run) -> pl.DataFrame:
    """Every trace's decode steps per concurrency (``analysis.acceptance.decode_step_periods``, with k), where at
    least ``MIN_BASELINE_STEPS`` step pairs measured them, with what those steps spent in vLLM's calls
    (``recorded_phases``): the baseline and the check of --profile measured."""
    per_trace = [decode_periods(t).with_columns(k=pl.lit(t.k, pl.Int32)) for t in run.traces]
    return pl.concat(per_trace).join(recorded_phases(run.traces), on=["k", "batch"], how="left")


def decode_periods(trace: Trace) -> pl.DataFrame:
    """``analysis.acceptance.decode_step_periods`` of ``trace`` at the concurrencies with at least
    ``MIN_BASELINE_STEPS`` step pairs (fewer measure no step time worth predicting from)."""
    return decode_step_periods(trace.steps()).filter(pl.col("decode_steps") >= MIN_BASELINE_STEPS)


def recorded_phases(traces: Sequence[Trace]) -> pl.DataFrame:
    """Per (k, batch): ms per step in vLLM's forward, sampling and drafting calls (``PHASE_COLUMNS``), from each
    trace's manifest ``phases``: the longer of the host and device medians (the step waits for the longer); null
    where a trace did not time them (a trace without drafts has no drafting) or timed fewer than
    ``MIN_PHASE_CALLS`` calls (a median of one or two calls can be a one-off: a new batch shape compiling)."""
    rows = [{"k": trace.k, "batch": int(batch), "phase": f"{phase}_ms",
             "ms": max(float(timing["host_ms_median"]), float(timing.get("device_ms_median") or 0.0))}
            for trace in traces
            for phase, per_batch in (trace.manifest.get("phases") or {}).items()
            for batch, timing in per_batch.items() if int(timing.get("calls", 0)) >= MIN_PHASE_CALLS]
    schema = {"k": pl.Int32, "batch": pl.Int32, **{name: pl.Float64 for name in PHASE_COLUMNS}}
    if not rows:
        return pl.DataFrame(schema=schema)
    wide = pl.DataFrame(rows).pivot(on="phase", index=["k", "batch"], values="ms")
    return wide.with_columns(pl.lit(None, pl.Float64).alias(name) for name in PHASE_COLUMNS
                             if name not in wide.columns).select(pl.col(name).cast(t) for name, t in schema.items())


def measured_baselines(run: Run, steps: pl.DataFrame, options: Options) -> dict[int, float]:
    """The k=0 trace's decode step (start to start, ms) at each asked concurrency it has steps of (``steps``:
    ``recorded_steps``)."""
    baseline = next((trace for trace in run.traces if trace.k == 0), None)
    if baseline is None:
        raise UserError(f"{run.path}: --profile measured needs a k=0 trace in the sweep (its steps are the baseline)")
    periods = steps.filter(pl.col("k") == 0)
    found = {int(row["batch"]): float(row["period_ms"]) for row in periods.to_dicts()
             if row["batch"] in options.batches}
    if not found:
        have = ", ".join(str(b) for b in periods["batch"].to_list()) or "none"
        raise UserError(f"{baseline.path}: no run of {MIN_BASELINE_STEPS}+ decode steps at concurrency "
                        f"{', '.join(map(str, options.batches))} to measure the k=0 step at (has: {have})")
    return found


def sync_trace(run: Run, path: Path) -> Trace:
    """``--k0-sync``: the trace at ``path``, checked to be a k=0 recording of the sweep's model with async scheduling
    off, beside a sweep whose k=0 ran with it on and whose k>0 traces ran with it off (as vLLM drafts n-gram)."""
    trace = open_trace(path)
    if trace.k != 0:
        raise UserError(f"{path}: --k0-sync needs one trace recorded at k=0")
    if trace.manifest.get("capture", {}).get("async_scheduling") is True:
        raise UserError(f"{path}: recorded with async scheduling on; --k0-sync needs it off")
    k0 = next(t for t in run.traces if t.k == 0)
    if k0.manifest.get("capture", {}).get("async_scheduling") is False:
        raise UserError(f"{path}: the sweep's k=0 trace ran with async scheduling off already: no --k0-sync needed")
    differs = first_difference(run.primary.manifest, trace.manifest, SWEEP_MODEL_KEYS)
    if differs is not None:
        key, mine, theirs = differs
        raise UserError(f"{path}: not the sweep's model: {key} {theirs!r}, the sweep has {mine!r}")
    drafting = [t for t in run.traces if t.k > 0 and t.manifest.get("capture", {}).get("async_scheduling") is True]
    if drafting:
        raise UserError(f"{path}: --k0-sync, but {drafting[0].path} drafted with async scheduling on")
    return trace


def scheduling_costs(trace: Trace, baselines: dict[int, float]) -> dict[int, float]:
    """Per concurrency of ``baselines`` (the sweep's k=0 step, ms): how much longer a k=0 decode step took in
    ``sync_trace``, recorded with async scheduling off, which vLLM switches off to draft with n-gram: what every
    k>0 step pays for that switch."""
    found = {int(row["batch"]): float(row["period_ms"]) for row in decode_periods(trace).to_dicts()}
    missing = [batch for batch in baselines if batch not in found]
    if missing:
        raise UserError(f"{trace.path}: no run of {MIN_BASELINE_STEPS}+ decode steps at concurrency {missing[0]} "
                        f"(has: {', '.join(map(str, sorted(found))) or 'none'})")
    return {batch: found[batch] - baseline for batch, baseline in baselines.items()}


def measured_per_k(steps: pl.DataFrame, column: str, batches: Sequence[int], max_k: int,
                   scale_with_k: bool) -> dict[int, dict[int, float]] | None:
    """Per concurrency of ``batches``: ``column`` of ``recorded_steps`` (ms per step) at every k up to ``max_k``, from
    what the sweep's k > 0 traces measured at that concurrency, or at the nearest one that has it
    (``analysis.cost.per_k_from_nearest`` across k); None when no trace measured it."""
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


def measured_steps(run: Run, steps: pl.DataFrame, options: Options, sync: Trace | None) -> dict[int, MeasuredSteps]:
    """Per asked concurrency the sweep's k=0 trace ran at: what the sweep's own steps measured there
    (``analysis.cost.MeasuredSteps``; ``steps``: ``recorded_steps``; ``sync``: the ``--k0-sync`` trace, the k=0
    steps run as the k>0 steps were, against which their phases grow)."""
    baselines = measured_baselines(run, steps, options)
    method = str(run.primary.manifest["spec"].get("method"))
    grew = growth_over_k0(steps, None if sync is None else recorded_phases([sync]))
    drafting = measured_per_k(steps, "drafting_ms", list(baselines), options.max_k, method in MODEL_DRAFTERS)
    sampling = measured_per_k(grew, "sampling_growth_ms", list(baselines), options.max_k, scale_with_k=False)
    scheduling = None if sync is None else scheduling_costs(sync, baselines)
    out = {}
    prefill = {int(row["batch"]): float(row["prefill_ms_per_token"] or 0.0)
               for row in steps.filter(pl.col("k") == 0).to_dicts()}
    for batch, baseline in baselines.items():
        # the forward's growth at this concurrency only: what it grew beyond the calibrated MoE depends on the
        # experts a step of this many requests reads
        forward = grew.filter((pl.col("batch") == batch) & (pl.col("k") > 0)).drop_nulls("forward_growth_ms")
        out[batch] = MeasuredSteps(baseline, dict(zip(forward["k"].to_list(), forward["forward_growth_ms"].to_list())),
                                   None if sampling is None else sampling[batch],
                                   None if drafting is None else drafting[batch],
                                   None if scheduling is None else scheduling[batch], prefill[batch])
    return out


def run_prediction(run: Run, inputs: pl.DataFrame, shape: ModelShape, tp: int, ep: int, options: Options,
                   steps: pl.DataFrame | None, sync: Trace | None, disagreements: dict[int, str]
                   ) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, dict[str, Any]]:
    """Per (batch, k) predicted steps, the per-k prediction at the fewest requests predicted, and the recommended
    k per batch, from ``step_inputs`` (at the prediction's placement)."""
    if options.acceptance is None and max(t.k for t in run.traces) == 0:
        raise UserError(f"{run.primary.path}: no verified drafts to measure acceptance from; give --acceptance RATE")
    pred_shape, pred_tp, pred_ep, preset_notes = prediction_deployment(shape, tp, ep, options)
    # the step a profile measured: one request's window of its tokens (k = tokens - 1), read at batch 1
    tokens = options.profile.tokens if options.profile is not None else 1
    at = inputs.filter((pl.col("batch") == 1) & (pl.col("k") == tokens - 1))
    if at.is_empty():
        raise UserError(f"--profile tokens={tokens}: its step is one request's window of {tokens} tokens, "
                        f"k={tokens - 1}: give --max-k {tokens - 1} or more")
    anchor = (float(at["unique_experts"].item()), float(at["busiest_rank_experts"].item()))
    measured = measured_steps(run, steps, options, sync) if steps is not None else None
    try:
        speedups, basis = speedup_per_batch(inputs, deployment_for(pred_shape, pred_tp, pred_ep),
                                            options.profile, options.calibration, anchor, measured)
    except ValueError as exc:
        raise UserError(f"{options.calibration_path or 'prediction'}: {exc}") from None
    # the per-k table is for one request, or for the fewest requests predicted (--profile measured predicts only
    # the concurrencies its k=0 trace ran at)
    per_k_batch = int(speedups["batch"].min())  # type: ignore[arg-type]
    table = speedups.filter(pl.col("batch") == per_k_batch).drop("batch")
    basis["notes"] = preset_notes + basis["notes"]
    basis["per_k_batch"] = per_k_batch
    basis["routing"] = options.routing
    basis["acceptance"] = options.acceptance
    basis["shape"] = options.shape_preset or (options.preset.shape if pred_shape is not shape and options.preset
                                              else "manifest")
    basis["calibration"] = str(options.calibration_path) if options.calibration_path else None
    basis["profile"] = f"profile {options.profile.source}" if options.profile else None
    basis["preset"] = options.preset.label if options.preset else None
    basis["expert_bytes"], basis["moe_layers"] = pred_shape.expert_bytes, pred_shape.moe_layers
    basis["same_shape"] = pred_shape == shape and (pred_tp, pred_ep) == (tp, ep)
    if options.calibration is not None:
        device = options.calibration.get("device", {})
        basis["calibration_device"] = f"{device.get('name')} x{device.get('count')}"
    decision = recommended_k(speedups.filter(pl.col("batch").is_in(list(options.batches))), disagreements)
    return speedups, table, decision, basis


def self_check(analysis: RunAnalysis) -> list[str]:
    """At every recorded k, the prediction's inputs against the measured tables of the same report: tokens per
    step (the acceptance table), unique experts per (batch, k) (the table of what a step reads) and expert bytes
    (the bytes table, where both price the same shape); a difference over ``CHECK_TOLERANCE`` is a warning naming
    both numbers."""
    if analysis.speedups is None or analysis.prediction_basis is None:
        return []
    found = []
    measured = {int(row["k"]): row for row in analysis.acceptance_per_k.to_dicts()}
    unions = {(int(row["batch"]), int(row["k"])): row for row in analysis.unions.to_dicts()}
    byte_rows = {int(row["k"]): row for row in analysis.step_bytes.to_dicts()}

    def compare(what: str, predicted: float, table: str, value: float | None) -> None:
        if value is None:
            return
        if abs(predicted - value) > CHECK_TOLERANCE * max(abs(value), 1e-12):
            found.append(f"self-check: the prediction's {what} is {predicted:.4g}, the {table} measured {value:.4g} "
                         f"({(predicted - value) / value:+.1%})")

    for row in analysis.speedups.to_dicts():
        k, batch = int(row["k"]), int(row["batch"])
        if k not in measured:
            continue
        where = f"at k={k}, {batch} request(s)"
        compare(f"tokens per step {where}", row["tokens_per_step"], "acceptance table", measured[k]["tokens_per_step"])
        union = unions.get((batch, k))
        if union is not None:
            compare(f"unique experts per layer {where}", row["unique_experts"], "table of what a step reads",
                    union["unique_experts"])
        if batch == 1 and analysis.prediction_basis["same_shape"] and k in byte_rows:
            compare(f"expert bytes per step {where}", row["expert_weight_bytes"], "bytes table",
                    byte_rows[k]["expert_weight_bytes"])
    return found


CHECK_TOLERANCE = 0.01


def analyse_run(run: Run, options: Options) -> RunAnalysis:
    trace = run.primary
    shape = model_shape(trace, options.shape_preset)
    tp = parallel_size(trace, "tp", options.tp)
    ep = parallel_size(trace, "ep", options.ep)
    placement = expert_placement(trace, ep, options.placement_file)
    routing = trace.routing()
    rows = decode_and_verify(routing)
    growth_table = growth(
        routing, shape.num_experts, shape.top_k, range(options.max_k + 1), trace.k, placement, rows
    )
    by_position = pl.concat(
        [acceptance_by_position(t.steps(), t.k).with_columns(k=pl.lit(t.k, pl.Int32)) for t in run.traces]
    )
    per_k = measured_speedup(pl.concat(
        [pl.concat([acceptance_summary(t.steps()), step_times(t.steps())], how="horizontal")
         .with_columns(k=pl.lit(t.k, pl.Int32)) for t in run.traces]
    ).select("k", pl.exclude("k")).lazy())
    disagreements = {t.k: found for t in run.traces
                     if (found := disagreement(routing_gaps(t.routing(), t.steps()))) is not None}
    sample = trace_windows(run)
    curves, budget_share = budget_curves_per_k(run, sample, range(1, options.max_k + 1), shape.expert_bytes)
    at_k = curves.filter(pl.col("k") == max(options.k, 1)).drop("k")
    inputs = step_inputs(run, sample, shape, placement, options)
    one_token = inputs.filter((pl.col("batch") == 1) & (pl.col("k") == 0))["ranks_touched"]
    bytes_table = step_bytes(inputs.filter(pl.col("batch") == 1), deployment_for(shape, tp, ep),
                             float(one_token.item()) if len(one_token) else 1.0)
    speedups = prediction = decision = basis = None
    steps = recorded_steps(run) if options.measured_baseline else None
    sync = sync_trace(run, options.k0_sync) if steps is not None and options.k0_sync else None
    prediction_note = None
    if options.predicts:
        _, _, pred_ep, _ = prediction_deployment(shape, tp, ep, options)
        pred_inputs = inputs if pred_ep == ep else step_inputs(
            run, sample, shape, expert_placement(trace, pred_ep, options.placement_file), options)
        try:
            speedups, prediction, decision, basis = run_prediction(run, pred_inputs, shape, tp, ep, options, steps,
                                                                   sync, disagreements)
        except UserError as exc:
            if options.preset is None:  # the user asked for this prediction
                raise
            prediction_note = f"no prediction: {exc} (give --calibration or --profile for this deployment)"
    checked = (against_trace(speedups, steps, None if sync is None else recorded_phases([sync]))
               if steps is not None and speedups is not None else None)
    analysis = RunAnalysis(
        run=run,
        shape=shape,
        tp=tp,
        ep=ep,
        growth=growth_table,
        rejected_only=rejected_only_experts(rows, shape.num_experts),
        unions=inputs,
        step_bytes=bytes_table,
        acceptance_by_position=by_position,
        acceptance_per_k=per_k,
        disagreements=disagreements,
        budget_source=MEASURED if trace.k == max(options.k, 1) else COUNTERFACTUAL,
        budget_curves=curves,
        budget_share=budget_share,
        budgets=smallest_budgets(at_k.lazy(), options.coverage),
        load=expert_load(rows, shape.num_experts),
        k=options.k,
        prediction=prediction,
        prediction_basis=basis,
        speedups=speedups,
        against_trace=checked,
        decision=decision,
        prediction_note=prediction_note,
    )
    analysis.checks = self_check(analysis)
    return analysis


def growth_overview(growth_table: pl.DataFrame) -> pl.DataFrame:
    """Per k, the mean over layers of each series: measured per request and per batch, counterfactual, the uniform
    bound, locality, and the per-rank view of the best per-request estimate (measured where recorded)."""
    series = (
        growth_table.group_by("k")
        .agg(
            *[
                pl.col("unique_experts").filter((pl.col("source") == source) & (pl.col("scope") == scope)).mean()
                .alias(name)
                for name, source, scope in (
                    ("measured_request", MEASURED, PER_REQUEST),
                    ("measured_batch", MEASURED, PER_BATCH),
                    ("counterfactual", COUNTERFACTUAL, PER_REQUEST),
                )
            ],
            pl.col("uniform_bound").drop_nulls().first(),
        )
    )
    best = (
        best_window_estimate(growth_table.lazy())
        .group_by("k")
        .agg(
            least_direct_expr("source").alias("source"),
            pl.col("unique_experts").mean().alias("best"),
            pl.col("busiest_rank_experts").mean(),
            pl.col("ranks_touched").mean(),
        )
        .collect()
    )
    return (
        series.join(best, on="k")
        .with_columns(locality=pl.col("best") / pl.col("uniform_bound"))
        .select(
            "k", "source", "measured_request", "measured_batch", "counterfactual", "uniform_bound", "locality",
            "busiest_rank_experts", "ranks_touched",
        )
        .sort("k")
    )


def notes(analysis: RunAnalysis, k: int) -> list[str]:
    found = []
    if analysis.manifest["model"].get("random_weights"):
        found.append(RANDOM_WEIGHTS_NOTE)
    if analysis.run.primary.k < k:
        found.append(
            f"recorded at k={analysis.run.primary.k}: figures at k={k} are counterfactual "
            f"(windows of {k + 1} consecutive accepted tokens)"
        )
    if analysis.budget_source == COUNTERFACTUAL:
        found.append(f"budgets at k={max(k, 1)} use counterfactual windows of accepted tokens")
    sampled = sample_note(analysis.budget_share)
    if sampled is not None:
        found.append(sampled)
    if analysis.prediction_note is not None:
        found.append(analysis.prediction_note)
    if analysis.prediction_basis is not None and analysis.prediction_basis["allreduce_extrapolated"]:
        found.append(f"prediction: all-reduce time is {analysis.prediction_basis['allreduce']}")
    found += [f"k={k}: routing and steps disagree: {what}" for k, what in sorted(analysis.disagreements.items())]
    return found + analysis.checks + analysis.run.warnings


def prediction_summary(analysis: RunAnalysis, k: int) -> dict[str, Any] | None:
    if analysis.prediction is None:
        return None
    at_k = analysis.prediction.filter(pl.col("k") == k).to_dicts()
    return {"basis": analysis.prediction_basis, "at_k": at_k[0] if at_k else None,
            "per_k": analysis.prediction.to_dicts(),
            "per_batch": analysis.speedups.to_dicts() if analysis.speedups is not None else [],
            "against_trace": analysis.against_trace.to_dicts() if analysis.against_trace is not None else []}


def budget_summary(analysis: RunAnalysis, coverage: float) -> dict[str, Any]:
    chosen = analysis.budgets
    budgets = chosen["budget"]
    return {
        "k": max(analysis.k, 1),
        "source": analysis.budget_source,
        "coverage_target": coverage,
        "min_budget": int(budgets.min()) if len(budgets) else None,  # type: ignore[arg-type]
        "median_budget": float(budgets.median()) if len(budgets) else None,  # type: ignore[arg-type]
        "max_budget": int(budgets.max()) if len(budgets) else None,  # type: ignore[arg-type]
        # per verification window, over the model's MoE layers (mean per recorded layer × MoE layers)
        "bytes_saved_per_window": float(chosen["bytes_saved"].mean()) * analysis.shape.moe_layers  # type: ignore[arg-type]
        if len(chosen)
        else None,
        "per_layer": chosen.to_dicts(),
    }


def decision_summary(analysis: RunAnalysis, options: Options) -> dict[str, Any] | None:
    """Per concurrency: the recommended k, its predicted speedup, what it rests on, and the expert budget per
    request window at that k (experts and bytes it saves, priced at the prediction's shape)."""
    if analysis.decision is None or analysis.prediction_basis is None:
        return None
    basis = analysis.prediction_basis
    rows = []
    for row in analysis.decision.to_dicts():
        budget = None
        if row["k"] is not None and row["k"] >= 1:
            chosen = smallest_budgets(analysis.budget_curves.filter(pl.col("k") == row["k"]).drop("k").lazy(),
                                      options.coverage)
            saved = float(chosen["experts_saved"].mean()) if len(chosen) else 0.0  # type: ignore[arg-type]
            budget = {
                "median": float(chosen["budget"].median()) if len(chosen) else None,  # type: ignore[arg-type]
                "experts_saved_per_layer": saved,
                "bytes_saved_per_window": saved * basis["expert_bytes"] * basis["moe_layers"],
                "shape": basis["shape"],
                "source": MEASURED if analysis.run.primary.k == row["k"] else COUNTERFACTUAL,
            }
        rows.append({**row, "budget": budget})
    return {
        "drafter": analysis.manifest["spec"].get("method") or "none",
        "label": analysis.run.label,
        "acceptance": "measured" if options.acceptance is None else f"given {options.acceptance:g} per draft",
        "based_on": basis["preset"] or " + ".join(
            part for part in (basis["calibration"], basis.get("profile")) if part),
        "coverage_target": options.coverage,
        "shape": basis["shape"] if basis["shape"] != "manifest" else f"{analysis.manifest['model'].get('name')} "
                                                                      "(as recorded)",
        "per_batch": rows,
    }


def summary_json(analyses: list[RunAnalysis], options: Options) -> dict[str, Any]:
    """Everything the terminal shows, as plain JSON-able data."""
    k = options.k
    runs = []
    for analysis in analyses:
        model = analysis.manifest["model"]
        overview = growth_overview(analysis.growth)
        bytes_at_k = analysis.step_bytes.filter(pl.col("k") == k).to_dicts()
        runs.append(
            {
                "label": analysis.run.label,
                "path": str(analysis.run.path),
                "model": str(model.get("name")),
                "random_weights": bool(model.get("random_weights")),
                "spec_method": analysis.manifest["spec"].get("method"),
                "recorded_k": [trace.k for trace in analysis.run.traces],
                "primary_k": analysis.run.primary.k,
                "source_at_k": analysis.source_at_k,
                "shape": options.shape_preset or f"{model.get('name')} (as recorded)",
                "tp": analysis.tp,
                "ep": analysis.ep,
                "notes": notes(analysis, k),
                "growth_at_k": next(iter(overview.filter(pl.col("k") == k).to_dicts()), None),
                "growth_overview": overview.to_dicts(),
                "bytes_at_k": bytes_at_k[0] if bytes_at_k else None,
                "acceptance_per_k": analysis.acceptance_per_k.to_dicts(),
                "step_reads": analysis.unions.to_dicts(),
                "checks": analysis.checks,
                "disagreements": {str(k): what for k, what in analysis.disagreements.items()},
                "acceptance_by_position": analysis.acceptance_by_position.to_dicts(),
                "rejected_only": analysis.rejected_only.to_dicts(),
                "budget": budget_summary(analysis, options.coverage),
                "prediction": prediction_summary(analysis, k),
                "growth": analysis.growth.to_dicts(),
                "step_bytes": analysis.step_bytes.to_dicts(),
                **dashboard_data(analysis),
            }
        )
    decisions = [decision for decision in (decision_summary(a, options) for a in analyses) if decision]
    warnings = [f"{analysis.run.label}: {line}" for analysis in analyses
                for line in [*(f"k={k}: routing and steps disagree: {what}"
                               for k, what in sorted(analysis.disagreements.items())), *analysis.checks]]
    warnings += [f"{decision['label']}: no recommendation at {row['batch']} request(s) per step: {row['status']}"
                 for decision in decisions for row in decision["per_batch"] if row["status"] != "ok"]
    return {"decision": decisions, "warnings": warnings, "k": k, "coverage_target": options.coverage, "runs": runs}


def dashboard_data(analysis: RunAnalysis) -> dict[str, Any]:
    """What the dashboard plots beyond the terminal's figures, as plain lists: the recorded MoE ``layers``, the
    ``expert_load`` matrix (picks per expert, one row per layer of ``layers``) and the ``budget_curves`` per k and
    layer (routing weight kept at each budget, with the source of the windows: measured at the recorded k, else
    counterfactual)."""
    layers = sorted({int(layer) for layer in [*analysis.growth["layer"].to_list(), *analysis.load["layer"].to_list()]})
    row_of = {layer: row for row, layer in enumerate(layers)}
    load = [[0] * analysis.shape.num_experts for _ in layers]
    for layer, expert, picks in analysis.load.select("layer", "expert", "picks").iter_rows():
        load[row_of[int(layer)]][int(expert)] = int(picks)
    curves = (
        analysis.budget_curves.sort("k", "layer", "budget")
        .group_by("k", "layer", maintain_order=True)
        .agg("budget", "coverage")
        .with_columns(source=pl.when(pl.col("k") == analysis.run.primary.k).then(pl.lit(MEASURED))
                      .otherwise(pl.lit(COUNTERFACTUAL)))
    )
    return {"layers": layers, "expert_load": load, "budget_curves": curves.to_dicts()}
