"""`moetrace report --profile measured` by context: each context's k=0 step from the sweep's own steps there."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from statistics import mean
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import polars as pl
import pytest
from click.testing import CliRunner

from moetrace.cli import main
from moetrace.report.inputs import open_run
from moetrace.report.measured import (decoding_step_contexts, recorded_steps,
                                      with_k0_steps_of)
from trace_builder import Model, Tokens, decode_tokens, kept_tokens, verify_tokens, write_trace
from calibrations import small_calibration
from trace_edits import delay_after_prefill, with_phases

def long_from(tokens: Tokens, first: int, extra: int) -> Tokens:
    """``tokens`` whose steps from ``first`` on run ``extra`` tokens further into their requests."""
    return dataclasses.replace(tokens, position=tokens.position + (tokens.step >= first) * np.uint32(extra))


def slower_from(trace: Path, first: int, period_ms: float) -> None:
    """The trace's steps from ``first`` on start ``period_ms`` apart (1 ms before: the builder's)."""
    table = pq.read_table(trace / "steps")
    rows = table.to_pylist()
    for row in rows:
        start = min(row["step"], first) * 1e6 + max(row["step"] - first, 0) * period_ms * 1e6
        row["t_start_ns"], row["t_end_ns"] = int(start), int(start + 5e5)
    for part in (trace / "steps").iterdir():
        part.unlink()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), trace / "steps" / "part-00000.parquet")


def test_profile_measured_takes_a_contexts_k0_step_from_the_sweeps_own_steps_there(tmp_path: Path) -> None:
    """A sweep (k = 0 and 2, two requests a step, vLLM's calls timed, a slow prefill at k = 2) whose later steps run
    5,000 tokens further into their requests and 2 ms apart (1 ms before), the k=0 trace draining to one request at
    the end. With --profile measured, the k=0 step at --context 700 is the short steps' and at 5,500 the long ones'
    at two requests (brute force over the rows; one request, drained through, is not a concurrency the sweep ran
    at), moved from their own mean context; what grows with k (vLLM's calls, prefill) stays the whole sweep's; a
    context whose bucket the sweep never ran in is moved from the whole sweep, and the report says which is which."""
    model = Model(extra={"kv_bytes_per_token": 70_272})
    sweep = tmp_path / "sweep"
    decoded = long_from(decode_tokens(np.random.default_rng(0), model, requests=2, steps=100), 84, 5_000)
    drained = ~((decoded.request == 1) & (decoded.step >= 92))  # one request from step 92 on: 7 step pairs
    k0 = write_trace(sweep / "k0", kept_tokens(decoded, drained), model, k=0)
    k2 = write_trace(sweep / "k2", long_from(verify_tokens(np.random.default_rng(1), model, requests=2, steps=22,
                                                           k=2, accept_prob=0.7), 12, 5_000), model, k=2)
    slower_from(k0, 84, 2.0)
    slower_from(k2, 12, 2.0)
    delay_after_prefill(k2, 3.0)

    def timed(host: float) -> dict[str, Any]:
        return {"calls": 10, "host_ms_median": host, "device_ms_median": None}

    with_phases(k0, {"forward": {"2": timed(0.6)}, "sampling": {"2": timed(0.1)}})
    with_phases(k2, {"forward": {"2": timed(0.8)}, "sampling": {"2": timed(0.2)}, "drafting": {"2": timed(0.3)}})
    (tmp_path / "calib.json").write_text(json.dumps({**small_calibration(), "copy_bandwidth_gbs": 2_000.0}))

    # brute force over the k=0 trace: each step's requests, mean anchor position and start to the next's, at two
    # requests a step (the concurrency it ran at)
    routing = pq.read_table(k0 / "routing").to_pylist()
    anchors: dict[int, list[int]] = {}
    for row in routing:
        if row["layer"] == model.layers[0]:
            anchors.setdefault(row["step"], []).append(row["position"])
    starts = {row["step"]: row["t_start_ns"] / 1e6 for row in pq.read_table(k0 / "steps").to_pylist()}
    periods = {step: starts[step + 1] - starts[step] for step in starts
               if step + 1 in starts and len(anchors[step]) == len(anchors[step + 1]) == 2}
    by_bucket = {"≤1K": [s for s in starts if mean(anchors[s]) <= 1024 and len(anchors[s]) == 2],
                 "4-16K": [s for s in starts if 4096 < mean(anchors[s]) <= 16384 and len(anchors[s]) == 2]}
    assert len([s for s in starts if len(anchors[s]) == 1]) == 8  # drained through: 7 pairs at one request

    # what the report takes: the k=0 rows' periods from the bucket, every other figure the whole trace's
    run = open_run(sweep, 2)
    whole = recorded_steps(run)
    long_steps = decoding_step_contexts(run.traces[0]).filter(pl.col("bucket") == 2)
    in_bucket = with_k0_steps_of(whole, run.traces[0], long_steps)
    assert in_bucket.filter(pl.col("k") == 2).equals(whole.filter(pl.col("k") == 2))
    k0_long, k0_whole = (next(row for row in table.filter(pl.col("k") == 0).to_dicts() if row["batch"] == 2)
                         for table in (in_bucket, whole))
    assert k0_long["period_ms"] == pytest.approx(mean(periods[s] for s in by_bucket["4-16K"] if s in periods))
    assert k0_long["decode_steps"] == sum(s in periods for s in by_bucket["4-16K"])
    assert {key: k0_long[key] for key in ("prefill_ms_per_token", "forward_ms", "sampling_ms")} == {
        key: k0_whole[key] for key in ("prefill_ms_per_token", "forward_ms", "sampling_ms")}

    def report(*args: str) -> Any:
        return CliRunner().invoke(main, [
            "report", str(sweep), "--k", "2", "--tp", "2", "--force", "--batch", "2", "--calibration",
            str(tmp_path / "calib.json"), "--profile", "measured", "--context", "700,5500,20000", *args],
            catch_exceptions=False)

    result = report("--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)["decision"][0]["by_context"]
    steps_at = {entry["context"]: entry for entry in found["from_steps"]}
    rows = {row["context"]: row for row in found["per_batch"]}
    for context, label in ((700, "≤1K"), (5500, "4-16K")):
        pairs = [s for s in by_bucket[label] if s in periods]
        assert (steps_at[context]["measured"], steps_at[context]["bucket"], steps_at[context]["step_pairs"]) == (
            True, label, len(pairs))
        origin = mean(mean(anchors[s]) for s in by_bucket[label])
        assert steps_at[context]["mean_tokens"] == pytest.approx(origin)
        assert steps_at[context]["mean_tokens_by_batch"] == {"2": pytest.approx(origin)}  # one request: drained
        assert rows[context]["attention_kv_ms"] == pytest.approx(2 * (context - origin) * 70_272 / (2_000.0 * 1e6))
        assert rows[context]["k0_step_ms"] - rows[context]["attention_kv_ms"] == pytest.approx(
            mean(periods[s] for s in pairs))
    # 16-64K: nothing ran there; the whole k=0 trace's step, moved
    assert not steps_at[20000]["measured"] and steps_at[20000]["why"].startswith("at 16-64K tokens: ")
    assert "no run of 5+ decode steps" in steps_at[20000]["why"] and steps_at[20000]["mean_tokens"] is None
    # acceptance and prefill stay the whole sweep's at every context, and the report says so with their mean context
    assert (f"acceptance and prefill as recorded, at a mean {found['recorded_context']:,.0f} tokens"
            in found["attention_basis"])
    assert rows[20000]["k0_step_ms"] - rows[20000]["attention_kv_ms"] == pytest.approx(mean(periods.values()))
    assert {row["speedup_source"] for row in rows.values()} <= {"estimated", "extrapolated", None}
    # what a k > 0 step adds to k=0's is the whole sweep's at every context (the KV read adds alike to every k)
    assert len({row["best_k"] for row in rows.values()}) == 1
    added = [(row["step_ratio"] - 1) * row["k0_step_ms"] for row in rows.values()]
    assert added == pytest.approx([added[0]] * 3) and added[0] > 0
    # the terminal and the dashboard say which contexts rest on the sweep's own steps
    says = [entry["says"] for entry in found["from_steps"]]
    assert says[1].startswith(f"at 5,500 tokens: the k=0 step from the sweep's own {steps_at[5500]['step_pairs']} k=0 "
                              "step pairs at 4-16K tokens")
    shown = report()
    # (rich wraps a long path wherever it must: compared without whitespace)
    assert shown.exit_code == 0 and all("".join(line.split()) in "".join(shown.output.split()) for line in says)
    page = (sweep / "report.html").read_text()
    assert all(line.replace("'", "&#39;") in page for line in says)


def test_profile_measured_predicts_a_concurrency_whose_forward_growth_no_trace_timed(tmp_path: Path) -> None:
    """The k=0 trace ran at two requests a step and then at one (9 step pairs, a tenth of its 39 at two: a
    concurrency it ran at); vLLM's calls were timed at two requests only. One request's prediction has no measured
    growth beyond the calibrated MoE: it is predicted without it, beside two requests' with it."""
    model = Model()
    decoded = decode_tokens(np.random.default_rng(0), model, requests=2, steps=50)
    kept = ~((decoded.request == 1) & (decoded.step >= 40))
    k0 = write_trace(tmp_path / "sweep" / "k0", kept_tokens(decoded, kept), model, k=0)
    k2 = write_trace(tmp_path / "sweep" / "k2", verify_tokens(np.random.default_rng(1), model, requests=2, steps=20,
                                                              k=2, accept_prob=0.7), model, k=2)
    with_phases(k0, {"forward": {"2": {"calls": 10, "host_ms_median": 0.6, "device_ms_median": None}}})
    with_phases(k2, {"forward": {"2": {"calls": 10, "host_ms_median": 0.8, "device_ms_median": None}}})
    (tmp_path / "calib.json").write_text(json.dumps(small_calibration()))
    result = CliRunner().invoke(main, ["report", str(tmp_path / "sweep"), "--k", "2", "--tp", "2", "--force", "--json",
                                       "--calibration", str(tmp_path / "calib.json"), "--profile", "measured",
                                       "--batch", "1,2"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["runs"][0]["prediction"]["per_batch"]
    beyond = {row["batch"]: row["forward_beyond_moe_ms"] for row in rows if row["k"] == 2}
    assert beyond[1] is None and beyond[2] is not None and {r["step_source"] for r in rows} == {"measured"}


def test_a_measured_contexts_concurrencies_move_each_from_its_own_steps_context(tmp_path: Path) -> None:
    """Every step of the sweep ran at 4-16K tokens: the k=0 trace's first 30 at two requests about 5,000 tokens in,
    its last 30 at one request about 9,000 in (both concurrencies it ran at). At --context 6000 each concurrency's
    k=0 step moves from its own steps' mean context (brute force over the rows), one request's down."""
    model = Model(extra={"kv_bytes_per_token": 70_272})
    decoded = long_from(long_from(decode_tokens(np.random.default_rng(0), model, requests=2, steps=60), 0, 5_000),
                        30, 4_000)
    kept = ~((decoded.request == 1) & (decoded.step >= 30))
    write_trace(tmp_path / "sweep" / "k0", kept_tokens(decoded, kept), model, k=0)
    write_trace(tmp_path / "sweep" / "k2", long_from(verify_tokens(np.random.default_rng(1), model, requests=2,
                                                                   steps=20, k=2, accept_prob=0.7), 0, 5_000),
                model, k=2)
    (tmp_path / "calib.json").write_text(json.dumps({**small_calibration(), "copy_bandwidth_gbs": 2_000.0}))
    result = CliRunner().invoke(main, ["report", str(tmp_path / "sweep"), "--k", "2", "--tp", "2", "--force",
                                       "--json", "--calibration", str(tmp_path / "calib.json"), "--profile",
                                       "measured", "--batch", "1,2", "--context", "6000"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)["decision"][0]["by_context"]
    anchors: dict[int, list[int]] = {}
    for row in pq.read_table(tmp_path / "sweep" / "k0" / "routing").to_pylist():
        if row["layer"] == model.layers[0]:
            anchors.setdefault(row["step"], []).append(row["position"])
    origin = {batch: mean(mean(a) for a in anchors.values() if len(a) == batch) for batch in (1, 2)}
    assert origin[1] > 8_000 and 5_000 < origin[2] < 6_000
    (steps_at,) = found["from_steps"]
    assert steps_at["measured"] and steps_at["mean_tokens_by_batch"] == {
        str(batch): pytest.approx(tokens) for batch, tokens in origin.items()}
    rows = {row["batch"]: row for row in found["per_batch"]}
    for batch in (1, 2):
        assert rows[batch]["attention_kv_ms"] == pytest.approx(
            batch * (6000 - origin[batch]) * 70_272 / (2_000.0 * 1e6))
    assert rows[1]["attention_kv_ms"] < 0 < rows[2]["attention_kv_ms"]
