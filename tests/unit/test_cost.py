"""The cost model (analysis/cost.py) against hand-computed cases."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from moetrace.analysis.acceptance import acceptance_curve, tokens_per_step
from moetrace.analysis.concurrency import uniform_unions
from moetrace.analysis.calibration import allreduce_model, drafter_step_ms, expert_fit, ring_model, table_time_us
from moetrace.analysis.calibration import AttentionCurve
from moetrace.analysis.context import at_contexts
from moetrace.analysis.cost import predict
from moetrace.analysis.measured_steps import MeasuredSteps, forward_beyond_moe, per_k_from_nearest
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.decision import speedup_per_batch
from moetrace.analysis.placement import linear_placement
from moetrace.analysis.profile import PROFILE_PRESETS, Profile
from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.report.measured import passed_baselines
from calibrations import DRAFTER, small_calibration

SMALL = ModelShape(num_experts=64, top_k=8, num_layers=2, moe_layers=2, hidden_size=1000, expert_width=32,
                   shared_experts=1, expert_weight_bits=16, quant_group_size=None)


def test_a_curve_measured_at_the_same_per_rank_work_serves_another_config() -> None:
    calibration = small_calibration()
    calibration["experts"][0].update(width=16, experts_per_rank=64)  # tp2 of SMALL: each rank 1000×16, 64 experts
    per_gpu = deployment_for(replace(SMALL, expert_width=16), 1, 1)  # SMALL's per-GPU slice at tp1: the same work
    fit, _, notes = expert_fit(calibration, "tp1", "bf16", per_gpu.rank_shape())
    assert fit["per_expert_us"] == 2.0 and "tp2's serves" in notes[0]
    with pytest.raises(ValueError, match="no expert curve for tp1"):  # 1000×32 per rank: not what tp2 measured
        expert_fit(calibration, "tp1", "bf16", deployment_for(SMALL, 1, 1).rank_shape())


def test_a_measured_k0_step_grows_at_copy_bandwidth_where_no_curve_fits() -> None:
    calibration = {**small_calibration(), "copy_bandwidth_gbs": 100.0}
    # SMALL at tp1 has no curve; an expert is 3 × 1000 × 32 × 2 B = 192 kB: 1.92 us at 100 GB/s. k=1 reads
    # 12 + 1 shared experts against 8 + 1 in each of 2 MoE layers: 2 × 4 × 1.92 us more
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 1, 1), None, calibration,
                           measured=MeasuredSteps(5.0))
    k0, k1 = table.to_dicts()
    assert k0["step_ms"] == pytest.approx(5.0) and k1["step_ms"] - k0["step_ms"] == pytest.approx(2 * 4 * 1.92e-3)
    assert any("copy bandwidth (100 GB/s, 192.0 kB per expert per rank)" in note for note in basis["notes"])
    # under EP a rank holds whole experts: 192 kB each, and the busiest rank's experts are read
    ep_table, ep_basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 1, 2), None, calibration,
                                 measured=MeasuredSteps(5.0))
    assert any("192.0 kB per expert per rank" in note for note in ep_basis["notes"])
    assert ep_table["step_ms"][1] > ep_table["step_ms"][0]
    with pytest.raises(ValueError, match="no expert curve for tp1"):  # without a measured step: no such shortcut
        predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 1, 1), None, calibration)


def test_async_scheduling_off_adds_its_measured_time_to_every_step_that_drafts() -> None:
    args = (_per_k([8.0, 8.0], [1.0, 1.5]), deployment_for(SMALL, 1, 1), None, {**small_calibration(),
                                                                                "copy_bandwidth_gbs": 100.0})
    plain, _ = predict(*args, measured=MeasuredSteps(5.0))
    table, basis = predict(*args, measured=MeasuredSteps(5.0, scheduling_ms=0.75))
    # same experts at both k: the step at k=1 is the k=0 step plus 0.75 ms, and the speedup 1.5 × 5 / 5.75
    assert table["scheduling_ms"].to_list() == [0.0, 0.75] and plain["scheduling_ms"].to_list() == [None, None]
    assert table["step_ms"].to_list() == pytest.approx([5.0, 5.75])
    assert table["speedup"][1] == pytest.approx(1.5 * 5.0 / 5.75)
    assert any("+0.750 ms per step, measured at k=0 (--k0-sync)" in note for note in basis["notes"])
    # the rejection sampler's measured time over k=0's adds the same way
    sampled, basis = predict(*args, measured=MeasuredSteps(5.0, sampling_ms={1: 0.25}))
    assert sampled["sampling_ms"].to_list() == [0.0, 0.25] and sampled["step_ms"][1] == pytest.approx(5.25)
    assert any("rejection sampler's time over k=0's" in note for note in basis["notes"])


def test_a_model_drafters_step_is_its_first_pass_over_the_verified_tokens_then_k_minus_1_passes() -> None:
    assert drafter_step_ms(DRAFTER, 0, 4) == 0.0  # k = 0 runs no drafter
    # k=1, one request: fc and layers over 2 tokens (2 + 12 µs), the head on 1 (2 µs)
    assert drafter_step_ms(DRAFTER, 1, 1) == pytest.approx(16e-3)
    # k=3, one request: 4 + 16 + 2 over 4 verified tokens, then 2 × (10 + 2)
    assert drafter_step_ms(DRAFTER, 3, 1) == pytest.approx(46e-3)
    # k=2, two requests: 6 verified tokens past the curve's end (layers +2 µs, fc +1 µs a token): 6 + 20, the head
    # on 2 (3 µs), then one pass of 2 tokens: 12 + 3
    assert drafter_step_ms(DRAFTER, 2, 2) == pytest.approx(44e-3)


def test_a_calibrated_drafter_is_added_to_every_step_that_drafts_where_nothing_was_measured() -> None:
    args = (_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, small_calibration())
    plain, _ = predict(*args)
    table, basis = predict(*args, drafter=DRAFTER)
    assert table["drafting_ms"].to_list() == pytest.approx([0.0, 16e-3]) and plain["drafting_ms"][1] is None
    assert table["step_ms"][1] - plain["step_ms"][1] == pytest.approx(16e-3)
    assert any("priced from the calibration's eagle3 curve (test head, tp2" in note for note in basis["notes"])
    # the sweep's own measured drafter wins over a calibrated one
    measured, _ = predict(*args[:3], {**small_calibration(), "copy_bandwidth_gbs": 100.0},
                          measured=MeasuredSteps(5.0, drafting_ms={1: 0.5}), drafter=DRAFTER)
    assert measured["drafting_ms"].to_list() == [0.0, 0.5]


def _per_k(unique: list[float], tokens: list[float]) -> pl.DataFrame:
    """One request at k = 0..: k+1 tokens moved."""
    return pl.DataFrame({"k": list(range(len(unique))), "tokens": [k + 1.0 for k in range(len(unique))],
                         "unique_experts": unique, "busiest_rank_experts": unique, "tokens_per_step": tokens})


def geometric_acceptance(rate: float, k: int) -> list[float]:
    return [rate**i for i in range(1, k + 1)]


def test_tokens_per_step_from_acceptance() -> None:
    assert tokens_per_step(geometric_acceptance(0.7, 3)) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    assert tokens_per_step(geometric_acceptance(0.7, 0)) == 1.0
    rates, extrapolated = acceptance_curve({1: 0.8, 2: 0.6}, 4)  # conditional 0.75 continues
    assert rates == pytest.approx([0.8, 0.6, 0.45, 0.3375]) and extrapolated
    assert acceptance_curve({1: 0.8, 2: 0.6}, 2) == ([0.8, 0.6], False)
    with pytest.raises(ValueError):
        acceptance_curve({}, 2)


def test_ring_model_and_extrapolation() -> None:
    assert ring_model(8, 10.0, 100.0, "").time_us(1e6) == pytest.approx(10.0 + 1.75 * 1e6 / 1e5)
    doc = small_calibration()
    two = allreduce_model(doc, 2)
    assert two is not None and not two.extrapolated
    assert two.time_us(5000) == pytest.approx(11.5)  # interpolated between 10 µs and 13 µs
    assert two.time_us(12000) == pytest.approx(13.0)  # the 12 µs dip at 16 kB is raised to 13 (non-decreasing)
    eight = allreduce_model(doc, 8)
    assert eight is not None and eight.extrapolated and "EXTRAPOLATED from 2 GPUs" in eight.basis
    assert eight.time_us(2000) == pytest.approx(two.time_us(3500))  # same bytes per GPU: ×1.75
    assert eight.time_us(1e6) == pytest.approx(9.0 + 1.75 * 1e6 / 2e3)  # past the curve: the fitted ring model
    assert allreduce_model(small_calibration(()), 8) is None


def test_predict_profile_only_by_hand() -> None:
    profile = Profile(step_ms=10.0, allreduce=0.5, moe=0.1, attention=0.2, other_gemm=0.1,
                      attention_growth_per_token=0.0, other_growth_per_token=0.0)
    tokens = tokens_per_step(geometric_acceptance(0.7, 3))
    table, basis = predict(_per_k([8.0, 0.0, 0.0, 32.0], [1.0, 1.0, 1.0, tokens]).filter(pl.col("k").is_in([0, 3])),
                           deployment_for(SMALL, 2, 1), profile, None)
    row = table.filter(pl.col("k") == 3).to_dicts()[0]
    assert row["moe_ms"] == pytest.approx(1.0 * 33 / 9)  # (unique + shared) / (8 + 1)
    # 4 all-reduces (2 layers × 2) of 1.25 ms each; 3 more tokens × 1000 × 2 B at 100 GB/s (ring 1 for 2 GPUs)
    assert row["allreduce_ms"] == pytest.approx(5.0 + 4 * 6000 / 1e5 / 1e3)
    step = 33 / 9 + 5.0 + 4 * 0.06e-3 + 2.0 + 1.0 + 1.0
    assert row["step_ms"] == pytest.approx(step)
    assert row["speedup"] == pytest.approx(tokens / (step / 10.0))
    assert basis["mode"] == "profile, modelled growth" and not basis["allreduce_extrapolated"]


def test_predict_calibration_only_by_hand() -> None:
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, small_calibration())
    k1 = table.filter(pl.col("k") == 1).to_dicts()[0]
    # tp2: the kernel over 12 experts and 2 tokens × 8 rows, 10 + 2·12 + 0.5·16 = 42 µs, plus the shared expert at
    # the one-token point's price per expert, (10 + 2·8 + 0.5·8) / 8 = 3.75 µs: 45.75 µs per layer, 2 layers
    assert k1["expert_layer_us"] == pytest.approx(45.75) and k1["moe_ms"] == pytest.approx(0.0915)
    # 4 all-reduces of 2 tokens × 1000 × 2 B = 4000 B: 10 + 3·(2000/6000) = 11 µs
    assert k1["allreduce_ms"] == pytest.approx(4 * 11.0 / 1e3)
    k0 = table.filter(pl.col("k") == 0).to_dicts()[0]
    assert k0["step_ms"] == pytest.approx(2 * (10 + 16 + 4 + 3.75) / 1e3 + 4 * 10.0 / 1e3)
    assert k1["speedup"] == pytest.approx(1.5 / (k1["step_ms"] / k0["step_ms"]))
    assert basis["mode"] == "calibration only" and any("lower bound" in n for n in basis["notes"])
    with pytest.raises(ValueError, match="no expert curve for ep2"):
        predict(_per_k([8.0], [1.0]), deployment_for(SMALL, 1, 2), None, small_calibration())


def test_a_kernel_table_is_read_by_interpolation_between_measured_levels() -> None:
    # (experts, rows, µs): one point at 8 rows, two at 16, three at 40
    table = [(8.0, 8.0, 40.0), (8.0, 16.0, 50.0), (16.0, 16.0, 70.0), (8.0, 40.0, 90.0), (16.0, 40.0, 95.0),
             (40.0, 40.0, 150.0)]
    assert table_time_us(table, 8.0, 8.0) == 40.0 and table_time_us(table, 8.0, 4.0) == 40.0  # held below
    assert table_time_us(table, 12.0, 12.0) == pytest.approx((40.0 + 60.0) / 2)  # 8 rows: 40; 16 rows: 60
    # 40 rows, 24 experts: 95 + 55·8/24 inside the level
    assert table_time_us(table, 24.0, 40.0) == pytest.approx(95.0 + 55.0 * 8 / 24)
    # past the last level the last two carry on: 16 experts at 16 rows 70, at 40 rows 95; 64 rows: 95 + 25
    assert table_time_us(table, 16.0, 64.0) == pytest.approx(120.0)


def test_the_engines_kernel_table_is_preferred_to_a_fitted_grouped_gemm() -> None:
    calibration = small_calibration()
    points = [{"experts": 8, "rows": 8, "time_us": 20.0}, {"experts": 8, "rows": 16, "time_us": 30.0},
              {"experts": 16, "rows": 16, "time_us": 46.0}]
    calibration["experts"].append({"config": "tp2", "format": "bf16", "weight_bits": 16, "estimated": False,
                                   "kernel": "vLLM fused_experts (Triton)", "table": True, "points": points,
                                   "fit": {"c0_us": 0.0, "per_expert_us": 1.0, "per_row_us": 1.0}})
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, calibration)
    k0, k1 = table.to_dicts()
    # the shared expert: the one-token point (8 experts, 8 rows) ÷ 8 = 2.5 µs. k=0: 8 experts over 8 rows, the point
    # itself; k=1: 12 experts over 16 rows, 30 + 16·4/8 inside the 16-row level
    assert k0["expert_layer_us"] == pytest.approx(20.0 + 2.5) and k1["expert_layer_us"] == pytest.approx(38.0 + 2.5)
    assert any("table of vLLM fused_experts (Triton) (3 points)" in note for note in basis["notes"])


def test_predict_from_a_measured_k0_step_by_hand() -> None:
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, small_calibration(),
                           measured=MeasuredSteps(5.0))
    k0, k1 = table.to_dicts()
    # k=0: 2 layers × (10 + 2·8 + 0.5·8 + 3.75 shared) µs MoE and 4 all-reduces of 10 µs; the rest of the 5 ms is
    # held flat
    assert k0["moe_ms"] == pytest.approx(0.0675) and k0["allreduce_ms"] == pytest.approx(0.040)
    assert k0["rest_ms"] == pytest.approx(5.0 - 0.0675 - 0.040) and k0["step_ms"] == pytest.approx(5.0)
    # k=1: 2 × 45.75 µs MoE, 4 × 11 µs all-reduce, the same rest
    assert k1["step_ms"] == pytest.approx(5.0 - 0.1075 + 0.0915 + 0.044)
    assert k1["speedup"] == pytest.approx(1.5 / (k1["step_ms"] / 5.0))
    assert basis["mode"] == "measured k=0 step, calibrated growth"
    # no k > 0 trace timed the forward: the note says its growth is missing and which way that errs
    assert any("no recorded k > 0 trace timed vLLM's forward" in n and "run high" in n for n in basis["notes"])
    small, small_basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None,
                                 small_calibration(), measured=MeasuredSteps(0.05))
    # the calibration's 0.1075 ms at k=0 is above the measured 0.05 ms step: the step stays anchored at what was
    # measured and only the calibration's growth (0.1355 - 0.1075 ms) is added at k=1
    assert small["step_ms"].to_list() == pytest.approx([0.05, 0.05 - 0.1075 + 0.0915 + 0.044])
    assert small["rest_ms"].to_list() == pytest.approx([0.05 - 0.1075] * 2)
    assert any("only their growth" in n for n in small_basis["notes"])
    for profile, calibration in ((PROFILE_PRESETS["kimi-k2-tp8"], small_calibration()), (None, None)):
        with pytest.raises(ValueError):
            predict(_per_k([8.0], [1.0]), deployment_for(SMALL, 2, 1), profile, calibration,
                    measured=MeasuredSteps(5.0))


def test_a_measured_time_is_kept_where_recorded_and_scaled_or_held_elsewhere() -> None:
    measured = {2: 4.0, 4: 9.0}
    # a model drafter runs a forward per draft: scaled by k from the nearest recorded k (ties: the smaller)
    assert per_k_from_nearest(measured, range(7), True) == {1: 2.0, 2: 4.0, 3: 6.0, 4: 9.0, 5: 11.25, 6: 13.5}
    # n-gram: one lookup per step, whatever k
    assert per_k_from_nearest(measured, range(1, 4), False) == {1: 4.0, 2: 4.0, 3: 4.0}
    with pytest.raises(ValueError):
        per_k_from_nearest({}, range(3), False)
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, small_calibration(),
                           measured=MeasuredSteps(5.0, drafting_ms={1: 0.5}))
    k0, k1 = table.to_dicts()
    assert k0["drafting_ms"] == 0.0 and k1["drafting_ms"] == 0.5
    assert k1["step_ms"] == pytest.approx(5.0 - 0.1075 + 0.0915 + 0.044 + 0.5)
    assert any("drafter's own time per step" in note for note in basis["notes"])


def test_the_forward_grows_by_what_the_traces_measured_beyond_the_calibrated_moe() -> None:
    # by hand: calibrated MoE + all-reduce growth 0.2 ms at k=1, 0.3 at k=2, 0.5 at k=3; the forward measured +1.0
    # at k=1 and +2.0 at k=3: 0.8 and 1.5 beyond; k=2 takes k=1's (nearest, ties to the smaller), k=4 k=3's
    assert forward_beyond_moe({1: 1.0, 3: 2.0}, {0: 0.0, 1: 0.2, 2: 0.3, 3: 0.5, 4: 0.7}, range(5)) == \
        pytest.approx({1: 0.8, 2: 0.8, 3: 1.5, 4: 1.5})
    assert forward_beyond_moe({}, {0: 0.0, 1: 0.2}, range(2)) == {}
    # in predict: at a recorded k the step is the k=0 step plus the forward's measured growth (the calibrated MoE
    # growth 2 × 4 × 1.92 µs at k=1 is inside it, not added again)
    calibration = {**small_calibration(), "copy_bandwidth_gbs": 100.0}
    per_k = _per_k([8.0, 12.0, 12.0], [1.0, 1.5, 1.8])
    table, basis = predict(per_k, deployment_for(SMALL, 1, 1), None, calibration,
                           measured=MeasuredSteps(5.0, forward_growth_ms={1: 0.6}))
    moe_growth = 2 * 4 * 1.92e-3
    assert table["step_ms"].to_list() == pytest.approx([5.0, 5.6, 5.6])
    assert table["forward_beyond_moe_ms"].to_list() == pytest.approx([0.0, 0.6 - moe_growth, 0.6 - moe_growth])
    assert any("the forward by what it grew beyond that" in note for note in basis["notes"])
    # a request that also waits 0.5 ms of prefill per token it gets: (5 + 0.5) / (5.6 / 1.5 + 0.5) at k=1, against
    # 1.5 / (5.6 / 5) from the decode steps alone
    with_prefill, _ = predict(per_k, deployment_for(SMALL, 1, 1), None, calibration,
                              measured=MeasuredSteps(5.0, forward_growth_ms={1: 0.6},
                                                     prefill_ms_per_token={0: 0.5}))
    assert table["speedup"][1] == pytest.approx(1.5 / (5.6 / 5.0))
    assert with_prefill["speedup"][1] == pytest.approx(5.5 / (5.6 / 1.5 + 0.5))
    assert with_prefill["prefill_ms_per_token"].to_list() == [0.5] * 3
    # prefills measured per k: k=2 recorded 1.5 ms per token (under speculation prompts come one step each), so k=1,
    # not recorded, takes k=2's, not k=0's: (5 + 0.5) / (5.6 / 1.5 + 1.5)
    per_k_prefill, _ = predict(per_k, deployment_for(SMALL, 1, 1), None, calibration,
                               measured=MeasuredSteps(5.0, forward_growth_ms={1: 0.6},
                                                      prefill_ms_per_token={0: 0.5, 2: 1.5}))
    assert per_k_prefill["prefill_ms_per_token"].to_list() == [0.5, 1.5, 1.5]
    assert per_k_prefill["speedup"][1] == pytest.approx(5.5 / (5.6 / 1.5 + 1.5))
    plain, _ = predict(per_k, deployment_for(SMALL, 1, 1), None, calibration, measured=MeasuredSteps(5.0))
    assert plain["step_ms"][1] == pytest.approx(5.0 + moe_growth)
    assert plain["forward_beyond_moe_ms"].to_list() == [None, None, None]


def test_speedup_per_batch_estimates_the_batches_without_a_measured_k0_step_from_those_with_one() -> None:
    per_batch = pl.concat([_per_k([8.0, 12.0], [1.0, 1.5]).with_columns(batch=pl.lit(b, pl.Int32)) for b in (1, 4)])
    per_batch = per_batch.with_columns(uniform_bound=pl.col("unique_experts"), union_source=pl.lit("measured"))
    table, _ = speedup_per_batch(per_batch, deployment_for(SMALL, 2, 1), None, small_calibration(), (8.0, 8.0),
                                 {4: MeasuredSteps(3.0)})
    k0 = {row["batch"]: row for row in table.filter(pl.col("k") == 0).to_dicts()}
    assert k0[4]["step_ms"] == pytest.approx(3.0) and k0[4]["step_source"] == "measured"
    # one recorded concurrency: what its k=0 step holds beyond the calibrated MoE and all-reduce is held; the MoE
    # here reads the same experts at both, and the all-reduce moves 1 token instead of 4
    assert k0[1]["step_source"] == "estimated"
    assert k0[1]["step_ms"] == pytest.approx(3.0 - k0[4]["allreduce_ms"] + k0[1]["allreduce_ms"])


def test_a_concurrency_the_k0_trace_passed_through_takes_only_its_k0_step_from_those_steps() -> None:
    per_batch = pl.concat([_per_k([8.0, 12.0], [1.0, 1.5]).with_columns(batch=pl.lit(b, pl.Int32)) for b in (1, 4)])
    per_batch = per_batch.with_columns(uniform_bound=pl.col("unique_experts"), union_source=pl.lit("measured"))
    deployment = deployment_for(SMALL, 2, 1)
    held, _ = speedup_per_batch(per_batch, deployment, None, small_calibration(), (8.0, 8.0), {4: MeasuredSteps(3.0)})
    passed, basis = speedup_per_batch(per_batch, deployment, None, small_calibration(), (8.0, 8.0),
                                      {4: MeasuredSteps(3.0)}, passed={1: 2.25})
    at_one = {row["k"]: row for row in passed.filter(pl.col("batch") == 1).to_dicts()}
    before = {row["k"]: row for row in held.filter(pl.col("batch") == 1).to_dicts()}
    # the k=0 step is the 2.25 ms the trace measured at one request, not the estimate's; the k=1 step stays the
    # estimate's: the k=0 step's correction is not carried into it
    assert before[0]["step_ms"] != pytest.approx(2.25)
    assert at_one[0]["step_ms"] == pytest.approx(2.25) and at_one[0]["step_source"] == "estimated"
    assert at_one[1]["step_ms"] == pytest.approx(before[1]["step_ms"])
    assert any("2.250 ms at 1" in note for note in basis["notes"])
    # at the recorded concurrency nothing changes
    assert passed.filter(pl.col("batch") == 4)["step_ms"].to_list() == held.filter(pl.col("batch") == 4)[
        "step_ms"].to_list()


def test_passed_concurrencies_need_enough_k0_steps_and_are_not_those_the_sweep_ran_at() -> None:
    # decode step pairs per (k, batch): 1 and 16 ran at; 8 passed through 20 times, 5 only 19, 12 at k=2 only
    steps = pl.DataFrame({"k": [0, 0, 0, 0, 2], "batch": [1, 5, 8, 16, 12], "decode_steps": [400, 19, 20, 120, 50],
                          "period_ms": [2.0, 4.0, 4.5, 6.0, 7.0]})
    assert passed_baselines(steps, {1: 2.0, 16: 6.0}) == {8: 4.5}


def test_design_profile_uniform_k3_is_in_the_hand_band() -> None:
    shape = SHAPE_PRESETS["kimi-k2"]
    per_k = uniform_unions(384, 8, linear_placement(384, 1), range(4), [1]).with_columns(
        tokens=pl.col("k").cast(pl.Float64) + 1,
        tokens_per_step=pl.Series([tokens_per_step(geometric_acceptance(0.7, k)) for k in range(4)]))
    table, _ = predict(per_k, deployment_for(shape, 8, 1), PROFILE_PRESETS["kimi-k2-tp8"], None)
    k3 = table.filter(pl.col("k") == 3).to_dicts()[0]
    assert k3["unique_experts"] == pytest.approx(384 * (1 - (1 - 8 / 384) ** 4))
    assert 1.9 <= k3["speedup"] <= 2.3


def test_uniform_busiest_rank_is_hand_computed_where_it_is_certain() -> None:
    every = uniform_unions(16, 16, linear_placement(16, 4), [0], [1])  # every expert used: 4 per rank
    assert every["busiest_rank_experts"].item() == 4.0 and every["ranks_touched"].item() == 4.0
    one = uniform_unions(64, 1, linear_placement(64, 8), [0], [1])  # one token, one expert: one rank holds it
    assert one["busiest_rank_experts"].item() == 1.0 and one["ranks_touched"].item() == 1.0
    single = uniform_unions(16, 2, np.zeros(16, dtype=np.int64), [1], [1])
    assert single["busiest_rank_experts"].item() == pytest.approx(16 * (1 - (1 - 2 / 16) ** 2))


def test_a_longer_context_adds_the_same_kv_read_to_every_k_and_speculation_pays_more() -> None:
    """Two concurrencies, k = 0 and 2, recorded at 100 tokens of context; moved to 10,100 tokens at 1,000 bytes a
    token and 1,000 GB/s, a step of B requests reads B × 10,000 × 1,000 bytes more: B × 0.01 ms. By hand."""
    speedups = pl.DataFrame({"batch": [1, 1, 4, 4], "k": [0, 2, 0, 2], "step_ms": [10.0, 12.0, 10.0, 12.0],
                             "tokens_per_step": [1.0, 2.0, 1.0, 2.0], "prefill_ms_per_token": [0.0, 0.0, 0.5, 0.5]})
    moved = at_contexts(speedups, [100, 10_100], 100.0, 1_000, 1_000.0)
    rows = {(r["context"], r["batch"], r["k"]): r for r in moved.to_dicts()}
    assert rows[(100, 4, 2)]["speedup"] == pytest.approx((10.0 / 1 + 0.5) / (12.0 / 2 + 0.5))
    assert rows[(10_100, 1, 2)]["attention_kv_ms"] == pytest.approx(0.01)
    assert rows[(10_100, 4, 0)]["step_ms"] == pytest.approx(10.04)
    assert rows[(10_100, 4, 2)]["speedup"] == pytest.approx((10.04 / 1 + 0.5) / (12.04 / 2 + 0.5))
    assert rows[(10_100, 4, 2)]["speedup"] > rows[(100, 4, 2)]["speedup"]
    assert {r["step_source"] for r in rows.values()} == {"estimated"}
    # four requests' step measured at 5,100 tokens (one request's at 100): moved 5,000 tokens, 4 × 0.005 ms
    per_batch = at_contexts(speedups, [10_100], 100.0, 1_000, 1_000.0, from_contexts={4: 5_100.0})
    assert per_batch.filter(pl.col("k") == 0)["attention_kv_ms"].to_list() == pytest.approx([0.01, 0.02])


def test_a_calibrated_attention_curve_moves_each_k_by_its_own_queries_and_marks_what_it_did_not_time() -> None:
    """A curve of one layer timed at Q = 1 (2 + 0.001·B·L µs) and Q = 3 (2 + 0.002·B·L µs), up to 8,100 tokens and
    16,200 cached tokens; 10 layers. From 100 to 8,100 tokens a step of B requests at k = 0 grows 10 × 0.001 × B ×
    8,000 µs = 0.08·B ms, at k = 2 twice that (three queries over the same cache). By hand; past 8,100 tokens, or at
    4 requests × 8,100, the curve was not timed: extrapolated."""
    curve = AttentionCurve(lines=((1, 1, 2.0, 0.001), (1, 4, 2.0, 0.004), (3, 1, 2.0, 0.002), (3, 4, 2.0, 0.008)),
                           kv_bytes_per_token_layer=1152,
                           max_context=8_100, max_cached_tokens=16_200, max_batch=4, heads_per_rank=8,
                           kernel="by hand")
    speedups = pl.DataFrame({"batch": [1, 1, 4, 4], "k": [0, 2, 0, 2], "step_ms": [10.0, 12.0, 10.0, 12.0],
                             "tokens_per_step": [1.0, 2.0, 1.0, 2.0], "prefill_ms_per_token": [0.0, 0.0, 0.0, 0.0]})
    moved = at_contexts(speedups, [8_100, 20_100], 100.0, 11_520, 1_000.0, curve, 10)
    rows = {(r["context"], r["batch"], r["k"]): r for r in moved.to_dicts()}
    assert rows[(8_100, 1, 0)]["attention_kv_ms"] == pytest.approx(0.08)
    assert rows[(8_100, 1, 2)]["attention_kv_ms"] == pytest.approx(0.16)
    assert rows[(8_100, 4, 2)]["attention_kv_ms"] == pytest.approx(0.64)
    assert rows[(8_100, 1, 2)]["speedup"] == pytest.approx(10.08 / (12.16 / 2))
    assert rows[(8_100, 1, 2)]["step_source"] == "estimated" and rows[(8_100, 4, 2)]["step_source"] == "extrapolated"
    assert rows[(20_100, 1, 2)]["step_source"] == "extrapolated"
    assert curve.layer_us(1, 2, 1_000) == pytest.approx(2 + 0.0015 * 1_000)  # Q between the timed ones: linear
    assert curve.extrapolated(8, 1, 100) and not curve.extrapolated(4, 3, 100)  # more requests than timed


def test_a_step_past_the_largest_recorded_concurrency_is_extrapolated_and_between_them_estimated() -> None:
    from moetrace.analysis.cost import step_source

    recorded = MeasuredSteps(3.0, estimated_from=(1, 16))
    assert step_source(8, recorded) == "estimated"
    assert step_source(48, recorded) == "extrapolated"
    assert step_source(16, MeasuredSteps(3.0)) == "measured"  # the sweep's own steps there


def test_an_fp4_format_no_kernel_timed_is_priced_from_its_bytes_at_the_measured_bandwidth_and_says_so() -> None:
    # SMALL at tp2 in MXFP4: 3 × 1000 × 32 weights of 4 bits and an 8-bit scale per 32 = 48,000 + 3,000 B an
    # expert, 25,500 B on each of 2 ranks; the calibration timed bf16 alone, its weights streaming at 50 GB/s
    mxfp4 = replace(SMALL, expert_weight_bits=4, quant_group_size=32, scale_bits=8, expert_format="mxfp4")
    calibration = small_calibration()
    calibration["experts"][0]["marginal_weight_gbs"] = 50.0
    deployment = deployment_for(mxfp4, 2, 1)
    assert deployment.weight_format == "mxfp4"  # never INT4's curve, though both are 4 bits
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment, None, calibration)
    assert basis["weight_format"] == "mxfp4 (estimated from bytes)"
    assert any("estimated from its bytes" in note and "50 GB/s" in note for note in basis["notes"])
    # one MoE layer at one token: the kernel's c0 10 us + 25,500 B / 50 GB/s (0.51 us) per expert × 8 + 0.5 us per
    # row × 8, and the shared expert as one eighth of that one-token point
    routed = 10.0 + 0.51 * 8 + 0.5 * 8
    assert table["expert_layer_us"][0] == pytest.approx(routed + routed / 8)
    nvfp4 = replace(mxfp4, quant_group_size=16, tensor_scale_bits=32, expert_format="nvfp4 modelopt NVFP4 16")
    assert deployment_for(nvfp4, 2, 1).weight_format == "nvfp4"
    assert deployment_for(replace(mxfp4, expert_format="compressed-tensors int4"), 2, 1).weight_format == "int4"
