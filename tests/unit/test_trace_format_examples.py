"""docs/trace-format.md's examples run as written (its trace path pointed at a builder trace): the Polars one through
moetrace's public API, the DuckDB one on the Parquet files alone, and they agree with each other."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from trace_builder import small_k2_trace

DOC = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"
DOC_TRACE = "traces/kimi-k2-tiny-ngram-k0-1-2-3-4/k2"


def example(language: str) -> str:
    (block,) = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)
    assert DOC_TRACE in block
    return block


def test_the_polars_example_runs_on_a_trace_through_the_public_api(tmp_path: Path) -> None:
    trace = small_k2_trace(tmp_path / "run" / "k2")
    names: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(example("python").replace(DOC_TRACE, str(trace)), str(DOC), "exec"), names)
    # what it computed, against a plain scan of the files
    routing = pl.read_parquet(trace / "routing" / "*.parquet")
    verify = routing.filter(pl.col("phase") == "verify")
    assert sorted(names["per_layer"].rows()) == sorted(verify.group_by("layer").len().rows())
    assert names["acceptance"]["draft_pos"].to_list() == [1, 2]
    served = routing.filter(pl.col("phase") != "prefill").explode("experts")
    most = served.group_by("layer", "experts").len()["len"].max()
    assert names["busiest"]["picks"][0] == most
    assert {"k", "layer", "unique_experts"} <= set(names["growth"].columns)


def test_the_duckdb_example_counts_what_polars_counts(tmp_path: Path) -> None:
    trace = small_k2_trace(tmp_path / "run" / "k2")
    got = duckdb.sql(example("sql").replace(DOC_TRACE, str(trace))).fetchall()
    verify = pl.read_parquet(trace / "routing" / "*.parquet").filter(pl.col("phase") == "verify")
    want = (verify.group_by("layer").agg(experts_used=pl.col("experts").explode().n_unique(), rows=pl.len())
            .sort("layer").rows())
    assert [tuple(row) for row in got] == [tuple(row) for row in want] and got


def test_every_public_analysis_resolves_from_moetrace_analysis() -> None:
    import moetrace.analysis as analysis

    assert sorted(analysis.__all__) == sorted(analysis.PUBLIC)
    assert all(callable(getattr(analysis, name)) for name in analysis.__all__)
