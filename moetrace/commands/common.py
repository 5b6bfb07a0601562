"""What the commands share: the consoles, a trace's expert load for the placement commands, and vLLM's EPLB policy
for the placement comparisons (``moetrace place``, ``moetrace report --ep``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console

from moetrace.errors import UserError, warn

err_console = Console(stderr=True)
console = Console()


def vllm_eplb(load: npt.NDArray[np.int64], ep: int, redundant: int) -> npt.NDArray[np.int64]:
    """vLLM's default EPLB policy's physical-to-logical map for ``load`` (``hooks.vllm_api.eplb_placement``): the
    baseline the placement comparisons score against (``report.placements.EplbPolicy``). vLLM's policy is imported
    here, when a comparison runs, so that the report layer never reaches into vLLM."""
    from moetrace.hooks.vllm_api import VllmApiError, eplb_placement

    try:
        return np.asarray(eplb_placement(load, ep, redundant)["physical_to_logical_map"])
    except VllmApiError as exc:
        raise UserError(str(exc)) from None


def trace_load(trace_path: Path) -> tuple[Any, list[int]]:
    """A trace's picks per (decoder layer, expert) in decode and verification [layers, experts] (dense layers all
    zero; the trace at the largest k of a sweep), and its MoE layers; or an SGLang stat dump's counts (``.pt``)."""
    if trace_path.suffix == ".pt":
        from moetrace.formats.sglang_recorder import stat_load

        return stat_load(trace_path)
    from moetrace.analysis.window_rows import decode_and_verify
    from moetrace.analysis.load import expert_load
    from moetrace.formats.export import sglang_logical_count
    from moetrace.report.inputs import open_run
    from moetrace.trace.schema import MAX_K

    trace = open_run(trace_path, MAX_K).primary
    warn(trace.warnings)
    model = trace.manifest.model
    experts, moe_layers = model.num_experts, list(model.moe_layers)
    layers = model.num_layers or max(moe_layers) + 1
    load = expert_load(decode_and_verify(trace.routing()), experts)
    return sglang_logical_count({(int(r["layer"]), int(r["expert"])): int(r["picks"]) for r in load.to_dicts()},
                                layers, experts), moe_layers
