"""The streamed path of the counterfactual growth (``growth.counterfactual_window_sums``): a token-major trace (every
token's layers on consecutive rows, in one layer order, each request's positions increasing from chunk to chunk:
what the recorder writes) read in chunks, its counterfactual windows (``counterfactual``) counted as they
complete, without a sort."""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.counterfactual import Proposals, window_spans
from moetrace.analysis.predicates import in_sequence, step_key
from moetrace.analysis.expert_sets import (
    Masks,
    MaskTable,
    Scratch,
    group_of_row,
    group_starts,
    group_union,
    looked_up,
    rank_masks,
    window_union,
)

CHUNK_ROWS = 1 << 17
"""Rows per streamed chunk: small enough that a chunk's bitsets (rows x 48 bytes for 384 experts) stay in the CPU's
last-level cache, large enough that the per-chunk Python overhead is small."""


class NotTokenMajor(Exception):
    """The rows are not laid out as the streamed path needs: take the general path."""


# A chunk of rows: routing column name -> its values [rows] (experts [rows, top_k])
Columns = dict[str, npt.NDArray[Any]]


def routing_chunks(routing: pl.LazyFrame, with_proposals: bool) -> Iterator[Columns]:
    """The columns ``counterfactual_streamed`` reads, streamed from ``routing`` in chunks of ``CHUNK_ROWS`` rows
    (``with_proposals``: the step key and draft position too)."""
    anchors: list[pl.Expr | str] = [step_key(), "draft_pos"] if with_proposals else []
    query = routing.select("request", "position", "layer", "experts", in_sequence().alias("in_sequence"), *anchors)
    collect_batches = getattr(query, "collect_batches", None)
    # Polars without collect_batches: one collect, sliced
    frames = query.collect().iter_slices(CHUNK_ROWS) if collect_batches is None else collect_batches(
        chunk_size=CHUNK_ROWS)
    for frame in frames:
        yield {name: frame.get_column(name).to_numpy() for name in frame.columns}


def array_chunks(columns: Columns) -> Iterator[Columns]:
    """``columns`` (rows decoded already) in chunks of ``CHUNK_ROWS`` rows, as views."""
    rows = len(next(iter(columns.values()), ()))
    for start in range(0, rows, CHUNK_ROWS):
        yield {name: values[start : start + CHUNK_ROWS] for name, values in columns.items()}


class _TokenMajor:
    """Turns streamed row chunks into whole tokens: per-token key columns and experts [tokens, layers, top_k].

    A token's rows are consecutive and share their keys; the first token fixes the layer order, every token must
    repeat it. Anything else raises ``NotTokenMajor``."""

    def __init__(self, chunks: Iterable[Columns], keys: Sequence[str], keep: str | None = None) -> None:
        self.chunks, self.keys, self.keep = chunks, list(keys), keep
        self.layers: npt.NDArray[np.int64] | None = None

    def __iter__(self) -> Iterator[tuple[dict[str, npt.NDArray[np.int64]], npt.NDArray[np.integer]]]:
        names = [*self.keys, "layer"]
        left: dict[str, npt.NDArray[np.integer]] = {}
        left_experts: npt.NDArray[np.integer] | None = None
        for chunk in self.chunks:
            columns = {name: chunk[name] for name in names}
            experts = chunk["experts"]
            if experts.ndim != 2 or experts.dtype.kind not in "ui":
                raise NotTokenMajor
            if self.keep is not None:
                keep = chunk[self.keep]
                if keep.dtype != np.bool_:
                    raise NotTokenMajor
                if not keep.all():
                    columns = {name: values[keep] for name, values in columns.items()}
                    experts = experts[keep]
            if left_experts is not None:
                columns = {name: np.concatenate([left[name], columns[name]]) for name in names}
                experts = np.concatenate([left_experts, experts])
            rows = len(experts)
            if rows == 0:  # every row of the chunk filtered out
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
                raise NotTokenMajor  # a token without all its layers
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
            raise NotTokenMajor
        return layers

    def _tokens(
        self, columns: dict[str, npt.NDArray[np.integer]], experts: npt.NDArray[np.integer], rows: int
    ) -> tuple[dict[str, npt.NDArray[np.int64]], npt.NDArray[np.integer]]:
        assert self.layers is not None
        width = len(self.layers)
        if not np.array_equal(columns["layer"][:rows].reshape(-1, width),
                              np.broadcast_to(self.layers, (rows // width, width))):
            raise NotTokenMajor
        keys: dict[str, npt.NDArray[np.int64]] = {}
        for name in self.keys:
            grid = columns[name][:rows].reshape(-1, width)
            if not (grid == grid[:, :1]).all():
                raise NotTokenMajor
            keys[name] = grid[:, 0].astype(np.int64)
        return keys, experts[:rows].reshape(rows // width, width, experts.shape[1])


class WindowStats:
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
        """One row of sums per (layer, k), layers ascending (``layers``: the layer of each index)."""
        found = (self.row(index, int(layers[index]), k, source, scope)
                 for index in np.argsort(layers, kind="stable").tolist() for k in ks)
        return [row for row in found if row is not None]

    def row(self, index: int, layer: int, k: int, source: str, scope: str) -> dict[str, object] | None:
        """The sums (``growth.WINDOW_SUMS_SCHEMA``) of the ``index``-th layer at ``k``; None where no window."""
        windows = self.windows[k]
        if windows == 0:
            return None
        unique = int(self.unique[k][index])
        busiest, touched = unique, windows
        if len(self.ranks) > 1:
            busiest, touched = int(self.busiest[k][index]), int(self.touched[k][index])
        return {"layer": layer, "k": k, "source": source, "scope": scope, "windows": windows, "unique_sum": unique,
                "busiest_sum": busiest, "touched_sum": touched}


# A request's pending tokens [P]: positions, drafts proposed (``counterfactual.Proposals.at``; None for a trace
# without drafts), their expert bitsets [P, layers, words]
_Held = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None, Masks]
# Tokens [T] of any requests: request, position, drafts proposed (as ``_Held``), bitsets [T, layers, words]
_Tokens = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64] | None, Masks]


class _SequenceWindows:
    """Counterfactual windows (``counterfactual.window_spans``) over streamed tokens. Each round sorts the new tokens,
    with those still pending for the same requests, by (request, position) and counts the complete windows that end
    beyond every position seen for their request before the round and that no later token can reach (later tokens
    of a request lie beyond every position already seen for it); the tokens a window still open may hold stay
    pending, per request, until that request's next tokens (or the end)."""

    NO_POSITION = -1
    OPEN_END = np.iinfo(np.int64).max

    def __init__(self, ks: Sequence[int], trace_k: int, stats: WindowStats) -> None:
        self.ks, self.trace_k = list(ks), trace_k
        self.widest = max(self.ks, default=0) + 1  # no window holds more tokens
        self.stats = stats
        self.scratch = Scratch()
        self.pending: dict[int, _Held] = {}
        self.seen = np.zeros(0, np.int64)  # requests seen so far, ascending
        self.last = np.zeros(0, np.int64)  # and the last position seen for each

    def _last(self, request: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return looked_up(self.seen, self.last, request, self.NO_POSITION)

    def add(self, request: npt.NDArray[np.int64], position: npt.NDArray[np.int64],
            proposed: npt.NDArray[np.int64] | None, masks: Masks) -> None:
        """Tokens [T] in recording order, with their expert bitsets [T, layers, words] (read within this call)."""
        if (position <= self._last(request)).any():
            raise NotTokenMajor  # a request went back to a position already passed
        held = [(r, self.pending.pop(r)) for r in np.unique(request).tolist() if r in self.pending]
        self._round(*self._joined(held, (request, position, proposed, masks)), final=False)

    def finish(self) -> None:
        held, self.pending = list(self.pending.items()), {}
        if held:
            self._round(*self._joined(held, None), final=True)

    @staticmethod
    def _joined(held: list[tuple[int, _Held]], new: _Tokens | None) -> _Tokens:
        parts: list[_Tokens] = [(np.full(len(positions), r, np.int64), positions, proposed, masks)
                                 for r, (positions, proposed, masks) in held]
        if new is not None:
            parts.append(new)
        if len(parts) == 1:
            return parts[0]
        request, position, proposed, masks = zip(*parts)
        return (np.concatenate(request), np.concatenate(position),
                None if proposed[0] is None else np.concatenate(proposed), np.concatenate(masks))

    def _round(
        self, request: npt.NDArray[np.int64], position: npt.NDArray[np.int64],
        proposed: npt.NDArray[np.int64] | None, unordered: Masks, final: bool,
    ) -> None:
        if len(request) == 0:
            return
        order = np.lexsort((position, request))
        request, position = request[order], position[order]
        proposed = None if proposed is None else proposed[order]
        runs = group_starts(request)
        run_of = group_of_row(runs, len(request))
        run_request = request[runs]
        before = self._last(run_request)
        after = position[np.append(runs[1:], len(request)) - 1]
        self.seen, index = np.unique(np.concatenate([self.seen, run_request]), return_inverse=True)
        last = np.full(len(self.seen), self.NO_POSITION, np.int64)
        np.maximum.at(last, index, np.concatenate([self.last, after]))
        self.last = last
        reach = np.full(len(runs), self.OPEN_END, np.int64) if final else after
        masks: Masks = np.take(unordered, order, axis=0, out=self.scratch.array(
            "ordered", unordered.shape, np.uint64), mode="clip")  # in place: mode="raise" would buffer
        for k in self.ks:
            spans = window_spans(request, position, proposed, k, self.trace_k)
            run = run_of[spans.starts]
            closes_now = spans.take((spans.ends > before[run]) & (spans.ends <= reach[run])).widest_first()
            self.stats.add(k, window_union(masks, closes_now.starts, closes_now.widths, self.scratch))
        # a window still open ends past the reach, so it starts after reach - widest + 1
        keep = position > reach[run_of] - self.widest + 1
        if keep.any():
            request, position = request[keep], position[keep]
            proposed = None if proposed is None else proposed[keep]
            held = masks[keep]  # a copy: the ordered bitsets are reused next round
            bounds = np.append(group_starts(request), len(request))
            for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                self.pending[int(request[start])] = (position[start:stop],
                                                     None if proposed is None else proposed[start:stop],
                                                     held[start:stop])


def counterfactual_streamed(
    chunks: Iterable[Columns], num_experts: int, ks: Sequence[int], expert_rank: npt.NDArray[np.int64], trace_k: int,
    proposals: Proposals | None, source: str, scope: str
) -> list[dict[str, object]]:
    """Counterfactual windows (``counterfactual``) over a token-major trace recorded at ``trace_k``, read in
    ``chunks`` of its rows in recording order (``routing_chunks``, or rows already decoded; ``proposals``: what its
    request-steps proposed; None without drafts): one row of sums per (layer, k) (``growth.WINDOW_SUMS_SCHEMA``,
    labelled ``source`` and ``scope``); raises ``NotTokenMajor`` for a trace not laid out so."""
    keys = ("request", "position", "step_key", "draft_pos") if proposals is not None else ("request", "position")
    tokens = _TokenMajor(chunks, keys, keep="in_sequence")
    stats = WindowStats(ks, rank_masks(expert_rank, num_experts))
    windows, table, scratch = _SequenceWindows(ks, trace_k, stats), MaskTable(num_experts), Scratch()
    for found, experts in tokens:
        proposed = None if proposals is None else proposals.at(found["step_key"], found["request"],
                                                               found["draft_pos"])
        windows.add(found["request"], found["position"], proposed, table.masks(experts, scratch))
    windows.finish()
    return [] if tokens.layers is None else stats.rows(tokens.layers, ks, source, scope)


TOKEN_CHUNK_ROWS = 1 << 18
"""Rows ``TokenMajorCounts`` turns into bitsets at a time (about 12 MB of them)."""


class TokenMajorCounts:
    """Window sums over token-major rows, fed a chunk of whole steps at a time (``add``), each turned into bitsets
    once. The measured windows at ``measured_ks`` (``growth.measured_window_sums``) per request and, where
    ``whole_steps``, per step; and, asked for ``counterfactual`` (its ks, the trace's k and what its request-steps
    proposed), the counterfactual windows, cut from the same bitsets in a second thread (numpy lets go of the GIL in
    its loops). Used as a context manager: the second thread ends with it, however the feeding ends."""

    def __init__(self, num_experts: int, measured_ks: Sequence[int], whole_steps: bool, ranks: Masks,
                 counterfactual: tuple[Sequence[int], int, Proposals | None] | None = None) -> None:
        self.measured_ks, self.whole_steps = list(measured_ks), whole_steps
        self.measured = [WindowStats(measured_ks, ranks) for _ in range(2 if whole_steps else 1)]
        self.table = MaskTable(num_experts)
        self.free: queue.Queue[Scratch] = queue.Queue()
        for _ in range(3):  # the bitsets of a chunk being counted here, of one waiting and of one being cut
            self.free.put(Scratch())
        self.ready: queue.Queue[tuple[Columns, Masks, Scratch] | None] = queue.Queue()
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.cut = None if counterfactual is None else self.pool.submit(_cut, self.ready, self.free, ranks,
                                                                         *counterfactual)

    def __enter__(self) -> TokenMajorCounts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ready.put(None)  # the second thread's end, however the feeding ended
        self.pool.shutdown(wait=True)

    def add(self, experts: npt.NDArray[np.integer], tokens: Columns) -> None:
        """Tokens of whole steps, in recording order, steps in order: ``experts`` [tokens, layers, top_k];
        ``tokens``: each token's "step" key, "request", "position", "draft_pos" and "in_sequence"."""
        step = tokens["step"]
        steps = group_starts(step)
        cuts = np.searchsorted(steps, np.arange(0, len(step), max(1, TOKEN_CHUNK_ROWS // max(experts.shape[1], 1))))
        bounds = np.unique(np.append(steps[cuts[cuts < len(steps)]], len(step))).tolist()  # at step starts
        for first, end in zip(bounds[:-1], bounds[1:]):
            part = {name: values[first:end] for name, values in tokens.items()}
            scratch = self.free.get()
            masks = self.table.masks(experts[first:end], scratch)  # [tokens, layers, words]
            for k in self.measured_ks:
                capped = part["draft_pos"] <= k
                read, keys = masks, (part["step"], part["request"])
                if not bool(capped.all()):
                    read, keys = masks[capped], (keys[0][capped], keys[1][capped])
                self.measured[0].add(k, group_union(read, group_starts(*keys)))
                if self.whole_steps:
                    self.measured[1].add(k, group_union(read, group_starts(keys[0])))
            if self.cut is None:
                self.free.put(scratch)
            else:
                self.ready.put((part, masks, scratch))

    def result(self) -> tuple[list[WindowStats], WindowStats | None]:
        """The measured sums (per request, then per step where ``whole_steps``) and the counterfactual ones: None
        where not asked for, or where a request went back to a position it had passed."""
        self.ready.put(None)
        return self.measured, None if self.cut is None else self.cut.result()


def _cut(ready: queue.Queue[tuple[Columns, Masks, Scratch] | None], free: queue.Queue[Scratch], ranks: Masks,
         ks: Sequence[int], trace_k: int, proposals: Proposals | None) -> WindowStats | None:
    """``TokenMajorCounts``' counterfactual windows, from the chunks' tokens and bitsets as they come ``ready`` (each
    scratch handed back ``free`` once read)."""
    stats = WindowStats(ks, ranks)
    windows: _SequenceWindows | None = _SequenceWindows(ks, trace_k, stats)
    failed: Exception | None = None
    while (chunk := ready.get()) is not None:
        tokens, masks, scratch = chunk
        try:
            if windows is not None and failed is None:
                keep = tokens["in_sequence"]
                request, position = (tokens[name][keep].astype(np.int64) for name in ("request", "position"))
                proposed = None if proposals is None else proposals.at(tokens["step"][keep], request,
                                                                       tokens["draft_pos"][keep])
                windows.add(request, position, proposed, masks if bool(keep.all()) else masks[keep])
        except NotTokenMajor:
            windows = None
        except Exception as exc:  # raised once every chunk is handed back: the first thread waits for them
            failed = exc
        finally:
            free.put(scratch)
    if failed is not None:
        raise failed
    if windows is None:
        return None
    windows.finish()
    return stats
