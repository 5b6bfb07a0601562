"""The offline HTML dashboard: one self-contained file with plotly.js inlined, drawn from the report's payload alone
(``payload.report_payload``, what ``report --json`` prints) embedded in the page, and redrawn there when the k and
layer pickers change (``templates/dashboard.html``, its figures' script ``templates/dashboard-script.html``). Where
it is written: ``dashboard_path``; a file there that is not a dashboard is the user's (``refuse_overwrite``).

The page opens on the decision (``headline``, ``first_screen``): per drafter, the recommended k over concurrency and
context, and the speedup against concurrency per k with the recommended k's interval; the tables follow, grouped.

Every figure carries its source (``analysis.sources``): a table cell or plotted point shows the source's mark
beside the number and names the source in its hover text; the legend of the marks is generated from ``MARKS``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2
import plotly.offline  # type: ignore[import-untyped]

from moetrace.analysis.decision import may_pay_more
from moetrace.analysis.sources import MARKS, Source
from moetrace.errors import refuse_existing
from moetrace.report.cells import SYNTHETIC_LEGEND, SYNTHETIC_MARK
from moetrace.trace.reader import is_partition_root, run_path

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
# in every page's head (templates/dashboard.html): a file that holds it is a dashboard moetrace wrote
DASHBOARD_MARK = b'<meta name="generator" content="moetrace report">'

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


def max_k(payload: Mapping[str, Any]) -> int:
    """The largest k on the curves (the payload's growth rows run from k=0 to --max-k)."""
    ks = [int(row["k"]) for run in payload.get("runs", []) for row in run.get("growth") or []]
    return max([*ks, int(payload["k"])])


def _recommended(row: Mapping[str, Any]) -> str:
    """A recommended k as the headline says it: "k = 3+" where a larger k may pay more, "none" where none is."""
    if row.get("k") is None:
        return "no recommendation"
    if row["k"] == 0:
        return "k = 0 (no speculation)"
    return f"k = {row['k']}{'+' if may_pay_more(row) else ''}"


def decided(decision: Mapping[str, Any]) -> str:
    """One drafter's decision in words: "kimi-k2 ngram: k = 3 at 1–32, k = 1 at 128 requests" (concurrencies that
    share a recommendation run together, at the context the trace ran at)."""
    groups: list[tuple[str, list[int]]] = []
    for row in sorted(decision.get("per_batch") or [], key=lambda row: int(row["batch"])):
        said = _recommended(row)
        if groups and groups[-1][0] == said:
            groups[-1][1].append(int(row["batch"]))
        else:
            groups.append((said, [int(row["batch"])]))
    label, drafter = str(decision["label"]), str(decision["drafter"])
    name = label if drafter in label else f"{label} {drafter}"
    if not groups:
        return f"{name}: no concurrency looked at"
    spans = [f"{said} at {batches[0] if len(batches) == 1 else f'{batches[0]}–{batches[-1]}'}"
             for said, batches in groups]
    said = f"{name}: {', '.join(spans)} request{'s' if groups[-1][1] != [1] else ''}"
    recorded = decision.get("context") or {}
    if decision.get("by_context") and recorded.get("mean_tokens") is not None:  # the heatmap shows other contexts
        said += f" at the recorded context ({recorded['mean_tokens']:,.0f} tokens)"
    return said


def headline(payload: Mapping[str, Any]) -> str:
    """What the page's title and heading say: each drafter's decision, or, with none, the runs and the k."""
    decisions = payload.get("decision") or []
    if decisions:
        return "; ".join(decided(decision) for decision in decisions)
    labels = ", ".join(str(run["label"]) for run in payload.get("runs") or [])
    return f"{labels}: figures at k={payload['k']} (no recommendation: no prediction)"


def _context_label(tokens: float | None, recorded: bool) -> str:
    if tokens is None:
        return "as recorded"
    return f"{tokens:,.0f} tokens (recorded)" if recorded else f"{tokens:,.0f} tokens"


def first_screen(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per decision, what the first screen draws: ``cells`` (the recommended k per concurrency and context, each a
    decision row with its ``context_label``: the rows of ``--context`` where it was given, else one row at the
    recorded context), ``contexts`` (their labels, shortest first), ``batches``, ``lines`` (the run's predicted
    speedup per concurrency and k at the recorded context), ``band`` (per concurrency, the recommended k, none where
    there is none, its speedup and interval) and ``crossovers`` (the decision's, where it found one)."""
    runs = {str(run["label"]): run for run in payload.get("runs") or []}
    screens = []
    for decision in payload.get("decision") or []:
        by_context = decision.get("by_context")
        if by_context:
            cells = [{**row, "context_label": _context_label(row["context"], recorded=False),
                      "may_pay_more": may_pay_more(row)} for row in by_context["per_batch"]]
            contexts = [_context_label(context, recorded=False)
                        for context in sorted({row["context"] for row in by_context["per_batch"]})]
        else:
            recorded = decision.get("context") or {}
            label = _context_label(recorded.get("mean_tokens"), recorded=True)
            cells = [{**row, "context_label": label, "may_pay_more": may_pay_more(row)}
                     for row in decision["per_batch"]]
            contexts = [label]
        run = runs.get(str(decision["label"])) or {}
        prediction = run.get("prediction") or {}
        band = [{**{key: row.get(key) for key in ("batch", "k", "speedup", "speedup_low", "speedup_high",
                                                  "speedup_source")}, "may_pay_more": may_pay_more(row)}
                for row in sorted(decision["per_batch"], key=lambda row: int(row["batch"]))]
        screens.append({
            "label": decision["label"],
            "drafter": decision["drafter"],
            "said": decided(decision),
            "batches": sorted({int(row["batch"]) for row in cells}),
            "contexts": contexts,
            "cells": cells,
            "lines": [{key: row.get(key) for key in ("batch", "k", "speedup", "union_source", "acceptance_source")}
                      for row in prediction.get("per_batch") or []],
            "band": band,
            "crossovers": [found for found in (decision.get("crossover") or {}).values() if found],
        })
    return screens


def render_dashboard(payload: Mapping[str, Any]) -> str:
    """The dashboard page for ``payload`` (the dict ``report_payload`` returns, or the same loaded back from JSON)."""
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined
    )
    environment.globals.update(marks=marks, describe=describe, least_direct=least_direct)
    template = environment.get_template("dashboard.html")
    legend = source_legend()
    screens = first_screen(payload)
    return template.render(
        plotly_js=plotly.offline.get_plotlyjs(),
        payload=payload,
        legend=legend,
        larger_k_mark=MARKS[Source.EXTRAPOLATED],
        larger_k=LARGER_K,
        headline=headline(payload),
        screens=screens,
        page={
            "k": payload["k"],
            "max_k": max_k(payload),
            "coverage": payload["coverage_target"],
            "sources": {entry["source"]: entry for entry in legend},
            "runs": payload["runs"],
            "budget_sweep": payload.get("budget_sweep"),
            "first_screen": screens,
            "larger_k": LARGER_K,
            "synthetic": {"mark": SYNTHETIC_MARK, "legend": SYNTHETIC_LEGEND},
        },
    )


def dashboard_path(traces: tuple[Path, ...], output: Path | None) -> Path:
    """``output``, else ``TRACE/report.html`` for one trace; beside an always-on recording's root, not in it (a live
    root holds partitions only: its disk cap drops partitions and counts nothing else)."""
    if output is not None:
        return output
    if len(traces) == 1:
        run = run_path(traces[0])
        if is_partition_root(run):
            return run.parent.resolve() / f"{run.resolve().name}.report.html"
        return run / "report.html" if run.is_dir() else Path(f"{run.name}.report.html")
    return Path("-vs-".join(path.name for path in traces)[:120] + ".report.html")


def refuse_overwrite(path: Path, force: bool) -> None:
    """A dashboard moetrace wrote is derived from the traces: rebuilt. Any other file is the user's: kept unless
    ``force``."""
    try:
        with path.open("rb") as existing:
            ours = DASHBOARD_MARK in existing.read(4096)
    except OSError:
        ours = False
    if not ours:
        refuse_existing(path, force)
