"""The decision's second axis: the recommended k per (concurrency, context length), ``moetrace report --context``.

The prediction holds at the context the traces ran at (``analysis.context``'s mean over decoding request-steps);
``analysis.context.at_contexts`` moves every step to each context asked for by what its attention costs there: the
calibration's MLA curve where it timed one of the model's latent width, else the model's KV bytes per token at the
calibration's copy bandwidth (both estimated), and each context gets its decision, intervals and crossover as the
recorded context does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from moetrace.analysis.calibration import AttentionCurve, attention_curve
from moetrace.analysis.context import at_contexts, recorded_context
from moetrace.analysis.decision import crossover, recommended_k
from moetrace.analysis.shape import ModelShape
from moetrace.analysis.uncertainty import HeldOutErrors, with_intervals
from moetrace.errors import UserError
from moetrace.report.inputs import held_out_errors


@dataclass(frozen=True)
class StepsAt:
    """What the decision at a context is moved from: the ``speedups`` predicted from steps that ran at a mean of
    ``context`` tokens; where those are the sweep's own decode steps in that context's bucket (``--profile
    measured`` of a sweep that holds it), the bucket's label and how many steps of all its traces."""

    speedups: pl.DataFrame
    context: float
    bucket: str | None = None
    decode_steps: int = 0


@dataclass(frozen=True)
class ContextDecision:
    """Per (context, batch): the decision rows (``analysis.decision.recommended_k`` with a context column and
    ``attention_kv_ms``, what the KV read adds to a step there over the context it was moved from), per context the
    crossover (``analysis.decision.crossover``), and the contexts decided from the sweep's own steps in their bucket
    (``measured_at``: bucket, mean_tokens, decode_steps)."""

    recorded_context: float
    rows: pl.DataFrame
    crossovers: dict[int, dict[str, Any]]
    attention_basis: str  # how a step's attention was moved to each context
    measured_at: dict[int, dict[str, Any]]


def context_refusal(contexts: Sequence[int], shape: ModelShape, calibration: Mapping[str, Any] | None) -> str | None:
    """Why ``--context`` cannot be priced for the predicted model ``shape`` (None: it can)."""
    if shape.max_context is not None and max(contexts) > shape.max_context:
        return (f"--context {max(contexts)}: beyond the model's {shape.max_context:,} tokens "
                f"(max_position_embeddings)")
    if shape.kv_bytes_per_token is None:
        return ("--context: the trace does not say how many KV-cache bytes a token holds (recorded before moetrace "
                "kept it): give --shape kimi-k2 or record it again")
    if calibration is None or not calibration.get("copy_bandwidth_gbs"):
        return "--context: the KV read is priced at a calibration's memory bandwidth: give --calibration"
    return None


def context_decision(origins: Mapping[int, StepsAt], recorded_context: float, shape: ModelShape,
                     calibration: Mapping[str, Any], batches: Sequence[int], errors: HeldOutErrors,
                     disagreements: Mapping[int, str], unpriced: Mapping[int, str]) -> ContextDecision:
    """The decision at each context of ``origins`` from the speedups it is moved from (the traces' recorded context
    is ``recorded_context``); a concurrency whose KV cache alone would not fit the calibrated GPU's memory at a
    context gets no recommendation there."""
    kv = shape.kv_bytes_per_token
    assert kv is not None
    curve, basis = attention_pricing(calibration, shape)
    memory = float(calibration.get("device", {}).get("memory_gib") or 0) * 2**30
    frames, crossovers = [], {}
    for context, origin in origins.items():
        at = at_contexts(origin.speedups, [context], origin.context, kv, float(calibration["copy_bandwidth_gbs"]),
                         curve, shape.num_layers, measured_there=origin.bucket is not None).drop("context")
        unfit = {batch: (f"the KV cache of {batch} requests of {context:,} tokens "
                         f"({batch * context * kv / 1e9:,.0f} GB a rank) exceeds the calibrated GPU's "
                         f"{memory / 2**30:,.0f} GiB")
                 for batch in batches if memory and batch * context * kv > memory}
        at = at.filter(~pl.col("batch").is_in(list(unfit)))
        decided = with_intervals(recommended_k(at, batches, disagreements, {**unpriced, **unfit}), at, errors)
        kv_ms = at.filter(pl.col("k") == 0).select("batch", "attention_kv_ms")
        frames.append(decided.join(kv_ms, on="batch", how="left").with_columns(context=pl.lit(context, pl.Int64)))
        crossovers[context] = crossover(at, [b for b in batches if b not in unpriced and b not in unfit],
                                        "predicted")
    measured_at = {context: {"bucket": origin.bucket, "mean_tokens": origin.context,
                             "decode_steps": origin.decode_steps}
                   for context, origin in origins.items() if origin.bucket is not None}
    return ContextDecision(recorded_context, pl.concat(frames, how="diagonal_relaxed").select(
        "context", pl.exclude("context")), crossovers, basis, measured_at)


def measured_sentence(context: int, found: Mapping[str, Any]) -> str:
    """How the decision at ``context`` rests on the sweep's own steps (``ContextDecision.measured_at``)."""
    return (f"at {context:,} tokens: from the sweep's own {found['decode_steps']:,} decoding steps at "
            f"{found['bucket']} tokens (a mean {found['mean_tokens']:,.0f}), measured at the concurrencies they ran "
            f"and moved within that bucket")


def attention_pricing(calibration: Mapping[str, Any], shape: ModelShape) -> tuple[AttentionCurve | None, str]:
    """The calibration's attention curve where it timed the model's latent width, and what the report says of how
    each step's attention moved to another context."""
    curve = attention_curve(calibration)
    kv = shape.kv_bytes_per_token
    if curve is not None and kv is not None and curve.kv_bytes_per_token_layer * shape.num_layers == kv:
        return curve, (f"each step's attention moved from the recorded context by the calibration's MLA curve "
                       f"({curve.kernel}, {curve.heads_per_rank} heads a rank) over {shape.num_layers} layers: "
                       f"estimated, extrapolated past {curve.max_context:,} tokens, {curve.max_batch} requests or "
                       f"{curve.max_cached_tokens:,} cached tokens a layer")
    why = ("the calibration timed no attention" if curve is None else
           f"the calibration's attention caches {curve.kv_bytes_per_token_layer} bytes a token and layer, this model "
           f"{(kv or 0) // max(1, shape.num_layers)}")
    return None, (f"each step moved from the recorded context by the KV cache it reads there (the model's KV bytes "
                  f"per token at the calibration's copy bandwidth: estimated; {why})")


def decide_at_contexts(speedups: pl.DataFrame, contexts: Sequence[int], shape: ModelShape,
                       calibration: Mapping[str, Any] | None, acceptance_by_context: pl.DataFrame | None,
                       batches: Sequence[int], disagreements: Mapping[int, str], unpriced: Mapping[int, str],
                       measured: Mapping[int, StepsAt] | None = None) -> ContextDecision:
    """``context_decision`` of the ``speedups`` predicted for the model ``shape`` at ``contexts``, from the context
    the traces ran at (``analysis.context.recorded_context`` of their ``acceptance_by_context``), or, at a context
    of ``measured``, from the sweep's own steps in its bucket; a ``UserError`` in one line where they cannot be
    priced."""
    refused = context_refusal(contexts, shape, calibration)
    recorded = recorded_context(acceptance_by_context)
    if refused is None and recorded is None:
        refused = "--context: the trace holds no decoding request-step to know the context it ran at from"
    if refused is not None:
        raise UserError(refused)
    assert recorded is not None and calibration is not None
    whole = StepsAt(speedups, float(recorded["mean_tokens"]))
    origins = {context: (measured or {}).get(context, whole) for context in contexts}
    return context_decision(origins, whole.context, shape, calibration, batches, held_out_errors(), disagreements,
                            unpriced)
