"""Unique experts one verification step reads at concurrency B: the union of B requests' windows of k+1 tokens.

- measured: steps of the trace that verified exactly B requests at the trace's own k (the union of their recorded
  windows), where the trace has at least ``MIN_MEASURED_STEPS`` such steps;
- estimated: the mean union of B distinct windows drawn at random (seeded: disjoint groups of a few random
  permutations) from the trace's own per-request windows at k (the recorded windows at the trace's k, windows of k+1 consecutive accepted tokens at any
  other k); with fewer windows than B, every window once (so a lower bound, and labelled so);
- uniform: N·(1−(1−K/N)^(B(k+1))), B(k+1) independent uniformly random top-K sets.

Long traces are sampled to about ``MAX_WINDOWS`` windows per layer and k first (whole steps where steps are unioned).

Per layer, with the experts on the busiest rank under an expert placement beside the unique count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.budgets import WINDOW, WindowSample
from moetrace.analysis.cost import uniform_busiest_rank
from moetrace.analysis.expert_sets import (
    Masks,
    count_experts,
    expert_masks,
    group_starts,
    group_union,
    per_rank_counts,
    rank_masks,
)
from moetrace.analysis.growth import uniform_unique_experts

MEASURED_BATCH = "measured"
ESTIMATED = "estimated"
ESTIMATED_ALL = "lower bound"  # fewer windows than B: the union of all of them
DIRECTNESS = {MEASURED_BATCH: 0, ESTIMATED: 1, ESTIMATED_ALL: 2}
MIN_MEASURED_STEPS = 5
SAMPLES = 256
MAX_PERMUTATIONS = 8
# Windows per layer and k the unions are drawn from: above it, a deterministic sample (of whole steps for the
# measured unions), so a long trace costs what a short one does; the estimates are means over random draws anyway.
MAX_WINDOWS = 4_000

SCHEMA: dict[str, pl.DataType] = {
    "batch": pl.Int32(), "k": pl.Int32(), "layer": pl.Int32(), "unique_experts": pl.Float64(),
    "busiest_rank_experts": pl.Float64(), "uniform_bound": pl.Float64(), "source": pl.String(),
}


def uniform_batch_union(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected unique experts in ``tokens`` tokens that each pick top_k of num_experts uniformly at random."""
    return uniform_unique_experts(num_experts, top_k, tokens - 1)


def window_masks(windows: pl.LazyFrame, num_experts: int) -> dict[int, tuple[Masks, npt.NDArray[np.int64]]]:
    """Per layer: one expert bitset per window and the window's ``window_major`` key (the step of a recorded
    window)."""
    frame = windows.select(*WINDOW, "experts").sort(WINDOW).collect()
    out: dict[int, tuple[Masks, npt.NDArray[np.int64]]] = {}
    for (layer,), part in frame.group_by("layer", maintain_order=True):
        major = part["window_major"].to_numpy().astype(np.int64)
        starts = group_starts(major, part["window_minor"].to_numpy())
        masks = group_union(expert_masks(part["experts"].to_numpy(), num_experts), starts)
        out[int(str(layer))] = (masks, major[starts])
    return out


def _busiest(masks: Masks, ranks: Masks) -> npt.NDArray[np.int64]:
    if len(ranks) == 1:
        return count_experts(masks)
    busiest: npt.NDArray[np.int64] = per_rank_counts(masks, ranks).max(axis=1)
    return busiest


def measured_batch_unions(masks: Masks, steps: npt.NDArray[np.int64], batch: int) -> Masks:
    """The union per step over the steps that verified exactly ``batch`` windows."""
    starts = group_starts(steps)
    sizes = np.diff(np.append(starts, len(steps)))
    unions: Masks = group_union(masks, starts)[sizes == batch]
    return unions


def sampled_batch_unions(masks: Masks, batch: int, samples: int, seed: int) -> tuple[Masks, bool]:
    """Unions of ``batch`` distinct windows, about ``samples`` of them: disjoint groups of random permutations of
    the windows (a few permutations at most, so vectorised); all windows once when there are fewer than ``batch``
    (the second value says so)."""
    if len(masks) <= batch:
        return np.bitwise_or.reduce(masks, axis=0, keepdims=True), len(masks) < batch
    rng = np.random.default_rng(seed)
    per_permutation = len(masks) // batch
    permutations = min(MAX_PERMUTATIONS, -(-samples // per_permutation))
    groups = np.concatenate([rng.permutation(len(masks))[: per_permutation * batch].reshape(-1, batch)
                             for _ in range(permutations)])[:samples]
    return np.bitwise_or.reduce(masks[groups], axis=1), False


def batch_unions(sample: WindowSample, num_experts: int, top_k: int, expert_rank: npt.NDArray[np.int64],
                 ks: Sequence[int], batches: Sequence[int], trace_k: int, seed: int = 0,
                 recorded: Mapping[int, WindowSample] | None = None) -> pl.DataFrame:
    """Per (batch, k, layer): unique experts and busiest-rank experts one step reads, and the uniform bound. From
    ``sample`` (recorded at ``trace_k``), or at a k that a sweep recorded in a trace of its own, from that trace's
    sample (``recorded``): its steps are steps at that k."""
    ranks = rank_masks(expert_rank, num_experts)
    rows: list[dict[str, object]] = []
    for k in ks:
        own = (recorded or {}).get(k) if k > 0 else None
        measured_k = own is not None or (k == trace_k and k > 0)
        windows, _ = (own or sample).windows(k, measured_k, MAX_WINDOWS)
        per_layer = window_masks(windows, num_experts)
        for batch in batches:
            bound = uniform_batch_union(num_experts, top_k, batch * (k + 1))
            for layer, (masks, steps) in sorted(per_layer.items()):
                unions = measured_batch_unions(masks, steps, batch) if measured_k else masks[:0]
                source = MEASURED_BATCH
                if len(unions) < MIN_MEASURED_STEPS:
                    unions, short = sampled_batch_unions(masks, batch, SAMPLES, seed + 7919 * layer + batch)
                    source = ESTIMATED_ALL if short else ESTIMATED
                if len(unions) == 0:
                    continue
                rows.append({"batch": batch, "k": k, "layer": layer,
                             "unique_experts": float(count_experts(unions).mean()),
                             "busiest_rank_experts": float(_busiest(unions, ranks).mean()),
                             "uniform_bound": bound, "source": source})
    return pl.DataFrame(rows, schema=SCHEMA)


def uniform_unions(num_experts: int, top_k: int, expert_rank: npt.NDArray[np.int64], ks: Sequence[int],
                   batches: Sequence[int]) -> pl.DataFrame:
    """batch_unions' rows for uniformly random routing (one row per batch and k, layer 0)."""
    single_rank = int(expert_rank.max()) == 0
    rows = []
    for k in ks:
        for batch in batches:
            bound = uniform_batch_union(num_experts, top_k, batch * (k + 1))
            busiest = bound if single_rank else uniform_busiest_rank(
                num_experts, top_k, expert_rank, batch * (k + 1) - 1, samples=64)
            rows.append({"batch": batch, "k": k, "layer": 0, "unique_experts": bound,
                         "busiest_rank_experts": busiest, "uniform_bound": bound, "source": "uniform"})
    return pl.DataFrame(rows, schema=SCHEMA)


def union_means(unions: pl.DataFrame) -> pl.DataFrame:
    """Per (batch, k): the mean over layers, and where the unions came from (the least direct source of any
    layer)."""
    return (
        unions.group_by("batch", "k")
        .agg(pl.col("unique_experts").mean(), pl.col("busiest_rank_experts").mean(),
             pl.col("uniform_bound").first(),
             pl.col("source").sort_by(pl.col("source").replace_strict(DIRECTNESS, default=len(DIRECTNESS))).last()
             .alias("union_source"))
        .sort("batch", "k")
    )
