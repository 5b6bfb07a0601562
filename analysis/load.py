"""How often each expert is picked, per layer."""

from __future__ import annotations

import numpy as np
import polars as pl

from moetrace.analysis.growth import WindowRows

CHUNK_ROWS = 4_000_000  # rows counted at a time: their flattened keys stay around 128 MB


def expert_load(rows: WindowRows, num_experts: int) -> pl.DataFrame:
    """Per (layer, expert): picks by decode and verification tokens. ``rows``: ``growth.decode_and_verify`` of the
    trace (prefill already excluded); counted with one bincount per chunk of rows, not by exploding the lists."""
    if len(rows.layer) == 0:
        return pl.DataFrame(schema={"layer": pl.UInt16(), "expert": pl.UInt16(), "picks": pl.Int64()})
    bins = (int(rows.layer.max()) + 1) * num_experts
    counts = np.zeros(bins, dtype=np.int64)
    for start in range(0, len(rows.layer), CHUNK_ROWS):
        layer = rows.layer[start : start + CHUNK_ROWS].astype(np.int32)
        keys = layer[:, None] * num_experts + rows.experts[start : start + CHUNK_ROWS]
        counts += np.bincount(keys.ravel(), minlength=bins)
    picked = np.flatnonzero(counts)
    return pl.DataFrame({
        "layer": (picked // num_experts).astype(np.uint16),
        "expert": (picked % num_experts).astype(np.uint16),
        "picks": counts[picked],
    })
