"""The streamed counterfactual path (token-major rows, chunk after chunk) against brute force, across chunk sizes,
and its fallback to the general path for rows laid out any other way."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

import decision_oracle as oracle
import moetrace.analysis.growth as growth_module
import moetrace.analysis.streamed_windows as streamed_module
from moetrace.analysis.counterfactual import Proposals, proposed_drafts
from moetrace.analysis.expert_sets import MaskTable, expert_masks, window_union
from moetrace.analysis.growth import counterfactual_window_sums, window_means
from moetrace.analysis.placement import linear_placement
from moetrace.analysis.window_rows import decode_and_verify
from moetrace.trace.reader import open_trace
from trace_builder import Model, decode_tokens, routing_frame, verify_tokens, write_trace

MODEL = Model(num_experts=16, top_k=2, layers=(1, 2, 5))
KS = range(0, 9)


def brute_force(frame: pl.DataFrame, ep: int, trace_k: int) -> dict[tuple[int, int], tuple[int, float, float, float]]:
    """(layer, k) -> windows, mean unique experts, busiest rank, ranks touched, from the oracle's windows (Python
    sets) of a trace recorded at ``trace_k``."""
    rank = linear_placement(MODEL.num_experts, ep)
    rows = frame.with_columns(pl.col("phase").cast(pl.String)).to_dicts()
    out = {}
    for k in KS:
        for layer, found in oracle.counterfactual_windows(rows, k, trace_k).items():
            windows = list(found.values())
            on_rank = [[sum(1 for e in w if rank[e] == x) for x in range(ep)] for w in windows]
            out[(layer, k)] = (
                len(windows),
                mean(len(w) for w in windows),
                mean(max(c) for c in on_rank),
                mean(sum(1 for n in c if n) for c in on_rank),
            )
    return out


def assert_brute_force(result: pl.DataFrame, frame: pl.DataFrame, ep: int, trace_k: int) -> None:
    want = brute_force(frame, ep, trace_k)
    got = {
        (r["layer"], r["k"]): (r["windows"], r["unique_experts"], r["busiest_rank_experts"], r["ranks_touched"])
        for r in result.to_dicts()
    }
    assert got.keys() == want.keys()
    for key, values in want.items():
        assert got[key][0] == values[0], key
        assert got[key][1:] == pytest.approx(values[1:]), key


@pytest.fixture
def general_path_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    sorted_path = growth_module._counterfactual_sorted

    def spy(*args: object) -> pl.DataFrame:
        calls.append(1)
        return sorted_path(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(growth_module, "_counterfactual_sorted", spy)
    return calls


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 1 << 17])
@pytest.mark.parametrize("ep", [1, 4])
@pytest.mark.parametrize("read", ["scanned", "decoded"])  # streamed from the files, or from rows decoded already
def test_streamed_matches_brute_force_across_chunks(
    chunk_rows: int, ep: int, read: str, monkeypatch: pytest.MonkeyPatch, general_path_calls: list[int]
) -> None:
    monkeypatch.setattr(streamed_module, "CHUNK_ROWS", chunk_rows)
    tokens = verify_tokens(np.random.default_rng(7), MODEL, requests=3, steps=25, k=3, accept_prob=0.6,
                           variable_drafts=True)
    routing = routing_frame(tokens, MODEL)
    rows = decode_and_verify(routing) if read == "decoded" else None
    result = counterfactual_window_sums(routing, MODEL.num_experts, KS, linear_placement(16, ep), 3, rows=rows)
    assert not general_path_calls
    assert_brute_force(window_means(result), routing.collect(), ep, 3)
    proposals = Proposals.of(proposed_drafts(routing, 3))
    assert_frame_equal(result, growth_module._counterfactual_sorted(routing, 16, KS, linear_placement(16, ep), 3,
                                                                    proposals))


def _shuffled(frame: pl.DataFrame, seed: int) -> pl.LazyFrame:
    return frame[np.random.default_rng(seed).permutation(frame.height)].lazy()


@pytest.mark.parametrize(
    "layout",
    [
        "shuffled",  # rows in any order
        "missing layer",  # one token without one of its layers
        "positions go back",  # a request's positions decrease from chunk to chunk
    ],
)
def test_other_layouts_take_the_general_path(
    layout: str, monkeypatch: pytest.MonkeyPatch, general_path_calls: list[int]
) -> None:
    monkeypatch.setattr(streamed_module, "CHUNK_ROWS", 12)
    tokens = verify_tokens(np.random.default_rng(8), MODEL, requests=2, steps=20, k=2, accept_prob=0.5)
    frame = routing_frame(tokens, MODEL).collect()
    if layout == "shuffled":
        routing = _shuffled(frame, 1)
    elif layout == "missing layer":
        routing = frame.filter(pl.int_range(pl.len()) != frame.height // 2).lazy()
    else:
        routing = frame.reverse().lazy()
    result = window_means(counterfactual_window_sums(routing, MODEL.num_experts, KS, linear_placement(16, 4), 2))
    assert general_path_calls
    assert_brute_force(result, routing.collect(), 4, 2)


def test_repeated_positions_count_rows_like_the_general_path(general_path_calls: list[int]) -> None:
    """A token recorded twice (same request and position, token-major) is two rows of its window, as in the general
    path: the window no longer has k+1 rows, or has them with one position missing. (Within one chunk: a repeat
    in a later chunk is a request going back, which takes the general path.)"""
    tokens = decode_tokens(np.random.default_rng(9), MODEL, requests=2, steps=30)
    frame = routing_frame(tokens, MODEL).collect()
    width = len(MODEL.layers)
    rows = np.concatenate(
        [np.arange(0, 11 * width), np.arange(10 * width, 25 * width), np.arange(26 * width, frame.height)]
    )  # token 10 twice, token 25 missing
    routing = frame[rows].lazy()
    result = window_means(counterfactual_window_sums(routing, MODEL.num_experts, KS, linear_placement(16, 4), 0))
    assert not general_path_calls
    assert_brute_force(result, routing.collect(), 4, 0)


def test_streamed_from_parquet_files(tmp_path: Path, general_path_calls: list[int]) -> None:
    tokens = verify_tokens(np.random.default_rng(10), MODEL, requests=4, steps=40, k=3, accept_prob=0.7)
    trace = open_trace(write_trace(tmp_path / "t", tokens, MODEL, k=3, files=3))
    result = window_means(counterfactual_window_sums(trace.routing(), MODEL.num_experts, KS,
                                                     linear_placement(16, 2), trace.k))
    assert not general_path_calls
    assert_brute_force(result, trace.routing().collect(), 2, trace.k)


def test_empty_and_single_token() -> None:
    tokens = decode_tokens(np.random.default_rng(11), MODEL, requests=1, steps=1)
    frame = routing_frame(tokens, MODEL)
    one = counterfactual_window_sums(frame, 16, KS, linear_placement(16, 1), 0)
    assert one["k"].to_list() == [0, 0, 0] and one["windows"].to_list() == [1, 1, 1]
    empty = counterfactual_window_sums(frame.filter(pl.lit(False)), 16, KS, linear_placement(16, 1), 0)
    assert empty.height == 0 and empty.schema == one.schema


def test_mask_table_and_window_union() -> None:
    rng = np.random.default_rng(12)
    for experts, slots in ((16, 3), (384, 8), (384, 1), (100, 5)):
        ids = np.stack([rng.permutation(experts)[:slots] for _ in range(40)]).astype(np.uint16)
        want = np.zeros((40, (experts + 63) // 64), dtype=np.uint64)
        for row, picks in enumerate(ids.tolist()):
            for e in picks:
                want[row, e // 64] |= np.uint64(1) << np.uint64(e % 64)
        assert np.array_equal(MaskTable(experts).masks(ids), want)
        assert np.array_equal(MaskTable(experts, pairs=False).masks(ids), want)
        assert np.array_equal(expert_masks(ids, experts), want)
        starts = np.array([0, 5, 30], dtype=np.int64)
        unions = window_union(want, starts, 4)
        assert np.array_equal(unions, np.stack([np.bitwise_or.reduce(want[s : s + 4]) for s in starts]))
    with pytest.raises(ValueError):
        MaskTable(16).masks(np.array([[3, 16]], dtype=np.uint16))
    with pytest.raises(IndexError):
        window_union(want, np.array([38], dtype=np.int64), 4)
