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


def record_like_the_fixture(out: Path, *extra: str) -> Path:
    """``moetrace record`` with the shared recording's workload (n-gram k=3, 8 built-in prompts, batch 4, top-16
    candidates) plus ``extra`` options; returns the trace directory."""
    done = run_cli(
        "record", "--k", str(K), "--max-tokens", "40", "--batch-size", "4", "--candidates", str(CANDIDATES),
        "--out", str(out), *extra,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (trace,) = [p for p in out.iterdir() if p.is_dir()]
    assert f"next: moetrace report {trace} --k {K}" in done.stdout
    return trace


def assert_same_routing_up_to_divergence(reference: Path, other: Path) -> None:
    """Every in-sequence row of ``reference`` up to each request's divergence has its twin in ``other`` with the
    same token; at least 99.9% have the same experts, and every other one is a near-tie."""
    from moetrace.compare import compare_runs

    result = compare_runs(reference, other)
    assert result["rows_compared"] == result["rows_in_a"] > 0 and result["tokens_equal"]
    assert result["decoded_rows_compared"] > 0, "decoded tokens are compared too"
    assert result["rows_identical"] / result["rows_compared"] >= 0.999
    assert result["rows_unexplained"] == 0


@pytest.fixture(scope="session")
def recorded_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A k=3 n-gram recording of the default model: 8 built-in prompts, batch 4, with top-16 candidates."""
    return record_like_the_fixture(tmp_path_factory.mktemp("traces"))
