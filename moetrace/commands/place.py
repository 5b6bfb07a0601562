"""``moetrace place``: the verification-aware expert placement of a trace, scored on held-out windows beside vLLM's
EPLB policy, written in the engines' formats."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moetrace.analysis.window_rows import decode_and_verify
from moetrace.commands.common import console, err_console, trace_load, vllm_eplb
from moetrace.errors import UserError, refuse_existing
from moetrace.formats.export import sglang_physical_to_logical_map
from moetrace.report.inputs import open_run
from moetrace.report.placements import held_out_comparison, held_out_verdict
from moetrace.trace.schema import MAX_K


def place_experts(trace: Path, ep: int, redundant: int, spread: float, max_load: float, target: Path,
                  force: bool) -> None:
    """Fit the verification-aware placement of ``trace``'s experts on ``ep`` ranks, score it on held-out windows
    beside vLLM's EPLB policy and the linear placement, write it as vLLM EPLB maps (``target``) and SGLang's
    expert-location file beside it, and say which placement the held-out windows favour."""
    sglang_target = target.with_name(f"{target.name.removesuffix('.json')}.sglang-expert-location.json")
    for path in (target, sglang_target):
        refuse_existing(path, force)
    run = open_run(trace, MAX_K).primary
    experts, layers = run.manifest.model.num_experts, sorted(run.manifest.model.moe_layers)
    if (experts + redundant) % ep:
        raise UserError(f"--ep {ep} --redundant {redundant}: {experts} experts + {redundant} redundant do not "
                        f"split evenly over {ep} ranks")
    if run.k == 0:
        raise UserError(f"{run.path}: recorded at k = 0, so it has no verification windows; record with "
                        f"speculation (moetrace record --k 3) and place from that trace")
    rows = decode_and_verify(run.routing())
    columns = (TextColumn("placing layer {task.completed}/{task.total}"), BarColumn(), TimeElapsedColumn())
    bar, started = Progress(*columns, console=err_console, transient=True), time.monotonic()
    task = bar.add_task("", total=len(layers))

    def advance(_layer: int) -> None:
        bar.advance(task)
        if not bar.live.is_started and time.monotonic() - started > 1.0:
            bar.start()  # only a run long enough to wait for shows a bar

    try:
        with err_console.status("vLLM's EPLB policy"):
            from moetrace.hooks.vllm_api import EPLB_LOGICAL_MAPS_PATH, symbol

            logical_maps = symbol(EPLB_LOGICAL_MAPS_PATH)
        done = held_out_comparison(rows, str(run.path), experts, layers, ep, redundant, vllm_eplb, spread, max_load,
                                   advance)
    finally:
        bar.stop()
    counts, _ = trace_load(trace)
    import torch

    placement = done.placement
    logical, replicas = logical_maps(torch.from_numpy(placement), experts)
    document = {"policy": f"moetrace verification-aware, spread {spread}, max load {max_load}x, fitted on the "
                          "verification windows of even steps", "ep": ep, "redundant": redundant, "layers": layers,
                "load": counts[layers].tolist(), "physical_to_logical_map": placement.tolist(),
                "logical_to_physical_map": logical.tolist(), "logical_replica_count": replicas.tolist(),
                "held_out": done.scores.to_dicts()}
    sglang = sglang_physical_to_logical_map(counts, [], ep, redundant)  # dense layers' rows as export writes them
    sglang[layers] = placement
    target.write_text(json.dumps(document) + "\n")
    sglang_target.write_text(json.dumps({"physical_to_logical_map": sglang.tolist()}) + "\n")
    first = done.scores.row(0, named=True)
    table = Table(title=f"EP={ep} (+{redundant}) held out: {first['windows'] // len(layers):,} windows a layer in "
                        f"{first['steps']:,} odd steps, fitted on the even ones")
    for column in ("placement", "ranks / window", "busiest-rank experts / step", "balancedness"):
        table.add_column(column, justify="left" if column == "placement" else "right")
    for row in done.scores.iter_rows(named=True):
        table.add_row(row["placement"], f"{row['ranks_touched']:.2f}", f"{row['busiest_rank_experts']:.2f}",
                      f"{row['balancedness']:.3f}")
    console.print(table)
    click.echo(held_out_verdict(done.scores))
    click.echo(f"{target}: vLLM EPLB maps of {experts} experts (+{redundant}) over {ep} ranks in {len(layers)} MoE "
               f"layers")
    click.echo(f"{sglang_target}: SGLang physical_to_logical_map")
    click.echo(f"next: python -m sglang.launch_server --model-path MODEL --init-expert-location {sglang_target} "
               f"--ep-size {ep} --ep-num-redundant-experts {redundant}")


@click.command()
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--ep", type=int, required=True, help="Expert-parallel ranks to place the experts on.")
@click.option("--redundant", default=0, show_default=True,
              help="Extra expert slots per layer: replicas of the most picked experts.")
@click.option("--spread", default=1.0, show_default=True,
              help="Weight of a step's experts per rank (squared, a stand-in for the busiest rank) against ranks "
                   "touched per window; 0: ranks touched alone.")
@click.option("--max-load", default=1.1, show_default=True,
              help="Cap on a rank's token load, times the mean (or the balanced start's busiest rank if higher).")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="vLLM EPLB-style file to write [default: TRACE's name with .placement-ep<N>.json]; SGLang's "
                   "file goes beside it with .sglang-expert-location.json.")
@click.option("--force", is_flag=True, help="Overwrite existing files.")
def place(trace: Path, ep: int, redundant: int, spread: float, max_load: float, output: Path | None,
          force: bool) -> None:
    """Place experts on EP ranks for speculative verification: per MoE layer, the experts that appear together in
    a request's verification window (its k+1 tokens in one step) go to one rank, so a window dispatches to fewer
    ranks, while each step's experts stay spread and each rank's token load stays within --max-load.

    Fitted on the windows of even steps and scored on those of odd steps, beside vLLM's default EPLB policy fitted
    on the same windows' load and the default linear placement: ranks touched per window, unique experts on the
    busiest rank per step, balancedness (mean over max tokens per rank per step, as vLLM's EPLB logs it). Writes
    the placement scored there as vLLM EPLB maps (physical_to_logical_map, logical_to_physical_map,
    logical_replica_count) and as SGLang's --init-expert-location file (physical_to_logical_map)."""
    for bad, message in ((ep < 1, f"--ep {ep}: needs at least 1 rank"),
                         (redundant < 0, f"--redundant {redundant}: must be 0 or more"),
                         (spread < 0, f"--spread {spread}: must be 0 or more"),
                         (max_load < 1, f"--max-load {max_load}: must be 1 or more (times the mean rank load)")):
        if bad:
            raise UserError(message)
    target = output or trace.with_name(f"{trace.name}.placement-ep{ep}{f'-r{redundant}' if redundant else ''}.json")
    place_experts(trace, ep, redundant, spread, max_load, target, force)
