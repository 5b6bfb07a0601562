"""k-choosing policies replayed on a sweep's trace against the static table the decision gives
(``analysis.policies``), at the report's predicted steps."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from moetrace.analysis.policies import compare_policies, policy_verdict
from moetrace.report.inputs import Run


@dataclass(frozen=True)
class PolicyReplay:
    """``analysis.policies.compare_policies``'s rows, their verdict per concurrency, and the k of the trace
    replayed."""

    rows: pl.DataFrame
    verdict: list[str]
    trace_k: int


def replayed_policies(run: Run, speedups: pl.DataFrame, decision: pl.DataFrame | None,
                      max_k: int) -> PolicyReplay | None:
    """``analysis.policies.compare_policies`` on the sweep's trace at its largest k (up to ``max_k``), at each
    concurrency the decision priced (the static table: its k, or the k its figures would pick), at the predicted
    steps; None without drafts."""
    deepest = max((trace for trace in run.traces if trace.k <= max_k), key=lambda trace: trace.k)
    if deepest.k == 0 or decision is None:
        return None
    table = {int(row["batch"]): int(row["k"] if row["k"] is not None else row["best_k"])
             for row in decision.to_dicts() if row["k"] is not None or row["best_k"] is not None}
    step_ms = {int(str(batch)): dict(zip(part["k"].to_list(), part["step_ms"].to_list()))
               for (batch,), part in speedups.group_by("batch") if int(str(batch)) in table}
    # a replay prices every k up to the trace's: not where nothing predicted one (no windows of it to read)
    unpriced = {batch: f"no predicted step at k={', '.join(map(str, missing))}" for batch, at in step_ms.items()
                if (missing := [k for k in range(deepest.k + 1) if k not in at])}
    if deepest.manifest.spec.adaptive:  # a replay takes each request-step's accepted drafts as a fixed k's prefix
        unpriced = {batch: f"the k={deepest.k} trace's adaptive schedule chose each request-step's drafts: its "
                           "request-steps are no fixed k's (the adaptive schedule's own table sets it beside the "
                           "static table)" for batch in table}
    steps = deepest.steps()
    rows = compare_policies(steps, deepest.k, step_ms, {b: k for b, k in table.items() if b not in unpriced})
    requests = int(steps.select(pl.col("request").n_unique()).collect().item())
    return PolicyReplay(rows, policy_verdict(rows, sorted(table), requests, unpriced), deepest.k)
