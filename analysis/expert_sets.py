"""Sets of experts as bitsets: one row of uint64 words per token (or window), bit ``e`` set when expert ``e`` is in
the set. Unions are bitwise ORs and set sizes are popcounts, so unique-expert counts over windows cost a few
vectorised word operations instead of a hash per (window, expert) pair."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

WORD_BITS = 64

Masks = npt.NDArray[np.uint64]


def words_for(num_experts: int) -> int:
    return (num_experts + WORD_BITS - 1) // WORD_BITS


def expert_masks(experts: npt.NDArray[np.integer], num_experts: int) -> Masks:
    """``experts`` [rows, slots] of distinct expert ids per row -> bitsets [rows, words]."""
    rows, slots = experts.shape
    words = words_for(num_experts)
    flat = np.zeros(rows * words, dtype=np.uint64)
    row_base = np.arange(rows, dtype=np.int64) * words
    ids = experts.astype(np.int64, copy=False)
    for slot in range(slots):  # a handful of slots; each assignment is vectorised over all rows
        column = ids[:, slot]
        flat[row_base + (column >> 6)] |= np.left_shift(np.uint64(1), (column & 63).astype(np.uint64))
    return flat.reshape(rows, words)


def count_experts(masks: Masks) -> npt.NDArray[np.int64]:
    """Set size per row."""
    counts: npt.NDArray[np.int64] = np.bitwise_count(masks).sum(axis=1, dtype=np.int64)
    return counts


def group_union(masks: Masks, group_starts: npt.NDArray[np.int64]) -> Masks:
    """Union of contiguous row groups; ``group_starts`` are the first row of each group, ascending."""
    if len(group_starts) == 0:
        return np.zeros((0, masks.shape[1]), dtype=np.uint64)
    return np.bitwise_or.reduceat(masks, group_starts, axis=0)


def group_starts(*keys: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """First row of every run of equal keys (rows sorted so that equal keys are contiguous)."""
    length = len(keys[0]) if keys else 0
    if length == 0:
        return np.zeros(0, dtype=np.int64)
    change = np.zeros(length, dtype=bool)
    change[0] = True
    for key in keys:
        change[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(change).astype(np.int64)


def rank_masks(expert_rank: npt.NDArray[np.integer], num_experts: int) -> Masks:
    """One bitset per rank holding the experts placed on it; ``expert_rank[e]`` is the rank of expert ``e``."""
    num_ranks = int(expert_rank.max()) + 1
    per_expert = expert_masks(np.arange(len(expert_rank))[:, None], num_experts)
    return np.stack([np.bitwise_or.reduce(per_expert[expert_rank == rank], axis=0) for rank in range(num_ranks)])


def per_rank_counts(masks: Masks, ranks: Masks) -> npt.NDArray[np.int64]:
    """[rows, ranks]: how many of each row's experts live on each rank."""
    return np.stack([count_experts(masks & rank) for rank in ranks], axis=1)
