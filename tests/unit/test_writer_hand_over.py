"""The engine side of the trace writer: it never waits for a step's copies or for the writer process, hands steps
over several at a time, in order, through the shared ring, and forwards what it left queued once the engine goes
quiet."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import moetrace.writer.process
from moetrace.hooks.rows import PackedLayout, StepRecord
from moetrace.trace.files import StepCapture
from moetrace.trace.reader import open_trace
from moetrace.writer.process import HAND_OVER_STEPS, TraceWriter
from moetrace.writer.ring import RingRows, SharedRows
from writer_steps import LAYERS, TOP_K, NotReadyYet, manifest, verify_step


def test_the_engine_side_never_waits_for_a_step_and_sends_it_once_ready_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K)
    slow = NotReadyYet(verify_step(0, rng), polls=2)
    with writer._lock:  # the idle forwarder stays out of the way
        writer.submit(slow)
        writer._forward(wait=False)  # not ready: stays on the engine side
        writer.submit(verify_step(1, rng))
        writer._forward(wait=False)  # ready, but behind step 0: order is kept
        assert writer.steps_waiting == 2
        writer.submit(verify_step(2, rng))
        writer._forward(wait=False)  # step 0 became ready on this poll: all three go
        assert not writer.steps_waiting
    final = writer.close()
    assert final["complete"] and final["counts"]["steps"] == 3
    steps = open_trace(tmp_path).steps().collect()["step"].unique().sort().to_list()
    assert steps == [0, 1, 2]


class PickledSlowly:
    """A ready step whose hand-over takes a while to start (as pickling a large step does), on whichever thread."""

    def __init__(self, capture: StepCapture):
        self.capture, self.started, self.release = capture, threading.Event(), threading.Event()

    def is_ready(self) -> bool:
        return True

    def ready(self) -> StepCapture:
        self.started.set()
        self.release.wait(10)
        return self.capture


def test_the_engine_thread_never_waits_while_the_idle_forwarder_hands_a_step_over(tmp_path: Path) -> None:
    """Each step's rows are its own until the writer process releases them (the shared ring), so the engine
    thread's ``forward_ready`` leaves a hand-over already under way to the idle forwarder instead of waiting for
    its lock; the step still reaches the trace once, intact."""
    rng = np.random.default_rng(8)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K)
    capture = verify_step(0, rng)
    expected = capture.experts.copy()
    slow = PickledSlowly(capture)
    writer.submit(slow)
    assert slow.started.wait(5), "the idle forwarder took the quiet engine's step"
    began = time.monotonic()
    writer.forward_ready()
    assert time.monotonic() - began < 0.2, "forward_ready waited for the idle forwarder"
    slow.release.set()
    final = writer.close()
    assert final["complete"] and final["counts"]["steps"] == 1
    routing = open_trace(tmp_path).routing().sort(["request", "position", "layer"]).collect()
    written = np.sort(np.stack(routing["experts"].to_list()), axis=1)  # the trace orders each top-k by weight
    assert np.array_equal(written, np.sort(expected.reshape(-1, TOP_K), axis=1))


def test_a_step_queued_during_the_idle_forwarders_hand_over_follows_it_intact(tmp_path: Path) -> None:
    """The engine thread may queue a step while the idle forwarder is handing the queue over: recording goes on and
    both steps reach the trace, in order."""
    rng = np.random.default_rng(13)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K)
    slow = PickledSlowly(verify_step(0, rng))
    writer.submit(slow)
    assert slow.started.wait(5), "the idle forwarder took the quiet engine's step"
    writer.submit(verify_step(1, rng))  # queued while the idle forwarder is inside the hand-over
    slow.release.set()
    final = writer.close()
    assert writer.failed is None and final["complete"] and final["counts"]["steps"] == 2
    assert open_trace(tmp_path).steps().collect()["step"].unique().sort().to_list() == [0, 1]


def test_the_engine_thread_hands_steps_over_together_not_a_pickle_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code run once per step runs cold, so ``forward_ready`` only queues until ``HAND_OVER_STEPS`` steps wait (or
    the oldest has waited ``SEND_EVERY_SECONDS``, or a quarter of the ring is reserved), then hands them all over in
    one message; every step reaches the trace."""
    monkeypatch.setattr(moetrace.writer.process, "SEND_EVERY_SECONDS", 3600.0)  # only the count or the ring decides
    rng = np.random.default_rng(12)
    writer = TraceWriter(tmp_path / "count", manifest(), LAYERS, TOP_K)
    for step in range(HAND_OVER_STEPS - 1):
        writer.submit(verify_step(step, rng))
        writer.forward_ready()
    assert writer.steps_waiting == HAND_OVER_STEPS - 1 and not writer.bytes_unsent, "nothing handed over yet"
    writer.submit(verify_step(HAND_OVER_STEPS - 1, rng))
    writer.forward_ready()
    assert not writer.steps_waiting and not writer.bytes_unsent, "the whole hand-over went down the pipe at once"
    assert writer.close()["counts"]["steps"] == HAND_OVER_STEPS

    layout = PackedLayout(layers=len(LAYERS), top_k=TOP_K, candidates=0, token_ids=True)
    ring = SharedRows.create(20, layout.width)
    writer = TraceWriter(tmp_path / "ring", manifest(), LAYERS, TOP_K, rows=ring)
    where = ring.reserve(6)  # 6 of 20 rows: more than a quarter of the ring
    assert where is not None
    ring.rows[0:6] = 0
    writer.submit(NotReadyYet(StepRecord(0, 0, 1, np.array([0], dtype=np.uint32), np.array([0, 6]), np.array([6]),
                                         np.array([0]), np.array([0]), where, layout), polls=0))
    writer.forward_ready()
    assert not writer.steps_waiting, "a ring filling up is handed over at once"
    assert writer.close()["counts"]["steps"] == 1


def test_the_shared_ring_never_wraps_a_step_and_reuses_rows_only_once_released() -> None:
    ring = SharedRows.create(10, 3)
    try:
        first = ring.reserve(4)
        second = ring.reserve(4)
        assert first == RingRows(0, 4, 4) and second == RingRows(4, 4, 8)
        assert ring.reserve(3) is None, "rows 8-9 are too few and rows 0-3 are not released yet"
        ring.rows[0:4] = 7
        assert first is not None and ring.take(first).tolist() == [[7] * 3] * 4
        third = ring.reserve(3)
        assert third == RingRows(0, 3, 13), "the ring's tail is skipped: a step's rows are consecutive"
        assert ring.reserve(2) is None, "rows 4-7 are still the second step's"
        assert ring.reserve(11) is None, "a step larger than the ring never fits"
    finally:
        ring.close()


def test_steps_whose_rows_lie_in_the_shared_ring_reach_the_trace_and_free_the_ring(tmp_path: Path) -> None:
    """The engine writes each step's packed rows into the ring and sends only where they lie: the writer process
    copies them out (releasing them) and the trace holds exactly those rows, across more rows than the ring
    holds at once."""
    layout = PackedLayout(layers=len(LAYERS), top_k=TOP_K, candidates=0, token_ids=True)
    ring = SharedRows.create(20, layout.width)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K, rows=ring)
    rng = np.random.default_rng(11)
    sent = []
    for step in range(12):  # 6 tokens a step: 72 rows through a ring of 20
        deadline = time.monotonic() + 30
        while (where := ring.reserve(6)) is None:
            assert time.monotonic() < deadline, "the writer process never released the ring's rows"
            writer.forward_ready()
            time.sleep(0.01)
        ids = rng.integers(0, 64, (6, len(LAYERS) * TOP_K), dtype=np.int32)
        weights = rng.random((6, len(LAYERS) * TOP_K), dtype=np.float32).view(np.int32)
        ring.rows[where.offset : where.offset + 6] = np.concatenate(
            [ids, weights, np.arange(6, dtype=np.int32)[:, None], np.full((6, 1), step, dtype=np.int32)], axis=1)
        writer.submit(NotReadyYet(StepRecord(step, 0, 1, np.array([step], dtype=np.uint32), np.array([0, 6]),
                                             np.array([6]), np.array([0]), np.array([0]), where, layout), polls=0))
        writer.forward_ready()
        sent.append(ids.reshape(6, len(LAYERS), TOP_K))
    final = writer.close()
    assert final["complete"] and final["counts"]["steps"] == 12
    routing = open_trace(tmp_path).routing().sort(["step", "position", "layer"]).collect()
    assert routing["token"].to_list()[:: 6 * len(LAYERS)] == list(range(12))
    written = np.sort(np.stack(routing["experts"].to_list()), axis=1)
    assert np.array_equal(written, np.sort(np.concatenate(sent).reshape(-1, TOP_K), axis=1))


def test_steps_the_engine_thread_left_queued_are_forwarded_once_it_goes_quiet(tmp_path: Path) -> None:
    """An engine that stops stepping (idle, then killed by ``vllm serve``) holds no queued step back."""
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K)
    writer.submit(verify_step(0, np.random.default_rng(6)))  # queued, and no forward_ready follows
    deadline = time.monotonic() + 10
    while writer.steps < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert writer.steps == 1 and not writer.steps_waiting
    writer.close()
