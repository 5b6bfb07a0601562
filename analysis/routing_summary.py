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

from moetrace.analysis.budgets import sampled_tables, with_experts
from moetrace.analysis.consistency import routing_gaps
from moetrace.analysis.counterfactual import proposed_drafts
from moetrace.analysis.growth import WINDOW_KEYS, WindowRows, decode_and_verify, growth_sums, rejected_only_sums
from moetrace.analysis.load import expert_load


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


def summarise_routing(routing: pl.LazyFrame, steps: pl.LazyFrame,
                      request: SummaryRequest) -> tuple[RoutingSummary, WindowRows]:
    """The summary of one trace's rows (or one partition's, numbered as in the whole), and its non-prefill rows
    (``growth.decode_and_verify``: the placement comparison takes them)."""
    columns = list(request.sample_columns)
    # the gaps and the sample (its experts taken from the rows) first: the peaks of their own passes over the files
    # come before the rows are in memory
    gaps = routing_gaps(routing, steps, sampled_requests=not request.whole_steps)
    accepted, stepped = sampled_tables(routing, request.share, columns, experts_apart=True)
    rows = decode_and_verify(routing)
    accepted, stepped = with_experts(accepted, rows.experts, columns), with_experts(stepped, rows.experts, columns)
    proposals = proposed_drafts(routing, request.trace_k)

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
                          stepped=stepped, proposals=proposals), rows


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
