"""The trace writer and reader on their own: rotation, crash safety, failures that never reach the engine."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from moetrace.analysis.consistency import disagreement, routing_gaps

from moetrace.errors import UserError
from moetrace.hooks.rows import PackedLayout, StepRecord
from moetrace.trace.reader import open_trace, open_traces
from moetrace.trace.schema import FOOTER_SCHEMA_KEY, SCHEMA_VERSION
import moetrace.writer.process
from moetrace.writer.ring import RingRows, SharedRows
from moetrace.trace.files import StepCapture
from moetrace.trace.manifest import amend_manifest, start_manifest
from moetrace.writer.process import HAND_OVER_STEPS, TraceWriter

LAYERS = [1, 2, 3]
TOP_K = 8
EXPERTS = 384


def manifest(k: int = 2) -> dict[str, object]:
    return {
        "schema": SCHEMA_VERSION, "run_id": "unit", "complete": False,
        "model": {"num_experts": EXPERTS, "top_k": TOP_K, "moe_layers": LAYERS, "hidden_size": 64},
        "spec": {"method": "ngram", "k": k}, "parallel": {"tp": 1, "ep": 1}, "capture": {"candidates": 0},
    }


def verify_step(
    step: int, rng: np.random.Generator, requests: int = 2, drafts: int = 2, accepted: int = 1
) -> StepCapture:
    """``requests`` verify windows of ``drafts`` drafts each, the first ``accepted`` drafts accepted."""
    window = drafts + 1
    tokens = requests * window
    draft_pos = np.tile(np.arange(window), requests).astype(np.uint8)
    flags = np.where(draft_pos == 0, -1, (draft_pos <= accepted).astype(np.int8)).astype(np.int8)
    experts = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in LAYERS]) for _ in range(tokens)])
    weights = rng.random((tokens, len(LAYERS), TOP_K)).astype(np.float32)
    return StepCapture(
        step=step,
        request=np.repeat(np.arange(requests), window).astype(np.uint32),
        position=(100 + step * window + draft_pos.astype(np.uint32)).astype(np.uint32),
        phase=np.full(tokens, 2, np.int8),
        draft_pos=draft_pos,
        token=rng.integers(0, 256, tokens).astype(np.uint32),
        accepted=flags,
        experts=experts.astype(np.uint16),
        weights=weights,
        cand_experts=None,
        cand_scores=None,
        steps_rows={
            "step": np.full(requests, step, np.uint32), "request": np.arange(requests, dtype=np.uint32),
            "num_tokens": np.full(requests, window, np.uint32), "num_drafts": np.full(requests, drafts, np.uint32),
            "num_accepted": np.full(requests, accepted, np.uint32),
            "batch_size": np.full(requests, requests, np.uint32),
            "t_start_ns": np.full(requests, step, np.int64), "t_end_ns": np.full(requests, step + 1, np.int64),
        },
    )


def submit_and_wait(writer: TraceWriter, capture: StepCapture) -> None:
    """Submit and forward one step and wait until the writer process has written it (so each step is its own
    batch)."""
    before = writer.steps
    writer.submit(capture)
    writer.forward_ready()
    deadline = time.monotonic() + 10
    while writer.steps == before and time.monotonic() < deadline:
        time.sleep(0.005)


def test_writer_rotates_files_orders_experts_by_weight_and_finalises_the_manifest(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K, rotate_rows=50, row_group_rows=10)
    captures = [verify_step(s, rng) for s in range(6)]
    for capture in captures:
        submit_and_wait(writer, capture)
    final = writer.close()
    assert final["complete"] is True and final["counts"]["routing_rows"] == 6 * 6 * len(LAYERS)
    assert final["counts"]["drafts"] == 6 * 4 and final["counts"]["accepted"] == 6 * 2
    files = sorted((tmp_path / "routing").glob("*.parquet"))
    assert len(files) >= 2, "files rotate by row count"
    assert pq.read_schema(files[0]).metadata[FOOTER_SCHEMA_KEY] == SCHEMA_VERSION.encode()
    trace = open_trace(tmp_path)
    assert trace.warnings == []
    routing = trace.routing().sort("step", "request", "position", "layer").collect()
    first = routing.row(0, named=True)
    source = captures[0]
    order = np.argsort(-source.weights[0, 0])
    assert first["experts"] == source.experts[0, 0][order].tolist()
    weights = np.stack(routing["weights"].to_numpy()).astype(np.float32)
    assert (np.diff(weights, axis=1) <= 0).all()
    assert (routing.filter(pl.col("draft_pos") == 0)["accepted"].null_count()
            == routing.filter(pl.col("draft_pos") == 0).height)


# CRC-32 of vLLM-style request ids (as gzip's trailer gives them): cmpl-3 3943220874 and cmpl-5 40592319 are
# multiples of 3; cmpl-0, -1, -2, -4 and -6 are not
KEPT_ONE_IN_3 = {"cmpl-3", "cmpl-5"}


def sampled_by_request(tmp_path: Path, ids: list[str], steps: int) -> Path:
    """A trace recorded one request in 3, of ``steps`` steps each verifying the requests ``ids`` (indices 0..)."""
    document = manifest()
    document["capture"] = {"sampled": {"one_request_in": 3}}
    writer = TraceWriter(tmp_path, document, LAYERS, TOP_K)
    rng = np.random.default_rng(1)
    for step in range(steps):
        capture = verify_step(step, rng, requests=len(ids))
        submit_and_wait(writer, dataclasses.replace(capture, new_requests=tuple(ids) if step == 0 else ()))
    writer.close()
    return tmp_path


def test_sampled_by_request_the_writer_keeps_routing_of_requests_chosen_by_id_and_every_steps_row(
        tmp_path: Path) -> None:
    ids = [f"cmpl-{i}" for i in range(7)]
    trace = open_trace(sampled_by_request(tmp_path, ids, steps=4))
    routing, steps = trace.routing().collect(), trace.steps().collect()
    assert sorted(routing["request"].unique().to_list()) == [3, 5]
    assert routing.height == 4 * 2 * 3 * len(LAYERS)  # 4 steps x 2 requests x 3 tokens (anchor, 2 drafts)
    final = trace.manifest.document
    assert steps.height == 4 * 7 and final["counts"]["steps_rows"] == 4 * 7
    # counts are the whole steps' (they equal the engine's counters): 7 requests x 2 drafts, 1 accepted, x 4 steps
    assert final["counts"]["drafts"] == 4 * 7 * 2 and final["counts"]["accepted"] == 4 * 7
    assert final["counts"]["routing_rows"] == routing.height
    assert trace.manifest.capture.one_request_in == 3
    assert disagreement(routing_gaps(trace.routing(), trace.steps(), sampled_requests=True)) is None
    # read as if every request were routed, the 5 x 4 request-steps of the other requests would be missing
    assert disagreement(routing_gaps(trace.routing(), trace.steps())) == (
        "20 of 28 decoding request-steps lack routing rows")


def test_a_request_running_across_a_partition_boundary_is_sampled_in_both_partitions(tmp_path: Path) -> None:
    """Each partition numbers its requests from 0: cmpl-3 is request 3 of the first and request 0 of the next, and
    it is kept in both (by index, 0 and 3 would be kept in each)."""
    first = open_trace(sampled_by_request(tmp_path / "p1", ["cmpl-0", "cmpl-1", "cmpl-2", "cmpl-3"], steps=2))
    second = open_trace(sampled_by_request(tmp_path / "p2", ["cmpl-3", "cmpl-4", "cmpl-5", "cmpl-6"], steps=2))
    for trace in (first, second):
        ids = trace.request_ids()
        routed = {ids[request] for request in trace.routing().collect()["request"].unique().to_list()}
        assert routed == KEPT_ONE_IN_3 & set(ids.values())


def test_the_writer_process_imports_the_engines_moetrace_not_one_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoy = tmp_path / "cwd" / "moetrace"  # a source checkout's package where the engine runs, without recording/
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the working directory was imported')\n")
    monkeypatch.chdir(decoy.parent)
    writer = TraceWriter(tmp_path / "trace", manifest(), LAYERS, TOP_K)
    submit_and_wait(writer, verify_step(0, np.random.default_rng(0)))
    final = writer.close()
    assert final["complete"] is True and final["counts"]["routing_rows"] == 6 * len(LAYERS)


def test_killed_writer_leaves_closed_files_readable_and_the_open_one_reported(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K, rotate_rows=30, row_group_rows=10)
    for step in range(5):
        submit_and_wait(writer, verify_step(step, rng))
    # Simulate SIGKILL: the process vanishes without close(); copy the directory as it is on disk now.
    crashed = tmp_path.parent / "crashed"
    shutil.copytree(tmp_path, crashed)
    writer.close()
    trace = open_trace(crashed)
    assert not trace.complete
    assert any("recording incomplete" in w for w in trace.warnings)
    # 18 rows a step, files closed at 30: steps 0+1 and 2+3 fill two files, step 4 sits in the open one
    (open_file,) = (crashed / "routing").glob("*.inprogress")
    assert any(str(open_file) in w and "still open" in w for w in trace.warnings)
    closed = trace.routing().collect().height
    assert closed > 0 and closed % len(LAYERS) == 0


def test_writer_failure_stops_recording_without_raising(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K, row_group_rows=1)
    shutil.rmtree(tmp_path / "routing")  # the disk under the writer goes away
    (tmp_path / "routing").write_text("now a file")
    for step in range(3):
        writer.submit(verify_step(step, rng))  # must not raise into the engine
    final = writer.close()
    assert final["complete"] is False and "error" in final
    assert writer.failed is not None


def test_reader_skips_a_corrupt_file_naming_it_and_reads_the_rest(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K, rotate_rows=30, row_group_rows=10)
    for step in range(4):
        submit_and_wait(writer, verify_step(step, rng))
    writer.close()
    files = sorted((tmp_path / "routing").glob("*.parquet"))
    intact = sum(pq.read_metadata(f).num_rows for f in files[1:])
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    trace = open_trace(tmp_path)
    assert any(str(files[0]) in w and "corrupt or truncated" in w for w in trace.warnings)
    assert trace.routing().collect().height == intact


def test_a_writer_process_that_cannot_start_leaves_no_descriptor_open(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("moetrace.writer.process.sys.executable", str(tmp_path / "no-python"))
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError):
        TraceWriter(tmp_path / "trace", manifest(), LAYERS, TOP_K)
    assert set(os.listdir("/proc/self/fd")) == before


def test_a_writer_launched_beside_takes_steps_before_its_process_runs_and_writes_them_all(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K, launch_beside=True)
    for step in range(5):  # queued at once, in the pipe while the writer process may still be starting
        writer.submit(verify_step(step, rng))
        writer.forward_ready()
    final = writer.close()
    assert final["complete"] is True and final["counts"]["steps"] == 5
    assert open_trace(tmp_path).steps().collect()["step"].n_unique() == 5


def test_a_writer_launched_beside_that_cannot_start_stops_the_recording_not_the_caller(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("moetrace.writer.process.sys.executable", str(tmp_path / "no-python"))
    before = set(os.listdir("/proc/self/fd"))
    writer = TraceWriter(tmp_path / "trace", manifest(), LAYERS, TOP_K, launch_beside=True)  # no raise
    writer.submit(verify_step(0, np.random.default_rng(3)))
    final = writer.close()
    assert final["complete"] is False and "the writer process could not start (FileNotFoundError" in final["error"]
    assert writer.failed is not None and set(os.listdir("/proc/self/fd")) == before


def test_reader_refuses_unknown_schema_and_missing_manifest_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a moetrace trace"):
        open_traces(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest(), "schema": "moetrace/2"}))
    with pytest.raises(UserError, match="unknown schema version 'moetrace/2'"):
        open_trace(tmp_path)


def test_the_manifest_is_read_as_typed_sections_and_a_wrong_value_is_named(tmp_path: Path) -> None:
    written = manifest(3)
    (tmp_path / "manifest.json").write_text(json.dumps(written))
    typed = open_trace(tmp_path).manifest
    assert (typed.spec.k, typed.model.top_k, typed.model.moe_layers) == (3, TOP_K, tuple(LAYERS))
    assert (typed.parallel.dp_rank, typed.parallel.dp_ranks, typed.capture.candidates) == (0, (0,), 0)
    assert typed.source is None and not typed.lacks("router_weights") and typed.document == written
    del written["model"]["top_k"]
    (tmp_path / "manifest.json").write_text(json.dumps(written))
    with pytest.raises(UserError, match="manifest lacks 'model.top_k'$"):
        open_trace(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({**written, "model": {**written["model"], "top_k": "eight"}}))
    with pytest.raises(UserError, match=r"manifest has a malformed value \(ValueError: invalid literal"):
        open_trace(tmp_path)


def test_sweep_parent_opens_every_k_in_order(tmp_path: Path) -> None:
    for k in (3, 0, 1):
        TraceWriter(tmp_path / f"k{k}", manifest(k), LAYERS, TOP_K).close()
    assert [t.k for t in open_traces(tmp_path)] == [0, 1, 3]


class NotReadyYet:
    """A step whose device copies are still in flight for its first ``polls`` questions (as a CUDA event reports)."""

    def __init__(self, capture: StepCapture | StepRecord, polls: int):
        self.capture, self.polls = capture, polls

    def is_ready(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def ready(self) -> StepCapture | StepRecord:
        return self.capture


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


def test_steps_queued_while_the_idle_forwarder_hands_a_batch_over_follow_it_intact(tmp_path: Path) -> None:
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


def test_the_engine_thread_hands_steps_over_in_batches_not_a_pickle_per_step(
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
    assert not writer.steps_waiting and not writer.bytes_unsent, "the whole batch went down the pipe at once"
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


ENGINE_THAT_DIES = """
import os, signal, sys, time
from pathlib import Path
import numpy as np
sys.path.insert(0, {tests!r})
from test_writer_reader import LAYERS, TOP_K, NotReadyYet, manifest, verify_step
import moetrace.writer.process
from moetrace.writer.process import TraceWriter
writer = TraceWriter(Path({root!r}), manifest(), LAYERS, TOP_K, row_group_rows=10)
rng = np.random.default_rng(5)
writer.note_sections({{"partition": {{"switch_ms": 4.25}}, "phases": {{"forward": {{"1": {{"calls": 3}}}}}}}})
for step in range({steps}):
    writer.submit(verify_step(step, rng))
if {mid_step}:
    writer.submit(NotReadyYet(verify_step(4, rng), polls=100))  # its copies never land before the kill
deadline = time.monotonic() + 30
while writer.steps < {steps} and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # idle, as `vllm serve` is before it stops
if {unsent}:  # two more steps queued by the engine thread, not yet time to hand them over
    moetrace.writer.process.SEND_EVERY_SECONDS = 3600
    for step in (5, 6):
        writer.submit(verify_step(step, rng))
    writer.forward_ready()
    assert writer.steps_waiting == 2 and not writer.bytes_unsent, "the two steps wait for the next hand-over"
if {stopped}:  # recording stops as the recorder stops it, and the engine serves on until killed
    writer.failed = "a fault inside the forward"
os.kill(os.getpid(), signal.SIGKILL)
"""


def kill_engine_and_read_manifest(root: Path, mid_step: bool, unsent: bool = False, stopped: bool = False,
                                  steps: int = 4) -> dict[str, Any]:
    script = ENGINE_THAT_DIES.format(tests=str(Path(__file__).parent), root=str(root), mid_step=mid_step,
                                     unsent=unsent, stopped=stopped, steps=steps)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    deadline = time.monotonic() + 30
    while json.loads((root / "manifest.json").read_text()).get("end_time") is None:
        assert time.monotonic() < deadline, "the writer process never finished the manifest"
        time.sleep(0.1)
    assert not list(root.rglob("*.inprogress")), "the writer process closed every file"
    assert open_trace(root).routing().collect().height == steps * 6 * len(LAYERS)
    final: dict[str, Any] = json.loads((root / "manifest.json").read_text())
    assert final["counts"]["steps"] == steps
    return final


def test_an_engine_killed_while_idle_leaves_a_complete_trace(tmp_path: Path) -> None:
    """`vllm serve` stops by killing its workers: the writer process outlives them, closes every file and, since
    every recorded step had been handed over, the trace is complete."""
    final = kill_engine_and_read_manifest(tmp_path / "trace", mid_step=False)
    assert final["complete"] is True and "every recorded step handed over" in final["end"]
    # with what the recorder adds at close, as it last told the writer process (a partition's switch, phases)
    assert final["partition"] == {"switch_ms": 4.25} and final["phases"] == {"forward": {"1": {"calls": 3}}}


def test_an_engine_killed_before_its_first_step_leaves_a_complete_trace_with_what_the_recorder_told(
        tmp_path: Path) -> None:
    """A partition switch on a step with nothing scheduled may open the last partition of a `vllm serve`; killed
    before it records a step, its writer process still closes it with the recorder's sections (they went alone)."""
    final = kill_engine_and_read_manifest(tmp_path / "trace", mid_step=False, steps=0)
    assert final["complete"] is True
    assert final["partition"] == {"switch_ms": 4.25} and final["phases"] == {"forward": {"1": {"calls": 3}}}


def test_an_engine_killed_mid_step_leaves_closed_files_and_says_what_is_missing(tmp_path: Path) -> None:
    final = kill_engine_and_read_manifest(tmp_path / "trace", mid_step=True)
    assert final["complete"] is False and "last 1 step(s) are missing" in final["error"]


def test_steps_queued_but_not_yet_handed_over_when_the_engine_is_killed_are_said_missing(tmp_path: Path) -> None:
    """The engine thread hands its steps over a batch at a time; those it still held when killed are counted in
    memory it shares with the writer process, which says they are missing."""
    final = kill_engine_and_read_manifest(tmp_path / "trace", mid_step=False, unsent=True)
    assert final["complete"] is False and "last 2 step(s) are missing" in final["error"]


def test_an_engine_killed_after_recording_stopped_leaves_a_trace_that_says_why(tmp_path: Path) -> None:
    """Recording stops on a fault and the engine serves on; killed later, it never closed the trace, but the reason
    lives in memory it shared with the writer process, so the trace is not taken for a complete one."""
    final = kill_engine_and_read_manifest(tmp_path / "trace", mid_step=False, stopped=True)
    assert final["complete"] is False and "recording had stopped (a fault inside the forward)" in final["error"]
    assert "missing" not in final["error"]  # every step recorded before the fault was handed over


def test_a_sweep_folder_with_two_traces_at_one_k_or_two_models_is_refused_in_one_line(tmp_path: Path) -> None:
    for name, k in (("a", 3), ("b", 3)):
        TraceWriter(tmp_path / "dup" / name, manifest(k), LAYERS, TOP_K).close()
    with pytest.raises(UserError, match=r"two traces at k=3 \(a, b\)"):
        open_traces(tmp_path / "dup")
    other = {**manifest(2), "model": {**manifest(2)["model"], "num_experts": 256}}  # type: ignore[dict-item]
    TraceWriter(tmp_path / "mixed" / "k0", manifest(0), LAYERS, TOP_K).close()
    TraceWriter(tmp_path / "mixed" / "k2", other, LAYERS, TOP_K).close()
    with pytest.raises(UserError, match="not one sweep: k0 has model.num_experts 384, k2 has 256"):
        open_traces(tmp_path / "mixed")


def _dp_recording(root: Path, ks: tuple[int, int] = (2, 2)) -> Path:
    """Two DP ranks' traces of one recording, as the plugin writes them: root/dp0, root/dp1."""
    from trace_builder import Model, verify_tokens, write_trace

    model = Model()
    for rank, k in enumerate(ks):
        tokens = verify_tokens(np.random.default_rng(rank), model, requests=2, steps=6, k=k, accept_prob=0.6)
        trace = write_trace(root / f"dp{rank}", tokens, model, k=k)
        manifest = json.loads((trace / "manifest.json").read_text())
        manifest["parallel"].update(dp=2, dp_rank=rank)
        manifest["counts"] = {"steps": 6, "routing_rows": int(len(tokens.step)) * len(model.layers)}
        (trace / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_a_data_parallel_recording_reads_as_one_trace_with_each_ranks_requests_and_steps_apart(
    tmp_path: Path,
) -> None:
    root = _dp_recording(tmp_path / "run")
    (trace,) = open_traces(root)
    ranks = [open_trace(root / "dp0"), open_trace(root / "dp1")]
    routing = trace.routing().collect()
    assert routing.height == sum(r.routing().collect().height for r in ranks)
    assert routing["dp_rank"].unique().sort().to_list() == [0, 1]
    # the same request index on two ranks is two requests; a rank's step is its own batch
    per_rank = [r.steps().collect() for r in ranks]
    steps = trace.steps().collect()
    assert steps.select("request").n_unique() == sum(f.select("request").n_unique() for f in per_rank)
    assert steps.select("dp_rank", "step").n_unique() == sum(f.select("step").n_unique() for f in per_rank)
    for rank, own in enumerate(per_rank):  # each rank keeps its own step numbers
        assert steps.filter(pl.col("dp_rank") == rank)["step"].sort().to_list() == own["step"].sort().to_list()
    assert trace.manifest.parallel.dp_ranks == (0, 1) and trace.manifest.counts["steps"] == 12
    assert trace.k == 2 and trace.complete


def test_a_data_parallel_recordings_request_ids_follow_its_merged_request_indices(tmp_path: Path) -> None:
    root = _dp_recording(tmp_path / "run")
    for rank in (0, 1):
        manifest = json.loads((root / f"dp{rank}" / "manifest.json").read_text())
        manifest["requests"] = [f"rank{rank}-req{i}-x" for i in range(2)]
        (root / f"dp{rank}" / "manifest.json").write_text(json.dumps(manifest))
    (trace,) = open_traces(root)
    assert trace.request_ids() == {0: "rank0-req0-x", 1: "rank1-req0-x", 2: "rank0-req1-x", 3: "rank1-req1-x"}
    # every merged request index in the rows has its id, and the rank that recorded it
    rows = trace.steps().select("request", "dp_rank").unique().collect()
    for request, rank in rows.iter_rows():
        assert trace.request_ids()[request].startswith(f"rank{rank}-")


def test_data_parallel_ranks_of_different_recordings_are_refused(tmp_path: Path) -> None:
    root = _dp_recording(tmp_path / "run", ks=(2, 3))
    with pytest.raises(UserError, match="not one recording"):
        open_traces(root)


def test_steps_the_engine_thread_left_queued_are_forwarded_once_it_goes_quiet(tmp_path: Path) -> None:
    """An engine that stops stepping (idle, then killed by ``vllm serve``) holds no queued step back."""
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K)
    writer.submit(verify_step(0, np.random.default_rng(6)))  # queued, and no forward_ready follows
    deadline = time.monotonic() + 10
    while writer.steps < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert writer.steps == 1 and not writer.steps_waiting
    writer.close()


def test_a_failing_test_that_started_a_writer_process_leaves_none_behind(pytester: pytest.Pytester) -> None:
    """The suite's fixture (``conftest.no_writer_left_behind``): a test that starts a writer process and fails
    before closing it (its traceback keeps the writer's pipe open) still leaves no writer process running."""
    from conftest import writer_processes

    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_inner="""
from pathlib import Path
from moetrace.writer.process import TraceWriter

def test_fails_with_its_writer_open(tmp_path):
    writer = TraceWriter(tmp_path / "t", {"schema": "moetrace/1", "run_id": "inner"}, [1], 2)
    assert writer.failed is None
    assert False, "fails before close"
""")
    before = writer_processes()
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert writer_processes() - before == set()


def test_a_manifest_section_outside_the_contract_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a manifest section: speedup"):
        start_manifest(tmp_path, **manifest(), speedup=2.0)
    assert not (tmp_path / "manifest.json").exists()


def test_amending_a_closed_manifest_keeps_what_the_writer_process_wrote(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K)
    writer.submit(verify_step(0, np.random.default_rng(0)))
    closed = writer.close()
    amend_manifest(tmp_path, vllm_counters={"num_drafts": 2.0})
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["vllm_counters"] == {"num_drafts": 2.0}
    assert {key: on_disk[key] for key in closed} == json.loads(json.dumps(closed))
    # 2 requests × 3-token windows, 1 of 2 drafts accepted in each: counted by the writer process, kept by the amend
    assert (on_disk["complete"], on_disk["counts"]["tokens"], on_disk["counts"]["drafts"]) == (True, 6, 4)


def test_the_python_api_opens_a_trace_by_its_path_and_duckdb_reads_the_same_rows(tmp_path: Path) -> None:
    import duckdb

    import moetrace
    from trace_builder import small_k2_trace

    path = small_k2_trace(tmp_path / "run" / "k2")
    trace = moetrace.open_trace(str(path))  # a plain string, as a notebook passes it
    assert trace.k == 2 and trace.manifest.spec.method == "ngram"
    rows = trace.routing().select(pl.len()).collect().item()
    # another reader of the same files: DuckDB over the Parquet glob, no moetrace code involved
    assert duckdb.sql(f"SELECT count(*) FROM '{path}/routing/*.parquet'").fetchall() == [(rows,)]
    assert [t.k for t in moetrace.open_traces(tmp_path / "run")] == [2]
    with pytest.raises(UserError, match="no such trace"):
        moetrace.open_trace(str(tmp_path / "missing"))
    with pytest.raises(AttributeError):
        getattr(moetrace, "open_tracee")
    # the engine process imports the package for its plugin: that alone loads no Polars
    loaded = subprocess.run([sys.executable, "-c", "import sys, moetrace; print('polars' in sys.modules)"],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"


def test_a_second_checkouts_package_beside_this_ones_analysis_is_refused_in_one_line(tmp_path: Path) -> None:
    # another clone's moetrace/ first on sys.path, this checkout's editable install mapping moetrace.analysis
    shutil.copytree(Path(moetrace.__file__).parent, tmp_path / "moetrace",
                    ignore=shutil.ignore_patterns("__pycache__"))
    mixed = subprocess.run([sys.executable, "-c", "import moetrace.analysis"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert mixed.returncode != 0
    last = mixed.stderr.strip().splitlines()[-1]
    # an editable install maps the subpackage to its own checkout: refused by name; any other install has none
    assert "two moetrace checkouts are mixed" in last or "No module named 'moetrace.analysis'" in last


def test_a_data_parallel_recording_always_on_reads_as_one_trace_of_each_ranks_partitions(tmp_path: Path) -> None:
    """Under `vllm serve` with DP each rank records into OUT/dp<r>, and always on that is a root of partitions
    (OUT/dp<r>/date=…/hour=…): OUT reads as one trace of both ranks, each its partitions numbered on."""
    from click.testing import CliRunner
    from trace_builder import Model, verify_tokens, write_trace

    from moetrace.cli import main

    model, root, written = Model(), tmp_path / "served", []
    for rank in (0, 1):
        for hour in (15, 16):
            tokens = verify_tokens(np.random.default_rng(10 * rank + hour), model, requests=2, steps=6, k=2,
                                   accept_prob=0.6)
            part = write_trace(root / f"dp{rank}" / "date=2026-12-04" / f"hour={hour}", tokens, model, k=2)
            manifest = json.loads((part / "manifest.json").read_text())
            manifest["parallel"].update(dp=2, dp_rank=rank)
            (part / "manifest.json").write_text(json.dumps(manifest))
            written.append((rank, tokens))
    (trace,) = open_traces(root)
    assert [len(rank.parts) for rank in trace.ranks] == [2, 2] and trace.manifest.parallel.dp_ranks == (0, 1)
    routing = trace.routing().collect()
    assert routing.height == sum(len(tokens.step) for _, tokens in written) * len(model.layers)
    for rank in (0, 1):  # each rank's two partitions, the second's steps numbered on after the first's
        steps = sum(len(np.unique(tokens.step)) for at, tokens in written if at == rank)
        assert routing.filter(pl.col("dp_rank") == rank)["step"].n_unique() == steps
    reported = CliRunner().invoke(main, ["report", str(root), "--json", "-o", str(tmp_path / "r.html")])
    assert reported.exit_code == 0, reported.output
