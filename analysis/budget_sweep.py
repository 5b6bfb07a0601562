"""A budget sweep: the same workload recorded under several expert budgets (``moetrace record --budget 12,16,none``),
compared with the run under the router's own routing (``none``)."""

from __future__ import annotations

from collections.abc import Mapping

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
