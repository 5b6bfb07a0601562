"""The model ``bench_capture_gpu.py`` captures routing from: Kimi-K2-shaped MoE layers (its router, grouped-GEMM
experts), built without vLLM."""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

SIZES = (1, 2, 4, 8, 16)  # the token counts of the CUDA graphs captured, as vLLM's capture sizes


def padded(num_tokens: int) -> int:
    return next(s for s in SIZES if s >= num_tokens)


# -- the model ---------------------------------------------------------------------------------------------------


class KimiRouter:
    """vLLM's bias router for Kimi-K2 (n_group = topk_group = 1): what ``_compute_routing`` returns."""

    scoring_func = "sigmoid"

    def __init__(self, bias: torch.Tensor, top_k: int):
        self.e_score_correction_bias = bias  # [E] fp32
        self.top_k = top_k

    def _compute_routing(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor, indices_type: Any = None, *,
        input_ids: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = router_logits.float().sigmoid()
        ids = (scores + self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)


class Experts:
    """Routed experts of one TP rank: gate_up [E, 2I, H] and down [E, H, I], bf16, as a grouped GEMM."""

    def __init__(self, num_experts: int, hidden: int, width: int, device: torch.device, gen: torch.Generator):
        self.num_experts = num_experts
        self.w13 = (torch.randn(num_experts, 2 * width, hidden, device=device, generator=gen) * 0.02).bfloat16()
        self.w2 = (torch.randn(num_experts, hidden, width, device=device, generator=gen) * 0.02).bfloat16()
        self.grouped = True

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, top_k = ids.shape
        flat = ids.flatten().long()
        order = flat.argsort(stable=True)
        rows = x[order // top_k]  # [T*K, H], grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        if self.grouped:
            h = torch._grouped_mm(rows, self.w13.transpose(-2, -1), offs=offs)
        else:  # gathers each row's expert weights: same result, more traffic
            h = torch.bmm(rows[:, None], self.w13[flat[order]].transpose(-2, -1))[:, 0]
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
        if self.grouped:
            y = torch._grouped_mm(act, self.w2.transpose(-2, -1), offs=offs)
        else:
            y = torch.bmm(act[:, None], self.w2[flat[order]].transpose(-2, -1))[:, 0]
        y = y.float() * weights.flatten()[order, None]
        out = torch.empty_like(y)
        out[order] = y  # deterministic un-permute (no atomics), so eager and replay agree bit for bit
        return out.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


class MoELayer:
    def __init__(self, gate: torch.Tensor, bias: torch.Tensor, top_k: int, experts: Any):
        self.gate, self.router, self.experts = gate, KimiRouter(bias, top_k), experts
        self.logits: dict[Any, torch.Tensor] = {}  # for the check: kept references, like the design's

    def __call__(self, x: torch.Tensor, key: Any) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],))
        logits = F.linear(h, self.gate)  # [P, E] bf16
        weights, ids = self.router._compute_routing(h, logits, None)
        if key is not None:
            self.logits[key] = logits
        return x + self.experts(h, weights, ids)


class EmbeddingSum:
    """Stand-in experts for --no-experts: sum of the chosen experts' embeddings, weighted."""

    def __init__(self, num_experts: int, hidden: int, device: torch.device, gen: torch.Generator):
        self.table = (torch.randn(num_experts, hidden, device=device, generator=gen) * 0.1).bfloat16()

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return (self.table[ids.long()].float() * weights[..., None]).sum(dim=1).to(x.dtype)


class Model:
    def __init__(self, args: argparse.Namespace, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(0)
        E, H = args.experts, args.hidden
        if args.no_experts:
            sets: list[Any] = [EmbeddingSum(E, H, device, gen)]
        else:
            sets = [Experts(E, H, args.width, device, gen) for _ in range(args.expert_sets)]
        self.layers = [
            MoELayer(
                (torch.randn(E, H, device=device, generator=gen) * H**-0.5).bfloat16(),
                torch.randn(E, device=device, generator=gen) * 0.05,
                args.top_k,
                sets[i % len(sets)],
            )
            for i in range(args.layers)
        ]
        self.sets = sets

    def __call__(self, x: torch.Tensor, key: Any = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, key)
        return x


def check_grouped_mm(model: Model) -> str:
    """Use the grouped GEMM if it runs and agrees with the gather fallback here; else fall back."""
    experts = [s for s in model.sets if isinstance(s, Experts)]
    if not experts:
        return "embedding sum (--no-experts)"
    e = experts[0]
    gen = torch.Generator(device=e.w13.device).manual_seed(1)
    x = torch.randn(16, e.w13.shape[-1], device=e.w13.device, generator=gen).bfloat16()
    ids = torch.rand(16, e.num_experts, device=e.w13.device, generator=gen).topk(8).indices.int()
    w = torch.rand(16, 8, device=e.w13.device, generator=gen)
    try:
        got = e(x, w, ids)
        for s in experts:
            s.grouped = False
        want = e(x, w, ids)
        if torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
            for s in experts:
                s.grouped = True
            return "torch._grouped_mm"
        return f"gather+bmm (grouped_mm disagreed by {(got.float() - want.float()).abs().max().item():.3g})"
    except Exception as exc:  # noqa: BLE001
        for s in experts:
            s.grouped = False
        return f"gather+bmm (grouped_mm failed: {type(exc).__name__}: {str(exc)[:120]})"


# -- the capture variants ------------------------------------------------------------------------------------


# -- the reference ---------------------------------------------------------------------------------------------


def reference_routing(model: Model, key: Any, num_tokens: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """Route the logits this forward computed again, eagerly and independently: ids sorted, weights in id order,
    and whether the K-th and (K+1)-th selection scores tie. [T, L, K], [T, L, K], [T, L]"""
    logits = torch.stack([layer.logits[key][:num_tokens] for layer in model.layers], dim=1)  # [T, L, E] bf16
    bias = torch.stack([layer.router.e_score_correction_bias for layer in model.layers])  # [L, E] fp32
    scores = logits.float().sigmoid()
    top = (scores + bias).topk(top_k + 1, dim=-1)
    ids = top.indices[..., :top_k]
    weights = scores.gather(-1, ids)
    weights = weights / weights.sum(-1, keepdim=True)
    tie = top.values[..., top_k - 1] == top.values[..., top_k]
    ids_sorted, order = ids.sort(dim=-1)
    return ids_sorted.int().cpu(), weights.gather(-1, order).float().cpu(), tie.cpu()


def compare(rows: dict[str, torch.Tensor], ref: tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
    """(rows compared, mismatched rows, mismatched rows explained by a tie), padding rows never included."""
    ref_ids, ref_w, tie = ref
    ids_sorted, order = rows["ids"].long().sort(dim=-1)
    weights = rows["weights"].gather(-1, order)
    same_ids = (ids_sorted.int() == ref_ids).all(-1)
    same_w = torch.isclose(weights, ref_w, atol=1e-6, rtol=1e-5).all(-1)
    bad = ~(same_ids & same_w)
    return int(bad.numel()), int(bad.sum()), int((bad & tie).sum())


# -- running ---------------------------------------------------------------------------------------------------
