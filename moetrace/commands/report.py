"""``moetrace report`` and ``moetrace budget``: their options parsed and checked once, then handed to the report
layer (``report.pipeline``), which analyses the traces and renders what it found."""

from __future__ import annotations

from pathlib import Path

import click

from moetrace.analysis.decision import DEFAULT_BATCHES, batches_from
from moetrace.analysis.profile import PROFILE_PRESETS
from moetrace.analysis.shape import SHAPE_PRESETS
from moetrace.commands.common import vllm_eplb
from moetrace.errors import UserError, refuse_existing
from moetrace.report.dashboard import dashboard_path, refuse_overwrite
from moetrace.report.distributed import check_address
from moetrace.report.inputs import DEFAULT_PREDICTION, read_calibration, read_profile
from moetrace.report.options import Options
from moetrace.report.pipeline import write_budget_file, write_report
from moetrace.trace.schema import check_k

SHAPE_CHOICE = click.Choice(sorted(SHAPE_PRESETS))


def _rate(value: float, option: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{option} {value}: must be in [0, 1]")
    return value


def _coverage(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise UserError(f"--coverage {value}: must be in (0, 1]")
    return value


def _max_k(max_k: int | None, k: int) -> int:
    value = max(8, k) if max_k is None else max_k
    if value < k:
        raise UserError(f"--max-k {value}: must be at least --k {k}")
    check_k(value, "--max-k")
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


def _ray(address: str | None) -> str | None:
    if address is not None:
        check_address(address)
    return address


@click.command()
@click.argument("traces", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--k", "k", type=int, default=3, show_default=True, help="Draft length the figures are for.")
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
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of tables.")
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
    """Recommend a k per concurrency (--batch) for each TRACE's drafter from its predicted speedup, then report
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
        traces=traces,
        k=k,
        max_k=_max_k(max_k, k),
        coverage=_coverage(coverage),
        shape_preset=shape_preset,
        tp=tp,
        ep=ep,
        placement_file=placement_file,
        calibration=preset.calibration() if preset else read_calibration(calibration_file),
        calibration_path=Path(f"preset {preset.name}") if preset else calibration_file,
        profile=PROFILE_PRESETS[preset.profile] if preset else read_profile(profile_text),
        acceptance=None if acceptance is None else _rate(acceptance, "--acceptance"),
        routing=routing,
        batches=_batches(batch_text),
        contexts=_contexts(context_text),
        preset=preset,
        measured_baseline=measured_baseline,
        k0_sync=k0_sync,
        ray=_ray(ray_address),
        min_agreement=_rate(min_agreement, "--min-agreement"),
        dashboard=dashboard_path(traces, output),
        as_json=as_json,
    )
    refuse_overwrite(options.dashboard, force)
    write_report(options, vllm_eplb)


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
    write_budget_file(trace, k, coverage, shape_preset, output)
