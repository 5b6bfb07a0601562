"""How far a predicted speedup may lie from the measured one: an interval from the committed hold-outs' errors.

A hold-out's error is (predicted - measured) / measured, so a prediction p stands for a measured speedup in
[p / (1 + e_high), p / (1 + e_low)], where e_low and e_high bound the central ``coverage`` of the recorded errors.
k = 0 is exact (its speedup over itself is 1). Which recorded errors count: ``interval_errors``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moetrace.analysis.sources import Source


@dataclass(frozen=True)
class HeldOutErrors:
    """The prediction's errors on held-out cells (``moetrace/data/prediction-errors.json``) and the share of them
    an interval covers."""

    errors: tuple[float, ...]
    coverage: float = 0.8
    basis: str = "the errors given"  # which cells of the record the errors are

    def bounds(self) -> tuple[float, float]:
        """The errors' central ``coverage``: (low, high)."""
        tail = (1.0 - self.coverage) / 2
        low, high = np.quantile(np.asarray(self.errors, dtype=np.float64), [tail, 1.0 - tail])
        return float(low), float(high)


def fewest_errors(coverage: float) -> int:
    """The fewest errors whose central ``coverage`` leaves at least one error beyond each bound: np.quantile's
    position tail · (n - 1) reaches the second error from each end. With fewer, a bound is an extreme error itself,
    or lies between it and the next."""
    tail = (1.0 - coverage) / 2
    return 1 + math.ceil(1.0 / tail - 1e-9)  # 1e-9: 1 / 0.1 is 10.000000000000002 in floating point


def interval_errors(cells: Sequence[Mapping[str, Any]], coverage: float = 0.8) -> HeldOutErrors:
    """The errors the intervals are drawn from, of ``cells`` (``moetrace/data/prediction-errors.json``): the blind
    cells at their traces' own context; while those are fewer than ``fewest_errors(coverage)``, every cell at its
    traces' own context, re-predicted ones included, and ``basis`` says so. Cells moved to another context are left
    out either way: they price a context the traces did not run at."""
    own = [cell for cell in cells if cell["moved_from"] is None]
    blind = [float(cell["error"]) for cell in own if cell["prediction"] == "blind"]
    needed = fewest_errors(coverage)
    if len(blind) >= needed:
        return HeldOutErrors(tuple(blind), coverage, f"the {len(blind)} blind held-out cells")
    return HeldOutErrors(tuple(float(cell["error"]) for cell in own), coverage,
                         f"all {len(own)} held-out cells at the traces' own context, re-predicted ones included: "
                         f"{len(blind)} blind cells are fewer than the {needed} a central {coverage:.0%} needs")


def speedup_intervals(speedups: pl.DataFrame, errors: HeldOutErrors) -> pl.DataFrame:
    """``speedups`` (batch, k, speedup) with speedup_low and speedup_high: the measured speedups each prediction
    stands for."""
    low, high = errors.bounds()
    exact = pl.col("k") == 0
    return speedups.with_columns(
        speedup_low=pl.when(exact).then(1.0).otherwise(pl.col("speedup") / (1.0 + high)),
        speedup_high=pl.when(exact).then(1.0).otherwise(pl.col("speedup") / (1.0 + low)))


def with_intervals(decision: pl.DataFrame, speedups: pl.DataFrame, errors: HeldOutErrors) -> pl.DataFrame:
    """``decision`` (``analysis.decision.recommended_k``) with the recommended k's speedup_low and speedup_high, and
    within_error: the other k compared (acceptance not extrapolated) whose interval reaches the recommended k's, so
    the record of misses cannot tell them apart (empty: none; null where no k is recommended)."""
    compared = speedup_intervals(
        speedups.filter(pl.col("acceptance_source") != Source.EXTRAPOLATED.value).select("batch", "k", "speedup"),
        errors)
    chosen = decision.select("batch", "k").join(compared, on=["batch", "k"], how="left")
    rivals = (compared.join(chosen.select("batch", chosen_k="k", chosen_low="speedup_low"), on="batch")
              .filter((pl.col("k") != pl.col("chosen_k")) & (pl.col("speedup_high") >= pl.col("chosen_low")))
              .group_by("batch").agg(within_error=pl.col("k").sort()))
    return (decision.join(chosen.select("batch", "speedup_low", "speedup_high"), on="batch", how="left")
            .join(rivals, on="batch", how="left")
            .with_columns(within_error=pl.when(pl.col("k").is_null()).then(None)
                          .otherwise(pl.col("within_error").fill_null(pl.lit([], pl.List(pl.Int32)))))
            .sort("batch"))
