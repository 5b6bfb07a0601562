"""Unique experts per layer as the verification window grows: measured, counterfactual and the uniform bound.

- measured, per request: verification windows ``(step, request)`` of the recorded trace; the window of size k+1 is
  the anchor plus drafts 1..k of windows that proposed at least k drafts (so one trace at k answers 0..k).
- measured, per batch: the union over every decode/verify token of a step, drafts capped at k.
- counterfactual: windows of k+1 consecutive tokens of the accepted sequence (decode tokens, verification anchors and
  accepted drafts), aligned on positions that are multiples of k+1; only complete windows count. Any trace, plain
  decoding included, answers every k this way.
- uniform: N·(1−(1−top_k/N)^(k+1)), the expected union of k+1 independent uniformly random top-k sets.

Every row also carries the per-rank view under an expert placement: experts on the busiest rank and ranks touched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.expert_sets import (
    Masks,
    count_experts,
    expert_masks,
    group_starts,
    group_union,
    per_rank_counts,
    rank_masks,
)

MEASURED = "measured"
COUNTERFACTUAL = "counterfactual"
PER_REQUEST = "request"
PER_BATCH = "batch"

GROWTH_SCHEMA: dict[str, pl.DataType] = {
    "layer": pl.UInt16(),
    "k": pl.Int32(),
    "source": pl.String(),
    "scope": pl.String(),
    "windows": pl.Int64(),
    "unique_experts": pl.Float64(),
    "busiest_rank_experts": pl.Float64(),
    "ranks_touched": pl.Float64(),
}


def uniform_unique_experts(num_experts: int, top_k: int, k: int) -> float:
    """Expected unique experts in k+1 tokens that each pick top_k of num_experts uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** (k + 1))


def accepted_sequence(routing: pl.LazyFrame) -> pl.LazyFrame:
    """Rows of tokens that ended up in the sequence: plain decode, verification anchors and accepted drafts."""
    phase = pl.col("phase").cast(pl.String)
    in_verify = (phase == "verify") & ((pl.col("draft_pos") == 0) | pl.col("accepted").fill_null(False))
    return routing.filter((phase == "decode") | in_verify)


def _layer_parts(frame: pl.DataFrame) -> Iterator[tuple[int, pl.DataFrame]]:
    """Zero-copy slices of a frame sorted by layer, one per layer."""
    layers = frame["layer"].to_numpy()
    starts = group_starts(layers)
    ends = np.append(starts[1:], len(frame))
    for start, end in zip(starts.tolist(), ends.tolist()):
        yield int(layers[start]), frame.slice(start, end - start)


def _window_row(
    layer: int, k: int, source: str, scope: str, unions: Masks, ranks: Masks
) -> dict[str, object] | None:
    if len(unions) == 0:
        return None
    unique = float(count_experts(unions).mean())
    if len(ranks) == 1:  # every expert on one rank: nothing more to count
        busiest, touched = unique, 1.0
    else:
        on_rank = per_rank_counts(unions, ranks)
        busiest, touched = float(on_rank.max(axis=1).mean()), float((on_rank > 0).sum(axis=1).mean())
    return {
        "layer": layer,
        "k": k,
        "source": source,
        "scope": scope,
        "windows": len(unions),
        "unique_experts": unique,
        "busiest_rank_experts": busiest,
        "ranks_touched": touched,
    }


def _frame(rows: list[dict[str, object] | None]) -> pl.DataFrame:
    return pl.DataFrame([row for row in rows if row is not None], schema=GROWTH_SCHEMA, orient="row")


def counterfactual_growth(
    routing: pl.LazyFrame, num_experts: int, ks: Sequence[int], expert_rank: npt.NDArray[np.int64]
) -> pl.DataFrame:
    """Unique experts per window of k+1 consecutive accepted tokens, per layer and k (see module doc)."""
    frame = (
        accepted_sequence(routing)
        .select("layer", "request", "position", "experts")
        .sort("layer", "request", "position")
        .collect()
    )
    ranks = rank_masks(expert_rank, num_experts)
    rows: list[dict[str, object] | None] = []
    for layer, part in _layer_parts(frame):
        masks = expert_masks(part["experts"].to_numpy(), num_experts)
        request = part["request"].to_numpy()
        position = part["position"].to_numpy()
        for k in ks:
            starts = group_starts(request, position // (k + 1))
            sizes = np.diff(np.append(starts, len(part)))
            unions = group_union(masks, starts)[sizes == k + 1]
            rows.append(_window_row(layer, k, COUNTERFACTUAL, PER_REQUEST, unions, ranks))
    return _frame(rows)


def _decode_and_verify(routing: pl.LazyFrame) -> pl.DataFrame:
    """Non-prefill rows sorted into windows: layer, step, request, draft position."""
    phase = pl.col("phase").cast(pl.String)
    return (
        routing.filter(phase != "prefill")
        .select(
            "layer",
            "step",
            "request",
            "draft_pos",
            (phase == "verify").alias("is_verify"),
            ((pl.col("draft_pos") == 0) | pl.col("accepted").fill_null(False)).alias("in_sequence"),
            "experts",
        )
        .sort("layer", "step", "request", "draft_pos")
        .collect()
    )


def measured_growth(
    routing: pl.LazyFrame, num_experts: int, trace_k: int, expert_rank: npt.NDArray[np.int64]
) -> pl.DataFrame:
    """Unique experts per recorded verification window (per request) and per step (whole batch), k = 0..trace_k."""
    frame = _decode_and_verify(routing)
    ranks = rank_masks(expert_rank, num_experts)
    rows: list[dict[str, object] | None] = []
    for layer, part in _layer_parts(frame):
        masks = expert_masks(part["experts"].to_numpy(), num_experts)
        step = part["step"].to_numpy()
        request = part["request"].to_numpy()
        draft_pos = part["draft_pos"].to_numpy()
        is_verify = part["is_verify"].to_numpy()
        window_starts = group_starts(step, request)
        window_drafts = np.maximum.reduceat(draft_pos, window_starts) if len(window_starts) else draft_pos
        drafts_in_window = np.repeat(window_drafts, np.diff(np.append(window_starts, len(part))))
        for k in range(trace_k + 1):
            capped = draft_pos <= k
            in_window = capped & is_verify & (drafts_in_window >= k)
            unions = group_union(masks[in_window], group_starts(step[in_window], request[in_window]))
            rows.append(_window_row(layer, k, MEASURED, PER_REQUEST, unions, ranks))
            unions = group_union(masks[capped], group_starts(step[capped]))
            rows.append(_window_row(layer, k, MEASURED, PER_BATCH, unions, ranks))
    return _frame(rows)


def rejected_only_experts(routing: pl.LazyFrame, num_experts: int) -> pl.DataFrame:
    """Per layer, over verification windows with drafts: mean unique experts and mean experts that only rejected
    drafts pulled in (read for nothing)."""
    frame = _decode_and_verify(routing).filter(pl.col("is_verify"))
    rows = []
    for layer, part in _layer_parts(frame):
        masks = expert_masks(part["experts"].to_numpy(), num_experts)
        starts = group_starts(part["step"].to_numpy(), part["request"].to_numpy())
        has_drafts = np.maximum.reduceat(part["draft_pos"].to_numpy(), starts) > 0
        everything = group_union(masks, starts)[has_drafts]
        kept = group_union(np.where(part["in_sequence"].to_numpy()[:, None], masks, np.uint64(0)), starts)[has_drafts]
        if len(everything) == 0:
            continue
        unique = count_experts(everything)
        rejected_only = count_experts(everything & ~kept)
        rows.append(
            {
                "layer": layer,
                "windows": len(everything),
                "unique_experts": float(unique.mean()),
                "rejected_only_experts": float(rejected_only.mean()),
                "rejected_only_share": float(rejected_only.sum() / unique.sum()),
            }
        )
    schema = {
        "layer": pl.UInt16(),
        "windows": pl.Int64(),
        "unique_experts": pl.Float64(),
        "rejected_only_experts": pl.Float64(),
        "rejected_only_share": pl.Float64(),
    }
    return pl.DataFrame(rows, schema=schema, orient="row")


def growth(
    routing: pl.LazyFrame,
    num_experts: int,
    top_k: int,
    ks: Sequence[int],
    trace_k: int,
    expert_rank: npt.NDArray[np.int64],
) -> pl.DataFrame:
    """Measured (k ≤ trace_k) and counterfactual (every k in ks) growth per layer, with the uniform bound and the
    routing locality (unique experts / uniform bound: below 1 means tokens share experts more than chance)."""
    measured = measured_growth(routing, num_experts, min(trace_k, max(ks, default=0)), expert_rank)
    combined = pl.concat([measured, counterfactual_growth(routing, num_experts, ks, expert_rank)])
    uniform = pl.DataFrame(
        {"k": list(ks), "uniform_bound": [uniform_unique_experts(num_experts, top_k, k) for k in ks]},
        schema={"k": pl.Int32(), "uniform_bound": pl.Float64()},
    )
    return (
        combined.join(uniform, on="k", how="left")
        .with_columns(
            # The bound is for one request's k+1 tokens; a batch holds more tokens, so it has none.
            uniform_bound=pl.when(pl.col("scope") == PER_REQUEST).then(pl.col("uniform_bound")),
        )
        .with_columns(locality=pl.col("unique_experts") / pl.col("uniform_bound"))
        .sort("source", "scope", "layer", "k")
    )
