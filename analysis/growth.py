"""Unique experts per layer one request-step reads as k grows: measured, counterfactual and the uniform bound.

- measured, per request: every decoding request-step ``(step, request)`` of the recorded trace, its drafts capped at
  k (the anchor and drafts 1..min(d, k) of the d it proposed: what it would have read at k, so one trace at K
  answers 0..K).
- measured, per step (scope ``batch``, as the table and the JSON's ``measured_batch`` name it): the union over
  every decode/verify token of a step, drafts capped at k.
- counterfactual: ``counterfactual.window_spans``' windows of consecutive accepted tokens, one per request-step,
  as many tokens as its drafter proposed (a trace without drafts: full windows of k+1 tokens). Any trace, plain
  decoding included, answers every k this way.
- uniform: the expected union of as many independent uniformly random top-k sets as a request-step reads,
  N·(1−(1−top_k/N)^T) averaged over the request-steps' T (``counterfactual.window_tokens``; k+1 without drafts).

Every row also carries the per-rank view under an expert placement: experts on the busiest rank and ranks touched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.concurrency import uniform_unique_experts
from moetrace.analysis.counterfactual import Proposals, proposed_drafts, window_spans, window_tokens
from moetrace.analysis.predicates import accepted_sequence, step_key
from moetrace.analysis.sources import RANKS, Source
from moetrace.analysis.window_rows import WindowRows, decode_and_verify
from moetrace.analysis.streamed_windows import (
    Columns,
    NotTokenMajor,
    array_chunks,
    counterfactual_streamed,
    TokenMajorCounts,
    WindowStats,
    routing_chunks,
)
from moetrace.analysis.expert_sets import (
    Masks,
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
WINDOW_KEYS = ["layer", "k", "source", "scope"]
# The growth table before its means: integer sums over windows, so that the sums of two parts of a trace (two
# partitions of an always-on recording) are the sums of the whole, exactly.
WINDOW_SUMS_SCHEMA: dict[str, pl.DataType] = {
    "layer": pl.UInt16(),
    "k": pl.Int32(),
    "source": pl.String(),
    "scope": pl.String(),
    "windows": pl.Int64(),
    "unique_sum": pl.Int64(),
    "busiest_sum": pl.Int64(),
    "touched_sum": pl.Int64(),
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
    unique = count_experts(unions)
    if len(ranks) == 1:  # every expert on one rank: nothing more to count
        busiest, touched = int(unique.sum()), len(unions)
    else:
        on_rank = per_rank_counts(unions, ranks)
        busiest, touched = int(on_rank.max(axis=1).sum()), int((on_rank > 0).sum())
    return {
        "layer": layer,
        "k": k,
        "source": source,
        "scope": scope,
        "windows": len(unions),
        "unique_sum": int(unique.sum()),
        "busiest_sum": busiest,
        "touched_sum": touched,
    }


def _frame(rows: Sequence[dict[str, object] | None]) -> pl.DataFrame:
    return pl.DataFrame([row for row in rows if row is not None], schema=WINDOW_SUMS_SCHEMA, orient="row")


def window_means(sums: pl.DataFrame) -> pl.DataFrame:
    """Window sums (``WINDOW_SUMS_SCHEMA``) as means per window (``GROWTH_SCHEMA``): sums of whole numbers below
    2^53 are exact in float64, so a mean is the one correctly rounded quotient however the sums were split."""
    per_window = [(pl.col(total) / pl.col("windows")).alias(mean) for total, mean in
                  (("unique_sum", "unique_experts"), ("busiest_sum", "busiest_rank_experts"),
                   ("touched_sum", "ranks_touched"))]
    return sums.select(*WINDOW_KEYS, "windows", *per_window).cast(GROWTH_SCHEMA)  # type: ignore[arg-type]


def counterfactual_window_sums(
    routing: pl.LazyFrame, num_experts: int, ks: Sequence[int], expert_rank: npt.NDArray[np.int64], trace_k: int,
    proposals: pl.DataFrame | None = None, rows: WindowRows | None = None,
) -> pl.DataFrame:
    """Window sums (``WINDOW_SUMS_SCHEMA``) of unique experts per counterfactual window (``counterfactual``), per
    layer and k, of a trace recorded at ``trace_k``; ``proposals``: its ``counterfactual.proposed_drafts`` where the
    caller has them; ``rows``: its ``decode_and_verify`` where the caller has them (not read again).

    Token-major traces (every token's layers on consecutive rows, in one layer order, and each request's positions
    increasing from chunk to chunk: what the recorder writes) are streamed in chunks, without a sort; anything else
    takes the general path, which sorts."""
    found = Proposals.of(proposed_drafts(routing, trace_k) if proposals is None else proposals) if trace_k else None
    chunks = routing_chunks(routing, found is not None) if rows is None else array_chunks(
        rows.columns())
    try:
        return _frame(counterfactual_streamed(chunks, num_experts, ks, expert_rank, trace_k, found, COUNTERFACTUAL,
                                              PER_REQUEST))
    except NotTokenMajor:
        return _counterfactual_sorted(routing, num_experts, ks, expert_rank, trace_k, found)


def _counterfactual_sorted(
    routing: pl.LazyFrame, num_experts: int, ks: Sequence[int], expert_rank: npt.NDArray[np.int64], trace_k: int,
    proposals: Proposals | None,
) -> pl.DataFrame:
    """The general path: sort by layer, request and position, then cut windows per layer."""
    frame = (
        accepted_sequence(routing)
        .select("layer", "request", "position", step_key(), "draft_pos", "experts")
        .sort("layer", "request", "position")
        .collect()
    )
    ranks = rank_masks(expert_rank, num_experts)
    rows: list[dict[str, object] | None] = []
    for layer, part in _layer_parts(frame):
        masks = expert_masks(part["experts"].to_numpy(), num_experts)
        request = part["request"].to_numpy()
        position = part["position"].to_numpy()
        proposed = None if proposals is None else proposals.at(
            part["step_key"].to_numpy(), request, part["draft_pos"].to_numpy())
        for k in ks:
            spans = window_spans(request, position, proposed, k, trace_k).widest_first()
            unions = window_union(masks, spans.starts, spans.widths)
            rows.append(_window_row(layer, k, COUNTERFACTUAL, PER_REQUEST, unions, ranks))
    return _frame(rows)


def measured_window_sums(
    rows: WindowRows, num_experts: int, trace_k: int, expert_rank: npt.NDArray[np.int64], whole_steps: bool = True
) -> pl.DataFrame:
    """Window sums (``WINDOW_SUMS_SCHEMA``) of unique experts per recorded request-step (per request) and per step
    (whole step, where ``whole_steps``: not where the rows are of one request in N), drafts capped at k, k =
    0..trace_k. ``rows``: ``decode_and_verify`` of the trace. Token-major rows (``WindowRows.token_layers``) are
    counted over every layer at once, a chunk of whole steps at a time; others layer by layer."""
    ranks = rank_masks(expert_rank, num_experts)
    layers = rows.token_layers()
    if layers is not None:
        with TokenMajorCounts(num_experts, range(trace_k + 1), whole_steps, ranks) as counts:
            counts.add(*_tokens(rows, layers))
            return _measured_frame(counts.result()[0], layers, range(trace_k + 1))
    found: list[dict[str, object] | None] = []
    for layer, part in rows.by_layer():
        masks = expert_masks(part.experts, num_experts)
        for k in range(trace_k + 1):
            capped = part.draft_pos <= k
            if bool(capped.all()):  # no draft past k (plain decoding, or k = the trace's): no copy
                read, step, request = masks, part.step, part.request
            else:
                read, step, request = masks[capped], part.step[capped], part.request[capped]
            unions = group_union(read, group_starts(step, request))
            found.append(_window_row(layer, k, MEASURED, PER_REQUEST, unions, ranks))
            if whole_steps:
                found.append(_window_row(layer, k, MEASURED, PER_BATCH, group_union(read, group_starts(step)), ranks))
    return _frame(found)


class StreamedGrowth:
    """``growth_sums`` of a token-major trace, fed a chunk of whole steps at a time (``add``: ``decode_in_chunks``
    or the rows whole): each token's rows read in place (``streamed_windows.TokenMajorCounts``), not copied out of
    every L-th row layer by layer, a cache miss each for every column. ``add`` raises ``NotTokenMajor`` at a chunk
    that is not laid out so (``WindowRows.token_layers``), or whose steps do not follow the last chunk's. A context
    manager: its second thread ends with it."""

    def __init__(self, routing: pl.LazyFrame, num_experts: int, ks: Sequence[int], trace_k: int,
                 expert_rank: npt.NDArray[np.int64], proposals: pl.DataFrame, whole_steps: bool = True) -> None:
        self.routing, self.num_experts, self.ks, self.trace_k = routing, num_experts, list(ks), trace_k
        self.expert_rank, self.whole_steps = expert_rank, whole_steps
        self.proposals = Proposals.of(proposals) if trace_k else None
        self.measured_ks = range(measured_k(trace_k, ks) + 1)
        self.counts = TokenMajorCounts(num_experts, self.measured_ks, whole_steps,
                                       rank_masks(expert_rank, num_experts), (ks, trace_k, self.proposals))
        self.layers: npt.NDArray[np.uint16] | None = None
        self.last_step: int | None = None

    def __enter__(self) -> StreamedGrowth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.counts.__exit__(*exc)

    def add(self, rows: WindowRows) -> None:
        layers = rows.token_layers()
        if layers is None or (self.layers is not None and not np.array_equal(layers, self.layers)) or (
                self.last_step is not None and int(rows.step[0]) <= self.last_step):
            raise NotTokenMajor
        self.layers, self.last_step = layers, int(rows.step[-1])
        self.counts.add(*_tokens(rows, layers))

    def sums(self) -> pl.DataFrame:
        """The window sums (``growth_sums``) of every chunk added; ``NotTokenMajor`` where none was."""
        if self.layers is None:
            raise NotTokenMajor
        measured, cut = self.counts.result()
        sums = _measured_frame(measured, self.layers, self.measured_ks)
        counterfactual = (_counterfactual_sorted(self.routing, self.num_experts, self.ks, self.expert_rank,
                                                 self.trace_k, self.proposals)
                          if cut is None  # a request went back to a position it had passed
                          else _frame(cut.rows(self.layers.astype(np.int64), self.ks, COUNTERFACTUAL, PER_REQUEST)))
        return pl.concat([sums, counterfactual])


def _tokens(rows: WindowRows, layers: npt.NDArray[np.uint16]) -> tuple[npt.NDArray[np.uint16], Columns]:
    """Token-major ``rows`` of ``layers`` as ``TokenMajorCounts.add`` takes them: experts [tokens, layers, top_k]
    and each token's keys (its first row's)."""
    width = len(layers)
    tokens = {name: getattr(rows, name)[::width] for name in ("step", "request", "position", "draft_pos",
                                                              "in_sequence")}
    return rows.experts.reshape(len(tokens["step"]), width, -1), tokens


def _measured_frame(measured: list[WindowStats], layers: npt.NDArray[np.uint16], ks: Sequence[int]) -> pl.DataFrame:
    """The measured window sums (``TokenMajorCounts.result``) per layer of ``layers``, k and scope."""
    scopes = list(zip((PER_REQUEST, PER_BATCH), measured))
    return _frame([stats.row(index, layer, k, MEASURED, scope) for index, layer in enumerate(layers.tolist())
                   for k in ks for scope, stats in scopes])


def rejected_only_sums(rows: WindowRows, num_experts: int) -> pl.DataFrame:
    """Per layer, over verification windows with drafts: the windows, their unique experts and the experts that
    only rejected drafts pulled in (read for nothing), summed (``rejected_only_experts`` takes the means).
    ``rows``: ``decode_and_verify`` of the trace."""
    found: list[tuple[int, int, int, int]] = []
    if not rows.draft_pos.any():  # no window with drafts (plain decoding): nothing to split each layer for
        return pl.DataFrame(found, schema=REJECTED_SUMS_SCHEMA, orient="row")
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
        found.append((layer, len(everything), int(count_experts(everything).sum()),
                      int(count_experts(everything & ~kept).sum())))
    return pl.DataFrame(found, schema=REJECTED_SUMS_SCHEMA, orient="row")


REJECTED_SUMS_SCHEMA: dict[str, pl.DataType] = {
    "layer": pl.UInt16(), "windows": pl.Int64(), "unique_sum": pl.Int64(), "rejected_only_sum": pl.Int64()}


def rejected_only_experts(sums: pl.DataFrame) -> pl.DataFrame:
    """Per layer: windows, mean unique experts, mean rejected-only experts and their share of the unique ones, from
    ``rejected_only_sums`` (of one trace, or summed over its partitions)."""
    return sums.select(
        "layer",
        "windows",
        unique_experts=pl.col("unique_sum") / pl.col("windows"),
        rejected_only_experts=pl.col("rejected_only_sum") / pl.col("windows"),
        rejected_only_share=pl.col("rejected_only_sum") / pl.col("unique_sum"),
    )


def growth_sums(
    routing: pl.LazyFrame,
    num_experts: int,
    ks: Sequence[int],
    trace_k: int,
    expert_rank: npt.NDArray[np.int64],
    rows: WindowRows,
    proposals: pl.DataFrame,
    whole_steps: bool = True,
) -> pl.DataFrame:
    """Window sums of the measured (k ≤ trace_k) and counterfactual (every k in ks) growth per layer.
    ``rows``: ``decode_and_verify`` of ``routing``; ``proposals``: its ``counterfactual.proposed_drafts``;
    ``whole_steps``: as ``measured_window_sums``. Token-major rows (``WindowRows.token_layers``) are read once for
    both, in two threads."""
    if rows.token_layers() is None:
        measured = measured_window_sums(rows, num_experts, measured_k(trace_k, ks), expert_rank, whole_steps)
        return pl.concat([measured, counterfactual_window_sums(routing, num_experts, ks, expert_rank, trace_k,
                                                               proposals, rows)])
    with StreamedGrowth(routing, num_experts, ks, trace_k, expert_rank, proposals, whole_steps) as streamed:
        streamed.add(rows)
        return streamed.sums()


def measured_k(trace_k: int, ks: Sequence[int]) -> int:
    """The largest k of ``ks`` a trace recorded at ``trace_k`` measured (``growth_sums``)."""
    return min(trace_k, max(ks, default=0))


def growth(
    routing: pl.LazyFrame,
    num_experts: int,
    top_k: int,
    ks: Sequence[int],
    trace_k: int,
    expert_rank: npt.NDArray[np.int64],
    rows: WindowRows | None = None,
) -> pl.DataFrame:
    """Measured (k ≤ trace_k) and counterfactual (every k in ks) growth per layer (``growth_table``).
    ``rows``: ``decode_and_verify`` of the trace when the caller has it already."""
    rows = decode_and_verify(routing) if rows is None else rows
    proposals = proposed_drafts(routing, trace_k)
    sums = growth_sums(routing, num_experts, ks, trace_k, expert_rank, rows, proposals)
    return growth_table(sums, proposals, num_experts, top_k, ks, trace_k)


def growth_table(sums: pl.DataFrame, proposals: pl.DataFrame, num_experts: int, top_k: int, ks: Sequence[int],
                 trace_k: int) -> pl.DataFrame:
    """The growth table from ``growth_sums`` (of one trace, or summed over its partitions): means per window, the
    uniform bound of the request-steps' tokens (``proposals``: ``counterfactual.proposed_drafts`` of the trace,
    recorded at ``trace_k``) and the routing locality (unique experts / uniform bound: below 1 means tokens share
    experts more than chance)."""
    proposed = proposals["proposed"].to_numpy()

    def bound(k: int) -> float:
        if not trace_k or not len(proposed):
            return uniform_unique_experts(num_experts, top_k, k + 1)
        tokens, request_steps = np.unique(window_tokens(proposed, k, trace_k), return_counts=True)
        return float(np.average([uniform_unique_experts(num_experts, top_k, int(t)) for t in tokens],
                                weights=request_steps))

    uniform = pl.DataFrame({"k": list(ks), "uniform_bound": [bound(k) for k in ks]},
                           schema={"k": pl.Int32(), "uniform_bound": pl.Float64()})
    return (
        window_means(sums).join(uniform, on="k", how="left")
        .with_columns(
            # The bound is for one request-step's tokens; a whole step holds more tokens, so it has none.
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
