"""Unique experts per step at concurrency B, against brute-force unions in plain Python and hand-computed cases."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from moetrace.analysis.concurrency import (
    ESTIMATED,
    ESTIMATED_ALL,
    MEASURED_BATCH,
    batch_unions,
    uniform_batch_union,
)
from moetrace.analysis.budgets import window_sample
from moetrace.analysis.placement import linear_placement
from trace_builder import Model, routing_frame, verify_tokens

MODEL = Model(num_experts=32, top_k=2, layers=(1, 2))


def unions(routing: pl.LazyFrame, ks: list[int], batches: list[int], trace_k: int, ranks: int = 1) -> pl.DataFrame:
    sample = window_sample(routing, trace_k, ["experts"])
    return batch_unions(sample, 32, 2, linear_placement(32, ranks), ks=ks, batches=batches, trace_k=trace_k)


def test_uniform_union_is_hand_computed_for_small_cases() -> None:
    assert uniform_batch_union(4, 2, 1) == pytest.approx(2.0)
    assert uniform_batch_union(4, 2, 2) == pytest.approx(3.0)  # 4·(1 − (1/2)²)
    assert uniform_batch_union(384, 8, 0) == 0.0


def brute_force_step_unions(frame: pl.DataFrame, layer: int, batch: int) -> list[int]:
    """Per verify step with exactly ``batch`` requests: the size of the union of every row's experts."""
    sets: dict[int, set[int]] = {}
    requests: dict[int, set[int]] = {}
    for row in frame.filter((pl.col("layer") == layer) & (pl.col("phase").cast(pl.String) == "verify")).iter_rows(named=True):
        sets.setdefault(row["step"], set()).update(row["experts"])
        requests.setdefault(row["step"], set()).add(row["request"])
    return [len(experts) for step, experts in sets.items() if len(requests[step]) == batch]


def test_measured_unions_equal_brute_force_over_steps_with_exactly_b_requests() -> None:
    tokens = verify_tokens(np.random.default_rng(3), MODEL, requests=4, steps=12, k=2, accept_prob=0.6)
    routing = routing_frame(tokens, MODEL)
    table = unions(routing, [2], [4], 2)
    frame = routing.collect().with_columns(pl.col("experts").arr.to_list())
    for layer in MODEL.layers:
        row = table.filter(pl.col("layer") == layer).row(0, named=True)
        assert row["source"] == MEASURED_BATCH
        assert row["unique_experts"] == pytest.approx(np.mean(brute_force_step_unions(frame, layer, 4)))


def test_estimated_unions_with_all_windows_equal_the_union_of_every_window() -> None:
    tokens = verify_tokens(np.random.default_rng(4), MODEL, requests=2, steps=6, k=1, accept_prob=0.5)
    routing = routing_frame(tokens, MODEL)
    table = unions(routing, [3], [1000], 1)
    frame = routing.collect().with_columns(pl.col("experts").arr.to_list())
    for layer in MODEL.layers:
        # counterfactual windows of 4 consecutive accepted (not prefill) tokens, complete ones only, per request
        expected: set[int] = set()
        for request in (0, 1):
            accepted = frame.filter(
                (pl.col("layer") == layer) & (pl.col("request") == request)
                & (pl.col("phase").cast(pl.String) != "prefill")
                & (pl.col("accepted").is_null() | pl.col("accepted"))).sort("position")
            by_window: dict[int, list[list[int]]] = {}
            for row in accepted.iter_rows(named=True):
                by_window.setdefault(row["position"] // 4, []).append(row["experts"])
            for rows in by_window.values():
                if len(rows) == 4:
                    expected.update(e for experts in rows for e in experts)
        row = table.filter(pl.col("layer") == layer).row(0, named=True)
        assert row["source"] == ESTIMATED_ALL and row["unique_experts"] == len(expected)


def test_estimated_unions_of_independent_uniform_windows_approach_the_uniform_bound() -> None:
    tokens = verify_tokens(np.random.default_rng(5), MODEL, requests=64, steps=40, k=0, accept_prob=0.0)
    routing = routing_frame(tokens, MODEL)
    table = unions(routing, [1], [1, 4], 0, ranks=4)
    for batch in (1, 4):
        rows = table.filter(pl.col("batch") == batch)
        assert set(rows["source"]) == {ESTIMATED}
        assert rows["unique_experts"].mean() == pytest.approx(uniform_batch_union(32, 2, 2 * batch), rel=0.04)
        assert (rows["busiest_rank_experts"] <= rows["unique_experts"]).all()
        assert (rows["busiest_rank_experts"] >= rows["unique_experts"] / 4).all()


def test_long_traces_are_sampled_by_whole_steps_and_keep_the_measured_union(monkeypatch: pytest.MonkeyPatch) -> None:
    import moetrace.analysis.concurrency as concurrency

    tokens = verify_tokens(np.random.default_rng(6), MODEL, requests=4, steps=200, k=2, accept_prob=0.6)
    routing = routing_frame(tokens, MODEL)
    full = unions(routing, [2], [4], 2)
    monkeypatch.setattr(concurrency, "MAX_WINDOWS", 50)  # about a quarter of the 200 steps' windows per layer
    sampled = unions(routing, [2], [4], 2)
    assert set(sampled["source"]) == {MEASURED_BATCH}  # whole steps kept: still steps of exactly 4 requests
    assert sampled["unique_experts"].to_list() == pytest.approx(full["unique_experts"].to_list(), rel=0.1)


def test_a_sample_of_position_blocks_keeps_whole_windows_of_every_k() -> None:
    tokens = verify_tokens(np.random.default_rng(7), MODEL, requests=6, steps=2000, k=0, accept_prob=0.0)
    routing = routing_frame(tokens, MODEL)
    sample = window_sample(routing, 0, ["experts"], max_rows=routing.collect().height // 3)
    assert 0.2 < sample.share < 0.5 and sample.accepted.height < routing.collect().height
    for k in range(9):
        windows, _ = sample.windows(k, False, 10**9)
        sizes = windows.collect().group_by("layer", "window_major", "window_minor").len()["len"]
        assert sizes.len() > 0 and (sizes == k + 1).all()


def test_a_sweeps_trace_at_k_gives_the_measured_unions_at_that_k() -> None:
    primary = routing_frame(verify_tokens(np.random.default_rng(7), MODEL, requests=4, steps=12, k=3,
                                          accept_prob=0.6), MODEL)
    at_two = routing_frame(verify_tokens(np.random.default_rng(8), MODEL, requests=4, steps=12, k=2,
                                         accept_prob=0.6), MODEL)
    table = batch_unions(window_sample(primary, 3, ["experts"]), 32, 2, linear_placement(32, 1), ks=[1, 2, 3],
                         batches=[4], trace_k=3, recorded={2: window_sample(at_two, 2, ["experts"])})
    frame = at_two.collect().with_columns(pl.col("experts").arr.to_list())
    for layer in MODEL.layers:
        rows = {row["k"]: row for row in table.filter(pl.col("layer") == layer).iter_rows(named=True)}
        # k = 2: the steps of the trace recorded at k = 2, brute force; k = 1 was recorded by neither
        assert rows[2]["source"] == MEASURED_BATCH
        assert rows[2]["unique_experts"] == pytest.approx(np.mean(brute_force_step_unions(frame, layer, 4)))
        assert rows[3]["source"] == MEASURED_BATCH and rows[1]["source"] != MEASURED_BATCH
