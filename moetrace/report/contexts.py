"""The decision's second axis: the recommended k per (concurrency, context length), ``moetrace report --context``.

The prediction holds at the context the traces ran at (``analysis.context``'s mean over decoding request-steps);
``analysis.context.at_contexts`` moves every step to each context asked for by what its attention costs there: the
calibration's MLA curve where it timed one of the model's latent width, else the model's KV bytes per token at the
calibration's copy bandwidth (both estimated), and each context gets its decision, intervals and crossover as the
recorded context does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    """``--profile measured`` at a context: the ``speedups`` predicted with the k=0 step measured over the sweep's
    own ``step_pairs`` k=0 step pairs in that context's ``bucket``, whose mean context is ``context`` (per
    concurrency measured: ``by_batch``, where each is moved from); or, where it ran too few there, why (``speedups``
    None: the decision there is moved from the whole sweep's)."""

    bucket: str
    speedups: pl.DataFrame | None = None
    context: float = 0.0
    step_pairs: int = 0
    why: str | None = None
    by_batch: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ContextDecision:
    """Per (context, batch): the decision rows (``analysis.decision.recommended_k`` with a context column and
    ``attention_kv_ms``, what the KV read adds to a step there over the context it was moved from), per (context,
    batch, k) the speedups they chose from (``analysis.context.at_contexts``), per context the crossover
    (``analysis.decision.crossover``), and with ``--profile measured`` per context whether its k=0 step was measured
    in its bucket (``from_steps``: bucket, measured, mean_tokens, step_pairs, why)."""

    recorded_context: float
    rows: pl.DataFrame
    speedups: pl.DataFrame
    crossovers: dict[int, dict[str, Any]]
    attention_basis: str  # how a step's attention was moved to each context
    from_steps: dict[int, dict[str, Any]]


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


def context_decision(origins: Mapping[int, tuple[pl.DataFrame, float, Mapping[int, float]]], recorded_context: float,
                     shape: ModelShape, calibration: Mapping[str, Any], batches: Sequence[int], errors: HeldOutErrors,
                     disagreements: Mapping[int, str], unpriced: Mapping[int, str],
                     from_steps: Mapping[int, StepsAt]) -> ContextDecision:
    """The decision at each context of ``origins`` from the speedups it is moved from and the context those hold at,
    overall and per batch (the traces' own: ``recorded_context``); a concurrency whose KV cache alone would not fit
    the calibrated GPU's memory at a context gets no recommendation there."""
    kv = shape.kv_bytes_per_token
    assert kv is not None
    curve, basis = attention_pricing(calibration, shape)
    if shape.attention_layers and shape.attention_layers != shape.num_layers:
        basis += (f"; the cache grows in {shape.attention_layers} of {shape.num_layers} layers (the others, linear "
                  "attention, keep a fixed state per request)")
    # both move with context (n-gram drafts from the prompt; a longer prompt costs more prefill a token gained:
    # docs/validation.md), and only a trace that ran there measures them
    kept = "acceptance and prefill" if from_steps else "acceptance"
    basis += (f"; {kept} as recorded, at a mean {recorded_context:,.0f} tokens: record at the context you serve to "
              f"measure {'them' if from_steps else 'it'}")
    memory = float(calibration.get("device", {}).get("memory_gib") or 0) * 2**30
    frames, moved, crossovers = [], [], {}
    for context, (speedups, from_context, by_batch) in origins.items():
        # only the layers whose cache grows with context: a hybrid model's linear-attention state is fixed
        at = at_contexts(speedups, [context], from_context, kv, float(calibration["copy_bandwidth_gbs"]), curve,
                         shape.attention_layers or shape.num_layers, by_batch).drop("context")
        unfit = {batch: (f"the KV cache of {batch} requests of {context:,} tokens "
                         f"({batch * context * kv / 1e9:,.0f} GB a rank) exceeds the calibrated GPU's "
                         f"{memory / 2**30:,.0f} GiB")
                 for batch in batches if memory and batch * context * kv > memory}
        at = at.filter(~pl.col("batch").is_in(list(unfit)))
        moved.append(at.with_columns(context=pl.lit(context, pl.Int64)))
        decided = with_intervals(recommended_k(at, batches, disagreements, {**unpriced, **unfit}), at, errors)
        k0 = at.filter(pl.col("k") == 0).select("batch", "attention_kv_ms", k0_step_ms="step_ms")
        frames.append(decided.join(k0, on="batch", how="left").with_columns(context=pl.lit(context, pl.Int64)))
        crossovers[context] = crossover(at, [b for b in batches if b not in unpriced and b not in unfit],
                                        "predicted")
    return ContextDecision(recorded_context, pl.concat(frames, how="diagonal_relaxed").select(
        "context", pl.exclude("context")), pl.concat(moved, how="diagonal_relaxed").select(
        "context", pl.exclude("context")), crossovers, basis,
        {context: {"bucket": found.bucket, "measured": found.speedups is not None,
                   "mean_tokens": found.context if found.speedups is not None else None,
                   "mean_tokens_by_batch": {str(batch): tokens for batch, tokens in found.by_batch.items()},
                   "step_pairs": found.step_pairs, "why": found.why}
         for context, found in from_steps.items()})


def from_steps_sentence(context: int, found: Mapping[str, Any]) -> str:
    """Whether the decision at ``context`` rests on the sweep's own k=0 steps there
    (``ContextDecision.from_steps``)."""
    if not found["measured"]:
        return f"at {context:,} tokens: moved from the whole sweep ({found['why']})"
    return (f"at {context:,} tokens: the k=0 step from the sweep's own {found['step_pairs']:,} k=0 step pairs at "
            f"{found['bucket']} tokens (a mean {found['mean_tokens']:,.0f}), moved from there; its growth with k, "
            f"acceptance, prefill and routing the whole sweep's")


def attention_pricing(calibration: Mapping[str, Any], shape: ModelShape) -> tuple[AttentionCurve | None, str]:
    """The calibration's attention curve where it timed the model's latent width, and what the report says of how
    each step's attention moved to another context."""
    curve = attention_curve(calibration)
    kv = shape.kv_bytes_per_token
    layers = shape.attention_layers or shape.num_layers  # those whose cache grows with context
    if curve is not None and kv is not None and curve.kv_bytes_per_token_layer * layers == kv:
        return curve, (f"each step's attention moved from the context it holds at by the calibration's MLA curve "
                       f"({curve.kernel}, {curve.heads_per_rank} heads a rank) over {layers} layers: "
                       f"estimated, extrapolated past {curve.max_context:,} tokens, {curve.max_batch} requests or "
                       f"{curve.max_cached_tokens:,} cached tokens a layer")
    why = ("the calibration timed no attention" if curve is None else
           f"the calibration's attention caches {curve.kv_bytes_per_token_layer} bytes a token and layer, this model "
           f"{(kv or 0) // max(1, layers)}")
    return None, (f"each step moved from the context it holds at by the KV cache it reads there (the model's KV bytes "
                  f"per token at the calibration's copy bandwidth: estimated; {why})")


def decide_at_contexts(speedups: pl.DataFrame, contexts: Sequence[int], shape: ModelShape,
                       calibration: Mapping[str, Any] | None, acceptance_by_context: pl.DataFrame | None,
                       batches: Sequence[int], disagreements: Mapping[int, str], unpriced: Mapping[int, str],
                       measured: Mapping[int, StepsAt] | None = None) -> ContextDecision:
    """``context_decision`` of the ``speedups`` predicted for the model ``shape`` at ``contexts``, from the context
    the traces ran at (``analysis.context.recorded_context`` of their ``acceptance_by_context``), or, at a context
    of ``measured`` whose k=0 step was measured in its bucket, from the speedups predicted with it; a ``UserError``
    in one line where they cannot be priced."""
    refused = context_refusal(contexts, shape, calibration)
    recorded = recorded_context(acceptance_by_context)
    if refused is None and recorded is None:
        refused = "--context: the trace holds no decoding request-step to know the context it ran at from"
    if refused is not None:
        raise UserError(refused)
    assert recorded is not None and calibration is not None
    whole: tuple[pl.DataFrame, float, Mapping[int, float]] = (speedups, float(recorded["mean_tokens"]), {})
    from_steps = measured or {}
    origins = {context: whole if (found := from_steps.get(context)) is None or found.speedups is None
               else (found.speedups, found.context, found.by_batch) for context in contexts}
    return context_decision(origins, whole[1], shape, calibration, batches, held_out_errors(), disagreements,
                            unpriced, from_steps)
