"""``moetrace place``: the verification-aware expert placement of a trace, scored on held-out windows beside vLLM's
EPLB policy, written in the engines' formats."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np
import polars as pl
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moetrace.analysis.growth import decode_and_verify
from moetrace.analysis.verification_placement import (
    SPREAD,
    VERIFICATION_AWARE,
    PlacementComparison,
    compare_placements,
    fitting_half,
    fitting_load,
    layer_windows,
)
from moetrace.errors import UserError
from moetrace.export import sglang_physical_to_logical_map
from moetrace.report.inputs import open_run
from moetrace.trace.schema import MAX_K

if TYPE_CHECKING:
    from moetrace.analysis.growth import WindowRows


def place_experts(trace: Path, ep: int, redundant: int, spread: float, max_load: float, target: Path,
                  force: bool) -> None:
    """Fit the verification-aware placement of ``trace``'s experts on ``ep`` ranks, score it on held-out windows
    beside vLLM's EPLB policy and the linear placement, write it as vLLM EPLB maps (``target``) and SGLang's
    expert-location file beside it, and say which placement the held-out windows favour."""
    from moetrace.cli import console, err_console, refuse_existing, trace_load

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
        done = held_out_comparison(rows, str(run.path), experts, layers, ep, redundant, spread, max_load, advance)
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


def held_out_comparison(rows: WindowRows, where: str, experts: int, layers: list[int], ep: int, redundant: int,
                        spread: float = SPREAD, max_load: float = 1.1,
                        progress: Callable[[int], None] | None = None) -> PlacementComparison:
    """The verification-aware placement of ``rows`` (``analysis.growth.decode_and_verify``) fitted on the windows of
    even steps, scored on those of odd steps beside vLLM's EPLB policy (fitted on the same windows' load) and the
    linear placement. A ``UserError`` (naming ``where``) when the windows do not span both halves or vLLM's policy
    cannot be reached."""
    from moetrace.hooks.vllm_api import VllmApiError, eplb_placement

    fit = fitting_half(rows.step[rows.is_verify])
    if not fit.any() or fit.all():
        raise UserError(f"{where}: needs verification windows in both even and odd steps (fitted on one, scored "
                        f"on the other), it has {int(fit.sum())} and {int((~fit).sum())} verification rows: record "
                        f"more steps")
    try:
        eplb = eplb_placement(fitting_load(rows, experts, layers), ep, redundant)
    except VllmApiError as exc:
        raise UserError(str(exc)) from None
    baselines = {"linear": np.tile(np.arange(experts), (len(layers), 1)),
                 "vLLM EPLB": np.asarray(eplb["physical_to_logical_map"])}
    return compare_placements(layer_windows(rows, experts), layers, experts, ep, redundant, baselines, spread,
                              max_load, progress)


def held_out_verdict(scores: pl.DataFrame) -> str:
    """Which placement the held-out windows favour by what a verify step waits for under EP, the busiest rank's
    unique experts per step (ties: fewer ranks touched per window), and what the others trade against it."""
    ranked = scores.sort("busiest_rank_experts", "ranks_touched")
    best = ranked.row(0, named=True)
    mine = scores.filter(pl.col("placement") == VERIFICATION_AWARE).row(0, named=True)
    if best["placement"] == mine["placement"]:
        return (f"held out, {mine['placement']} reads the fewest experts on the busiest rank per step "
                f"({mine['busiest_rank_experts']:.2f}) and touches {mine['ranks_touched']:.2f} ranks a window")
    return (f"held out, {best['placement']} reads fewer experts on the busiest rank per step "
            f"({best['busiest_rank_experts']:.2f} against {mine['busiest_rank_experts']:.2f}), what a verify step "
            f"waits for under EP; {mine['placement']} touches fewer ranks a window ({mine['ranks_touched']:.2f} "
            f"against {best['ranks_touched']:.2f}): use {best['placement']}'s placement unless dispatches "
            f"dominate the step")
