"""The routing's windows as the windowed analyses read them: the rows read once (``trace_windows``), what the routing
summary is asked for (``summary_request``: ``analysis.routing_summary``), and budget curves per k, from a
deterministic sample of windows above ``MAX_BUDGET_WINDOWS`` per layer (``sample_note`` says so)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.budgets import WindowSample, budget_curves, sample_share, window_sample
from moetrace.analysis.routing_summary import SummaryRequest
from moetrace.analysis.shape import ModelShape
from moetrace.report.inputs import Run
from moetrace.trace.reader import Trace

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
