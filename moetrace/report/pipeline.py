"""A report end to end, from the options the command parsed: the runs opened (one per TRACE argument, or a budget
sweep's), each analysed (``analyse``), shaped into the payload (``payload``), and the payload rendered: the dashboard
written, the warnings on stderr, then ``--json``'s JSON or the terminal's tables. ``moetrace budget``'s file alike."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import click
from rich.console import Console

from moetrace.errors import UserError, warn
from moetrace.report.analyse import analyse_run
from moetrace.report.budget_sweep import budget_runs, budget_sweep_section, print_budget_sweep, recorded_concurrency
from moetrace.report.dashboard import render_dashboard
from moetrace.report.inputs import model_shape, open_run
from moetrace.report.options import Options
from moetrace.report.payload import budget_file, report_payload
from moetrace.report.placements import EplbPolicy
from moetrace.report.terminal import print_budget_table, print_report
from moetrace.report.windows import budget_curves_per_k, trace_windows


def write_report(options: Options, eplb: EplbPolicy) -> None:
    """``moetrace report``: ``eplb`` is vLLM's EPLB policy, the baseline of the placements compared under --ep."""
    swept = budget_runs(options.traces[0]) if len(options.traces) == 1 else []
    runs = [open_run(path, options.k) for path in swept or options.traces]
    if options.ray is not None and (one := next((run for run in runs if not run.primary.parts), None)):
        raise UserError(f"--ray: {one.path} is not an always-on recording's partitions (report it without --ray)")
    if swept:  # what a budget's routing buys is measured at the concurrency that routing was recorded at
        options = dataclasses.replace(options, batches=(recorded_concurrency(runs[0].primary),))
    analyses = [analyse_run(run, options, eplb) for run in runs]
    payload = report_payload(analyses, options)
    if swept:
        payload["budget_sweep"] = budget_sweep_section(analyses, options.min_agreement)
    try:
        options.dashboard.write_text(render_dashboard(payload), encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{options.dashboard}: cannot write dashboard ({exc.strerror})") from None
    payload["dashboard"] = str(options.dashboard)
    warn(payload["warnings"])
    if options.as_json:
        click.echo(json.dumps(payload, indent=2))
        return
    console = Console()
    print_report(payload, console)
    if swept:
        print_budget_sweep(payload["budget_sweep"], console)
    console.print(f"dashboard: {options.dashboard}", markup=False, highlight=False)
    named = " ".join(shlex.quote(str(path)) for path in options.traces)
    console.print(f"next: moetrace report {named} --json > decision.json && moetrace export decision.json "
                  "--vllm-spec-schedule", markup=False, highlight=False, soft_wrap=True)  # whole, to copy


def write_budget_file(trace: Path, k: int, coverage: float, shape_preset: str | None, output: Path) -> None:
    """``moetrace budget``: the smallest expert budget per layer at ``k`` for ``coverage``, written to ``output``."""
    run = open_run(trace, k)
    if run.primary.lacks("router_weights"):
        raise UserError(f"{trace}: imported without router weights: no budget by routing-weight coverage")
    shape = model_shape(run.primary, shape_preset)
    curves, share = budget_curves_per_k(run, trace_windows(run), range(k, k + 1), shape)
    budgets = budget_file(run, k, coverage, shape, curves.drop("k"), share)
    try:
        output.write_text(json.dumps(budgets, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"{output}: cannot write budgets ({exc.strerror})") from None
    console = Console()
    warn(budgets["warnings"])
    print_budget_table(budgets, console)
    console.print(f"budgets: {output}", markup=False, highlight=False)
    console.print(f"next: moetrace record MODEL --k {k} --budget {shlex.quote(str(output))},none (what the budget "
                  "does to acceptance and output, measured in vLLM)", markup=False, highlight=False, soft_wrap=True)
