"""Per-layer expert budgets enforced in verification: the experts a step's verifying tokens may use in a MoE layer
are limited to the layer's budget B, inside the router wrapper that records them (eager and under CUDA graphs).

# T tokens in a forward (T_pad under a CUDA graph), E experts, K top-k, G token groups that share a budget
# (one per step, or one per request window), B a layer's budget, L budgeted layers

Each layer's B lives in a device tensor [L] (``TokenGroups.sizes``) that the forward reads, so a running engine
changes its budgets between steps (``TokenGroups.set_sizes``; B = E: routing unchanged) without capturing its CUDA
graphs again. Before each forward (outside any CUDA graph) ``TokenGroups.plan`` writes each token's group into a
device buffer at a fixed address (``hooks.planned``): verification tokens (a request's window of 1 + d tokens,
d > 0 drafts) get their group, every other token (prefill, decoding without drafts, a graph's padding) the group
``G`` that the budget leaves alone.
Inside the forward ``restrict`` keeps, per group, the B experts with the largest summed router weight over the
group's tokens (MoE-Spec's rule) and re-chooses the top-k of each token that used another expert among the kept
ones, by the router's selection score (score plus selection bias, any expert groups ignored), its weights scaled
as the router scaled them: renormalised to the sum of its own weights where the router renormalises, else by the
same factor. No host sync, fixed shapes, nothing allocated on the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moetrace.hooks.options import BUDGET_SCOPES
from moetrace.hooks.planned import PlannedBuffer, PlannedStep

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class LayerBudget:
    """Where one layer's budget lies in ``TokenGroups.sizes``, and how its router scores and normalises."""

    slot: int
    scoring_func: str
    renormalize: bool


def layer_budgets(budget: int | Mapping[str, int], layers: list[int], num_experts: int, top_k: int) -> list[int]:
    """The budget of every recorded layer, in slot order, from one budget for all or a budget per layer (the
    ``budgets`` of ``moetrace budget``'s file); ``ValueError`` naming a missing layer or a budget outside
    [top_k, num_experts]."""
    if isinstance(budget, int):
        chosen = [budget] * len(layers)
    else:
        missing = [layer for layer in layers if str(layer) not in budget]
        if missing:
            raise ValueError(f"the budget names no budget for MoE layer(s) {', '.join(map(str, missing))}")
        chosen = [int(budget[str(layer)]) for layer in layers]
    for layer, value in zip(layers, chosen):
        if not top_k <= value <= num_experts:
            raise ValueError(f"budget {value} for layer {layer} is outside [top_k={top_k}, experts={num_experts}]")
    return chosen


class TokenGroups:
    """Which budget group each token of the next forward is in (``planned``: a device buffer [T_max] at a fixed
    address), and every layer's budget (``sizes``: a device tensor [L])."""

    def __init__(self, max_tokens: int, max_requests: int, scope: str, sizes: list[int], num_experts: int,
                 device: torch.device) -> None:
        if scope not in BUDGET_SCOPES:
            raise ValueError(f"budget scope {scope!r} is not one of {', '.join(BUDGET_SCOPES)}")
        self.scope = scope
        self.groups = 1 if scope == "step" else max_requests
        self.untouched = self.groups  # the group of tokens the budget leaves alone
        self.planned = PlannedBuffer((max_tokens,), self.untouched, device)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        self.ranks = torch.arange(num_experts, device=device)  # [E]: an expert's place in its group's order

    def set_sizes(self, sizes: list[int]) -> None:
        """Every layer's budget from the next forward on (the engine between steps)."""
        self.sizes.copy_(torch.tensor(sizes, dtype=torch.int64))

    def plan(self, step: PlannedStep | None) -> None:
        """Group the next forward's tokens: a request's verify where it has drafts; None (a forward that is no
        request's step, such as a dummy run): every token left alone."""
        with self.planned.planning() as view:
            if step is not None:
                for request in np.flatnonzero(step.drafts > 0):
                    view[step.query_start[request]:step.query_start[request + 1]] = (
                        0 if self.scope == "step" else request)


def restrict(groups: TokenGroups, layer: LayerBudget, router_logits: torch.Tensor, bias: torch.Tensor | None,
             weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's (weights, ids) [T, K] with every group's tokens limited to the group's B experts of largest
    summed weight (B: the layer's entry in ``groups.sizes``); tokens whose experts are all kept, and tokens of no
    group, unchanged."""
    tokens, top_k = ids.shape
    group = groups.planned.device[:tokens]  # [T]
    experts = router_logits.shape[-1]
    # [G+1, E]: scatter_add on the flat view (atomic adds: no sort, no host sync, capturable in a CUDA graph)
    summed = torch.zeros((groups.groups + 1) * experts, dtype=torch.float32, device=ids.device)
    summed.scatter_add_(0, (group[:, None] * experts + ids.long()).flatten(), weights.float().flatten())
    summed = summed.view(groups.groups + 1, experts)
    ranked = summed.argsort(dim=1, descending=True)  # [G+1, E]; the first B of each group are kept
    within = (groups.ranks < groups.sizes[layer.slot]).expand_as(ranked)
    kept = torch.zeros_like(summed, dtype=torch.bool).scatter_(1, ranked, within)
    kept[groups.untouched] = True
    allowed = kept[group]  # [T, E]
    keeps_its_experts = allowed.gather(1, ids.long()).all(dim=1, keepdim=True)  # [T, 1]
    logits = router_logits.float()
    scores = logits.sigmoid() if layer.scoring_func == "sigmoid" else logits.softmax(dim=-1)  # [T, E]
    selection = scores + bias.float() if bias is not None else scores
    chosen = selection.masked_fill(~allowed, float("-inf")).topk(top_k, dim=1).indices  # [T, K]
    chosen_scores = scores.gather(1, chosen)
    own_sum = weights.float().sum(dim=1, keepdim=True)
    scaled_by = chosen_scores if layer.renormalize else scores.gather(1, ids.long())
    chosen_weights = chosen_scores * own_sum / scaled_by.sum(dim=1, keepdim=True)
    return (torch.where(keeps_its_experts, weights, chosen_weights.to(weights.dtype)),
            torch.where(keeps_its_experts, ids, chosen.to(ids.dtype)))


def budgeted_layers(routers: Sequence[Any], scoring_funcs: Sequence[str], sizes: list[int], num_experts: int,
                    max_num_tokens: int, max_num_reqs: int, scope: str, device: torch.device
                    ) -> list[tuple[TokenGroups, LayerBudget]]:
    """Each recorded layer's budget (``sizes``, its router and scoring function) and the token groups they share;
    ``ValueError`` where a router cannot take one (another scoring function, or shared experts fused into it)."""
    if any(func not in SCORING_FUNCS or getattr(router, "num_fused_shared_experts", 0)
           for func, router in zip(scoring_funcs, routers)):
        raise ValueError(f"a budget needs {' or '.join(SCORING_FUNCS)} routers without fused shared experts")
    groups = TokenGroups(max_num_tokens, max_num_reqs, scope, sizes, num_experts, device)
    return [(groups, LayerBudget(slot, func, bool(getattr(router, "renormalize", True))))
            for slot, (func, router) in enumerate(zip(scoring_funcs, routers))]
