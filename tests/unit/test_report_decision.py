"""`moetrace report`'s decision end to end on well-sampled built sweeps: the self-check, what each recommendation rests
on, a damaged trace, the record folder as input, the decision per context length, and the mark on a k no larger k
was compared against."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner, Result

from cli_results import invoke, one_line_error
from moetrace.cli import main
from trace_builder import small_k2_trace, well_sampled_sweep


def _with_kv_bytes(sweep: Path, per_token: int) -> Path:
    """``sweep`` with each manifest saying a token holds ``per_token`` KV-cache bytes (and Kimi-K2's 262,144
    positions): what --context prices a step's attention by."""
    for manifest in sweep.glob("*/manifest.json"):
        document = json.loads(manifest.read_text())
        document["model"].update(kv_bytes_per_token=per_token, max_position_embeddings=262_144)
        manifest.write_text(json.dumps(document))
    return sweep


def _with_attention_curve(out: Path) -> dict[str, Any]:
    """The shipped calibration with an MLA curve added by hand (one layer: 1 + 0.001·B·L µs at one query, twice the
    per-token cost at four, 1,152 latent bytes a token and layer), written to ``out``."""
    calibration = json.loads((Path(__file__).parents[2] / "moetrace" / "data" / "calibration-h200.json").read_text())
    points = [{"batch": b, "queries": q, "context": c, "time_us": 1 + 0.001 * (1 if q == 1 else 2) * b * c}
              for b in (1, 4) for q in (1, 4) for c in (1024, 65536)]
    calibration["attention"] = {"kernel": "by hand", "heads_per_rank": 8, "kv_bytes_per_token_layer": 1152,
                                "points": points,
                                "fit": [{"queries": q, "batch": b, "c0_us": 1.0,
                                         "per_context_token_us": 0.001 * (1 if q == 1 else 2) * b}
                                        for q in (1, 4) for b in (1, 4)]}
    out.write_text(json.dumps(calibration))
    return calibration


def _json_report(path: Path, tmp_path: Path, *extra: str) -> tuple[Result, dict[str, Any]]:
    result = CliRunner().invoke(main, ["report", str(path), "--k", "3", "--batch", "1,4", "--json", "-o",
                                      str(tmp_path / "r.html"), "--force", *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result, json.loads(result.stdout)


def test_the_self_check_passes_on_an_intact_sweep_and_every_recommendation_says_what_it_rests_on(
        tmp_path: Path) -> None:
    result, payload = _json_report(well_sampled_sweep(tmp_path / "sweep"), tmp_path)
    assert payload["warnings"] == [] and payload["runs"][0]["checks"] == [] and "warning" not in result.stderr
    for row in payload["decision"][0]["per_batch"]:
        # 160 decoding request-steps at each of k = 0..3 (k = 1, 2 are cut from the k = 3 trace)
        assert row["status"] == "ok" and row["k"] is not None and row["windows"] == 160
    # tokens per step at the recorded k = 3: the acceptance table's, by hand from the steps table
    steps = pl.read_parquet(tmp_path / "sweep" / "k3" / "steps").filter(
        pl.col("num_tokens") == pl.col("num_drafts") + 1)
    measured = 1 + steps["num_accepted"].mean()
    predicted = {row["k"]: row for row in payload["runs"][0]["prediction"]["per_k"]}
    assert predicted[3]["tokens_per_step"] == pytest.approx(measured)


def test_the_self_check_names_both_numbers_when_the_prediction_strays_from_the_measured_tables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moetrace.report.prediction as prediction_module

    original = prediction_module.speedup_per_batch

    def conditional_tokens(inputs: pl.DataFrame, *args: Any) -> Any:  # as if the old rates had reached the model
        return original(inputs.with_columns(pl.col("tokens_per_step") * 1.2), *args)

    monkeypatch.setattr(prediction_module, "speedup_per_batch", conditional_tokens)
    result, payload = _json_report(well_sampled_sweep(tmp_path / "sweep"), tmp_path)
    checks = " ".join(payload["runs"][0]["checks"])
    assert "tokens per step at k=3" in checks and "acceptance table measured" in checks and "+20.0%" in checks
    assert "self-check" in result.stderr


@pytest.mark.parametrize("which", [0, 1])
def test_a_truncated_routing_file_is_flagged_and_no_k_is_recommended(tmp_path: Path, which: int) -> None:
    sweep = well_sampled_sweep(tmp_path / "sweep")
    part = sorted((sweep / "k3" / "routing").glob("*.parquet"))[which]
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    result, payload = _json_report(sweep, tmp_path)
    assert "Traceback" not in result.output
    assert any("k=3: routing and steps disagree" in w and "lack routing rows" in w for w in payload["warnings"])
    for row in payload["decision"][0]["per_batch"]:
        assert row["k"] is None and row["speedup"] is None and "disagree at k=3" in row["status"]
    assert "no recommendation" in result.stderr
    terminal = CliRunner().invoke(main, ["report", str(sweep), "--k", "3", "--batch", "1,4", "-o",
                                        str(tmp_path / "t.html"), "--force"], catch_exceptions=False)
    assert "B=1: no recommendation: routing and steps disagree at k=3" in " ".join(terminal.stdout.split())


def test_the_record_out_folder_is_enough_when_it_holds_one_run(tmp_path: Path) -> None:
    # moetrace record --out OUT writes OUT/RUN/k<k>: OUT alone names the run; the dashboard goes into the run
    small_k2_trace(tmp_path / "out" / "run-a" / "k2")
    result = invoke("report", tmp_path / "out", "--k", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runs"][0]["path"] == str(tmp_path / "out" / "run-a")
    assert (tmp_path / "out" / "run-a" / "report.html").exists() and not (tmp_path / "out" / "report.html").exists()
    small_k2_trace(tmp_path / "out" / "run-b" / "k2")
    one_line_error(invoke("report", tmp_path / "out", "--k", "2"), "holds 2 runs (run-a, run-b): give one of them")
    assert invoke("report", tmp_path / "out" / "run-b", "--k", "2").exit_code == 0


def test_context_gives_a_decision_per_concurrency_and_context_and_bad_contexts_one_line(tmp_path: Path) -> None:
    """With the shipped H200 calibration and a trace whose manifest says 70,272 KV bytes a token (Kimi-K2's MLA): at
    each context every concurrency is decided, the KV read a step adds is B × (L − L₀) × 70,272 bytes at the copy
    bandwidth (by hand), a longer context never lowers the best speedup, and a cache that cannot fit gets no
    recommendation. A trace that does not say its KV bytes cannot be decided by context: one line."""
    path = well_sampled_sweep(tmp_path / "sweep")
    one_line_error(invoke("report", str(path), "--context", "1024"),
                    "--context: the trace does not say how many KV-cache bytes a token holds")
    _with_kv_bytes(path, 70_272)
    _, payload = _json_report(path, tmp_path, "--context", "1024,65536,262144", "--batch", "1,16")
    found = payload["decision"][0]["by_context"]
    rows = {(row["context"], row["batch"]): row for row in found["per_batch"]}
    assert set(rows) == {(context, batch) for context in (1024, 65536, 262144) for batch in (1, 16)}
    bandwidth = json.loads((Path(__file__).parents[2] / "moetrace" / "data" / "calibration-h200.json").read_text())[
        "copy_bandwidth_gbs"]
    assert rows[(65536, 16)]["attention_kv_ms"] == pytest.approx(
        16 * (65536 - found["recorded_context"]) * 70_272 / (bandwidth * 1e6))
    assert rows[(1024, 1)]["k"] is not None and rows[(65536, 16)]["speedup"] >= rows[(1024, 16)]["speedup"]
    assert rows[(262144, 16)]["k"] is None and "exceeds the calibrated GPU's" in rows[(262144, 16)]["status"]
    assert rows[(262144, 1)]["k"] is not None  # one request's 18 GB fits
    assert [c["context"] for c in found["crossover"]] == [1024, 65536, 262144]
    one_line_error(invoke("report", str(path), "--context", "8k"), "--context 8k: give context lengths")
    one_line_error(invoke("report", str(path), "--context", "0,1024"), "--context 0,1024")
    one_line_error(invoke("report", str(path), "--context", "300000"),
                    "--context 300000: beyond the model's 262,144 tokens")


def test_context_with_a_calibrated_attention_curve_prices_each_k_by_its_queries_and_says_so(tmp_path: Path) -> None:
    """The shipped calibration with an MLA curve added (one layer: 1 + 0.001·B·L µs at one query, twice the per-token
    cost at four, the model's 1,152 latent bytes a token and layer), predicting at TP=8: at 65,536 tokens a step's
    attention grows by layers × the curve's growth from the recorded context at B requests × (k + 1) queries (by
    hand); past the longest context timed the row is extrapolated; the report says which pricing it used."""
    path = well_sampled_sweep(tmp_path / "sweep")
    layers = json.loads(next(path.glob("*/manifest.json")).read_text())["model"]["num_layers"]
    _with_kv_bytes(path, 1152 * layers)
    calibration = _with_attention_curve(tmp_path / "calibration.json")
    _, payload = _json_report(path, tmp_path, "--context", "65536,131072", "--calibration",
                              str(tmp_path / "calibration.json"), "--tp", "8", "--profile", "kimi-k2-tp8")
    found = payload["decision"][0]["by_context"]
    assert "MLA curve (by hand, 8 heads a rank)" in found["attention_basis"]
    recorded = found["recorded_context"]
    # a preset's prediction holds no prefill; acceptance stays the trace's, and the report says so
    assert f"; acceptance as recorded, at a mean {recorded:,.0f} tokens" in found["attention_basis"]
    rows = {(row["context"], row["batch"]): row for row in found["per_batch"]}
    assert rows[(65536, 4)]["attention_kv_ms"] == pytest.approx(layers * 0.001 * 4 * (65536 - recorded) / 1e3)
    assert rows[(65536, 4)]["speedup_source"] != "extrapolated"
    assert rows[(131072, 1)]["speedup_source"] == "extrapolated"
    # every k the decision chose from: the recorded context's step plus the curve's growth at k + 1 queries (linear
    # in queries through the 1 and 4 it was given, carried on past 4), the recommended k's speedup among them
    recorded_steps = {(row["batch"], row["k"]): row["step_ms"] for row in payload["runs"][0]["prediction"]["per_batch"]}
    moved = {(row["context"], row["batch"], row["k"]): row for row in found["speedups"]}
    ks = sorted({k for _, _, k in moved})
    assert len(ks) >= 3
    for k in ks:
        per_token_us = 0.001 * 4 * (1 + k / 3)
        assert moved[(65536, 4, k)]["step_ms"] == pytest.approx(
            recorded_steps[(4, k)] + layers * per_token_us * (65536 - recorded) / 1e3)
    assert rows[(65536, 4)]["speedup"] == pytest.approx(moved[(65536, 4, rows[(65536, 4)]["k"])]["speedup"])
    calibration["attention"]["fit"] = {"1": {"c0_us": 1.0, "per_request_us": 0.0, "per_kv_token_us": 0.001}}
    (tmp_path / "earlier.json").write_text(json.dumps(calibration))  # fitted by an earlier moetrace: one line
    one_line_error(invoke("report", str(path), "--context", "65536", "--calibration", str(tmp_path / "earlier.json")),
                   "its attention was fitted by an earlier moetrace")


def _moved_to_8192(sweep: Path, tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    """The report of ``sweep`` at 1 and 4 requests per step, moved to 8,192 tokens (--context): its JSON, written to
    ``tmp_path``/report.json for the export, and its terminal text."""
    args = ("report", sweep, "--k", "2", "--batch", "1,4", "--context", "8192", "-o", tmp_path / "r.html", "--force",
            *extra)
    as_json = invoke(*args, "--json")
    assert as_json.exit_code == 0, as_json.output
    (tmp_path / "report.json").write_text(as_json.stdout)
    terminal = invoke(*args)
    assert terminal.exit_code == 0, terminal.output
    return json.loads(as_json.stdout), terminal.stdout


def _exported(tmp_path: Path, *extra: str) -> str:
    """What `moetrace export --vllm-spec-schedule` of the JSON payload ``_moved_to_8192`` wrote says."""
    result = invoke("export", tmp_path / "report.json", "--vllm-spec-schedule", "-o", tmp_path / "schedule.json",
                    "--force", *extra)
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


def test_a_k_at_the_largest_k_recorded_is_marked_in_every_decision_row_the_terminal_and_the_export(
        tmp_path: Path) -> None:
    """As the n-gram sweep of 256-token traces recorded at k = 0 and 2 and moved to 8,192 tokens (where k = 4
    measured 20-27% more throughput than the k = 2 it recommended): k = 2 is recommended, and every decision row, per
    concurrency and per concurrency and context, the terminal and the export say no larger k was recorded, and how
    to record one."""
    recorded = (0, 2)
    record_past = "moetrace record MODEL --k 0,2,3,4"  # the sweep's k and the two past its largest
    payload, terminal = _moved_to_8192(_with_kv_bytes(well_sampled_sweep(tmp_path / "sweep", recorded), 70_272),
                                       tmp_path)
    decision = payload["decision"][0]
    rows = [*decision["per_batch"], *decision["by_context"]["per_batch"]]
    assert [(row.get("context"), row["batch"]) for row in rows] == [(None, 1), (None, 4), (8192, 1), (8192, 4)]
    for row in rows:
        assert row["k"] == max(recorded) and type(row["k"]) is int and row["k_at_sweep_edge"] is True
        assert row["sweep_edge_note"].startswith("k = 2 is the largest k recorded") and record_past in row[
            "sweep_edge_note"]
    note = rows[0]["sweep_edge_note"]
    assert re.search(r"^1\s+2\+\s", terminal, re.MULTILINE) and re.search(r"^4\s+2\+\s", terminal, re.MULTILINE)
    assert re.search(r"^1\s+k=2\+ ", terminal, re.MULTILINE) and re.search(r"^4\s+k=2\+ ", terminal, re.MULTILINE)
    said = " ".join(terminal.split())
    assert f"k=2+ at B=1,4: {note}" in said and f"k=2+ at B=1,4, context 8,192: {note}" in said
    exported = _exported(tmp_path)
    assert f"k=2+ at B=1,4: {note}" in exported and f"k=2+ at B=1,4, context 8,192: {note}" in exported
    schedule = json.loads((tmp_path / "schedule.json").read_text())  # vLLM's keys alone: it reads no others
    assert set(schedule) == {"method", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"}
    assert schedule["num_speculative_tokens"] == max(recorded)
    assert f"k=2+ at B=1,4, context 8,192: {note}" in _exported(tmp_path, "--context", "8192")

    # with no k predicted past it the mark stands alone (no extrapolated k to pay more), and says how to look
    capped, terminal = _moved_to_8192(tmp_path / "sweep", tmp_path, "--max-k", "2")
    rows = [*capped["decision"][0]["per_batch"], *capped["decision"][0]["by_context"]["per_batch"]]
    assert all(row["k"] == 2 and row["k_at_sweep_edge"] and not row["larger_k_may_pay"] for row in rows)
    assert all("report again with --max-k 4" in row["sweep_edge_note"] for row in rows)
    assert re.search(r"^1\s+2\+\s", terminal, re.MULTILINE) and re.search(r"^1\s+k=2\+ ", terminal, re.MULTILINE)
    dashboard = (tmp_path / "r.html").read_text()
    assert f'<td class="k" title="{rows[0]["sweep_edge_note"]}">2<span class="mark">+</span></td>' in dashboard


def test_a_k_below_the_largest_k_recorded_is_not_marked(tmp_path: Path) -> None:
    """Recorded at k = 0, 2 and 4 with drafts accepted at 0.4: k = 2 is recommended with k = 4 measured against it;
    no row, terminal line or export line says a larger k was not looked at."""
    recorded = (0, 2, 4)
    sweep = _with_kv_bytes(well_sampled_sweep(tmp_path / "sweep", recorded, accept_prob=0.4), 70_272)
    payload, terminal = _moved_to_8192(sweep, tmp_path)
    decision = payload["decision"][0]
    rows = [*decision["per_batch"], *decision["by_context"]["per_batch"]]
    assert [row["k"] for row in rows] == [2] * 4 and 2 < max(recorded)
    assert not any(row["k_at_sweep_edge"] or row["sweep_edge_note"] or row["larger_k_may_pay"] for row in rows)
    assert re.search(r"^1\s+2\s", terminal, re.MULTILINE) and re.search(r"^1\s+k=2 ", terminal, re.MULTILINE)
    assert not re.search(r"^[14]\s+2\+", terminal, re.MULTILINE) and "k=2+" not in terminal
    assert "largest k" not in terminal
    assert "largest k" not in _exported(tmp_path)


def test_a_hybrid_models_step_grows_with_context_in_its_full_attention_layers_alone(tmp_path: Path) -> None:
    """Kimi-K3's layout: only the full-attention (MLA) layers keep a cache that grows with context, the Kimi Delta
    Attention ones a fixed state. The config says which (``linear_attn_config``): a token's KV bytes count those
    layers alone, and the same sweep moved to 65,536 tokens on a calibrated MLA curve grows each step by
    attention_layers / num_layers of what it grows with every layer MLA."""
    from moetrace.trace.model_config import attention_layers, kv_bytes_per_token

    hybrid = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}}
    assert attention_layers(hybrid) == 1 and kv_bytes_per_token(hybrid, 8, 2) == (512 + 64) * 2 * 1
    assert kv_bytes_per_token({**hybrid, "linear_attn_config": None}, 8, 2) == (512 + 64) * 2 * 4
    _with_attention_curve(tmp_path / "calibration.json")
    grown = {}
    for name, full_attention in (("mla", None), ("hybrid", 1)):
        path = well_sampled_sweep(tmp_path / name)
        layers = json.loads(next(path.glob("*/manifest.json")).read_text())["model"]["num_layers"]
        _with_kv_bytes(path, 1152 * (full_attention or layers))  # 1,152 bytes a token in each MLA layer
        for manifest in path.glob("*/manifest.json"):
            document = json.loads(manifest.read_text())
            document["model"]["attention_layers"] = full_attention
            manifest.write_text(json.dumps(document))
        _, payload = _json_report(path, tmp_path, "--context", "65536", "--calibration",
                                  str(tmp_path / "calibration.json"), "--tp", "8", "--profile", "kimi-k2-tp8")
        found = payload["decision"][0]["by_context"]
        grown[name] = {row["batch"]: row["attention_kv_ms"] for row in found["per_batch"]}
        said = f"the cache grows in 1 of {layers} layers"
        assert (said in found["attention_basis"]) == (full_attention is not None)
    assert layers > 1 and grown["mla"]
    for batch, ms in grown["mla"].items():
        assert ms > 0 and grown["hybrid"][batch] == pytest.approx(ms / layers)
