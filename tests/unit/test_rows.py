"""A step's record crosses to the writer process intact, and assembles into the rows it describes."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from moetrace.hooks.rows import PackedLayout, StepRecord
from moetrace.writer.ring import SharedRows

# R = 3 requests: a prefill of 4 tokens, a decode token, a verification of an anchor and 2 drafts (1 accepted)
LAYOUT = PackedLayout(layers=2, top_k=2, candidates=3, token_ids=True)


def record() -> StepRecord:
    rng = np.random.default_rng(0)
    tokens = 8
    ids = rng.integers(0, 16, (tokens, 2 * 2), dtype=np.int32)
    weights = rng.random((tokens, 2 * 2), dtype=np.float32).view(np.int32)
    cand_ids = rng.integers(0, 16, (tokens, 2 * 3), dtype=np.int32)
    cand_scores = rng.random((tokens, 2 * 3), dtype=np.float32).view(np.int32)
    positions = np.array([0, 1, 2, 3, 9, 5, 6, 7], dtype=np.int32)[:, None]
    token_ids = np.arange(100, 100 + tokens, dtype=np.int32)[:, None]
    packed = np.concatenate([ids, weights, cand_ids, cand_scores, positions, token_ids], axis=1)
    return StepRecord(step=7, t_start_ns=10, t_end_ns=20, requests=np.array([4, 0, 2], dtype=np.uint32),
                      query_start=np.array([0, 4, 5, 8]), num_prompt_tokens=np.array([6, 3, 4]),
                      drafts=np.array([0, 0, 2]), kept=np.array([0, 1, 2]), packed=packed, layout=LAYOUT,
                      sequence_limit=np.array([70, 0, 40]))


def test_a_pickled_step_record_is_the_same_record() -> None:
    original = record()
    copy = pickle.loads(pickle.dumps(original, protocol=pickle.HIGHEST_PROTOCOL))
    for field in dataclasses.fields(StepRecord):
        mine, theirs = getattr(original, field.name), getattr(copy, field.name)
        assert np.array_equal(mine, theirs) if isinstance(mine, np.ndarray) else mine == theirs, field.name
        if isinstance(mine, np.ndarray):
            assert theirs.dtype == np.dtype(np.uint32 if field.name == "requests" else
                                            np.int32 if field.name == "packed" else np.int64), field.name


def test_the_assembled_rows_follow_the_batch_layout() -> None:
    rows = pickle.loads(pickle.dumps(record())).assemble()
    assert rows.request.tolist() == [4, 4, 4, 4, 0, 2, 2, 2]
    assert rows.phase.tolist() == [0, 0, 0, 0, 1, 2, 2, 2]  # prefill, decode, verify (schema.TOKEN_PHASES order)
    assert rows.draft_pos.tolist() == [0, 0, 0, 0, 0, 0, 1, 2]
    assert rows.accepted.tolist() == [-1, -1, -1, -1, -1, -1, 1, 0]  # kept 2 = anchor + the first draft
    assert rows.token is not None and rows.token.tolist() == list(range(100, 108))
    assert rows.experts.shape == (8, 2, 2) and rows.cand_scores is not None and rows.cand_scores.shape == (8, 2, 3)
    assert rows.steps_rows["num_accepted"].tolist() == [0, 0, 1]


def test_a_record_whose_rows_lie_in_the_shared_ring_is_pickled_as_where_they_lie_and_takes_them_out() -> None:
    """The engine thread never copies a step's rows: only where they lie in the ring crosses the pipe, and the
    writer process's copy releases them."""
    whole = record()
    assert isinstance(whole.packed, np.ndarray)
    ring = SharedRows.create(16, whole.packed.shape[1])
    try:
        where = ring.reserve(8)
        assert where is not None
        ring.rows[where.offset : where.offset + 8] = whole.packed
        light = dataclasses.replace(whole, packed=where)
        message = pickle.dumps(light, protocol=pickle.HIGHEST_PROTOCOL)
        assert len(message) < whole.packed.nbytes, "the rows themselves stayed in the ring"
        crossed = pickle.loads(message)
        assert crossed.packed == where
        crossed.take_rows(ring)
        assert np.array_equal(crossed.packed, whole.packed)
        assert ring.reserve(16) is not None, "taking the rows released them"
        assert crossed.assemble().experts.tolist() == whole.assemble().experts.tolist()
    finally:
        ring.close()


def test_a_request_step_run_after_its_request_reached_max_tokens_is_left_out_and_counted() -> None:
    """Async scheduling runs one more step for a request whose last token is still in flight; vLLM drops it. Its
    first token lies at prompt + max_tokens - 1: the request's other rows, and every other request's, stay."""
    whole = pickle.loads(pickle.dumps(record())).assemble()
    finished = dataclasses.replace(record(), sequence_limit=np.array([70, 0, 6]))  # request 2: prompt 4 + 2 tokens
    rows = pickle.loads(pickle.dumps(finished)).assemble()
    kept = whole.request != 2
    assert rows.request.tolist() == whole.request[kept].tolist() == [4, 4, 4, 4, 0]
    assert rows.experts.tolist() == whole.experts[kept].tolist()
    assert rows.position.tolist() == whole.position[kept].tolist()
    assert rows.steps_rows["request"].tolist() == [4, 0]
    assert rows.steps_rows["batch_size"].tolist() == [3, 3], "the batch as the engine ran it"
    assert rows.discarded == (1, 3) and whole.discarded == (0, 0)
    one_short = dataclasses.replace(record(), sequence_limit=np.array([70, 0, 7]))  # one token still to come
    assert pickle.loads(pickle.dumps(one_short)).assemble().discarded == (0, 0)
