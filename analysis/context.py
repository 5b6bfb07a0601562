"""What a trace measured, by the context its request-steps ran at: acceptance, where drafts are first rejected,
unique experts per verification window and step time, per context bucket, each with its sample size.

A request-step's context is the tokens before its first token (the position of its anchor): what its attention
reads from the KV cache. Buckets are powers of four of 1K tokens
(``CONTEXT_BUCKETS``): at long context a verify step's attention reads each request's KV cache once for its k + 1
queries, while the experts it reads still grow with k, and n-gram drafts come from a longer history. A step holds
requests at several contexts: its time is filed under the bucket of its requests' mean context.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from moetrace.analysis.acceptance import mean_ms
from moetrace.analysis.calibration import AttentionCurve
from moetrace.analysis.cost import end_to_end_speedup
from moetrace.analysis.predicates import decoding, phase_is
from moetrace.analysis.sources import Source

# Upper bounds (tokens of context, inclusive) of every bucket but the last, which is open: ≤1K, 1-4K, 4-16K, 16-64K,
# >64K
CONTEXT_BUCKETS = (1024, 4096, 16384, 65536)
BUCKET_LABELS = ("≤1K", "1-4K", "4-16K", "16-64K", ">64K")
KEYS = ("dp_rank", "step", "request")


def bucket_of(context: pl.Expr) -> pl.Expr:
    """The bucket (0 .. len(CONTEXT_BUCKETS)) of a context in tokens."""
    bucket = pl.lit(len(CONTEXT_BUCKETS), pl.Int32)
    for index, bound in reversed(list(enumerate(CONTEXT_BUCKETS))):
        bucket = pl.when(context <= bound).then(pl.lit(index, pl.Int32)).otherwise(bucket)
    return bucket


def bucket_index(context: int) -> int:
    """The bucket of one context length in tokens."""
    return int(pl.select(bucket_of(pl.lit(context))).item())


def labelled(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with its ``bucket`` index named (``context``) first."""
    names = dict(enumerate(BUCKET_LABELS))
    return frame.with_columns(context=pl.col("bucket").replace_strict(names, return_dtype=pl.String)).select(
        "context", pl.exclude("context"))


def request_step_contexts(routing: pl.LazyFrame, layer: int) -> pl.LazyFrame:
    """``(dp_rank, step, request)`` → ``context`` (the position of the request-step's first token) and its
    ``bucket``, read from the rows of MoE ``layer`` (every layer holds the same tokens)."""
    return routing.filter(pl.col("layer") == layer).group_by(*KEYS).agg(
        context=pl.col("position").min().cast(pl.Int64)).with_columns(bucket=bucket_of(pl.col("context")))


def acceptance_by_context(steps: pl.LazyFrame, contexts: pl.LazyFrame, k: int) -> pl.DataFrame:
    """Per context bucket: decoding request-steps and their mean context, the unconditional acceptance rate at
    draft positions 1..k (``rate_<i>``: accepted at least i ÷ request-steps), tokens gained per request-step, and
    where verification first rejected a draft: the mean position of the first rejected draft over the windows that
    rejected one (``first_rejected``), and the share of windows with drafts that accepted them all."""
    decode = steps.filter(decoding()).join(contexts, on=list(KEYS))
    with_drafts = pl.col("num_drafts") > 0
    rejected = pl.col("num_accepted") < pl.col("num_drafts")
    table = decode.group_by("bucket").agg(
        request_steps=pl.len().cast(pl.Int64),
        mean_context=pl.col("context").mean().cast(pl.Float64),
        **{f"rate_{i}": ((pl.col("num_accepted") >= i).sum() / pl.len()).cast(pl.Float64) for i in range(1, k + 1)},
        tokens_per_step=(pl.col("num_accepted").mean() + 1).cast(pl.Float64),
        first_rejected=(pl.col("num_accepted") + 1).filter(with_drafts & rejected).mean().cast(pl.Float64),
        all_accepted=pl.when(with_drafts.any()).then(  # null, not NaN, where no window had drafts
            (with_drafts & ~rejected).sum() / with_drafts.sum().cast(pl.Float64)),
    ).sort("bucket").collect()
    return labelled(table)


def experts_by_context(routing: pl.LazyFrame, contexts: pl.LazyFrame) -> pl.DataFrame:
    """Per context bucket and MoE layer: verification windows (a request-step's anchor and drafts in one layer) and
    the mean number of unique experts one window read."""
    verify = routing.filter(phase_is("verify"))
    windows = verify.group_by(*KEYS, "layer").agg(unique=pl.col("experts").explode().n_unique())
    table = windows.join(contexts, on=list(KEYS)).group_by("bucket", "layer").agg(
        windows=pl.len().cast(pl.Int64), unique_experts=pl.col("unique").mean().cast(pl.Float64)
    ).sort("bucket", "layer").collect()
    return labelled(table)


def step_contexts(steps: pl.LazyFrame, contexts: pl.LazyFrame) -> pl.LazyFrame:
    """``(dp_rank, step)`` → ``context``, the mean context of the step's requests (``request_step_contexts``), and
    its ``bucket``: the bucket a step is filed under."""
    return steps.join(contexts, on=list(KEYS)).group_by("dp_rank", "step").agg(
        context=pl.col("context").mean()).with_columns(bucket=bucket_of(pl.col("context")))


def step_time_by_context(steps: pl.LazyFrame, contexts: pl.LazyFrame) -> pl.DataFrame:
    """Per context bucket (of a step's requests' mean context) and batch (requests in the step): the steps in which
    every request was decoding, and their mean time in ms (from vLLM's ``execute_model`` to its sync after
    sampling: verification and drafting)."""
    per_step = steps.group_by("dp_rank", "step").agg(
        decoding=decoding().all(), batch=pl.len().cast(pl.Int64),
        t_start_ns=pl.col("t_start_ns").first(), t_end_ns=pl.col("t_end_ns").first())
    table = per_step.filter(pl.col("decoding")).join(step_contexts(steps, contexts), on=["dp_rank", "step"]).group_by(
        "bucket", "batch").agg(steps=pl.len().cast(pl.Int64),
                               step_ms=mean_ms(pl.col("t_end_ns") - pl.col("t_start_ns"))
                               ).sort("bucket", "batch").collect()
    return labelled(table)


def context_tables(stepped: pl.LazyFrame, steps: pl.LazyFrame, k: int, layer: int) -> dict[str, pl.DataFrame]:
    """The three tables by context (``acceptance``, ``experts``, ``step_time``) of a trace recorded at ``k`` whose
    first MoE layer is ``layer``, from ``stepped``: the routing rows of the decoding and verifying request-steps
    of whole engine steps, all of them or a deterministic sample (``analysis.budgets.WindowSample.stepped``,
    already in memory: no other pass over the trace's rows)."""
    contexts = request_step_contexts(stepped, layer).collect().lazy()  # read once, joined three times
    return {"acceptance": acceptance_by_context(steps, contexts, k), "experts": experts_by_context(stepped, contexts),
            "step_time": step_time_by_context(steps, contexts)}


def recorded_context(acceptance: pl.DataFrame | None) -> dict[str, float | int | str] | None:
    """The context a trace ran at, from ``acceptance_by_context``'s table: its decoding request-steps' mean context
    (``mean_tokens``), the bucket most of them ran in and how many there were; None where it recorded none."""
    if acceptance is None or acceptance.is_empty():
        return None
    steps = int(acceptance["request_steps"].sum())
    widest = acceptance.sort("request_steps", descending=True).row(0, named=True)
    return {"mean_tokens": float((acceptance["mean_context"] * acceptance["request_steps"]).sum()) / steps,
            "bucket": str(widest["context"]), "request_steps": steps}


# ---------------------------------------------------------------- the step at another context


def kv_read_ms(batch: int, context: float, kv_bytes_per_token: int, bandwidth_gbs: float) -> float:
    """One step's read of its ``batch`` requests' KV caches of ``context`` tokens on one rank, at ``bandwidth_gbs``."""
    return batch * context * kv_bytes_per_token / (bandwidth_gbs * 1e6)


def at_contexts(speedups: pl.DataFrame, contexts: Sequence[int], from_context: float, kv_bytes_per_token: int,
                bandwidth_gbs: float, attention: AttentionCurve | None = None, layers: int = 0,
                from_contexts: Mapping[int, float] | None = None) -> pl.DataFrame:
    """``speedups`` (per batch and k: step_ms, tokens_per_step, prefill_ms_per_token, ...) moved from the context
    they hold at, ``from_context`` tokens (the traces' own, or where ``--profile measured`` measured the k=0 step), to
    each of ``contexts``, with a context column; what a step of B
    requests gains there is ``attention_kv_ms``. With a calibrated ``attention`` curve (one MLA layer's decode, of
    the model's latent width), it is ``layers`` × the curve's growth from L₀ to L at B requests × (k + 1) queries:
    the cache is read once for all k + 1 queries, their work grows with k. Without one, every k's step grows alike
    by ``kv_read_ms`` of B × (L − L₀) tokens: the KV bytes the model's config names at the calibration's copy
    bandwidth. Either is estimated (``step_source``), extrapolated where the curve was not timed that far. At long
    context the MoE's growth with k weighs less and speculation pays more. A step that would shrink to nothing (a
    context far below the one it is moved from) gets no speedup. ``from_contexts``: per batch, where its step was
    measured at another context than ``from_context`` (``--profile measured``'s steps of one bucket)."""
    origin = dict(from_contexts or {})
    frames = []
    for context in contexts:
        at = speedups.with_columns(context=pl.lit(context, pl.Int64))
        pairs = at.select("batch", "k").rows()
        if attention is None:
            frames.append(at.with_columns(
                attention_kv_ms=pl.Series([kv_read_ms(b, context - origin.get(b, from_context), kv_bytes_per_token,
                                                      bandwidth_gbs) for b, _ in pairs], dtype=pl.Float64),
                beyond_timed=pl.lit(False)))
            continue
        frames.append(at.with_columns(
            attention_kv_ms=pl.Series([layers * (attention.layer_us(b, k + 1, context)
                                                 - attention.layer_us(b, k + 1, origin.get(b, from_context))) / 1e3
                                       for b, k in pairs], dtype=pl.Float64),
            beyond_timed=pl.Series([attention.extrapolated(b, k + 1, context) for b, k in pairs],
                                   dtype=pl.Boolean)))
    moved = pl.concat(frames).with_columns(step_ms=pl.col("step_ms") + pl.col("attention_kv_ms"))
    rows = moved.select("batch", "context", "k", "step_ms", "tokens_per_step", "prefill_ms_per_token").to_dicts()
    k0 = {(row["batch"], row["context"]): row for row in rows if row["k"] == 0}

    def speedup(row: dict[str, Any]) -> float | None:
        base = k0[(row["batch"], row["context"])]
        if min(row["step_ms"], base["step_ms"]) <= 0:
            return None
        return end_to_end_speedup(base["step_ms"], base["tokens_per_step"], base["prefill_ms_per_token"],
                                  row["step_ms"], row["tokens_per_step"], row["prefill_ms_per_token"])

    beyond = {(b, c, k) for b, c, k, past in moved.select("batch", "context", "k", "beyond_timed").rows() if past}

    def source(row: dict[str, Any]) -> str:  # a speedup rests on its own step and on k = 0's
        past = {(row["batch"], row["context"], row["k"]), (row["batch"], row["context"], 0)} & beyond
        return str((Source.EXTRAPOLATED if past else Source.ESTIMATED).value)

    return moved.with_columns(
        step_ratio=pl.Series([row["step_ms"] / k0[(row["batch"], row["context"])]["step_ms"] for row in rows]),
        speedup=pl.Series([speedup(row) for row in rows], dtype=pl.Float64),
        step_source=pl.Series([source(row) for row in rows]),
    ).drop("beyond_timed")
