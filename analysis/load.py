"""How often each expert is picked, per layer."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from moetrace.analysis.window_rows import WindowRows

CHUNK_ROWS = 1 << 15  # rows counted at a time: their keys, as bincount copies them (2 MB), stay in cache


def expert_load(rows: WindowRows, num_experts: int) -> pl.DataFrame:
    """Per (layer, expert): picks by decode and verification tokens. ``rows``: ``window_rows.decode_and_verify`` of the
    trace (prefill already excluded)."""
    load = ExpertLoad(num_experts)
    load.add(rows)
    return load.frame()


class ExpertLoad:
    """Picks per (layer, expert), counted over rows added a chunk at a time (``window_rows.decode_in_chunks``), with one
    bincount per chunk of rows, not by exploding the lists."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts = np.zeros(0, dtype=np.int64)  # [layers x experts], grown to the largest layer seen

    def add(self, rows: WindowRows) -> None:
        if len(rows.layer) == 0:
            return
        bins = (int(rows.layer.max()) + 1) * self.num_experts
        if bins > len(self.counts):
            self.counts = np.concatenate([self.counts, np.zeros(bins - len(self.counts), dtype=np.int64)])
        # keys in the narrowest type that holds them all: the cheapest to add up (a Python int keeps an array's type)
        key_type: type[np.unsignedinteger[Any]] = np.uint16 if bins <= 1 << 16 else np.uint32
        for start in range(0, len(rows.layer), CHUNK_ROWS):
            layer = rows.layer[start : start + CHUNK_ROWS].astype(key_type)
            keys = layer[:, None] * self.num_experts + rows.experts[start : start + CHUNK_ROWS].astype(key_type)
            self.counts[:bins] += np.bincount(keys.ravel(), minlength=bins)

    def frame(self) -> pl.DataFrame:
        picked = np.flatnonzero(self.counts)
        return pl.DataFrame({
            "layer": (picked // self.num_experts).astype(np.uint16),
            "expert": (picked % self.num_experts).astype(np.uint16),
            "picks": self.counts[picked],
        }, schema={"layer": pl.UInt16(), "expert": pl.UInt16(), "picks": pl.Int64()})
