"""An engine process killed under the trace writer (as `vllm serve` stops its workers): the writer process outlives
it, closes every file and says in the manifest what, if anything, is missing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from moetrace.trace.reader import open_trace
from writer_steps import LAYERS

ENGINE_THAT_DIES = """
import os, signal, sys, time
from pathlib import Path
import numpy as np
sys.path.insert(0, {fixtures!r})
from writer_steps import LAYERS, TOP_K, NotReadyYet, manifest, verify_step
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
    script = ENGINE_THAT_DIES.format(fixtures=str(Path(__file__).parents[1] / "fixtures"), root=str(root),
                                     mid_step=mid_step, unsent=unsent, stopped=stopped, steps=steps)
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
    """The engine thread hands its steps over several at a time; those it still held when killed are counted in
    memory it shares with the writer process, which says they are missing."""
    final = kill_engine_and_read_manifest(tmp_path / "trace", mid_step=False, unsent=True)
    assert final["complete"] is False and "last 2 step(s) are missing" in final["error"]


def test_an_engine_killed_after_recording_stopped_leaves_a_trace_that_says_why(tmp_path: Path) -> None:
    """Recording stops on a fault and the engine serves on; killed later, it never closed the trace, but the reason
    lives in memory it shared with the writer process, so the trace is not taken for a complete one."""
    final = kill_engine_and_read_manifest(tmp_path / "trace", mid_step=False, stopped=True)
    assert final["complete"] is False and "recording had stopped (a fault inside the forward)" in final["error"]
    assert "missing" not in final["error"]  # every step recorded before the fault was handed over
