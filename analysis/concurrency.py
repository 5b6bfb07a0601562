"""Unique experts one step reads at concurrency B, per k: the one definition the cost model, the decision, the
self-check and the tables share (B = 1 is one request's step).

At a k a trace of the sweep recorded (its request-steps: every token each request read in a step, anchors,
accepted and rejected drafts, or one decode token where nothing was proposed):

- measured: over the steps that really ran B requests, all of them decoding (per data-parallel rank, from the
  steps table) and none sharing a prompt with another, the union of every token the step read, where the trace has
  at least ``MIN_MEASURED_STEPS``;
- estimated: otherwise, the mean union of B request-steps drawn at random, one from each of B requests with
  different prompts, as a step's requests are, each request as likely as it has request-steps (seeded; B = 1: every
  request-step once, exactly). Under greedy decoding, requests that share a prompt count as one
  (``request_prompts``): they read the same tokens, and a trace recorded over a set of prompts in rounds repeats
  them (on an H100 trace of 48 prompts over 168 requests, one request-step from each of 16 requests gave 139
  experts a layer where its steps of 16 requests read 152; one per prompt, 150). Over fewer prompts than B, each
  prompt ⌊B/P⌋ times and the rest drawn;
- lower bound: fewer request-steps than B: the union of all of them.

At a k no trace recorded: the counterfactual windows (``counterfactual``: one per request-step, as many consecutive
accepted tokens as its drafter proposed) of the trace acceptance draws the k from (``drawn_from``: the smallest
recorded k above it, else the largest), drawn the same way (lower bound when fewer than B); so too every k drawn
from a trace whose adaptive schedule chose each request-step's drafts (``RecordedK.scheduled``: its steps are no
fixed k's). Alongside: uniform, N·(1−(1−K/N)^(B(k+1))).

Long traces are sampled to about ``MAX_WINDOWS`` windows per layer and k first (whole steps where steps are
unioned). Per layer, with the experts on the busiest rank under an expert placement and the ranks touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.acceptance import decode_steps, drawn_from
from moetrace.analysis.budgets import WINDOW, WindowSample
from moetrace.analysis.expert_sets import (
    Masks,
    count_experts,
    expert_masks,
    group_starts,
    group_union,
    looked_up,
    per_rank_counts,
    rank_masks,
)
from moetrace.analysis.predicates import phase_is, step_key
from moetrace.analysis.sources import Source, least_direct_expr

MIN_MEASURED_STEPS = 5
SAMPLES = 256
# random keys drawn per union estimate, at most: 256 draws over up to 1,024 prompts, fewer over more
KEYED_VALUES = 1 << 18
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
    """A trace of the sweep at its own k: its rows (``WindowSample``), its steps table and each request's prompt
    (``request_prompts``; empty: every request its own). ``scheduled``: an adaptive schedule chose how many drafts
    each of its request-steps verified, so its steps ran no fixed k, its own included: every k is drawn from it as
    counterfactual windows (of k + 1 tokens where its ``sample`` says the drafter proposed all of them:
    ``counterfactual.every_draft_proposed``)."""

    sample: WindowSample
    steps: pl.LazyFrame
    prompts: Mapping[int, int] = field(default_factory=dict)
    scheduled: bool = False


def request_prompts(routing: pl.LazyFrame) -> dict[int, int]:
    """Request → a number per distinct prompt (numbered in request order: the same numbers run after run): requests
    whose prefill rows read the same tokens at the same positions share one. Under prefix caching a repeat computes
    only the part of its prompt the cache did not serve, its tail: a request shares the prompt of a longer one whose
    rows end at the same position and agree at every position it holds. A request with no prefill rows, or whose
    token ids the trace did not record, is its own."""
    first_layer = routing.select(pl.col("layer").min()).collect().item()
    keyed = (routing.filter(phase_is("prefill") & (pl.col("layer") == first_layer))
             .group_by("request")
             .agg(pl.col("token").null_count().alias("unknown"), pl.col("position").sort().alias("positions"),
                  pl.col("token").sort_by("position").alias("tokens"))
             .filter(pl.col("unknown") == 0)
             .with_columns(pl.struct("positions", "tokens").hash(seed=0).alias("key"),
                           pl.col("positions").list.len().alias("rows"),
                           pl.col("positions").list.first().alias("first"),
                           pl.col("positions").list.last().alias("last"), pl.col("tokens").list.last().alias("token"))
             .collect())
    found: dict[int, int] = dict(zip(keyed["request"].to_list(), keyed["key"].to_list()))  # whole prompts: by rows
    # tails, and the prompts that end where one does: matched in Python, the longest first (a tail finds its prompt)
    involved = (keyed.join(keyed.filter(pl.col("first") > 0).select("last", "token").unique(), on=["last", "token"],
                           how="semi")
                .sort(["rows", "request"], descending=[True, False]))
    ending: dict[tuple[int, int], list[tuple[int, list[int], list[int]]]] = {}  # (last position, its token) → prompts
    for request, key, positions, tokens in zip(involved["request"].to_list(), involved["key"].to_list(),
                                               involved["positions"].to_list(), involved["tokens"].to_list()):
        end = ending.setdefault((positions[-1], tokens[-1]), [])
        held = next((number for number, prompt_positions, prompt_tokens in end
                     if holds_tail(prompt_positions, prompt_tokens, positions, tokens)), None)
        if held is None:
            held = key
            end.append((key, positions, tokens))
        found[int(request)] = held
    numbers: dict[int, int] = {}
    return {request: numbers.setdefault(found[request], len(numbers)) for request in sorted(found)}


def prompt_numbers(prompts: Mapping[int, int], requests: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Each request's prompt number (``request_prompts``); -1 - request for a request that is its own."""
    known = np.fromiter(prompts.keys(), dtype=np.int64, count=len(prompts))
    order = np.argsort(known)
    known, numbers = known[order], np.fromiter(prompts.values(), dtype=np.int64, count=len(prompts))[order]
    return looked_up(known, numbers, requests, -1 - requests)


def holds_tail(positions: list[int], tokens: list[int], tail_positions: list[int], tail_tokens: list[int]) -> bool:
    """Whether a prompt's prefill rows (``positions``, ``tokens``, sorted by position) read ``tail_tokens`` at every
    one of ``tail_positions``."""
    read = dict(zip(positions, tokens))
    return all(read.get(position) == token for position, token in zip(tail_positions, tail_tokens))


def decoding_step_sizes(steps: pl.LazyFrame) -> dict[int, int]:
    """Step key → requests, for the steps in which every request was decoding."""
    sizes = decode_steps(steps).filter(pl.col("decoding")).select(step_key(), "requests").collect()
    return dict(zip(sizes["step_key"].to_list(), sizes["requests"].to_list()))


@dataclass(frozen=True)
class LayerWindows:
    """One layer's windows: an expert bitset each, its ``window_major`` key (the step key of a recorded
    request-step) and the request it belongs to."""

    masks: Masks
    major: npt.NDArray[np.int64]
    requests: npt.NDArray[np.int64]


def window_masks(windows: pl.LazyFrame, num_experts: int, request_key: str) -> dict[int, LayerWindows]:
    """Per layer, the windows' ``LayerWindows`` (ordered by their ``WINDOW`` key); ``request_key``: the key column
    that holds the request."""
    frame = windows.select(*WINDOW, "experts").collect()
    keys = [frame.get_column(name).to_numpy() for name in WINDOW]
    experts = frame.get_column("experts").to_numpy()
    order = np.lexsort(keys[::-1])  # the samples' windows come in key order: then nothing is moved
    if bool((order != np.arange(len(order))).any()):
        keys, experts = [key[order] for key in keys], experts[order]
    layer, major, minor = keys
    requests = major if request_key == "window_major" else minor
    out: dict[int, LayerWindows] = {}
    bounds = np.append(group_starts(layer), len(layer)).tolist()
    for first, end in zip(bounds[:-1], bounds[1:]):  # a layer's bitsets at a time: all of them would be 100 MB
        starts = first + group_starts(major[first:end], minor[first:end])
        masks = group_union(expert_masks(experts[first:end], num_experts), starts - first)
        out[int(layer[first])] = LayerWindows(masks, major[starts].astype(np.int64), requests[starts].astype(np.int64))
    return out


@dataclass(frozen=True)
class StepUnions:
    """One layer's recorded steps: the union of each step's windows, how many windows the rows hold and how many
    distinct prompts they belong to, and how many requests the steps table says it ran, all decoding (-1: not a
    decoding step)."""

    unions: Masks
    windows: npt.NDArray[np.int64]
    prompts: npt.NDArray[np.int64]
    requests: npt.NDArray[np.int64]

    @classmethod
    def of(cls, masks: Masks, steps: npt.NDArray[np.int64], prompts: npt.NDArray[np.int64],
           sizes: Mapping[int, int]) -> StepUnions:
        """``steps``: each window's step key, sorted; ``prompts``: each window's prompt number."""
        starts = group_starts(steps)
        windows = np.diff(np.append(starts, len(steps)))
        step_of = np.repeat(np.arange(len(starts)), windows)
        distinct = np.bincount(np.unique(np.stack([step_of, prompts], axis=1), axis=0)[:, 0], minlength=len(starts))
        return cls(group_union(masks, starts), windows, distinct.astype(np.int64),
                   np.array([sizes.get(int(key), -1) for key in steps[starts]], dtype=np.int64))

    def ran(self, batch: int) -> Masks:
        """The unions of the steps that ran exactly ``batch`` requests, all decoding, with every request-step in the
        rows and no two of one prompt (a step with rows missing is not measured, nor one that repeats a prompt:
        under greedy decoding requests of one prompt started together read the same tokens, and a step of ``batch``
        distinct requests reads more experts)."""
        unions: Masks = self.unions[(self.requests == batch) & (self.windows == batch) & (self.prompts == batch)]
        return unions


def sampled_batch_unions(masks: Masks, prompts: npt.NDArray[np.int64], batch: int, samples: int,
                         seed: int) -> tuple[Masks, bool]:
    """Unions of ``batch`` windows as one step of ``batch`` requests reads them (``prompts``: each window's prompt
    number): B = 1: every window once (exact mean); else ``samples`` draws (fewer over many prompts: at most
    ``KEYED_VALUES`` random keys in all) of ``batch`` distinct prompts, each as likely as it has windows (a request
    is in as many steps as it runs), and a window of each at random; over P < B prompts every prompt ⌊B/P⌋ times and
    the rest so drawn. All windows once when there are fewer windows than ``batch`` (the second value says so)."""
    if batch == 1:
        return masks, False
    if len(masks) <= batch:
        return np.bitwise_or.reduce(masks, axis=0, keepdims=True), len(masks) < batch
    rng = np.random.default_rng(seed)
    _, of_window = np.unique(prompts, return_inverse=True)
    counts = np.bincount(of_window)
    by_prompt = np.argsort(of_window, kind="stable")
    firsts = np.cumsum(counts) - counts
    draws = max(1, min(samples, KEYED_VALUES // len(counts)))
    every, rest = divmod(batch, len(counts))
    # Efraimidis-Spirakis: the ``rest`` largest of log(u) / weight are a draw without replacement by weight
    keys = np.log(rng.random((draws, len(counts)))) / counts
    drawn = np.argpartition(-keys, rest - 1, axis=1)[:, :rest] if rest else np.zeros((draws, 0), dtype=np.int64)
    chosen = np.concatenate([np.tile(np.arange(len(counts)), (draws, every)), drawn], axis=1)
    picks = by_prompt[firsts[chosen] + (rng.random(chosen.shape) * counts[chosen]).astype(np.int64)]
    return np.bitwise_or.reduce(masks[picks.T], axis=0), False  # each draw's windows ORed in whole rows: 2-5x faster


def batch_unions(recorded: Mapping[int, RecordedK], num_experts: int, top_k: int,
                 expert_rank: npt.NDArray[np.int64], ks: Sequence[int], batches: Sequence[int],
                 seed: int = 0) -> pl.DataFrame:
    """Per (batch, k, layer): unique experts, busiest-rank experts and ranks touched one step reads, what they rest
    on (windows, measured steps), the uniform bound and the source (see the module doc). ``recorded``: the sweep's
    traces by k."""
    ranks = rank_masks(expert_rank, num_experts)

    def at(k: int) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        drawn = recorded[drawn_from(recorded, k)]
        at_k = k in recorded and not drawn.scheduled
        if at_k:
            windows, _ = drawn.sample.request_steps(MAX_WINDOWS)
            sizes = decoding_step_sizes(drawn.steps)
        else:
            windows, _ = drawn.sample.request_windows(k, MAX_WINDOWS)
            sizes = {}
        per_layer = window_masks(windows, num_experts, "window_minor" if at_k else "window_major")
        for layer, found in sorted(per_layer.items()):
            prompts = prompt_numbers(drawn.prompts, found.requests)
            by_step = StepUnions.of(found.masks, found.major, prompts, sizes) if at_k else None
            for batch in batches:
                unions = by_step.ran(batch) if by_step is not None else found.masks[:0]
                measured_steps = len(unions)
                source = Source.MEASURED
                if measured_steps < MIN_MEASURED_STEPS:
                    unions, short = sampled_batch_unions(found.masks, prompts, batch, SAMPLES,
                                                         seed + 7919 * layer + batch)
                    measured_steps = 0
                    source = (Source.LOWER_BOUND if short else
                              Source.ESTIMATED if at_k else Source.COUNTERFACTUAL)
                if len(unions) == 0:
                    continue
                on_rank = per_rank_counts(unions, ranks) if len(ranks) > 1 else count_experts(unions)[:, None]
                rows.append({"batch": batch, "k": k, "layer": layer,
                             "unique_experts": float(count_experts(unions).mean()),
                             "busiest_rank_experts": float(on_rank.max(axis=1).mean()),
                             "ranks_touched": float((on_rank > 0).sum(axis=1).mean()),
                             "uniform_bound": uniform_unique_experts(num_experts, top_k, batch * (k + 1)),
                             "windows": len(found.masks), "steps": measured_steps, "source": source.value})
        return rows

    # two ks at a time: their windows are cut by Polars and counted by numpy, both of which let go of the GIL
    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = [row for found in pool.map(at, ks) for row in found]
    return pl.DataFrame(rows, schema=SCHEMA).sort("k", "batch", "layer")


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
