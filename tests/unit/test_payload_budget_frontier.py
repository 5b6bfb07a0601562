"""The budget frontier the dashboard plots over all layers (``report.payload.budget_frontier``): every layer's budget
curve averaged at every budget, a curve that ended held at its last values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


FRONTIER_IN_A_CHILD = """
import sys
import numpy as np, polars as pl
from moetrace.report.payload import budget_frontier
rng = np.random.default_rng(7)
layers, budgets = 61, 200
rows = 3 * layers * budgets
curves = pl.DataFrame({"k": np.repeat([1, 2, 3], layers * budgets),
                       "layer": np.tile(np.repeat(np.arange(layers), budgets), 3),
                       "budget": np.tile(np.arange(1, budgets + 1), 3 * layers), "coverage": rng.random(rows) / 3,
                       "rerouted_share": rng.random(rows) / 7, "bytes_saved": rng.random(rows) * 1e6 / 3})
budget_frontier(curves.lazy()).write_parquet(sys.argv[1])
"""


def test_the_frontier_is_the_same_to_the_last_digit_on_any_number_of_threads(tmp_path: Path) -> None:
    # a float sum depends on its order, which Polars' parallel group-by changes with the thread count (seen: the
    # Ray report, its partitions on other processes, against the one-machine one)
    frames = []
    for threads in (1, 8):
        out = tmp_path / f"frontier-{threads}.parquet"
        subprocess.run([sys.executable, "-c", FRONTIER_IN_A_CHILD, str(out)], check=True,
                       env={**os.environ, "POLARS_MAX_THREADS": str(threads)})
        frames.append(pl.read_parquet(out))
    assert frames[0].height == 3 * 200 and frames[0].equals(frames[1])
