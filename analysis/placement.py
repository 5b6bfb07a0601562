"""Which expert-parallel rank holds which expert."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

def linear_placement(num_experts: int, ep: int) -> npt.NDArray[np.int64]:
    """Contiguous blocks in rank order, as vLLM places experts by default: every rank N // ep experts, the first
    N % ep ranks one more; ``ep=1`` puts every expert on rank 0."""
    if ep < 1:
        raise ValueError(f"expert-parallel size must be at least 1, got {ep}")
    base, extra = divmod(num_experts, ep)
    return np.repeat(np.arange(ep, dtype=np.int64), [base + (rank < extra) for rank in range(ep)])


def round_robin_placement(num_experts: int, ep: int) -> npt.NDArray[np.int64]:
    """Rank ``r`` holds experts ``r, r+ep, r+2·ep, ...`` (vLLM's ``expert_placement_strategy="round_robin"``)."""
    if ep < 1:
        raise ValueError(f"expert-parallel size must be at least 1, got {ep}")
    return np.arange(num_experts, dtype=np.int64) % ep


def explicit_placement(expert_rank: Sequence[int], num_experts: int) -> npt.NDArray[np.int64]:
    """A placement given as the rank of every expert, checked for length and range."""
    ranks = np.asarray(expert_rank, dtype=np.int64)
    if ranks.ndim != 1 or len(ranks) != num_experts:
        raise ValueError(f"placement lists {ranks.size} experts, the model has {num_experts}")
    if len(ranks) and ranks.min() < 0:
        raise ValueError("placement has a negative rank")
    return ranks


def replicated_placement(picks: Sequence[int], ep: int, redundant: int) -> npt.NDArray[np.int64]:
    """One layer's physical slots under expert parallelism with ``redundant`` extra replicas: the logical expert in
    each of the ``len(picks) + redundant`` slots, rank r holding the r-th block of equal size (as SGLang's
    ``physical_to_logical_map`` lays them out). Each extra replica goes to the expert with the most picks per
    replica (ties: the lower id); then replicas, heaviest first (picks split evenly among an expert's replicas),
    each take the free slot of the least-loaded rank with room."""
    load = np.asarray(picks, dtype=np.float64)
    slots = len(load) + redundant
    if ep < 1 or redundant < 0 or slots % ep:
        raise ValueError(f"{len(load)} experts + {redundant} redundant do not split evenly over {ep} ranks")
    replicas = np.ones(len(load), dtype=np.int64)
    for _ in range(redundant):
        replicas[int(np.argmax(load / replicas))] += 1
    share = load / replicas
    order = sorted(((share[e], e) for e in range(len(load)) for _ in range(replicas[e])), key=lambda s: (-s[0], s[1]))
    per_rank = slots // ep
    rank_load = np.zeros(ep)
    held: list[list[int]] = [[] for _ in range(ep)]
    for weight, expert in order:
        rank = min((r for r in range(ep) if len(held[r]) < per_rank), key=lambda r: (rank_load[r], r))
        held[rank].append(expert)
        rank_load[rank] += weight
    return np.asarray([expert for rank in held for expert in rank], dtype=np.int64)
