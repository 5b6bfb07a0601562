"""Unique experts per step at concurrency B, against brute-force unions in plain Python and hand-computed cases."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest

import decision_oracle as oracle
from moetrace.analysis.acceptance import acceptance_per_k, drawn_from
from moetrace.analysis.budgets import WINDOW, window_sample
from moetrace.analysis.concurrency import (
    RecordedK,
    batch_unions,
    request_prompts,
    sampled_batch_unions,
    uniform_unique_experts,
)
from moetrace.analysis.expert_sets import count_experts, expert_masks
from moetrace.analysis.placement import linear_placement
from moetrace.report.step_reads import greedy
from moetrace.trace.reader import open_trace
from trace_builder import Model, Tokens, decode_tokens, routing_frame, steps_frame, verify_tokens, write_trace

MODEL = Model(num_experts=32, top_k=2, layers=(1, 2))


def unions(sweep: dict[int, Tokens], ks: list[int], batches: list[int], ranks: int = 1,
           frames: dict[int, tuple[pl.LazyFrame, pl.LazyFrame]] | None = None) -> pl.DataFrame:
    """batch_unions over a sweep of traces (tokens by recorded k, or ready routing and steps frames)."""
    frames = frames or {k: (routing_frame(tokens, MODEL), steps_frame(tokens)) for k, tokens in sweep.items()}
    recorded = {k: RecordedK(window_sample(routing, k, ["experts"]), steps, request_prompts(routing))
                for k, (routing, steps) in frames.items()}
    return batch_unions(recorded, 32, 2, linear_placement(32, ranks), ks, batches)


def test_uniform_union_is_hand_computed_for_small_cases() -> None:
    assert uniform_unique_experts(4, 2, 2) == pytest.approx(3.0)  # 4·(1 − (1/2)²)
    assert uniform_unique_experts(384, 8, 0) == 0.0


def brute_force_step_unions(tokens: Tokens, layer_index: int, batch: int) -> list[int]:
    """Per step in which exactly ``batch`` requests ran, all decoding: the size of the union of every token's
    experts (anchors, accepted and rejected drafts)."""
    sets: dict[int, set[int]] = {}
    requests: dict[int, set[int]] = {}
    prefill: set[int] = set()
    for i, step in enumerate(tokens.step.tolist()):
        if tokens.phase[i] == "prefill":
            prefill.add(step)
            continue
        sets.setdefault(step, set()).update(tokens.experts[i, layer_index].tolist())
        requests.setdefault(step, set()).add(int(tokens.request[i]))
    return [len(experts) for step, experts in sets.items() if len(requests[step]) == batch and step not in prefill]


def test_measured_unions_are_over_steps_that_ran_b_requests_with_every_token_they_read() -> None:
    tokens = verify_tokens(np.random.default_rng(3), MODEL, requests=8, steps=12, k=2, accept_prob=0.6,
                           variable_drafts=True)
    table = unions({2: tokens}, [2], [2, 4, 8])
    for index, layer in enumerate(MODEL.layers):
        rows = {row["batch"]: row for row in table.filter(pl.col("layer") == layer).iter_rows(named=True)}
        # every step ran all 8 requests: B = 8 is measured (12 steps), B = 2 and 4 are not
        assert rows[8]["source"] == "measured" and rows[8]["steps"] == 12
        assert rows[8]["unique_experts"] == pytest.approx(np.mean(brute_force_step_unions(tokens, index, 8)))
        assert rows[2]["source"] == rows[4]["source"] == "estimated" and rows[4]["steps"] == 0


def test_steps_whose_requests_repeat_a_prompt_are_not_measured() -> None:
    tokens = verify_tokens(np.random.default_rng(5), MODEL, requests=4, steps=8, k=2, accept_prob=0.6)
    prompt = np.array([0, 0, 1, 2])[tokens.request.astype(np.int64)]  # requests 0 and 1 share a prompt
    shared = replace(tokens, token=(prompt * 100 + tokens.position).astype(np.uint32))
    distinct = replace(tokens, token=(tokens.request * 100 + tokens.position).astype(np.uint32))
    # every step ran all 4 requests: measured over its 8 steps only where no two of them share a prompt
    for row in unions({2: distinct}, [2], [4]).iter_rows(named=True):
        assert (row["source"], row["steps"]) == ("measured", 8)
    for row in unions({2: shared}, [2], [4]).iter_rows(named=True):
        assert (row["source"], row["steps"]) == ("estimated", 0)


def test_one_request_is_the_exact_mean_over_every_request_step() -> None:
    tokens = verify_tokens(np.random.default_rng(4), MODEL, requests=3, steps=10, k=2, accept_prob=0.5,
                           variable_drafts=True)
    table = unions({2: tokens}, [2], [1])
    for index, layer in enumerate(MODEL.layers):
        windows: dict[tuple[int, int], set[int]] = {}
        for i, phase in enumerate(tokens.phase):
            if phase != "prefill":
                windows.setdefault((int(tokens.step[i]), int(tokens.request[i])), set()).update(
                    tokens.experts[i, index].tolist())
        row = table.filter(pl.col("layer") == layer).row(0, named=True)
        assert row["source"] == "estimated" and row["windows"] == len(windows)
        assert row["unique_experts"] == pytest.approx(np.mean([len(s) for s in windows.values()]))


def test_requests_whose_prefill_read_the_same_tokens_share_a_prompt() -> None:
    prefill = pl.LazyFrame({"request": [0, 0, 1, 1, 2, 2, 3, 4], "position": [0, 1, 1, 0, 0, 1, 0, 0],
                            "phase": ["prefill"] * 7 + ["decode"], "layer": [1] * 8,
                            "token": [5, 6, 6, 5, 5, 7, None, 5]})
    prompts = request_prompts(prefill)
    # 0 and 1 read 5, 6 (rows in any order); 2 read 5, 7; 3's token ids were not recorded; 4 has no prefill rows
    assert prompts[0] == prompts[1] != prompts[2] and set(prompts) == {0, 1, 2}


def test_a_request_whose_prefix_the_cache_served_shares_the_prompt_whose_tail_it_read() -> None:
    # request 0 prefilled 5, 6, 8 at positions 0-2; 1 and 3 only 6, 8 at 1-2 (the cache served position 0), as
    # vLLM's prefix cache leaves a repeat; 2 read 9, 8 there (another prompt, ending alike); 4 read 6, 8 at 2-3
    prefill = pl.LazyFrame({"request": [1, 1, 0, 0, 0, 2, 2, 3, 3, 4, 4],
                            "position": [2, 1, 0, 1, 2, 1, 2, 1, 2, 2, 3],
                            "phase": ["prefill"] * 11, "layer": [1] * 11,
                            "token": [8, 6, 5, 6, 8, 9, 8, 6, 8, 6, 8]})
    assert request_prompts(prefill) == {0: 0, 1: 0, 2: 1, 3: 0, 4: 2}


def test_only_greedy_traces_merge_requests_by_prompt(tmp_path: Path) -> None:
    tokens = verify_tokens(np.random.default_rng(11), MODEL, requests=2, steps=2, k=2, accept_prob=0.5)
    root = write_trace(tmp_path / "t", tokens, MODEL, k=2)
    manifest = json.loads((root / "manifest.json").read_text())
    assert "workload" not in manifest and greedy(open_trace(root))  # not stated: moetrace record's greedy default
    for temperature, merged in ((0.0, True), (0.7, False)):
        manifest["workload"] = {"sampling": {"temperature": temperature}}
        (root / "manifest.json").write_text(json.dumps(manifest))
        assert greedy(open_trace(root)) is merged


def test_estimated_unions_draw_one_request_step_per_prompt_as_a_step_holds() -> None:
    tokens = verify_tokens(np.random.default_rng(9), MODEL, requests=40, steps=6, k=2, accept_prob=0.5)
    group = tokens.request.astype(np.int64) % 4  # request r reads experts 2(r % 4) and 2(r % 4) + 1 in every layer
    tokens.experts[:] = np.stack([2 * group, 2 * group + 1], axis=-1)[:, None, :]
    shared = replace(tokens, token=(group * 100 + tokens.position).astype(np.uint32))  # r % 4 is the prompt too
    own = replace(tokens, token=(tokens.request * 100 + tokens.position).astype(np.uint32))  # 40 prompts
    # every step ran all 40 requests: 4 requests per step is estimated. Four distinct prompts each read their own
    # two experts: 8 in every draw
    for row in unions({2: shared}, [2], [4]).iter_rows(named=True):
        assert row["source"] == "estimated" and row["unique_experts"] == 8.0
    # 40 prompts, ten per expert pair: 4 of 40 requests miss a given pair with probability C(30,4)/C(40,4)
    expected = 2 * 4 * (1 - 27405 / 91390)
    for row in unions({2: own}, [2], [4]).iter_rows(named=True):
        assert row["unique_experts"] == pytest.approx(expected, abs=0.25)


def test_prompts_are_drawn_as_often_as_they_run_without_repeating() -> None:
    # prompts X (8 windows) and Y (1) read experts 0 and 1, Z (1) reads 2 and 3. Two distinct prompts drawn by
    # weight: {X, Y} with probability 0.8 · 1/2 + 0.1 · 8/9 = 0.4889 (union 2), else 4: 2 · 0.4889 + 4 · 0.5111
    # = 3.022 (drawn alike, 3.333)
    masks = expert_masks(np.array([[0, 1]] * 9 + [[2, 3]]), 16)
    prompts = np.array([0] * 8 + [1, 2])
    unions, short = sampled_batch_unions(masks, prompts, 2, 4096, seed=1)
    assert not short and count_experts(unions).mean() == pytest.approx(2 * 0.48889 + 4 * 0.51111, abs=0.06)


def test_a_step_over_fewer_prompts_than_requests_holds_every_prompt() -> None:
    # four prompts, each reading two experts of its own: 3 requests read 6 of them, 4 or more read all 8
    masks = expert_masks(np.array([[2 * (w % 4), 2 * (w % 4) + 1] for w in range(40)]), 16)
    prompts = np.arange(40) % 4
    means = [count_experts(sampled_batch_unions(masks, prompts, b, 256, seed=b)[0]).mean() for b in (2, 3, 4, 5, 9)]
    assert means == [4.0, 6.0, 8.0, 8.0, 8.0]


def test_counterfactual_windows_count_requests_that_share_a_prompt_once() -> None:
    tokens = verify_tokens(np.random.default_rng(10), MODEL, requests=40, steps=6, k=2, accept_prob=0.5)
    group = tokens.request.astype(np.int64) % 4
    tokens.experts[:] = np.stack([2 * group, 2 * group + 1], axis=-1)[:, None, :]
    shared = replace(tokens, token=(group * 100 + tokens.position).astype(np.uint32))
    # k = 1 was not recorded: windows of 2 accepted tokens of the k = 2 trace, one from each of 4 prompts
    for row in unions({2: shared}, [1], [4]).iter_rows(named=True):
        assert row["source"] == "counterfactual" and row["unique_experts"] == 8.0


def test_more_requests_than_windows_give_the_union_of_all_of_them_as_a_lower_bound() -> None:
    tokens = verify_tokens(np.random.default_rng(5), MODEL, requests=2, steps=6, k=1, accept_prob=0.5)
    table = unions({1: tokens}, [1, 3], [1000])
    for index, layer in enumerate(MODEL.layers):
        rows = {row["k"]: row for row in table.filter(pl.col("layer") == layer).iter_rows(named=True)}
        every = {e for i, phase in enumerate(tokens.phase) if phase != "prefill"
                 for e in tokens.experts[i, index].tolist()}
        assert rows[1]["source"] == "lower bound" and rows[1]["unique_experts"] == len(every)
        # k = 3 was not recorded: counterfactual windows of 4 accepted tokens, fewer than 1000 of them
        assert rows[3]["source"] == "lower bound"


def test_estimated_unions_of_independent_uniform_windows_approach_the_uniform_bound() -> None:
    tokens = verify_tokens(np.random.default_rng(5), MODEL, requests=64, steps=40, k=0, accept_prob=0.0)
    table = unions({0: tokens}, [0], [1, 4], ranks=4)
    for batch in (1, 4):
        rows = table.filter(pl.col("batch") == batch)
        assert set(rows["source"]) == {"estimated"}
        assert rows["unique_experts"].mean() == pytest.approx(uniform_unique_experts(32, 2, batch), rel=0.04)
        assert (rows["busiest_rank_experts"] <= rows["unique_experts"]).all()
        assert (rows["busiest_rank_experts"] >= rows["unique_experts"] / 4).all()


def test_long_traces_are_sampled_by_whole_steps_and_keep_the_measured_union(monkeypatch: pytest.MonkeyPatch) -> None:
    import moetrace.analysis.concurrency as concurrency

    tokens = verify_tokens(np.random.default_rng(6), MODEL, requests=4, steps=200, k=2, accept_prob=0.6)
    full = unions({2: tokens}, [2], [4])
    monkeypatch.setattr(concurrency, "MAX_WINDOWS", 200)  # about a quarter of the 200 steps' windows per layer
    sampled = unions({2: tokens}, [2], [4])
    assert set(sampled["source"]) == {"measured"}  # whole steps kept: still steps of exactly 4 requests
    assert 20 < sampled["steps"].max() < 120
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
    at_three = verify_tokens(np.random.default_rng(7), MODEL, requests=4, steps=12, k=3, accept_prob=0.6)
    at_two = verify_tokens(np.random.default_rng(8), MODEL, requests=4, steps=12, k=2, accept_prob=0.6)
    table = unions({3: at_three, 2: at_two}, [1, 2, 3], [4])
    for index, layer in enumerate(MODEL.layers):
        rows = {row["k"]: row for row in table.filter(pl.col("layer") == layer).iter_rows(named=True)}
        # k = 2: the steps of the trace recorded at k = 2, brute force; k = 1 was recorded by neither
        assert rows[2]["source"] == "measured"
        assert rows[2]["unique_experts"] == pytest.approx(np.mean(brute_force_step_unions(at_two, index, 4)))
        assert rows[3]["source"] == "measured" and rows[1]["source"] == "counterfactual"


def test_data_parallel_ranks_steps_of_the_same_number_are_unioned_apart() -> None:
    ranks = [verify_tokens(np.random.default_rng(10 + r), MODEL, requests=2, steps=10, k=2, accept_prob=0.6)
             for r in (0, 1)]
    routing = pl.concat([routing_frame(t, MODEL).with_columns(dp_rank=pl.lit(r, pl.UInt16),
                                                              request=pl.col("request") * 2 + r)
                         for r, t in enumerate(ranks)])
    steps = pl.concat([steps_frame(t).with_columns(dp_rank=pl.lit(r, pl.UInt16), request=pl.col("request") * 2 + r)
                       for r, t in enumerate(ranks)])
    table = unions({}, [2], [2, 4], frames={2: (routing, steps)})
    for index, layer in enumerate(MODEL.layers):
        rows = {row["batch"]: row for row in table.filter(pl.col("layer") == layer).iter_rows(named=True)}
        per_rank = [u for tokens in ranks for u in brute_force_step_unions(tokens, index, 2)]
        assert rows[2]["source"] == "measured" and rows[2]["steps"] == 20
        assert rows[2]["unique_experts"] == pytest.approx(np.mean(per_rank))
        assert rows[4]["source"] == "estimated"  # no step ran 4 requests: each rank ran its own 2


def test_a_k_not_recorded_is_drawn_from_the_smallest_recorded_k_above_it() -> None:
    # as acceptance_per_k reads it: the smallest recorded k at or above, else the largest
    assert [drawn_from({0, 2, 4}, k) for k in range(7)] == [0, 2, 2, 4, 4, 4, 4]
    at_two = verify_tokens(np.random.default_rng(12), MODEL, requests=4, steps=12, k=2, accept_prob=0.6,
                           variable_drafts=True)
    at_four = verify_tokens(np.random.default_rng(13), MODEL, requests=4, steps=12, k=4, accept_prob=0.6,
                            variable_drafts=True)
    both = unions({2: at_two, 4: at_four}, [1, 3, 6], [1])
    assert both.filter(pl.col("k") == 1).equals(unions({2: at_two}, [1], [1]))
    assert both.filter(pl.col("k") == 3).equals(unions({4: at_four}, [3], [1]))
    assert both.filter(pl.col("k") == 6).equals(unions({4: at_four}, [6], [1]))


def test_counterfactual_request_steps_at_one_request_are_the_oracles_windows() -> None:
    """K = 3, 0..3 drafts per request-step: at a k not recorded one request reads, per layer, the mean over the
    oracle's windows (as many accepted tokens as each request-step's drafter proposed, capped at k; past K, k + 1
    where it was capped), every window once."""
    tokens = verify_tokens(np.random.default_rng(14), MODEL, requests=3, steps=15, k=3, accept_prob=0.5,
                           variable_drafts=True)
    rows = routing_frame(tokens, MODEL).with_columns(pl.col("phase").cast(pl.String)).collect().to_dicts()
    table = unions({3: tokens}, [0, 1, 2, 5], [1])
    for k in (0, 1, 2, 5):
        for layer, windows in oracle.counterfactual_windows(rows, k, 3).items():
            row = table.filter((pl.col("k") == k) & (pl.col("layer") == layer)).row(0, named=True)
            assert row["source"] == "counterfactual" and row["windows"] == len(windows)
            assert row["unique_experts"] == pytest.approx(np.mean([len(w) for w in windows.values()]))


def test_counterfactual_windows_read_the_tokens_acceptance_reads() -> None:
    """Each request ends in 6 plain decode steps, so that every window up to k = 6 completes: the windows at k hold, on
    average, exactly the tokens acceptance_per_k says a request-step reads at k (1 + mean min(d, k) below K, K's
    tokens plus k − K per request-step that proposed K past it)."""
    drafted = verify_tokens(np.random.default_rng(15), MODEL, requests=4, steps=20, k=3, accept_prob=0.5,
                            variable_drafts=True)
    kept = np.array([d == 0 or bool(a) for d, a in zip(drafted.draft_pos.tolist(), drafted.accepted)])
    ending = {r: int(drafted.position[kept & (drafted.request == r)].max()) + 1 for r in range(4)}  # next anchor
    extra = [(21 + i, r, ending[r] + i) for i in range(6) for r in range(4)]  # step, request, position
    routing_extra = decode_tokens(np.random.default_rng(16), MODEL, requests=1, steps=len(extra))
    tokens = replace(
        drafted, step=np.concatenate([drafted.step, np.array([e[0] for e in extra], np.uint32)]),
        request=np.concatenate([drafted.request, np.array([e[1] for e in extra], np.uint32)]),
        position=np.concatenate([drafted.position, np.array([e[2] for e in extra], np.uint32)]),
        phase=drafted.phase + ["decode"] * len(extra),
        draft_pos=np.concatenate([drafted.draft_pos, np.zeros(len(extra), np.uint8)]),
        accepted=drafted.accepted + [None] * len(extra),
        experts=np.concatenate([drafted.experts, routing_extra.experts]),
        weights=np.concatenate([drafted.weights, routing_extra.weights]))
    sample = window_sample(routing_frame(tokens, MODEL), 3, ["experts"])
    read = acceptance_per_k({3: steps_frame(tokens)}, range(7))
    for k in range(7):
        windows, _ = sample.request_windows(k, 10**9)
        sizes = windows.collect().group_by(WINDOW).len()["len"]
        assert sizes.mean() == pytest.approx(read.filter(pl.col("k") == k)["tokens_read"].item()), k
