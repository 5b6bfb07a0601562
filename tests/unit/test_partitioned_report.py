"""`moetrace report` over an always-on recording's partitions (``trace.reader.open_partitions``): one trace whose
report equals that of the same rows recorded as one trace; bad partitions named."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from polars.testing import assert_frame_equal

from moetrace.analysis.placement import linear_placement
from moetrace.analysis.predicates import accepted_sequence
from moetrace.analysis.routing_summary import RoutingSummary, SummaryRequest, added_summaries, summarise_routing
from moetrace.cli import main
from moetrace.errors import UserError
from moetrace.trace.partitions import partitions
from moetrace.report.distributed import cache_root, partition_cache, partition_summary, prune_cache
from moetrace.trace.manifest import Manifest
from moetrace.trace.reader import Trace, open_traces
from trace_builder import Model, Tokens, default_token_ids, verify_tokens, write_trace
from vllm_fixtures import run_cli

MODEL = Model(num_experts=32, top_k=2)
HOUR_15, HOUR_16 = "date=2026-12-04/hour=15", "date=2026-12-04/hour=16"


def two_partitions(rng_seed: int = 0) -> tuple[Tokens, Tokens]:
    """4 requests, then 3 others (their prompts' token ids apart from the first's, as they are numbered on)."""
    rng = np.random.default_rng(rng_seed)
    first = verify_tokens(rng, MODEL, requests=4, steps=20, k=2, accept_prob=0.6, variable_drafts=True)
    second = verify_tokens(rng, MODEL, requests=3, steps=15, k=2, accept_prob=0.6, variable_drafts=True)
    return (replace(first, token=default_token_ids(first)),
            replace(second, token=default_token_ids(shifted(second, 0, 4))))


def shifted(tokens: Tokens, steps: int, requests: int) -> Tokens:
    return replace(tokens, step=tokens.step + steps, request=tokens.request + requests)


def joined(first: Tokens, second: Tokens) -> Tokens:
    """The two as one recording: the second's steps and requests numbered on after the first's."""
    later = shifted(second, int(first.step.max()) + 1, int(first.request.max()) + 1)
    return Tokens(**{name: (np.concatenate([getattr(first, name), getattr(later, name)])
                            if isinstance(getattr(first, name), np.ndarray) else
                            None if getattr(first, name) is None else getattr(first, name) + getattr(later, name))
                     for name in Tokens.__dataclass_fields__})


def write_partition(root: Path, tokens: Tokens, clock_from_step: int) -> Path:
    """A partition numbers its steps from 0 while the host's clock runs on: its step times start where the partition
    before it ended (the builder times step s at s ms)."""
    written = write_trace(root, tokens, MODEL, k=2)
    for file in (written / "steps").glob("*.parquet"):
        table = pq.read_table(file)
        for column in ("t_start_ns", "t_end_ns"):
            table = table.set_column(table.schema.get_field_index(column), column,
                                     pc.add(table[column], clock_from_step * 1_000_000))
        pq.write_table(table, file)
    return written


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Path, Path]:
    """An always-on recording of two hourly partitions, and the same rows written as one trace."""
    first, second = two_partitions()
    root = tmp_path / "always-on"
    write_partition(root / HOUR_15, first, 0)
    write_partition(root / HOUR_16, second, int(first.step.max()) + 1)
    return root, write_trace(tmp_path / "whole", joined(first, second), MODEL, k=2)


def report_json(path: Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["report", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload


def test_the_dashboard_of_an_always_on_root_is_written_beside_it_never_into_it(
        recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    held = sorted(path.relative_to(root) for path in root.rglob("*"))
    assert report_json(root)["dashboard"] == str(root.parent / "always-on.report.html")
    assert sorted(path.relative_to(root) for path in root.rglob("*")) == held


def test_a_report_over_partitions_equals_the_report_of_the_same_rows_as_one_trace(
        recorded: tuple[Path, Path]) -> None:
    root, whole = recorded
    over_partitions, as_one = report_json(root), report_json(whole)
    for key in ("growth", "acceptance_by_position", "acceptance_per_k", "step_reads", "budget"):
        assert over_partitions["runs"][0][key] == as_one["runs"][0][key], key
    assert [d["per_batch"] for d in over_partitions["decision"]] == [d["per_batch"] for d in as_one["decision"]]
    assert over_partitions["runs"][0]["growth"]  # not two empty reports


def test_the_open_partition_is_read_to_the_last_step_its_closed_routing_and_steps_files_both_hold(
        recorded: tuple[Path, Path]) -> None:
    """The partition being recorded: its routing files closed to step 12, its steps files to step 8 (they rotate
    apart), a file of each still open and its manifest not yet complete. Read whole, 4 routed request-steps would
    have no steps row and the report would have no recommendation."""
    root, _ = recorded
    live = root / HOUR_16
    for table, last_closed in (("routing", 12), ("steps", 8)):
        files = sorted((live / table).glob("*.parquet"))
        for file in files:
            rows = pq.read_table(file)
            pq.write_table(rows.filter(pc.less_equal(rows["step"], last_closed)), file)
        (live / table / f"part-{len(files):05d}.parquet.inprogress").write_bytes(b"PAR1")
    manifest = json.loads((live / "manifest.json").read_text())
    (live / "manifest.json").write_text(json.dumps({**manifest, "complete": False,
                                                    "start_time": "2026-12-04T16:00:00+0000"}))
    closed = json.loads((root / HOUR_15 / "manifest.json").read_text())
    (root / HOUR_15 / "manifest.json").write_text(json.dumps({**closed, "start_time": "2026-12-04T15:00:00+0000",
                                                              "end_time": "2026-12-04T16:00:00+0000"}))
    [trace] = open_traces(root)
    [said] = trace.warnings
    assert said == (f"{live}: partition still open (being recorded, or its recording was killed): read up to step 8, "
                    "where its closed routing (to step 12) and steps (to step 8) files both reach")
    first = two_partitions()[0]
    last_step = int(first.step.max()) + 1 + 8  # numbered on after the first partition's
    for table in (trace.routing(), trace.steps()):
        assert table.select(pl.col("step").max()).collect().item() == last_step
    reported = report_json(root)
    assert not [w for w in reported["warnings"] if "disagree" in w or "no recommendation" in w], reported["warnings"]
    assert any("partition still open" in w for w in reported["warnings"])
    # info says what the root holds: how many partitions, over what time, which one is open
    info = CliRunner().invoke(main, ["info", str(root), "--json"])
    [described] = json.loads(info.stdout)
    assert described["partitions"] == {"count": 2, "first_start": "2026-12-04T15:00:00+0000", "last_end": None,
                                       "open": [HOUR_16]}
    said = CliRunner().invoke(main, ["info", str(root)]).stdout
    assert f"partitions 2 (always on), from 2026-12-04T15:00:00+0000 to now, still open: {HOUR_16}" in said


def test_partitions_are_numbered_on_one_after_another(recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    [trace] = open_traces(root)
    first, second = two_partitions()
    steps = trace.steps().collect()
    # 4 requests over steps 0..20, then 3 over 21..36: 7 requests, 37 steps, none shared
    assert steps["request"].n_unique() == 7 and steps["step"].n_unique() == 37 and steps["step"].max() == 36
    assert trace.routing().collect().height == (len(first.step) + len(second.step)) * len(MODEL.layers)
    assert trace.warnings == []


def test_an_unreadable_partition_is_named_and_left_out(recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    (root / HOUR_16 / "manifest.json").write_text("{ truncated")
    [trace] = open_traces(root)
    assert trace.steps().collect()["request"].n_unique() == 4
    assert len(trace.warnings) == 1 and "hour=16" in trace.warnings[0] and "left out" in trace.warnings[0]


def test_a_partition_of_another_k_is_refused_naming_it(recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    manifest = json.loads((root / HOUR_16 / "manifest.json").read_text())
    manifest["spec"]["k"] = 3
    (root / HOUR_16 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"hour=16: not a partition of the recording .*spec\.k differs"):
        open_traces(root)


# --- per-partition summaries (analysis.routing_summary), their cache and --ray (report.distributed) ---

def summary_request(share: float) -> SummaryRequest:
    return SummaryRequest(MODEL.num_experts, tuple(range(6)), 2, linear_placement(MODEL.num_experts, 4), share,
                          ("experts", "weights"))


def whole_summary(trace: Trace, request: SummaryRequest) -> RoutingSummary:
    summary, _ = summarise_routing(trace.routing(), trace.steps(), request)
    return summary


def assert_same_summary(mine: RoutingSummary, expected: RoutingSummary) -> None:
    assert_frame_equal(mine.growth, expected.growth, check_row_order=False)
    assert_frame_equal(mine.proposals, expected.proposals, check_row_order=False)
    for name in ("rejected_only", "load", "gaps", "accepted", "stepped"):
        assert_frame_equal(getattr(mine, name), getattr(expected, name)), name


@pytest.mark.parametrize("share", [1.0, 0.4])
def test_partition_summaries_added_equal_the_summary_of_all_rows(recorded: tuple[Path, Path], share: float) -> None:
    root, _ = recorded
    [trace] = open_traces(root)
    request = summary_request(share)
    parts = [partition_summary(part, first_step, first_request, request, partition_cache(root, part.path))
             for part, first_step, first_request in trace.parts]
    expected = whole_summary(trace, request)
    assert expected.growth.height and expected.gaps["request_steps"].item() > 0
    if share < 1.0:  # some rows sampled out, some kept
        assert 0 < expected.accepted.height < accepted_sequence(trace.routing()).collect().height
    assert_same_summary(added_summaries([part.summary for part in parts]), expected)
    assert not any(part.cached for part in parts)


def test_a_partition_summary_is_cached_beside_the_root_and_serves_a_smaller_sample(
        recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    [trace] = open_traces(root)
    part, first_step, first_request = trace.parts[1]
    cache = partition_cache(root, part.path)
    fresh = partition_summary(part, first_step, first_request, summary_request(1.0), cache)
    again = partition_summary(part, first_step, first_request, summary_request(1.0), cache)
    assert again.cached and not fresh.cached
    assert_same_summary(again.summary, fresh.summary)
    # outside the root: the root holds its partitions' own files only
    assert cache == root.parent / f"{root.name}.report-cache" / HOUR_16 and not list(root.rglob("*.arrow"))
    thinned = partition_summary(part, first_step, first_request, summary_request(0.3), cache)
    assert thinned.cached
    assert_same_summary(thinned.summary, whole_summary(replace(part, parts=[(part, first_step, first_request)]),
                                                       summary_request(0.3)))
    # the cache holds the rows of its own numbering only: numbered from elsewhere, the partition is read again, and
    # its summary replaces the other (one per partition)
    assert not partition_summary(part, first_step + 1, first_request, summary_request(1.0), cache).cached
    assert len(list(cache.iterdir())) == 1


def test_a_rewritten_or_unfinished_partition_is_read_again(recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    [trace] = open_traces(root)
    part, first_step, first_request = trace.parts[0]
    cache = partition_cache(root, part.path)
    partition_summary(part, first_step, first_request, summary_request(1.0), cache)
    routing_file = part.routing_files[0]
    pq.write_table(pq.read_table(routing_file).slice(0, 40), routing_file)  # the same file, other rows
    assert not partition_summary(part, first_step, first_request, summary_request(1.0), cache).cached
    unfinished = replace(part, manifest=Manifest.from_document({**part.manifest.document, "complete": False}))
    shutil.rmtree(cache)
    partition_summary(unfinished, first_step, first_request, summary_request(1.0), cache)
    assert not cache.exists()


def test_the_summaries_of_partitions_the_cap_dropped_leave_the_cache(
        recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    [trace] = open_traces(root)
    for part, first_step, first_request in trace.parts:
        partition_summary(part, first_step, first_request, summary_request(1.0), partition_cache(root, part.path))
    shutil.rmtree(root / HOUR_15)  # dropped at the disk cap
    prune_cache(root, partitions(root))
    assert sorted(path.parent.parent.relative_to(cache_root(root)).as_posix()
                  for path in cache_root(root).glob("**/share.json")) == [HOUR_16]


@pytest.mark.parametrize("address, said", [("127.0.0.1:1", "no Ray cluster answers there"),
                                           ("somewhere", "give auto, local or HOST:PORT")])
def test_a_ray_address_that_does_not_answer_is_one_line_within_30_s(
        recorded: tuple[Path, Path], address: str, said: str) -> None:
    root, _ = recorded
    started = time.monotonic()
    result = CliRunner().invoke(main, ["report", str(root), "--ray", address])
    assert result.exit_code == 1 and time.monotonic() - started < 30
    assert result.output.count("\n") == 1 and said in result.output, result.output


def test_ray_is_refused_for_a_trace_that_is_not_partitioned(recorded: tuple[Path, Path]) -> None:
    _, whole = recorded
    result = CliRunner().invoke(main, ["report", str(whole), "--ray", "local"])
    assert result.exit_code == 1 and "not an always-on recording's partitions" in result.output, result.output


@pytest.mark.xdist_group("ray")
def test_report_on_a_local_ray_cluster_equals_the_one_machine_report(tmp_path: Path) -> None:
    """Three partitions summarised as Ray tasks on a new local cluster (this machine's 2 cores), as a user runs it:
    the whole report (decision, growth, acceptance, budgets, step reads) equals the one-machine report's; run
    again, every partition's summary comes from its cache and the report is the same."""
    rng = np.random.default_rng(3)
    root = tmp_path / "always-on"
    clock = 0
    for hour in (15, 16, 17):
        tokens = verify_tokens(rng, MODEL, requests=3, steps=18, k=2, accept_prob=0.6, variable_drafts=True)
        write_partition(root / f"date=2026-12-04/hour={hour}", tokens, clock)
        clock += int(tokens.step.max()) + 1
    one_machine = run_cli("report", str(root), "--json", "--batch", "1,4,8")
    assert one_machine.returncode == 0, one_machine.stderr
    expected = json.loads(one_machine.stdout)
    for attempt in ("computed", "cached"):
        on_ray = run_cli("report", str(root), "--json", "--batch", "1,4,8", "--ray", "local")
        assert on_ray.returncode == 0, on_ray.stderr
        assert json.loads(on_ray.stdout) == expected, attempt
        reused = 3 if attempt == "cached" else 0
        assert f"3 partitions summarised on Ray ({reused} from their cache)" in on_ray.stderr, on_ray.stderr
    assert expected["decision"] and expected["runs"][0]["growth"]
