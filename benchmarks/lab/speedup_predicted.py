"""What ``moetrace report`` predicts for a sweep, as ``bench_speedup_validation.py compare`` reads it: the report run
as a user runs it (a subprocess, its JSON), its rows and decision by concurrency, and a row's speedup recomputed
with another prefill or acceptance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def report_json(sweep: Path, calibration: Path, scratch: Path, k0_sync: Path | None,
                batches: list[int], context: int | None = None) -> dict[str, Any] | None:
    """``moetrace report --profile measured --batch <batches>`` as a user runs it (a subprocess): its JSON, or None
    (and why, printed) where it failed. ``k0_sync``: the k=0 trace with async scheduling off, for a drafter vLLM
    runs that way; ``context``: also ``--context <context>``."""
    command = [sys.executable, "-m", "moetrace", "report", str(sweep), "--calibration", str(calibration),
               "--profile", "measured", "--batch", ",".join(map(str, batches)), "--json",
               "-o", str(scratch / f"{sweep.name}.html"), "--force",
               *(["--k0-sync", str(k0_sync)] if k0_sync is not None else []),
               *(["--context", str(context)] if context is not None else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"{sweep.name}: moetrace report failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def predicted_rows(report: dict[str, Any] | None,
                   context: int | None = None) -> tuple[dict[tuple[int, int], Any], dict[tuple[int, int], Any]]:
    """The report's predicted rows and its check against the recorded steps, each by (batch, k); empty where the
    report failed or predicted nothing. ``context``: the rows moved there (``--context``), and no check (its steps
    ran at another context)."""
    prediction = report["runs"][0]["prediction"] if report is not None else None
    if prediction is None:
        return {}, {}
    if context is not None:
        return ({(r["batch"], r["k"]): r for r in decision_of(report)["by_context"]["speedups"]
                 if r["context"] == context}, {})
    return ({(r["batch"], r["k"]): r for r in prediction["per_batch"]},
            {(r["batch"], r["k"]): r for r in prediction["against_trace"]})


def decision_of(report: dict[str, Any]) -> dict[str, Any]:
    """The report's decision for its (one) run."""
    run = report["runs"][0]
    decisions = run.get("decision") or [d for d in report.get("decision", []) if d.get("label") == run.get("label")]
    return decisions if isinstance(decisions, dict) else (decisions[0] if decisions else {})


def recommended(report: dict[str, Any] | None, context: int | None = None) -> dict[int, dict[str, Any]]:
    """The report's decision by concurrency (at ``context``, where given): its row (``k`` null where it recommends
    none, ``status`` says why)."""
    if report is None:
        return {}
    decision = decision_of(report)
    if context is not None:
        return {int(r["batch"]): r for r in decision["by_context"]["per_batch"] if r["context"] == context}
    return {int(r["batch"]): r for r in decision.get("per_batch", [])}


def moved_with(row: dict[str, Any], row0: dict[str, Any], own: dict[str, Any], own0: dict[str, Any],
               acceptance: bool) -> float:
    """The speedup of a moved prediction's ``row`` (its k=0 row ``row0``) as the report computes it, a step's time
    per token gained plus the prefill a token carries, with that prefill (and with ``acceptance``, the tokens a step
    gains) taken from the rows ``own``/``own0`` predicted from the run's own traces at its own context: how much of
    the moved prediction's miss each term the move keeps as recorded explains."""
    from moetrace.analysis.cost import end_to_end_speedup

    return end_to_end_speedup(row0["step_ms"], 1.0, own0["prefill_ms_per_token"] or 0.0, row["step_ms"],
                              (own if acceptance else row)["tokens_per_step"], own["prefill_ms_per_token"] or 0.0)


def in_span(row: dict[str, Any], row0: dict[str, Any], share: float, share0: float) -> float:
    """The speedup of a predicted ``row`` (its k=0 row ``row0``) as the report computes it, with the prefill a token
    carries scaled to the closed loop's span (``share``/``share0``: ``span_prefill_shares`` at k and at k = 0)."""
    from moetrace.analysis.cost import end_to_end_speedup

    prefill0, prefill = row0["prefill_ms_per_token"] or 0.0, row["prefill_ms_per_token"] or 0.0
    return float(end_to_end_speedup(row0["step_ms"], 1.0, share0 * prefill0, row["step_ms"], row["tokens_per_step"],
                                    share * prefill))
