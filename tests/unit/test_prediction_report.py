"""`moetrace report --profile/--calibration/--profile measured`: the cost model's prediction as the report gives it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import polars as pl
import pytest
from click.testing import CliRunner

from moetrace.analysis.calibration import drafter_step_ms
from moetrace.cli import main
from moetrace.report.inputs import open_run
from moetrace.trace.reader import open_trace
from moetrace.report.measured import (measured_baselines, recorded_phases)
from trace_builder import Model, decode_tokens, small_k2_trace, verify_tokens, write_trace
from calibrations import DRAFTER, small_calibration
from trace_edits import delay_after_prefill, with_phases

@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return small_k2_trace(tmp_path / "t-k2")


def test_report_predicts_with_profile_and_calibration(trace: Path, tmp_path: Path) -> None:
    calibration = tmp_path / "calib.json"
    calibration.write_text(json.dumps(small_calibration()))
    result = CliRunner().invoke(main, ["report", str(trace), "--k", "2", "--tp", "2", "--json", "--force",
                                       "--profile", "step=10ms,allreduce=50%,moe=10%,attention=20%,other=10%",
                                       "--calibration", str(calibration)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    prediction = json.loads(result.stdout)["runs"][0]["prediction"]
    assert prediction["basis"]["mode"] == "profile anchored, calibrated growth"
    assert prediction["at_k"]["k"] == 2 and prediction["per_k"][0]["step_ms"] == pytest.approx(10.0)
    # k=2 recorded: measured; k=1 from the k=2 trace's first position: estimated; k=0 gains one token by definition
    assert [row["acceptance_source"] for row in prediction["per_k"][:3]] == ["measured", "estimated", "measured"]
    page = (trace / "report.html").read_text()
    assert "fig-prediction" in page
    terminal = CliRunner().invoke(main, ["report", str(trace), "--force", "--tp", "8", "--routing", "uniform",
                                         "--acceptance", "0.7", "--calibration", str(calibration)],
                                  catch_exceptions=False)
    assert terminal.exit_code == 1 and "no expert curve for tp8" in terminal.output


def test_report_prices_an_eagle3_trace_drafter_from_the_calibrations_curve(trace: Path, tmp_path: Path) -> None:
    manifest = json.loads((trace / "manifest.json").read_text())
    manifest["spec"]["method"] = "eagle3"
    (trace / "manifest.json").write_text(json.dumps(manifest))
    args = ["report", str(trace), "--tp", "2", "--json", "--force", "--batch", "1,4"]

    def prediction(calibration: dict[str, Any]) -> dict[str, Any]:
        path = tmp_path / "calib.json"
        path.write_text(json.dumps(calibration))
        result = CliRunner().invoke(main, [*args, "--calibration", str(path)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        found: dict[str, Any] = json.loads(result.stdout)["runs"][0]["prediction"]
        return found

    priced = prediction({**small_calibration(), "drafter": DRAFTER})
    drafting = {(row["batch"], row["k"]): row["drafting_ms"] for row in priced["per_batch"]}
    assert drafting[(1, 2)] == pytest.approx(drafter_step_ms(DRAFTER, 2, 1))
    # 4 requests: fc and layers over 12 verified tokens (4 + 8·1, 16 + 8·2 µs), the head on 4, then one pass of 4
    assert drafting[(4, 2)] == pytest.approx((12 + 32 + 5 + 16 + 5) / 1e3)
    assert not any("not priced" in note for note in priced["basis"]["notes"])
    unpriced = prediction(small_calibration())
    assert any("eagle3 drafter's passes are not priced (the calibration has no drafter curve" in note
               for note in unpriced["basis"]["notes"])
    other = prediction({**small_calibration(), "drafter": {**DRAFTER, "method": "draft_model"}})
    assert any("drafter curve is of draft_model" in note for note in other["basis"]["notes"])


def test_report_prediction_bad_input(trace: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "other"}')
    for args, fragment in ((["--calibration", str(bad)], "not a moetrace calibration"),
                           (["--calibration", str(tmp_path / "missing.json")], "cannot read calibration"),
                           (["--profile", "step=1ms"], "--profile"),
                           (["--profile", "kimi-k2-tp8", "--acceptance", "1.5"], "--acceptance")):
        result = CliRunner().invoke(main, ["report", str(trace), "--force", *args], catch_exceptions=False)
        assert result.exit_code == 1 and fragment in result.output and "Traceback" not in result.output
    ok = CliRunner().invoke(main, ["report", str(trace), "--force", "--profile", "kimi-k2-tp8", "--routing",
                                   "uniform", "--acceptance", "0.7"], catch_exceptions=False)
    assert ok.exit_code == 0 and "Predicted verify step" in ok.output


def stretch_steps(trace: Path, factor: float) -> None:
    """Space the trace's recorded steps ``factor`` times as far apart."""
    for part in (trace / "steps").glob("*.parquet"):
        table = pq.read_table(part)
        for name in ("t_start_ns", "t_end_ns"):
            stretched = pa.array([int(v * factor) for v in table[name].to_pylist()], pa.int64())
            table = table.set_column(table.schema.get_field_index(name), name, stretched)
        pq.write_table(table, part)


def prefill_per_token(trace: Path, batch: int) -> float:
    """Brute force over the steps table: what the steps that held a prefill chunk, and the step right after each,
    ran (start to the next step's start) beyond the mean decode step of the requests they serve (consecutive
    decoding steps of that many requests, start to start, neither right after a prefill), over the whole trace, per
    token gained in it, times ``batch``. Every step of these traces serves the concurrency it runs at."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in pq.read_table(trace / "steps").to_pylist():
        by_step.setdefault(row["step"], []).append(row)
    order = sorted(by_step)
    start = {s: by_step[s][0]["t_start_ns"] / 1e6 for s in order}
    prefill = {s: any(r["num_tokens"] != r["num_drafts"] + 1 for r in by_step[s]) for s in order}
    after = {s: not prefill[s] and prefill.get(s - 1, False) for s in order}
    timed = [s for s in order if s + 1 in by_step]
    decode: dict[int, list[float]] = {}
    for s in timed:
        if not prefill[s] and not after[s] and not prefill[s + 1] and len(by_step[s + 1]) == len(by_step[s]):
            decode.setdefault(len(by_step[s]), []).append(start[s + 1] - start[s])
    excess = sum(start[s + 1] - start[s] - sum(decode[len(by_step[s])]) / len(decode[len(by_step[s])])
                 for s in timed if prefill[s] or after[s])
    gained = sum(r["num_accepted"] + 1 for s in order for r in by_step[s])
    return max(excess, 0.0) * batch / gained




def with_workload(trace: Path, workload: dict[str, Any]) -> None:
    manifest = json.loads((trace / "manifest.json").read_text())
    manifest["workload"] = workload
    (trace / "manifest.json").write_text(json.dumps(manifest))


def test_a_round_draining_through_a_few_steps_of_a_concurrency_is_not_a_concurrency_the_sweep_ran_at(
        tmp_path: Path) -> None:
    model = Model()
    write_trace(tmp_path / "sweep" / "k0", decode_tokens(np.random.default_rng(0), model, requests=2, steps=12),
                model, k=0)
    # decode step pairs per concurrency, as a closed loop at 1 and 16 leaves them: 39 at 5 is under a tenth of 400
    steps = pl.DataFrame({"k": [0, 0, 0, 0], "batch": [1, 5, 14, 16], "decode_steps": [400, 39, 40, 120],
                          "period_ms": [2.0, 4.0, 5.5, 6.0]})
    assert measured_baselines(open_run(tmp_path / "sweep", 0), steps) == {1: 2.0, 14: 5.5, 16: 6.0}


def test_a_model_drafter_under_async_scheduling_costs_its_device_time(tmp_path: Path) -> None:
    model = Model()
    timing = {"drafting": {"4": {"calls": 10, "host_ms_median": 1.4, "device_ms_median": 0.35}},
              "sampling": {"4": {"calls": 10, "host_ms_median": 0.3, "device_ms_median": 0.05}}}
    costs = {}
    for scheduling in (True, False):
        trace = write_trace(tmp_path / f"async-{scheduling}", verify_tokens(
            np.random.default_rng(1), model, requests=2, steps=6, k=2, accept_prob=0.5), model, k=2)
        with_phases(trace, timing)
        manifest = json.loads((trace / "manifest.json").read_text())
        manifest["capture"] = {**manifest.get("capture", {}), "async_scheduling": scheduling}
        (trace / "manifest.json").write_text(json.dumps(manifest))
        costs[scheduling] = recorded_phases([open_trace(trace)]).to_dicts()[0]
    # under async scheduling the drafter's host work overlaps the device: its 0.35 ms device median, not 1.4;
    # with async scheduling off, and for every other call, the longer of the two
    assert costs[True]["drafting_ms"] == 0.35 and costs[False]["drafting_ms"] == 1.4
    assert costs[True]["sampling_ms"] == costs[False]["sampling_ms"] == 0.3


def test_report_predicts_from_the_sweeps_own_k0_steps(tmp_path: Path) -> None:
    model = Model()
    write_trace(tmp_path / "sweep" / "k0", decode_tokens(np.random.default_rng(0), model, requests=2, steps=12),
                model, k=0)
    k2 = write_trace(tmp_path / "sweep" / "k2", verify_tokens(np.random.default_rng(1), model, requests=2, steps=10,
                                                              k=2, accept_prob=0.7), model, k=2)

    delay_after_prefill(k2, 3.0)  # a prefill step at k=2 takes 3 ms more than a decode step

    def timed(host: float, device: float | None) -> dict[str, Any]:
        return {"calls": 10, "host_ms_median": host, "device_ms_median": device}

    # what the recorder timed per batch size: a step costs the longer of its host and device time
    with_phases(tmp_path / "sweep" / "k0", {"forward": {"2": timed(0.6, 0.7)}, "sampling": {"2": timed(0.1, None)}})
    with_phases(k2, {"forward": {"2": timed(0.8, 0.75)}, "sampling": {"2": timed(0.2, 0.15)},
                     "drafting": {"1": timed(9.0, None), "2": timed(0.25, None)}})
    calibration = tmp_path / "calib.json"
    calibration.write_text(json.dumps(small_calibration()))

    def report(*args: str) -> Any:
        return CliRunner().invoke(main, ["report", str(tmp_path / "sweep"), "--k", "2", "--tp", "2", "--force",
                                         *args], catch_exceptions=False)

    result = report("--calibration", str(calibration), "--profile", "measured", "--batch", "1,2", "--json")
    assert result.exit_code == 0, result.output
    prediction = json.loads(result.stdout)["runs"][0]["prediction"]
    assert prediction["basis"]["mode"] == "measured k=0 step, calibrated growth"
    every_batch = prediction["per_batch"]
    rows = [row for row in every_batch if row["batch"] == 2]  # the builder's k=0 trace decodes 2 requests a step
    assert {row["step_source"] for row in rows} == {"measured"}
    assert next(row["step_ms"] for row in rows if row["k"] == 0) == pytest.approx(1.0)  # 1 ms apart
    # one request per step was never recorded: estimated from the one concurrency that was (held: 1 ms less the
    # MoE and all-reduce calibrated at two requests' unions, plus those at one request's)
    one = [row for row in every_batch if row["batch"] == 1]
    assert {row["step_source"] for row in one} == {"estimated"} and len(one) == len(rows)
    k0_two, k0_one = rows[0], one[0]
    assert k0_one["step_ms"] == pytest.approx(1.0 - k0_two["moe_ms"] - k0_two["allreduce_ms"] + k0_one["moe_ms"]
                                              + k0_one["allreduce_ms"])
    decision = json.loads(result.stdout)["decision"][0]["per_batch"]
    assert [row["batch"] for row in decision] == [1, 2]
    # at two requests the best k is the recorded k=2: its unions and steps measured; at one request the step is
    # estimated (the builder's 20 request-steps are too few to recommend, so k is null and the rows say so)
    assert [(row["best_k"], row["speedup_source"]) for row in decision] == [(2, "estimated"), (2, "measured")]
    # the crossover: predicted over --batch, measured over what the sweep recorded (two requests per step)
    crossovers = json.loads(result.stdout)["decision"][0]["crossover"]
    assert crossovers["predicted"]["looked_at"] == [1, 2] and crossovers["measured"]["looked_at"] == [2]
    assert crossovers["measured"]["best"][0]["speedup"] == pytest.approx(prediction["against_trace"][0][
        "measured_speedup"])
    # the drafter's 0.25 ms per step, measured at k=2 with 2 requests a step, held for every k of an n-gram drafter
    assert {row["drafting_ms"] for row in rows if row["k"] > 0} == {0.25}
    # sampling took 0.2 ms a step at k=2 (the longer of host and device), 0.1 at k=0: 0.1 more, held for every k
    assert [row["sampling_ms"] for row in rows if row["k"] > 0] == pytest.approx([0.1] * 8)
    # beside the recorded k=2 steps (the builder starts a step every 1 ms at every k, each 0.5 ms long): the speedup
    # they measured is per token, 1 ms over tokens per step, plus each trace's prefill steps' time beyond a decode
    # step per token a request gained; what the prediction leaves out is 1 ms minus its predicted step
    (checked,) = prediction["against_trace"]
    assert (checked["batch"], checked["k"]) == (2, 2)
    p0, p2 = prefill_per_token(tmp_path / "sweep" / "k0", 2), prefill_per_token(k2, 2)
    assert p0 == 0.0 and p2 > 0.05  # the k=0 builder writes no prefill step, the k=2 one with 3 ms more
    assert checked["measured_speedup"] == pytest.approx((1.0 + p0) / (1.0 / checked["measured_tokens_per_step"] + p2))
    # the prediction at a recorded k takes that k's prefill steps; a k not recorded the nearest recorded k > 0's
    assert [row["prefill_ms_per_token"] for row in rows] == pytest.approx([p0] + [p2] * 8)
    predicted_k2 = next(row["step_ms"] for row in rows if row["k"] == 2)
    assert checked["unexplained_ms"] == pytest.approx(1.0 - predicted_k2)
    # where the recorded step grew against k=0: not at all (1 ms apart at both), of which forward 0.8 - 0.7,
    # sampling 0.2 - 0.1, and the drafter's 0.25
    assert checked["step_growth_ms"] == pytest.approx(0.0)
    assert (checked["forward_growth_ms"], checked["sampling_growth_ms"]) == (pytest.approx(0.1), pytest.approx(0.1))
    assert checked["drafting_ms"] == 0.25
    terminal = report("--calibration", str(calibration), "--profile", "measured", "--batch", "2")
    assert "Predicted against measured on the machine that recorded" in terminal.output
    # the per-k table is for one request
    assert [row["k"] for row in prediction["per_k"]][:3] == [0, 1, 2]
    assert "Predicted verify step at one request per step" in terminal.output and "draft" in terminal.output
    page = (tmp_path / "sweep" / "report.html").read_text()
    assert 'class="against-trace"' in page and f"{checked['unexplained_ms']:.2f}" in page
    failed = report("--profile", "measured")
    assert failed.exit_code == 1 and "give --calibration too" in failed.output and "Traceback" not in failed.output
    # a concurrency above the engines' slots gets a row that says why there is no recommendation
    for trace in (tmp_path / "sweep" / "k0", k2):
        with_workload(trace, {"batch_size": 4})
    above = json.loads(report("--calibration", str(calibration), "--profile", "measured", "--batch", "3,7",
                              "--json").stdout)
    three, seven = above["decision"][0]["per_batch"]
    assert three["batch"] == 3 and three["status"].startswith("too few windows") and three["best_k"] is not None
    assert seven["k"] is None and "ran at most 4 requests at once (max_num_seqs)" in seven["status"]
    assert any("no recommendation at 7 request(s)" in line for line in above["warnings"])
    terminal_above = report("--calibration", str(calibration), "--profile", "measured", "--batch", "3,7").output
    assert "B=7: no recommendation: the sweep's engines ran at most 4" in " ".join(terminal_above.split())
    for trace in (tmp_path / "sweep" / "k0", k2):
        with_workload(trace, {})
    # a k=0 trace recorded with async scheduling off, its steps 1.5 ms apart against the sweep's 1 ms: every step
    # that drafts pays 0.5 ms more
    sync = write_trace(tmp_path / "sync", decode_tokens(np.random.default_rng(0), model, requests=2, steps=12), model,
                       k=0)
    stretch_steps(sync, 1.5)
    # its forward took 0.75 ms (async off, the step's input preparation no longer overlaps the device): the k=2
    # forward (0.8) grew 0.05 over it, not the 0.1 it grew over the async k=0 step, whose price is the 0.5 ms
    with_phases(sync, {"forward": {"2": timed(0.6, 0.75)}, "sampling": {"2": timed(0.1, None)}})
    synced = report("--calibration", str(calibration), "--profile", "measured", "--batch", "2", "--k0-sync",
                    str(sync), "--json")
    assert synced.exit_code == 0, synced.output
    rows_sync = [row for row in json.loads(synced.stdout)["runs"][0]["prediction"]["per_batch"] if row["batch"] == 2]
    assert [row["scheduling_ms"] for row in rows_sync[:3]] == [0.0, pytest.approx(0.5), pytest.approx(0.5)]
    assert rows_sync[2]["step_ms"] == pytest.approx(predicted_k2 + 0.5 - 0.05)
    widest = report("--calibration", str(calibration), "--profile", "measured", "--batch", "2", "--k0-sync",
                    str(sync)).stdout
    assert "sched" in widest and "rej" in widest
    # every table, the measured-mode ones with a dozen columns included, fits an 80-column terminal unfolded (the
    # next command after them is printed whole, to be copied)
    *tables, next_command = widest.splitlines()
    assert max(len(line) for line in tables) <= 80 and next_command.startswith("next: moetrace report ")
    assert f"{predicted_k2 + 0.5 - 0.05:.2f}" in widest
    with_async = json.loads((sync / "manifest.json").read_text())
    with_async["capture"] = {"async_scheduling": True}
    (tmp_path / "async").mkdir()
    shutil.copytree(sync / "steps", tmp_path / "async" / "steps")
    shutil.copytree(sync / "routing", tmp_path / "async" / "routing")
    (tmp_path / "async" / "manifest.json").write_text(json.dumps(with_async))
    for args, fragment in ((["--k0-sync", str(sync)], "--k0-sync goes with --profile measured"),
                           (["--profile", "measured", "--k0-sync", str(k2)], "needs one trace recorded at k=0"),
                           (["--profile", "measured", "--k0-sync", str(tmp_path / "async")], "async scheduling on"),
                           (["--profile", "measured", "--k0-sync", str(tmp_path / "none")], "no such trace")):
        failed = report("--calibration", str(calibration), "--batch", "2", *args)
        assert failed.exit_code == 1 and fragment in failed.output and "Traceback" not in failed.output, failed.output
    k0_manifest = tmp_path / "sweep" / "k0" / "manifest.json"
    as_recorded = k0_manifest.read_text()
    k0_manifest.write_text(json.dumps({**json.loads(as_recorded), "capture": {"async_scheduling": False}}))
    redundant = report("--calibration", str(calibration), "--profile", "measured", "--batch", "2", "--k0-sync",
                       str(sync))
    assert redundant.exit_code == 1 and "no --k0-sync needed" in redundant.output
    k0_manifest.write_text(as_recorded)
    no_k0 = CliRunner().invoke(main, ["report", str(tmp_path / "sweep" / "k2"), "--k", "2", "--tp", "2", "--force",
                                      "--calibration", str(calibration), "--profile", "measured"])
    assert no_k0.exit_code == 1 and "needs a k=0 trace" in no_k0.output
    # a phase timed in fewer than 3 calls is not measured (one call can be a new input shape compiling): the
    # forward's growth then stays out
    with_phases(k2, {"forward": {"2": {**timed(0.8, 0.75), "calls": 2}}, "sampling": {"2": timed(0.2, 0.15)}})
    few = [row for row in json.loads(report("--calibration", str(calibration), "--profile", "measured", "--batch", "2",
                                            "--json").stdout)["runs"][0]["prediction"]["per_batch"]
           if row["batch"] == 2]
    assert [row["forward_beyond_moe_ms"] for row in few] == [None] * len(few)
