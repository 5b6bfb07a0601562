"""``moetrace report`` and ``moetrace budget``: thin click commands over the summary, terminal and dashboard."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from moetrace.analysis.budgets import smallest_budgets
from moetrace.analysis.calibration import check_calibration
from moetrace.analysis.growth import COUNTERFACTUAL, MEASURED
from moetrace.analysis.profile import PROFILE_PRESETS, Profile, parse_profile
from moetrace.analysis.shape import SHAPE_PRESETS
from moetrace.commands.common import warn
from moetrace.errors import UserError, refuse_existing
from moetrace.report.budget_sweep import budget_runs, budget_sweep_summary, print_budget_sweep, recorded_concurrency
from moetrace.report.dashboard import render_dashboard
from moetrace.report.distributed import check_address
from moetrace.analysis.decision import DEFAULT_BATCHES, batches_from
from moetrace.trace.reader import is_partition_root, run_path
from moetrace.trace.schema import check_k
from moetrace.report.inputs import DEFAULT_PREDICTION, model_shape, open_run
from moetrace.report.payload import summary_json
from moetrace.report.analyse import analyse_run
from moetrace.report.summary import Options, budget_curves_per_k, sample_note, trace_windows
from moetrace.report.terminal import print_budget_table, print_summary

SHAPE_CHOICE = click.Choice(sorted(SHAPE_PRESETS))


def _dashboard_path(traces: tuple[Path, ...], output: Path | None) -> Path:
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


DASHBOARD_MARK = b'<meta name="generator" content="moetrace report">'


def _refuse_overwrite_unless_dashboard(path: Path, force: bool) -> None:
    """A dashboard moetrace wrote is derived from the traces: rebuilt. Any other file is the user's: kept unless
    ``force``."""
    try:
        with path.open("rb") as existing:
            ours = DASHBOARD_MARK in existing.read(4096)
    except OSError:
        ours = False
    if not ours:
        refuse_existing(path, force)


def _calibration(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        check_calibration(doc)
    except OSError as exc:
        raise UserError(f"{path}: cannot read calibration ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise UserError(f"{path}: not a moetrace calibration ({exc})") from None
    return doc


def _profile(text: str | None) -> Profile | None:
    if text is None:
        return None
    path = Path(text)
    if text not in PROFILE_PRESETS and path.suffix == ".json":
        try:
            text = path.read_text()
        except OSError as exc:
            raise UserError(f"--profile {path}: cannot read ({exc.strerror})") from None
    try:
        return parse_profile(text)
    except ValueError as exc:
        raise UserError(f"--profile: {exc}") from None


def _acceptance(value: float | None) -> float | None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise UserError(f"--acceptance {value}: must be in [0, 1]")
    return value


def _batches(text: str) -> tuple[int, ...]:
    try:
        return batches_from([int(part) for part in text.split(",") if part.strip()])
    except ValueError:
        raise UserError(f"--batch {text}: give concurrencies ≥ 1, comma-separated (e.g. 1,8,32,128)") from None


def _contexts(text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        contexts = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        contexts = ()
    if not contexts or contexts[0] < 1:
        raise UserError(f"--context {text}: give context lengths ≥ 1 token, comma-separated (e.g. 1024,8192,32768)")
    return contexts


def _coverage(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise UserError(f"--coverage {value}: must be in (0, 1]")
    return value


@click.command()
@click.argument("traces", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--k", "k", type=int, default=3, show_default=True, help="Draft length the summary is for.")
@click.option("--max-k", type=int, default=None, help="Largest k on the curves [default: max(8, --k)].")
@click.option("--coverage", type=float, default=0.95, show_default=True,
              help="Routing-weight coverage target for budgets.")
@click.option("--shape", "shape_preset", type=SHAPE_CHOICE, default=None,
              help="Price bytes at a real model's size instead of the manifest's.")
@click.option("--tp", type=int, default=None, help="Tensor-parallel size [default: the manifest's].")
@click.option("--ep", type=int, default=None, help="Expert-parallel size [default: the manifest's].")
@click.option("--placement", "placement_file", type=click.Path(path_type=Path), default=None,
              help='JSON placement: {"expert_to_rank": [rank of expert 0, ...]} [default: linear].')
@click.option("--calibration", "calibration_file", type=click.Path(path_type=Path), default=None,
              help="Calibration JSON from `moetrace calibrate`: predict step time and speedup per k from it.")
@click.option("--profile", "profile_text", default=None,
              help="Measured step breakdown at k=0: a preset (kimi-k2-tp8), a .json file, "
                   "'step=12.1ms,allreduce=51.5%,moe=11.1%,attention=15.3%,other=13.4%', or 'measured': the sweep's "
                   "own k=0 step time at each --batch (with --calibration, on the machine that recorded).")
@click.option("--k0-sync", "k0_sync", type=click.Path(path_type=Path), default=None,
              help="With --profile measured: a k=0 trace recorded with async scheduling off (vLLM switches it off to "
                   "draft with n-gram); what that costs a step is added at every k>0.")
@click.option("--acceptance", type=float, default=None,
              help="Per-draft acceptance rate for the prediction [default: measured per draft position].")
@click.option("--routing", type=click.Choice(["measured", "uniform"]), default="measured", show_default=True,
              help="Unique experts for the prediction: the trace's, or uniformly random routing's.")
@click.option("--batch", "batch_text", default=",".join(map(str, DEFAULT_BATCHES)), show_default=True,
              help="Concurrencies (requests per step) to recommend a k for, comma-separated.")
@click.option("--context", "context_text", default=None, metavar="L,L,...",
              help="Context lengths (tokens before a request's next token) to recommend a k at beside --batch, "
                   "comma-separated; default: the context the trace ran at.")
@click.option("--min-agreement", type=float, default=0.99, show_default=True,
              help="A budget sweep: the least share of tokens a budget's greedy output must share with the "
                   "unbudgeted run's for its budget to be recommended.")
@click.option("--ray", "ray_address", default=None, metavar="auto|local|HOST:PORT",
              help="An always-on recording: summarise each partition as a Ray task (auto: the cluster this machine "
                   "belongs to, local: a new one on this machine's cores) and cache each summary in its partition.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Dashboard file [default: TRACE/report.html, or NAME-vs-NAME.report.html for several].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of tables.")
@click.option("--force", is_flag=True,
              help="Overwrite a file at the dashboard's path that is not a moetrace dashboard.")
def report(
    traces: tuple[Path, ...],
    k: int,
    max_k: int | None,
    coverage: float,
    shape_preset: str | None,
    tp: int | None,
    ep: int | None,
    placement_file: Path | None,
    calibration_file: Path | None,
    profile_text: str | None,
    k0_sync: Path | None,
    acceptance: float | None,
    routing: str,
    batch_text: str,
    context_text: str | None,
    min_agreement: float,
    ray_address: str | None,
    output: Path | None,
    as_json: bool,
    force: bool,
) -> None:
    """Recommend a k per concurrency (--batch) for each TRACE's drafter from its predicted speedup, then summarise
    at --k (unique experts vs k, bytes per step, acceptance, expert budgets) in the terminal and write one offline
    HTML dashboard. Several TRACEs (traces or sweep folders, e.g. one per drafter) are compared side by side, as are
    the runs of a budget sweep (`moetrace record --budget 12,16,none`), at the concurrency it was recorded at, with
    a table of budgets and the one that pays most at --min-agreement.
    Predictions use --calibration and/or --profile; without either, the shipped H200 preset (Kimi-K2, TP=8)."""
    check_k(k)
    measured_baseline = profile_text == "measured"
    if measured_baseline:
        if calibration_file is None:
            raise UserError("--profile measured: give --calibration too (how MoE and all-reduce grow with k)")
        profile_text = None
    elif k0_sync is not None:
        raise UserError("--k0-sync goes with --profile measured (it corrects the sweep's own k=0 step)")
    preset = DEFAULT_PREDICTION if calibration_file is None and profile_text is None else None
    options = Options(
        k=k,
        max_k=max(8, k) if max_k is None else max_k,
        coverage=_coverage(coverage),
        shape_preset=shape_preset,
        tp=tp,
        ep=ep,
        placement_file=placement_file,
        calibration=preset.calibration() if preset else _calibration(calibration_file),
        calibration_path=Path(f"preset {preset.name}") if preset else calibration_file,
        profile=PROFILE_PRESETS[preset.profile] if preset else _profile(profile_text),
        acceptance=_acceptance(acceptance),
        routing=routing,
        batches=_batches(batch_text),
        contexts=_contexts(context_text),
        preset=preset,
        measured_baseline=measured_baseline,
        k0_sync=k0_sync,
        ray=ray_address,
    )
    if options.max_k < k:
        raise UserError(f"--max-k {options.max_k}: must be at least --k {k}")
    check_k(options.max_k, "--max-k")
    dashboard = _dashboard_path(traces, output)
    _refuse_overwrite_unless_dashboard(dashboard, force)
    if not 0.0 <= min_agreement <= 1.0:
        raise UserError(f"--min-agreement {min_agreement}: must be in [0, 1]")
    if ray_address is not None:
        check_address(ray_address)
    swept = budget_runs(traces[0]) if len(traces) == 1 else []
    runs = [open_run(path, k) for path in swept or traces]
    if ray_address is not None and (one := next((run for run in runs if not run.primary.parts), None)):
        raise UserError(f"--ray: {one.path} is not an always-on recording's partitions (report it without --ray)")
    if swept:  # what a budget's routing buys is measured at the concurrency that routing was recorded at
        options = dataclasses.replace(options, batches=(recorded_concurrency(runs[0].primary),))
    analyses = [analyse_run(run, options) for run in runs]
    summary = summary_json(analyses, options)
    if swept:
        summary["budget_sweep"] = budget_sweep_summary(analyses, min_agreement)
    try:
        dashboard.write_text(render_dashboard(summary), encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{dashboard}: cannot write dashboard ({exc.strerror})") from None
    summary["dashboard"] = str(dashboard)
    warn(summary["warnings"])
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    console = Console()
    print_summary(summary, console)
    if swept:
        print_budget_sweep(summary["budget_sweep"], console)
    console.print(f"dashboard: {dashboard}", markup=False, highlight=False)
    named = " ".join(shlex.quote(str(path)) for path in traces)
    console.print(f"next: moetrace report {named} --json > decision.json && moetrace export decision.json "
                  "--vllm-spec-schedule", markup=False, highlight=False, soft_wrap=True)  # whole, to copy


@click.command()
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--k", "k", type=int, default=3, show_default=True, help="Draft length the budget is for.")
@click.option("--coverage", type=float, default=0.95, show_default=True,
              help="Routing-weight share each layer must keep.")
@click.option("--shape", "shape_preset", type=SHAPE_CHOICE, default=None,
              help="Price bytes saved at a real model's size.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("budgets.json"), show_default=True,
              help="Budget file to write.")
@click.option("--force", is_flag=True, help="Overwrite an existing budget file.")
def budget(trace: Path, k: int, coverage: float, shape_preset: str | None, output: Path, force: bool) -> None:
    """Write the smallest expert budget per layer whose top-scored experts keep --coverage of the routing weight
    in verification windows of k+1 tokens (measured when TRACE was recorded at --k, else counterfactual)."""
    check_k(k)
    if k < 1:
        raise UserError("--k 0: a budget needs at least one draft")
    _coverage(coverage)
    refuse_existing(output, force)
    run = open_run(trace, k)
    if run.primary.lacks("router_weights"):
        raise UserError(f"{trace}: imported without router weights: no budget by routing-weight coverage")
    shape = model_shape(run.primary, shape_preset)
    curves, share = budget_curves_per_k(run, trace_windows(run), range(k, k + 1), shape)
    curves = curves.drop("k")
    notes = [note for note in (sample_note(share), shape.unpriced_note()) if note is not None]
    chosen = smallest_budgets(curves.lazy(), coverage)
    payload: dict[str, Any] = {
        "schema": "moetrace-budget/1",
        "trace": str(run.primary.path),
        "k": k,
        "source": MEASURED if run.primary.k == k else COUNTERFACTUAL,
        "coverage_target": coverage,
        "expert_bytes": None if shape.unpriced_format is not None else shape.expert_bytes,
        "budgets": {str(row["layer"]): row["budget"] for row in chosen.to_dicts()},
        "per_layer": chosen.to_dicts(),
        "window_share": share,
        "warnings": run.warnings + notes,
    }
    try:
        output.write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"{output}: cannot write budgets ({exc.strerror})") from None
    console = Console()
    warn(payload["warnings"])
    print_budget_table(payload, console)
    console.print(f"budgets: {output}", markup=False, highlight=False)
    console.print(f"next: moetrace record MODEL --k {k} --budget {shlex.quote(str(output))},none (what the budget "
                  "does to acceptance and output, measured in vLLM)", markup=False, highlight=False, soft_wrap=True)
