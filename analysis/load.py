"""How often each expert is picked, per layer."""

from __future__ import annotations

import polars as pl


def expert_load(routing: pl.LazyFrame) -> pl.DataFrame:
    """Per (layer, expert): picks by decode and verification tokens (prefill excluded)."""
    return (
        routing.filter(pl.col("phase").cast(pl.String) != "prefill")
        .select("layer", pl.col("experts").arr.to_list().alias("expert"))
        .explode("expert")
        .group_by("layer", "expert")
        .agg(picks=pl.len().cast(pl.Int64))
        .sort("layer", "expert")
        .collect()
    )
