"""The recommended k per concurrency, against step times and speedups computed by hand."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from moetrace.analysis.calibration import CALIBRATION_SCHEMA
from moetrace.analysis.deployment import Deployment
from moetrace.analysis.decision import against_trace, recommended_k, speedup_per_batch
from moetrace.analysis.profile import Profile
from moetrace.analysis.shape import ModelShape

SHAPE = ModelShape(num_experts=64, top_k=2, num_layers=2, moe_layers=1, hidden_size=8, expert_width=4,
                   shared_experts=0, expert_weight_bits=16, quant_group_size=None)
# one expert layer costs 10 µs plus 1 µs per expert (rows are free)
CALIBRATION: dict[str, Any] = {
    "schema": CALIBRATION_SCHEMA, "device": {"name": "test", "count": 1}, "int4_estimate": [],
    "allreduce": {"measured": []},
    "experts": [{"config": "tp1", "format": "bf16", "weight_bits": 16,
                 "fit": {"c0_us": 10.0, "per_expert_us": 1.0, "per_row_us": 0.0}}],
}


TOKENS_PER_STEP = {0: 1.0, 1: 1.5}


def per_batch(rows: list[tuple[int, int, float]]) -> pl.DataFrame:
    """Step inputs per (batch, k, unique experts): B·(k+1) tokens moved, 1.5 tokens gained at k = 1."""
    return pl.DataFrame(
        {"batch": [b for b, _, _ in rows], "k": [k for _, k, _ in rows], "tokens": [b * (k + 1.0) for b, k, _ in rows],
         "unique_experts": [u for _, _, u in rows], "busiest_rank_experts": [u for _, _, u in rows],
         "tokens_per_step": [TOKENS_PER_STEP[k] for _, k, _ in rows], "acceptance_source": ["measured"] * len(rows),
         "request_steps": [100] * len(rows), "steps": [0] * len(rows),
         "uniform_bound": [0.0] * len(rows), "union_source": ["estimated"] * len(rows)},
        schema_overrides={"batch": pl.Int32, "k": pl.Int32})


def speedups_table(speedup: list[float], acceptance: list[str], windows: int = 100) -> pl.DataFrame:
    """recommended_k's input at one request, k = 0, 1, 2."""
    return pl.DataFrame({"batch": [1, 1, 1], "k": [0, 1, 2], "speedup": speedup,
                         "tokens_per_step": [1.0, 1.5, 1.7], "step_ratio": [1.0, 1.15, 1.3],
                         "unique_experts": [2.0, 3.0, 4.0], "uniform_bound": [2.0, 3.9, 5.8],
                         "union_source": ["measured"] * 3, "acceptance_source": acceptance,
                         "request_steps": [windows] * 3, "steps": [10] * 3})


def test_speedup_per_batch_is_tokens_over_the_step_ratio_at_the_same_concurrency() -> None:
    table = per_batch([(1, 0, 2.0), (1, 1, 3.0), (4, 0, 6.0), (4, 1, 10.0), (8, 0, 12.0), (8, 1, 30.0)])
    speedups, basis = speedup_per_batch(table, Deployment(SHAPE, tp=1, ep=1, weight_format="bf16"), None,
                                        CALIBRATION, anchor=(2.0, 2.0))
    by_key = {(r["batch"], r["k"]): r for r in speedups.to_dicts()}
    assert by_key[(1, 0)]["step_ms"] == pytest.approx(0.012)  # 10 + 2 experts, µs → ms
    assert by_key[(1, 1)]["speedup"] == pytest.approx(1.5 / (13 / 12))
    assert by_key[(4, 1)]["speedup"] == pytest.approx(1.5 / (20 / 16))
    assert by_key[(8, 1)]["speedup"] == pytest.approx(1.5 / (40 / 22))
    assert by_key[(4, 1)]["tokens"] == 8.0 and basis["mode"] == "calibration only"

    chosen = {r["batch"]: r for r in recommended_k(speedups).to_dicts()}
    assert (chosen[1]["k"], chosen[4]["k"]) == (1, 1)
    assert chosen[8]["k"] == 0 and chosen[8]["speedup"] == 1.0  # 0.825 at k=1: do not speculate


def test_ties_recommend_the_smaller_k() -> None:
    assert recommended_k(speedups_table([1.0, 1.3, 1.3], ["measured"] * 3))["k"].to_list() == [1]


def test_k_past_the_measured_acceptance_is_not_recommended_but_flagged_when_it_looks_better() -> None:
    (row,) = recommended_k(speedups_table([1.0, 1.3, 1.5], ["measured", "measured", "extrapolated"])).to_dicts()
    assert row["k"] == 1 and row["larger_k_may_pay"] is True


def test_too_few_windows_or_disagreeing_rows_give_no_recommendation_and_say_why() -> None:
    (thin,) = recommended_k(speedups_table([1.0, 1.3, 1.2], ["measured"] * 3, windows=29)).to_dicts()
    assert thin["k"] is None and thin["speedup"] is None and thin["best_k"] == 1
    assert thin["status"].startswith("too few windows: 29")
    (enough,) = recommended_k(speedups_table([1.0, 1.3, 1.2], ["measured"] * 3, windows=30)).to_dicts()
    assert enough["k"] == 1 and enough["status"] == "ok"
    (broken,) = recommended_k(speedups_table([1.0, 1.3, 1.2], ["measured"] * 3),
                              {2: "3 of 90 decoding request-steps lack routing rows"}).to_dicts()
    assert broken["k"] is None and "disagree at k=2: 3 of 90" in broken["status"]


def test_a_profile_is_scaled_from_one_token_to_batch_times_k_plus_one_tokens() -> None:
    profile = Profile(step_ms=10.0, allreduce=0.0, moe=0.5, attention=0.2, other_gemm=0.1)
    table = per_batch([(4, 0, 6.0), (4, 1, 10.0)])
    speedups, _ = speedup_per_batch(table, Deployment(SHAPE, tp=1, ep=1, weight_format="bf16"), profile,
                                    CALIBRATION, anchor=(2.0, 2.0))
    k0, k1 = speedups.sort("k").to_dicts()
    assert k0["moe_ms"] == pytest.approx(10.0 * 0.5 * 16 / 12)  # 6 experts vs one token's 2, at 10 µs + 1 µs each
    assert k1["moe_ms"] == pytest.approx(10.0 * 0.5 * 20 / 12)
    assert k0["attention_ms"] == pytest.approx(10.0 * 0.2 * (1 + 0.03 * 3))  # 4 tokens: 3 more than the profile's
    assert k1["other_ms"] == pytest.approx(10.0 * 0.1 * (1 + 0.01 * 7))
    assert k0["rest_ms"] == pytest.approx(10.0 * 0.2)


def test_against_trace_sets_the_prediction_beside_the_recorded_steps_by_hand() -> None:
    speedups = pl.DataFrame({"batch": [1, 1, 4, 4], "k": [0, 2, 0, 2], "step_ms": [10.0, 11.0, 12.0, 14.0],
                             "tokens_per_step": [1.0, 2.5, 1.0, 2.5], "speedup": [1.0, 2.5 / 1.1, 1.0, 2.5 * 12 / 14]})
    measured = pl.DataFrame({"k": [0, 2, 0], "batch": [1, 1, 4], "period_ms": [10.0, 15.0, 12.5],
                             "tokens_per_step": [1.0, 2.4, 1.0], "prefill_ms_per_token": [0.0, 0.0, 0.0],
                             "forward_ms": [8.0, 9.5, 9.0],
                             "sampling_ms": [0.5, 1.25, 0.5], "drafting_ms": [None, 2.0, None]})
    (row,) = against_trace(speedups, measured).to_dicts()  # batch 4 has no recorded k = 2 steps
    assert (row["batch"], row["k"]) == (1, 2)
    assert row["measured_speedup"] == pytest.approx(2.4 / 1.5)
    assert row["error"] == pytest.approx((2.5 / 1.1 - 1.6) / 1.6)
    assert row["unexplained_ms"] == pytest.approx(4.0)
    # the recorded step grew 5 ms against k = 0: 1.5 in the forward, 0.75 in sampling, 2 ms drafting
    assert row["step_growth_ms"] == pytest.approx(5.0)
    assert (row["forward_growth_ms"], row["sampling_growth_ms"]) == (pytest.approx(1.5), pytest.approx(0.75))
    assert row["drafting_ms"] == 2.0
