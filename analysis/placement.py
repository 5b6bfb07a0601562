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
