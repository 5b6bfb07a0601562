"""Bytes one verification step moves, per k: expert weights read, tensor-parallel all-reduce, expert-parallel
dispatch/combine. Sizes come from a ``ModelShape``; expert counts from the growth table of one request's window."""

from __future__ import annotations

import polars as pl

from moetrace.analysis.growth import MEASURED, PER_REQUEST
from moetrace.analysis.shape import ModelShape


def best_window_estimate(growth: pl.LazyFrame) -> pl.LazyFrame:
    """Per (layer, k), the per-request window row: measured where the trace has it, else counterfactual."""
    return (
        growth.filter(pl.col("scope") == PER_REQUEST)
        .sort(pl.col("source") == MEASURED)
        .group_by("layer", "k")
        .last()
    )


def step_bytes(
    growth: pl.LazyFrame, shape: ModelShape, tp: int, ep: int, allreduces_per_layer: int = 2
) -> pl.DataFrame:
    """Per k, for one request verifying k drafts (k+1 tokens):

    - ``expert_weight_bytes``: routed experts (mean unique per layer) and shared experts, over all MoE layers,
      all ranks together;
    - ``busiest_rank_weight_bytes``: what the busiest rank reads (EP: its own experts plus 1/ep of the shared
      experts, which vLLM shards like a dense MLP; TP only: 1/tp of every expert);
    - ``allreduce_bytes``: sent by each rank for the ring all-reduces, 2(tp−1)/tp × tokens × hidden × activation
      bytes, ``allreduces_per_layer`` per decoder layer (attention output and MLP output);
    - ``ep_bytes``: dispatch plus combine, every token's activations to and from each rank holding its experts.
    """
    per_k = (
        best_window_estimate(growth)
        .group_by("k")
        .agg(
            pl.col("source").min(),  # "counterfactual" as soon as one layer is
            pl.col("unique_experts").mean(),
            pl.col("busiest_rank_experts").mean(),
        )
        .sort("k")
        .collect()
    )
    ranks_per_token = (
        best_window_estimate(growth).filter(pl.col("k") == 0).select(pl.col("ranks_touched").mean()).collect().item()
    )
    tokens = pl.col("k") + 1
    per_layer_expert = float(shape.expert_bytes * shape.moe_layers)
    activation_row = float(shape.hidden_size * shape.activation_bytes)
    weights = (pl.col("unique_experts") + shape.shared_experts) * per_layer_expert
    busiest = (  # EP: the shared experts are tensor-parallel over the ranks, as in the cost model (1/ep each)
        (pl.col("busiest_rank_experts") + shape.shared_experts / ep) * per_layer_expert if ep > 1 else weights / tp
    )
    ring = 2.0 * (tp - 1) / tp
    dispatch = 2.0 * shape.moe_layers * (ranks_per_token or 0.0) * activation_row if ep > 1 else 0.0
    return per_k.with_columns(tokens=tokens).select(
        "k",
        "source",
        "tokens",
        "unique_experts",
        weights.alias("expert_weight_bytes"),
        busiest.alias("busiest_rank_weight_bytes"),
        (shape.num_layers * allreduces_per_layer * ring * activation_row * tokens).alias("allreduce_bytes"),
        (dispatch * tokens).cast(pl.Float64).alias("ep_bytes"),
    )
