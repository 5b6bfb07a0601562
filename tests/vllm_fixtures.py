"""One real recording of the embedded default model, made once per test session and shared by the vLLM tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

K = 3
CANDIDATES = 16


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``moetrace ARGS`` as a user runs it: a separate process."""
    return subprocess.run(
        [sys.executable, "-m", "moetrace", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def recorded_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A k=3 n-gram recording of the default model: 8 built-in prompts, batch 4, with top-16 candidates."""
    out = tmp_path_factory.mktemp("traces")
    done = run_cli(
        "record", "--k", str(K), "--max-tokens", "40", "--batch-size", "4", "--candidates", str(CANDIDATES),
        "--out", str(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (trace,) = [p for p in out.iterdir() if p.is_dir()]
    assert f"next: moetrace report {trace} --k {K}" in done.stdout
    return trace
