"""The record of how far the prediction misses, and which misses were blind: every held-out cell (a concurrency the
traces were not recorded at, timed closed loop on a GPU) of every committed speedup validation in
``benchmarks/results/``, as ``moetrace/data/prediction-errors.json``, from whose blind cells the report gives each
predicted speedup its interval (``analysis.uncertainty.interval_errors``); beside the cells, what following each
recommended k cost against the measured best k; and the README's one line of GPU evidence.

    python tools/prediction_errors.py            # rewrite the record and the README's line from the results
    python tools/prediction_errors.py --check    # exit 1 where either is not the results' (CI)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RECORD = ROOT / "moetrace" / "data" / "prediction-errors.json"
README = ROOT / "README.md"
SCHEMA = "moetrace-prediction-errors/2"
README_FIGURES = re.compile(
    r"\d+ of \d+ blind held-out cells within 10% \(\S+ to \S+\), \d+ more re-predicted \(\d+ within 10%\)")
# a row that sets a predicted speedup beside a measured one (a budget sweep's rows name no model or drafter)
COMPARED = ("model", "drafter", "concurrency", "k", "predicted_speedup", "measured_speedup")
PROMPT_TOKENS = re.compile(r"--prompt-tokens (\d+)")
ACCEPTANCES = ("drafter", "synthetic")

DEFINITIONS = {
    "error": "(predicted - measured) / measured speedup, at a concurrency the traces were not recorded at",
    "prediction": "blind: the prediction code and the plan (which concurrencies, which k) were committed before the "
                  "GPU ran, and the figures were never predicted again; commit: that prediction code. re-predicted: "
                  "anything else, or nothing to show otherwise; commit: the prediction code that wrote the figures, "
                  "where known. why: the evidence (git history of the file and the code, docs/validation.md)",
    "context": "prompt tokens of the timed and recorded runs (--prompt-tokens); null: the benchmark's built-in "
               "prompts",
    "moved_from": "the context the traces were recorded at, where the prediction moved them to this one "
                  "(--moved-from); null: predicted at the traces' own context",
    "acceptance": "who kept the drafts: the drafter, or vLLM's synthetic rejection sampling at set rates",
    "recorded": "the concurrencies the traces were recorded at (null: the file does not say): past the largest, the "
                "step is extrapolated",
    "regret": "per (results, model, drafter, context, concurrency): the measured throughput of the measured best k "
              "over that of the recommended k, minus 1 (0 where the recommended k is the best); regret_interval: the "
              "best's 95% low over the recommended's 95% high and high over low, minus 1, a bound from the two "
              "intervals rather than a 95% interval of the ratio (both share the k = 0 engine's rounds)",
    "groups_without_recommendation": "groups whose results file sets no recommended k beside the measured best",
}


@dataclass(frozen=True)
class Provenance:
    """Whether a results file's figures were predicted blind, by which prediction code, on what evidence."""

    prediction: str  # "blind" or "re-predicted"
    commit: str | None
    why: str
    moved_from: int | None = None  # the context its moved traces were recorded at


# Read off each file's git history (git log --follow; git log -S on the plans' --timed lists) and docs/validation.md.
PROVENANCE = {
    "speedup-validation-synthetic-chat-h100.json": Provenance(
        "blind", "9184541",
        "plan (h200_next_checks.sh synthetic-chat) and prediction code committed in 9184541 before the GPU ran "
        "(2026-12-07 16:17-16:39 UTC); the GPU ran that commit's tree and compare ran that commit's code"),
    "speedup-validation-closed-loop-40.json": Provenance(
        "blind", "cbe7201",
        "plan committed in benchmarks/lab/h200_next_checks.sh (557537b), naming cbe7201 as its prediction code "
        "(fe8a12e) before the run; a4f898d wrote the figures, its only code change a note's words; never re-predicted"),
    "speedup-validation-closed-loop-96.json": Provenance(
        "re-predicted", "525b544",
        "not shown blind: its plan (96 slots, timed at 2, 8, 32, 96) was first committed with the results (c79710f), "
        "docs/validation.md saying it was written into an uncommitted run script before the run; never predicted "
        "again, by n-gram's prediction code of 525b544 (later commits before the results price model drafters only)"),
    "speedup-validation-closed-loop.json": Provenance(
        "re-predicted", "525b544",
        "525b544 changed the prediction after seeing these cells (B = 4 had missed by 23-63% from a round's drain "
        "steps; prefill held past the recorded concurrencies after seeing B = 48) and wrote the figures with it"),
    "speedup-validation-closed-loop-8-32.json": Provenance(
        "re-predicted", "525b544",
        "decided before 525b544's rule change and predicted after it (docs/validation.md at 525b544)"),
    "speedup-validation-closed-loop-64.json": Provenance(
        "re-predicted", "4478a39",
        "first predicted at f05fda7; 4478a39 kept the k > 0 steps estimated, a rule chosen after seeing its B = 8, "
        "and wrote today's figures"),
    "speedup-validation-closed-loop-32-table256.json": Provenance(
        "re-predicted", "a4f898d",
        "the 32-slot hold-out (as run: 2f3f66a's speedup-validation-closed-loop-32.json) predicted again with the "
        "dense shared experts, the unions of cbe7201 and the H200's 256-token table"),
    "speedup-validation-closed-loop-24-repredicted.json": Provenance(
        "re-predicted", "cbe7201",
        "the 24-slot hold-out (as run: 557537b's speedup-validation-closed-loop-24.json) predicted again with the "
        "unions of 27577f1, then of cbe7201"),
    "speedup-validation-context-256-ngram-h100.json": Provenance(
        "re-predicted", "988bf3b",
        "first predicted at 950295f; the prefill's wait (9f173c2) and the prefill summed per trace (988bf3b) were "
        "fixed after seeing the context cells, and the figures predicted again"),
    "speedup-validation-context-256-ngram-h100-rerun.json": Provenance(
        "re-predicted", "988bf3b",
        "first predicted at b080550, predicted again with the prefill fixes of 9f173c2 and 988bf3b"),
    "speedup-validation-context-8192-ngram-h100.json": Provenance(
        "re-predicted", "988bf3b",
        "first predicted at b080550 (-13 to -4%), predicted again with the prefill fixes of 9f173c2 and 988bf3b, "
        "found in these cells"),
    "speedup-moved-context-8192-ngram-from-256-h100.json": Provenance(
        "re-predicted", "988bf3b",
        "the 256-token traces moved by --context 8192, first predicted at b080550, predicted again with the prefill "
        "fixes of 9f173c2 and 988bf3b", moved_from=256),
    "speedup-validation-eagle3.json": Provenance(
        "re-predicted", "4478a39",
        "first predicted at f05fda7, predicted again with the model drafter's pricing of 847df73 and with 4478a39"),
    "speedup-validation-eagle3-h100.json": Provenance(
        "re-predicted", None,
        "written at 8b3d35f a minute after 7743107 changed the prediction (shared experts as a dense MLP); which "
        "code predicted it is not recorded"),
    "speedup-validation-eagle3-h100-k3.json": Provenance(
        "re-predicted", None,
        "written at 557537b in the same second as 27577f1 changed the prediction (unions); which code predicted it "
        "is not recorded"),
}
UNRECORDED = Provenance("re-predicted", None, "no evidence recorded in tools/prediction_errors.py that the "
                                              "prediction code and plan were committed before the GPU ran")


def provenance(name: str) -> Provenance:
    """What ``PROVENANCE`` says of the results file ``name``; a file named re-predicted is never blind."""
    found = PROVENANCE.get(name, UNRECORDED)
    if found.prediction == "blind" and "repredicted" in name:
        return replace(found, prediction="re-predicted", why=f"named re-predicted; {found.why}")
    return found


def validations(results: Path) -> Iterator[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """Each results file with rows that set a predicted speedup beside a measured one: its name, document and those
    rows."""
    for path in sorted(results.glob("*.json")):
        document = json.loads(path.read_text())
        rows = document.get("rows") if isinstance(document, dict) else None
        compared = [row for row in rows if isinstance(row, dict) and all(key in row for key in COMPARED)] if (
            isinstance(rows, list)) else []
        if compared:
            yield path.name, document, compared


def context_of(row: dict[str, Any]) -> int | None:
    """The prompt tokens the row's runs were given (``--prompt-tokens`` in its command)."""
    found = PROMPT_TOKENS.search(row.get("command") or "")
    return int(found.group(1)) if found else None


def moved_from(name: str, document: dict[str, Any], row: dict[str, Any]) -> int | None:
    """The context the row's traces were recorded at where the prediction moved them (``predicted_from``)."""
    if not document.get("models", {}).get(row["model"], {}).get("predicted_from"):
        return None
    source = provenance(name).moved_from
    if source is None:
        sys.exit(f"{name}: predicted from traces moved to another context; record the context they were recorded at "
                 "in PROVENANCE (tools/prediction_errors.py)")
    return source


def acceptance_of(row: dict[str, Any]) -> str:
    """Who kept the row's drafts: ``acceptance`` as the lab's compare writes it (or ``acceptance_source``); the
    drafter where the row does not say."""
    found = str(row.get("acceptance", row.get("acceptance_source", "drafter")))
    if found not in ACCEPTANCES:
        raise ValueError(f"acceptance {found!r} is none of {ACCEPTANCES}")
    return found


def held_out_cells(results: Path = RESULTS) -> list[dict[str, Any]]:
    """Every predicted row at a concurrency the traces were not recorded at, in every results file."""
    cells = []
    for name, document, rows in validations(results):
        found = provenance(name)
        for row in rows:
            if row.get("held_out_concurrency") and row.get("error") is not None:
                cells.append({"results": name, "model": row["model"], "drafter": row["drafter"],
                              "context": context_of(row), "moved_from": moved_from(name, document, row),
                              "k": row["k"], "concurrency": row["concurrency"],
                              "recorded": document.get("models", {}).get(row["model"], {}).get("recorded"),
                              "acceptance": acceptance_of(row),
                              "error": round(row["error"], 4), "prediction": found.prediction,
                              "commit": found.commit, "why": found.why})
    return cells


def regret_of(name: str, document: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Per (model, drafter, context, concurrency) of one results file: what the recommended k cost against the
    measured best; and how many groups the file gives no recommendation for."""
    decisions = {(d["model"], d["drafter"], d["concurrency"]): d for d in document.get("decisions", [])}
    measured = {(row["model"], row["drafter"], row["concurrency"], row["k"]): row for row in rows}

    def speedup(key: tuple[Any, ...], k: int) -> tuple[float | None, list[float] | None]:
        if k == 0:  # the baseline itself
            return 1.0, [1.0, 1.0]
        row = measured.get((*key, k), {})
        return row.get("measured_speedup"), row.get("measured_ci95")

    regret: list[dict[str, Any]] = []
    without = 0
    groups = {(row["model"], row["drafter"], context_of(row), row["concurrency"]): row for row in rows}
    for (model, drafter, context, concurrency), row in groups.items():
        decision = decisions.get((model, drafter, concurrency), {})
        best_k, recommended_k = decision.get("measured_best_k"), decision.get("recommended_k")
        if best_k is None or recommended_k is None:
            without += 1
            continue
        value: float | None = 0.0
        interval: list[float] | None = [0.0, 0.0]
        if best_k != recommended_k:
            (best, best_ci), (chosen, chosen_ci) = (speedup((model, drafter, concurrency), k)
                                                    for k in (best_k, recommended_k))
            value = round(best / chosen - 1, 4) if best and chosen else None
            interval = ([round(best_ci[0] / chosen_ci[1] - 1, 4), round(best_ci[1] / chosen_ci[0] - 1, 4)]
                        if best_ci and chosen_ci else None)
        regret.append({"results": name, "model": model, "drafter": drafter, "context": context,
                       "moved_from": moved_from(name, document, row), "concurrency": concurrency,
                       "held_out_concurrency": bool(row.get("held_out_concurrency")),
                       "prediction": provenance(name).prediction, "recommended_k": recommended_k,
                       "measured_best_k": best_k, "regret": value, "regret_interval": interval})
    return regret, without


def record(results: Path = RESULTS) -> dict[str, Any]:
    """The record: the held-out cells, the regret of each recommendation, and the groups with none."""
    regret: list[dict[str, Any]] = []
    without = 0
    for name, document, rows in validations(results):
        found, missing = regret_of(name, document, rows)
        regret += found
        without += missing
    return {"schema": SCHEMA, "definitions": DEFINITIONS, "cells": held_out_cells(results), "regret": regret,
            "groups_without_recommendation": without}


def readme_figures(cells: list[dict[str, Any]]) -> str:
    """What the README says of ``cells``: how many blind ones are within 10% and the range of their errors, and how
    many more were re-predicted."""
    blind = [cell["error"] for cell in cells if cell["prediction"] == "blind"]
    again = [cell["error"] for cell in cells if cell["prediction"] != "blind"]

    def within(errors: list[float]) -> int:
        return sum(abs(error) <= 0.10 for error in errors)

    def percent(error: float) -> str:
        return f"{error:+.0%}".replace("-", "\u2212")

    return (f"{within(blind)} of {len(blind)} blind held-out cells within 10% ({percent(min(blind))} to "
            f"{percent(max(blind))}), {len(again)} more re-predicted ({within(again)} within 10%)")


def held_out_rows() -> list[tuple[str, str, str, int, int, float]]:
    """Every row of every results file that sets a prediction beside a measurement at a held-out concurrency, read
    plainly (not through ``held_out_cells``): what the record must hold, the moved-context files included."""
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        document = json.loads(path.read_text())
        found = document.get("rows") if isinstance(document, dict) else None
        for row in found if isinstance(found, list) else []:
            if isinstance(row, dict) and row.get("held_out_concurrency") and row.get("error") is not None:
                rows.append((path.name, row["model"], row["drafter"], row["k"], row["concurrency"],
                             round(row["error"], 4)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 where the record is not the results'.")
    args = parser.parse_args()
    text = json.dumps(record(), indent=1) + "\n"
    cells = json.loads(text)["cells"]
    readme = README.read_text()
    said = README_FIGURES.sub(readme_figures(cells), readme, count=1)
    if args.check:
        missing = sorted(set(held_out_rows()) - {(c["results"], c["model"], c["drafter"], c["k"], c["concurrency"],
                                                  c["error"]) for c in cells})
        if missing or not any(name.startswith("speedup-moved-context") for name, *_ in held_out_rows()):
            sys.exit(f"{RECORD} leaves out held-out rows of {RESULTS}: {missing[:3]}")
        if RECORD.read_text() != text:
            sys.exit(f"{RECORD} is not the record of {RESULTS}: run python tools/prediction_errors.py")
        if said != readme or not README_FIGURES.search(readme):
            sys.exit(f"{README} does not say {readme_figures(cells)!r}: run python tools/prediction_errors.py")
        return
    RECORD.write_text(text)
    README.write_text(said)
    print(f"{RECORD}: {readme_figures(cells)}")


if __name__ == "__main__":
    main()
