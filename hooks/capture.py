"""Graph-safe routing capture: each target-model router writes its top-k into static device buffers.

# T tokens in a forward, L recorded MoE layers, K top-k, C router candidates, E experts

The wrapper only issues tensor copies into buffers allocated once at model load, so it is replayed correctly by
CUDA graphs and traced correctly by Dynamo; it never reads a value back to the host. The step hook copies rows
[:T] out after the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

RoutingFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_WRAPPED_MARK = "_moetrace_original_compute_routing"


@dataclass
class RouterInfo:
    """What the trace needs to know about one wrapped router."""

    layer: int
    num_experts: int
    top_k: int
    scoring_func: str
    routed_scaling_factor: float


class RoutingBuffers:
    """Static buffers that routers write into during the forward.

    ids [T_max, L, K] int32 · weights [T_max, L, K] fp32 · cand_ids/cand_scores [T_max, L, C] (only when C > 0)
    """

    def __init__(self, max_tokens: int, num_layers: int, top_k: int, candidates: int, device: torch.device):
        shape = (max_tokens, num_layers)
        self.ids = torch.zeros(*shape, top_k, dtype=torch.int32, device=device)
        self.weights = torch.zeros(*shape, top_k, dtype=torch.float32, device=device)
        self.cand_ids = torch.zeros(*shape, candidates, dtype=torch.int32, device=device) if candidates else None
        self.cand_scores = torch.zeros(*shape, candidates, dtype=torch.float32, device=device) if candidates else None
        self.top_k = top_k
        self.candidates = candidates

    def rows(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """Host copies of the first ``num_tokens`` rows, safe to keep after the next forward overwrites the
        buffers."""
        out = {"ids": self.ids[:num_tokens], "weights": self.weights[:num_tokens]}
        if self.cand_ids is not None and self.cand_scores is not None:
            out["cand_ids"] = self.cand_ids[:num_tokens]
            out["cand_scores"] = self.cand_scores[:num_tokens]
        return {name: t.to("cpu", copy=True) for name, t in out.items()}


def selection_scores(router: Any, router_logits: torch.Tensor) -> torch.Tensor:
    """The scores a router ranks experts by: the normalised score plus the selection bias, if any. [T, E]"""
    logits = router_logits.float()
    scores = logits.sigmoid() if router.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    bias = getattr(router, "e_score_correction_bias", None)
    return scores + bias.float() if bias is not None else scores


def wrap_router(router: Any, slot: int, buffers: RoutingBuffers) -> None:
    """Make ``router._compute_routing`` also write its result into ``buffers`` at layer ``slot``. Idempotent."""
    if _WRAPPED_MARK in vars(router):
        return
    original: RoutingFn = router._compute_routing
    top_k = buffers.top_k

    def compute_routing_and_capture(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original(*args, **kwargs)
        num_tokens = ids.shape[0]
        # Slice to top_k: fused shared experts append extra columns with ids >= E.
        buffers.ids[:num_tokens, slot].copy_(ids[:, :top_k])
        buffers.weights[:num_tokens, slot].copy_(weights[:, :top_k])
        if buffers.cand_ids is not None and buffers.cand_scores is not None:
            router_logits = args[1] if len(args) > 1 else kwargs["router_logits"]
            cand_scores, cand_ids = selection_scores(router, router_logits).topk(buffers.candidates, dim=-1)
            buffers.cand_ids[:num_tokens, slot].copy_(cand_ids)
            buffers.cand_scores[:num_tokens, slot].copy_(cand_scores)
        return weights, ids

    setattr(router, _WRAPPED_MARK, original)
    router._compute_routing = compute_routing_and_capture


def unwrap_router(router: Any) -> None:
    """Undo ``wrap_router``; a router that was never wrapped is left alone."""
    original = vars(router).pop(_WRAPPED_MARK, None)
    if original is None:
        return
    if getattr(original, "__func__", None) is getattr(type(router), "_compute_routing", None):
        del router._compute_routing  # the class method shows through again
    else:
        router._compute_routing = original


def target_moe_runners(model: torch.nn.Module) -> list[Any]:
    """The MoE runners of the target model, in layer order. Draft models are separate modules, never walked."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    return sorted(runners, key=lambda r: int(r.layer_id))


def router_info(runner: Any) -> RouterInfo:
    router = runner.router
    return RouterInfo(
        layer=int(runner.layer_id),
        num_experts=int(router.global_num_experts),
        top_k=int(router.top_k),
        scoring_func=str(getattr(router, "scoring_func", "softmax")),
        routed_scaling_factor=float(getattr(router, "routed_scaling_factor", 1.0)),
    )
