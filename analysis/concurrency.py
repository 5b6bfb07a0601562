"""Unique experts one step reads at concurrency B, per k: the one definition the cost model, the decision, the
self-check and the tables share (B = 1 is one request's step).

At a k a trace of the sweep recorded (its request-steps: every token each request read in a step, anchors,
accepted and rejected drafts, or one decode token where nothing was proposed):

- measured: over the steps that really ran B requests, all of them decoding (per data-parallel rank, from the
  steps table), the union of every token the step read, where the trace has at least ``MIN_MEASURED_STEPS``;
- estimated: otherwise, the mean union of B distinct request-steps drawn at random (seeded: disjoint groups of a
  few random permutations; B = 1: every request-step once, exactly);
- lower bound: fewer request-steps than B: the union of all of them.

At a k no trace recorded: windows of k+1 consecutive accepted tokens of the primary trace (counterfactual), drawn
the same way (lower bound when fewer than B). Alongside: uniform, N·(1−(1−K/N)^(B(k+1))).

Long traces are sampled to about ``MAX_WINDOWS`` windows per layer and k first (whole steps where steps are
unioned). Per layer, with the experts on the busiest rank under an expert placement and the ranks touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.acceptance import decode_steps
from moetrace.analysis.budgets import WINDOW, WindowSample
from moetrace.analysis.expert_sets import (
    Masks,
    count_experts,
    expert_masks,
    group_starts,
    group_union,
    per_rank_counts,
    rank_masks,
)
from moetrace.analysis.predicates import step_key
from moetrace.analysis.sources import Source, least_direct_expr

MIN_MEASURED_STEPS = 5
SAMPLES = 256
MAX_PERMUTATIONS = 8
# Windows per layer and k the unions are drawn from: above it, a deterministic sample (of whole steps for the
# measured unions), so a long trace costs what a short one does; the estimates are means over random draws anyway.
MAX_WINDOWS = 4_000

SCHEMA: dict[str, pl.DataType] = {
    "batch": pl.Int32(), "k": pl.Int32(), "layer": pl.Int32(), "unique_experts": pl.Float64(),
    "busiest_rank_experts": pl.Float64(), "ranks_touched": pl.Float64(), "uniform_bound": pl.Float64(),
    "windows": pl.Int64(), "steps": pl.Int64(), "source": pl.String(),
}


def uniform_unique_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected unique experts in ``tokens`` tokens that each pick top_k of num_experts uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class RecordedK:
    """A trace of the sweep at its own k: its rows (``WindowSample``) and its steps table."""

    sample: WindowSample
    steps: pl.LazyFrame


def decoding_step_sizes(steps: pl.LazyFrame) -> dict[int, int]:
    """Step key → requests, for the steps in which every request was decoding."""
    sizes = decode_steps(steps).filter(pl.col("decoding")).select(step_key(), "requests").collect()
    return dict(zip(sizes["step_key"].to_list(), sizes["requests"].to_list()))


def window_masks(windows: pl.LazyFrame, num_experts: int) -> dict[int, tuple[Masks, npt.NDArray[np.int64]]]:
    """Per layer: one expert bitset per window and the window's ``window_major`` key (the step key of a recorded
    request-step)."""
    frame = windows.select(*WINDOW, "experts").sort(WINDOW).collect()
    out: dict[int, tuple[Masks, npt.NDArray[np.int64]]] = {}
    for (layer,), part in frame.group_by("layer", maintain_order=True):
        major = part["window_major"].to_numpy().astype(np.int64)
        starts = group_starts(major, part["window_minor"].to_numpy())
        masks = group_union(expert_masks(part["experts"].to_numpy(), num_experts), starts)
        out[int(str(layer))] = (masks, major[starts])
    return out


@dataclass(frozen=True)
class StepUnions:
    """One layer's recorded steps: the union of each step's windows, how many windows the rows hold, and how many
    requests the steps table says it ran, all decoding (-1: not a decoding step)."""

    unions: Masks
    windows: npt.NDArray[np.int64]
    requests: npt.NDArray[np.int64]

    @classmethod
    def of(cls, masks: Masks, steps: npt.NDArray[np.int64], sizes: Mapping[int, int]) -> StepUnions:
        starts = group_starts(steps)
        return cls(group_union(masks, starts), np.diff(np.append(starts, len(steps))),
                   np.array([sizes.get(int(key), -1) for key in steps[starts]], dtype=np.int64))

    def ran(self, batch: int) -> Masks:
        """The unions of the steps that ran exactly ``batch`` requests, all decoding, with every request-step in the
        rows (a step with rows missing is not measured)."""
        unions: Masks = self.unions[(self.requests == batch) & (self.windows == batch)]
        return unions


def sampled_batch_unions(masks: Masks, batch: int, samples: int, seed: int) -> tuple[Masks, bool]:
    """Unions of ``batch`` distinct windows: one batch = every window once (exact mean); else about ``samples``
    disjoint groups of a few random permutations (vectorised); all windows once when there are fewer than
    ``batch`` (the second value says so)."""
    if batch == 1:
        return masks, False
    if len(masks) <= batch:
        return np.bitwise_or.reduce(masks, axis=0, keepdims=True), len(masks) < batch
    rng = np.random.default_rng(seed)
    per_permutation = len(masks) // batch
    permutations = min(MAX_PERMUTATIONS, -(-samples // per_permutation))
    groups = np.concatenate([rng.permutation(len(masks))[: per_permutation * batch].reshape(-1, batch)
                             for _ in range(permutations)])[:samples]
    return np.bitwise_or.reduce(masks[groups], axis=1), False


def batch_unions(counterfactual: WindowSample, recorded: Mapping[int, RecordedK], num_experts: int, top_k: int,
                 expert_rank: npt.NDArray[np.int64], ks: Sequence[int], batches: Sequence[int],
                 seed: int = 0) -> pl.DataFrame:
    """Per (batch, k, layer): unique experts, busiest-rank experts and ranks touched one step reads, what they rest
    on (windows, measured steps), the uniform bound and the source (see the module doc). ``recorded``: the sweep's
    traces by k; ``counterfactual``: the primary trace's sample, for the k no trace recorded."""
    ranks = rank_masks(expert_rank, num_experts)
    rows: list[dict[str, object]] = []
    for k in ks:
        at_k = recorded.get(k)
        if at_k is not None:
            windows, _ = at_k.sample.request_steps(MAX_WINDOWS)
            sizes = decoding_step_sizes(at_k.steps)
        else:
            windows, _ = counterfactual.windows(k, False, MAX_WINDOWS)
            sizes = {}
        per_layer = window_masks(windows, num_experts)
        by_step = {layer: StepUnions.of(masks, steps, sizes) for layer, (masks, steps) in per_layer.items()
                   if at_k is not None}
        for batch in batches:
            for layer, (masks, steps) in sorted(per_layer.items()):
                unions = by_step[layer].ran(batch) if at_k is not None else masks[:0]
                measured_steps = len(unions)
                source = Source.MEASURED
                if measured_steps < MIN_MEASURED_STEPS:
                    unions, short = sampled_batch_unions(masks, batch, SAMPLES, seed + 7919 * layer + batch)
                    measured_steps = 0
                    source = (Source.LOWER_BOUND if short else
                              Source.ESTIMATED if at_k is not None else Source.COUNTERFACTUAL)
                if len(unions) == 0:
                    continue
                on_rank = per_rank_counts(unions, ranks) if len(ranks) > 1 else count_experts(unions)[:, None]
                rows.append({"batch": batch, "k": k, "layer": layer,
                             "unique_experts": float(count_experts(unions).mean()),
                             "busiest_rank_experts": float(on_rank.max(axis=1).mean()),
                             "ranks_touched": float((on_rank > 0).sum(axis=1).mean()),
                             "uniform_bound": uniform_unique_experts(num_experts, top_k, batch * (k + 1)),
                             "windows": len(masks), "steps": measured_steps, "source": source.value})
    return pl.DataFrame(rows, schema=SCHEMA)


MONTE_CARLO_VALUES = 1 << 24  # random scores drawn at once for the uniform busiest rank (128 MiB of float64)


def uniform_unions(num_experts: int, top_k: int, expert_rank: npt.NDArray[np.int64], ks: Sequence[int],
                   batches: Sequence[int], samples: int = 400, seed: int = 0) -> pl.DataFrame:
    """batch_unions' rows for uniformly random routing (one row per batch and k, layer 0): the bound and, over
    several ranks, the busiest rank and ranks touched by a seeded Monte Carlo of B(k+1) tokens each picking top_k
    distinct experts (fewer samples for large steps, so that a draw stays within ``MONTE_CARLO_VALUES``)."""
    rng = np.random.default_rng(seed)
    ranks = rank_masks(expert_rank, num_experts)
    rows = []
    for k in ks:
        for batch in batches:
            tokens = batch * (k + 1)
            bound = uniform_unique_experts(num_experts, top_k, tokens)
            busiest, touched = bound, 1.0
            if len(ranks) > 1:
                draws = max(8, min(samples, MONTE_CARLO_VALUES // (tokens * num_experts)))
                picks = np.argsort(rng.random((draws, tokens, num_experts)), axis=-1)[..., :top_k]
                masks = np.bitwise_or.reduce(expert_masks(picks.reshape(-1, top_k), num_experts)
                                             .reshape(draws, tokens, -1), axis=1)
                on_rank = per_rank_counts(masks, ranks)
                busiest, touched = float(on_rank.max(axis=1).mean()), float((on_rank > 0).sum(axis=1).mean())
            rows.append({"batch": batch, "k": k, "layer": 0, "unique_experts": bound,
                         "busiest_rank_experts": busiest, "ranks_touched": touched, "uniform_bound": bound,
                         "windows": 0, "steps": 0, "source": Source.UNIFORM.value})
    return pl.DataFrame(rows, schema=SCHEMA)


def union_means(unions: pl.DataFrame) -> pl.DataFrame:
    """Per (batch, k): the mean over layers, what the least sampled layer rests on, and the least direct source of
    any layer (``union_source``)."""
    return (
        unions.group_by("batch", "k")
        .agg(pl.col("unique_experts").mean(), pl.col("busiest_rank_experts").mean(), pl.col("ranks_touched").mean(),
             pl.col("uniform_bound").first(), pl.col("windows").min(), pl.col("steps").min(),
             least_direct_expr("source").alias("union_source"))
        .sort("batch", "k")
    )
