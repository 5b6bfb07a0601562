"""The budget frontier the dashboard plots over all layers (``report.payload.budget_frontier``): every layer's budget
curve averaged at every budget, a curve that ended held at its last values."""

from __future__ import annotations

import polars as pl
import pytest

from moetrace.report.payload import budget_frontier


def test_the_frontier_averages_every_layer_at_every_budget_holding_a_layer_past_its_curves_end() -> None:
    """Layer 1's windows read at most 2 experts, layer 2's 4: at budgets 3 and 4 layer 1 keeps, costs and saves
    what it does at 2 (averaging layer 2 alone there would say budget 3 keeps 0.9 of the weight, not 0.95)."""
    curves = pl.DataFrame({
        "k": [2] * 6,
        "layer": [1, 1, 2, 2, 2, 2],
        "budget": [1, 2, 1, 2, 3, 4],
        "coverage": [0.6, 1.0, 0.4, 0.7, 0.9, 1.0],
        "rerouted_share": [0.5, 0.0, 0.9, 0.6, 0.2, 0.0],
        "bytes_saved": [100.0, 0.0, 300.0, 200.0, 100.0, 0.0],
        "experts_read": [1.0, 1.5, 1.0, 2.0, 2.5, 3.0],  # not plotted: left out
    })
    frontier = budget_frontier(curves.lazy())
    assert frontier.columns == ["k", "budget", "coverage", "rerouted_share", "bytes_saved"]
    assert frontier["budget"].to_list() == [1, 2, 3, 4]
    assert frontier["coverage"].to_list() == pytest.approx([0.5, 0.85, 0.95, 1.0])
    assert frontier["rerouted_share"].to_list() == pytest.approx([0.7, 0.3, 0.1, 0.0])
    assert frontier["bytes_saved"].to_list() == pytest.approx([200.0, 100.0, 50.0, 0.0])


def test_a_frontier_of_unpriced_experts_saves_unknown_bytes_and_of_no_curves_is_empty() -> None:
    unpriced = pl.DataFrame({"k": [1, 1], "layer": [1, 1], "budget": [1, 2], "coverage": [0.5, 1.0],
                             "rerouted_share": [0.5, 0.0], "bytes_saved": [None, None]},
                            schema_overrides={"bytes_saved": pl.Float64})
    assert budget_frontier(unpriced.lazy())["bytes_saved"].to_list() == [None, None]
    assert budget_frontier(unpriced.clear().lazy()).is_empty()
