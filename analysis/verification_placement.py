"""Verification-aware placement (``moetrace place``). A verification window is one request's anchor and drafts in
one step, in one MoE layer. Under expert parallelism a window costs a dispatch to every rank holding one of its
experts, and a step waits for its busiest rank. The placement here fits, per MoE layer, which expert each rank's
slots hold from the windows' co-activation; the scoring counts what a placement costs on windows it was not fitted
on."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.expert_sets import group_starts
from moetrace.analysis.placement import linear_placement, replicated_placement
from moetrace.analysis.predicates import DP_RANK_SHIFT

if TYPE_CHECKING:
    from moetrace.analysis.window_rows import WindowRows


FIT_WINDOWS = 8192
"""The most windows per layer the exact step of ``verification_placement`` counts (evenly strided); the pairwise
step counts every window."""


@dataclass(frozen=True)
class LayerWindows:
    """One MoE layer's verification windows, in step order: each window's step key (``predicates.step_key``), its
    request, and how many of its tokens picked each expert, ``picks`` [windows, experts]."""

    layer: int
    step: npt.NDArray[np.int64]
    request: npt.NDArray[np.int64]
    picks: npt.NDArray[np.uint8]

    def take(self, index: npt.NDArray[np.bool_] | npt.NDArray[np.int64]) -> LayerWindows:
        return LayerWindows(self.layer, self.step[index], self.request[index], self.picks[index])


def layer_windows(rows: WindowRows, num_experts: int) -> Iterator[LayerWindows]:
    """Each layer's verification windows (rows of the ``verify`` phase grouped by step and request) from the rows
    of ``analysis.window_rows.decode_and_verify``; plain decode rows are left out."""
    verify = rows.take(np.flatnonzero(rows.is_verify))
    for layer, part in verify.by_layer():
        starts = group_starts(part.step, part.request)
        first = np.zeros(len(part.step), dtype=np.int64)
        first[starts] = 1
        window = np.cumsum(first) - 1
        flat = np.repeat(window, part.experts.shape[1]) * num_experts + part.experts.reshape(-1).astype(np.int64)
        picks = np.bincount(flat, minlength=len(starts) * num_experts).reshape(len(starts), num_experts)
        yield LayerWindows(layer, part.step[starts].astype(np.int64), part.request[starts].astype(np.int64),
                           np.minimum(picks, 255).astype(np.uint8))


def fitting_half(step: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """The windows a placement is fitted on when it is scored on the rest: those of even engine steps (the step
    number of a step key, each data-parallel rank's own)."""
    even: npt.NDArray[np.bool_] = (step >> DP_RANK_SHIFT) % 2 == 0
    return even


def slot_ranks(slots: int, ep: int) -> npt.NDArray[np.int64]:
    """The rank of every physical slot: rank r holds the r-th contiguous block (vLLM's and SGLang's layout)."""
    return linear_placement(slots, ep)


def route_windows(present: npt.NDArray[np.bool_], physical: npt.NDArray[np.int64], ep: int,
                  request: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Which physical slots each window reads, ``[windows, slots]``, for one layer's ``physical`` slot -> expert
    map. An expert with one slot is read there. An expert with replicas (visited in ascending id) is read, for all
    of a window's tokens that picked it, on the first of its replicas (in slot order) whose rank the window already
    touches (through its experts of one slot, or replicas chosen before); where none does, on replica
    ``request mod replicas`` (each request keeps to one replica, the requests spread over them)."""
    windows, experts = present.shape
    replicas = np.bincount(physical, minlength=experts)
    if len(replicas) > experts or (present.any(axis=0) & (replicas[:experts] == 0)).any():
        raise ValueError("the placement holds no slot for an expert the windows pick")
    ranks = slot_ranks(len(physical), ep)
    first_slot = np.full(experts, -1, dtype=np.int64)
    held, first = np.unique(physical, return_index=True)
    first_slot[held] = first
    single = np.flatnonzero(replicas == 1)
    used = np.zeros((windows, len(physical)), dtype=bool)
    used[:, first_slot[single]] = present[:, single]
    touched = rank_sums(used, ep) > 0
    for expert in np.flatnonzero(replicas > 1).tolist():
        here = np.flatnonzero(present[:, expert])
        slots = np.flatnonzero(physical == expert)
        hit = touched[np.ix_(here, ranks[slots])]
        choice = np.where(hit.any(axis=1), hit.argmax(axis=1), request[here] % len(slots))
        used[here, slots[choice]] = True
        touched[here, ranks[slots[choice]]] = True
    return used


def co_occurrence(rows: npt.NDArray[np.bool_], columns: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """[a, b]: the rows in which ``rows[:, a]`` and ``columns[:, b]`` both hold (``rows.T @ columns``). Sparse rows
    (a window's few experts) are counted over the pairs that occur, a cost in pairs rather than rows × experts²;
    dense ones (a step's many) by a float32 product."""
    sizes = columns.sum(axis=1)
    pairs = int(rows.sum(axis=1) @ sizes)
    if pairs * DENSE_PAIR_COST > rows.size * columns.shape[1]:
        product = rows.T.astype(np.float32) @ columns.astype(np.float32)  # exact: counts below 2**24
        return np.rint(product).astype(np.int64)
    where, first = np.nonzero(rows)
    members = np.nonzero(columns)
    width = int(sizes.max(initial=0))
    listed = np.full((len(columns), width), -1, dtype=np.int64)  # each row's columns, -1 after the last
    listed[members[0], np.arange(len(members[0])) - np.repeat(np.cumsum(sizes) - sizes, sizes)] = members[1]
    partner = listed[where]
    flat = (first[:, None] * columns.shape[1] + partner)[partner >= 0]
    return np.bincount(flat, minlength=rows.shape[1] * columns.shape[1]).reshape(rows.shape[1], columns.shape[1])


DENSE_PAIR_COST = 16
"""About how many multiply-adds of a float32 product cost as much as counting one pair."""


def rank_sums(per_slot: npt.NDArray[np.generic], ep: int) -> npt.NDArray[np.int64]:
    """``per_slot`` [rows, slots] (counts or flags) summed over each rank's block of slots: [rows, ranks]."""
    rows, slots = per_slot.shape
    if slots % ep == 0:
        sums: npt.NDArray[np.int64] = per_slot.reshape(rows, ep, slots // ep).sum(axis=2, dtype=np.int64)
        return sums
    to_rank = np.zeros((slots, ep))
    to_rank[np.arange(slots), slot_ranks(slots, ep)] = 1.0
    return np.rint(per_slot.astype(np.float64) @ to_rank).astype(np.int64)


def ranks_touched(present: npt.NDArray[np.bool_], physical: npt.NDArray[np.int64], ep: int,
                  request: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Ranks each window dispatches to under ``physical`` (routed as ``route_windows`` says)."""
    used = route_windows(present, physical, ep, request)
    per_rank = rank_sums(used, ep)
    touched: npt.NDArray[np.int64] = (per_rank > 0).sum(axis=1).astype(np.int64)
    return touched


SPREAD = 1.0
"""Default weight of the step term against the window term in ``verification_placement``."""


def verification_placement(picks: npt.NDArray[np.integer], ep: int, redundant: int = 0,
                           request: npt.NDArray[np.int64] | None = None, step: npt.NDArray[np.int64] | None = None,
                           spread: float = SPREAD, max_load_ratio: float = 1.1, fit_windows: int = FIT_WINDOWS,
                           ) -> npt.NDArray[np.int64]:
    """One layer's physical slots (the logical expert in each of ``experts + redundant`` slots, rank r holding the
    r-th block) for the fitted windows ``picks`` [windows, experts] (tokens per expert; ``request`` and ``step``
    per window, windows in step order; without ``step`` each window is a step of its own).

    The cost it lowers, per window and per step: ranks touched per window, plus ``spread`` × the sum over ranks
    of the squared unique experts a step reads on the rank (over steps; a smooth stand-in for the busiest rank's
    experts, which co-locating a window's experts raises). Both are sums over pairs of experts held on one rank:
    Cw[e, f], the share of windows in which e and f both appear (more on one rank: fewer ranks touched), and
    Cs[e, f], the share of steps in which both are read (more on one rank: a busier rank).

    1. Start: ``replicated_placement`` of the windows' picks (extra replicas to the most picked per replica, ranks
       filled heaviest first). Replicas stay where it put them; the experts of one slot move.
    2. Pairwise: for each pair of ranks, the swap of one expert each way that most raises Cw − spread·Cs held
       within ranks, repeated while one gains (disjoint pairs of ranks side by side: their gains add up); sweeps
       over the pairs until none does (at most 8).
    3. Exact: swaps that lower the ranks touched summed over windows (at most ``fit_windows``, evenly strided;
       replicas read as ``route_windows`` says) plus the step term, several a round on disjoint pairs of ranks
       (their changes add up), until none does (at most 4 rounds).

    Every swap keeps each rank's slot count and its token load (an expert's picks split evenly over its replicas)
    at most ``max_load_ratio`` × the mean rank load, or the start's busiest rank where that is higher.
    Deterministic: no random draws, the same windows give the same slots."""
    picks = np.asarray(picks)
    windows, experts = picks.shape
    slots = experts + redundant
    if ep < 1 or redundant < 0 or slots % ep:
        raise ValueError(f"{experts} experts + {redundant} redundant do not split evenly over {ep} ranks")
    load = picks.sum(axis=0, dtype=np.int64)
    physical = replicated_placement(load.tolist(), ep, redundant)
    if ep == 1 or windows == 0:
        return physical
    search = _Search(physical, load, ep, max_load_ratio)
    present = picks > 0
    steps = present if step is None else np.logical_or.reduceat(present, group_starts(step), axis=0)
    window_term = co_occurrence(present, present).astype(np.float64) / windows
    step_term = spread * co_occurrence(steps, steps).astype(np.float64) / len(steps)
    np.fill_diagonal(window_term, 0.0)
    np.fill_diagonal(step_term, 0.0)
    search.pairwise(window_term - step_term)
    sample = np.linspace(0, windows - 1, min(windows, fit_windows)).astype(np.int64)
    search.exact(present[sample], (np.zeros(windows, dtype=np.int64) if request is None else request)[sample],
                 step_term)
    return search.layout()


class _Search:
    """The state of ``verification_placement``'s local search: the rank of every expert of one slot, every rank's
    token load and the cap on it."""

    def __init__(self, start: npt.NDArray[np.int64], load: npt.NDArray[np.int64], ep: int,
                 max_load_ratio: float) -> None:
        experts = len(load)
        self.start, self.ep = start, ep
        self.ranks = slot_ranks(len(start), ep)
        self.replicas = np.bincount(start, minlength=experts)
        self.movable = np.flatnonzero(self.replicas == 1)
        single = self.replicas[start] == 1
        self.rank = np.zeros(experts, dtype=np.int64)
        self.rank[start[single]] = self.ranks[single]
        self.share = load / self.replicas
        self.rank_load = np.bincount(self.ranks, weights=self.share[start], minlength=ep)
        self.cap = max(max_load_ratio * float(self.rank_load.mean()), float(self.rank_load.max())) + 1e-9
        self.incidence = np.zeros((experts, ep), dtype=np.float64)  # [e, r]: e has a slot on r
        self.incidence[start, self.ranks] = 1.0

    def swap(self, a: int, b: int) -> None:
        p, q = int(self.rank[a]), int(self.rank[b])
        self.rank[a], self.rank[b] = q, p
        self.incidence[a, p], self.incidence[a, q], self.incidence[b, q], self.incidence[b, p] = 0.0, 1.0, 0.0, 1.0
        self.rank_load[p] += self.share[b] - self.share[a]
        self.rank_load[q] += self.share[a] - self.share[b]

    def pairwise(self, together: npt.NDArray[np.float64]) -> None:
        """Raise the sum of ``together`` over pairs of experts on one rank: the rank pairs in rounds of disjoint
        pairs (the circle method), each pair of a round taking its best swap at once, until none gains."""
        experts, ep = len(self.rank), self.ep
        # one more expert, a placeholder padding each rank's list: no co-activation, a load no swap can take
        pad = np.zeros((experts + 1, experts + 1))
        pad[:experts, :experts] = together
        held = np.zeros((experts + 1, ep))
        held[:experts] = np.einsum("ij,jr->ir", together, self.incidence)  # [e, r]: e's sum over the experts on r
        share = np.append(self.share, 1e300)  # larger than any room on a rank, and finite: no inf - inf
        width = max(int(np.sum(self.rank[self.movable] == r)) for r in range(ep))
        members = np.full((ep, width), experts, dtype=np.int64)  # each rank's experts of one slot
        for r in range(ep):
            mine = self.movable[self.rank[self.movable] == r]
            members[r, :len(mine)] = mine
        seats = list(range(ep)) + ([-1] if ep % 2 else [])
        rounds = [[(seats[i], seats[-1 - i]) for i in range(len(seats) // 2)] for _ in range(len(seats) - 1)]
        for t in range(1, len(rounds)):  # circle method: keep seat 0, rotate the rest
            rest = seats[1:]
            seats = [seats[0], rest[-1], *rest[:-1]]
            rounds[t] = [(seats[i], seats[-1 - i]) for i in range(len(seats) // 2)]
        for _ in range(8):
            gained = False
            for pairs in rounds:
                p = np.asarray([min(x, y) for x, y in pairs if min(x, y) >= 0], dtype=np.int64)
                q = np.asarray([max(x, y) for x, y in pairs if min(x, y) >= 0], dtype=np.int64)
                k = np.arange(len(p))
                on_p, on_q = members[p], members[q]  # [pair, width]
                block = pad[on_p[:, :, None], on_q[:, None, :]]
                share_p, share_q = share[on_p], share[on_q]
                for _ in range(len(self.movable)):
                    # a on p for b on q: a's gain toward q, b's toward p, less their own pair counted twice
                    gain = ((held[on_p, q[:, None]] - held[on_p, p[:, None]])[:, :, None]
                            + (held[on_q, p[:, None]] - held[on_q, q[:, None]])[:, None, :] - 2.0 * block)
                    diff = share_q[:, None, :] - share_p[:, :, None]  # p's load change
                    gain[(diff > (self.cap - self.rank_load[p])[:, None, None])
                         | (diff < (self.rank_load[q] - self.cap)[:, None, None])] = -np.inf
                    i, j = np.divmod(gain.reshape(len(p), -1).argmax(axis=1), width)
                    go = np.flatnonzero(gain[k, i, j] > 1e-12)
                    if not len(go):
                        break
                    gained = True
                    for g in go.tolist():
                        x, y = int(i[g]), int(j[g])
                        a, b = int(on_p[g, x]), int(on_q[g, y])
                        held[:, p[g]] += pad[:, b] - pad[:, a]
                        held[:, q[g]] += pad[:, a] - pad[:, b]
                        self.swap(a, b)
                        on_p[g, x], on_q[g, y] = b, a
                        share_p[g, x], share_q[g, y] = share[b], share[a]
                        block[g, x, :], block[g, :, y] = pad[b, on_q[g]], pad[on_p[g], a]
                members[p], members[q] = on_p, on_q
            if not gained:
                return

    def exact(self, present: npt.NDArray[np.bool_], request: npt.NDArray[np.int64],
              step_term: npt.NDArray[np.float64]) -> None:
        """Swaps that lower the ranks touched per window (counted on ``present``) plus the sum of ``step_term`` over
        pairs of experts on one rank, on disjoint pairs of ranks each round."""
        windows = len(present)
        movable, ep = self.movable, self.ep
        in_window = present[:, movable]
        on_movable = in_window.astype(np.int32)
        pair_step = step_term[np.ix_(movable, movable)]
        index = np.arange(len(movable))
        for _ in range(4):
            used = route_windows(present, self.layout(), ep, request)
            count = rank_sums(used, ep)  # experts per (window, rank)
            r = self.rank[movable]
            alone = in_window & (count == 1)[:, r]  # a is its rank's only expert in the window
            # [a, rank]: a's windows where that rank holds none, and a's step term with the experts there
            toward = (on_movable.T @ (count == 0).astype(np.int32)) / windows + np.matmul(
                step_term[movable], self.incidence)
            leave = alone.sum(axis=0) / windows + toward[index, r]  # (a's own rank is never empty where a is)
            # half of a swap's change in cost, a's side: ranks touched per window (a leaves the windows where it is
            # alone on its rank, except those b rejoins; a reaches the windows where b's rank has none), and the
            # step term moving a from its rank to b's
            half = np.take(toward, r, axis=1)
            half -= leave[:, None]
            half += co_occurrence(alone, in_window) * (1.0 / windows)
            half -= pair_step
            cost = half + half.T
            room = self.cap - self.rank_load[r] + self.share[movable]  # the largest share a's rank can take for a
            fits = self.share[movable][None, :] <= room[:, None]
            cost[~(fits & fits.T & (r[:, None] != r[None, :]))] = np.inf
            free = np.ones(ep, dtype=bool)
            swapped = False
            while free.sum() >= 2:
                i, j = divmod(int(np.argmin(cost)), len(movable))
                if not cost[i, j] < -1e-9:
                    break
                self.swap(int(movable[i]), int(movable[j]))
                swapped = True
                free[[r[i], r[j]]] = False
                gone = ~free[r]
                cost[gone, :] = np.inf
                cost[:, gone] = np.inf
            if not swapped:
                return

    def layout(self) -> npt.NDArray[np.int64]:
        """The physical slots: on each rank its experts of one slot and the replicas the start put there, by id."""
        fixed = self.replicas[self.start] > 1
        held = [sorted(self.movable[self.rank[self.movable] == r].tolist()
                       + self.start[fixed & (self.ranks == r)].tolist()) for r in range(self.ep)]
        return np.asarray([expert for experts in held for expert in experts], dtype=np.int64)


@dataclass
class PlacementScore:
    """What one placement costs on held-out windows, summed over layers as they come (``add``)."""

    windows: int = 0
    ranks_touched: float = 0.0
    steps: int = 0  # (step, layer) pairs
    busiest_rank_experts: float = 0.0
    step_tokens: list[pl.DataFrame] = field(default_factory=list)  # per (step, layer): mean and max rank tokens

    def add(self, held: LayerWindows, physical: npt.NDArray[np.int64], ep: int) -> None:
        """Score one layer's ``physical`` slots on its windows ``held`` (routed as ``route_windows`` says)."""
        if len(held.step) == 0:
            return
        used = route_windows(held.picks > 0, physical, ep, held.request)
        self.windows += len(used)
        self.ranks_touched += float((rank_sums(used, ep) > 0).sum())
        starts = group_starts(held.step)
        on_step = rank_sums(np.logical_or.reduceat(used, starts, axis=0), ep)
        self.steps += len(starts)
        self.busiest_rank_experts += float(on_step.max(axis=1).sum())
        tokens = np.add.reduceat(rank_sums(used * held.picks[:, physical], ep), starts, axis=0)
        self.step_tokens.append(pl.DataFrame({"step": held.step[starts], "mean": tokens.mean(axis=1),
                                              "max": tokens.max(axis=1)}))

    def row(self, name: str) -> dict[str, object]:
        steps = (pl.concat(self.step_tokens).group_by("step").agg(pl.col("mean").sum(), pl.col("max").sum())
                 if self.step_tokens else pl.DataFrame({"mean": [], "max": []}))
        balanced = steps.filter(pl.col("max") > 0).select(pl.col("mean") / pl.col("max")).to_series()
        return {"placement": name, "windows": self.windows, "steps": steps.height,
                "ranks_touched": self.ranks_touched / self.windows if self.windows else None,
                "busiest_rank_experts": self.busiest_rank_experts / self.steps if self.steps else None,
                "balancedness": float(balanced.mean()) if len(balanced) else None}  # type: ignore[arg-type]


PLACEMENT_SCORE_SCHEMA: dict[str, pl.DataType] = {
    "placement": pl.String(),
    "windows": pl.Int64(),
    "steps": pl.Int64(),
    "ranks_touched": pl.Float64(),
    "busiest_rank_experts": pl.Float64(),
    "balancedness": pl.Float64(),
}

VERIFICATION_AWARE = "moetrace"


@dataclass(frozen=True)
class PlacementComparison:
    """``scores``: one row per placement, held-out figures (``PLACEMENT_SCORE_SCHEMA``): windows and steps scored
    (steps of all MoE layers as one), ranks touched per window, unique experts on the busiest rank per step (every
    window of the step, per layer), balancedness (per step, as vLLM's EPLB logs it: the ranks' mean token load over
    their max, each summed over layers; the mean over steps). ``placement`` [layers, experts + redundant]: the
    verification-aware placement scored there (fitted on the windows of even steps), the row for each of
    ``layers``."""

    scores: pl.DataFrame
    layers: list[int]
    placement: npt.NDArray[np.int64]


def fitting_load(rows: WindowRows, num_experts: int, layers: Sequence[int]) -> npt.NDArray[np.int64]:
    """Picks per expert in the verification windows ``compare_placements`` fits on (``fitting_half``), one row per
    layer of ``layers`` [layers, experts]: what a load-only placement (vLLM's EPLB) is fitted on."""
    row_of = np.full(int(max(layers, default=0)) + 1, -1, dtype=np.int64)
    row_of[list(layers)] = np.arange(len(layers))
    keep = rows.is_verify & fitting_half(rows.step) & (rows.layer.astype(np.int64) < len(row_of))
    layer = row_of[rows.layer[keep].astype(np.int64)]
    known = layer >= 0
    experts = rows.experts[keep][known].astype(np.int64)
    flat = np.repeat(layer[known], experts.shape[1]) * num_experts + experts.reshape(-1)
    return np.bincount(flat, minlength=len(layers) * num_experts).reshape(len(layers), num_experts)


def compare_placements(windows: Iterable[LayerWindows], layers: Sequence[int], num_experts: int, ep: int,
                       redundant: int, baselines: Mapping[str, npt.NDArray[np.int64]], spread: float = SPREAD,
                       max_load_ratio: float = 1.1, progress: Callable[[int], None] | None = None
                       ) -> PlacementComparison:
    """Per MoE layer of ``windows``: ``verification_placement`` fitted on the windows of even steps
    (``fitting_half``) and scored on those of odd steps beside each of ``baselines`` (physical slots [layers,
    slots], one row per layer of ``layers``, fitted on the same windows: ``fitting_load``). ``progress`` is
    called with each layer done."""
    scores = {name: PlacementScore() for name in [*baselines, VERIFICATION_AWARE]}
    placement = np.tile(np.arange(num_experts + redundant, dtype=np.int64) % num_experts, (len(layers), 1))
    row_of = {layer: index for index, layer in enumerate(layers)}
    for part in windows:
        if part.layer not in row_of:
            continue
        row = row_of[part.layer]
        fit = fitting_half(part.step)
        fitted, held = part.take(fit), part.take(~fit)
        for name, baseline in baselines.items():
            scores[name].add(held, np.asarray(baseline[row], dtype=np.int64), ep)
        placement[row] = verification_placement(fitted.picks, ep, redundant, fitted.request, fitted.step, spread,
                                                max_load_ratio)
        scores[VERIFICATION_AWARE].add(held, placement[row], ep)
        if progress is not None:
            progress(part.layer)
    frame = pl.DataFrame([score.row(name) for name, score in scores.items()], schema=PLACEMENT_SCORE_SCHEMA,
                         orient="row")
    return PlacementComparison(frame, list(layers), placement)
