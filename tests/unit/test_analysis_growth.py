"""Growth, per-rank view and rejected-only experts against brute force (Python sets) and the closed form."""

from __future__ import annotations

from collections import defaultdict
from statistics import mean

import numpy as np
import polars as pl
import pytest

from moetrace.analysis.growth import (
    counterfactual_window_sums,
    growth,
    decode_and_verify,
    measured_window_sums,
    rejected_only_experts,
    rejected_only_sums,
    window_means,
)
from moetrace.analysis.concurrency import uniform_unique_experts
from moetrace.analysis.placement import linear_placement
from trace_builder import Model, Tokens, decode_tokens, routing_frame, verify_tokens

MODEL = Model(num_experts=16, top_k=2, layers=(1, 2))
EP = 4


def _rows(tokens: Tokens) -> list[dict[str, object]]:
    return routing_frame(tokens, MODEL).with_columns(pl.col("phase").cast(pl.String)).collect().to_dicts()


def _stats(windows: list[set[int]], expert_rank: np.ndarray) -> tuple[float, float, float]:
    busiest = [max(sum(1 for e in w if expert_rank[e] == r) for r in range(EP)) for w in windows]
    touched = [len({int(expert_rank[e]) for e in w}) for w in windows]
    return mean(len(w) for w in windows), mean(busiest), mean(touched)


def _check(frame: pl.DataFrame, layer: int, k: int, scope: str, windows: list[set[int]]) -> None:
    row = frame.filter((pl.col("layer") == layer) & (pl.col("k") == k) & (pl.col("scope") == scope)).to_dicts()
    assert len(row) == 1, (layer, k, scope)
    unique, busiest, touched = _stats(windows, linear_placement(MODEL.num_experts, EP))
    assert row[0]["windows"] == len(windows)
    assert row[0]["unique_experts"] == pytest.approx(unique)
    assert row[0]["busiest_rank_experts"] == pytest.approx(busiest)
    assert row[0]["ranks_touched"] == pytest.approx(touched)


def test_measured_growth_of_rows_out_of_recording_order_equals_the_recorded_order() -> None:
    tokens = verify_tokens(np.random.default_rng(2), MODEL, requests=3, steps=12, k=3, accept_prob=0.6,
                           variable_drafts=True)
    ordered = routing_frame(tokens, MODEL)
    shuffled = ordered.collect().sample(fraction=1.0, shuffle=True, seed=0).lazy()
    placement = linear_placement(16, EP)
    expected = measured_window_sums(decode_and_verify(ordered), MODEL.num_experts, 3, placement)
    assert measured_window_sums(decode_and_verify(shuffled), MODEL.num_experts, 3, placement).equals(expected)


def test_measured_matches_brute_force() -> None:
    tokens = verify_tokens(np.random.default_rng(1), MODEL, requests=3, steps=12, k=3, accept_prob=0.6,
                           variable_drafts=True)
    rows = _rows(tokens)
    frame = window_means(measured_window_sums(decode_and_verify(routing_frame(tokens, MODEL)), MODEL.num_experts, 3,
                                              linear_placement(16, EP)))
    for layer in MODEL.layers:
        mine = [r for r in rows if r["layer"] == layer and r["phase"] != "prefill"]
        by_window: dict[tuple[object, object], list[dict[str, object]]] = defaultdict(list)
        by_step: dict[object, list[dict[str, object]]] = defaultdict(list)
        for r in mine:
            if r["phase"] == "verify":
                by_window[(r["step"], r["request"])].append(r)
            by_step[r["step"]].append(r)
        for k in range(4):
            windows = [
                {e for r in w if r["draft_pos"] <= k for e in r["experts"]}  # type: ignore[operator, attr-defined]
                for w in by_window.values()
                if max(r["draft_pos"] for r in w) >= k  # type: ignore[type-var]
            ]
            _check(frame, layer, k, "request", windows)
            batches = [{e for r in w if r["draft_pos"] <= k for e in r["experts"]} for w in by_step.values()]  # type: ignore[operator, attr-defined]
            _check(frame, layer, k, "batch", batches)


def test_counterfactual_matches_brute_force() -> None:
    tokens = verify_tokens(np.random.default_rng(2), MODEL, requests=2, steps=15, k=2, accept_prob=0.5,
                           variable_drafts=True)
    rows = _rows(tokens)
    frame = window_means(counterfactual_window_sums(routing_frame(tokens, MODEL), MODEL.num_experts, range(6),
                                                    linear_placement(16, EP)))
    for layer in MODEL.layers:
        in_sequence = [
            r
            for r in rows
            if r["layer"] == layer
            and (r["phase"] == "decode" or (r["phase"] == "verify" and (r["draft_pos"] == 0 or r["accepted"])))
        ]
        for k in range(6):
            groups: dict[tuple[object, int], list[set[int]]] = defaultdict(list)
            for r in in_sequence:
                groups[(r["request"], int(r["position"]) // (k + 1))].append(set(r["experts"]))  # type: ignore[call-overload, arg-type]
            windows = [set().union(*sets) for sets in groups.values() if len(sets) == k + 1]
            _check(frame, layer, k, "request", windows)


def test_uniform_random_routing_meets_closed_form() -> None:
    model = Model(num_experts=384, top_k=8, layers=(0,))
    tokens = decode_tokens(np.random.default_rng(3), model, requests=4, steps=6000)
    frame = window_means(counterfactual_window_sums(routing_frame(tokens, model), 384, range(1, 9),
                                                    linear_placement(384, 1)))
    for row in frame.to_dicts():
        assert row["unique_experts"] == pytest.approx(uniform_unique_experts(384, 8, row["k"] + 1), rel=0.01)


def test_all_tokens_on_the_same_experts_never_grow() -> None:
    model = Model(num_experts=384, top_k=8, layers=(3, 4))
    tokens = verify_tokens(np.random.default_rng(4), model, requests=2, steps=10, k=4, accept_prob=0.7)
    tokens.experts[:] = np.arange(100, 108, dtype=np.uint16)
    frame = growth(routing_frame(tokens, model), 384, 8, range(9), 4, linear_placement(384, 8))
    assert frame.filter(pl.col("scope") == "request")["unique_experts"].to_list() == [8.0] * (2 * (5 + 9))
    assert set(frame["unique_experts"].to_list()) == {8.0}
    assert set(frame["ranks_touched"].to_list()) == {1.0}  # experts 100..107 all live on rank 2 of 8


def test_growth_labels_sources_and_locality() -> None:
    tokens = verify_tokens(np.random.default_rng(5), MODEL, requests=2, steps=10, k=2, accept_prob=0.5)
    frame = growth(routing_frame(tokens, MODEL), 16, 2, range(5), 2, linear_placement(16, 1))
    measured = frame.filter((pl.col("source") == "measured") & (pl.col("scope") == "request"))
    assert sorted(set(measured["k"].to_list())) == [0, 1, 2]
    assert sorted(set(frame.filter(pl.col("source") == "counterfactual")["k"].to_list())) == [0, 1, 2, 3, 4]
    assert frame.filter(pl.col("scope") == "batch")["uniform_bound"].null_count() == frame.filter(
        pl.col("scope") == "batch"
    ).height
    row = measured.filter((pl.col("k") == 2) & (pl.col("layer") == 1)).to_dicts()[0]
    assert row["uniform_bound"] == pytest.approx(16 * (1 - (1 - 2 / 16) ** 3))
    assert row["locality"] == pytest.approx(row["unique_experts"] / row["uniform_bound"])


def test_rejected_only_matches_brute_force() -> None:
    tokens = verify_tokens(np.random.default_rng(6), MODEL, requests=3, steps=10, k=3, accept_prob=0.5,
                           variable_drafts=True)
    rows = _rows(tokens)
    frame = rejected_only_experts(rejected_only_sums(decode_and_verify(routing_frame(tokens, MODEL)), 16))
    for layer in MODEL.layers:
        windows: dict[tuple[object, object], list[dict[str, object]]] = defaultdict(list)
        for r in rows:
            if r["layer"] == layer and r["phase"] == "verify":
                windows[(r["step"], r["request"])].append(r)
        rejected = [
            len(
                {e for r in w for e in r["experts"]}  # type: ignore[attr-defined]
                - {e for r in w if r["draft_pos"] == 0 or r["accepted"] for e in r["experts"]}  # type: ignore[attr-defined]
            )
            for w in windows.values()
        ]
        row = frame.filter(pl.col("layer") == layer).to_dicts()[0]
        assert row["windows"] == len(windows)
        assert row["rejected_only_experts"] == pytest.approx(mean(rejected))
