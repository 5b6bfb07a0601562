"""How far a predicted speedup may lie from the measured one: an interval from the committed hold-outs' errors.

A hold-out's error is (predicted - measured) / measured, so a prediction p stands for a measured speedup in
[p / (1 + e_high), p / (1 + e_low)], where e_low and e_high bound the central ``coverage`` of the recorded errors.
k = 0 is exact (its speedup over itself is 1). Which recorded errors count: ``interval_errors``. Past the largest
recorded concurrency the step is extrapolated, and the bounds widen with the distance d = log2(B / largest
recorded): linear in d, through the bounds at d = 0 and those of the cells that were themselves past their recorded
concurrencies at their median distance (``HeldOutErrors.bounds_at``)."""

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
    # (distance, error) of the cells past their recorded concurrencies: distance = log2(concurrency / largest
    # recorded); empty: the bounds do not widen
    beyond: tuple[tuple[float, float], ...] = ()

    def bounds(self) -> tuple[float, float]:
        """The errors' central ``coverage``: (low, high)."""
        return central(self.errors, self.coverage)

    def bounds_at(self, distance: float) -> tuple[float, float]:
        """The bounds at ``distance`` (log2 of the concurrency over the largest recorded; 0 or less: within what
        was recorded): ``bounds`` moved linearly in the distance towards the bounds of the cells past their recorded
        concurrencies, which they reach at those cells' median distance, and never narrower than ``bounds``."""
        low, high = self.bounds()
        if distance <= 0 or not self.beyond:
            return low, high
        far_low, far_high = central(tuple(error for _, error in self.beyond), self.coverage)
        scale = distance / float(np.median([d for d, _ in self.beyond]))
        return min(low, low + (far_low - low) * scale), max(high, high + (far_high - high) * scale)


def central(errors: Sequence[float], coverage: float) -> tuple[float, float]:
    """The central ``coverage`` of ``errors``: (low, high)."""
    tail = (1.0 - coverage) / 2
    low, high = np.quantile(np.asarray(errors, dtype=np.float64), [tail, 1.0 - tail])
    return float(low), float(high)


def beyond_recorded(cell: Mapping[str, Any]) -> float | None:
    """log2(concurrency / largest recorded) of a record's cell past its recorded concurrencies; None within them,
    or where the cell does not say what was recorded."""
    if not cell.get("recorded"):
        return None
    top = max(cell["recorded"])
    return math.log2(cell["concurrency"] / top) if cell["concurrency"] > top else None


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
    out either way: they price a context the traces did not run at. The widening past the recorded concurrencies
    (``beyond``) takes the cells of that basis past theirs, or every such cell at its own context while those are
    too few, and ``basis`` says so too."""
    own = [cell for cell in cells if cell["moved_from"] is None]
    blind = [cell for cell in own if cell["prediction"] == "blind"]
    needed = fewest_errors(coverage)
    chosen, basis = ((blind, f"the {len(blind)} blind held-out cells") if len(blind) >= needed else
                     (own, f"all {len(own)} held-out cells at the traces' own context, re-predicted ones included: "
                           f"{len(blind)} blind cells are fewer than the {needed} a central {coverage:.0%} needs"))

    def past(among: Sequence[Mapping[str, Any]]) -> tuple[tuple[float, float], ...]:
        return tuple((d, float(cell["error"])) for cell in among if (d := beyond_recorded(cell)) is not None)

    beyond = past(chosen)
    if len(beyond) < needed:
        beyond = past(own)
        basis += (f"; past the recorded concurrencies, widening as the {len(beyond)} such cells at the traces' own "
                  f"context, re-predicted ones included, missed")
    else:
        basis += f"; past the recorded concurrencies, widening as {len(beyond)} of them missed there"
    return HeldOutErrors(tuple(float(cell["error"]) for cell in chosen), coverage, basis,
                         beyond if len(beyond) >= needed else ())


def speedup_intervals(speedups: pl.DataFrame, errors: HeldOutErrors) -> pl.DataFrame:
    """``speedups`` (batch, k, speedup, and step_source where the prediction has one) with speedup_low and
    speedup_high: the measured speedups each prediction stands for, wider past the largest concurrency whose step was
    measured (``step_source`` extrapolated; ``HeldOutErrors.bounds_at``)."""
    if "step_source" in speedups.columns:
        recorded = speedups.filter(pl.col("step_source") == Source.MEASURED.value)["batch"]
        top = recorded.max() if len(recorded) else None
    else:
        top = None
    batches = sorted(set(speedups["batch"].to_list()))
    at = [errors.bounds_at(math.log2(b / top) if top is not None and b > top else 0.0) for b in batches]
    bounds = pl.DataFrame({"batch": batches, "low": [low for low, _ in at], "high": [high for _, high in at]},
                          schema={"batch": speedups.schema["batch"], "low": pl.Float64, "high": pl.Float64})
    exact = pl.col("k") == 0
    return (speedups.join(bounds, on="batch", how="left").with_columns(
        speedup_low=pl.when(exact).then(1.0).otherwise(pl.col("speedup") / (1.0 + pl.col("high"))),
        speedup_high=pl.when(exact).then(1.0).otherwise(pl.col("speedup") / (1.0 + pl.col("low"))))
        .drop("low", "high"))


def with_intervals(decision: pl.DataFrame, speedups: pl.DataFrame, errors: HeldOutErrors) -> pl.DataFrame:
    """``decision`` (``analysis.decision.recommended_k``) with the recommended k's speedup_low and speedup_high, and
    within_error: the other k compared (acceptance not extrapolated) whose interval reaches the recommended k's, so
    the record of misses cannot tell them apart (empty: none; null where no k is recommended)."""
    compared = speedup_intervals(
        speedups.filter(pl.col("acceptance_source") != Source.EXTRAPOLATED.value).select(
            "batch", "k", "speedup", *(["step_source"] if "step_source" in speedups.columns else [])),
        errors).drop("step_source", strict=False)
    chosen = decision.select("batch", "k").join(compared, on=["batch", "k"], how="left")
    rivals = (compared.join(chosen.select("batch", chosen_k="k", chosen_low="speedup_low"), on="batch")
              .filter((pl.col("k") != pl.col("chosen_k")) & (pl.col("speedup_high") >= pl.col("chosen_low")))
              .group_by("batch").agg(within_error=pl.col("k").sort()))
    return (decision.join(chosen.select("batch", "speedup_low", "speedup_high"), on="batch", how="left")
            .join(rivals, on="batch", how="left")
            .with_columns(within_error=pl.when(pl.col("k").is_null()).then(None)
                          .otherwise(pl.col("within_error").fill_null(pl.lit([], pl.List(pl.Int32)))))
            .sort("batch"))
