"""What the report asks of each TRACE argument (``Options``) and what it found (``RunAnalysis``: growth, budgets,
acceptance, the prediction and the decision, and the self-check), with the parts ``report.analyse`` runs them
through; ``report.measured`` gathers what --profile measured takes from the sweep, ``report.payload`` shapes the
summary JSON the terminal and the dashboard render."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.acceptance import (
    acceptance_per_k,
)
from moetrace.analysis.measured_steps import MeasuredSteps
from moetrace.trace.drafters import MODEL_DRAFTERS
from moetrace.analysis.budgets import WindowSample, budget_curves, sample_share, window_sample
from moetrace.analysis.concurrency import RecordedK, batch_unions, request_prompts, union_means, uniform_unions
from moetrace.analysis.counterfactual import every_draft_proposed
from moetrace.analysis.decision import (
    DEFAULT_BATCHES,
    recommended_k,
    speedup_per_batch,
)
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.growth import (
    COUNTERFACTUAL,
    MEASURED,
)
from moetrace.analysis.predicates import decoding
from moetrace.analysis.profile import Profile
from moetrace.analysis.routing_summary import SummaryRequest
from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.analysis.uncertainty import with_intervals
from moetrace.report.contexts import ContextDecision
from moetrace.errors import UserError
from moetrace.report.policies import PolicyReplay
from moetrace.trace.manifest import Manifest
from moetrace.trace.reader import Trace
from moetrace.report.inputs import (PredictionPreset, Run, held_out_errors)
from moetrace.report.measured import (engine_slots)

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
    ray: str | None = None  # --ray: an always-on recording's partitions summarised on this Ray cluster
    contexts: tuple[int, ...] = ()  # --context: context lengths to decide at beside the recorded one

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


# Budget curves per layer and k from at most this many windows per layer (and about this many over all layers):
# above it they come from a deterministic sample (4M rows took 22 s per k on 2 cores, so 60M rows took minutes per
# k); the report says so.
MAX_BUDGET_WINDOWS = 5_000
MAX_BUDGET_WINDOWS_ALL_LAYERS = 30_000


def sample_columns(trace: Trace) -> tuple[str, ...]:
    """The routing columns the window sample keeps besides its keys (budgets rank by candidates where recorded)."""
    candidates = trace.manifest.capture.candidates > 0
    return ("experts", "weights", *(("cand_experts", "cand_scores") if candidates else ()))


def trace_windows(run: Run) -> WindowSample:
    """The rows every windowed analysis (budgets, batch unions) cuts its windows from, read once."""
    trace = run.primary
    return window_sample(trace.routing(), trace.k, list(sample_columns(trace)))


def summary_request(trace: Trace, num_experts: int, max_k: int, placement: npt.NDArray[np.int64],
                    rows: int) -> SummaryRequest:
    """What the report asks of a trace of ``rows`` routing rows (``analysis.routing_summary``)."""
    return SummaryRequest(num_experts, tuple(range(max_k + 1)), trace.k, placement, sample_share(rows),
                          sample_columns(trace), whole_steps=trace.manifest.capture.one_request_in == 1)


def budget_curves_per_k(run: Run, sample: WindowSample, ks: range, shape: ModelShape) -> tuple[pl.DataFrame, float]:
    """Budget curves (with a k column) of the primary trace: its verification windows at its own k, counterfactual
    windows of accepted tokens at any other k, bytes at ``shape``'s (none where it cannot price them). Also the
    smallest share of windows a k was computed from."""
    trace = run.primary
    use_candidates = "cand_experts" in sample.accepted.columns
    layers = len(trace.manifest.model.moe_layers)
    per_layer = min(MAX_BUDGET_WINDOWS, max(500, MAX_BUDGET_WINDOWS_ALL_LAYERS // max(layers, 1)))
    frames, shares = [], []
    expert_bytes = None if shape.unpriced_format is not None else shape.expert_bytes
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


def greedy(trace: Trace) -> bool:
    """Whether the trace's requests were decoded greedily (temperature 0, or not stated): only then do two requests
    with one prompt read the same tokens, and count as one in the unions at a concurrency not recorded."""
    sampling = (trace.manifest.document.get("workload") or {}).get("sampling") or {}
    return float(sampling.get("temperature") or 0.0) == 0.0


def recorded_k(run: Run, trace: Trace, primary_sample: WindowSample | None = None) -> RecordedK:
    """``trace`` as the unions read its steps as they ran: rows (``primary_sample`` for the primary trace where
    given), steps and, under greedy decoding, each request's prompt."""
    sample = (primary_sample if primary_sample is not None and trace is run.primary
              else window_sample(trace.routing(), trace.k, ["experts"]))
    return RecordedK(sample, trace.steps(), request_prompts(trace.routing()) if greedy(trace) else {})


def recorded_ks(run: Run, primary_sample: WindowSample | None = None) -> dict[int, RecordedK]:
    """The sweep's traces by k as the unions read them for fixed k (``recorded_k``); a trace whose adaptive schedule
    chose each request-step's drafts is read as its drafter proposed them, every k drawn as counterfactual windows
    (``RecordedK.scheduled``)."""
    scheduled, found = scheduled_ks(run), {}
    for trace in run.traces:
        read = recorded_k(run, trace, primary_sample)
        if trace.k in scheduled:  # its drafter proposed k drafts at every request-step, the schedule verified fewer
            proposed = every_draft_proposed(read.sample.proposals, trace.k)
            read = replace(read, scheduled=True, sample=replace(read.sample, proposals=proposed))
        found[trace.k] = read
    return found


def scheduled_ks(run: Run) -> set[int]:
    """The recorded k whose engine chose how many drafts each request-step verified (``SpecInfo.adaptive``)."""
    return {t.k for t in run.traces if t.k > 0 and t.manifest.spec.adaptive}


def step_inputs(run: Run, sample: WindowSample, shape: ModelShape, placement: npt.NDArray[np.int64],
                options: Options, batches: Sequence[int]) -> pl.DataFrame:
    """Per (batch, k), for k = 0..max_k and every concurrency of ``batches``: what one step reads (``union_means`` of
    ``analysis.concurrency``, or uniform routing's) beside the acceptance at k (``acceptance_per_k``), and the
    tokens the step moves (batch × tokens a request-step reads). The one table the cost model, the bytes, the
    decision and the self-check take."""
    ks = range(options.max_k + 1)
    if options.routing == "uniform":
        unions = uniform_unions(shape.num_experts, shape.top_k, placement, ks, batches)
    else:
        recorded = recorded_ks(run, sample)
        unions = batch_unions(recorded, shape.num_experts, shape.top_k, placement, ks, batches)
    acceptance = acceptance_per_k({t.k: t.steps() for t in run.traces}, ks, options.acceptance, scheduled_ks(run))
    return with_step_tokens(union_means(unions).join(acceptance, on="k"))


def with_step_tokens(inputs: pl.DataFrame) -> pl.DataFrame:
    """Per (batch, k) inputs with the tokens the step moves: batch × tokens a request-step reads."""
    return inputs.with_columns(tokens=pl.col("batch").cast(pl.Float64) * pl.col("tokens_read")).sort("batch", "k")


def schedule_trace(run: Run) -> Trace | None:
    """The sweep's trace of an adaptive schedule (``scheduled_ks``) with the most drafts: the schedule the report
    sets beside the static table; None where none."""
    ks = scheduled_ks(run)
    return max((t for t in run.traces if t.k in ks), key=lambda t: t.k, default=None)


def schedule_inputs(run: Run, sample: WindowSample, shape: ModelShape, placement: npt.NDArray[np.int64],
                    static: pl.DataFrame, batches: Sequence[int]) -> pl.DataFrame | None:
    """The adaptive schedule (``schedule_trace``) as the cost model takes it, at each concurrency of ``batches``: k = 0
    as the static table reads it (``static``: ``step_inputs``), and at its k (its drafter drafted k each step) what
    it verified as it ran: the unions of its steps (measured where it ran that concurrency), the tokens its
    request-steps read and gained (measured). None without such a trace."""
    trace = schedule_trace(run)
    if trace is None:
        return None
    unions = batch_unions({trace.k: recorded_k(run, trace, sample)}, shape.num_experts, shape.top_k, placement,
                          [trace.k], batches)
    acceptance = acceptance_per_k({trace.k: trace.steps()}, [trace.k])
    as_run = with_step_tokens(union_means(unions).join(acceptance, on="k"))
    return pl.concat([static.filter((pl.col("k") == 0) & pl.col("batch").is_in(list(batches))),
                      as_run.select(static.columns)]).sort("batch", "k")


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
