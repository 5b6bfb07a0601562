"""Sets of experts as bitsets: one row of uint64 words per token (or window), bit ``e`` set when expert ``e`` is in
the set. Unions are bitwise ORs and set sizes are popcounts, so unique-expert counts over windows cost a few
vectorised word operations instead of a hash per (window, expert) pair."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt

WORD_BITS = 64

Masks = npt.NDArray[np.uint64]


def words_for(num_experts: int) -> int:
    return (num_experts + WORD_BITS - 1) // WORD_BITS


def expert_lut(num_experts: int) -> Masks:
    """[num_experts, words]: the one-expert bitset of every expert (expert ``e`` is bit ``e % 64`` of word
    ``e // 64``)."""
    experts = np.arange(num_experts)
    lut = np.zeros((num_experts, words_for(num_experts)), dtype=np.uint64)
    lut[experts, experts >> 6] = np.left_shift(np.uint64(1), (experts & 63).astype(np.uint64))
    return lut


class Scratch:
    """Reusable work buffers for code that runs the same large temporaries chunk after chunk: fresh allocations
    of many megabytes come as fresh pages, and faulting those in costs as much as the arithmetic. An array handed
    out is valid until the same name is asked for again."""

    def __init__(self) -> None:
        self._buffers: dict[str, npt.NDArray[np.uint8]] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: type[np.generic]) -> npt.NDArray[Any]:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buffer = self._buffers.get(name)
        if buffer is None or len(buffer) < size:
            buffer = self._buffers[name] = np.empty(size + size // 4, dtype=np.uint8)
        return buffer[:size].view(dtype).reshape(shape)


def _work(scratch: Scratch | None, name: str, shape: tuple[int, ...], dtype: type[np.generic]) -> npt.NDArray[Any]:
    return np.empty(shape, dtype=dtype) if scratch is None else scratch.array(name, shape, dtype)


PAIR_TABLE_BYTES = 1 << 20
"""Largest table of expert pairs to build: one look-up per pair pays while the table stays in the CPU's cache (128
experts: 256 KiB, 1.4x faster than one per slot on the 2-core CI machine); past it each look-up misses (384 experts:
147,456 pairs x 48 bytes = 7 MiB, 1.3-2x slower than one per slot)."""


class MaskTable:
    """Turns expert ids into bitsets by table look-up: one look-up and one OR per pair of slots (or per slot, where
    the table of pairs would be too large), each vectorised over all rows."""

    def __init__(self, num_experts: int, pairs: bool = True) -> None:
        self.num_experts = num_experts
        self.single = expert_lut(num_experts)
        self.pairs: Masks | None = None
        if pairs and num_experts * num_experts * self.single.shape[1] * self.single.itemsize <= PAIR_TABLE_BYTES:
            self.pairs = (self.single[:, None, :] | self.single[None, :, :]).reshape(num_experts * num_experts, -1)

    def masks(self, experts: npt.NDArray[np.integer], scratch: Scratch | None = None) -> Masks:
        """``experts`` [..., slots] of expert ids -> bitsets [..., words] (in ``scratch``'s "masks" when given)."""
        slots = experts.shape[-1]
        flat = experts.reshape(-1, slots)
        rows, words = len(flat), self.single.shape[1]
        out: Masks = _work(scratch, "masks", (rows, words), np.uint64)
        if self.pairs is None or slots < 2:
            out.fill(0)  # else the first pair's look-up fills it
        if rows == 0 or slots == 0:
            return out.reshape(*experts.shape[:-1], words)
        if int(flat.min()) < 0 or int(flat.max()) >= self.num_experts:
            raise ValueError(f"expert ids must lie in 0..{self.num_experts - 1}")
        buffer = _work(scratch, "masks.buffer", (rows, words), np.uint64)
        # ``out=`` with mode="clip" writes in place (mode="raise" would buffer); the ids are checked above
        singles = range(slots)
        if self.pairs is not None:
            pair = _work(scratch, "masks.pair", (rows,), np.intp)
            for slot in range(0, slots - 1, 2):
                np.multiply(flat[:, slot], self.num_experts, out=pair, dtype=np.intp)
                np.add(pair, flat[:, slot + 1], out=pair)
                np.take(self.pairs, pair, axis=0, out=buffer if slot else out, mode="clip")
                if slot:
                    out |= buffer
            singles = range(slots - slots % 2, slots)
        for slot in singles:
            np.take(self.single, flat[:, slot], axis=0, out=buffer, mode="clip")
            out |= buffer
        return out.reshape(*experts.shape[:-1], words)


@functools.lru_cache(maxsize=4)
def _mask_table(num_experts: int) -> MaskTable:
    return MaskTable(num_experts)  # built once per expert count: its table of pairs takes milliseconds to build


def expert_masks(experts: npt.NDArray[np.integer], num_experts: int) -> Masks:
    """``experts`` [rows, slots] of expert ids per row -> bitsets [rows, words]."""
    return _mask_table(num_experts).masks(experts)


def window_union(
    masks: Masks, starts: npt.NDArray[np.int64], width: int | npt.NDArray[np.int64], scratch: Scratch | None = None,
    name: str = "union"
) -> Masks:
    """Union of the ``width`` consecutive rows (along axis 0) that start at each of ``starts`` (in ``scratch``'s
    ``name`` when given). ``width``: one for every window, or one per window, widest first (so that the windows
    still open at each offset are a prefix)."""
    shape = (len(starts), *masks.shape[1:])
    out: Masks = _work(scratch, name, shape, np.uint64)
    if len(starts) == 0:
        return out
    widths = np.broadcast_to(np.asarray(width, dtype=np.int64), (len(starts),))
    if bool(np.any(np.diff(widths) > 0)):
        raise ValueError("windows must come widest first")
    if int(starts.min()) < 0 or int((starts + widths).max()) > len(masks) or int(widths.min()) < 1:
        raise IndexError("window beyond the rows")
    np.take(masks, starts, axis=0, out=out, mode="clip")  # in place: mode="raise" would buffer
    buffer = _work(scratch, "union.buffer", shape, np.uint64)  # shared: used only within this call
    # the windows still open at each offset: widths are non-increasing, so a prefix (-widths ascending)
    open_at = np.searchsorted(-widths, -np.arange(1, int(widths[0])), side="left")
    for offset, count in enumerate(open_at.tolist(), start=1):
        np.take(masks, starts[:count] + offset, axis=0, out=buffer[:count], mode="clip")
        out[:count] |= buffer[:count]
    return out


def count_experts(masks: Masks) -> npt.NDArray[np.int64]:
    """Set size per row."""
    counts: npt.NDArray[np.int64] = np.bitwise_count(masks).sum(axis=1, dtype=np.int64)
    return counts


def group_union(masks: Masks, group_starts: npt.NDArray[np.int64]) -> Masks:
    """Union of contiguous row groups; ``group_starts`` are the first row of each group, ascending (``masks`` itself
    where every group is one row)."""
    if len(group_starts) == 0:
        return np.zeros((0, masks.shape[1]), dtype=np.uint64)
    if len(group_starts) == len(masks):  # a group per row (plain decoding, one token a request-step): the rows
        return masks
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


def group_of_row(starts: npt.NDArray[np.int64], rows: int) -> npt.NDArray[np.int64]:
    """Each of ``rows`` rows' group, numbered from 0, from the groups' first rows (``group_starts``)."""
    return np.repeat(np.arange(len(starts)), np.diff(np.append(starts, rows)))


def looked_up(keys: npt.NDArray[np.integer], values: npt.NDArray[Any], wanted: npt.NDArray[np.integer],
              missing: Any) -> npt.NDArray[Any]:
    """The value of each ``wanted`` key in ascending, distinct ``keys``; ``missing`` where absent (one value, or one
    per wanted key)."""
    if len(keys) == 0:
        return np.broadcast_to(np.asarray(missing, dtype=values.dtype), wanted.shape).copy()
    at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    return np.where(keys[at] == wanted, values[at], missing)


def rank_masks(expert_rank: npt.NDArray[np.integer], num_experts: int) -> Masks:
    """One bitset per rank holding the experts placed on it; ``expert_rank[e]`` is the rank of expert ``e``."""
    num_ranks = int(expert_rank.max()) + 1
    per_expert = expert_masks(np.arange(len(expert_rank))[:, None], num_experts)
    return np.stack([np.bitwise_or.reduce(per_expert[expert_rank == rank], axis=0) for rank in range(num_ranks)])


def per_rank_counts(masks: Masks, ranks: Masks) -> npt.NDArray[np.int64]:
    """[rows, ranks]: how many of each row's experts live on each rank."""
    return np.stack([count_experts(masks & rank) for rank in ranks], axis=1)
