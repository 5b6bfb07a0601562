"""How often each expert is picked, per layer."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from moetrace.analysis.growth import WindowRows

CHUNK_ROWS = 1 << 15  # rows counted at a time: their keys, as bincount copies them (2 MB), stay in cache


def expert_load(rows: WindowRows, num_experts: int) -> pl.DataFrame:
    """Per (layer, expert): picks by decode and verification tokens. ``rows``: ``growth.decode_and_verify`` of the
    trace (prefill already excluded); counted with one bincount per chunk of rows, not by exploding the lists."""
    if len(rows.layer) == 0:
        return pl.DataFrame(schema={"layer": pl.UInt16(), "expert": pl.UInt16(), "picks": pl.Int64()})
    bins = (int(rows.layer.max()) + 1) * num_experts
    counts = np.zeros(bins, dtype=np.int64)
    # keys in the narrowest type that holds them all: the cheapest to add up (a Python int keeps an array's type)
    key_type: type[np.unsignedinteger[Any]] = np.uint16 if bins <= 1 << 16 else np.uint32
    for start in range(0, len(rows.layer), CHUNK_ROWS):
        layer = rows.layer[start : start + CHUNK_ROWS].astype(key_type)
        keys = layer[:, None] * num_experts + rows.experts[start : start + CHUNK_ROWS].astype(key_type)
        counts += np.bincount(keys.ravel(), minlength=bins)
    picked = np.flatnonzero(counts)
    return pl.DataFrame({
        "layer": (picked // num_experts).astype(np.uint16),
        "expert": (picked % num_experts).astype(np.uint16),
        "picks": counts[picked],
    })
