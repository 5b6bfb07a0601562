"""The recommended k per concurrency, against step times and speedups computed by hand."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from moetrace.analysis.calibration import CALIBRATION_SCHEMA
from moetrace.analysis.deployment import Deployment
from moetrace.analysis.measured_steps import MeasuredSteps
from moetrace.analysis.decision import (
    across_batches,
    against_trace,
    crossover,
    recommended_k,
    speedup_per_batch,
)
from moetrace.analysis.profile import Profile
from moetrace.analysis.shape import ModelShape
from moetrace.analysis.uncertainty import HeldOutErrors, with_intervals

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
    """recommended_k's input at one request, k = 0 .. len(speedup) - 1 (at most 4)."""
    n = len(speedup)
    return pl.DataFrame({"batch": [1] * n, "k": list(range(n)), "speedup": speedup,
                         "tokens_per_step": [1.0, 1.5, 1.7, 1.8, 1.85][:n],
                         "step_ratio": [1.0, 1.15, 1.3, 1.45, 1.6][:n],
                         "unique_experts": [2.0, 3.0, 4.0, 5.0, 6.0][:n],
                         "uniform_bound": [2.0, 3.9, 5.8, 7.6, 9.4][:n],
                         "union_source": ["measured"] * n, "acceptance_source": acceptance,
                         "request_steps": [windows] * n, "steps": [10] * n})


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

    chosen = {r["batch"]: r for r in recommended_k(speedups, [1, 4, 8]).to_dicts()}
    assert (chosen[1]["k"], chosen[4]["k"]) == (1, 1)
    assert chosen[8]["k"] == 0 and chosen[8]["speedup"] == 1.0  # 0.825 at k=1: do not speculate


def test_steps_past_the_calibrations_kernel_table_are_named_in_a_note() -> None:
    # the kernel table measured up to 8 rows (4 tokens of top-2); B·(k+1)·2 rows: B=1 k=1 4, B=4 k=1 16, B=8 k=1 32
    points = [{"experts": e, "rows": r, "time_us": 10.0 + e} for e, r in ((2, 2), (2, 4), (4, 4), (2, 8), (8, 8))]
    calibration = {**CALIBRATION, "experts": [{**CALIBRATION["experts"][0], "kernel": "vLLM fused_experts (Triton)",
                                               "table": True, "points": points}]}
    deployment = Deployment(SHAPE, tp=1, ep=1, weight_format="bf16")
    table = per_batch([(1, 0, 2.0), (1, 1, 3.0), (4, 0, 6.0), (4, 1, 10.0), (8, 0, 12.0), (8, 1, 30.0)])
    _, basis = speedup_per_batch(table, deployment, None, calibration, anchor=(2.0, 2.0))
    past = [note for note in basis["notes"] if "past the calibration table" in note]
    assert past == [past[0]] and past[0].startswith("at 4, 8 request(s) per step")
    assert "up to 32 routed rows per rank" in past[0] and "largest step (8 rows)" in past[0]
    _, within = speedup_per_batch(table.filter(pl.col("batch") == 1), deployment, None, calibration,
                                  anchor=(2.0, 2.0))
    assert not any("past the calibration table" in note for note in within["notes"])
    assert "moe_past_table" not in basis and "moe_past_table" not in within


def test_ties_recommend_the_smaller_k() -> None:
    assert recommended_k(speedups_table([1.0, 1.3, 1.3], ["measured"] * 3), [1])["k"].to_list() == [1]


def test_k_past_the_measured_acceptance_is_not_recommended_but_flagged_when_it_looks_better() -> None:
    (row,) = recommended_k(speedups_table([1.0, 1.3, 1.5], ["measured", "measured", "extrapolated"]), [1]).to_dicts()
    assert row["k"] == 1 and row["larger_k_may_pay"] is True


def test_the_largest_k_recorded_is_marked_even_where_the_extrapolated_k_past_it_look_worse() -> None:
    # recorded at k = 0 and 2 (k = 1 cut from the k = 2 trace), k = 3 extrapolated: as the n-gram sweep of 256-token
    # traces moved to 8,192 tokens, where k = 4 measured 20-27% more throughput
    (row,) = recommended_k(speedups_table([1.0, 1.3, 1.5, 1.4], ["measured", "estimated", "measured", "extrapolated"]),
                           [1]).to_dicts()
    assert (row["k"], row["larger_k_may_pay"], row["k_at_sweep_edge"]) == (2, False, True)
    assert row["sweep_edge_note"] == ("k = 2 is the largest k recorded (past it acceptance is only extrapolated); a "
                                      "larger k may pay more: moetrace record MODEL --k 0,2,3,4, then report that "
                                      "sweep")


def test_the_largest_k_predicted_is_marked_with_the_max_k_that_looks_past_it() -> None:
    # no extrapolated k: the report stopped at k = 2 (--max-k 2), whatever the sweep recorded
    (row,) = recommended_k(speedups_table([1.0, 1.3, 1.5], ["measured"] * 3), [1]).to_dicts()
    assert row["k"] == 2 and row["k_at_sweep_edge"] is True and "--max-k 4" in row["sweep_edge_note"]


def test_a_k_inside_the_sweep_or_no_speculation_is_not_marked() -> None:
    # recorded at k = 0, 2 and 4: k = 2 has a larger k measured against it
    middle = speedups_table([1.0, 1.3, 1.5, 1.45, 1.4], ["measured", "estimated", "measured", "estimated", "measured"])
    (row,) = recommended_k(middle, [1]).to_dicts()
    assert (row["k"], row["k_at_sweep_edge"], row["sweep_edge_note"]) == (2, False, None)
    (none_pays,) = recommended_k(speedups_table([1.0, 0.9, 0.8], ["measured"] * 3), [1]).to_dicts()
    assert (none_pays["k"], none_pays["k_at_sweep_edge"]) == (0, False)


def test_too_few_windows_or_disagreeing_rows_give_no_recommendation_and_say_why() -> None:
    (thin,) = recommended_k(speedups_table([1.0, 1.3, 1.2], ["measured"] * 3, windows=29), [1]).to_dicts()
    assert thin["k"] is None and thin["speedup"] is None and thin["best_k"] == 1
    assert thin["status"].startswith("too few windows: 29")
    (enough,) = recommended_k(speedups_table([1.0, 1.3, 1.2], ["measured"] * 3, windows=30), [1]).to_dicts()
    assert enough["k"] == 1 and enough["status"] == "ok"
    (broken,) = recommended_k(speedups_table([1.0, 1.3, 1.2], ["measured"] * 3), [1],
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


def test_every_concurrency_asked_gets_a_row_predicted_or_with_the_reason() -> None:
    rows = recommended_k(speedups_table([1.0, 1.3, 1.2], ["measured"] * 3), [1, 16, 64],
                         unpriced={64: "above the engines' 48 slots"}).to_dicts()
    assert [row["batch"] for row in rows] == [1, 16, 64]
    assert rows[0]["k"] == 1 and rows[0]["speedup_source"] == "measured"
    assert rows[1]["k"] is None and rows[1]["status"].startswith("nothing to predict it from")
    assert rows[2]["k"] is None and rows[2]["speedup"] is None and rows[2]["status"] == "above the engines' 48 slots"


def test_a_term_between_recorded_concurrencies_is_linear_and_past_them_follows_the_nearest_two() -> None:
    recorded = {1: 2.0, 4: 5.0, 16: 11.0}
    assert across_batches(recorded, 4) == 5.0
    assert across_batches(recorded, 2) == pytest.approx(3.0)  # 2 + (5 - 2) · 1/3
    assert across_batches(recorded, 10) == pytest.approx(8.0)  # 5 + (11 - 5) · 6/12
    assert across_batches(recorded, 48) == pytest.approx(11.0 + 0.5 * 32)  # the 4..16 slope, 0.5 per request
    assert across_batches({4: 5.0, 16: 2.0}, 48) == 2.0  # a falling slope is not carried past the last one
    assert across_batches(recorded, 48, extend=False) == 11.0 and across_batches(recorded, 10, extend=False) == 8.0
    assert across_batches({16: 8.0}, 48) == 8.0 and across_batches({16: 8.0}, 2) == 8.0


def test_measured_mode_estimates_a_concurrency_the_sweep_did_not_record_from_those_it_did() -> None:
    table = per_batch([(1, 0, 2.0), (1, 1, 3.0), (4, 0, 6.0), (4, 1, 10.0), (8, 0, 12.0), (8, 1, 30.0)])
    # k=0 steps of 1.0 ms at one request and 2.0 ms at four; the forward grew 0.05 and 0.11 ms at k=1
    measured = {1: MeasuredSteps(1.0, {1: 0.05}), 4: MeasuredSteps(2.0, {1: 0.11})}
    speedups, basis = speedup_per_batch(table, Deployment(SHAPE, tp=1, ep=1, weight_format="bf16"), None,
                                        CALIBRATION, (2.0, 2.0), measured)
    by_key = {(r["batch"], r["k"]): r for r in speedups.to_dicts()}
    assert {r["step_source"] for r in speedups.to_dicts() if r["batch"] < 8} == {"measured"}
    # past the largest recorded concurrency (4): extrapolated, and marked so
    assert by_key[(8, 0)]["step_source"] == by_key[(8, 1)]["step_source"] == "extrapolated"
    # what is left of the k=0 step beyond its calibrated MoE (10 µs + 1 µs per expert): 1 - 0.012 at one request,
    # 2 - 0.016 at four; at eight, along that line: 1.984 + (1.984 - 0.988) / 3 · 4
    rest8 = 1.984 + (1.984 - 0.988) / 3 * 4
    assert by_key[(8, 0)]["step_ms"] == pytest.approx(rest8 + 0.022)
    # the forward grew beyond the calibrated MoE by 0.05 - 0.001 at one request and 0.11 - 0.004 at four
    beyond8 = 0.106 + (0.106 - 0.049) / 3 * 4
    assert by_key[(8, 1)]["forward_beyond_moe_ms"] == pytest.approx(beyond8)
    assert by_key[(8, 1)]["step_ms"] == pytest.approx(rest8 + 0.040 + beyond8)
    assert any("at 8 request(s) per step, which the sweep did not record" in note for note in basis["notes"])


def crossing_speedups(best: dict[int, float]) -> pl.DataFrame:
    """k = 0 at 1.0 and k = 1 at ``best[batch]`` per batch, k = 2 always worse, acceptance measured."""
    rows = [(b, k, s) for b, value in best.items() for k, s in ((0, 1.0), (1, value), (2, value - 0.05))]
    return pl.DataFrame({"batch": [b for b, _, _ in rows], "k": [k for _, k, _ in rows],
                         "speedup": [s for _, _, s in rows], "acceptance_source": ["measured"] * len(rows)})


def test_the_crossover_is_interpolated_in_log_concurrency_between_the_last_paying_and_the_next() -> None:
    found = crossover(crossing_speedups({1: 2.0, 8: 1.5, 32: 1.2, 128: 0.8}), [1, 8, 32, 128], "predicted")
    assert (found["status"], found["paying"], found["none_pays"]) == ("crosses", 32, 128)
    # 1.2 → 0.8 between log 32 and log 128: 1.0 halfway, at sqrt(32 · 128) = 64
    assert found["batch"] == pytest.approx(64.0)
    assert [(row["batch"], row["k"]) for row in found["best"]] == [(1, 1), (8, 1), (32, 1), (128, 1)]
    assert crossover(crossing_speedups({1: 1.3, 8: 1.1}), [1, 8], "measured")["status"] == "pays throughout"
    never = crossover(crossing_speedups({1: 0.9, 8: 0.7}), [1, 8], "predicted")
    assert (never["status"], never["none_pays"], never["batch"]) == ("never pays", 1, None)
    # a concurrency that pays again above one that does not moves the crossover up to the last that pays
    assert crossover(crossing_speedups({1: 1.5, 8: 0.9, 32: 1.1, 128: 0.9}), [1, 8, 32, 128],
                     "predicted")["paying"] == 32


def test_each_recommended_speedup_carries_the_interval_the_held_out_errors_give_and_the_k_inside_it() -> None:
    """Errors spread evenly over -10%..+10% (central 80%: -8%..+8%): at B=1, k=2's 1.50 stands for 1.50/1.08 to
    1.50/0.92; k=1's 1.40 reaches 1.40/0.92 = 1.52 > 1.389, so it lies within; k=3 extrapolated is not compared.
    Computed here by hand."""
    errors = HeldOutErrors(tuple(e / 100 for e in range(-10, 11)), coverage=0.8)
    assert errors.bounds() == pytest.approx((-0.08, 0.08))
    speedups = pl.DataFrame({"batch": [1, 1, 1, 1, 8, 8, 8], "k": [0, 1, 2, 3, 0, 1, 2],
                             "speedup": [1.0, 1.40, 1.50, 1.90, 1.0, 1.30, 1.10],
                             "acceptance_source": ["measured"] * 3 + ["extrapolated"] + ["measured"] * 3})
    decision = pl.DataFrame({"batch": [1, 8, 32], "k": [2, 1, None]}, schema={"batch": pl.Int32, "k": pl.Int32})
    rows = {row["batch"]: row for row in with_intervals(
        decision, speedups.with_columns(pl.col("batch", "k").cast(pl.Int32)), errors).to_dicts()}
    assert rows[1]["speedup_low"] == pytest.approx(1.50 / 1.08) and rows[1]["speedup_high"] == pytest.approx(1.5 / 0.92)
    assert rows[1]["within_error"] == [1]  # k=0 (exactly 1) lies below 1.389
    assert rows[8]["within_error"] == []  # k=2's 1.10/0.92 = 1.196 stays under k=1's 1.30/1.08 = 1.204
    assert rows[32]["within_error"] is None and rows[32]["speedup_low"] is None
