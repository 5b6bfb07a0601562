"""Expert budgets: keep only the B experts with the highest aggregated router score in each verification window
(per layer) and see what that keeps of the routing.

Experts are ranked per window by the sum of their candidate scores when the trace recorded router candidates
(``cand_experts``/``cand_scores``), else by the sum of their top-k routing weights. For each budget B:

- ``coverage``: share of the routing weight (top-k weights, all windows) that lands on kept experts;
- ``rerouted_share``: share of tokens with at least one top-k expert outside the kept set (they would re-route);
- ``experts_read`` / ``experts_saved``: mean experts read per window, min(unique, B), and the reduction;
- ``bytes_saved``: ``experts_saved`` × bytes of one expert, per window and layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.counterfactual import CutSequence, Proposals, proposed_drafts
from moetrace.analysis.expert_sets import group_of_row, group_starts, looked_up
from moetrace.analysis.predicates import HASH_RANGE, accepted_sequence, in_sequence, not_prefill, phase_is, step_key

WINDOW = ["layer", "window_major", "window_minor"]


def budget_windows(routing: pl.LazyFrame, k: int, measured: bool, share: float = 1.0) -> pl.LazyFrame:
    """Routing rows keyed by window, complete windows of k+1 tokens only: a budget must hold for a window that
    verifies all k drafts, however many a drafter proposed. Measured: the recorded verification windows ``(step,
    request)`` that verified k drafts. Counterfactual: ``counterfactual.window_spans``' full windows of k+1
    consecutive accepted tokens (``window_major``: the request, ``window_minor``: the window's first position).
    ``share`` < 1 keeps a deterministic sample of whole windows (by a hash of the window key): budget curves are
    means over windows, so a uniform sample estimates them at a fraction of the cost."""
    if not measured:
        return CutSequence(accepted_sequence(routing).collect(), 0, None).windows(k, share=share, full=True)[0].lazy()
    keyed = routing.filter(phase_is("verify")).with_columns(
        window_major=step_key(), window_minor=pl.col("request")
    )
    if share < 1.0:
        key_hash = pl.struct("window_major", "window_minor").hash(seed=0) % HASH_RANGE
        keyed = keyed.filter(key_hash < int(share * HASH_RANGE))
    return keyed.filter(pl.len().over(WINDOW) == k + 1)


# lcm(1..9): a block of this many positions holds whole windows of k+1 tokens for every k ≤ 8 (full windows start
# at multiples of k+1), so a sample of blocks serves every k at once. A request-step's window (``counterfactual``)
# starts at its anchor: one that runs past a block's end into a block not sampled is lost (at most k of 2,520).
SAMPLE_BLOCK = 2520
# Rows read into memory at most, per table, for windows at every k; beyond it, a deterministic sample.
MAX_SAMPLE_ROWS = 3_000_000


@dataclass(frozen=True)
class WindowSample:
    """What windows at any k are cut from, read from the trace once: the accepted sequence of a deterministic
    sample of position blocks ``(request, position // SAMPLE_BLOCK)`` (counterfactual windows), and every
    non-prefill row of a deterministic sample of whole steps (``stepped``: the recorded request-steps, at the
    trace's own k). ``share``: the share of blocks and steps kept (1.0: the whole trace); ``trace_k``: the k the
    trace recorded; ``proposals``: its ``counterfactual.proposed_drafts``."""

    accepted: pl.DataFrame
    stepped: pl.DataFrame
    share: float
    trace_k: int
    proposals: pl.DataFrame

    @cached_property
    def sequence(self) -> CutSequence:
        """The accepted rows ordered for cutting counterfactual windows, with what each request-step proposed."""
        return CutSequence(self.accepted, self.trace_k, Proposals.of(self.proposals) if self.trace_k else None)

    def windows(self, k: int, measured: bool, max_windows: int) -> tuple[pl.LazyFrame, float]:
        """``budget_windows`` of the sample (full windows of k+1 tokens), thinned to about ``max_windows`` windows
        per layer; with the share of the trace's windows they stand for."""
        if measured:  # whole steps, so that a step's windows stay together
            share = window_share(self.stepped.height, max(int(self.stepped["layer"].n_unique()), 1), k, max_windows)
            return budget_windows(self._whole_steps(share), k, True), share * self.share
        keyed, share = self.sequence.windows(k, max_windows, full=True)
        return keyed.lazy(), share * self.share

    def request_windows(self, k: int, max_windows: int) -> tuple[pl.LazyFrame, float]:
        """The counterfactual windows at ``k`` (``counterfactual``: one per request-step, as many accepted tokens as
        its drafter proposed): the layer and experts of their rows (what ``concurrency`` reads), keyed as
        ``CutSequence.windows``, thinned to about ``max_windows`` windows per layer; with the share of the trace's
        windows they stand for."""
        keyed, share = self.sequence.windows(k, max_windows, columns=["layer", "experts"])
        return keyed.lazy(), share * self.share

    def request_steps(self, max_windows: int) -> tuple[pl.LazyFrame, float]:
        """Every recorded request-step as a window (``window_major``: its step key, ``window_minor``: its request),
        all its tokens (anchor, accepted and rejected drafts, or one decode token), thinned by whole steps to about
        ``max_windows`` windows per layer; with the share of the trace's request-steps they stand for."""
        windows = self.stepped.select("step_key", "request").n_unique() if self.stepped.height else 0
        share = 1.0 if windows <= max_windows else max_windows / windows
        keyed = self._whole_steps(share).with_columns(window_major=pl.col("step_key"), window_minor=pl.col("request"))
        return keyed, share * self.share

    def _whole_steps(self, share: float) -> pl.LazyFrame:
        rows = self.stepped.lazy()
        return rows if share >= 1.0 else rows.filter(
            pl.col("step_key").hash(seed=1) % HASH_RANGE < int(share * HASH_RANGE))


def sample_share(rows: int, max_rows: int = MAX_SAMPLE_ROWS) -> float:
    """The share of a trace of ``rows`` routing rows that ``sampled_windows`` keeps: all of it up to ``max_rows``."""
    return min(1.0, max_rows / max(rows, 1))


SAMPLE_KEYS = ["layer", "step", "dp_rank", "request", "position", "phase", "draft_pos", "accepted"]


def sampled_windows(routing: pl.LazyFrame, share: float, columns: list[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The accepted and stepped tables of a ``WindowSample`` at ``share``, read in one pass over the rows (each
    table's rows flagged, then split: a pass decodes every row's columns before any filter); ``columns`` besides the
    keys every window needs. Each row is kept or not by a hash of its own block or step key, so the sample of a
    trace's parts is the sample of the whole."""
    keep, beside = sample_selection(share, columns)
    return split_sample(routing.filter(not_prefill()).with_columns(step_key()).filter(keep).select(beside).collect(),
                        columns)


def sample_selection(share: float, columns: list[str]) -> tuple[pl.Expr, list[str | pl.Expr]]:
    """Which non-prefill routing rows (with their ``step_key``) a ``WindowSample`` at ``share`` keeps, and what it
    reads of them (for ``split_sample``): its keys, ``columns``, the step key and each table's flag."""
    in_accepted, in_stepped = in_sequence(), pl.lit(True)
    if share < 1.0:
        in_accepted, in_stepped = in_accepted & block_sampled(share), step_sampled(share)
    return in_accepted | in_stepped, [*SAMPLE_KEYS, *columns, "step_key", in_accepted.alias("in_accepted"),
                                      in_stepped.alias("in_stepped")]


def split_sample(kept: pl.DataFrame, columns: list[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The accepted and stepped tables of the rows ``sample_selection`` kept."""
    chosen = [*SAMPLE_KEYS, *columns]
    # one chunk each: Polars sorts and gathers a frame of many chunks (one per file and row group) many times slower
    # (a 3M-row sample: 11 s against 0.6 s)
    return (kept.filter("in_accepted").select(chosen).rechunk(),
            kept.filter("in_stepped").select(*chosen, "step_key").rechunk())


def block_sampled(share: float) -> pl.Expr:
    """Whether a routing row's position block ``(request, position // SAMPLE_BLOCK)`` is in the sample at
    ``share``: a hash below the share of its range, so a smaller share keeps a subset of a larger one's blocks."""
    block = pl.struct(pl.col("request"), pl.col("position") // SAMPLE_BLOCK).hash(seed=0) % HASH_RANGE
    return block < int(share * HASH_RANGE)


def step_sampled(share: float) -> pl.Expr:
    """Whether a row's step (``step_key``) is in the sample at ``share`` (as ``block_sampled``)."""
    return pl.col("step_key").hash(seed=0) % HASH_RANGE < int(share * HASH_RANGE)


def window_sample(routing: pl.LazyFrame, trace_k: int, columns: list[str],
                  max_rows: int = MAX_SAMPLE_ROWS) -> WindowSample:
    """A ``WindowSample`` of the trace (see ``sampled_windows``)."""
    share = sample_share(int(routing.select(pl.len()).collect().item()), max_rows)
    return WindowSample(*sampled_windows(routing, share, columns), share, trace_k, proposed_drafts(routing, trace_k))


def window_share(rows: int, layers: int, k: int, max_windows: int) -> float:
    """The share of windows to keep so that about ``max_windows`` per layer remain: ``rows`` routing rows over
    ``layers`` layers hold at most rows / layers / (k+1) complete windows of k+1 tokens."""
    windows = rows / max(layers, 1) / (k + 1)
    return 1.0 if windows <= max_windows else max_windows / windows


def budget_curves(windows: pl.LazyFrame, expert_bytes: int | None, use_candidates: bool) -> pl.DataFrame:
    """Per (layer, budget) from 1 to the largest useful budget: see the module doc for the columns (``bytes_saved``
    null where ``expert_bytes`` is: a format the cost model cannot price)."""
    # Counted in numpy, the rows ordered by window and position: Polars' joins and window functions over the picks
    # took a second per k for a sample of 30,000 windows.
    columns = [*WINDOW, "position", "experts", "weights", *(["cand_experts", "cand_scores"] if use_candidates else [])]
    frame = windows.select(columns).collect()
    keys = [frame.get_column(name).to_numpy() for name in (*WINDOW, "position")]
    order = np.lexsort(keys[::-1])
    ordered = [key[order] for key in keys]
    window_firsts = group_starts(*ordered[:3])
    window = group_of_row(window_firsts, len(order))  # [rows]: windows numbered in WINDOW order
    token_firsts = group_starts(*ordered)  # a token: a window's rows at one position
    layers, window_layer = np.unique(ordered[0][window_firsts], return_inverse=True)

    def column(name: str) -> npt.NDArray[Any]:
        values: npt.NDArray[Any] = frame.get_column(name).to_numpy()[order]
        return values

    def keyed(name: str) -> npt.NDArray[np.int64]:  # window · 2^16 + expert, per (row, slot) in row order
        experts = column(name)
        return (np.repeat(window, experts.shape[1]) << 16) | experts.reshape(-1).astype(np.int64)

    pick = keyed("experts")
    weights = column("weights").reshape(-1).astype(np.float64)
    picked, picked_weight, of_pick = _summed(pick, weights)
    if use_candidates:
        scored, score, _ = _summed(keyed("cand_experts"), column("cand_scores").reshape(-1).astype(np.float64))
        weight = looked_up(picked, picked_weight, scored, 0.0)
    else:
        scored, score, weight = picked, picked_weight, picked_weight
    # each scored expert's rank in its window: by score, descending, then by expert
    by_rank = pl.DataFrame({"window": scored >> 16, "score": score, "expert": scored & 0xFFFF}).select(
        pl.arg_sort_by("window", "score", "expert", descending=[False, True, False])).to_series().to_numpy()
    rank = np.empty(len(scored), dtype=np.int64)
    firsts = group_starts(scored[by_rank] >> 16)
    rank[by_rank] = np.arange(len(scored)) - firsts[group_of_row(firsts, len(scored))] + 1
    budgets = int(rank.max(initial=0))
    scored_layer = window_layer[scored >> 16]
    deepest = np.zeros(len(layers), dtype=np.int64)  # per layer, its largest budget: the most experts a window scored
    np.maximum.at(deepest, scored_layer, rank)

    def per_budget(layer: npt.NDArray[np.intp], budget: npt.NDArray[np.int64],
                   values: npt.NDArray[np.float64] | None = None) -> npt.NDArray[Any]:
        """[layers, budgets]: how many (or ``values`` summed, in their order) per layer and budget 1..budgets; a
        budget past them (an expert no candidate listed) is dropped."""
        counted = np.bincount(layer * (budgets + 2) + budget, values, minlength=len(layers) * (budgets + 2))
        return counted.reshape(len(layers), budgets + 2)[:, 1 : budgets + 1]

    kept_weight = per_budget(scored_layer, rank, weight)  # summed in (window, expert) order: the same sums each run
    unique = np.bincount(picked >> 16, minlength=len(window_layer))  # picked experts per window
    # windows with at least b picked experts: those with b or more, counted down from the most
    reaching = np.cumsum(per_budget(window_layer, np.minimum(unique, budgets))[:, ::-1], axis=1)[:, ::-1]
    slots = len(pick) // max(len(order), 1)
    pick_rank = (looked_up(scored, rank, picked, budgets + 1) if use_candidates else rank)[of_pick]
    worst = (np.maximum.reduceat(pick_rank, token_firsts * slots)
             if len(pick) else np.zeros(0, dtype=np.int64))  # the rank a budget must reach to serve each token
    token_layer = window_layer[window[token_firsts]]
    served = per_budget(token_layer, worst)
    total_weight = np.bincount(np.repeat(window_layer[window], slots), weights, minlength=len(layers))
    total_tokens = np.bincount(token_layer, minlength=len(layers))
    total_windows = np.bincount(window_layer, minlength=len(layers))
    valid = np.arange(1, budgets + 1)[None, :] <= deepest[:, None]
    row_layer, row_budget = np.nonzero(valid)
    windows_of_row = total_windows[row_layer]
    mean_unique = np.where(valid, reaching, 0).sum(axis=1)[row_layer] / windows_of_row
    experts_read = np.cumsum(reaching, axis=1)[valid] / windows_of_row
    experts_saved = mean_unique - experts_read
    return pl.DataFrame({
        "layer": pl.Series(layers[row_layer], dtype=frame.schema["layer"]),
        "budget": row_budget.astype(np.int64) + 1,
        "coverage": np.cumsum(kept_weight, axis=1)[valid] / total_weight[row_layer],
        "rerouted_share": 1.0 - np.cumsum(served, axis=1)[valid] / total_tokens[row_layer],
        "experts_read": experts_read,
        "experts_saved": experts_saved,
    }).with_columns(bytes_saved=pl.col("experts_saved") * (None if expert_bytes is None else float(expert_bytes)))


def _summed(keys: npt.NDArray[np.int64], values: npt.NDArray[np.float64]) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Each key once, ascending, with its values summed (in row order), and the index of each row's key."""
    order = np.argsort(keys, kind="stable")
    firsts = group_starts(keys[order])
    of_row = np.empty(len(keys), dtype=np.int64)
    of_row[order] = group_of_row(firsts, len(keys))
    return keys[order][firsts], np.add.reduceat(values[order], firsts) if len(firsts) else values[:0], of_row


def smallest_budgets(curves: pl.LazyFrame, coverage: float) -> pl.DataFrame:
    """Per layer, the smallest budget whose coverage reaches ``coverage`` (layers where none does are absent)."""
    return (
        curves.filter(pl.col("coverage") >= coverage - 1e-12)
        .sort("budget")
        .group_by("layer")
        .first()
        .select("layer", "budget", "coverage", "rerouted_share", "experts_saved", "bytes_saved")
        .sort("layer")
        .collect()
    )


# A budget sweep: the same workload recorded under several expert budgets (``moetrace record --budget 12,16,none``),
# compared with the run under the router's own routing (``none``).

UNBUDGETED = "none"


def greedy_agreement(reference: pl.LazyFrame, other: pl.LazyFrame) -> pl.DataFrame:
    """How far greedy outputs (``request``, ``position``, ``token``: one row per generated token) agree with the
    reference's: ``tokens`` the reference generated, ``identical`` those the other generated alike at the same
    request and position, their share ``agreement``, and ``diverged`` the requests that differ anywhere."""
    joined = reference.join(other, on=["request", "position"], how="left", suffix="_other")
    same = (pl.col("token") == pl.col("token_other")).fill_null(False)
    return joined.select(
        tokens=pl.len().cast(pl.Int64),
        identical=same.sum().cast(pl.Int64),
        agreement=same.mean().cast(pl.Float64),
        diverged=pl.col("request").filter(~same).n_unique().cast(pl.Int64),
    ).collect()


def largest_groups(routing: pl.LazyFrame, scope: str) -> dict[int, int]:
    """Per MoE layer, the most distinct experts one budget group of verifying tokens used: a step's (``scope``
    step) or one request's window (``window``)."""
    keys = ["step", "layer"] if scope == "step" else ["step", "request", "layer"]
    largest = (routing.filter(pl.col("phase") == "verify").explode("experts").group_by(keys)
               .agg(used=pl.col("experts").n_unique()).group_by("layer").agg(largest=pl.col("used").max()).collect())
    return dict(zip(largest["layer"].to_list(), largest["largest"].to_list()))


def binds(largest: Mapping[int, int], per_layer: Mapping[int, int]) -> bool:
    """Whether a budget (experts per layer) re-routes any token of the unbudgeted run whose groups used at most
    ``largest`` experts per layer. One that never binds leaves every step's routing as it was, so its run is the
    unbudgeted run again: what it measures or is predicted to pay beyond that run is noise."""
    return any(used > per_layer.get(layer, used) for layer, used in largest.items())


def best_budget(rows: pl.DataFrame, column: str, min_agreement: float) -> str | None:
    """The budget with the largest ``column`` (a speedup: ``predicted`` or ``measured_vs_none``) among the
    unbudgeted run and the budgets that bind (``binds``: null for the unbudgeted run) whose ``agreement`` with the
    unbudgeted outputs is at least ``min_agreement``; None where none has one."""
    ranked = rows.filter((pl.col("agreement") >= min_agreement) & pl.col(column).is_not_null()
                         & pl.col("binds").fill_null(True)).sort(column, descending=True)
    return str(ranked["budget"][0]) if ranked.height else None
