"""Trace writer: per-step routing captures into rotated Parquet files, encoded in a process of its own.

The engine thread only hands over: a step's routing rows are written (on a GPU by the GPU itself) into a ring of rows
that the engine process and the writer process both map (``SharedRows``); ``TraceWriter.submit`` queues the step,
and ``forward_ready`` (called where the GPU is busy with the next forward) hands the queued steps over several at a
time: one pickle of what is left of each step whose rows have landed (its request order, query starts, drafts, kept
counts, and where its rows lie in the ring: a few hundred bytes) and one write down a non-blocking pipe to the writer
process (``python -m moetrace.writer.process``), which copies the rows out of the ring, releasing them, and
assembles rows, builds Arrow tables, compresses and writes. Done by a thread of the engine process, that work took
the GIL from the engine loop at high step rates (measured on an H200: 4-5% of throughput). A file being written is
named ``*.parquet.inprogress`` and renamed when closed, so a killed recording leaves every rotated file readable and
marks the one it lost; if the engine process dies, the writer process still closes its files. Any error stops
recording with a warning; it never propagates into the engine.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import mmap
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from moetrace.writer.metrics import MetricsState, serve_metrics
from moetrace.writer.ring import SHARED_BYTES, EngineRecord, Pending, SharedRows
from moetrace.trace.files import Assemblable, StepCapture, TraceFiles
from moetrace.trace.manifest import amend_manifest, start_manifest
from moetrace.trace.schema import MANIFEST_NAME, ROUTING_DIR, STEPS_DIR

log = logging.getLogger("moetrace")


# Keeps the writer process off the engine's cores when they are scarce (a CPU backend's OpenMP team stalls
# whenever one core is taken).
WRITER_NICENESS = 10
CPU_PINNING_VARIABLES = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")
# Bytes of steps the engine may hold while the writer process catches up; past it recording stops, said out loud.
MAX_BACKLOG_BYTES = 256 << 20
IDLE_FORWARD_SECONDS = 0.1  # how long queued steps wait for the engine thread before the idle forwarder sends them
# Queued steps are handed over together (one pickle, one pipe write) once this many wait, once the oldest has waited
# this long, or once a quarter of the ring is reserved, whichever comes first. Code that runs once per step runs
# cold (its instructions and data evicted by vLLM's own step): a hand-over per step cost the engine thread 60-70 µs
# on an H200 host; with a pause between steps, 31-39 µs one by one against 20-25 µs together (a CPU VM).
HAND_OVER_STEPS = 16
SEND_EVERY_SECONDS = 0.05
PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = 1031  # Linux fcntl: grow a pipe's buffer


class TraceWriter:
    """The engine side of one trace directory: steps go down a pipe to the writer process.

    No thread on the engine side takes the GIL from the engine loop while steps flow: ``submit`` (once per step, on
    the engine thread) only queues a step and counts it in memory shared with the writer process, and
    ``forward_ready`` (once per step, where the engine thread would otherwise wait for the GPU) hands the queued
    steps whose copies have landed over in one hand-over (``HAND_OVER_STEPS``, ``SEND_EVERY_SECONDS``, a quarter of the
    ring: their rows stay in the ``rows`` ring, which the writer process maps too, so only where they lie is
    pickled) through a non-blocking pipe, and otherwise returns at once; what the pipe cannot take yet waits in
    memory. Why recording stopped, if it did, is kept in the shared memory too. Once the engine has gone quiet for
    ``IDLE_FORWARD_SECONDS``, a thread forwards what is left (an engine stopped while idle, as ``vllm serve`` kills
    its workers, holds no step back)."""

    def __init__(self, root: Path, manifest: dict[str, Any], moe_layers: list[int], top_k: int, candidates: int = 0,
                 rotate_rows: int = 4_000_000, rotate_seconds: float = 10.0, row_group_rows: int = 262_144,
                 write_every_seconds: float = 1.0, rows: SharedRows | None = None, metrics_port: int | None = None,
                 metrics_state: MetricsState | None = None, launch_beside: bool = False) -> None:
        """``rows``: the ring that steps leave their rows in, shared with the writer process (closed with the
        writer); ``metrics_port``: where the writer process serves the recording's live metrics
        (``moetrace.writer.metrics``), if anywhere, kept in ``metrics_state`` (an always-on recording's, which
        lives across its partitions' writers; None: the writer's own); ``launch_beside``: start the writer process
        on a thread of its own and return at once (an always-on recording's next partition: the engine thread does
        not wait for a Python to start; steps queue in the pipe meanwhile, and a launch that fails stops the
        recording, not the engine); else it is started before this returns, and a launch that fails raises.
        A ``root`` that holds a trace already (a server restarted with the same ``MOETRACE_RECORD``) raises
        ``FileExistsError`` before anything is written: a recording never writes over another."""
        if (root / MANIFEST_NAME).exists():
            raise FileExistsError(f"{root} already holds a trace: name another directory (a recording never "
                                  "writes over one)")
        self.root = root
        self._failed: str | None = None
        self.steps = 0  # steps written so far, as the writer process last reported
        self._final: dict[str, Any] | None = None
        self._waiting: collections.deque[StepCapture | Pending] = collections.deque()
        self._submitted = 0
        self._sections: dict[str, Any] | None = None  # told by ``note_sections``, not yet handed over
        self._backlog = bytearray()
        self._shared_file = tempfile.TemporaryFile()  # unlinked: it lives while a process maps it
        self._shared_file.truncate(SHARED_BYTES)
        self._shared: EngineRecord | None = EngineRecord(mmap.mmap(self._shared_file.fileno(), SHARED_BYTES))
        self.rows = rows
        self._own_metrics: MetricsState | None = None
        if metrics_port is not None and metrics_state is None:
            self._own_metrics = metrics_state = MetricsState.create(
                len(moe_layers), int(manifest["model"]["num_experts"]), int(manifest["spec"]["k"]))
        for table in (ROUTING_DIR, STEPS_DIR):
            (root / table).mkdir(parents=True, exist_ok=True)
        manifest = start_manifest(root, **manifest)  # a trace says what it is before its first row
        to_child_r, self._to_child = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            fcntl.fcntl(self._to_child, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
        # Started detached (through a launcher that exits at once, in a session of its own): `vllm serve` stops by
        # killing every process below its workers, and the writer must outlive them to close its files.
        # Nor may it inherit the engine's CPU pinning (vLLM's CPU worker sets GOMP_CPU_AFFINITY for its OpenMP team).
        unpinned = {key: value for key, value in os.environ.items() if key not in CPU_PINNING_VARIABLES}
        # the writer process's arguments: its pipes, the engine's record, the ring and the metrics' state (-1: none)
        fds = (to_child_r, from_child_w, self._shared_file.fileno(), self.rows.fd if self.rows else -1,
               metrics_state.fd if metrics_state and metrics_port is not None else -1)
        self._launcher: threading.Thread | None = None
        if launch_beside:
            self._launcher = threading.Thread(target=self._launch_beside, args=(fds, unpinned),
                                              name="moetrace-writer-launch", daemon=True)
        else:
            try:
                self._launch(fds, unpinned)
            except BaseException:  # no writer process: nothing may stay open behind the error
                for fd in (self._to_child, from_child_r):
                    os.close(fd)
                self._release_shared()
                raise
        os.set_blocking(self._to_child, False)
        self._from_child = os.fdopen(from_child_r, "rb")
        config = dict(root=root, manifest=manifest, moe_layers=moe_layers, top_k=top_k, candidates=candidates,
                      rotate_rows=rotate_rows, rotate_seconds=rotate_seconds, row_group_rows=row_group_rows,
                      write_every_seconds=write_every_seconds, metrics_port=metrics_port)
        ring = (self.rows.capacity, self.rows.width) if self.rows else None
        self._backlog += pickle.dumps(("init", config, ring), protocol=pickle.HIGHEST_PROTOCOL)
        self._drain(wait=False)  # the writer process starts its files now, not at the first hand-over
        self._lock = threading.Lock()  # the engine thread, the idle forwarder and close take turns
        self._last_forward = time.monotonic()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, name="moetrace-writer-status", daemon=True)
        self._reader.start()
        self._idle = threading.Thread(target=self._forward_when_idle, name="moetrace-writer-idle", daemon=True)
        self._idle.start()
        if self._launcher is not None:
            self._launcher.start()

    @staticmethod
    def _launch(fds: tuple[int, ...], env: dict[str, str]) -> None:
        """Start the writer process; the launch's ends of the pipes (``fds``' first two) are closed either way."""
        try:
            subprocess.run([sys.executable, "-c", LAUNCH_DETACHED, *map(str, fds)],
                           pass_fds=[fd for fd in fds if fd >= 0], stdin=subprocess.DEVNULL, env=env, check=True)
        finally:
            os.close(fds[0])
            os.close(fds[1])

    def _launch_beside(self, fds: tuple[int, ...], env: dict[str, str]) -> None:
        """Thread: ``_launch``; a launch that fails stops the recording (said as it is)."""
        try:
            self._launch(fds, env)
        except Exception as exc:
            self._fail(f"the writer process could not start ({type(exc).__name__}: {exc})")

    @property
    def failed(self) -> str | None:
        """Why recording stopped (None while it goes on)."""
        return self._failed

    @failed.setter
    def failed(self, reason: str | None) -> None:
        self._failed = reason
        if reason is not None and self._shared is not None:  # a killed engine's trace still says why it stopped
            self._shared.set_failure(reason)

    @property
    def steps_waiting(self) -> int:
        """Steps submitted and not yet handed over to the writer process (handed over together by ``forward_ready``)."""
        return len(self._waiting)

    @property
    def bytes_unsent(self) -> int:
        """Bytes handed over but not yet written to the writer process's pipe."""
        return len(self._backlog)

    def submit(self, step: StepCapture | Pending) -> None:
        """Queue one step (pickled by the next ``forward_ready``); never blocks and never raises."""
        if self.failed is None and self._shared is not None:  # None once closed
            self._submitted += 1
            self._shared.set_submitted(self._submitted)  # counted before it can be sent: never fewer than received
            self._waiting.append(step)

    def note_sections(self, sections: dict[str, Any]) -> None:
        """Tell the writer process what the recorder will add to the manifest at close, as it stands now: a trace
        whose engine process dies is closed by the writer process with these (sent with the next hand-over)."""
        self._sections = sections  # one reference, swapped whole: picked up by ``_forward`` under its lock

    def forward_ready(self) -> None:
        """Hand the queued steps that are ready (their copies have landed) over, if it is time (``HAND_OVER_STEPS``);
        never blocks and never raises: while the idle forwarder is handing steps over, it leaves them to it."""
        if not (self._waiting or self._backlog or self._sections is not None):
            return
        if (len(self._waiting) < HAND_OVER_STEPS and time.monotonic() - self._last_forward < SEND_EVERY_SECONDS
                and (self.rows is None or 4 * self.rows.in_use() < self.rows.capacity)):
            return
        if self.failed is not None or self._closing.is_set():
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._forward(wait=False)
        except Exception as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self._lock.release()

    def close(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Flush everything, rename the open files and rewrite the manifest as complete (or say why not)."""
        extra = dict(extra or {})
        if self._launcher is not None:  # the descriptors it passes stay open until it has passed them
            self._launcher.join()
        self._closing.set()
        with self._lock:
            try:
                if self.failed is None:
                    self._forward(wait=True)
                self._backlog += pickle.dumps(("close", extra, self.failed), protocol=pickle.HIGHEST_PROTOCOL)
                self._drain(wait=True)
            except Exception as exc:
                self._fail(f"the writer process is gone ({type(exc).__name__}: {exc})")
            finally:
                os.close(self._to_child)  # the writer process sees the end either way, and closes its files
        self._reader.join(timeout=120)  # the writer process reports "closed", then exits
        if not self._reader.is_alive():
            self._from_child.close()
        if self._final is None:  # the writer process died: say so in the manifest it could not finish
            self._final = amend_manifest(self.root, **extra, complete=False,
                                         error=self.failed or "the writer process ended unexpectedly")
        if self._final.get("error") and self.failed is None:
            self.failed = str(self._final["error"])
        self._release_shared()
        return self._final

    def _release_shared(self) -> None:
        """Close the memory shared with the writer process (the record, the ring, its own metrics), once."""
        if self._shared is not None:
            self._shared.memory.close()
            self._shared = None
            self._shared_file.close()
            if self.rows is not None:
                self.rows.close()
            if self._own_metrics is not None:
                self._own_metrics.close()

    def _forward_when_idle(self) -> None:
        """Thread: forwards what is queued (steps, sections) once nothing has been forwarded for
        ``IDLE_FORWARD_SECONDS``; while steps flow it only wakes to find the engine thread has done it. Sections go
        alone too: a partition whose engine is killed before it records a step still closes with them."""
        while not self._closing.wait(IDLE_FORWARD_SECONDS):
            if ((self._waiting or self._backlog or self._sections is not None)
                    and time.monotonic() - self._last_forward >= IDLE_FORWARD_SECONDS):
                self.forward_ready()

    def _forward(self, wait: bool) -> None:
        """Pickle the leading steps that are ready (all of them when ``wait``) as one message into the backlog, and
        drain it (when ``wait``, until the pipe has taken all of it)."""
        self._last_forward = time.monotonic()
        handed: list[StepCapture | Assemblable] = []
        # A copy (taken in one C call, so whole): the engine thread may queue steps while the idle forwarder is here,
        # and a deque changed under an iterator raises.
        for step in list(self._waiting):
            if isinstance(step, StepCapture):
                handed.append(step)
            elif wait or step.is_ready():
                handed.append(step.ready())
            else:
                break
        sections, self._sections = self._sections, None
        if sections is not None:
            self._backlog += pickle.dumps(("sections", sections), protocol=pickle.HIGHEST_PROTOCOL)
        if handed:
            self._backlog += pickle.dumps(("steps", handed), protocol=pickle.HIGHEST_PROTOCOL)
            for _ in handed:  # only once pickled: an error before leaves them queued, counted as submitted
                self._waiting.popleft()
        self._drain(wait)
        if len(self._backlog) > MAX_BACKLOG_BYTES:
            raise RuntimeError(f"the writer process fell {len(self._backlog) >> 20} MiB behind the engine")

    def _drain(self, wait: bool) -> None:
        """Write the backlog into the (non-blocking) pipe: one system call when it fits, as it does send after send;
        when the pipe is full, the rest goes with a later send, or, when ``wait``, once the pipe has room."""
        while self._backlog:
            try:
                written = os.write(self._to_child, self._backlog)
            except BlockingIOError:
                if not wait:
                    return
                select.select([], [self._to_child], [], 1.0)
                continue
            except BrokenPipeError:
                raise RuntimeError("the writer process ended unexpectedly") from None
            del self._backlog[:written]

    def _read(self) -> None:
        """Status thread (asleep in a read but for one progress message per write): what the writer process
        reports."""
        while True:
            try:
                message = pickle.load(self._from_child)
            except (EOFError, OSError, pickle.UnpicklingError):
                return
            if message[0] == "progress":
                self.steps = message[1]
            elif message[0] == "failed":
                self._fail(message[1])
            elif message[0] == "closed":
                self._final = message[1]

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            log.warning("moetrace: recording stopped, the engine keeps serving (%s)", reason)


def serve(inbox: Any, outbox: Any, engine: EngineRecord, ring_fd: int | None = None,
          metrics_fd: int | None = None) -> None:
    """The writer process: read steps from ``inbox`` (their rows from the ring shared through ``ring_fd``, copied
    out as each step arrives), write what arrived every ``write_every_seconds``, rotate files on time even when idle,
    and report progress, failure and the final manifest to ``outbox``; ``engine`` says what an engine that ended
    without closing had submitted, and why its recording stopped if it did; ``metrics_fd``: the live metrics' state
    (``MetricsState``), where the config asks for them."""
    for stop in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C reaches the whole process group: end at EOF instead
        signal.signal(stop, signal.SIG_IGN)
    received: queue.Queue[tuple[Any, ...] | None] = queue.Queue()

    def receive() -> None:  # a thread, so that files still rotate while no step arrives
        while True:
            try:
                message = pickle.load(inbox)
            except (EOFError, OSError, pickle.UnpicklingError):  # the engine process is gone (maybe mid-message)
                received.put(None)
                return
            if message[0] == "steps":
                for step in message[1]:
                    if not isinstance(step, StepCapture):
                        step.take_rows(ring)  # at once: the engine reuses the ring's rows once released
            received.put(message)

    def report(*message: Any) -> None:
        try:
            pickle.dump(message, outbox, protocol=pickle.HIGHEST_PROTOCOL)
            outbox.flush()
        except OSError:
            pass

    kind, config, ring_shape = pickle.load(inbox)
    metrics_port = config.pop("metrics_port", None)
    try:
        ring = SharedRows(ring_fd, *ring_shape) if ring_fd is not None and ring_shape else None
        files = TraceFiles(**config)
    except Exception as exc:  # the engine side finishes the manifest with this reason
        report("failed", f"{type(exc).__name__}: {exc}")
        return
    metrics = None
    if metrics_port is not None:
        try:
            model, spec = files.manifest["model"], files.manifest["spec"]
            shape = (model["moe_layers"], int(model["num_experts"]), int(spec["k"]))
            state = None if metrics_fd is None else MetricsState(metrics_fd, len(shape[0]), *shape[1:])
            metrics = serve_metrics(metrics_port, *shape, state)
        except Exception as exc:  # metrics are extra: the trace is written without them, and says why
            log.warning("moetrace: no live metrics on port %s (%s: %s)", metrics_port, type(exc).__name__, exc)
    threading.Thread(target=receive, daemon=True).start()
    steps_received = 0
    told: dict[str, Any] = {}  # the recorder's closing sections as it last told them (``TraceWriter.note_sections``)
    while True:
        pending: list[Any] = []
        closing: tuple[Any, ...] | None = None
        deadline = time.monotonic() + files.write_every_seconds
        while closing is None and (remaining := deadline - time.monotonic()) > 0:
            try:
                message = received.get(timeout=remaining)
            except queue.Empty:
                break
            if message is None:
                kind, extra, error = engine_ended(*engine.read(), steps_received)
                closing = (kind, {**told, **extra}, error)
            elif message[0] == "steps":
                pending.extend(message[1])
                steps_received += len(message[1])
            elif message[0] == "sections":
                told = message[1]
            else:
                closing = message
        if files.failed is None:
            written: list[StepCapture] = []
            try:
                written = files.write(pending)
                files.maybe_rotate()
            except Exception as exc:
                files.failed = f"{type(exc).__name__}: {exc}"
                report("failed", files.failed)
            report("progress", files.steps)
            if metrics is not None:
                try:
                    metrics.observe(written)
                except Exception as exc:  # never at the trace's cost: the metrics stop, the recording goes on
                    log.warning("moetrace: live metrics stopped (%s: %s)", type(exc).__name__, exc)
                    metrics = None
        if closing is not None:
            _, extra, error = closing
            report("closed", files.close(extra, error))
            return


def engine_ended(submitted: int, failure: str | None, received: int) -> tuple[Any, ...]:
    """The close message for an engine process that ended without closing its trace. `vllm serve` stops that way
    (it kills its workers); if the engine had handed over every step it recorded, nothing is missing."""
    stopped = f"; recording had stopped ({failure})" if failure else ""
    if submitted == received and not failure:
        return ("close", {"end": "the engine process ended (killed or shut down) with every recorded step handed "
                                 "over"}, None)
    missing = f"; its last {submitted - received} step(s) are missing" if submitted != received else ""
    return ("close", {}, f"the engine process ended without closing the trace{missing}{stopped}")

LAUNCH_DETACHED = (
    "import os, subprocess, sys\n"
    "try:\n"
    "    os.sched_setaffinity(0, range(os.cpu_count() or 1))  # vLLM's CPU workers pin the thread that spawns us\n"
    "except OSError:\n"
    "    pass\n"
    f"os.nice({WRITER_NICENESS})\n"
    "fds = tuple(int(fd) for fd in sys.argv[1:] if int(fd) >= 0)\n"
    # -P: not the working directory first on sys.path, where a source checkout's moetrace/ would shadow the
    # installed package the engine imported (seen: a checkout beside a non-editable install lacks moetrace.hooks)
    "subprocess.Popen([sys.executable, '-P', '-m', 'moetrace.writer.process', *sys.argv[1:]], pass_fds=fds,\n"
    "                 stdin=subprocess.DEVNULL, start_new_session=True)\n"
)

if __name__ == "__main__":
    # the importable module's serve, not this __main__ copy's: pickled steps name moetrace.writer.process's classes
    from moetrace.writer.process import serve as serve_steps

    ring, metrics = (int(fd) if int(fd) >= 0 else None for fd in sys.argv[4:6])  # where the engine shares them
    serve_steps(os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb"),
                EngineRecord(mmap.mmap(int(sys.argv[3]), SHARED_BYTES)), ring, metrics)
