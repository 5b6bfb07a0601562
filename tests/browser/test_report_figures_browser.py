"""The figures a reader of a speculative-decoding report expects, each plotting the JSON payload's own numbers:
unique experts per layer against k beside the uniform bound, bytes per k split into weights, all-reduce and
all-to-all, acceptance by draft position (marked where vLLM set it), and the expert budget frontier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from headless_page import browser_page
from moetrace.cli import main
from moetrace.trace.manifest import amend_manifest
from trace_builder import Model, decode_tokens, verify_tokens, write_trace

SET_RATES = [0.8, 0.5]  # what vLLM's synthetic rejection sampling kept the k = 2 drafts at
# growth_overview's columns (each the mean over layers) and the growth rows they average
GROWTH = {"measured_request": ("measured", "request"), "counterfactual": ("counterfactual", "request"),
          "measured_batch": ("measured", "batch")}
FIGURES = ("fig-growth", "fig-bytes", "fig-acceptance", "fig-budget")


@pytest.fixture
def synthetic_report(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A sweep at k = 0 and 2 whose k = 2 drafts vLLM kept at ``SET_RATES``, reported at k = 2 as run on TP = 2 and
    EP = 2 (so that both collectives move bytes): the dashboard and the JSON payload printed while writing it."""
    model = Model(layers=(1, 2, 3))
    write_trace(tmp_path / "sweep" / "k0", decode_tokens(np.random.default_rng(0), model, requests=3, steps=20),
                model, k=0)
    verified = write_trace(tmp_path / "sweep" / "k2", verify_tokens(np.random.default_rng(2), model, requests=3,
                                                                    steps=20, k=2, accept_prob=0.7), model, k=2)
    spec = json.loads((verified / "manifest.json").read_text())["spec"]
    amend_manifest(verified, spec={**spec, "acceptance": {"set_by": "synthetic", "rates": SET_RATES}})
    output = tmp_path / "synthetic.html"
    result = CliRunner().invoke(main, ["report", str(tmp_path / "sweep"), "--k", "2", "--tp", "2", "--ep", "2",
                                       "--json", "-o", str(output)])
    assert result.exit_code == 0, result.output
    return output, json.loads(result.stdout)


def _plotted(page: Any) -> dict[str, Any]:
    """Per figure of ``FIGURES``: its title and, per series (its ``meta``), the x and y it drew and its name."""
    plotted: dict[str, Any] = page.evaluate(
        """ids => Object.fromEntries(ids.map(id => { const div = document.getElementById(id);
               return [id, {title: div.layout.title.text, series: Object.fromEntries(div.data.map(
                   t => [t.meta.series, {x: Array.from(t.x), y: Array.from(t.y), name: t.name}]))}]; }))""",
        list(FIGURES))
    return plotted


@pytest.mark.browser
def test_the_growth_bytes_acceptance_and_budget_figures_plot_the_payloads_numbers(
        synthetic_report: tuple[Path, dict[str, Any]]) -> None:
    path, payload = synthetic_report
    run = payload["runs"][0]
    with browser_page(path) as (page, errors):
        for figure in FIGURES:
            page.wait_for_selector(f"#{figure} svg.main-svg", timeout=15_000)
        over_layers = _plotted(page)
        page.select_option("#layer-picker", "2")
        page.wait_for_function("document.getElementById('fig-budget').layout.title.text.endsWith('layer 2')")
        at_layer = _plotted(page)
    assert errors == []

    # unique experts per layer against k: over all layers the payload's means, at one layer its rows; each beside
    # the uniform bound
    growth, overview = over_layers["fig-growth"]["series"], run["growth_overview"]
    for column, (source, scope) in GROWTH.items():
        drawn = [row for row in overview if row[column] is not None]
        assert growth[column]["x"] == [row["k"] for row in drawn], column
        assert growth[column]["y"] == [row[column] for row in drawn], column
        rows = sorted((row for row in run["growth"]
                       if (row["layer"], row["source"], row["scope"]) == (2, source, scope)), key=lambda row: row["k"])
        assert at_layer["fig-growth"]["series"][column]["y"] == [row["unique_experts"] for row in rows], column
    assert growth["uniform_bound"]["y"] == [row["uniform_bound"] for row in overview]
    assert growth["uniform_bound"]["name"].startswith("uniform bound")

    # bytes per k: weights, all-reduce and all-to-all, each the payload's step bytes
    bytes_drawn = over_layers["fig-bytes"]["series"]
    for column in ("expert_weight_bytes", "busiest_rank_weight_bytes", "allreduce_bytes", "ep_bytes"):
        assert bytes_drawn[column]["x"] == [row["k"] for row in run["step_bytes"]]
        assert bytes_drawn[column]["y"] == [row[column] for row in run["step_bytes"]]
        assert all(value > 0 for value in bytes_drawn[column]["y"]), column
    assert bytes_drawn["allreduce_bytes"]["name"].startswith("all-reduce")
    assert bytes_drawn["ep_bytes"]["name"].startswith("all-to-all")

    # acceptance by draft position: the measured rates, marked § as set by vLLM, the rates it was set to beside them
    acceptance = over_layers["fig-acceptance"]
    assert run["acceptance_set_by"] == [{"k": 2, "set_by": "synthetic", "rates": SET_RATES}]
    rates = [row for row in run["acceptance_by_position"] if row["k"] == 2]
    assert acceptance["series"]["k=2"]["x"] == [row["draft_pos"] for row in rates] == [1, 2]
    assert acceptance["series"]["k=2"]["y"] == [row["acceptance_rate"] for row in rates]
    assert acceptance["series"]["k=2"]["name"].endswith("§")
    assert acceptance["series"]["set k=2"]["y"] == SET_RATES
    assert "§ acceptance set by vLLM's synthetic rejection sampling" in acceptance["title"]

    # the expert budget frontier at k = 2: over all layers the payload's frontier, at one layer its curve
    frontier = next(row for row in run["budget_frontier"] if row["k"] == 2)
    curve = next(row for row in run["budget_curves"] if (row["k"], row["layer"]) == (2, 2))
    for drawn, expected in ((over_layers, frontier), (at_layer, curve)):
        for column in ("coverage", "rerouted_share"):
            series = drawn["fig-budget"]["series"][column]
            assert series["x"] == expected["budget"] and series["y"] == expected[column], column
    assert frontier["budget"][-1] >= curve["budget"][-1] and frontier["coverage"] != curve["coverage"]
