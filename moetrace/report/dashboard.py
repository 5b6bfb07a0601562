"""The offline HTML dashboard: one self-contained file with plotly.js inlined, the summary data embedded as JSON,
and figures drawn (and redrawn when the k and layer pickers change) from that data in the page."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import jinja2
import plotly.offline  # type: ignore[import-untyped]
import polars as pl

from moetrace.report.summary import Options, RunAnalysis, growth_overview, notes

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


def _columns(frame: pl.DataFrame) -> dict[str, list[Any]]:
    return {name: frame[name].to_list() for name in frame.columns}


def _load_matrix(analysis: RunAnalysis) -> dict[str, Any]:
    num_experts = analysis.shape.num_experts
    layers = sorted(analysis.load["layer"].unique().to_list())
    matrix = [[0] * num_experts for _ in layers]
    index = {layer: row for row, layer in enumerate(layers)}
    for layer, expert, picks in analysis.load.iter_rows():
        matrix[index[layer]][expert] = picks
    return {"layers": layers, "z": matrix}


def _run_data(analysis: RunAnalysis) -> dict[str, Any]:
    """What the page plots for one TRACE argument; strings from the trace are HTML-escaped for Plotly's text."""
    model = analysis.manifest["model"]
    growth = analysis.growth.select("layer", "k", "source", "scope", "unique_experts", "uniform_bound")
    return {
        "label": html.escape(analysis.run.label),
        "model": html.escape(str(model.get("name"))),
        "layers": sorted(analysis.growth["layer"].unique().to_list()),
        "growth": _columns(growth),
        "overview": _columns(growth_overview(analysis.growth)),
        "load": _load_matrix(analysis),
        "bytes": _columns(analysis.step_bytes),
        "acceptance": _columns(analysis.acceptance_by_position),
        "budgets": _columns(analysis.budget_curves.select("k", "layer", "budget", "coverage")),
        "prediction": None if analysis.prediction is None else _columns(analysis.prediction.select(
            "k", "tokens_per_step", "moe_ms", "allreduce_ms", "attention_ms", "other_ms", "rest_ms", "drafting_ms",
            "scheduling_ms", "sampling_ms", "step_ms", "speedup")),
        "prediction_mode": None if analysis.prediction_basis is None else html.escape(
            str(analysis.prediction_basis["mode"])),
    }


def render_dashboard(analyses: list[RunAnalysis], options: Options, summary: dict[str, Any]) -> str:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined
    )
    template = environment.get_template("dashboard.html")
    return template.render(
        plotly_js=plotly.offline.get_plotlyjs(),
        summary=summary,
        runs=[{"analysis": a, "notes": notes(a, options.k)} for a in analyses],
        data={
            "k": options.k,
            "max_k": options.max_k,
            "coverage": options.coverage,
            "runs": [_run_data(analysis) for analysis in analyses],
        },
    )

