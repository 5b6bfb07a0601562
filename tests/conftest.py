"""Test-wide setup: the tests' own helpers importable (``trace_builder``), and no writer process left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["pytester"]

WRITER_GRACE_SECONDS = 10.0  # a writer process whose engine side closed or went away ends on its own within this


def writer_processes() -> set[int]:
    """PIDs of the running ``python -m moetrace.writer`` processes (their short-lived launcher runs ``python -c``)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"moetrace.writer"]:
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
