"""What one step reads per (batch, k) (``step_inputs``): the sweep's traces as the unions read them (``recorded_ks``),
or uniformly random routing's unions, beside the acceptance at each k and the tokens the step moves: the one table the
cost model, the bytes, the decision and the self-check take. An adaptive schedule's trace is read alike
(``schedule_inputs``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.acceptance import acceptance_per_k
from moetrace.analysis.budgets import WindowSample, window_sample
from moetrace.analysis.concurrency import RecordedK, batch_unions, request_prompts, union_means, uniform_unions
from moetrace.analysis.counterfactual import every_draft_proposed
from moetrace.analysis.shape import ModelShape
from moetrace.report.inputs import Run
from moetrace.report.options import Options
from moetrace.trace.reader import Trace


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
