"""The trace writer and reader on their own: rotation, crash safety, failures that never reach the engine."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from moetrace.analysis.consistency import disagreement, routing_gaps

from moetrace.errors import UserError
from moetrace.trace.reader import open_trace, open_traces
from moetrace.trace.schema import FOOTER_SCHEMA_KEY, SCHEMA_VERSION
import moetrace.writer.process
from moetrace.trace.manifest import amend_manifest, start_manifest
from moetrace.writer.process import TraceWriter
from writer_steps import LAYERS, TOP_K, manifest, submit_and_wait, verify_step


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


def test_a_writer_on_a_directory_holding_a_trace_refuses_before_touching_it(tmp_path: Path) -> None:
    """`vllm serve` restarted with the same MOETRACE_RECORD: the second recording would write its manifest and its
    part-00000 files over the first's."""
    writer = TraceWriter(tmp_path, manifest(), LAYERS, TOP_K)
    submit_and_wait(writer, verify_step(0, np.random.default_rng(0)))
    writer.close()
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    with pytest.raises(FileExistsError, match="already holds a trace"):
        TraceWriter(tmp_path, manifest(), LAYERS, TOP_K)
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    assert open_trace(tmp_path).manifest.complete


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
