"""Always-on recording under ``vllm serve``: one complete trace per period under a root (``trace.partitions``), each
closed beside the engine on a thread of its own, and the root held to its disk cap.

The recorder switches partitions between steps (``Recorder.next_partition``); this class keeps what lasts across
them: when the partition under way began, the partitions still closing, and the disk cap, whose walk of the root
never runs on the engine thread (``watch_cap`` on a thread; ``hold_cap`` on each closing thread).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetrace.hooks.options import RecordingOptions
from moetrace.trace.partitions import drop_oldest, new_partition_dir, over_cap
from moetrace.writer.process import TraceWriter

log = logging.getLogger("moetrace")
CAP_CHECK_SECONDS = 5.0  # between partitions, how often a thread checks the partition root against its disk cap


class Partitions:
    """The partitions of one always-on recording (``options``: under ``options.out``, a period and a cap each),
    named after its run id and their start."""

    def __init__(self, options: RecordingOptions) -> None:
        assert options.partition_seconds is not None
        self.root, self.run_id = Path(options.out), options.run_id
        self.period, self.cap, self.at_cap = float(options.partition_seconds), options.disk_cap_bytes, options.at_cap
        self.started = 0.0
        self.writing = self.root  # the partition under way
        self.closing: list[tuple[threading.Thread, Path]] = []  # partitions closing beside the engine
        self.switch_ms: float | None = None  # the engine thread's time on the switch to the partition under way
        # the root is over its cap: switch at the next step (``watch_cap``); still over it after a switch under
        # "stop": stop recording at the next step (``hold_cap``)
        self.cap_reached, self.stop_at_cap = threading.Event(), threading.Event()

    def options_for(self, options: RecordingOptions, now: float | None = None) -> RecordingOptions:
        """``options`` for the partition that starts at ``now`` (seconds since the epoch; default: now): its folder
        under the root (created here), its own run id."""
        self.started = time.time() if now is None else now
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.started))
        self.writing = new_partition_dir(self.root, self.started, self.period)
        return dataclasses.replace(options, run_id=f"{self.run_id}-{stamp}", out=str(self.writing))

    def due(self, now: float | None = None) -> bool:
        """Whether the partition under way has run its period, or the root is over its cap, at ``now`` (seconds
        since the epoch; default: now)."""
        now = time.time() if now is None else now
        return now - self.started >= self.period or self.cap_reached.is_set()

    def watch_cap(self, recording: Callable[[], bool]) -> None:
        """Where there is a cap: start a thread that checks the root against it every ``CAP_CHECK_SECONDS`` while
        ``recording()``."""
        cap = self.cap
        if cap is None:
            return

        def watch() -> None:
            while recording() and not self.stop_at_cap.is_set():
                time.sleep(CAP_CHECK_SECONDS)
                if over_cap(self.root, cap):
                    self.cap_reached.set()

        threading.Thread(target=watch, name="moetrace-disk-cap", daemon=True).start()

    def close_beside(self, writer: TraceWriter, sections: dict[str, Any]) -> None:
        """Close a partition's trace on a thread of its own (its writer process finishes it beside the next one's),
        which then holds the root to its cap."""
        def close() -> None:
            began = time.perf_counter()
            writer.close(sections)
            log.info("moetrace: partition %s closed in %.1f ms beside the engine thread", writer.root,
                     (time.perf_counter() - began) * 1e3)
            self.hold_cap()

        self.cap_reached.clear()
        thread = threading.Thread(target=close, name="moetrace-partition-close")
        thread.start()
        self.closing = [(t, path) for t, path in self.closing if t.is_alive()] + [(thread, writer.root)]

    def hold_cap(self) -> None:
        """At the disk cap, drop the oldest partitions (never the one being written nor one still closing), or
        under "stop" have the engine thread stop recording at its next step (the server serves on unhooked)."""
        cap = self.cap
        if cap is None or not over_cap(self.root, cap):
            return
        if self.at_cap == "stop":
            log.warning("moetrace: %s holds more than its cap of %d bytes: recording stops, the server serves on",
                        self.root, cap)
            self.stop_at_cap.set()
            return
        still_closing = [path for thread, path in self.closing if thread is not threading.current_thread()]
        dropped = drop_oldest(self.root, cap, keep=[self.writing, *still_closing])
        log.info("moetrace: at the cap of %d bytes under %s, dropped %d partition(s)", cap, self.root, len(dropped))

    def join(self) -> None:
        """Wait for every partition still closing."""
        for thread, _ in self.closing:
            thread.join()


class StopAfter:
    """A recording under ``vllm serve`` that closes after ``steps`` recorded steps, or ``seconds`` after its first
    (the driver's ``MOETRACE_RECORD`` steps= / seconds=)."""

    __slots__ = ("steps", "seconds", "first_at")

    def __init__(self, steps: int | None, seconds: float | None) -> None:
        self.steps, self.seconds = steps, seconds
        self.first_at: float | None = None

    def reached(self, recorded: int) -> bool:
        """Whether the step just recorded, the ``recorded``-th, is the last."""
        if self.first_at is None:
            self.first_at = time.monotonic()
        return (self.steps is not None and recorded >= self.steps) or (
            self.seconds is not None and time.monotonic() - self.first_at >= self.seconds)
