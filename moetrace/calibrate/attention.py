"""Attention time against context: one layer's MLA decode on one rank for B requests × Q query tokens (a verify step's
k + 1) over a context of L tokens each, the cost that grows with context where the experts' does not.

MLA (Kimi, DeepSeek) caches one latent of ``kv_lora_rank + rope_dim`` values per token and layer, shared by every
head, so a decode step reads each request's latent cache once for all its query heads. A verify step's k + 1 queries
are read against one cache, as vLLM's MLA decode kernels take them (FlashMLA's ``s_q × h_q``): the cache is read once
per request, and the work per byte grows with the queries. On CUDA with vLLM installed the kernel is vLLM's own, the
first within tolerance of the reference on a small case: FlashMLA (its Hopper backend's), then the Triton MLA decode
(TRITON_MLA's, the queries folded into the heads); elsewhere (the CPU, a smoke run) the reference: the absorbed
attention as two batched matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import torch

from moetrace.calibrate.experts import time_calls

# T = B·Q query rows, H heads per rank, D = latent + rope width, C = latent width, L context tokens, P pages
PAGE_TOKENS = 64  # vLLM's MLA block size on Hopper (FlashMLA's)
DISTINCT_BYTES = 256 << 20  # small caches are timed over up to 4 copies (the smallest still fit L2: a lower bound)
KERNEL_TOLERANCE = 0.05  # bf16 outputs of order 1: vLLM's kernel is used only within this of the reference
Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (query, cache) → the attention's output


class KernelMaker(Protocol):  # a kernel for (batch, queries, context), its queries causal or not
    def __call__(self, batch: int, queries: int, context: int, causal: bool = True) -> Kernel: ...


def fit_attention(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Least squares per (query count, requests): ``time_us = c0_us + per_context_token_us · L``, with its largest
    relative miss. Per requests, not one plane over B·L: a decode of one request cannot spread its cache read over
    the device as 64 can (on an H100, FlashMLA reads a token of one request's cache at a third of the rate it reads
    64 requests' tokens). A (queries, requests) timed at one context alone (the others out of memory) gets no line:
    the report reads it between the request counts that have one."""
    fits = []
    for queries, batch in sorted({(int(p["queries"]), int(p["batch"])) for p in points}):
        mine = [p for p in points if (p["queries"], p["batch"]) == (queries, batch)]
        if len({p["context"] for p in mine}) < 2:
            continue
        a = torch.tensor([[1.0, p["context"]] for p in mine], dtype=torch.float64)
        y = torch.tensor([p["time_us"] for p in mine], dtype=torch.float64)
        # rows weighted by 1/y: relative misses, so the short contexts count as much as the long
        coef = torch.linalg.lstsq(a / y[:, None], torch.ones_like(y)).solution
        predicted = a @ coef
        fits.append({"queries": queries, "batch": batch, "c0_us": float(coef[0]),
                     "per_context_token_us": float(coef[1]),
                     "max_relative_miss": float(((predicted - y).abs() / y).max())})
    return fits


def kv_splits(context: int, sms: int) -> int:
    """The kv splits vLLM's TRITON_MLA backend runs a context in: a power of two, 512 tokens or more a split, at most
    two per multiprocessor."""
    return min(1 << max(0, (max(1, context // 512) - 1).bit_length()), 2 * sms)


class MlaDecode:
    """One MLA layer's decode on ``device``: a latent cache of ``batch`` requests × ``context`` tokens and a query of
    ``queries`` tokens × ``heads`` heads per request."""

    def __init__(self, heads: int, latent: int, rope: int, device: torch.device) -> None:
        self.heads, self.latent, self.width, self.device = heads, latent, latent + rope, device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.scale = 1.0 / math.sqrt(192)  # DeepSeek-V3's q/k head width (nope 128 + rope 64), as the engine scales
        self.generator = torch.Generator(device=device).manual_seed(0)

    def _random(self, *dims: int) -> torch.Tensor:
        # drawn in the timed dtype: a float32 draw then cast would need three times a bf16 cache's memory
        return torch.randn(dims, generator=self.generator, device=self.device, dtype=self.dtype)

    def copies(self, batch: int, context: int) -> int:
        cache_bytes = batch * context * self.width * (2 if self.dtype == torch.bfloat16 else 4)
        return max(1, min(4, DISTINCT_BYTES // max(1, cache_bytes)))

    def reference(self, query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The absorbed attention in two batched matmuls: scores of the B × (Q·H) queries over each request's
        cache, softmax, then the weighted latents."""
        scores = torch.bmm(query, cache.transpose(1, 2)).float() * self.scale  # B × Q·H × L
        return torch.bmm(scores.softmax(-1).to(cache.dtype), cache[..., : self.latent])  # B × Q·H × C

    def reference_call(self, batch: int, queries: int, context: int) -> Callable[[int], torch.Tensor]:
        caches = [self._random(batch, context, self.width) for _ in range(self.copies(batch, context))]  # B × L × D
        query = self._random(batch, queries * self.heads, self.width)  # B × Q·H × D
        return lambda i: self.reference(query, caches[i % len(caches)])

    def triton_kernel(self, batch: int, queries: int, context: int, causal: bool = True) -> Kernel:
        """vLLM's Triton MLA decode of a B × Q·H × D query over a paged cache (P × page × 1 × D, ``PAGE_TOKENS`` a
        page, each request's pages in a row), with the kv splits the TRITON_MLA backend picks for this context. It
        decodes one token a request: the Q queries, folded into the heads, each see the whole cache (``causal`` has
        no effect)."""
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

        block_table, seq_lens = self.paging(batch, context)
        splits = kv_splits(context, torch.cuda.get_device_properties(self.device).multi_processor_count)
        rows = queries * self.heads
        logits = torch.empty(batch, rows, splits, self.latent + 1, dtype=torch.float32, device=self.device)
        out = torch.empty(batch, rows, self.latent, dtype=self.dtype, device=self.device)
        lse = torch.empty(batch, rows, dtype=self.dtype, device=self.device)
        unit = torch.ones((), dtype=torch.float32, device=self.device)  # no host copy inside a captured graph

        def kernel(query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            decode_attention_fwd(  # type: ignore[no-untyped-call]
                query, cache, cache[..., : self.latent], out, lse, block_table, seq_lens, logits, splits, self.scale,
                PAGE_TOKENS, k_scale=unit, v_scale=unit, is_mla=True)
            return out

        return kernel

    def flashmla_kernel(self, batch: int, queries: int, context: int, causal: bool = True) -> Kernel:
        """vLLM's FlashMLA decode (its FLASHMLA backend on Hopper), which takes a verify step's queries as they come:
        B × Q × H × D, causal among the Q, over the same paged cache as ``triton_kernel``."""
        # exported where vLLM was built with FlashMLA
        from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata  # type: ignore[attr-defined]

        block_table, seq_lens = self.paging(batch, context)
        schedule, _ = get_mla_metadata(seq_lens, queries * self.heads, 1, is_fp8_kvcache=False)

        def kernel(query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            out, _ = flash_mla_with_kvcache(
                q=query.view(batch, queries, self.heads, self.width), k_cache=cache, block_table=block_table,
                cache_seqlens=seq_lens, head_dim_v=self.latent, tile_scheduler_metadata=schedule,
                softmax_scale=self.scale, causal=causal, is_fp8_kvcache=False)
            return torch.as_tensor(out).reshape(batch, queries * self.heads, self.latent)

        return kernel

    def paging(self, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table (each request's pages in a row) and the context lengths of a paged cache."""
        pages = -(-context // PAGE_TOKENS)
        block_table = torch.arange(batch * pages, dtype=torch.int32, device=self.device).view(batch, pages)
        return block_table, torch.full((batch,), context, dtype=torch.int32, device=self.device)

    def pages(self, batch: int, context: int) -> torch.Tensor:
        return self._random(batch * -(-context // PAGE_TOKENS), PAGE_TOKENS, 1, self.width)

    def paged_call(self, make: KernelMaker, batch: int, queries: int, context: int) -> Callable[[int], torch.Tensor]:
        kernel = make(batch, queries, context)
        caches = [self.pages(batch, context) for _ in range(self.copies(batch, context))]
        query = self._random(batch, queries * self.heads, self.width)
        return lambda i: kernel(query, caches[i % len(caches)])

    def engine_kernels(self) -> dict[str, KernelMaker]:
        """vLLM's MLA decode kernels that can run here, the one its Hopper backend serves first: FlashMLA (a 512-wide
        latent on Hopper), then the Triton decode; none off CUDA or without vLLM."""
        if self.device.type != "cuda":
            return {}
        kernels: dict[str, KernelMaker] = {}
        try:
            from vllm.v1.attention.ops.flashmla import is_flashmla_dense_supported

            if self.latent == 512 and is_flashmla_dense_supported()[0]:
                kernels["vLLM FlashMLA decode (flash_mla_with_kvcache), queries causal"] = self.flashmla_kernel
        except ImportError:
            pass
        try:
            import vllm.v1.attention.ops.triton_decode_attention  # noqa: F401

            kernels["vLLM Triton MLA decode (decode_attention_fwd), queries folded into the heads"] = self.triton_kernel
        except ImportError:
            pass
        return kernels

    def error(self, make: KernelMaker) -> float:
        """A kernel against the reference on one small case, its queries not causal (largest absolute difference)."""
        batch, queries, context = 2, 3, 4 * PAGE_TOKENS
        cache = self.pages(batch, context)
        query = self._random(batch, queries * self.heads, self.width)
        theirs = make(batch, queries, context, causal=False)(query, cache).float()
        ours = self.reference(query.float(), cache.float().view(batch, context, self.width))
        return float((theirs - ours).abs().max())


def attention_grid(batches: Sequence[int], queries: Sequence[int], contexts: Sequence[int], heads: int, latent: int,
                   rope: int, sms: int, max_bytes: float) -> list[tuple[int, int, int]]:
    """(batch, queries, context) points whose bf16 latent cache and the kernel's float32 partial results (one per kv
    split, at most 2 per multiprocessor, ``sms``) fit ``max_bytes``, contexts outermost."""
    def needs(b: int, q: int, c: int) -> int:
        return b * c * (latent + rope) * 2 + b * q * heads * kv_splits(c, sms) * (latent + 1) * 4

    return [(b, q, c) for c in contexts for b in batches for q in queries if needs(b, q, c) <= max_bytes]


def measure_attention(heads: int, latent: int, rope: int, grid: Sequence[tuple[int, int, int]],
                      device: torch.device, reps: int, replays: int,
                      progress: Callable[[int, int], None]) -> dict[str, Any]:
    """The calibration's ``attention`` section: every point's µs (a point out of memory skipped), the line over
    context per (queries, requests), the kernel timed and how each of vLLM's kernels tried compared with the
    reference."""
    decode = MlaDecode(heads, latent, rope, device)
    kernel = "reference: absorbed MLA as two batched matmuls (torch)"
    checked: dict[str, float | str] = {}  # each engine kernel tried: its difference from the reference, or why not
    call: Callable[[int, int, int], Callable[[int], torch.Tensor]] = decode.reference_call
    for name, make in decode.engine_kernels().items():  # the first within tolerance of the reference is timed
        try:
            error = decode.error(make)
        except Exception as exc:  # a kernel that cannot run this shape here: the next one
            checked[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            continue
        checked[name] = round(error, 5)
        if error <= KERNEL_TOLERANCE:
            kernel, call = name, partial(decode.paged_call, make)
            break
    points, modes, skipped = [], set(), []
    for done, (batch, queries, context) in enumerate(grid):
        try:
            time_us, mode = time_calls(call(batch, queries, context), device, reps, replays)
        except torch.OutOfMemoryError:  # one point past the memory left must not lose the others
            skipped.append({"batch": batch, "queries": queries, "context": context, "why": "out of memory"})
        else:
            modes.add(mode)
            points.append({"batch": batch, "queries": queries, "context": context, "time_us": time_us})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        progress(done + 1, len(grid))
    return {
        # vLLM serves a verify step's k + 1 queries through FlashMLA or FlashAttention-MLA on Hopper (TRITON_MLA
        # takes one query a request): the Triton kernel stands in where FlashMLA cannot run, reading each cache once
        "kernel": kernel, "kernels_checked": checked, "skipped_points": skipped,
        "heads_per_rank": heads, "kv_lora_rank": latent, "rope_dim": rope,
        "kv_bytes_per_token_layer": (latent + rope) * 2, "dtype": str(decode.dtype).removeprefix("torch."),
        "page_tokens": PAGE_TOKENS, "timing": sorted(modes), "points": points, "fit": fit_attention(points),
    }
