"""The analyses the report runs: functions of Polars frames that return Polars frames (no plotting).

The ones a user calls on a trace (``moetrace.open_trace``) are importable from here, each on first use (the vLLM
plugin imports this package's modules in engine processes that have no use for the rest)::

    from moetrace.analysis import acceptance_by_position, decode_and_verify, expert_growth, expert_load

``expert_growth`` is ``moetrace.analysis.growth.growth`` (the module's name is taken by the module).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from moetrace import require_same_checkout

require_same_checkout(__file__, __name__)

if TYPE_CHECKING:
    from moetrace.analysis.acceptance import acceptance_by_position, acceptance_totals, step_times
    from moetrace.analysis.budgets import budget_curves, budget_windows, smallest_budgets
    from moetrace.analysis.window_rows import decode_and_verify
    from moetrace.analysis.growth import growth as expert_growth
    from moetrace.analysis.load import expert_load
    from moetrace.analysis.placement import linear_placement

# public name -> (module, name there)
PUBLIC = {
    "acceptance_by_position": ("acceptance", "acceptance_by_position"),
    "acceptance_totals": ("acceptance", "acceptance_totals"), "step_times": ("acceptance", "step_times"),
    "budget_windows": ("budgets", "budget_windows"), "budget_curves": ("budgets", "budget_curves"),
    "smallest_budgets": ("budgets", "smallest_budgets"), "decode_and_verify": ("window_rows", "decode_and_verify"),
    "expert_growth": ("growth", "growth"), "expert_load": ("load", "expert_load"),
    "linear_placement": ("placement", "linear_placement"),
}
__all__ = ["acceptance_by_position", "acceptance_totals", "budget_curves", "budget_windows", "decode_and_verify",
           "expert_growth", "expert_load", "linear_placement", "smallest_budgets", "step_times"]


def __getattr__(name: str) -> Any:
    if name in PUBLIC:
        module, defined = PUBLIC[name]
        return getattr(import_module(f"moetrace.analysis.{module}"), defined)
    raise AttributeError(f"module 'moetrace.analysis' has no attribute {name!r}")
