"""Budgets against brute force: rank experts per window, keep the top B, measure what is kept."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import polars as pl
import pytest

import moetrace.analysis.window_rows as rows_module
from moetrace.analysis.budgets import (
    budget_curves,
    budget_windows,
    sample_selection,
    sampled_windows,
    smallest_budgets,
    split_sample,
    window_share,
)
from moetrace.analysis.window_rows import KeptRows
from trace_builder import Model, routing_frame, verify_tokens

MODEL = Model(num_experts=16, top_k=2, layers=(1, 2))
EXPERT_BYTES = 1000


def _brute_force(rows: list[dict[str, object]], layer: int, budget: int, use_candidates: bool) -> dict[str, float]:
    windows: dict[tuple[object, object], list[dict[str, object]]] = defaultdict(list)
    for r in rows:
        if r["layer"] == layer and r["phase"] == "verify":
            windows[(r["step"], r["request"])].append(r)
    kept_weight = total_weight = 0.0
    rerouted = tokens = 0
    read: list[int] = []
    unique: list[int] = []
    for window in windows.values():
        score: dict[int, float] = defaultdict(float)
        for r in window:
            names, values = ("cand_experts", "cand_scores") if use_candidates else ("experts", "weights")
            for e, s in zip(r[names], r[values]):  # type: ignore[call-overload]
                score[e] += s
        kept = set(sorted(score, key=lambda e: (-score[e], e))[:budget])
        picked = {e for r in window for e in r["experts"]}  # type: ignore[attr-defined]
        for r in window:
            tokens += 1
            rerouted += any(e not in kept for e in r["experts"])  # type: ignore[attr-defined]
            for e, w in zip(r["experts"], r["weights"]):  # type: ignore[call-overload]
                total_weight += w
                kept_weight += w if e in kept else 0.0
        read.append(min(len(picked), budget))
        unique.append(len(picked))
    saved = float(np.mean(unique) - np.mean(read))
    return {
        "coverage": kept_weight / total_weight,
        "rerouted_share": rerouted / tokens,
        "experts_read": float(np.mean(read)),
        "experts_saved": saved,
        "bytes_saved": saved * EXPERT_BYTES,
    }


@pytest.mark.parametrize("candidates", [0, 5])
def test_budget_curves_match_brute_force(candidates: int) -> None:
    tokens = verify_tokens(np.random.default_rng(7), MODEL, requests=3, steps=8, k=3, accept_prob=0.5,
                           candidates=candidates)
    routing = routing_frame(tokens, MODEL)
    rows = routing.with_columns(pl.col("phase").cast(pl.String)).collect().to_dicts()
    curves = budget_curves(budget_windows(routing, 3, measured=True), EXPERT_BYTES, use_candidates=bool(candidates))
    for layer in MODEL.layers:
        mine = curves.filter(pl.col("layer") == layer)
        assert mine["budget"].to_list() == list(range(1, mine.height + 1))
        assert mine["coverage"][-1] == pytest.approx(1.0)
        for row in mine.to_dicts():
            expected = _brute_force(rows, layer, row["budget"], bool(candidates))
            for name, value in expected.items():
                assert row[name] == pytest.approx(value), (layer, row["budget"], name)


def test_smallest_budget_meets_the_target() -> None:
    tokens = verify_tokens(np.random.default_rng(8), MODEL, requests=2, steps=8, k=3, accept_prob=0.5)
    curves = budget_curves(budget_windows(routing_frame(tokens, MODEL), 3, measured=True), EXPERT_BYTES, False)
    chosen = smallest_budgets(curves.lazy(), 0.9)
    for row in chosen.to_dicts():
        layer_curve = curves.filter(pl.col("layer") == row["layer"])
        assert row["coverage"] >= 0.9
        smaller = layer_curve.filter(pl.col("budget") == row["budget"] - 1)["coverage"].to_list()
        assert not smaller or smaller[0] < 0.9


def test_counterfactual_windows_are_complete_runs_of_accepted_tokens() -> None:
    tokens = verify_tokens(np.random.default_rng(9), MODEL, requests=2, steps=10, k=2, accept_prob=0.5)
    windows = budget_windows(routing_frame(tokens, MODEL), 4, measured=False).collect()
    sizes = windows.group_by("layer", "window_major", "window_minor").len()["len"].unique().to_list()
    assert sizes == [5]
    assert windows["phase"].cast(pl.String).is_in(["decode", "verify"]).all()


def test_measured_windows_are_the_verification_windows_that_verified_k_drafts() -> None:
    tokens = verify_tokens(np.random.default_rng(12), MODEL, requests=3, steps=30, k=3, accept_prob=0.5,
                           variable_drafts=True)
    windows = budget_windows(routing_frame(tokens, MODEL), 3, measured=True).collect()
    drafts_per_window: dict[tuple[int, int], int] = {}
    for step, request, phase, draft in zip(tokens.step, tokens.request, tokens.phase, tokens.draft_pos):
        if phase == "verify":
            key = (int(step), int(request))
            drafts_per_window[key] = max(drafts_per_window.get(key, 0), int(draft))
    full = {key for key, drafts in drafts_per_window.items() if drafts == 3}
    assert 0 < len(full) < len(drafts_per_window)
    kept = set(zip((windows["window_major"] // (1 << 16)).to_list(), windows["window_minor"].to_list()))  # step keys
    assert kept == full and len(windows) == 4 * len(full) * len(MODEL.layers)


def test_window_sample_keeps_whole_windows_and_estimates_the_full_curve() -> None:
    tokens = verify_tokens(np.random.default_rng(11), MODEL, requests=40, steps=60, k=3, accept_prob=0.7)
    routing = routing_frame(tokens, MODEL)
    full = budget_windows(routing, 3, measured=True).collect()
    sample = budget_windows(routing, 3, measured=True, share=0.5).collect()
    keys = ["layer", "window_major", "window_minor"]
    full_sizes = {(r[0], r[1], r[2]): r[3] for r in full.group_by(keys).len().iter_rows()}
    sampled_sizes = sample.group_by(keys).len()
    assert all(full_sizes[(r[0], r[1], r[2])] == r[3] for r in sampled_sizes.iter_rows())  # windows stay whole
    share = sampled_sizes.height / len(full_sizes)
    assert 0.4 < share < 0.6
    assert sample.equals(budget_windows(routing, 3, measured=True, share=0.5).collect())  # deterministic
    full_curve = budget_curves(full.lazy(), EXPERT_BYTES, False)
    sample_curve = budget_curves(sample.lazy(), EXPERT_BYTES, False)
    joined = full_curve.join(sample_curve, on=["layer", "budget"], suffix="_sample")
    assert (joined["coverage"] - joined["coverage_sample"]).abs().max() < 0.05  # type: ignore[operator]


@pytest.mark.parametrize("share", [1.0, 0.3])
@pytest.mark.parametrize("chunk_rows", [7, 1 << 20])
def test_a_sample_kept_as_the_rows_stream_equals_one_read_on_its_own(share: float, chunk_rows: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The report keeps the window sample in the pass that streams every non-prefill row (``decode_in_chunks``):
    the rows it keeps, in order, with their experts and weights, are those a pass of its own reads."""
    monkeypatch.setattr(rows_module, "DECODE_CHUNK_ROWS", chunk_rows)
    tokens = verify_tokens(np.random.default_rng(12), MODEL, requests=12, steps=30, k=3, accept_prob=0.6)
    routing = routing_frame(tokens, MODEL)
    columns = ["experts", "weights"]
    kept = KeptRows(*sample_selection(share, columns))
    for _ in rows_module.decode_in_chunks(routing, kept):
        pass
    for streamed, read in zip(split_sample(pl.concat(kept.frames), columns), sampled_windows(routing, share, columns)):
        assert streamed.height > 0 and streamed.equals(read)


def test_window_share_targets_max_windows_per_layer() -> None:
    assert window_share(rows=1000, layers=2, k=3, max_windows=500) == 1.0
    assert window_share(rows=8_000_000, layers=2, k=3, max_windows=10_000) == pytest.approx(10_000 / 1_000_000)


def test_a_budget_binds_only_where_a_group_of_the_unbudgeted_run_used_more_experts_than_it_allows() -> None:
    """Two verification steps of two requests, one MoE layer (3) and another (5); prefill rows never count."""
    from moetrace.analysis.budgets import binds, largest_groups

    routing = pl.LazyFrame({
        "step": [0, 0, 1, 1, 1, 1, 0],
        "request": [0, 1, 0, 1, 0, 1, 0],
        "layer": [3, 3, 3, 3, 5, 5, 5],
        "phase": ["verify", "verify", "verify", "verify", "verify", "verify", "prefill"],
        "experts": [[1, 2], [2, 3], [1, 4], [5, 6], [7, 8], [7, 8], [1, 2]],
    })
    # step scope: layer 3 used {1,2,3} at step 0 and {1,4,5,6} at step 1; layer 5 {7,8} (its prefill row left out)
    assert largest_groups(routing, "step") == {3: 4, 5: 2}
    assert largest_groups(routing, "window") == {3: 2, 5: 2}
    assert binds({3: 4, 5: 2}, {3: 3, 5: 8}) and not binds({3: 4, 5: 2}, {3: 4, 5: 2})
    assert not binds({3: 2, 5: 2}, {3: 3, 5: 8})
