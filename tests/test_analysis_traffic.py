"""Bytes per step and acceptance, checked against hand computation."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from moetrace.analysis.acceptance import (
    acceptance_by_position,
    acceptance_summary,
    decode_step_periods,
    measured_speedup,
    step_times,
)
from moetrace.analysis.cost import Deployment
from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.analysis.traffic import step_bytes
from trace_builder import Model, routing_frame, steps_frame, verify_tokens

SHAPE = ModelShape(
    num_experts=16,
    top_k=2,
    num_layers=3,
    moe_layers=2,
    hidden_size=100,
    expert_width=10,
    shared_experts=1,
    expert_weight_bits=4,
    quant_group_size=10,
)


def _growth() -> pl.LazyFrame:
    rows = [
        # layer, k, source, scope, unique, busiest, ranks touched
        (1, 0, "measured", "request", 2.0, 1.0, 1.5),
        (2, 0, "measured", "request", 2.0, 2.0, 2.5),
        (1, 1, "measured", "request", 4.0, 2.0, 2.0),
        (2, 1, "measured", "request", 3.0, 2.0, 2.0),
        (1, 1, "counterfactual", "request", 99.0, 99.0, 9.0),  # measured wins where both exist
        (2, 1, "measured", "batch", 99.0, 99.0, 9.0),  # batch rows do not price one request
        (1, 2, "counterfactual", "request", 5.0, 3.0, 3.0),
        (2, 2, "counterfactual", "request", 6.0, 3.0, 3.0),
    ]
    columns = ["layer", "k", "source", "scope", "unique_experts", "busiest_rank_experts", "ranks_touched"]
    return pl.DataFrame(rows, schema=columns, orient="row").lazy()


def test_expert_bytes_include_scales() -> None:
    # 3 matrices of 100x10 int4 = 1500 bytes, plus one bf16 scale per 10 weights = 600 bytes
    assert SHAPE.expert_bytes == 2100
    kimi = SHAPE_PRESETS["kimi-k2"]
    assert kimi.expert_bytes == 3 * 7168 * 2048 // 2 + 3 * 7168 * 2048 // 32 * 2


def test_step_bytes_under_tensor_parallelism() -> None:
    table = step_bytes(_growth(), SHAPE, tp=4, ep=1).to_dicts()
    assert [row["k"] for row in table] == [0, 1, 2]
    assert [row["source"] for row in table] == ["measured", "measured", "counterfactual"]
    k1 = table[1]
    assert k1["tokens"] == 2
    assert k1["expert_weight_bytes"] == pytest.approx((3.5 + 1) * 2100 * 2)
    assert k1["busiest_rank_weight_bytes"] == pytest.approx((3.5 + 1) * 2100 * 2 / 4)
    # 3 layers x 2 all-reduces x ring 2*3/4 x 2 tokens x 100 hidden x 2 bytes
    assert k1["allreduce_bytes"] == pytest.approx(3 * 2 * 1.5 * 2 * 100 * 2)
    assert k1["ep_bytes"] == 0.0


def test_step_bytes_under_expert_parallelism_charge_each_rank_what_the_cost_model_does() -> None:
    k2 = step_bytes(_growth(), SHAPE, tp=1, ep=4).to_dicts()[2]
    # the busiest rank's 3 experts plus a quarter of the shared expert (sharded over the 4 ranks), 2 MoE layers
    assert k2["busiest_rank_weight_bytes"] == pytest.approx((3.0 + 1 / 4) * 2100 * 2)
    experts, _ = Deployment(SHAPE, tp=1, ep=4, weight_format="int4").rank_work(5.5, 3.0, 3.0)
    assert k2["busiest_rank_weight_bytes"] == pytest.approx(experts * SHAPE.expert_bytes * SHAPE.moe_layers)
    assert k2["allreduce_bytes"] == 0.0
    # dispatch + combine, 2 MoE layers, 3 tokens, 2 ranks per token (mean of k=0 rows), 100 x 2 bytes
    assert k2["ep_bytes"] == pytest.approx(2 * 2 * 3 * 2.0 * 100 * 2)


def test_acceptance_matches_the_drafts() -> None:
    model = Model()
    tokens = verify_tokens(np.random.default_rng(10), model, requests=3, steps=20, k=3, accept_prob=0.7)
    by_position = acceptance_by_position(routing_frame(tokens, model)).to_dicts()
    for row in by_position:
        mine = [a for a, d in zip(tokens.accepted, tokens.draft_pos) if d == row["draft_pos"]]
        assert row["proposed"] == len(mine)
        assert row["accepted"] == sum(bool(a) for a in mine)
    summary = acceptance_summary(steps_frame(tokens)).to_dicts()[0]
    accepted = sum(bool(a) for a in tokens.accepted)
    assert summary["verify_windows"] == 60
    assert summary["mean_drafts"] == 3.0
    assert summary["mean_accepted"] == pytest.approx(accepted / 60)
    assert summary["tokens_per_step"] == pytest.approx(1 + accepted / 60)


def test_step_times_take_decode_steps_only_and_speedup_is_per_request_throughput_over_k0() -> None:
    steps = pl.DataFrame({  # step 0: a prefill chunk (4 tokens, no drafts) beside a decode; steps 1, 2: decoding
        "step": [0, 0, 1, 1, 2, 2], "request": [0, 1, 0, 1, 0, 1], "num_tokens": [4, 1, 3, 3, 1, 3],
        "num_drafts": [0, 0, 2, 2, 0, 2], "num_accepted": [0, 0, 1, 2, 0, 0],
        "t_start_ns": [0, 0, 10_000_000, 10_000_000, 30_000_000, 30_000_000],
        "t_end_ns": [8_000_000, 8_000_000, 14_000_000, 14_000_000, 36_000_000, 36_000_000],
    }).lazy()
    (times,) = step_times(steps).to_dicts()
    assert times == {"decode_steps": 2, "step_ms": 5.0, "requests_per_step": 2.0}  # median of 4 ms and 6 ms
    per_k = pl.DataFrame({"k": [0, 2], "tokens_per_step": [1.0, 1.6], "step_ms": [4.0, 5.0]}).lazy()
    speedups = measured_speedup(per_k)["measured_speedup"].to_list()
    assert speedups == pytest.approx([1.0, (1.6 / 5.0) / (1.0 / 4.0)])
    without_k0 = measured_speedup(per_k.filter(pl.col("k") > 0))["measured_speedup"].to_list()
    assert without_k0 == [None]


def test_decode_step_periods_time_consecutive_decode_steps_of_one_concurrency() -> None:
    ms = 1_000_000
    # (step, requests, start ms, prefill?): step 0 holds a prefill chunk; steps 1-3 decode 2 requests; steps 4-5
    # decode 1; step 6 is not recorded, so 5 -> 7 is no pair
    plan = [(0, 2, 0, True), (1, 2, 10, False), (2, 2, 14, False), (3, 2, 20, False), (4, 1, 30, False),
            (5, 1, 33, False), (7, 1, 50, False), (8, 1, 52, False)]
    rows: dict[str, list[int]] = {"step": [], "request": [], "num_tokens": [], "num_drafts": [], "num_accepted": [],
                                  "t_start_ns": [], "t_end_ns": []}
    for step, requests, start, prefill in plan:
        for request in range(requests):
            rows["step"].append(step)
            rows["request"].append(request)
            rows["num_tokens"].append(5 if prefill and request == 0 else 3)
            rows["num_drafts"].append(0 if prefill and request == 0 else 2)
            rows["num_accepted"].append(1 if step != 8 else 3)  # the last step starts no pair: not counted
            rows["t_start_ns"].append(start * ms)
            rows["t_end_ns"].append(start * ms + ms)
    periods = decode_step_periods(pl.DataFrame(rows).lazy()).to_dicts()
    # batch 2: 1 -> 2 (4 ms) and 2 -> 3 (6 ms); batch 1: 4 -> 5 (3 ms) and 7 -> 8 (2 ms); 0 -> 1 has a prefill,
    # 3 -> 4 changes the request count
    assert periods == [{"batch": 1, "decode_steps": 2, "period_ms": 2.5, "tokens_per_step": 2.0},
                       {"batch": 2, "decode_steps": 2, "period_ms": 5.0, "tokens_per_step": 2.0}]
