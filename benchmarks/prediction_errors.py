"""The record of how far the prediction misses: every held-out cell of the committed speedup validations
(``benchmarks/results/speedup-validation-*.json``: concurrencies nobody recorded, timed closed loop on a GPU), as
``moetrace/data/prediction-errors.json``, from which the report gives each predicted speedup its interval, and the
README's one line of GPU evidence.

    python benchmarks/prediction_errors.py            # rewrite the record and the README's line from the results
    python benchmarks/prediction_errors.py --check    # exit 1 where either is not the results' (CI)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RECORD = ROOT / "moetrace" / "data" / "prediction-errors.json"
README = ROOT / "README.md"
README_FIGURES = re.compile(r"\d+ of \d+ held-out cells within 10% \(\S+ to \S+\)")


def held_out_cells(results: Path = RESULTS) -> dict[str, Any]:
    cells = []
    for path in sorted(results.glob("speedup-validation-*.json")):
        for row in json.loads(path.read_text()).get("rows", []):
            if row.get("held_out_concurrency") and row.get("error") is not None:
                cells.append({"results": path.name, "model": row["model"], "drafter": row["drafter"],
                              "k": row["k"], "concurrency": row["concurrency"], "error": round(row["error"], 4)})
    return {"schema": "moetrace-prediction-errors/1",
            "error": "(predicted - measured) / measured speedup, at a concurrency the traces were not recorded at",
            "cells": cells}


def readme_figures(cells: list[dict[str, Any]]) -> str:
    """What the README says of ``cells``: how many are within 10%, and the range of the errors."""
    errors = [cell["error"] for cell in cells]
    within = sum(abs(error) <= 0.10 for error in errors)

    def percent(error: float) -> str:
        return f"{error:+.0%}".replace("-", "\u2212")

    return f"{within} of {len(cells)} held-out cells within 10% ({percent(min(errors))} to {percent(max(errors))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 where the record is not the results'.")
    args = parser.parse_args()
    text = json.dumps(held_out_cells(), indent=1) + "\n"
    cells = json.loads(text)["cells"]
    readme = README.read_text()
    said = README_FIGURES.sub(readme_figures(cells), readme, count=1)
    if args.check:
        if RECORD.read_text() != text:
            sys.exit(f"{RECORD} is not the record of {RESULTS}: run python benchmarks/prediction_errors.py")
        if said != readme or not README_FIGURES.search(readme):
            sys.exit(f"{README} does not say {readme_figures(cells)!r}: run python benchmarks/prediction_errors.py")
        return
    RECORD.write_text(text)
    README.write_text(said)
    print(f"{RECORD}: {readme_figures(cells)}")


if __name__ == "__main__":
    main()
