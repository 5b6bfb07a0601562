"""analysis.uncertainty.interval_errors: the report's intervals come from blind cells, or say they do not."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from moetrace.analysis.uncertainty import fewest_errors, interval_errors


def cell(error: float, prediction: str, moved_from: int | None = None) -> dict[str, Any]:
    return {"error": error, "prediction": prediction, "moved_from": moved_from}


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
    assert errors.basis == "the 11 blind held-out cells"
    assert errors.bounds() == pytest.approx((-0.04, 0.04))


def test_too_few_blind_cells_fall_back_to_every_cell_at_its_own_context_and_say_so() -> None:
    cells = ([cell(0.05, "blind"), cell(-0.08, "blind"), cell(0.2, "re-predicted"), cell(-0.1, "re-predicted")]
             + [cell(0.75, "re-predicted", moved_from=256)])
    errors = interval_errors(cells)
    assert errors.errors == (0.05, -0.08, 0.2, -0.1)  # the moved cell left out
    assert errors.basis.startswith("all 4 held-out cells at the traces' own context, re-predicted ones included")
    assert "2 blind cells are fewer than the 11 a central 80% needs" in errors.basis
