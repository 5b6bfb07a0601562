"""``moetrace report`` on a budget sweep (a folder of ``budget-<name>/`` runs written by ``moetrace record --budget
12,16,none``): per budget, acceptance, tokens per step, agreement with the unbudgeted greedy outputs, measured and
predicted speedup, and the budget that pays most at the agreement asked for."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl
from rich import box
from rich.console import Console
from rich.table import Table

from moetrace.analysis.acceptance import acceptance_totals, step_times
from moetrace.analysis.budgets import UNBUDGETED, best_budget, binds, greedy_agreement, largest_groups
from moetrace.errors import UserError
from moetrace.report.analyse import RunAnalysis
from moetrace.trace.reader import Trace, holds_run

BUDGET_PREFIX = "budget-"


def budget_runs(path: Path) -> list[Path]:
    """The runs of a budget sweep folder (``budget-<name>/``: the unbudgeted one, then by budget); [] for anything
    else."""
    if not path.is_dir():
        return []
    runs = [child for child in sorted(path.iterdir())
            if child.is_dir() and child.name.startswith(BUDGET_PREFIX) and holds_run(child)]
    if runs and path / f"{BUDGET_PREFIX}{UNBUDGETED}" not in runs:
        raise UserError(f"{path}: a budget sweep needs its {BUDGET_PREFIX}{UNBUDGETED} run (the router's own routing) "
                        "to compare with; record it with --budget ...,none")
    def order(run: Path) -> tuple[bool, int, str]:  # the unbudgeted run, then budgets by size, then files by name
        name = run.name.removeprefix(BUDGET_PREFIX)
        return name != UNBUDGETED, int(name) if name.isdigit() else 1 << 30, name

    return sorted(runs, key=order)


def recorded_concurrency(trace: Trace) -> int:
    """The requests per step the run was recorded at (``moetrace record --batch-size``; else its steps' median)."""
    if trace.manifest.batch_size:
        return trace.manifest.batch_size
    return max(1, round(float(step_times(trace.steps())["requests_per_step"].item() or 1)))


def greedy_outputs(trace: Trace) -> pl.LazyFrame:
    """vLLM's outputs beside the trace (``outputs.jsonl``) as one row per generated token."""
    path = trace.path / "outputs.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the run's outputs ({exc.strerror}): agreement needs them") from None
    outputs = [json.loads(line) for line in lines]
    return pl.LazyFrame({"request": [o["request_id"] for o in outputs],
                         "token": [o["output_token_ids"] for o in outputs]}).explode("token").with_columns(
        position=pl.int_range(pl.len()).over("request"))


def recorded_on(trace: Trace) -> str:
    """The device the trace's engine ran on: its GPU where the rows came off one, else the host's CPU."""
    host = trace.manifest.host
    return host.gpus[0] if trace.manifest.capture.on_gpu and host.gpus else host.cpu or "the recording's host"


def describe_budget(trace: Trace) -> str:
    budget = trace.manifest.capture.budget
    if budget is None:
        return "none"
    sizes = sorted(set(budget.per_layer.values()))
    per_layer = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    return f"{per_layer}/{budget.scope}"


def budget_sweep_section(analyses: Sequence[RunAnalysis], min_agreement: float) -> dict[str, Any]:
    """The sweep's table (one row per budget, the unbudgeted first) and its best budget per concurrency.
    ``analyses``: one per budget run, at the same k, predicted at the concurrency the sweep was recorded at."""
    reference = analyses[0].run.primary
    k = reference.k
    batch = recorded_concurrency(reference)
    reference_outputs = greedy_outputs(reference)
    reference_rate: float | None = None
    largest: dict[str, dict[int, int]] = {}  # the unbudgeted run's largest verifying group per layer, per scope
    rows = []
    for analysis in analyses:
        trace = analysis.run.primary
        if trace.k != k or analysis.k != k:
            raise UserError(f"{analysis.run.path}: recorded at k={trace.k}; every run of a budget sweep is compared "
                            f"at the same k ({k}): give --k {trace.k}")
        steps = trace.steps()
        gained = float(acceptance_totals(steps)["tokens_per_step"].item() or 1.0)
        step_ms = step_times(steps)["step_ms"].item()
        rate = gained / step_ms if step_ms else None
        reference_rate = rate if reference_rate is None else reference_rate
        agreement = greedy_agreement(reference_outputs, greedy_outputs(trace)).row(0, named=True)
        predicted = None
        if analysis.speedups is not None:
            at_k = analysis.speedups.filter((pl.col("k") == k) & (pl.col("batch") == batch))
            predicted = float(at_k["speedup"].item()) if at_k.height else None
        budget = trace.manifest.capture.budget
        if budget is not None and budget.scope not in largest:
            largest[budget.scope] = largest_groups(reference.routing(), budget.scope)
        rows.append({
            "budget": analysis.run.label.removeprefix(BUDGET_PREFIX),
            "limit": describe_budget(trace),
            "acceptance_by_position": [row["acceptance_rate"] for row in analysis.acceptance_by_position.to_dicts()],
            "tokens_per_step": gained,
            "agreement": agreement["agreement"],
            "diverged_requests": agreement["diverged"],
            "measured_vs_none": rate / reference_rate if rate and reference_rate else None,
            "predicted": predicted,
            # whether it re-routes any of the unbudgeted run's tokens (None: the unbudgeted run)
            "binds": None if budget is None else binds(largest[budget.scope], budget.per_layer),
        })
    table = pl.DataFrame(rows)
    return {"k": k, "batch": batch, "min_agreement": min_agreement,
            "best": best_budget(table, "predicted", min_agreement),
            "measured_best": best_budget(table, "measured_vs_none", min_agreement),
            "measured_on": recorded_on(reference), "rows": rows}


def print_budget_sweep(sweep: dict[str, Any], console: Console) -> None:
    """The sweep's table, the best budget marked, and why where none qualifies."""
    # eight columns: no rules between them and one space of padding, so that they fit 80 columns
    table = Table(title=f"budgets at k={sweep['k']}, {sweep['batch']} request(s) per step", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    for column in ("budget", "experts", "accepted", "tok/step", "agree", "measured", "predicted", "binds"):
        table.add_column(column, justify="left" if column in ("budget", "experts") else "right", no_wrap=True)
    for row in sweep["rows"]:
        mark = " ◀" if row["budget"] == sweep["best"] else ""
        table.add_row(row["budget"] + mark, row["limit"],
                      " ".join(f"{rate:.2f}" for rate in row["acceptance_by_position"] if rate is not None),
                      f"{row['tokens_per_step']:.2f}", f"{row['agreement']:.3f}",
                      "-" if row["measured_vs_none"] is None else f"{row['measured_vs_none']:.2f}x",
                      "-" if row["predicted"] is None else f"{row['predicted']:.2f}x",
                      {None: "-", True: "yes", False: "no"}[row["binds"]])
    console.print(table)
    console.print(f"experts: per layer and step or window; accepted: rate at draft positions 1..{sweep['k']}; agree: "
                  "share of output tokens equal to the unbudgeted run's; measured: step throughput against the "
                  f"unbudgeted run on {sweep['measured_on']}; predicted: speedup over no speculation at "
                  f"{sweep['batch']} request(s) per step; binds: re-routes tokens of the unbudgeted run (one that does "
                  "not runs as the unbudgeted run, and is never marked)", markup=False, highlight=False)
    if sweep["best"] is None:
        console.print(f"no budget keeps {sweep['min_agreement']:.0%} agreement with the unbudgeted outputs and has a "
                      "prediction", markup=False, highlight=False)
    else:
        console.print(f"◀ the largest predicted speedup at agreement >= {sweep['min_agreement']:g}", markup=False,
                      highlight=False)
    if sweep["measured_best"] not in (None, sweep["best"]):
        console.print(f"measured on {sweep['measured_on']}, budget {sweep['measured_best']} pays most at that "
                      "agreement: the prediction is for the deployment it names, not for the machine that recorded",
                      markup=False, highlight=False)
