"""The offline HTML dashboard: one self-contained file with plotly.js inlined, drawn from the summary JSON alone
(``summary.summary_json``, what ``report --json`` prints) embedded in the page, and redrawn there when the k and
layer pickers change.

Every figure carries its source (``analysis.sources``): a table cell or plotted point shows the source's mark
beside the number and names the source in its hover text; the legend of the marks is generated from ``MARKS``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2
import plotly.offline  # type: ignore[import-untyped]

from moetrace.analysis.sources import MARKS, Source

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"

LARGER_K = (f"{MARKS[Source.EXTRAPOLATED]} after a recommended k: a larger k may pay more, predicted on extrapolated "
            "acceptance (record a larger k to know)")


def _known(sources: Iterable[str | None]) -> list[Source]:
    """The distinct sources named, most direct first."""
    return sorted({Source(value) for value in sources if value is not None}, key=lambda source: source.rank)


def marks(sources: Iterable[str | None]) -> str:
    """The marks of ``sources`` (one per distinct source, most direct first; measured has none)."""
    return "".join(dict.fromkeys(source.mark for source in _known(sources)))


def least_direct(sources: Iterable[str | None]) -> str:
    """The least direct of ``sources`` (what a figure resting on all of them is), "" when there are none."""
    known = _known(sources)
    return known[-1].value if known else ""


def describe(named: Mapping[str, str | None]) -> str:
    """Hover text naming the source of each input of a figure: "tokens per step: extrapolated (…)"."""
    return "; ".join(f"{what + ': ' if what else ''}{value} ({Source(value).meaning})"
                     for what, value in named.items() if value is not None)


def source_legend() -> list[dict[str, Any]]:
    """One entry per source, in order of directness, from ``MARKS``."""
    return [{"source": source.value, "mark": source.mark, "meaning": source.meaning, "rank": source.rank}
            for source in Source]


def max_k(summary: Mapping[str, Any]) -> int:
    """The largest k on the curves (the summary's growth rows run from k=0 to --max-k)."""
    ks = [int(row["k"]) for run in summary.get("runs", []) for row in run.get("growth") or []]
    return max([*ks, int(summary["k"])])


def render_dashboard(summary: Mapping[str, Any]) -> str:
    """The dashboard page for ``summary`` (the dict ``summary_json`` returns, or the same loaded back from JSON)."""
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined
    )
    environment.globals.update(marks=marks, describe=describe, least_direct=least_direct)
    template = environment.get_template("dashboard.html")
    legend = source_legend()
    return template.render(
        plotly_js=plotly.offline.get_plotlyjs(),
        summary=summary,
        legend=legend,
        larger_k_mark=MARKS[Source.EXTRAPOLATED],
        larger_k=LARGER_K,
        page={
            "k": summary["k"],
            "max_k": max_k(summary),
            "coverage": summary["coverage_target"],
            "sources": {entry["source"]: entry for entry in legend},
            "runs": summary["runs"],
            "budget_sweep": summary.get("budget_sweep"),
            "by_context": [{"label": decision["label"], "drafter": decision["drafter"], **decision["by_context"]}
                           for decision in summary.get("decision") or [] if decision.get("by_context")],
        },
    )
