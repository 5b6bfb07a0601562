"""The cost model (analysis/cost.py) against hand-computed cases, and `moetrace report --profile/--calibration`."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import polars as pl
import pytest
from click.testing import CliRunner

from moetrace.analysis.acceptance import acceptance_curve, tokens_per_step
from moetrace.analysis.concurrency import uniform_unions
from moetrace.analysis.calibration import allreduce_model, drafter_step_ms, expert_fit, ring_model, table_time_us
from moetrace.analysis.cost import MeasuredSteps, at_contexts, forward_beyond_moe, per_k_from_nearest, predict
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.decision import speedup_per_batch
from moetrace.analysis.placement import linear_placement
from moetrace.analysis.profile import PROFILE_PRESETS, Profile
from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.cli import main
from moetrace.report.inputs import open_run
from moetrace.trace.reader import open_trace
from moetrace.report.measured import measured_baselines, passed_baselines, recorded_phases
from trace_builder import Model, decode_tokens, small_k2_trace, verify_tokens, write_trace

SMALL = ModelShape(num_experts=64, top_k=8, num_layers=2, moe_layers=2, hidden_size=1000, expert_width=32,
                   shared_experts=1, expert_weight_bits=16, quant_group_size=None)


def _calibration(world_sizes: tuple[int, ...] = (2,)) -> dict[str, Any]:
    fit = {"model": "", "c0_us": 10.0, "per_expert_us": 2.0, "per_row_us": 0.5}
    measured = [{"world_size": n, "backend": "nccl",
                 "points": [{"bytes": 2000, "tokens": 1, "time_us": 10.0},
                            {"bytes": 8000, "tokens": 4, "time_us": 13.0},
                            {"bytes": 16000, "tokens": 8, "time_us": 12.0}],
                 "fit": {"latency_us": 9.0, "bus_bandwidth_gbs": 2.0, "timing": "graph"}} for n in world_sizes]
    return {"schema": "moetrace-calibration/1", "device": {"name": "test", "count": 2},
            "shape": {"hidden_size": 1000},
            "experts": [{"config": "tp2", "format": "bf16", "weight_bits": 16, "estimated": False, "fit": fit}],
            "int4_estimate": [], "allreduce": {"measured": measured}}


def test_a_curve_measured_at_the_same_per_rank_work_serves_another_config() -> None:
    calibration = _calibration()
    calibration["experts"][0].update(width=16, experts_per_rank=64)  # tp2 of SMALL: each rank 1000×16, 64 experts
    per_gpu = deployment_for(replace(SMALL, expert_width=16), 1, 1)  # SMALL's per-GPU slice at tp1: the same work
    fit, _, notes = expert_fit(calibration, "tp1", "bf16", per_gpu.rank_shape())
    assert fit["per_expert_us"] == 2.0 and "tp2's serves" in notes[0]
    with pytest.raises(ValueError, match="no expert curve for tp1"):  # 1000×32 per rank: not what tp2 measured
        expert_fit(calibration, "tp1", "bf16", deployment_for(SMALL, 1, 1).rank_shape())


def test_a_measured_k0_step_grows_at_copy_bandwidth_where_no_curve_fits() -> None:
    calibration = {**_calibration(), "copy_bandwidth_gbs": 100.0}
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
    args = (_per_k([8.0, 8.0], [1.0, 1.5]), deployment_for(SMALL, 1, 1), None, {**_calibration(),
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


DRAFTER = {"method": "eagle3", "tp": 2, "parameters_per_rank": 1000, "shape": {"architecture": "test head"},
           "points": [{"tokens": 1, "layers_us": 10.0, "head_us": 2.0, "fc_us": 1.0},
                      {"tokens": 4, "layers_us": 16.0, "head_us": 5.0, "fc_us": 4.0}]}


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
    args = (_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, _calibration())
    plain, _ = predict(*args)
    table, basis = predict(*args, drafter=DRAFTER)
    assert table["drafting_ms"].to_list() == pytest.approx([0.0, 16e-3]) and plain["drafting_ms"][1] is None
    assert table["step_ms"][1] - plain["step_ms"][1] == pytest.approx(16e-3)
    assert any("priced from the calibration's eagle3 curve (test head, tp2" in note for note in basis["notes"])
    # the sweep's own measured drafter wins over a calibrated one
    measured, _ = predict(*args[:3], {**_calibration(), "copy_bandwidth_gbs": 100.0},
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
    doc = _calibration()
    two = allreduce_model(doc, 2)
    assert two is not None and not two.extrapolated
    assert two.time_us(5000) == pytest.approx(11.5)  # interpolated between 10 µs and 13 µs
    assert two.time_us(12000) == pytest.approx(13.0)  # the 12 µs dip at 16 kB is raised to 13 (non-decreasing)
    eight = allreduce_model(doc, 8)
    assert eight is not None and eight.extrapolated and "EXTRAPOLATED from 2 GPUs" in eight.basis
    assert eight.time_us(2000) == pytest.approx(two.time_us(3500))  # same bytes per GPU: ×1.75
    assert eight.time_us(1e6) == pytest.approx(9.0 + 1.75 * 1e6 / 2e3)  # past the curve: the fitted ring model
    assert allreduce_model(_calibration(()), 8) is None


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
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, _calibration())
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
        predict(_per_k([8.0], [1.0]), deployment_for(SMALL, 1, 2), None, _calibration())


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
    calibration = _calibration()
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
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, _calibration(),
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
                                 _calibration(), measured=MeasuredSteps(0.05))
    # the calibration's 0.1075 ms at k=0 is above the measured 0.05 ms step: the step stays anchored at what was
    # measured and only the calibration's growth (0.1355 - 0.1075 ms) is added at k=1
    assert small["step_ms"].to_list() == pytest.approx([0.05, 0.05 - 0.1075 + 0.0915 + 0.044])
    assert small["rest_ms"].to_list() == pytest.approx([0.05 - 0.1075] * 2)
    assert any("only their growth" in n for n in small_basis["notes"])
    for profile, calibration in ((PROFILE_PRESETS["kimi-k2-tp8"], _calibration()), (None, None)):
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
    table, basis = predict(_per_k([8.0, 12.0], [1.0, 1.5]), deployment_for(SMALL, 2, 1), None, _calibration(),
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
    calibration = {**_calibration(), "copy_bandwidth_gbs": 100.0}
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
    table, _ = speedup_per_batch(per_batch, deployment_for(SMALL, 2, 1), None, _calibration(), (8.0, 8.0),
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
    held, _ = speedup_per_batch(per_batch, deployment, None, _calibration(), (8.0, 8.0), {4: MeasuredSteps(3.0)})
    passed, basis = speedup_per_batch(per_batch, deployment, None, _calibration(), (8.0, 8.0),
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


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return small_k2_trace(tmp_path / "t-k2")


def test_report_predicts_with_profile_and_calibration(trace: Path, tmp_path: Path) -> None:
    calibration = tmp_path / "calib.json"
    calibration.write_text(json.dumps(_calibration()))
    result = CliRunner().invoke(main, ["report", str(trace), "--k", "2", "--tp", "2", "--json", "--force",
                                       "--profile", "step=10ms,allreduce=50%,moe=10%,attention=20%,other=10%",
                                       "--calibration", str(calibration)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    prediction = json.loads(result.stdout)["runs"][0]["prediction"]
    assert prediction["basis"]["mode"] == "profile anchored, calibrated growth"
    assert prediction["at_k"]["k"] == 2 and prediction["per_k"][0]["step_ms"] == pytest.approx(10.0)
    # k=2 recorded: measured; k=1 from the k=2 trace's first position: estimated; k=0 gains one token by definition
    assert [row["acceptance_source"] for row in prediction["per_k"][:3]] == ["measured", "estimated", "measured"]
    page = (trace / "report.html").read_text()
    assert "fig-prediction" in page
    terminal = CliRunner().invoke(main, ["report", str(trace), "--force", "--tp", "8", "--routing", "uniform",
                                         "--acceptance", "0.7", "--calibration", str(calibration)],
                                  catch_exceptions=False)
    assert terminal.exit_code == 1 and "no expert curve for tp8" in terminal.output


def test_report_prices_an_eagle3_trace_drafter_from_the_calibrations_curve(trace: Path, tmp_path: Path) -> None:
    manifest = json.loads((trace / "manifest.json").read_text())
    manifest["spec"]["method"] = "eagle3"
    (trace / "manifest.json").write_text(json.dumps(manifest))
    args = ["report", str(trace), "--tp", "2", "--json", "--force", "--batch", "1,4"]

    def prediction(calibration: dict[str, Any]) -> dict[str, Any]:
        path = tmp_path / "calib.json"
        path.write_text(json.dumps(calibration))
        result = CliRunner().invoke(main, [*args, "--calibration", str(path)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        found: dict[str, Any] = json.loads(result.stdout)["runs"][0]["prediction"]
        return found

    priced = prediction({**_calibration(), "drafter": DRAFTER})
    drafting = {(row["batch"], row["k"]): row["drafting_ms"] for row in priced["per_batch"]}
    assert drafting[(1, 2)] == pytest.approx(drafter_step_ms(DRAFTER, 2, 1))
    # 4 requests: fc and layers over 12 verified tokens (4 + 8·1, 16 + 8·2 µs), the head on 4, then one pass of 4
    assert drafting[(4, 2)] == pytest.approx((12 + 32 + 5 + 16 + 5) / 1e3)
    assert not any("not priced" in note for note in priced["basis"]["notes"])
    unpriced = prediction(_calibration())
    assert any("eagle3 drafter's passes are not priced (the calibration has no drafter curve" in note
               for note in unpriced["basis"]["notes"])
    other = prediction({**_calibration(), "drafter": {**DRAFTER, "method": "draft_model"}})
    assert any("drafter curve is of draft_model" in note for note in other["basis"]["notes"])


def test_report_prediction_bad_input(trace: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "other"}')
    for args, fragment in ((["--calibration", str(bad)], "not a moetrace calibration"),
                           (["--calibration", str(tmp_path / "missing.json")], "cannot read calibration"),
                           (["--profile", "step=1ms"], "--profile"),
                           (["--profile", "kimi-k2-tp8", "--acceptance", "1.5"], "--acceptance")):
        result = CliRunner().invoke(main, ["report", str(trace), "--force", *args], catch_exceptions=False)
        assert result.exit_code == 1 and fragment in result.output and "Traceback" not in result.output
    ok = CliRunner().invoke(main, ["report", str(trace), "--force", "--profile", "kimi-k2-tp8", "--routing",
                                   "uniform", "--acceptance", "0.7"], catch_exceptions=False)
    assert ok.exit_code == 0 and "Predicted verify step" in ok.output


def stretch_steps(trace: Path, factor: float) -> None:
    """Space the trace's recorded steps ``factor`` times as far apart."""
    for part in (trace / "steps").glob("*.parquet"):
        table = pq.read_table(part)
        for name in ("t_start_ns", "t_end_ns"):
            stretched = pa.array([int(v * factor) for v in table[name].to_pylist()], pa.int64())
            table = table.set_column(table.schema.get_field_index(name), name, stretched)
        pq.write_table(table, part)


def prefill_per_token(trace: Path, batch: int) -> float:
    """Brute force over the steps table, at ``batch`` requests per step: what the steps that held a prefill chunk
    ran (start to the next step's start) beyond the mean decode step (consecutive decoding steps of that many
    requests, start to start), per token a request gained in all steps of that many requests."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in pq.read_table(trace / "steps").to_pylist():
        by_step.setdefault(row["step"], []).append(row)
    order = sorted(by_step)
    start = {s: by_step[s][0]["t_start_ns"] / 1e6 for s in order}
    prefill = {s: any(r["num_tokens"] != r["num_drafts"] + 1 for r in by_step[s]) for s in order}
    mine = [s for s in order if len(by_step[s]) == batch and s + 1 in by_step]
    decode_periods = [start[s + 1] - start[s] for s in mine if not prefill[s] and not prefill[s + 1]
                      and len(by_step[s + 1]) == batch]
    excess = sum(start[s + 1] - start[s] for s in mine if prefill[s]) - sum(map(prefill.get, mine)) * (
        sum(decode_periods) / len(decode_periods))
    gained = sum(r["num_accepted"] + 1 for s in order if len(by_step[s]) == batch for r in by_step[s])
    return max(excess, 0.0) * batch / gained


def delay_after_prefill(trace: Path, ms: float) -> None:
    """Every step after one that held a prefill chunk starts ``ms`` later (as do all after it)."""
    table = pq.read_table(trace / "steps")
    rows = table.to_pylist()
    prefill_steps = sorted({r["step"] for r in rows if r["num_tokens"] != r["num_drafts"] + 1})
    for row in rows:
        shift = int(ms * 1e6) * sum(step < row["step"] for step in prefill_steps)
        row["t_start_ns"] += shift
        row["t_end_ns"] += shift
    for part in (trace / "steps").iterdir():
        part.unlink()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), trace / "steps" / "part-00000.parquet")


def with_phases(trace: Path, phases: dict[str, Any]) -> None:
    manifest = json.loads((trace / "manifest.json").read_text())
    manifest["phases"] = phases
    (trace / "manifest.json").write_text(json.dumps(manifest))


def with_workload(trace: Path, workload: dict[str, Any]) -> None:
    manifest = json.loads((trace / "manifest.json").read_text())
    manifest["workload"] = workload
    (trace / "manifest.json").write_text(json.dumps(manifest))


def test_a_round_draining_through_a_few_steps_of_a_concurrency_is_not_a_concurrency_the_sweep_ran_at(
        tmp_path: Path) -> None:
    model = Model()
    write_trace(tmp_path / "sweep" / "k0", decode_tokens(np.random.default_rng(0), model, requests=2, steps=12),
                model, k=0)
    # decode step pairs per concurrency, as a closed loop at 1 and 16 leaves them: 39 at 5 is under a tenth of 400
    steps = pl.DataFrame({"k": [0, 0, 0, 0], "batch": [1, 5, 14, 16], "decode_steps": [400, 39, 40, 120],
                          "period_ms": [2.0, 4.0, 5.5, 6.0]})
    assert measured_baselines(open_run(tmp_path / "sweep", 0), steps) == {1: 2.0, 14: 5.5, 16: 6.0}


def test_a_model_drafter_under_async_scheduling_costs_its_device_time(tmp_path: Path) -> None:
    model = Model()
    timing = {"drafting": {"4": {"calls": 10, "host_ms_median": 1.4, "device_ms_median": 0.35}},
              "sampling": {"4": {"calls": 10, "host_ms_median": 0.3, "device_ms_median": 0.05}}}
    costs = {}
    for scheduling in (True, False):
        trace = write_trace(tmp_path / f"async-{scheduling}", verify_tokens(
            np.random.default_rng(1), model, requests=2, steps=6, k=2, accept_prob=0.5), model, k=2)
        with_phases(trace, timing)
        manifest = json.loads((trace / "manifest.json").read_text())
        manifest["capture"] = {**manifest.get("capture", {}), "async_scheduling": scheduling}
        (trace / "manifest.json").write_text(json.dumps(manifest))
        costs[scheduling] = recorded_phases([open_trace(trace)]).to_dicts()[0]
    # under async scheduling the drafter's host work overlaps the device: its 0.35 ms device median, not 1.4;
    # with async scheduling off, and for every other call, the longer of the two
    assert costs[True]["drafting_ms"] == 0.35 and costs[False]["drafting_ms"] == 1.4
    assert costs[True]["sampling_ms"] == costs[False]["sampling_ms"] == 0.3


def test_report_predicts_from_the_sweeps_own_k0_steps(tmp_path: Path) -> None:
    model = Model()
    write_trace(tmp_path / "sweep" / "k0", decode_tokens(np.random.default_rng(0), model, requests=2, steps=12),
                model, k=0)
    k2 = write_trace(tmp_path / "sweep" / "k2", verify_tokens(np.random.default_rng(1), model, requests=2, steps=10,
                                                              k=2, accept_prob=0.7), model, k=2)

    delay_after_prefill(k2, 3.0)  # a prefill step at k=2 takes 3 ms more than a decode step

    def timed(host: float, device: float | None) -> dict[str, Any]:
        return {"calls": 10, "host_ms_median": host, "device_ms_median": device}

    # what the recorder timed per batch size: a step costs the longer of its host and device time
    with_phases(tmp_path / "sweep" / "k0", {"forward": {"2": timed(0.6, 0.7)}, "sampling": {"2": timed(0.1, None)}})
    with_phases(k2, {"forward": {"2": timed(0.8, 0.75)}, "sampling": {"2": timed(0.2, 0.15)},
                     "drafting": {"1": timed(9.0, None), "2": timed(0.25, None)}})
    calibration = tmp_path / "calib.json"
    calibration.write_text(json.dumps(_calibration()))

    def report(*args: str) -> Any:
        return CliRunner().invoke(main, ["report", str(tmp_path / "sweep"), "--k", "2", "--tp", "2", "--force",
                                         *args], catch_exceptions=False)

    result = report("--calibration", str(calibration), "--profile", "measured", "--batch", "1,2", "--json")
    assert result.exit_code == 0, result.output
    prediction = json.loads(result.stdout)["runs"][0]["prediction"]
    assert prediction["basis"]["mode"] == "measured k=0 step, calibrated growth"
    every_batch = prediction["per_batch"]
    rows = [row for row in every_batch if row["batch"] == 2]  # the builder's k=0 trace decodes 2 requests a step
    assert {row["step_source"] for row in rows} == {"measured"}
    assert next(row["step_ms"] for row in rows if row["k"] == 0) == pytest.approx(1.0)  # 1 ms apart
    # one request per step was never recorded: estimated from the one concurrency that was (held: 1 ms less the
    # MoE and all-reduce calibrated at two requests' unions, plus those at one request's)
    one = [row for row in every_batch if row["batch"] == 1]
    assert {row["step_source"] for row in one} == {"estimated"} and len(one) == len(rows)
    k0_two, k0_one = rows[0], one[0]
    assert k0_one["step_ms"] == pytest.approx(1.0 - k0_two["moe_ms"] - k0_two["allreduce_ms"] + k0_one["moe_ms"]
                                              + k0_one["allreduce_ms"])
    decision = json.loads(result.stdout)["decision"][0]["per_batch"]
    assert [row["batch"] for row in decision] == [1, 2]
    # at two requests the best k is the recorded k=2: its unions and steps measured; at one request the step is
    # estimated (the builder's 20 request-steps are too few to recommend, so k is null and the rows say so)
    assert [(row["best_k"], row["speedup_source"]) for row in decision] == [(2, "estimated"), (2, "measured")]
    # the crossover: predicted over --batch, measured over what the sweep recorded (two requests per step)
    crossovers = json.loads(result.stdout)["decision"][0]["crossover"]
    assert crossovers["predicted"]["looked_at"] == [1, 2] and crossovers["measured"]["looked_at"] == [2]
    assert crossovers["measured"]["best"][0]["speedup"] == pytest.approx(prediction["against_trace"][0][
        "measured_speedup"])
    # the drafter's 0.25 ms per step, measured at k=2 with 2 requests a step, held for every k of an n-gram drafter
    assert {row["drafting_ms"] for row in rows if row["k"] > 0} == {0.25}
    # sampling took 0.2 ms a step at k=2 (the longer of host and device), 0.1 at k=0: 0.1 more, held for every k
    assert [row["sampling_ms"] for row in rows if row["k"] > 0] == pytest.approx([0.1] * 8)
    # beside the recorded k=2 steps (the builder starts a step every 1 ms at every k, each 0.5 ms long): the speedup
    # they measured is per token, 1 ms over tokens per step, plus each trace's prefill steps' time beyond a decode
    # step per token a request gained; what the prediction leaves out is 1 ms minus its predicted step
    (checked,) = prediction["against_trace"]
    assert (checked["batch"], checked["k"]) == (2, 2)
    p0, p2 = prefill_per_token(tmp_path / "sweep" / "k0", 2), prefill_per_token(k2, 2)
    assert p0 == 0.0 and p2 > 0.05  # the k=0 builder writes no prefill step, the k=2 one with 3 ms more
    assert checked["measured_speedup"] == pytest.approx((1.0 + p0) / (1.0 / checked["measured_tokens_per_step"] + p2))
    # the prediction at a recorded k takes that k's prefill steps; a k not recorded the nearest recorded k > 0's
    assert [row["prefill_ms_per_token"] for row in rows] == pytest.approx([p0] + [p2] * 8)
    predicted_k2 = next(row["step_ms"] for row in rows if row["k"] == 2)
    assert checked["unexplained_ms"] == pytest.approx(1.0 - predicted_k2)
    # where the recorded step grew against k=0: not at all (1 ms apart at both), of which forward 0.8 - 0.7,
    # sampling 0.2 - 0.1, and the drafter's 0.25
    assert checked["step_growth_ms"] == pytest.approx(0.0)
    assert (checked["forward_growth_ms"], checked["sampling_growth_ms"]) == (pytest.approx(0.1), pytest.approx(0.1))
    assert checked["drafting_ms"] == 0.25
    terminal = report("--calibration", str(calibration), "--profile", "measured", "--batch", "2")
    assert "Predicted against measured on the machine that recorded" in terminal.output
    # the per-k table is for one request
    assert [row["k"] for row in prediction["per_k"]][:3] == [0, 1, 2]
    assert "Predicted verify step at one request per step" in terminal.output and "draft" in terminal.output
    page = (tmp_path / "sweep" / "report.html").read_text()
    assert 'class="against-trace"' in page and f"{checked['unexplained_ms']:.2f}" in page
    failed = report("--profile", "measured")
    assert failed.exit_code == 1 and "give --calibration too" in failed.output and "Traceback" not in failed.output
    # a concurrency above the engines' slots gets a row that says why there is no recommendation
    for trace in (tmp_path / "sweep" / "k0", k2):
        with_workload(trace, {"batch_size": 4})
    above = json.loads(report("--calibration", str(calibration), "--profile", "measured", "--batch", "3,7",
                              "--json").stdout)
    three, seven = above["decision"][0]["per_batch"]
    assert three["batch"] == 3 and three["status"].startswith("too few windows") and three["best_k"] is not None
    assert seven["k"] is None and "ran at most 4 requests at once (max_num_seqs)" in seven["status"]
    assert any("no recommendation at 7 request(s)" in line for line in above["warnings"])
    terminal_above = report("--calibration", str(calibration), "--profile", "measured", "--batch", "3,7").output
    assert "B=7: no recommendation: the sweep's engines ran at most 4" in " ".join(terminal_above.split())
    for trace in (tmp_path / "sweep" / "k0", k2):
        with_workload(trace, {})
    # a k=0 trace recorded with async scheduling off, its steps 1.5 ms apart against the sweep's 1 ms: every step
    # that drafts pays 0.5 ms more
    sync = write_trace(tmp_path / "sync", decode_tokens(np.random.default_rng(0), model, requests=2, steps=12), model,
                       k=0)
    stretch_steps(sync, 1.5)
    # its forward took 0.75 ms (async off, the step's input preparation no longer overlaps the device): the k=2
    # forward (0.8) grew 0.05 over it, not the 0.1 it grew over the async k=0 step, whose price is the 0.5 ms
    with_phases(sync, {"forward": {"2": timed(0.6, 0.75)}, "sampling": {"2": timed(0.1, None)}})
    synced = report("--calibration", str(calibration), "--profile", "measured", "--batch", "2", "--k0-sync",
                    str(sync), "--json")
    assert synced.exit_code == 0, synced.output
    rows_sync = [row for row in json.loads(synced.stdout)["runs"][0]["prediction"]["per_batch"] if row["batch"] == 2]
    assert [row["scheduling_ms"] for row in rows_sync[:3]] == [0.0, pytest.approx(0.5), pytest.approx(0.5)]
    assert rows_sync[2]["step_ms"] == pytest.approx(predicted_k2 + 0.5 - 0.05)
    widest = report("--calibration", str(calibration), "--profile", "measured", "--batch", "2", "--k0-sync",
                    str(sync)).stdout
    assert "sched" in widest and "rej" in widest
    # every table, the measured-mode ones with a dozen columns included, fits an 80-column terminal unfolded (the
    # next command after them is printed whole, to be copied)
    *tables, next_command = widest.splitlines()
    assert max(len(line) for line in tables) <= 80 and next_command.startswith("next: moetrace report ")
    assert f"{predicted_k2 + 0.5 - 0.05:.2f}" in widest
    with_async = json.loads((sync / "manifest.json").read_text())
    with_async["capture"] = {"async_scheduling": True}
    (tmp_path / "async").mkdir()
    shutil.copytree(sync / "steps", tmp_path / "async" / "steps")
    shutil.copytree(sync / "routing", tmp_path / "async" / "routing")
    (tmp_path / "async" / "manifest.json").write_text(json.dumps(with_async))
    for args, fragment in ((["--k0-sync", str(sync)], "--k0-sync goes with --profile measured"),
                           (["--profile", "measured", "--k0-sync", str(k2)], "needs one trace recorded at k=0"),
                           (["--profile", "measured", "--k0-sync", str(tmp_path / "async")], "async scheduling on"),
                           (["--profile", "measured", "--k0-sync", str(tmp_path / "none")], "no such trace")):
        failed = report("--calibration", str(calibration), "--batch", "2", *args)
        assert failed.exit_code == 1 and fragment in failed.output and "Traceback" not in failed.output, failed.output
    k0_manifest = tmp_path / "sweep" / "k0" / "manifest.json"
    as_recorded = k0_manifest.read_text()
    k0_manifest.write_text(json.dumps({**json.loads(as_recorded), "capture": {"async_scheduling": False}}))
    redundant = report("--calibration", str(calibration), "--profile", "measured", "--batch", "2", "--k0-sync",
                       str(sync))
    assert redundant.exit_code == 1 and "no --k0-sync needed" in redundant.output
    k0_manifest.write_text(as_recorded)
    no_k0 = CliRunner().invoke(main, ["report", str(tmp_path / "sweep" / "k2"), "--k", "2", "--tp", "2", "--force",
                                      "--calibration", str(calibration), "--profile", "measured"])
    assert no_k0.exit_code == 1 and "needs a k=0 trace" in no_k0.output
    # a phase timed in fewer than 3 calls is not measured (one call can be a new batch shape compiling): the
    # forward's growth then stays out
    with_phases(k2, {"forward": {"2": {**timed(0.8, 0.75), "calls": 2}}, "sampling": {"2": timed(0.2, 0.15)}})
    few = [row for row in json.loads(report("--calibration", str(calibration), "--profile", "measured", "--batch", "2",
                                            "--json").stdout)["runs"][0]["prediction"]["per_batch"]
           if row["batch"] == 2]
    assert [row["forward_beyond_moe_ms"] for row in few] == [None] * len(few)


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
