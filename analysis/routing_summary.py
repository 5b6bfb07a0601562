"""Everything the report reads from a trace's routing rows, in a form whose parts add up: integer sums over windows
(growth, rejected-only experts), expert picks, the routing/steps agreement counts, the rows of the window sample
(each kept by a hash of its own key) and the drafts each request-step proposed. The summaries of an always-on
recording's partitions, added (``added_summaries``), equal the summary of all its rows read as one trace, exactly:
a window, a step and a sampled block never span two partitions (a request that ran across a boundary is a request
in each, on both paths)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.budgets import sample_selection, sampled_windows, split_sample
from moetrace.analysis.consistency import routing_gaps
from moetrace.analysis.counterfactual import proposed_drafts
from moetrace.analysis.growth import WINDOW_KEYS, StreamedGrowth, growth_sums, rejected_only_sums
from moetrace.analysis.load import ExpertLoad, expert_load
from moetrace.analysis.streamed_windows import NotTokenMajor
from moetrace.analysis.window_rows import KeptRows, WindowRows, decode_and_verify, decode_in_chunks


@dataclass(frozen=True)
class RoutingSummary:
    growth: pl.DataFrame  # growth.WINDOW_SUMS_SCHEMA
    rejected_only: pl.DataFrame  # growth.REJECTED_SUMS_SCHEMA
    load: pl.DataFrame  # load.expert_load: picks per (layer, expert)
    gaps: pl.DataFrame  # consistency.routing_gaps: one row of counts
    accepted: pl.DataFrame  # the window sample's tables (budgets.WindowSample)
    stepped: pl.DataFrame
    proposals: pl.DataFrame  # counterfactual.proposed_drafts: the drafts each request-step proposed


@dataclass(frozen=True)
class SummaryRequest:
    """What a summary is for: the model's expert count, the ks of the growth, the trace's own k, the expert
    placement (rank of every expert), the window sample's share and columns, and whether the routing rows hold
    whole steps (not where they are of one request in N)."""

    num_experts: int
    ks: tuple[int, ...]
    trace_k: int
    expert_rank: npt.NDArray[np.int64]
    share: float
    sample_columns: tuple[str, ...]
    whole_steps: bool = True


def summarise_routing(routing: pl.LazyFrame, steps: pl.LazyFrame, request: SummaryRequest,
                      keep_rows: bool = False) -> tuple[RoutingSummary, WindowRows | None]:
    """The summary of one trace's rows (or one partition's, numbered as in the whole); with its non-prefill rows
    (``window_rows.decode_and_verify``) where ``keep_rows`` (the placement comparison takes them). Without, a
    token-major trace (what the recorder writes) is summed a chunk of whole steps at a time as Polars streams it,
    never held whole."""
    columns = list(request.sample_columns)
    # the gaps first: the peak of their own pass over the files comes before the rows are read
    gaps = routing_gaps(routing, steps, sampled_requests=not request.whole_steps)
    proposals = proposed_drafts(routing, request.trace_k)
    if not keep_rows:
        try:
            growth, rejected_only, load, (accepted, stepped) = _streamed(routing, request, proposals)
            return RoutingSummary(growth=growth, rejected_only=rejected_only, load=load, gaps=gaps, accepted=accepted,
                                  stepped=stepped, proposals=proposals), None
        except NotTokenMajor:
            pass
    # the sample before the rows: its reading's peak comes before they are in memory
    accepted, stepped = sampled_windows(routing, request.share, columns)
    rows = decode_and_verify(routing)

    def rest() -> tuple[pl.DataFrame, pl.DataFrame]:
        return rejected_only_sums(rows, request.num_experts), expert_load(rows, request.num_experts)

    # the rest beside the growth (itself two threads where the rows are token-major): numpy and Polars let go of
    # the GIL in their loops, so each thread takes a core while it runs
    with ThreadPoolExecutor(max_workers=1) as pool:
        beside = pool.submit(rest)
        growth = growth_sums(routing, request.num_experts, request.ks, request.trace_k, request.expert_rank, rows,
                             proposals, request.whole_steps)
        rejected_only, load = beside.result()
    return RoutingSummary(growth=growth, rejected_only=rejected_only, load=load, gaps=gaps, accepted=accepted,
                          stepped=stepped, proposals=proposals), rows if keep_rows else None


def _streamed(routing: pl.LazyFrame, request: SummaryRequest, proposals: pl.DataFrame
              ) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, tuple[pl.DataFrame, pl.DataFrame]]:
    """The growth sums, rejected-only sums, expert load and window sample of a token-major trace, summed a chunk of
    whole steps at a time (``window_rows.decode_in_chunks``), the sample kept in the same pass; ``NotTokenMajor`` at the
    first chunk not laid out so."""
    columns = list(request.sample_columns)
    sample = KeptRows(*sample_selection(request.share, columns))
    rejected: list[pl.DataFrame] = []
    load = ExpertLoad(request.num_experts)
    with StreamedGrowth(routing, request.num_experts, request.ks, request.trace_k, request.expert_rank, proposals,
                        request.whole_steps) as growth:
        for chunk in decode_in_chunks(routing, sample):
            growth.add(chunk)
            rejected.append(rejected_only_sums(chunk, request.num_experts))
            load.add(chunk)
        sums = growth.sums()
    rejected_only = pl.concat(rejected).group_by("layer").agg(pl.col("*").sum()).sort("layer")
    return sums, rejected_only, load.frame(), split_sample(pl.concat(sample.frames), columns)


def added_summaries(parts: Sequence[RoutingSummary]) -> RoutingSummary:
    """The summary of the parts' rows taken together, in the parts' order."""
    def joined(name: str) -> pl.DataFrame:
        frames: list[pl.DataFrame] = [getattr(part, name) for part in parts]
        return pl.concat(frames)

    return RoutingSummary(
        growth=joined("growth").group_by(WINDOW_KEYS).agg(pl.exclude(WINDOW_KEYS).sum()),
        rejected_only=joined("rejected_only").group_by("layer").agg(pl.exclude("layer").sum()).sort("layer"),
        load=joined("load").group_by("layer", "expert").agg(pl.col("picks").sum()).sort("layer", "expert"),
        gaps=joined("gaps").sum(),
        accepted=joined("accepted"),
        stepped=joined("stepped"),
        proposals=joined("proposals"),
    )


SUMMARY_TABLES = tuple(field.name for field in fields(RoutingSummary))
