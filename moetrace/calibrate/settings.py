"""What a calibration measures (``Settings``: Kimi-K2's shape and the per-rank slices of TP=8 and EP=8 by default)
and the grids it measures over: the expert configurations and their (unique experts, routed rows) points, the
all-reduce's message sizes and world sizes. Plain data, no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

Progress = Callable[[str, int, int], None]  # (stage label, done, total)

DECODE_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
BANDWIDTH_BYTES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
# a drafter's passes: B tokens (the later passes) and B·(k+1) (the first), k ≤ 7 at up to 64 requests
DRAFTER_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# attention: requests, query tokens a request (k + 1 for k = 0, 1, 2, 4) and contexts up to Kimi-K2.5's 256K
ATTENTION_BATCHES = (1, 4, 16, 64)
ATTENTION_QUERIES = (1, 2, 3, 5)
ATTENTION_CONTEXTS = (512, 2048, 8192, 32768, 131072, 262144)


@dataclass(frozen=True)
class Settings:
    """What to measure. The defaults are Kimi-K2's shape and the per-rank slices of TP=8 and EP=8."""

    device: str = "cuda"
    hidden: int = 7168
    expert_width: int = 2048
    num_experts: int = 384
    top_k: int = 8
    tp: int = 8
    ep: int = 8
    formats: tuple[str, ...] = ("bf16", "fp8")
    int4_group_size: int = 32
    vllm_kernel: bool = False  # also time vLLM's own fused_experts (TP configs, bf16), kept as a table
    allreduce: bool = True
    max_gpus: int | None = None
    quick: bool = False
    reps: int = 8
    replays: int = 7
    tokens: tuple[int, ...] = DECODE_TOKENS  # every decode size to 6 (k ≤ 5 at one request): vLLM's kernel steps
    ep_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    allreduce_tokens: tuple[int, ...] = DECODE_TOKENS
    allreduce_bandwidth_bytes: tuple[int, ...] = BANDWIDTH_BYTES
    allreduce_iters: int = 50
    allreduce_replays: int = 5
    drafter: str | None = None  # a drafter checkpoint's folder: its forward passes are timed too
    drafter_tokens: tuple[int, ...] = DRAFTER_TOKENS
    attention: bool = True  # MLA decode over (requests, query tokens, context); Kimi-K2's attention by default
    attention_heads: int = 64  # all ranks': each rank runs attention_heads / tp (at least one)
    kv_lora_rank: int = 512
    rope_dim: int = 64
    attention_batches: tuple[int, ...] = ATTENTION_BATCHES
    attention_queries: tuple[int, ...] = ATTENTION_QUERIES
    attention_contexts: tuple[int, ...] = ATTENTION_CONTEXTS
    command: str = field(default="", compare=False)

    @classmethod
    def quick_settings(cls, device: str, **overrides: Any) -> Settings:
        """A smoke run in seconds: a small model shape, a small grid, few repetitions."""
        base = cls(device=device, hidden=256, expert_width=256, num_experts=32, top_k=4, tp=2, ep=2, quick=True,
                   reps=2, replays=2, tokens=(1, 2, 4), ep_rows=(1, 2, 4, 8), allreduce_tokens=(1, 2, 4),
                   drafter_tokens=(1, 2, 4, 8), attention_heads=4, kv_lora_rank=32, rope_dim=16,
                   attention_batches=(1, 2), attention_queries=(1, 3), attention_contexts=(64, 256),
                   allreduce_bandwidth_bytes=(), allreduce_iters=5, allreduce_replays=2)
        return replace(base, **overrides)

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.attention_heads // self.tp)

    def check(self) -> None:
        if self.expert_width % self.tp:
            raise ValueError(f"expert width {self.expert_width} does not split over tp={self.tp}")
        if self.num_experts % self.ep:
            raise ValueError(f"{self.num_experts} experts do not split over ep={self.ep}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top-k {self.top_k} exceeds {self.num_experts} experts")
        unknown = set(self.formats) - {"bf16", "fp8"}
        if unknown:
            raise ValueError(f"unknown weight format(s) {', '.join(sorted(unknown))} (known: bf16, fp8)")


@dataclass(frozen=True)
class ExpertConfig:
    name: str  # "tp8": experts split by tensor parallelism; "ep8": whole experts, split by expert parallelism
    tp: int
    ep: int
    width: int  # per-rank expert width
    pool: int  # experts one rank holds
    grid: tuple[tuple[int, int], ...]  # (unique experts, routed rows) points


def expert_configs(s: Settings) -> list[ExpertConfig]:
    """TP: every rank holds a 1/tp slice of every expert and computes all unique experts of the step (at least
    top_k, at most top_k·tokens). EP: a rank holds num_experts/ep whole experts and computes those routed to it."""
    choices = sorted({s.top_k * m for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)} | {s.num_experts})
    tp_grid = [
        (experts, s.top_k * tokens)
        for tokens in s.tokens
        for experts in choices
        if experts <= min(s.num_experts, s.top_k * tokens)
    ]
    per_rank = s.num_experts // s.ep
    ep_choices = sorted({1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128} & set(range(1, per_rank + 1)) | {per_rank})
    ep_grid = [(experts, rows) for rows in s.ep_rows for experts in ep_choices if experts <= rows]
    configs = [ExpertConfig(f"tp{s.tp}", s.tp, 1, s.expert_width // s.tp, s.num_experts, tuple(tp_grid))]
    if s.ep > 1:
        configs.append(ExpertConfig(f"ep{s.ep}", 1, s.ep, s.expert_width, per_rank, tuple(ep_grid)))
    return configs


def allreduce_sizes(s: Settings) -> list[tuple[int | None, int]]:
    """(tokens or None, bytes): bf16 hidden states of each decode size, then larger messages for the bandwidth."""
    return [(t, t * s.hidden * 2) for t in s.allreduce_tokens] + [(None, b) for b in s.allreduce_bandwidth_bytes]


def allreduce_world_sizes(gpus: int) -> list[int]:
    """2, 4, 8, … up to the devices present, and the device count itself."""
    sizes = {n for n in (2, 4, 8, 16, 32) if n <= gpus}
    if gpus >= 2:
        sizes.add(gpus)
    return sorted(sizes)
