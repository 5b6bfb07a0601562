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
    measured_window_sums,
    rejected_only_experts,
    rejected_only_sums,
    window_means,
)
from moetrace.analysis.concurrency import uniform_unique_experts
from moetrace.analysis.placement import linear_placement
from moetrace.analysis.window_rows import decode_and_verify
import decision_oracle as oracle
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
        by_request_step: dict[tuple[object, object], list[dict[str, object]]] = defaultdict(list)
        by_step: dict[object, list[dict[str, object]]] = defaultdict(list)
        for r in mine:
            by_request_step[(r["step"], r["request"])].append(r)
            by_step[r["step"]].append(r)
        for k in range(4):
            # every request-step (with drafts or not), the drafts it proposed past k left out
            windows = [{e for r in w if r["draft_pos"] <= k for e in r["experts"]}  # type: ignore[operator, attr-defined]
                       for w in by_request_step.values()]
            _check(frame, layer, k, "request", windows)
            steps = [{e for r in w if r["draft_pos"] <= k for e in r["experts"]} for w in by_step.values()]  # type: ignore[operator, attr-defined]
            _check(frame, layer, k, "batch", steps)  # scope "batch": the union over a whole step's requests


def test_counterfactual_windows_hold_what_the_drafter_proposed_by_brute_force() -> None:
    """Drafts 0..2 per request-step at K = 2: at every k, windows of min(d, k) + 1 accepted tokens from each anchor
    (past K, d + 1 where d < 2, k + 1 where the drafter was capped), against the oracle's own count."""
    tokens = verify_tokens(np.random.default_rng(2), MODEL, requests=2, steps=15, k=2, accept_prob=0.5,
                           variable_drafts=True)
    rows = _rows(tokens)
    assert 0 < sum(d == 2 for d in tokens.draft_pos.tolist()) < sum(d == 0 for d in tokens.draft_pos.tolist())
    frame = window_means(counterfactual_window_sums(routing_frame(tokens, MODEL), MODEL.num_experts, range(6),
                                                    linear_placement(16, EP), 2))
    for k in range(6):
        for layer, windows in oracle.counterfactual_windows(rows, k, 2).items():
            _check(frame, layer, k, "request", list(windows.values()))


def test_counterfactual_windows_by_hand() -> None:
    """One request at K = 3, each token its own two experts (2p, 2p + 1), so a window's unique experts are twice
    its tokens. Request-steps: anchor 4 proposes 1 (accepted); anchor 6 proposes 3 (1 accepted, 2 rejected);
    anchor 8 none; anchor 9 proposes 3 (all accepted); anchor 13 none. At k = 2 the windows hold 2, 3, 1, 3, 1
    tokens (anchor 6's: 6, 7 and the next anchor 8): 4.0 experts. At k = 5 anchor 6 reads 6 tokens (capped at K:
    6..11), anchor 9's 9..14 runs past the request's last token (13): 4, 12, 2, 2: 5.0."""
    model = Model(num_experts=32, top_k=2, layers=(1,))
    steps = [(1, 4, 1, 1), (2, 6, 3, 1), (3, 8, 0, 0), (4, 9, 3, 3), (5, 13, 0, 0)]  # step, anchor, drafts, accepted
    step, position, draft_pos, phase, accepted = [], [], [], [], []
    for number, anchor, drafts, kept in steps:
        for j in range(drafts + 1):
            step.append(number), position.append(anchor + j), draft_pos.append(j)
            phase.append("verify" if drafts else "decode"), accepted.append(None if j == 0 else j <= kept)
    experts = np.array([[[2 * p, 2 * p + 1]] if accepted[i] is not False else [[30, 31]]
                        for i, p in enumerate(position)], dtype=np.uint16)
    tokens = Tokens(step=np.array(step, np.uint32), request=np.zeros(len(step), np.uint32),
                    position=np.array(position, np.uint32), phase=phase, draft_pos=np.array(draft_pos, np.uint8),
                    accepted=accepted, experts=experts, weights=np.ones(experts.shape, np.float32))
    frame = window_means(counterfactual_window_sums(routing_frame(tokens, model), 32, [2, 5],
                                                    linear_placement(32, 1), 3))
    assert dict(zip(frame["k"].to_list(), frame["unique_experts"].to_list())) == {2: 4.0, 5: 5.0}
    assert frame["windows"].to_list() == [5, 4]


def test_uniform_random_routing_meets_closed_form() -> None:
    model = Model(num_experts=384, top_k=8, layers=(0,))
    tokens = decode_tokens(np.random.default_rng(3), model, requests=4, steps=6000)
    frame = window_means(counterfactual_window_sums(routing_frame(tokens, model), 384, range(1, 9),
                                                    linear_placement(384, 1), 0))
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
