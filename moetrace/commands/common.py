"""What the commands share: the consoles, warnings on stderr, and a trace's expert load for the placement
commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console


err_console = Console(stderr=True)
console = Console()


def warn(lines: list[str]) -> None:
    """Each of ``lines`` as a warning on stderr: what the reader met (a file skipped as corrupt, a recording that did
    not close) is said whatever the command can still say from the rest."""
    for line in lines:
        err_console.print(f"warning: {line}", style="yellow", markup=False, highlight=False, soft_wrap=True)


def trace_load(trace_path: Path) -> tuple[Any, list[int]]:
    """A trace's picks per (decoder layer, expert) in decode and verification [layers, experts] (dense layers all
    zero; the trace at the largest k of a sweep), and its MoE layers; or an SGLang stat dump's counts (``.pt``)."""
    if trace_path.suffix == ".pt":
        from moetrace.formats.sglang_recorder import stat_load

        return stat_load(trace_path)
    from moetrace.analysis.growth import decode_and_verify
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
