"""Where a figure comes from, as an ordered type: every number that reaches the report carries one.

Order is directness, most direct first. A figure built from several inputs carries the least direct of their
sources (``least_direct``), so "measured" is only ever shown for a figure that rests on measurements alone.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import polars as pl


class Source(enum.Enum):
    MEASURED = "measured"  # read from the trace's own rows at the k (and concurrency) it ran
    ESTIMATED = "estimated"  # drawn from what the trace recorded, combined as it did not run it
    COUNTERFACTUAL = "counterfactual"  # windows of accepted tokens, as many as drafted: a k the trace did not record
    LOWER_BOUND = "lower bound"  # fewer windows than asked for: the union of all of them
    # continued past what was measured (acceptance past the largest recorded k, a step past the largest recorded
    # concurrency)
    EXTRAPOLATED = "extrapolated"
    GIVEN = "given"  # stated by the user (--acceptance)
    UNIFORM = "uniform"  # uniformly random routing, not the trace's

    @property
    def rank(self) -> int:
        return list(Source).index(self)

    @property
    def mark(self) -> str:
        """The one-character mark the terminal and the dashboard put beside a figure of this source."""
        return MARKS[self]

    @property
    def meaning(self) -> str:
        return MEANINGS[self]


MARKS = {Source.MEASURED: "", Source.ESTIMATED: "~", Source.COUNTERFACTUAL: "*", Source.LOWER_BOUND: "≥",
         Source.EXTRAPOLATED: "+", Source.GIVEN: "=", Source.UNIFORM: "u"}
MEANINGS = {
    Source.MEASURED: "read from the trace's own rows at the k (and concurrency) it ran",
    Source.ESTIMATED: "drawn from what the trace recorded, combined as it did not run it (its windows as steps of "
                      "another concurrency, a step time from the concurrencies it ran)",
    Source.COUNTERFACTUAL: "windows of consecutive accepted tokens, as many as each request-step's drafter proposed "
                           "(past the recorded k, a capped drafter assumed to propose every draft): a k the trace did "
                           "not record",
    Source.LOWER_BOUND: "fewer windows than asked for: the union of all of them",
    Source.EXTRAPOLATED: "continued past what was measured (acceptance past the largest recorded k, a step past the "
                         "largest recorded concurrency)",
    Source.GIVEN: "stated by the user (--acceptance)",
    Source.UNIFORM: "uniformly random routing, not the trace's",
}
RANKS = {source.value: source.rank for source in Source}


def least_direct(sources: Iterable[Source]) -> Source:
    """The least direct of ``sources`` (what a figure combining them rests on)."""
    return max(sources, key=lambda source: source.rank)


def least_direct_expr(column: str) -> pl.Expr:
    """In an aggregation: the least direct of a column of source values (by rank, never alphabetically)."""
    return pl.col(column).sort_by(pl.col(column).replace_strict(RANKS, return_dtype=pl.Int32)).last()
