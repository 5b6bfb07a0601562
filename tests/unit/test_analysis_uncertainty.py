"""analysis.uncertainty: the report's intervals come from blind cells, or say they do not, and widen past the
recorded concurrencies."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
import pytest

from moetrace.analysis.uncertainty import HeldOutErrors, fewest_errors, interval_errors, speedup_intervals


def cell(error: float, prediction: str, moved_from: int | None = None, concurrency: int = 8) -> dict[str, Any]:
    return {"error": error, "prediction": prediction, "moved_from": moved_from, "concurrency": concurrency,
            "recorded": [1, 16]}


def test_a_central_80_percent_needs_eleven_errors_to_leave_one_beyond_each_bound() -> None:
    # np.quantile's 10% of n sorted errors sits at position 0.1 · (n - 1): 1.0, the second error, at n = 11
    assert fewest_errors(0.8) == 11
    assert np.quantile(np.arange(11.0), 0.1) == 1.0
    assert np.quantile(np.arange(10.0), 0.1) < 1.0  # with ten, the bound lies below the second error
    assert fewest_errors(0.5) == 5  # 25% at 0.25 · 4 = 1


def test_enough_blind_cells_give_the_intervals_alone() -> None:
    blind = [i / 100 for i in range(-5, 6)]  # eleven
    cells = ([cell(e, "blind") for e in blind] + [cell(0.5, "re-predicted")]
             + [cell(0.9, "blind", moved_from=256)])
    errors = interval_errors(cells)
    assert errors.errors == tuple(blind)
    assert errors.basis.startswith("the 11 blind held-out cells")
    assert errors.bounds() == pytest.approx((-0.04, 0.04))


def test_too_few_blind_cells_fall_back_to_every_cell_at_its_own_context_and_say_so() -> None:
    cells = ([cell(0.05, "blind"), cell(-0.08, "blind"), cell(0.2, "re-predicted"), cell(-0.1, "re-predicted")]
             + [cell(0.75, "re-predicted", moved_from=256)])
    errors = interval_errors(cells)
    assert errors.errors == (0.05, -0.08, 0.2, -0.1)  # the moved cell left out
    assert errors.basis.startswith("all 4 held-out cells at the traces' own context, re-predicted ones included")
    assert "2 blind cells are fewer than the 11 a central 80% needs" in errors.basis


def test_past_the_recorded_concurrencies_the_bounds_widen_linearly_in_log_distance() -> None:
    """Eleven cells at concurrency 8 (within 1..16) miss by -5..+5%; eleven at 64 (two doublings past 16) by
    0..+20%: at 64 the bounds are those cells' own, at 256 (four doublings) twice as far from the base, at 16 and
    below the base; the lower bound never narrows."""
    within = [cell(i / 100, "blind") for i in range(-5, 6)]
    past = [cell(2 * i / 100, "blind", concurrency=64) for i in range(0, 11)]
    errors = interval_errors(within + past)
    assert len(errors.beyond) == 11 and all(distance == 2.0 for distance, _ in errors.beyond)
    base_low, base_high = np.quantile([c["error"] for c in within + past], [0.1, 0.9])
    far_low, far_high = 0.02, 0.18  # np.quantile of 0, 0.02, ..., 0.20 at 10% and 90%
    assert errors.bounds_at(0.0) == pytest.approx((base_low, base_high))
    assert errors.bounds_at(2.0) == pytest.approx((base_low, far_high))  # far_low lies inside: not narrowed
    assert errors.bounds_at(4.0)[1] == pytest.approx(base_high + 2 * (far_high - base_high))
    assert far_low > base_low


def test_a_step_extrapolated_past_the_largest_measured_concurrency_gets_the_wider_interval() -> None:
    errors = HeldOutErrors(tuple(i / 100 for i in range(-5, 6)), 0.8, "hand-made",
                           tuple((2.0, 2 * i / 100) for i in range(0, 11)))
    speedups = pl.DataFrame({"batch": [1, 16, 64, 64], "k": [2, 2, 0, 2], "speedup": [1.5, 1.5, 1.0, 1.5],
                             "step_source": ["measured", "measured", "extrapolated", "extrapolated"]})
    rows = {(r["batch"], r["k"]): r for r in speedup_intervals(speedups, errors).to_dicts()}
    low, high = errors.bounds()
    assert rows[(16, 2)]["speedup_low"] == pytest.approx(1.5 / (1 + high))
    assert rows[(64, 2)]["speedup_low"] == pytest.approx(1.5 / (1 + 0.18))  # two doublings past 16
    assert rows[(64, 2)]["speedup_high"] == pytest.approx(1.5 / (1 + low))
    assert rows[(64, 0)]["speedup_low"] == rows[(64, 0)]["speedup_high"] == 1.0  # k = 0 is exact
