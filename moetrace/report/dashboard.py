"""The offline HTML dashboard: one self-contained file with plotly.js inlined, drawn from the summary JSON alone
(``summary.summary_json``, what ``report --json`` prints) embedded in the page, and redrawn there when the k and
layer pickers change.

Every figure carries its source (``analysis.sources``): a table cell or plotted point shows the source's mark
beside the number and names the source in its hover text; the legend of the marks is generated from ``MARKS``."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2
import plotly.offline  # type: ignore[import-untyped]

from moetrace.analysis.sources import MARKS, Source

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"

MEANINGS = {
    Source.MEASURED: "read from the trace's own rows at the k (and concurrency) it ran",
    Source.ESTIMATED: "drawn from the trace's own windows, combined as the trace did not run them",
    Source.COUNTERFACTUAL: "windows of consecutive accepted tokens: a k the trace did not record",
    Source.LOWER_BOUND: "fewer windows than asked for: the union of all of them",
    Source.EXTRAPOLATED: "continued past what was measured (acceptance past the largest recorded k)",
    Source.GIVEN: "stated by the user (--acceptance)",
    Source.UNIFORM: "uniformly random routing, not the trace's",
}
LARGER_K = (f"{MARKS[Source.EXTRAPOLATED]} after a recommended k: a larger k may pay more, predicted on extrapolated "
            "acceptance (record a larger k to know)")
_RANK = {source.value: source.rank for source in Source}


def source_of(value: object) -> Source | None:
    """The ``Source`` a summary field names: its value, or text starting with one ("given 0.7 per draft")."""
    if isinstance(value, Source):
        return value
    if not isinstance(value, str):
        return None
    for source in Source:
        if value == source.value or value.startswith(source.value + " "):
            return source
    return None


def _names(sources: Iterable[object]) -> list[str]:
    """Distinct source names, most direct first (unknown text after every known source)."""
    found = {str(value.value if isinstance(value, Source) else value) for value in sources if value is not None}
    return sorted(found, key=lambda name: (_RANK.get(name, len(_RANK)), name))


def marks(sources: Iterable[object]) -> str:
    """The marks of ``sources`` (one per distinct source, most direct first; measured has none)."""
    return "".join(dict.fromkeys(MARKS[s] for s in map(source_of, _names(sources)) if s is not None))


def least_direct(sources: Iterable[object]) -> str:
    """The least direct of ``sources`` (what a figure resting on all of them is), "" when there are none."""
    names = _names(sources)
    return names[-1] if names else ""


def describe(named: Mapping[str, object]) -> str:
    """Hover text naming the source of each input of a figure: "tokens per step: extrapolated (…)"."""
    parts = []
    for what, value in named.items():
        if value is None:
            continue
        source = source_of(value)
        meaning = f" ({MEANINGS[source]})" if source is not None and source in MEANINGS else ""
        parts.append(f"{what + ': ' if what else ''}{value}{meaning}")
    return "; ".join(parts)


def _canonical(node: Any) -> Any:
    """``node`` with every ``source`` / ``*_source`` string that starts with a source's name reduced to that name."""
    if isinstance(node, list):
        return [_canonical(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if (key == "source" or key.endswith("_source")) and isinstance(value, str):
            source = source_of(value)
            out[key] = source.value if source is not None else value
        else:
            out[key] = _canonical(value)
    return out


def normalise(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``summary`` in which every figure's source is a ``Source`` value where it names one, every per-k
    prediction row has a ``routing_source`` (its ``union_source`` where it has no other), and every per-batch and
    decision row an ``acceptance_source`` (older summaries: from the boolean ``extrapolated``, or the per-k row of
    the same k)."""
    data: dict[str, Any] = _canonical(copy.deepcopy(dict(summary)))
    per_k_of: dict[str, dict[int, dict[str, Any]]] = {}
    per_batch_of: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
    for run in data.get("runs", []):
        prediction = run.get("prediction") or {}
        for row in [*(prediction.get("per_k") or []), prediction.get("at_k") or {}]:
            if row.get("routing_source") is None and row.get("union_source") is not None:
                row["routing_source"] = row["union_source"]  # the per-k rows name it either way
        per_k = {int(row["k"]): row for row in prediction.get("per_k") or []}
        for row in prediction.get("per_batch") or []:
            if row.get("acceptance_source") is None:
                if row.get("extrapolated"):
                    row["acceptance_source"] = Source.EXTRAPOLATED.value
                else:
                    row["acceptance_source"] = (per_k.get(int(row["k"])) or {}).get("acceptance_source") or \
                        Source.MEASURED.value
        per_k_of[run["label"]] = per_k
        per_batch_of[run["label"]] = {(int(row["batch"]), int(row["k"])): row
                                      for row in prediction.get("per_batch") or []}
    for decision in data.get("decision", []):
        for row in decision.get("per_batch", []):
            if row.get("acceptance_source") is None and row.get("k") is not None:
                same = (per_batch_of.get(decision["label"], {}).get((int(row["batch"]), int(row["k"])))
                        or per_k_of.get(decision["label"], {}).get(int(row["k"])) or {})
                row["acceptance_source"] = same.get("acceptance_source") or Source.MEASURED.value
    return data


def source_legend() -> list[dict[str, Any]]:
    """One entry per source, in order of directness, from ``MARKS``."""
    return [{"source": source.value, "mark": mark, "meaning": MEANINGS.get(source, ""), "rank": source.rank}
            for source, mark in sorted(MARKS.items(), key=lambda item: item[0].rank)]


def max_k(summary: Mapping[str, Any]) -> int:
    """The largest k on the curves (the summary's growth rows run from k=0 to --max-k)."""
    ks = [int(row["k"]) for run in summary.get("runs", []) for row in run.get("growth") or []]
    return max([*ks, int(summary["k"])])


def render_dashboard(summary: Mapping[str, Any]) -> str:
    """The dashboard page for ``summary`` (the dict ``summary_json`` returns, or the same loaded back from JSON)."""
    data = normalise(summary)
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined
    )
    environment.globals.update(marks=marks, describe=describe, least_direct=least_direct)
    template = environment.get_template("dashboard.html")
    legend = source_legend()
    return template.render(
        plotly_js=plotly.offline.get_plotlyjs(),
        summary=data,
        legend=legend,
        larger_k_mark=MARKS[Source.EXTRAPOLATED],
        larger_k=LARGER_K,
        page={
            "k": data["k"],
            "max_k": max_k(data),
            "coverage": data["coverage_target"],
            "sources": {entry["source"]: entry for entry in legend},
            "runs": data["runs"],
        },
    )
