"""Bytes per step and acceptance, checked against hand computation."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from moetrace.analysis.acceptance import (
    acceptance_by_position,
    acceptance_per_k,
    acceptance_totals,
    decode_step_periods,
    measured_speedup,
    step_times,
    tokens_per_step,
)
from moetrace.analysis.deployment import Deployment
from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.analysis.traffic import step_bytes
from trace_builder import Model, steps_frame, verify_tokens

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


def _per_k() -> pl.DataFrame:
    """One request's step at k = 0, 1, 2: tokens moved, unique and busiest-rank experts per layer, and the source."""
    return pl.DataFrame({"k": [0, 1, 2], "tokens": [1.0, 2.0, 3.0], "unique_experts": [2.0, 3.5, 5.5],
                         "busiest_rank_experts": [1.5, 2.0, 3.0],
                         "union_source": ["measured", "measured", "counterfactual"]})


def test_expert_bytes_include_scales() -> None:
    # 3 matrices of 100x10 int4 = 1500 bytes, plus one bf16 scale per 10 weights = 600 bytes
    assert SHAPE.expert_bytes == 2100
    kimi = SHAPE_PRESETS["kimi-k2"]
    assert kimi.expert_bytes == 3 * 7168 * 2048 // 2 + 3 * 7168 * 2048 // 32 * 2


def test_step_bytes_under_tensor_parallelism() -> None:
    table = step_bytes(_per_k(), Deployment(SHAPE, tp=4, ep=1, weight_format="int4"), ranks_per_token=1.0).to_dicts()
    assert [row["k"] for row in table] == [0, 1, 2]
    assert [row["source"] for row in table] == ["measured", "measured", "counterfactual"]
    k1 = table[1]
    assert k1["tokens"] == 2
    assert k1["expert_weight_bytes"] == pytest.approx((3.5 + 1) * 2100 * 2)
    assert k1["busiest_rank_weight_bytes"] == pytest.approx((3.5 + 1) * 2100 * 2 / 4)
    # 3 layers x 2 all-reduces x ring 2*3/4 x 2 tokens x 100 hidden x 2 bytes
    assert k1["allreduce_bytes"] == pytest.approx(3 * 2 * 1.5 * 2 * 100 * 2)
    assert k1["ep_bytes"] == 0.0


def test_step_bytes_under_expert_parallelism_charge_each_rank_and_the_all_reduces_as_the_cost_model_does() -> None:
    deployment = Deployment(SHAPE, tp=1, ep=4, weight_format="int4")
    k2 = step_bytes(_per_k(), deployment, ranks_per_token=2.0).to_dicts()[2]
    # the busiest rank's 3 experts plus a quarter of the shared expert (sharded over the 4 ranks), 2 MoE layers
    assert k2["busiest_rank_weight_bytes"] == pytest.approx((3.0 + 1 / 4) * 2100 * 2)
    # the cost model exchanges over max(tp, ep) = 4 GPUs: 3 layers x 2 x ring 2*3/4 x 3 tokens x 100 x 2 bytes
    assert deployment.allreduces == 6
    assert k2["allreduce_bytes"] == pytest.approx(3 * 2 * 1.5 * 3 * 100 * 2)
    # dispatch + combine, 2 MoE layers, 3 tokens, 2 ranks per token, 100 x 2 bytes
    assert k2["ep_bytes"] == pytest.approx(2 * 2 * 3 * 2.0 * 100 * 2)


def test_acceptance_rates_are_unconditional_and_sum_to_the_tokens_gained_when_drafts_vary() -> None:
    model = Model()
    tokens = verify_tokens(np.random.default_rng(10), model, requests=3, steps=40, k=3, accept_prob=0.7,
                           variable_drafts=True)
    windows: dict[tuple[int, int], list[int]] = {}  # (step, request) -> accepted flags of its drafts, by hand
    for step, request, phase, draft_pos, accepted in zip(tokens.step.tolist(), tokens.request.tolist(), tokens.phase,
                                                         tokens.draft_pos.tolist(), tokens.accepted):
        if phase != "prefill":
            windows.setdefault((step, request), [])
            if draft_pos > 0:
                windows[(step, request)].append(bool(accepted))
    gained = [sum(flags) for flags in windows.values()]
    assert any(len(flags) < 3 for flags in windows.values()), "some windows proposed fewer than k drafts"
    by_position = acceptance_by_position(steps_frame(tokens), 3).to_dicts()
    for row in by_position:
        i = row["draft_pos"]
        assert row["request_steps"] == len(windows)
        assert row["proposed"] == sum(len(flags) >= i for flags in windows.values())
        assert row["accepted"] == sum(g >= i for g in gained)
        assert row["acceptance_rate"] == pytest.approx(sum(g >= i for g in gained) / len(windows))
    totals = acceptance_totals(steps_frame(tokens)).to_dicts()[0]
    assert totals["windows"] == len(windows)
    assert totals["tokens_per_step"] == pytest.approx(1 + sum(gained) / len(windows))
    assert tokens_per_step([row["acceptance_rate"] for row in by_position]) == pytest.approx(totals["tokens_per_step"])
    # the old per-position rates (accepted at i over proposed at i) sum to more than what was gained
    conditional = 1 + sum(row["accepted"] / row["proposed"] for row in by_position)
    assert conditional > totals["tokens_per_step"] + 0.1


def test_acceptance_per_k_is_measured_at_recorded_k_estimated_below_and_extrapolated_past() -> None:
    model = Model()
    tokens = verify_tokens(np.random.default_rng(11), model, requests=2, steps=30, k=2, accept_prob=0.8,
                           variable_drafts=True)
    steps = steps_frame(tokens).collect()
    decoding = steps.filter(pl.col("num_tokens") == pl.col("num_drafts") + 1)
    accepted, drafts = decoding["num_accepted"].to_numpy(), decoding["num_drafts"].to_numpy()
    table = {row["k"]: row for row in acceptance_per_k({2: steps.lazy()}, range(4)).to_dicts()}
    assert [table[k]["acceptance_source"] for k in range(4)] == ["measured", "estimated", "measured", "extrapolated"]
    assert table[2]["tokens_per_step"] == pytest.approx(1 + accepted.mean())
    assert table[2]["tokens_read"] == pytest.approx(1 + drafts.mean())
    assert table[1]["tokens_per_step"] == pytest.approx(1 + (accepted >= 1).mean())
    assert table[1]["tokens_read"] == pytest.approx(1 + np.minimum(drafts, 1).mean())
    u1, u2 = (accepted >= 1).mean(), (accepted >= 2).mean()
    assert table[3]["tokens_per_step"] == pytest.approx(1 + u1 + u2 + u2 * (u2 / u1))
    assert table[0]["tokens_per_step"] == 1.0 and table[0]["request_steps"] == len(decoding)


def test_step_times_take_decode_steps_only_and_speedup_is_per_request_throughput_over_k0() -> None:
    steps = pl.DataFrame({  # step 0: a prefill chunk (4 tokens, no drafts) beside a decode; steps 1, 2: decoding
        "step": [0, 0, 1, 1, 2, 2], "request": [0, 1, 0, 1, 0, 1], "num_tokens": [4, 1, 3, 3, 1, 3],
        "num_drafts": [0, 0, 2, 2, 0, 2], "num_accepted": [0, 0, 1, 2, 0, 0],
        "t_start_ns": [0, 0, 10_000_000, 10_000_000, 30_000_000, 30_000_000],
        "t_end_ns": [8_000_000, 8_000_000, 14_000_000, 14_000_000, 36_000_000, 36_000_000], "dp_rank": [0] * 6,
    }).lazy()
    (times,) = step_times(steps).to_dicts()
    assert times == {"decode_steps": 2, "step_ms": 5.0, "requests_per_step": 2.0}  # mean of 4 ms and 6 ms
    per_k = pl.DataFrame({"k": [0, 2], "tokens_per_step": [1.0, 1.6], "step_ms": [4.0, 5.0]}).lazy()
    speedups = measured_speedup(per_k)["measured_speedup"].to_list()
    assert speedups == pytest.approx([1.0, (1.6 / 5.0) / (1.0 / 4.0)])
    without_k0 = measured_speedup(per_k.filter(pl.col("k") > 0))["measured_speedup"].to_list()
    assert without_k0 == [None]


def test_mean_step_times_are_the_same_in_any_row_order() -> None:
    """Step times are means over steps that come out of a group_by in any order and chunking: summed as integer
    nanoseconds, they are the one correctly rounded quotient whatever the order (a float mean of ms over 1 ns to
    1,000 s in 997-row chunks differs in its last bits for 8 of 20 orders)."""
    steps = 20_000
    durations = (10 ** np.random.default_rng(4).uniform(0, 12, size=steps)).astype(np.int64) + 1
    rows = pl.DataFrame({"step": np.arange(steps), "request": 0, "num_tokens": 3, "num_drafts": 2, "num_accepted": 1,
                         "t_start_ns": np.arange(steps) * 10**13, "dp_rank": 0}).with_columns(
        t_end_ns=pl.col("t_start_ns") + pl.Series(durations))
    expected = int(durations.sum()) / steps / 1e6  # Python's int / int: correctly rounded
    for seed in range(20):
        shuffled = rows.sample(fraction=1.0, shuffle=True, seed=seed)
        chunked = pl.concat([shuffled.slice(start, 997) for start in range(0, steps, 997)], rechunk=False)
        assert step_times(chunked.lazy())["step_ms"].item() == expected


def test_decode_step_periods_time_consecutive_decode_steps_of_one_concurrency() -> None:
    ms = 1_000_000
    # (step, requests, start ms, prefill?): step 0 holds a prefill chunk; steps 1-5 decode 2 requests; steps 6-7
    # decode 1; step 8 is not recorded, so 7 -> 9 is no pair
    plan = [(0, 2, 0, True), (1, 2, 10, False), (2, 2, 19, False), (3, 2, 23, False), (4, 2, 29, False),
            (5, 2, 40, False), (6, 1, 49, False), (7, 1, 52, False), (9, 1, 69, False), (10, 1, 71, False)]
    rows: dict[str, list[int]] = {"step": [], "request": [], "num_tokens": [], "num_drafts": [], "num_accepted": [],
                                  "t_start_ns": [], "t_end_ns": []}
    for step, requests, start, prefill in plan:
        for request in range(requests):
            rows["step"].append(step)
            rows["request"].append(request)
            rows["num_tokens"].append(5 if prefill and request == 0 else 3)
            rows["num_drafts"].append(0 if prefill and request == 0 else 2)
            rows["num_accepted"].append(1 if step != 10 else 3)  # the last step starts no pair: not counted
            rows["t_start_ns"].append(start * ms)
            rows["t_end_ns"].append(start * ms + ms)
    periods = decode_step_periods(pl.DataFrame(rows).with_columns(dp_rank=pl.lit(0)).lazy()).to_dicts()
    # batch 2: 2 -> 3 (4 ms), 3 -> 4 (6 ms), 4 -> 5 (11 ms): the mean, 7 ms, is what a request waits per step over
    # them (the median would say 6); batch 1: 6 -> 7 (3 ms) and 9 -> 10 (2 ms); 0 -> 1 has a prefill, 1 -> 2
    # follows it, 5 -> 6 changes the request count. The prefill step of 2 requests ran 10 ms to step 1's start and
    # step 1 9 ms to step 2's, 3 + 2 ms more than two decode steps of 2 requests; the trace gained 34 tokens (6
    # steps × 2 rows × 2, the prefill step's rows 1 + 1 accepted in this builder, then 3 steps × 1 row × 2 and the
    # last step's 4): 5/34 ms a token, which a request waits once per token at one request a step, twice at two
    assert periods == [
        {"batch": 1, "decode_steps": 2, "period_ms": 2.5, "tokens_per_step": 2.0,
         "prefill_ms_per_token": pytest.approx(5 / 34)},
        {"batch": 2, "decode_steps": 3, "period_ms": 7.0, "tokens_per_step": 2.0,
         "prefill_ms_per_token": pytest.approx(10 / 34)}]


def test_what_a_prefill_makes_the_next_step_wait_under_async_scheduling_is_prefill_not_decode() -> None:
    ms = 1_000_000
    # as vLLM runs with async scheduling: step 1 starts 6 ms after the prefill step 0, before its GPU work ends, and
    # waits for it (20 ms to step 2's start); then a decode step of 2 requests every 8 ms
    plan = [(0, True, 0), (1, False, 6), (2, False, 26), (3, False, 34), (4, False, 42), (5, False, 50)]
    rows = [{"dp_rank": 0, "step": step, "request": request, "num_tokens": 5 if prefill else 1, "num_drafts": 0,
             "num_accepted": 0, "t_start_ns": start * ms, "t_end_ns": start * ms + ms}
            for step, prefill, start in plan for request in range(2)]
    (period,) = decode_step_periods(pl.DataFrame(rows).lazy()).to_dicts()
    # decode pairs 2 -> 3, 3 -> 4, 4 -> 5 at 8 ms; the prefill took 6 + 20 ms to step 2's start, 10 ms more than
    # two decode steps; 6 steps gained 1 token per request each: 10/6 ms per token a request gained
    assert period == pytest.approx({"batch": 2, "decode_steps": 3, "period_ms": 8.0, "tokens_per_step": 1.0,
                                    "prefill_ms_per_token": 10 / 6})


def test_a_prefill_step_of_fewer_requests_is_paid_by_the_batch_it_leads_to() -> None:
    ms = 1_000_000
    # request 0 prefills alone (step 0, 8 ms to the next start), then 2 requests decode every 4 ms: the prefill serves
    # concurrency 2 (as when requests that ended together are replaced over steps of fewer requests)
    plan = [(0, 1, 0, True), (1, 2, 8, False), (2, 2, 12, False), (3, 2, 16, False), (4, 2, 20, False)]
    rows = [{"dp_rank": 0, "step": step, "request": request, "num_tokens": 5 if prefill else 2,
             "num_drafts": 0 if prefill else 1, "num_accepted": 1, "t_start_ns": start * ms,
             "t_end_ns": start * ms + ms}
            for step, requests, start, prefill in plan for request in range(requests)]
    (period,) = decode_step_periods(pl.DataFrame(rows).lazy()).to_dicts()
    # 8 ms less one 4 ms decode step of 2 requests, and step 1 (after the prefill) no longer than one: 4 ms; 18
    # tokens gained (the prefill row 2, then 4 steps × 2 rows × 2): 4/18 ms a token, twice that a request waits at
    # two requests a step; decode pairs 2 -> 3 and 3 -> 4
    assert period == pytest.approx({"batch": 2, "decode_steps": 2, "period_ms": 4.0, "tokens_per_step": 2.0,
                                    "prefill_ms_per_token": 4 / 9})


def test_decode_step_periods_pair_each_data_parallel_ranks_own_steps() -> None:
    ms = 1_000_000
    # two ranks, one request each, a step every 10 ms; rank 1 starts 3 ms after rank 0
    rows = [{"dp_rank": rank, "step": step, "request": 0, "num_tokens": 1, "num_drafts": 0, "num_accepted": 0,
             "t_start_ns": (10 * step + 3 * rank) * ms, "t_end_ns": (10 * step + 3 * rank + 2) * ms}
            for rank in (0, 1) for step in range(6)]
    (period,) = decode_step_periods(pl.DataFrame(rows).lazy()).to_dicts()
    assert period == {"batch": 1, "decode_steps": 10, "period_ms": 10.0, "tokens_per_step": 1.0,
                      "prefill_ms_per_token": 0.0}
