"""Bytes one step moves per k: expert weights read, all-reduce, expert-parallel dispatch/combine, from the same
per-k inputs the cost model takes (``analysis.deployment`` defines each term once)."""

from __future__ import annotations

import polars as pl

from moetrace.analysis.deployment import Deployment


def step_bytes(per_k: pl.DataFrame, deployment: Deployment, ranks_per_token: float) -> pl.DataFrame:
    """Per k: ``per_k`` (k, tokens: what the step moves, unique_experts, busiest_rank_experts, union_source: what
    ``deployment.batch`` requests' step reads) priced as bytes: ``expert_weight_bytes`` (all ranks),
    ``busiest_rank_weight_bytes``, ``allreduce_bytes`` (sent per rank) and ``ep_bytes``. ``ranks_per_token``: ranks
    one token's experts lie on (EP dispatch). Where the tokens are unknown (null: no acceptance to know them
    from), so are the bytes they move."""
    rows = per_k.sort("k").to_dicts()
    priced = deployment.shape.unpriced_format is None  # else the expert weights' bytes are unknown
    return pl.DataFrame({
        "k": [int(row["k"]) for row in rows],
        "source": [str(row["union_source"]) for row in rows],
        "tokens": [row["tokens"] for row in rows],
        "unique_experts": [float(row["unique_experts"]) for row in rows],
        "expert_weight_bytes": [deployment.expert_weight_bytes(row["unique_experts"]) if priced else None
                                for row in rows],
        "busiest_rank_weight_bytes": [deployment.busiest_rank_weight_bytes(row["unique_experts"],
                                                                           row["busiest_rank_experts"])
                                      if priced else None for row in rows],
        "allreduce_bytes": [None if row["tokens"] is None else deployment.allreduce_bytes(row["tokens"])
                            for row in rows],
        "ep_bytes": [None if row["tokens"] is None else deployment.ep_bytes(row["tokens"], ranks_per_token)
                     for row in rows],
    }, schema={"k": pl.Int32(), "source": pl.String(), "tokens": pl.Float64(), "unique_experts": pl.Float64(),
               "expert_weight_bytes": pl.Float64(), "busiest_rank_weight_bytes": pl.Float64(),
               "allreduce_bytes": pl.Float64(), "ep_bytes": pl.Float64()})
