"""The routing rows every growth and load analysis reads: the non-prefill rows as numpy columns (``WindowRows``),
decoded whole (``decode_and_verify``) or a chunk of whole steps at a time as Polars streams them
(``decode_in_chunks``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.predicates import in_sequence, not_prefill, phase_is, step_key
from moetrace.analysis.streamed_windows import Columns


@dataclass(frozen=True)
class WindowRows:
    """Non-prefill rows in recording order as numpy columns [N] (experts [N, K]), read once and shared by the
    measured and counterfactual growth, the rejected-only analysis and the expert load."""

    layer: npt.NDArray[np.uint16]
    step: npt.NDArray[np.int64]  # the step key (``predicates.step_key``: data-parallel ranks' steps apart)
    request: npt.NDArray[np.uint32]
    position: npt.NDArray[np.uint32]
    draft_pos: npt.NDArray[np.uint8]
    is_verify: npt.NDArray[np.bool_]
    in_sequence: npt.NDArray[np.bool_]
    experts: npt.NDArray[np.uint16]

    def columns(self) -> Columns:
        """The rows' columns (no copy), named as the routing columns (the step key ``step_key``)."""
        return {"step_key" if f.name == "step" else f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def take(self, index: slice | npt.NDArray[np.int64]) -> WindowRows:
        return WindowRows(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))

    def token_layers(self) -> npt.NDArray[np.uint16] | None:
        """The layers each token's rows hold, in row order, where the rows are token-major as the recorder writes
        them: each token's rows consecutive, in one layer order, with its keys on every one (step, request,
        position, draft position, in the sequence or not), and the steps in order (then layer i's rows are every L-th
        row, as ``by_layer`` takes them); else None."""
        rows = len(self.layer)
        repeat = np.flatnonzero(self.layer[1 : 1 << 16] == self.layer[0]) if rows else np.zeros(0, np.int64)
        width = int(repeat[0]) + 1 if len(repeat) else rows
        layers = self.layer[:width]
        if rows == 0 or rows % width or len(np.unique(layers)) != width:
            return None
        for values in (self.layer, self.step, self.request, self.position, self.draft_pos, self.in_sequence):
            grid = values.reshape(-1, width)
            if not bool((grid == (layers if values is self.layer else grid[:, :1])).all()):
                return None
        return layers if bool(np.all(np.diff(self.step[::width]) >= 0)) else None

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
                # copied out of the stride: each layer's rows are read many times, and a strided row is a cache miss
                layer = int(self.layer[i])
                part = WindowRows(*(np.ascontiguousarray(getattr(self, f.name)[i::count])
                                    for f in dataclasses.fields(self)))
            else:
                part, layer = self.take(order[(bounds[i - 1] if i else 0) : bounds[i]]), int(layers[i])
            if not bool(np.all(np.diff(part.step.astype(np.int64)) >= 0)):
                part = part.take(np.lexsort((part.draft_pos, part.request, part.step)))
            yield layer, part


DECODE_CHUNK_ROWS = 1 << 20
"""Rows ``decode_and_verify`` and ``decode_in_chunks`` take from Polars at a time."""

_ROW_COLUMNS = {"layer": "layer", "step": "step_key", "request": "request", "position": "position",
                "draft_pos": "draft_pos", "is_verify": "is_verify", "in_sequence": "in_sequence", "experts": "experts"}
"""Each ``WindowRows`` field's column in ``_decoded``."""


def _decoded(routing: pl.LazyFrame, beside: Sequence[str | pl.Expr] = ()) -> pl.LazyFrame:
    """The non-prefill rows' ``WindowRows`` columns (``_ROW_COLUMNS``), and ``beside`` (over the routing columns and
    ``step_key``) where not among them."""
    return routing.filter(not_prefill()).with_columns(step_key()).select(
        "layer", "step_key", "request", "position", "draft_pos", phase_is("verify").alias("is_verify"),
        in_sequence().alias("in_sequence"), "experts",
        *(column for column in beside if _name(column) not in _ROW_COLUMNS.values()))


def decode_and_verify(routing: pl.LazyFrame) -> WindowRows:
    """The trace's non-prefill rows as ``WindowRows``: one pass over the files, streamed in chunks straight into
    numpy arrays (collected whole, the Polars frame and its numpy copy both stood in memory: 4 GB at 60M rows)."""
    query = _decoded(routing)
    most = int(routing.select(pl.len()).collect().item())  # rows allocated, not touched: what no chunk fills costs none
    columns: dict[str, npt.NDArray[Any]] = {}
    filled = 0
    for chunk in query.collect_batches(chunk_size=DECODE_CHUNK_ROWS, maintain_order=True):
        for field, name in _ROW_COLUMNS.items():
            at = filled
            for piece in chunk.get_column(name).get_chunks():
                values = piece.to_numpy()
                if field not in columns:
                    columns[field] = np.empty((most, *values.shape[1:]), dtype=values.dtype)
                columns[field][at : at + len(values)] = values
                at += len(values)
        filled += chunk.height
    if not filled:  # no chunk, or an empty one: the empty frame's columns (an empty list column has no width)
        empty = query.clear().collect()
        columns = {field: empty.get_column(name).to_numpy() for field, name in _ROW_COLUMNS.items()}
        if columns["experts"].ndim == 1:
            columns["experts"] = columns["experts"].reshape(0, 0).astype(np.uint16)
    return WindowRows(**{field: values[:filled] for field, values in columns.items()})


@dataclass
class KeptRows:
    """The rows ``decode_in_chunks`` keeps whole as it reads them: those of the non-prefill routing rows (with their
    ``step_key``) where ``keep`` holds, their ``columns``; ``frames``: a frame of them per part read, in order."""

    keep: pl.Expr
    columns: list[str | pl.Expr]
    frames: list[pl.DataFrame] = dataclasses.field(default_factory=list)


def decode_in_chunks(routing: pl.LazyFrame, kept: KeptRows | None = None) -> Iterator[WindowRows]:
    """The trace's non-prefill rows as ``decode_and_verify`` reads them, in recording order, a chunk of whole steps
    at a time (where each step's rows are consecutive), as Polars streams them: nothing held but a chunk and the
    rows of the step under way, no copy of every row (at 60M rows, faulting in 2 GB of copies took longer than
    reading the files). ``kept``: rows kept whole in the same pass (the window sample: a pass of its own took a
    sixth of the report)."""
    beside = [] if kept is None else [*kept.columns, kept.keep.alias("row.kept")]
    query = _decoded(routing, beside)
    held: WindowRows | None = None  # the rows of the last step seen, which the next part may go on with
    for part in query.collect_batches(chunk_size=DECODE_CHUNK_ROWS, maintain_order=True):
        if part.height == 0:
            continue
        if kept is not None:
            kept.frames.append(part.filter("row.kept").select(_name(column) for column in kept.columns))
        rows = WindowRows(**{field: part.get_column(name).rechunk().to_numpy() for field, name in _ROW_COLUMNS.items()})
        if held is not None:
            other = np.flatnonzero(rows.step != held.step[-1])
            head = int(other[0]) if len(other) else len(rows.step)  # the held step's rows this part goes on with
            held = _joined(held, rows.take(slice(0, head)))
            if head == len(rows.step):
                continue
            yield held
            rows = rows.take(slice(head, None))
        other = np.flatnonzero(rows.step != rows.step[-1])
        last = int(other[-1]) + 1 if len(other) else 0  # the first row of the part's last step
        if last:
            yield rows.take(slice(0, last))
        held = rows.take(slice(last, None))
    if held is not None:
        yield held


def _name(column: str | pl.Expr) -> str:
    return column if isinstance(column, str) else column.meta.output_name()


def _joined(first: WindowRows, then: WindowRows) -> WindowRows:
    return WindowRows(*(np.concatenate([getattr(first, f.name), getattr(then, f.name)])
                        for f in dataclasses.fields(WindowRows)))
