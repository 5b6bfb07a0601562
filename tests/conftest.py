"""Test-wide setup: the tests' own helpers importable (``fixtures/trace_builder``, ``fixtures/vllm_fixtures``,
``oracles/decision_oracle``) and the development tools they test (``tools/vllm_contract``), and no writer process
left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# the helpers (trace builders, the engine fixtures, the decision oracle) importable from every folder of tests, and
# the development tools (not installed: run as scripts from the checkout)
sys.path[:0] = [str(HERE), str(HERE / "fixtures"), str(HERE / "oracles"), str(HERE.parent / "tools")]

# vllm_fixtures as a plugin: its session-scoped recording is one fixture for every module (a module importing the
# fixture would hold its own definition of it, and each such module would record it again)
pytest_plugins = ["pytester", "vllm_fixtures"]

# Under pytest-xdist (scripts/test.sh runs a worker per core) each worker runs its own vLLM engines: they must not
# all pin their OpenMP threads to the same core, as vLLM's automatic binding does.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER is not None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# Every process this test process starts (engines, servers, their writer processes) inherits this mark: the writers
# it left behind are told from those of another test run on the same machine, which they must never touch.
TEST_PROCESS = f"MOETRACE_TEST_PROCESS={os.getpid()}"
os.environ["MOETRACE_TEST_PROCESS"] = str(os.getpid())

WRITER_GRACE_SECONDS = 10.0  # a writer process whose engine side closed or went away ends on its own within this


def writer_processes() -> set[int]:
    """PIDs of the running ``python -P -m moetrace.writer.process`` processes (their short-lived launcher runs
    ``python -c``) started from this test process (they inherit its ``TEST_PROCESS`` mark): never those of another
    xdist worker or of another test run on the machine."""
    found = set()
    mine = TEST_PROCESS.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"-m\0moetrace.writer.process\0" in (entry / "cmdline").read_bytes() and (
                    mine in (entry / "environ").read_bytes().split(b"\0")):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture(autouse=True)
def no_writer_left_behind() -> Iterator[None]:
    """A test that starts writer processes leaves none behind, even when it fails: those still running at its end
    (after a grace for one closing its trace) are killed."""
    before = writer_processes()
    yield
    deadline = time.monotonic() + WRITER_GRACE_SECONDS
    while (left := writer_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def free_port() -> int:
    """A TCP port nothing listens on now (a server the test starts takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
