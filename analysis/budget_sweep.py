"""A budget sweep: the same workload recorded under several expert budgets (``moetrace record --budget 12,16,none``),
compared with the run under the router's own routing (``none``)."""

from __future__ import annotations

import polars as pl

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


def best_budget(rows: pl.DataFrame, column: str, min_agreement: float) -> str | None:
    """The budget with the largest ``column`` (a speedup: ``predicted`` or ``measured_vs_none``) among those whose
    ``agreement`` with the unbudgeted outputs is at least ``min_agreement``; None where none has one."""
    ranked = rows.filter((pl.col("agreement") >= min_agreement) & pl.col(column).is_not_null()).sort(
        column, descending=True)
    return str(ranked["budget"][0]) if ranked.height else None
