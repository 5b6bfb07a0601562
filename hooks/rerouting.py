"""What changes the routing a recording runs on: an expert budget in verification (``hooks.budget``) and routing
replayed from a trace (``hooks.replay``), set up for one engine and planned before each of its forwards.

# T tokens in a forward, L recorded MoE layers, E experts
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetrace.hooks.budget import LayerBudget, TokenGroups, budgeted_layers, layer_budgets
from moetrace.hooks.capture import RouterInfo
from moetrace.hooks.options import RecordingOptions, UnsupportedRunner
from moetrace.hooks.planned import PlannedStep
from moetrace.hooks.replay import ReplayedRouting, replayed_routing


@dataclass(frozen=True)
class EngineFacts:
    """What decides whether an engine's routing can be changed, and how: its routers and what they route."""

    routers: list[Any]  # one per recorded MoE layer
    infos: list[RouterInfo]
    max_num_tokens: int
    max_num_reqs: int
    positions: torch.Tensor  # the runner's device positions [>= T_max], at a fixed address
    parallel: tuple[int, int]  # (data, tensor) parallel sizes
    fuses_routing: bool  # an MoE kernel that never calls the router
    device: torch.device
    dtype: torch.dtype  # the model's, so its gates' and their logits'


def budget_sizes(options: RecordingOptions, infos: list[RouterInfo]) -> list[int] | None:
    """Every recorded layer's budget under ``options`` (None: no budget); ``UnsupportedRunner`` naming a missing
    layer or a budget outside [top_k, experts]."""
    if options.budget is None:
        return None
    try:
        return layer_budgets(options.budget, [info.layer for info in infos], infos[0].num_experts, infos[0].top_k)
    except ValueError as exc:
        raise UnsupportedRunner(str(exc)) from None


class Rerouting:
    """The budget and the replay (either may be None) of one engine, planned per forward."""

    def __init__(self, options: RecordingOptions, engine: EngineFacts) -> None:
        self.infos = engine.infos
        self.budgets = None if options.budget is None else self._budgets(options, engine)
        self.replay = None if options.replay_routing is None else self._replay(options, engine)

    @staticmethod
    def _check(what: str, engine: EngineFacts) -> None:
        """``UnsupportedRunner`` where ``what`` cannot change this engine's routing: routers under data parallelism
        see other ranks' tokens, other tensor-parallel ranks route on their own (rank 0 alone records), and kernels
        that fuse routing never call the router."""
        if max(engine.parallel) > 1:
            raise UnsupportedRunner(f"{what} needs an engine without data or tensor parallelism")
        if engine.fuses_routing:
            raise UnsupportedRunner(f"{what} needs the router's own routing (this MoE kernel fuses it)")

    def _budgets(self, options: RecordingOptions, engine: EngineFacts) -> list[tuple[TokenGroups, LayerBudget]]:
        self._check("a budget", engine)
        sizes = budget_sizes(options, engine.infos)
        assert sizes is not None
        try:
            return budgeted_layers(engine.routers, [info.scoring_func for info in engine.infos], sizes,
                                   engine.infos[0].num_experts, engine.max_num_tokens, engine.max_num_reqs,
                                   options.budget_scope, engine.device)
        except ValueError as exc:
            raise UnsupportedRunner(str(exc)) from None

    def _replay(self, options: RecordingOptions, engine: EngineFacts) -> ReplayedRouting:
        self._check("replayed routing", engine)
        assert options.replay_routing is not None
        try:
            return replayed_routing(Path(options.replay_routing), engine.infos[0].num_experts, engine.infos[0].top_k,
                                    engine.max_num_tokens, engine.positions, engine.device, engine.dtype)
        except ValueError as exc:
            raise UnsupportedRunner(str(exc)) from None

    @property
    def plans(self) -> bool:
        """Whether each forward's tokens are planned before it (a budget or a replay)."""
        return self.budgets is not None or self.replay is not None

    def restart(self, sizes: list[int] | None) -> None:
        """A new trace begins with the layers' budgets ``sizes`` (None: none) and its replay from the first request."""
        if self.budgets is not None:
            self.budgets[0][0].set_sizes(sizes or [self.infos[0].num_experts] * len(self.infos))
        if self.replay is not None:
            self.replay.restart()

    def of_layer(self, slot: int) -> tuple[tuple[TokenGroups, LayerBudget] | None, ReplayedRouting | None]:
        """What changes the router of recorded layer ``slot``."""
        return None if self.budgets is None else self.budgets[slot], self.replay

    def plan(self, step: PlannedStep | None, finished: Iterable[str]) -> None:
        """Write the next forward's token groups (a budget) and bank rows (a replay); None: no request's step;
        ``finished``: the requests done since the last step."""
        if self.budgets is not None:
            self.budgets[0][0].plan(step)
        if self.replay is not None:
            self.replay.plan(step, finished)
