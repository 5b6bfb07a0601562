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

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.concurrency import uniform_unique_experts
from moetrace.analysis.predicates import accepted_sequence, in_sequence, not_prefill, step_key
from moetrace.analysis.sources import RANKS, Source
from moetrace.analysis.expert_sets import (
    Masks,
    MaskTable,
    Scratch,
    count_experts,
    expert_masks,
    group_starts,
    group_union,
    per_rank_counts,
    rank_masks,
    window_union,
)

MEASURED = Source.MEASURED.value
COUNTERFACTUAL = Source.COUNTERFACTUAL.value
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


def _frame(rows: Sequence[dict[str, object] | None]) -> pl.DataFrame:
    return pl.DataFrame([row for row in rows if row is not None], schema=GROWTH_SCHEMA, orient="row")


def counterfactual_growth(
    routing: pl.LazyFrame, num_experts: int, ks: Sequence[int], expert_rank: npt.NDArray[np.int64]
) -> pl.DataFrame:
    """Unique experts per window of k+1 consecutive accepted tokens, per layer and k (see module doc).

    Token-major traces (every token's layers on consecutive rows, in one layer order, and each request's positions
    increasing from batch to batch: what the recorder writes) are streamed in batches, without a sort; anything else
    takes the general path, which sorts."""
    try:
        return _counterfactual_streamed(routing, num_experts, ks, expert_rank)
    except _NotTokenMajor:
        return _counterfactual_sorted(routing, num_experts, ks, expert_rank)


def _counterfactual_sorted(
    routing: pl.LazyFrame, num_experts: int, ks: Sequence[int], expert_rank: npt.NDArray[np.int64]
) -> pl.DataFrame:
    """The general path: sort by layer, request and position, then group windows per layer."""
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


# ---- the streamed path over token-major rows -------------------------------------------------------------------

BATCH_ROWS = 1 << 17
"""Rows per streamed batch: small enough that a batch's bitsets (rows x 48 bytes for 384 experts) stay in the CPU's
last-level cache, large enough that the per-batch Python overhead is small."""


class _NotTokenMajor(Exception):
    """The rows are not laid out as the streamed path needs: take the general path."""


def _batches(query: pl.LazyFrame) -> Iterator[pl.DataFrame]:
    collect_batches = getattr(query, "collect_batches", None)
    if collect_batches is None:  # Polars without streamed batches: one collect, sliced
        yield from query.collect().iter_slices(BATCH_ROWS)
    else:
        yield from collect_batches(chunk_size=BATCH_ROWS)


class _TokenMajor:
    """Turns streamed row batches into whole tokens: per-token key columns and experts [tokens, layers, top_k].

    A token's rows are consecutive and share their keys; the first token fixes the layer order, every token must
    repeat it. Anything else raises ``_NotTokenMajor``."""

    def __init__(self, batches: Iterable[pl.DataFrame], keys: Sequence[str], keep: str | None = None) -> None:
        self.batches, self.keys, self.keep = batches, list(keys), keep
        self.layers: npt.NDArray[np.int64] | None = None

    def __iter__(self) -> Iterator[tuple[dict[str, npt.NDArray[np.int64]], npt.NDArray[np.integer]]]:
        names = [*self.keys, "layer"]
        left: dict[str, npt.NDArray[np.integer]] = {}
        left_experts: npt.NDArray[np.integer] | None = None
        for frame in self.batches:
            columns = {name: frame.get_column(name).to_numpy() for name in names}
            experts = frame.get_column("experts").to_numpy()
            if experts.ndim != 2 or experts.dtype.kind not in "ui":
                raise _NotTokenMajor
            if self.keep is not None:
                keep = frame.get_column(self.keep).to_numpy()
                if keep.dtype != np.bool_:
                    raise _NotTokenMajor
                if not keep.all():
                    columns = {name: values[keep] for name, values in columns.items()}
                    experts = experts[keep]
            if left_experts is not None:
                columns = {name: np.concatenate([left[name], columns[name]]) for name in names}
                experts = np.concatenate([left_experts, experts])
            rows = len(experts)
            if rows == 0:  # every row of the batch filtered out
                continue
            if self.layers is None:
                self.layers = self._layer_order(columns, final=False)
                if self.layers is None:  # the first token is not complete yet
                    left, left_experts = columns, experts
                    continue
            width = len(self.layers)
            whole = rows - rows % width
            yield self._tokens(columns, experts, whole)
            left = {name: values[whole:] for name, values in columns.items()}
            left_experts = experts[whole:] if whole < rows else None
        if left_experts is not None:
            if self.layers is None:
                self.layers = self._layer_order(left, final=True)
            if self.layers is None or len(left_experts) % len(self.layers):
                raise _NotTokenMajor  # a token without all its layers
            yield self._tokens(left, left_experts, len(left_experts))

    def _layer_order(self, columns: dict[str, npt.NDArray[np.integer]], final: bool) -> npt.NDArray[np.int64] | None:
        """The first token's layers, once its rows are all there (a row with other keys follows, or input ended)."""
        rows = len(columns["layer"])
        change = np.zeros(rows, dtype=bool)
        for name in self.keys:
            change[1:] |= columns[name][1:] != columns[name][:1]
        ends = np.flatnonzero(change)
        if len(ends) == 0 and not final:
            return None
        width = int(ends[0]) if len(ends) else rows
        layers = columns["layer"][:width].astype(np.int64)
        if len(np.unique(layers)) != width:
            raise _NotTokenMajor
        return layers

    def _tokens(
        self, columns: dict[str, npt.NDArray[np.integer]], experts: npt.NDArray[np.integer], rows: int
    ) -> tuple[dict[str, npt.NDArray[np.int64]], npt.NDArray[np.integer]]:
        assert self.layers is not None
        width = len(self.layers)
        if not np.array_equal(columns["layer"][:rows].reshape(-1, width),
                              np.broadcast_to(self.layers, (rows // width, width))):
            raise _NotTokenMajor
        keys: dict[str, npt.NDArray[np.int64]] = {}
        for name in self.keys:
            grid = columns[name][:rows].reshape(-1, width)
            if not (grid == grid[:, :1]).all():
                raise _NotTokenMajor
            keys[name] = grid[:, 0].astype(np.int64)
        return keys, experts[:rows].reshape(rows // width, width, experts.shape[1])


class _WindowStats:
    """Sums over windows, per k and layer: windows, unique experts, busiest-rank experts and ranks touched."""

    def __init__(self, ks: Sequence[int], ranks: Masks) -> None:
        self.ranks = ranks
        self.windows = dict.fromkeys(ks, 0)
        self.unique: dict[int, npt.NDArray[np.int64]] = {}
        self.busiest: dict[int, npt.NDArray[np.int64]] = {}
        self.touched: dict[int, npt.NDArray[np.int64]] = {}

    def add(self, k: int, unions: Masks, rows: npt.NDArray[np.bool_] | None = None) -> None:
        """``unions`` [windows, layers, words], of which only ``rows`` when given."""
        if rows is not None and not rows.all():
            unions = unions[rows]
        windows, layers, words = unions.shape
        if windows == 0:
            return
        self.windows[k] += windows
        counts = np.bitwise_count(unions).reshape(windows, layers * words).sum(axis=0, dtype=np.int64)
        self._add(self.unique, k, counts.reshape(layers, words).sum(axis=1))
        if len(self.ranks) > 1:
            on_rank = np.stack(
                [np.bitwise_count(unions & rank).sum(axis=2, dtype=np.int64) for rank in self.ranks], axis=2
            )  # [windows, layers, ranks]
            self._add(self.busiest, k, on_rank.max(axis=2).sum(axis=0))
            self._add(self.touched, k, (on_rank > 0).sum(axis=2).sum(axis=0))

    @staticmethod
    def _add(sums: dict[int, npt.NDArray[np.int64]], k: int, values: npt.NDArray[np.int64]) -> None:
        sums[k] = sums[k] + values if k in sums else values

    def rows(
        self, layers: npt.NDArray[np.int64], ks: Sequence[int], source: str, scope: str
    ) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        for index in np.argsort(layers, kind="stable").tolist():
            for k in ks:
                windows = self.windows[k]
                if windows == 0:
                    continue
                unique = int(self.unique[k][index]) / windows
                busiest, touched = unique, 1.0
                if len(self.ranks) > 1:
                    busiest, touched = int(self.busiest[k][index]) / windows, int(self.touched[k][index]) / windows
                rows.append(
                    {
                        "layer": int(layers[index]),
                        "k": k,
                        "source": source,
                        "scope": scope,
                        "windows": windows,
                        "unique_experts": unique,
                        "busiest_rank_experts": busiest,
                        "ranks_touched": touched,
                    }
                )
        return rows


class _SequenceWindows:
    """Counterfactual windows over streamed tokens. Each round sorts the new tokens, with those still pending for
    the same requests, by (request, position) and counts the complete windows that no later token can reach (later
    tokens of a request must lie beyond every position already seen for it); tokens of windows still open stay
    pending, per request, until that request's next tokens (or the end)."""

    NO_POSITION = -1
    OPEN_END = np.iinfo(np.int64).max

    def __init__(self, ks: Sequence[int], table: MaskTable, stats: _WindowStats) -> None:
        self.widths = sorted({k + 1 for k in ks})
        self.table, self.stats = table, stats
        self.scratch = Scratch()
        self.pending: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.integer]]] = {}  # positions, experts
        self.seen = np.zeros(0, np.int64)  # requests seen so far, ascending
        self.last = np.zeros(0, np.int64)  # and the last position seen for each

    def _last(self, request: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        if len(self.seen) == 0:
            return np.full(len(request), self.NO_POSITION, np.int64)
        at = np.minimum(np.searchsorted(self.seen, request), len(self.seen) - 1)
        return np.where(self.seen[at] == request, self.last[at], self.NO_POSITION)

    def add(
        self, request: npt.NDArray[np.int64], position: npt.NDArray[np.int64], experts: npt.NDArray[np.integer]
    ) -> None:
        if (position <= self._last(request)).any():
            raise _NotTokenMajor  # a request went back to a position already passed
        held = [(r, self.pending.pop(r)) for r in np.unique(request).tolist() if r in self.pending]
        self._round(*self._joined(held, (request, position, experts)), final=False)

    def finish(self) -> None:
        held, self.pending = list(self.pending.items()), {}
        if held:
            self._round(*self._joined(held, None), final=True)

    @staticmethod
    def _joined(
        held: list[tuple[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.integer]]]],
        new: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.integer]] | None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.integer]]:
        requests = [np.full(len(positions), r, np.int64) for r, (positions, _) in held]
        positions = [positions for _, (positions, _) in held]
        experts = [experts for _, (_, experts) in held]
        if new is not None:
            requests.append(new[0])
            positions.append(new[1])
            experts.append(new[2])
        if len(experts) == 1:
            return requests[0], positions[0], experts[0]
        return np.concatenate(requests), np.concatenate(positions), np.concatenate(experts)

    def _round(
        self, request: npt.NDArray[np.int64], position: npt.NDArray[np.int64], experts: npt.NDArray[np.integer],
        final: bool,
    ) -> None:
        if len(request) == 0:
            return
        order = np.lexsort((position, request))
        request, position = request[order], position[order]
        runs = group_starts(request)
        run_of = np.repeat(np.arange(len(runs)), np.diff(np.append(runs, len(request))))
        run_request = request[runs]
        before = self._last(run_request)
        after = position[np.append(runs[1:], len(request)) - 1]
        self.seen, index = np.unique(np.concatenate([self.seen, run_request]), return_inverse=True)
        last = np.full(len(self.seen), self.NO_POSITION, np.int64)
        np.maximum.at(last, index, np.concatenate([self.last, after]))
        self.last = last
        reach = np.full(len(runs), self.OPEN_END, np.int64) if final else after
        masks = self.table.masks(np.take(experts, order, axis=0), self.scratch)
        # With distinct positions, a window of width w is the union of w/m consecutive windows of a width m that
        # divides it (8 = 2 x 4, 9 = 3 x 3, ...): built from those, the wider windows read fewer rows.
        distinct = not ((np.diff(request) == 0) & (np.diff(position) == 0)).any()
        bases = {w: max((m for m in self.widths if 1 < m < w and w % m == 0), default=0) for w in self.widths}
        if not distinct:
            bases = dict.fromkeys(self.widths, 0)
        reused = set(bases.values())
        built: dict[int, tuple[npt.NDArray[np.int64], Masks]] = {}
        keep = np.zeros(len(request), dtype=bool)
        for width in self.widths:
            window = position // width
            starts = group_starts(request, window)
            sizes = np.diff(np.append(starts, len(request)))
            end = window[starts] * width + (width - 1)
            run = run_of[starts]
            complete = sizes == width
            closes_now = complete & (end <= reach[run]) & (end > before[run])
            base = bases[width]
            counted: npt.NDArray[np.bool_] | None = None
            if width in reused or base:  # every complete window, some of them counted already
                chosen, counted = starts[complete], closes_now[complete]
            else:
                chosen = starts[closes_now]
            name = f"union{width}" if width in reused else "union"
            if base:
                base_starts, base_unions = built[base]
                unions = window_union(base_unions, np.searchsorted(base_starts, chosen), width // base, self.scratch,
                                      name)
            else:
                unions = window_union(masks, chosen, width, self.scratch, name)
            if width in reused:
                built[width] = (chosen, unions)
            self.stats.add(width - 1, unions, counted)
            keep |= window * width + (width - 1) > reach[run_of]
        if keep.any():
            request, position = request[keep], position[keep]
            experts = np.take(experts, order[keep], axis=0)
            bounds = np.append(group_starts(request), len(request))
            for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                self.pending[int(request[start])] = (position[start:stop], experts[start:stop])


def _counterfactual_streamed(
    routing: pl.LazyFrame, num_experts: int, ks: Sequence[int], expert_rank: npt.NDArray[np.int64]
) -> pl.DataFrame:
    query = routing.select("request", "position", "layer", "experts", in_sequence().alias("in_sequence"))
    tokens = _TokenMajor(_batches(query), ("request", "position"), keep="in_sequence")
    stats = _WindowStats(ks, rank_masks(expert_rank, num_experts))
    windows = _SequenceWindows(ks, MaskTable(num_experts), stats)
    for keys, experts in tokens:
        windows.add(keys["request"], keys["position"], experts)
    windows.finish()
    if tokens.layers is None:
        return _frame([])
    return _frame([*stats.rows(tokens.layers, ks, COUNTERFACTUAL, PER_REQUEST)])


@dataclass(frozen=True)
class WindowRows:
    """Non-prefill rows in recording order as numpy columns [N] (experts [N, K]), read once and shared by the
    measured growth, the rejected-only analysis and the expert load."""

    layer: npt.NDArray[np.uint16]
    step: npt.NDArray[np.int64]  # the step key (``predicates.step_key``: data-parallel ranks' steps apart)
    request: npt.NDArray[np.uint32]
    draft_pos: npt.NDArray[np.uint8]
    is_verify: npt.NDArray[np.bool_]
    in_sequence: npt.NDArray[np.bool_]
    experts: npt.NDArray[np.uint16]

    def take(self, index: slice | npt.NDArray[np.int64]) -> WindowRows:
        return WindowRows(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))

    def by_layer(self) -> Iterator[tuple[int, WindowRows]]:
        """Each layer's rows with every verification window's rows contiguous. The recorder writes rows
        token-major, every token with the same layers in the same order: then layer i is every L-th row (a strided
        view, nothing copied). Otherwise one stable index gathers each layer, and a layer whose steps are out of
        order is sorted."""
        layers = np.unique(self.layer)
        count = len(layers)
        if count == 0:
            return
        tokens = len(self.layer) // count
        regular = len(self.layer) == tokens * count and bool(
            np.array_equal(self.layer.reshape(tokens, count), np.broadcast_to(self.layer[:count], (tokens, count))))
        order = None if regular else np.argsort(self.layer, kind="stable")
        bounds = None if order is None else np.searchsorted(self.layer[order], layers, side="right")
        for i in range(count):
            if order is None or bounds is None:
                part, layer = self.take(slice(i, None, count)), int(self.layer[i])
            else:
                part, layer = self.take(order[(bounds[i - 1] if i else 0) : bounds[i]]), int(layers[i])
            if not bool(np.all(np.diff(part.step.astype(np.int64)) >= 0)):
                part = part.take(np.lexsort((part.draft_pos, part.request, part.step)))
            yield layer, part


def decode_and_verify(routing: pl.LazyFrame) -> WindowRows:
    """The trace's non-prefill rows as ``WindowRows``: one pass over the files; each column moved into numpy and
    dropped from the Polars frame in turn, so that the peak holds the frame and one column's copy, not two frames."""
    frame = (
        routing.filter(not_prefill())
        .select(
            "layer",
            step_key().alias("step"),
            "request",
            "draft_pos",
            (pl.col("phase").cast(pl.String) == "verify").alias("is_verify"),
            in_sequence().alias("in_sequence"),
            "experts",
        )
        .collect()
    )
    columns = {}
    for field in dataclasses.fields(WindowRows):
        columns[field.name] = np.ascontiguousarray(frame.drop_in_place(field.name).to_numpy())
    if frame.height == 0 and columns["experts"].ndim == 1:  # an empty list column has no width
        columns["experts"] = columns["experts"].reshape(0, 0).astype(np.uint16)
    return WindowRows(**columns)


def measured_growth(
    rows: WindowRows, num_experts: int, trace_k: int, expert_rank: npt.NDArray[np.int64]
) -> pl.DataFrame:
    """Unique experts per recorded verification window (per request) and per step (whole batch), k = 0..trace_k.
    ``rows``: ``decode_and_verify`` of the trace."""
    ranks = rank_masks(expert_rank, num_experts)
    found: list[dict[str, object] | None] = []
    for layer, part in rows.by_layer():
        masks = expert_masks(part.experts, num_experts)
        step, request, draft_pos, is_verify = part.step, part.request, part.draft_pos, part.is_verify
        window_starts = group_starts(step, request)
        window_drafts = np.maximum.reduceat(draft_pos, window_starts) if len(window_starts) else draft_pos
        drafts_in_window = np.repeat(window_drafts, np.diff(np.append(window_starts, len(step))))
        for k in range(trace_k + 1):
            capped = draft_pos <= k
            in_window = capped & is_verify & (drafts_in_window >= k)
            unions = group_union(masks[in_window], group_starts(step[in_window], request[in_window]))
            found.append(_window_row(layer, k, MEASURED, PER_REQUEST, unions, ranks))
            unions = group_union(masks[capped], group_starts(step[capped]))
            found.append(_window_row(layer, k, MEASURED, PER_BATCH, unions, ranks))
    return _frame(found)


def rejected_only_experts(rows: WindowRows, num_experts: int) -> pl.DataFrame:
    """Per layer, over verification windows with drafts: mean unique experts and mean experts that only rejected
    drafts pulled in (read for nothing). ``rows``: ``decode_and_verify`` of the trace."""
    found = []
    for layer, everything_in_layer in rows.by_layer():
        part = everything_in_layer.take(np.flatnonzero(everything_in_layer.is_verify))
        if len(part.step) == 0:
            continue
        masks = expert_masks(part.experts, num_experts)
        starts = group_starts(part.step, part.request)
        has_drafts = np.maximum.reduceat(part.draft_pos, starts) > 0
        everything = group_union(masks, starts)[has_drafts]
        kept = group_union(np.where(part.in_sequence[:, None], masks, np.uint64(0)), starts)[has_drafts]
        if len(everything) == 0:
            continue
        unique = count_experts(everything)
        rejected_only = count_experts(everything & ~kept)
        found.append(
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
    return pl.DataFrame(found, schema=schema, orient="row")


def growth(
    routing: pl.LazyFrame,
    num_experts: int,
    top_k: int,
    ks: Sequence[int],
    trace_k: int,
    expert_rank: npt.NDArray[np.int64],
    rows: WindowRows | None = None,
) -> pl.DataFrame:
    """Measured (k ≤ trace_k) and counterfactual (every k in ks) growth per layer, with the uniform bound and the
    routing locality (unique experts / uniform bound: below 1 means tokens share experts more than chance).
    ``rows``: ``decode_and_verify`` of the trace when the caller has it already."""
    rows = decode_and_verify(routing) if rows is None else rows
    measured = measured_growth(rows, num_experts, min(trace_k, max(ks, default=0)), expert_rank)
    combined = pl.concat([measured, counterfactual_growth(routing, num_experts, ks, expert_rank)])
    uniform = pl.DataFrame(
        {"k": list(ks), "uniform_bound": [uniform_unique_experts(num_experts, top_k, k + 1) for k in ks]},
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


def best_window_estimate(growth_table: pl.LazyFrame) -> pl.LazyFrame:
    """Per (layer, k), the per-request window row from the most direct source the trace has (measured where it
    recorded k, else counterfactual)."""
    return (
        growth_table.filter(pl.col("scope") == PER_REQUEST)
        .sort(pl.col("source").replace_strict(RANKS, return_dtype=pl.Int32))
        .group_by("layer", "k")
        .first()
    )
