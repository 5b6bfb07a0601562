"""The dashboard in headless Chromium, offline: no console errors, every figure drawn, the k picker redraws, every
figure's source marked; and the dashboard rendered from the JSON payload alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from headless_page import browser_page, cell_point, column_labels, open_groups
from moetrace.analysis.sources import MARKS, Source
from moetrace.cli import main
from moetrace.report.dashboard import render_dashboard
from trace_builder import Model, decode_tokens, verify_tokens, write_trace

SWEEP_K = (0, 1, 2)  # the sweep records these k
ASKED_K = 4  # the report is for a k past them: figures at it are counterfactual, acceptance at it extrapolated


@pytest.fixture
def dashboard(tmp_path: Path) -> Path:
    paths = []
    for index, name in enumerate(("<script>alert(1)</script>", "second")):
        model = Model(name=name, random_weights=index == 0, layers=(1, 2, 3))
        tokens = verify_tokens(np.random.default_rng(index), model, requests=3, steps=15, k=3, accept_prob=0.6,
                               variable_drafts=True)
        paths.append(str(write_trace(tmp_path / f"run{index}", tokens, model, k=3)))
    output = tmp_path / "dashboard.html"
    result = CliRunner().invoke(main, ["report", *paths, "--k", "3", "-o", str(output)])
    assert result.exit_code == 0, result.output
    return output


@pytest.fixture
def sweep_report(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A TP-only sweep recorded at k=0, 1, 2 with drafts accepted often, reported at k=4: the dashboard and the
    payload JSON ``report --json`` printed while writing it."""
    model = Model(layers=(1, 2, 3))
    for k in SWEEP_K:
        rng = np.random.default_rng(10 + k)
        tokens = (decode_tokens(rng, model, requests=3, steps=20) if k == 0 else
                  verify_tokens(rng, model, requests=3, steps=20, k=k, accept_prob=0.9))
        write_trace(tmp_path / "sweep" / f"k{k}", tokens, model, k=k)
    output = tmp_path / "sweep.html"
    result = CliRunner().invoke(main, ["report", str(tmp_path / "sweep"), "--k", str(ASKED_K), "--json",
                                       "-o", str(output)])
    assert result.exit_code == 0, result.output
    return output, json.loads(result.stdout)


@pytest.mark.browser
def test_dashboard_renders_offline_and_reacts_to_k(dashboard: Path) -> None:
    with browser_page(dashboard) as (page, errors):
        figures = page.eval_on_selector_all(".figure", "nodes => nodes.map(n => n.id)")
        # per run: expert load, unique experts layer × k, predicted speedup batch × k (the shipped preset predicts
        # without flags, so the prediction figure is there too); one of them by context; per drafter, the first
        # screen's recommended k and speedup by concurrency
        assert len(figures) == 7 + 2 * 3 + 2 * 2
        decision_rows = page.eval_on_selector_all("#decision tr[data-batch]", "rows => rows.map(r => r.innerText)")
        assert len(decision_rows) == 2 * 4, decision_rows  # 2 runs × concurrencies 1, 8, 32, 128
        for figure in figures:
            page.wait_for_selector(f"#{figure} svg.main-svg", timeout=15_000)
            drawn = page.evaluate(
                """id => { const div = document.getElementById(id);
                           const points = div.querySelectorAll('.trace, .hm, image, .point, path.js-line').length;
                           return {traces: (div.data || []).length, points: points}; }""",
                figure,
            )
            assert drawn["traces"] > 0 and drawn["points"] > 0, (figure, drawn)
            shot = page.locator(f"#{figure}").screenshot()
            assert len(shot) > 8_000, f"{figure} looks blank ({len(shot)} bytes of PNG)"

        def plotted(figure: str) -> object:
            return page.evaluate(f"document.getElementById('{figure}').data.map(t => [t.x, t.y])")

        before = plotted("fig-unique-at-k"), plotted("fig-budget")
        page.select_option("#k-picker", "6")
        page.wait_for_function("document.getElementById('fig-unique-at-k').layout.title.text.endsWith('k=6')")
        after = plotted("fig-unique-at-k"), plotted("fig-budget")
        assert before[0] != after[0] and before[1] != after[1]
        page.select_option("#layer-picker", "2")
        page.wait_for_function("document.getElementById('fig-growth').layout.title.text.endsWith('layer 2')")
    assert errors == []


@pytest.mark.browser
def test_every_figure_carries_its_source_and_the_step_plot_is_readable(
        sweep_report: tuple[Path, dict[str, Any]]) -> None:
    path, payload = sweep_report
    run = payload["runs"][0]
    assert run["recorded_k"] == list(SWEEP_K) and run["source_at_k"] == "counterfactual"
    assert run["tp"] == 1 and run["ep"] == 1 and all(row["ep_bytes"] == 0 for row in run["step_bytes"])
    may_pay = [row for decision in payload["decision"] for row in decision["per_batch"]
               if row["k"] is not None and row["larger_k_may_pay"]]
    assert may_pay, "the sweep should leave a larger k predicted to pay (acceptance 0.9, extrapolated past k=2)"
    counterfactual, extrapolated = MARKS[Source.COUNTERFACTUAL], MARKS[Source.EXTRAPOLATED]

    with browser_page(path) as (page, errors):
        for figure in page.eval_on_selector_all(".figure", "nodes => nodes.map(n => n.id)"):
            page.wait_for_selector(f"#{figure} svg.main-svg", timeout=15_000)
        open_groups(page)

        # the legend of the marks: one entry per source, from MARKS
        legend = page.eval_on_selector_all("#source-legend li", "items => items.map(i => i.innerText)")
        assert len(legend) == len(MARKS)
        for source, mark in MARKS.items():
            assert any(item.startswith(mark or "(none)") and source.value in item for item in legend), (source, legend)

        # (a) a counterfactual cell: the per-k table's unique experts at k=4 ...
        cell = page.locator(f"#per-k-0 tr[data-k='{ASKED_K}'] td").nth(2)
        assert cell.inner_text().endswith(counterfactual)
        assert "counterfactual" in (cell.get_attribute("title") or "")
        # ... and the layer × k heatmap: every cell at k=4 shows the mark, and hovering one names the source
        heatmap = "fig-unique-heatmap-0"
        point = cell_point(page, heatmap, ASKED_K, 0)
        labels = column_labels(page, heatmap, point)
        assert len(labels) == 3 and all(label.endswith(counterfactual) for label in labels), labels
        recorded = cell_point(page, heatmap, SWEEP_K[-1], 0)
        labels_at_recorded = column_labels(page, heatmap, recorded)
        assert labels_at_recorded and not any(counterfactual in label for label in labels_at_recorded)
        page.mouse.move(point["x"], point["y"])
        page.wait_for_selector(f"#{heatmap} .hoverlayer .hovertext", timeout=5_000)
        hover = page.eval_on_selector_all(f"#{heatmap} .hoverlayer .hovertext",
                                          "nodes => nodes.map(n => n.textContent)")
        assert len(hover) == 1 and f"k={ASKED_K}" in hover[0] and f"counterfactual {counterfactual}" in hover[0], hover

        # (b) the decision table: a recommended k past which a larger (extrapolated) k may pay is "k+"
        cells = page.eval_on_selector_all(
            "#decision td.k", "cells => cells.map(c => ({text: c.innerText, title: c.title}))")
        assert len(cells) == len(payload["decision"][0]["per_batch"])
        for row, shown in zip(payload["decision"][0]["per_batch"], cells):
            if row["k"] is None:  # no recommendation at this concurrency
                assert shown["text"] == "none" and row["status"] in shown["title"], shown
            elif row["larger_k_may_pay"]:
                assert shown["text"] == f"{row['k']}{extrapolated}" and "extrapolated" in shown["title"], shown
            elif row["k_at_sweep_edge"]:  # the largest k the sweep holds: hover says how to look past it
                assert shown["text"] == f"{row['k']}{extrapolated}" and shown["title"] == row["sweep_edge_note"], shown
            else:
                assert shown["text"] == str(row["k"]), shown
        # ... and under it, the crossover per drafter as the JSON says it
        crossovers = page.eval_on_selector_all(
            "p.crossover", "ps => ps.map(p => ({kind: p.dataset.kind, text: p.innerText}))")
        expected = [(kind, found["says"]) for decision in payload["decision"]
                    for kind, found in decision["crossover"].items() if found]
        assert [(shown["kind"], shown["text"].split(", ", 1)[1]) for shown in crossovers] == expected, crossovers
        assert expected and expected[0][0] == "predicted"
        # ... and the policies replayed on the trace, with their verdict, as the JSON has them
        policies = payload["decision"][0]["policies"]
        shown_rows = page.eval_on_selector_all(
            "table.policies tr[data-policy]",
            "rows => rows.map(r => [...r.querySelectorAll('td')].map(c => c.innerText))")
        assert [(int(cells[0]), cells[1], cells[5]) for cells in shown_rows] == [
            (row["batch"], row["policy"], f"{row['vs_table']:.3f}") for row in policies["rows"]]
        assert policies["rows"] and page.eval_on_selector_all(
            "p.policy-verdict", "ps => ps.map(p => p.innerText)") == policies["verdict"]
        # ... and extrapolated acceptance is marked in the per-k table (tokens per step at k=4)
        tokens = page.locator(f"#per-k-0 tr[data-k='{ASKED_K}'] td").nth(1)
        assert tokens.inner_text().endswith(extrapolated) and "extrapolated" in (tokens.get_attribute("title") or "")

        # (c) the step-time plot: its plotting area at least 250 px tall, the legend clear of every plotting area,
        # every tick label inside the figure
        geometry = page.evaluate(
            """() => { const div = document.getElementById('fig-prediction');
                       const box = n => { const r = n.getBoundingClientRect();
                                          return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
                       return {height: div._fullLayout.yaxis._length,
                               legend: box(div.querySelector('g.legend')),
                               areas: [...div.querySelectorAll('.draglayer .nsewdrag')].map(box),
                               figure: box(div.querySelector('svg.main-svg')),
                               ticks: [...div.querySelectorAll('.xtick text, .ytick text, .y2tick text, .x2tick text')]
                                        .map(box)}; }"""
        )
        assert geometry["height"] >= 250, geometry["height"]
        legend_box = geometry["legend"]
        assert legend_box["right"] - legend_box["left"] > 0
        for area in geometry["areas"]:
            overlap = (min(area["right"], legend_box["right"]) > max(area["left"], legend_box["left"])
                       and min(area["bottom"], legend_box["bottom"]) > max(area["top"], legend_box["top"]))
            assert not overlap, (area, legend_box)
        outer = geometry["figure"]
        assert geometry["ticks"]
        for tick in geometry["ticks"]:
            assert (tick["left"] >= outer["left"] - 0.5 and tick["right"] <= outer["right"] + 0.5
                    and tick["top"] >= outer["top"] - 0.5 and tick["bottom"] <= outer["bottom"] + 0.5), tick

        # (d) a series that is all zero is not plotted: no all-to-all bytes (no EP), nor all-reduce (tp=1)
        names = page.eval_on_selector_all("#fig-bytes .legendtext", "nodes => nodes.map(n => n.textContent)")
        assert "expert weights (all ranks)" in names and not any(
            "all-to-all" in name or "all-reduce" in name for name in names), names
    # (e) no console errors
    assert errors == []


def test_the_dashboard_renders_from_the_payload_alone(sweep_report: tuple[Path, dict[str, Any]]) -> None:
    path, payload = sweep_report
    payload.pop("dashboard")  # added after the dashboard was written
    loaded = json.loads(json.dumps(payload))
    page = render_dashboard(loaded)
    assert page == path.read_text(encoding="utf-8")  # the same page as the one rendered from the live payload
    assert "counterfactual" in page and f"{MARKS[Source.COUNTERFACTUAL]}</span>" in page
    run = loaded["runs"][0]
    assert {"layers", "expert_load", "budget_curves"} <= set(run)
    assert len(run["expert_load"]) == len(run["layers"]) == 3


@pytest.mark.browser
def test_under_ep_the_dashboard_shows_the_held_out_placements_as_the_json_has_them(tmp_path: Path) -> None:
    model = Model(layers=(1, 2))
    tokens = verify_tokens(np.random.default_rng(3), model, requests=3, steps=16, k=3, accept_prob=0.6)
    trace = write_trace(tmp_path / "verify-k3", tokens, model, k=3)
    output = tmp_path / "ep.html"
    result = CliRunner().invoke(main, ["report", str(trace), "--k", "3", "--ep", "2", "--json", "-o", str(output)])
    assert result.exit_code == 0, result.output
    placement = json.loads(result.stdout)["runs"][0]["placement"]
    with browser_page(output) as (page, errors):
        open_groups(page)
        shown = page.eval_on_selector_all("#placement-0 tr[data-placement]",
                                          "rows => rows.map(r => Array.from(r.cells, c => c.innerText))")
        verdict = page.inner_text("p.verdict")
    assert shown == [[row["placement"], f"{row['ranks_touched']:.2f}", f"{row['busiest_rank_experts']:.2f}",
                      f"{row['balancedness']:.3f}"] for row in placement["rows"]]
    assert [row[0] for row in shown] == ["linear", "vLLM EPLB", "moetrace"] and verdict == placement["verdict"]
    assert errors == []


def test_a_budget_sweeps_dashboard_shows_its_table_and_frontier_as_the_json_has_them(tmp_path: Path) -> None:
    """Two runs of one workload, unbudgeted and at 8 experts per step; their greedy outputs differ in 2 of 12
    tokens, so the budget's agreement is 10/12."""
    model = Model(layers=(1, 2))
    outputs = {"none": [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], "8": [[1, 2, 0, 4], [5, 6, 7, 8], [9, 9, 9, 0]]}
    for seed, (name, generated) in enumerate(outputs.items()):
        tokens = verify_tokens(np.random.default_rng(seed), model, requests=3, steps=16, k=3, accept_prob=0.6)
        trace = write_trace(tmp_path / "sweep" / f"budget-{name}", tokens, model, k=3)
        written = json.loads((trace / "manifest.json").read_text())
        written["workload"] = {"batch_size": 3}
        if name != "none":
            written["capture"]["budget"] = {"scope": "step", "per_layer": {"1": 8, "2": 8}}
        (trace / "manifest.json").write_text(json.dumps(written))
        (trace / "outputs.jsonl").write_text("".join(json.dumps({"request_id": str(i), "output_token_ids": ids}) + "\n"
                                                     for i, ids in enumerate(generated)))
    output = tmp_path / "sweep.html"
    result = CliRunner().invoke(main, ["report", str(tmp_path / "sweep"), "--k", "3", "--min-agreement", "0.8",
                                       "--json", "-o", str(output)])
    assert result.exit_code == 0, result.output
    sweep = json.loads(result.stdout)["budget_sweep"]
    assert [(row["budget"], row["limit"], row["agreement"]) for row in sweep["rows"]] == [
        ("none", "none", 1.0), ("8", "8/step", 10 / 12)]
    with browser_page(output) as (page, errors):
        shown = page.eval_on_selector_all("#budget-sweep tr[data-budget]",
                                          "rows => rows.map(r => Array.from(r.cells, c => c.innerText))")
        points = page.evaluate("() => { const d = document.getElementById('fig-budget-frontier').data[0];"
                               " return [Array.from(d.x), Array.from(d.y), Array.from(d.text)]; }")
    assert [row[:2] + row[4:5] + row[7:] for row in shown] == [
        [row["budget"] + (" ◀" if row["budget"] == sweep["best"] else ""), row["limit"], f"{row['agreement']:.3f}",
         {None: "-", True: "yes"}[row["binds"]]] for row in sweep["rows"]]
    assert points[0] == [row["agreement"] for row in sweep["rows"]]
    assert points[1] == pytest.approx([row["predicted"] for row in sweep["rows"]])
    assert sum("◀" in text for text in points[2]) == (sweep["best"] is not None)
    assert errors == []


@pytest.mark.browser
def test_the_context_heatmap_shows_the_recommended_k_per_concurrency_and_context_as_the_json_has_it(
        tmp_path: Path) -> None:
    model = Model(layers=(1, 2))
    tokens = verify_tokens(np.random.default_rng(4), model, requests=3, steps=16, k=3, accept_prob=0.6)
    trace = write_trace(tmp_path / "verify-k3", tokens, model, k=3)
    written = json.loads((trace / "manifest.json").read_text())
    written["model"].update(kv_bytes_per_token=70_272, max_position_embeddings=262_144)  # Kimi-K2's MLA
    (trace / "manifest.json").write_text(json.dumps(written))
    output = tmp_path / "context.html"
    result = CliRunner().invoke(main, ["report", str(trace), "--k", "3", "--context", "1024,131072", "--batch",
                                       "1,8,32", "--json", "-o", str(output)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["decision"][0]["by_context"]["per_batch"]
    with browser_page(output) as (page, errors):
        page.wait_for_selector("#fig-decision-k-0 svg.main-svg", timeout=15_000)
        plotted = page.evaluate("(() => { const t = document.getElementById('fig-decision-k-0').data[0];"
                                " return {x: t.x, y: t.y, z: t.z, text: t.text}; })()")
        basis = page.inner_text("p.context-basis")
    assert basis == json.loads(result.stdout)["decision"][0]["by_context"]["attention_basis"]
    assert "the calibration timed no attention" in basis  # the shipped H200 preset: KV bytes at copy bandwidth
    # the first screen's heatmap: requests per step across, the contexts asked for up the side
    assert plotted["x"] == ["1", "8", "32"] and plotted["y"] == ["1,024 tokens", "131,072 tokens"]
    want = {(str(row["batch"]), f"{row['context']:,} tokens"): row["k"] for row in rows}
    assert {(x, y): plotted["z"][i][j] for i, y in enumerate(plotted["y"]) for j, x in enumerate(plotted["x"])} == want
    # each recommended k written as the terminal writes it: "+" where a larger k may pay more
    marked = {(str(row["batch"]), f"{row['context']:,} tokens"):
              f"k={row['k']}{'+' if row['larger_k_may_pay'] or row['k_at_sweep_edge'] else ''}"
              for row in rows if row["k"] is not None}
    assert {(x, y): plotted["text"][i][j].split("<br>")[0] for i, y in enumerate(plotted["y"])
            for j, x in enumerate(plotted["x"]) if (x, y) in marked} == marked
    # 32 requests of 131,072 tokens: 295 GB a rank, past the H200's memory
    assert want[("32", "131,072 tokens")] is None
    assert errors == []


FIRST_SCREEN_PX = 900  # of the 1000 px tall viewport: what a reader sees before scrolling, browser chrome aside


def _first_screen(page: Any) -> dict[str, Any]:
    """The first Plotly plot in document order: its id, where it is drawn, what it drew, and the tables before it."""
    found: dict[str, Any] = page.evaluate(
        """() => { const plot = document.querySelector('.js-plotly-plot'); const box = plot.getBoundingClientRect();
                   const before = [...document.querySelectorAll('table')].filter(
                       t => plot.compareDocumentPosition(t) & Node.DOCUMENT_POSITION_PRECEDING);
                   return {id: plot.id, top: box.top, bottom: box.bottom, left: box.left, right: box.right,
                           drawn: plot.querySelectorAll('svg.main-svg .hm, svg.main-svg image').length,
                           traces: (plot.data || []).length, tables_before: before.length}; }""")
    return found


@pytest.mark.browser
def test_the_dashboard_opens_on_the_decision_as_pictures(dashboard: Path) -> None:
    """Two drafters: in a 1400x1000 viewport the first plot is each drafter's recommended k, drawn within the first
    900 px with no table before it, side by side on one colour scale; the source legend follows the pictures."""
    with browser_page(dashboard) as (page, errors):
        for figure in ("fig-decision-k-0", "fig-decision-k-1", "fig-decision-speedup-0", "fig-decision-speedup-1"):
            page.wait_for_selector(f"#{figure} svg.main-svg", timeout=15_000)
        first = _first_screen(page)
        assert first["id"] == "fig-decision-k-0" and first["traces"] == 1 and first["drawn"] > 0, first
        assert 0 <= first["top"] and first["bottom"] <= FIRST_SCREEN_PX, first
        assert first["tables_before"] == 0, first
        boxes = page.evaluate(
            """ids => ids.map(id => { const b = document.getElementById(id).getBoundingClientRect();
                                      return {top: b.top, bottom: b.bottom, left: b.left, right: b.right}; })""",
            ["fig-decision-k-0", "fig-decision-k-1", "fig-decision-speedup-0", "fig-decision-speedup-1"])
        k0, k1, speed0, speed1 = boxes
        assert k0["top"] == k1["top"] and k0["right"] <= k1["left"], boxes  # side by side
        assert speed0["top"] >= k0["bottom"] and speed0["top"] < FIRST_SCREEN_PX, boxes  # the speedups begin on screen
        scales = page.evaluate(
            """() => [0, 1].map(i => { const t = document.getElementById('fig-decision-k-' + i).data[0];
                                        return [t.zmin, t.zmax, t.colorscale]; })""")
        assert scales[0] == scales[1], scales  # one colour scale for both drafters
        # the legend of the marks sits after the pictures, just before the table whose cells carry the marks
        order = page.evaluate(
            """() => { const at = s => document.querySelector(s);
                       const follows = (a, b) => !!(at(a).compareDocumentPosition(at(b))
                                                    & Node.DOCUMENT_POSITION_FOLLOWING);
                       return [follows('#decision-figures', '#source-legend'),
                               follows('#source-legend', '#decision')]; }""")
        assert order == [True, True]
        # the page names the runs and what was decided
        heading = page.inner_text("h1")
        assert page.title().startswith(heading)
        for label in ("run0", "run1"):
            assert f"{label} ngram: k = " in heading, heading
    assert errors == []


@pytest.mark.browser
def test_the_first_screen_draws_the_recommended_k_and_speedups_as_the_json_has_them(
        sweep_report: tuple[Path, dict[str, Any]]) -> None:
    """Without --context, the heatmap is one row at the recorded context: its cells are ``report --json``'s
    recommended k per concurrency, each written with its speedup and interval; the speedup plot draws the run's
    predicted speedup per k and concurrency, and the recommended k's interval as a band."""
    path, payload = sweep_report
    decision, run = payload["decision"][0], payload["runs"][0]
    rows = sorted(decision["per_batch"], key=lambda row: row["batch"])
    with browser_page(path) as (page, errors):
        page.wait_for_selector("#fig-decision-speedup-0 svg.main-svg", timeout=15_000)
        first = _first_screen(page)
        heatmap = page.evaluate("(() => { const t = document.getElementById('fig-decision-k-0').data[0];"
                                " return {x: t.x, y: t.y, z: t.z, text: t.text}; })()")
        speedups = page.evaluate("document.getElementById('fig-decision-speedup-0').data.map("
                                 "t => ({meta: t.meta, x: Array.from(t.x), y: Array.from(t.y)}))")
        heading = page.inner_text("h1")
    assert first["id"] == "fig-decision-k-0" and first["bottom"] <= FIRST_SCREEN_PX and first["tables_before"] == 0
    assert heatmap["x"] == [str(row["batch"]) for row in rows]
    assert heatmap["y"] == [f"{decision['context']['mean_tokens']:,.0f} tokens (recorded)"]
    assert heatmap["z"] == [[row["k"] for row in rows]]
    for row, text in zip(rows, heatmap["text"][0]):
        plus = "+" if row["larger_k_may_pay"] or row["k_at_sweep_edge"] else ""
        assert text.startswith(f"k={row['k']}{plus}<br>{row['speedup']:.2f}×"), text
        assert text.endswith(f"<br>{row['speedup_low']:.2f}–{row['speedup_high']:.2f}×"), text
    by_meta = {trace["meta"]: trace for trace in speedups}
    for k in sorted({row["k"] for row in run["prediction"]["per_batch"]}):
        mine = sorted((row for row in run["prediction"]["per_batch"] if row["k"] == k), key=lambda row: row["batch"])
        assert by_meta[f"k={k}"]["x"] == [row["batch"] for row in mine]
        assert by_meta[f"k={k}"]["y"] == pytest.approx([row["speedup"] for row in mine])
    band = by_meta["band"]
    assert band["y"] == pytest.approx([row["speedup_high"] for row in rows]
                                      + [row["speedup_low"] for row in rows][::-1])
    assert by_meta["recommended"]["y"] == pytest.approx([row["speedup"] for row in rows])
    # the heading says it: one k at every concurrency here, past which a larger k may pay
    assert {(row["k"], row["k_at_sweep_edge"] or row["larger_k_may_pay"]) for row in rows} == {(rows[0]["k"], True)}
    assert heading == (f"sweep {decision['drafter']}: k = {rows[0]['k']}+ at {rows[0]['batch']}–{rows[-1]['batch']} "
                       "requests")
    assert errors == []


@pytest.mark.browser
def test_the_first_screen_marks_the_crossover_and_leaves_a_concurrency_without_a_recommendation_blank(
        sweep_report: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """The payload's crossover, where it crosses, is a line at its (interpolated) concurrency on the speedup plot;
    a concurrency with no recommendation is an empty cell named "none", and the band breaks around it."""
    _, payload = sweep_report
    payload.pop("dashboard")
    decision = payload["decision"][0]
    rows = sorted(decision["per_batch"], key=lambda row: row["batch"])
    gap = rows[1]
    gap.update(k=None, status="too few request-steps", best_k=2)
    crossing = {**decision["crossover"]["predicted"], "status": "crosses", "batch": 50.0,
                "says": "predicted: no k pays above about 50 requests per step"}
    decision["crossover"]["predicted"] = crossing
    path = tmp_path / "crossing.html"
    path.write_text(render_dashboard(payload), encoding="utf-8")
    with browser_page(path) as (page, errors):
        page.wait_for_selector("#fig-decision-speedup-0 svg.main-svg", timeout=15_000)
        drawn = page.evaluate(
            """() => { const div = document.getElementById('fig-decision-speedup-0');
                       const heatmap = document.getElementById('fig-decision-k-0').data[0];
                       return {shapes: div.layout.shapes.map(s => [s.x0, s.x1]),
                               notes: div.layout.annotations.map(a => a.text),
                               band: div.data.find(t => t.meta === 'band').x,
                               z: heatmap.z, text: heatmap.text}; }""")
        caption = page.eval_on_selector_all("#decision-figures .crossover-note", "ps => ps.map(p => p.innerText)")
    assert [50.0, 50.0] in drawn["shapes"] and any("no k pays above ~50" in note for note in drawn["notes"])
    assert caption == [f"crossover, {crossing['says']}"]
    assert drawn["z"][0][1] is None and drawn["text"][0][1] == "none"
    assert None in drawn["band"] and gap["batch"] not in drawn["band"]
    assert errors == []
