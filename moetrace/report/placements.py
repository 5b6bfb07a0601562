"""The held-out placement comparison that ``moetrace place`` and ``moetrace report --ep N`` share: the
verification-aware placement fitted on even steps and scored on odd ones beside vLLM's EPLB policy and the linear
placement, and its verdict in words."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.window_rows import WindowRows
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
from moetrace.trace.reader import Trace

# vLLM's EPLB policy as the comparison takes it: the expert load [layers, experts], the EP ranks and the redundant
# slots in, its physical-to-logical map [layers, experts + redundant] out; a UserError where it cannot be reached.
# The commands hand it in (``commands.common.vllm_eplb``): the report reads traces, it never reaches into vLLM.
EplbPolicy = Callable[[npt.NDArray[np.int64], int, int], npt.NDArray[np.int64]]


def held_out_comparison(rows: WindowRows, where: str, experts: int, layers: list[int], ep: int, redundant: int,
                        eplb: EplbPolicy, spread: float = SPREAD, max_load: float = 1.1,
                        progress: Callable[[int], None] | None = None) -> PlacementComparison:
    """The verification-aware placement of ``rows`` (``analysis.window_rows.decode_and_verify``) fitted on the
    windows of even steps, scored on those of odd steps beside vLLM's EPLB policy (``eplb``, fitted on the same
    windows' load) and the linear placement. A ``UserError`` (naming ``where``) when the windows do not span both
    halves or vLLM's policy cannot be reached."""
    fit = fitting_half(rows.step[rows.is_verify])
    if not fit.any() or fit.all():
        raise UserError(f"{where}: needs verification windows in both even and odd steps (fitted on one, scored "
                        f"on the other), it has {int(fit.sum())} and {int((~fit).sum())} verification rows: record "
                        f"more steps")
    baselines = {"linear": np.tile(np.arange(experts), (len(layers), 1)),
                 "vLLM EPLB": eplb(fitting_load(rows, experts, layers), ep, redundant)}
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


def placement_scores(trace: Trace, rows: WindowRows | None, ep: int,
                     eplb: EplbPolicy) -> tuple[pl.DataFrame | None, str | None]:
    """Under expert parallelism (``ep`` > 1) with verification windows: ``moetrace place``'s held-out comparison
    of the verification-aware placement, vLLM's EPLB and the linear one (no redundant experts); else None. A
    comparison that cannot be made is a note, not a failed report. ``rows`` None: the rows were summarised per
    partition (--ray) and never met on one machine."""
    experts = trace.manifest.model.num_experts
    if ep < 2 or trace.k == 0:
        return None, None
    if rows is None:
        return None, "placements not compared under --ray: the held-out comparison needs every row on one machine"
    if experts % ep:
        return None, f"placements not compared: {experts} experts do not split evenly over {ep} ranks"
    try:
        compared = held_out_comparison(rows, str(trace.path), experts, list(trace.manifest.model.moe_layers), ep, 0,
                                       eplb)
    except UserError as exc:
        return None, f"placements not compared: {exc}"
    return compared.scores, None
