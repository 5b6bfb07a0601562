"""The routing summary of a token-major trace, summed a chunk of whole steps at a time as Polars streams the rows
(``window_rows.decode_in_chunks``), against the summary of the same rows in another order, which the general path (every
row decoded, layer by layer, sorted windows) sums: equal, however Polars' parts cut the steps."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

import moetrace.analysis.window_rows as rows_module
import moetrace.analysis.routing_summary as summary_module
from moetrace.analysis.placement import linear_placement
from moetrace.analysis.routing_summary import RoutingSummary, SummaryRequest, summarise_routing
from trace_builder import Model, routing_frame, steps_frame, verify_tokens

MODEL = Model(num_experts=16, top_k=2, layers=(1, 2, 5))
REQUEST = SummaryRequest(MODEL.num_experts, tuple(range(6)), 3, linear_placement(MODEL.num_experts, 4), 0.5,
                         ("experts", "weights"))
SAMPLE_ORDER = ["step", "request", "position", "layer"]


@pytest.fixture
def decoded_whole(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times every row was decoded at once (the general path)."""
    calls: list[int] = []
    whole = summary_module.decode_and_verify

    def spy(routing: pl.LazyFrame) -> rows_module.WindowRows:
        calls.append(1)
        return whole(routing)

    monkeypatch.setattr(summary_module, "decode_and_verify", spy)
    return calls


def trace(seed: int) -> tuple[pl.DataFrame, pl.LazyFrame]:
    tokens = verify_tokens(np.random.default_rng(seed), MODEL, requests=5, steps=30, k=3, accept_prob=0.6,
                           variable_drafts=True)
    return routing_frame(tokens, MODEL).collect(), steps_frame(tokens)


def assert_same(streamed: RoutingSummary, general: RoutingSummary) -> None:
    assert_frame_equal(streamed.growth, general.growth, check_row_order=False)
    for name in ("rejected_only", "load", "gaps", "proposals"):
        assert_frame_equal(getattr(streamed, name), getattr(general, name), check_row_order=False)
    for name in ("accepted", "stepped"):  # the sample's rows in recording order: compared by their keys
        mine, theirs = getattr(streamed, name), getattr(general, name)
        assert mine.height > 0
        assert_frame_equal(mine.sort(SAMPLE_ORDER), theirs.sort(SAMPLE_ORDER))


@pytest.mark.parametrize("chunk_rows", [7, 60, 1 << 20])  # a step cut by every part, by some, by none
def test_a_summary_streamed_in_chunks_equals_the_general_paths_of_the_rows_in_another_order(
        chunk_rows: int, monkeypatch: pytest.MonkeyPatch, decoded_whole: list[int]) -> None:
    monkeypatch.setattr(rows_module, "DECODE_CHUNK_ROWS", chunk_rows)
    routing, steps = trace(3)
    streamed, rows = summarise_routing(routing.lazy(), steps, REQUEST)
    assert rows is None and not decoded_whole  # nothing decoded whole: the streamed path ran
    shuffled = routing[np.random.default_rng(0).permutation(routing.height)].lazy()
    general, _ = summarise_routing(shuffled, steps, REQUEST)
    assert decoded_whole == [1]
    assert_same(streamed, general)
    windows = streamed.rejected_only["windows"].sum()
    assert windows > 0 and streamed.load["picks"].sum() == routing.filter(pl.col("phase") != "prefill").height * 2


def test_a_trace_found_out_of_order_midway_is_summed_by_the_general_path(
        monkeypatch: pytest.MonkeyPatch, decoded_whole: list[int]) -> None:
    """The streamed path gives up at the first chunk not laid out token-major, however many it summed before."""
    monkeypatch.setattr(rows_module, "DECODE_CHUNK_ROWS", 60)
    routing, steps = trace(4)
    tail = routing.height // 4
    late = routing[routing.height - tail :]
    reordered = pl.concat([routing[: routing.height - tail], late[np.random.default_rng(1).permutation(tail)]])
    summary, _ = summarise_routing(reordered.lazy(), steps, REQUEST)
    assert decoded_whole == [1]
    shuffled = routing[np.random.default_rng(2).permutation(routing.height)].lazy()
    assert_same(summary, summarise_routing(shuffled, steps, REQUEST)[0])


def test_rows_kept_for_the_placements_are_every_non_prefill_row(decoded_whole: list[int]) -> None:
    routing, steps = trace(5)
    _, rows = summarise_routing(routing.lazy(), steps, REQUEST, keep_rows=True)
    assert rows is not None and len(rows.layer) == routing.filter(pl.col("phase") != "prefill").height
