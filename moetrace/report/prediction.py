"""The prediction and its decision for one run: what the sweep's own steps measured (``measured_timing``, under
``--profile measured``), the predicted step per (batch, k) and the recommended k per concurrency of --batch
(``forecast``, over ``run_prediction``), priced for the deployment the options name (``prediction_deployment``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from moetrace.analysis.budgets import WindowSample
from moetrace.analysis.decision import recommended_k, speedup_per_batch, unpredicted
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.measured_steps import MeasuredSteps
from moetrace.analysis.predicates import decoding
from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.analysis.uncertainty import with_intervals
from moetrace.errors import UserError
from moetrace.report.inputs import Run, expert_placement, held_out_errors
from moetrace.report.measured import (
    engine_slots,
    measured_steps,
    passed_baselines,
    recorded_steps,
    sync_trace,
    with_k0_steps_of,
)
from moetrace.report.options import Options
from moetrace.report.step_reads import schedule_inputs, step_inputs
from moetrace.trace.drafters import MODEL_DRAFTERS
from moetrace.trace.reader import Trace


@dataclass(frozen=True)
class Timing:
    """What the sweep's own steps measured (``--profile measured``; all None, empty otherwise): its steps, the
    ``--k0-sync`` trace, per concurrency the steps as the cost model takes them and the k=0 trace's step where it
    passed through one, and the concurrencies no prediction can price (with why)."""

    steps: pl.DataFrame | None
    sync: Trace | None
    measured: dict[int, MeasuredSteps] | None
    passed: dict[int, float]
    unpriced: dict[int, str]


def measured_timing(run: Run, options: Options, steps_in: Callable[[Trace], pl.DataFrame] | None = None,
                    whole: Timing | None = None) -> Timing:
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
    return Timing(steps, sync, measured, passed, unpriced)


@dataclass(frozen=True)
class Forecast:
    """The prediction (at one request), the predicted steps per (batch, k), the decision and the prediction's
    basis; ``note``: why there is none, where there is not; ``schedule``: an adaptive schedule priced alike
    (``Prediction``)."""

    speedups: pl.DataFrame | None = None
    prediction: pl.DataFrame | None = None
    decision: pl.DataFrame | None = None
    basis: dict[str, Any] | None = None
    note: str | None = None
    schedule: pl.DataFrame | None = None


def forecast(run: Run, sample: WindowSample, inputs: pl.DataFrame, shape: ModelShape, tp: int, ep: int,
             options: Options, batches: list[int], timing: Timing, disagreements: dict[int, str],
             schedule_at: list[int]) -> Forecast:
    """The prediction and its decision, where one is asked for and the format can be priced, and the adaptive
    schedule priced alike at the concurrencies it ran at (``schedule_at``; not under uniform routing, which prices
    no trace's steps); a preset that cannot price this deployment leaves a note, a prediction the user asked for
    that cannot be made raises."""
    note = shape.unpriced_note()
    if note is not None:
        return Forecast(decision=unpredicted(options.batches, note) if options.predicts else None, note=note)
    if not options.predicts:
        return Forecast()
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
        return Forecast(decision=unpredicted(options.batches, note), note=note)
    return Forecast(found.speedups, found.table, found.decision, found.basis, schedule=found.schedule)


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


@dataclass(frozen=True)
class Prediction:
    """``run_prediction``'s result: per (batch, k) predicted steps (``speedups``), the per-k prediction at one
    request (``table``), the recommended k per concurrency of --batch (``decision``), what it priced on
    (``basis``), and the adaptive schedule priced the same way (``schedule``: its k = 0 and own-k rows per
    concurrency it ran at; None without one)."""

    speedups: pl.DataFrame
    table: pl.DataFrame
    decision: pl.DataFrame
    basis: dict[str, Any]
    schedule: pl.DataFrame | None = None


def run_prediction(run: Run, inputs: pl.DataFrame, shape: ModelShape, tp: int, ep: int, options: Options,
                   measured: dict[int, MeasuredSteps] | None, passed: dict[int, float], unpriced: dict[int, str],
                   disagreements: dict[int, str], schedule: pl.DataFrame | None = None) -> Prediction:
    """Per (batch, k) predicted steps, the per-k prediction at one request, and the recommended k at every
    concurrency of --batch, from ``step_inputs`` (at the prediction's placement); ``measured``: what --profile
    measured took from the sweep's steps, per recorded concurrency; ``passed``: the k=0 step at concurrencies the
    sweep passed through but did not run at (``report.measured.passed_baselines``); ``unpriced``: concurrencies
    left out, and why; ``schedule``: ``schedule_inputs``, priced alike."""
    if options.acceptance is None and max(t.k for t in run.traces) == 0:
        raise UserError(f"{run.primary.path}: no verified drafts to measure acceptance from; give --acceptance RATE")
    unmeasured = unmeasured_acceptance(run) if options.acceptance is None else None
    if unmeasured is not None:
        raise UserError(f"{unmeasured}: its acceptance is unknown; give --acceptance RATE")
    pred_shape, pred_tp, pred_ep, preset_notes = prediction_deployment(shape, tp, ep, options)
    # the step a profile measured: one request's window of its tokens (k = tokens - 1), read at batch 1
    tokens = options.profile.tokens if options.profile is not None else 1
    at = inputs.filter((pl.col("batch") == 1) & (pl.col("k") == tokens - 1))
    if at.is_empty():
        raise UserError(f"--profile tokens={tokens}: its step is one request's window of {tokens} tokens, "
                        f"k={tokens - 1}: give --max-k {tokens - 1} or more")
    anchor = (float(at["unique_experts"].item()), float(at["busiest_rank_experts"].item()))
    drafter, drafter_notes = (None, []) if measured is not None else calibrated_drafter(run, options.calibration)

    def priced(rows: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, Any]]:
        return speedup_per_batch(rows, deployment_for(pred_shape, pred_tp, pred_ep), options.profile,
                                 options.calibration, anchor, measured, drafter, passed)

    try:
        speedups, basis = priced(inputs)
    except ValueError as exc:
        raise UserError(f"{options.calibration_path or 'prediction'}: {exc}") from None
    try:
        schedule_speedups = None if schedule is None else priced(schedule)[0]
    except ValueError:  # --profile measured: the schedule ran at no concurrency the k=0 trace measured
        schedule_speedups = None
    table = speedups.filter(pl.col("batch") == 1).drop("batch")  # the per-k table is for one request
    basis["notes"] = preset_notes + drafter_notes + basis["notes"]
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
    errors = held_out_errors()
    basis["held_out_cells"], basis["held_out_coverage"] = len(errors.errors), errors.coverage
    basis["held_out_basis"] = errors.basis
    decision = with_intervals(recommended_k(speedups, options.batches, disagreements, unpriced), speedups, errors)
    return Prediction(speedups, table, decision, basis, schedule_speedups)


def unmeasured_acceptance(run: Run) -> str | None:
    """The first trace of ``run`` with drafts whose steps table holds no decoding request-step to measure acceptance
    from (``acceptance_per_k`` leaves the k resting on it null), and why: no steps rows (a recording killed before
    its first steps file), or prefill chunks only; None where every one has some."""
    for trace in run.traces:
        rows, decoding_rows = trace.steps().select(pl.len(), decoding().sum()).collect().row(0)
        if trace.k > 0 and not decoding_rows:
            return f"{trace.path}: {'no steps rows' if not rows else 'no decoding request-step in its steps rows'}"
    return None


def calibrated_drafter(run: Run, calibration: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list[str]]:
    """The calibration's drafter curve where it prices the model drafter the run's traces ran (same method); else
    None, and for a model drafter a note that its passes are left out. N-gram drafts on the host: nothing to
    price."""
    method = next((t.manifest.spec.method for t in run.traces if t.k > 0), None)
    if method not in MODEL_DRAFTERS:
        return None, []
    curve = (calibration or {}).get("drafter")
    if curve is not None and curve.get("method") == method:
        return curve, []
    why = (f"the calibration's drafter curve is of {curve.get('method')}" if curve is not None
           else "the calibration has no drafter curve")
    return None, [f"the {method} drafter's passes are not priced ({why}; moetrace calibrate --drafter PATH times "
                  f"them)"]


def unpriced_batches(run: Run, batches: Sequence[int]) -> dict[int, str]:
    """--profile measured: the concurrencies of ``batches`` above what the sweep's engines could run at once
    (``report.measured.engine_slots``), and why they get no prediction."""
    slots = engine_slots(run)
    return {batch: f"the sweep's engines ran at most {slots} requests at once (max_num_seqs): --profile measured has "
                   f"no step of {batch} to start from (record with --batch-size {batch} or more)"
            for batch in batches if slots is not None and batch > slots}
