"""A data-parallel recording (a trace per rank, or a root of partitions per rank) read as one trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from moetrace.errors import UserError
from moetrace.trace.reader import open_trace, open_traces

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
    # the same request index on two ranks is two requests; a rank's step holds its own requests
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
