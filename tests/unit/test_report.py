"""`moetrace report` and `moetrace budget` end to end on small built traces: terminal, JSON, dashboard, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from moetrace.cli import main
from moetrace.commands.report import budget, report
from moetrace.report.payload import RANDOM_WEIGHTS_NOTE
from cli_results import invoke, one_line_error
from trace_builder import Model, decode_tokens, verify_tokens, write_trace

HOSTILE = "<script>alert(1)</script>"
@pytest.fixture
def verify_trace(tmp_path: Path) -> Path:
    model = Model(name=HOSTILE, random_weights=True)
    tokens = verify_tokens(np.random.default_rng(0), model, requests=3, steps=12, k=3, accept_prob=0.6,
                           variable_drafts=True)
    return write_trace(tmp_path / "verify-k3", tokens, model, k=3)


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    model = Model()
    for k in (1, 2):
        tokens = verify_tokens(np.random.default_rng(k), model, requests=2, steps=10, k=k, accept_prob=0.7)
        write_trace(tmp_path / "sweep" / f"k{k}", tokens, model, k=k)
    return tmp_path / "sweep"


def test_report_prints_tables_and_writes_dashboard(verify_trace: Path) -> None:
    result = invoke("report", verify_trace, "--k", "3")
    assert result.exit_code == 0, result.output
    for heading in ("Unique experts per layer", "Bytes per verification step", "Acceptance", "Expert budget"):
        assert heading in result.output
    assert RANDOM_WEIGHTS_NOTE.split(":")[0] in result.output
    assert HOSTILE in result.output  # the terminal shows the name as text
    dashboard = verify_trace / "report.html"
    assert dashboard.is_file()
    page = dashboard.read_text()
    assert "routing of a random-weight model" in page
    assert "<script src" not in page and "<link" not in page


def test_hostile_model_name_is_escaped(verify_trace: Path) -> None:
    assert invoke("report", verify_trace).exit_code == 0
    page = (verify_trace / "report.html").read_text()
    assert HOSTILE not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_json_payload(verify_trace: Path) -> None:
    result = invoke("report", verify_trace, "--k", "2", "--json", "--ep", "4")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    run = payload["runs"][0]
    assert payload["k"] == 2 and run["source_at_k"] == "measured" and run["ep"] == 4
    assert run["model"] == HOSTILE and run["random_weights"] is True
    assert run["growth_at_k"]["measured_request"] >= 2.0
    # the bound of what each request-step reads at k=2: its anchor and min(drafts, 2) drafts
    steps = pl.read_parquet(verify_trace / "steps").filter(pl.col("num_tokens") == pl.col("num_drafts") + 1)
    tokens = [min(d, 2) + 1 for d in steps["num_drafts"].to_list()]
    assert 0 < tokens.count(1) < len(tokens)  # the drafter proposed nothing in some
    assert run["growth_at_k"]["uniform_bound"] == pytest.approx(np.mean([16 * (1 - (1 - 2 / 16) ** t) for t in tokens]))
    assert run["bytes_at_k"]["ep_bytes"] > 0
    assert set(run["budget"]["per_layer"][0]) >= {"layer", "budget", "coverage"}
    assert Path(payload["dashboard"]).is_file()
    # under EP the placements are compared on held-out windows (odd steps): the linear one by brute force from the
    # rows, 16 experts over 4 ranks, 4 a rank
    rows = pl.read_parquet(verify_trace / "routing").filter((pl.col("phase") == "verify") & (pl.col("step") % 2 == 1))
    windows = rows.explode("experts").group_by("step", "request", "layer").agg(
        ranks=(pl.col("experts") // 4).n_unique())
    placement = run["placement"]
    assert placement["ep"] == 4 and [r["placement"] for r in placement["rows"]] == ["linear", "vLLM EPLB", "moetrace"]
    linear = placement["rows"][0]
    assert linear["windows"] == windows.height and linear["ranks_touched"] == pytest.approx(windows["ranks"].mean())
    assert placement["verdict"].startswith("held out, ")


def test_the_terminal_shows_the_held_out_placements_under_ep_and_not_without(verify_trace: Path) -> None:
    under_ep = invoke("report", verify_trace, "--k", "2", "--ep", "4", "--force")
    assert under_ep.exit_code == 0, under_ep.output
    assert "Placement at EP=4, held out" in under_ep.output and "  held out, " in under_ep.output
    for name in ("linear", "vLLM EPLB", "moetrace"):
        assert name in under_ep.output.split("Placement at EP=4")[1]
    assert "Placement at EP" not in invoke("report", verify_trace, "--k", "2", "--force").output


def test_k_beyond_the_trace_is_counterfactual_and_labelled(verify_trace: Path) -> None:
    result = invoke("report", verify_trace, "--k", "6", "--json")
    run = json.loads(result.stdout)["runs"][0]
    assert run["source_at_k"] == "counterfactual"
    assert any("counterfactual" in note for note in run["notes"])
    assert run["growth_at_k"]["measured_request"] is None and run["growth_at_k"]["counterfactual"] is not None


def test_sweep_and_side_by_side(
    tmp_path: Path, verify_trace: Path, sweep: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("report", verify_trace, sweep, "--k", "2")
    assert result.exit_code == 0, result.output
    assert "Side by side at k=2" in result.output
    assert (tmp_path / "verify-k3-vs-sweep.report.html").is_file()
    payload = json.loads(invoke("report", sweep, "--k", "2", "--json", "-o", tmp_path / "s.html").stdout)
    run = payload["runs"][0]
    assert run["recorded_k"] == [1, 2] and run["primary_k"] == 2
    assert [row["k"] for row in run["acceptance_per_k"]] == [1, 2]


def test_a_dashboard_is_rebuilt_but_a_users_file_is_not_overwritten_without_force(verify_trace: Path,
                                                                                   tmp_path: Path) -> None:
    assert invoke("report", verify_trace).exit_code == 0
    assert invoke("report", verify_trace, "--json").exit_code == 0  # derived from the trace: rebuilt
    mine = tmp_path / "notes.html"
    mine.write_text("<p>my notes</p>")
    one_line_error(invoke("report", verify_trace, "-o", mine), "already exists", "--force")
    assert mine.read_text() == "<p>my notes</p>"
    assert invoke("report", verify_trace, "-o", mine, "--force").exit_code == 0


def test_shape_preset_prices_at_real_size(tmp_path: Path, verify_trace: Path) -> None:
    one_line_error(invoke("report", verify_trace, "--shape", "kimi-k2"), "kimi-k2", "384 experts")
    model = Model(num_experts=384, top_k=8, layers=(1, 2, 3))
    trace = write_trace(tmp_path / "kimi-tiny", decode_tokens(np.random.default_rng(1), model, 2, 40), model, k=0)
    run = json.loads(
        invoke("report", trace, "--k", "3", "--shape", "kimi-k2", "--tp", "8", "--json").stdout)["runs"][0]
    unique = run["bytes_at_k"]["unique_experts"]
    expert = 3 * 7168 * 2048 // 2 + 3 * 7168 * 2048 // 32 * 2
    assert run["bytes_at_k"]["expert_weight_bytes"] == pytest.approx((unique + 1) * expert * 60)
    assert run["bytes_at_k"]["allreduce_bytes"] == pytest.approx(61 * 2 * (2 * 7 / 8) * 4 * 7168 * 2)


@pytest.mark.parametrize("k", ["-1", "99"])
def test_bad_k(verify_trace: Path, k: str) -> None:
    one_line_error(invoke("report", verify_trace, "--k", k), "--k")


def test_missing_and_empty_traces(tmp_path: Path, verify_trace: Path) -> None:
    one_line_error(invoke("report", tmp_path / "nope"), "no such trace")
    (tmp_path / "empty").mkdir()
    one_line_error(invoke("report", tmp_path / "empty"), "not a moetrace trace")
    for table in ("routing", "steps"):
        for part in (verify_trace / table).iterdir():
            part.unlink()
    one_line_error(invoke("report", verify_trace), "no routing rows")


def test_unknown_schema_version(verify_trace: Path) -> None:
    manifest = json.loads((verify_trace / "manifest.json").read_text())
    manifest["schema"] = "moetrace/99"
    (verify_trace / "manifest.json").write_text(json.dumps(manifest))
    one_line_error(invoke("report", verify_trace), "unknown schema version", "moetrace/99")


def test_corrupt_and_truncated_parquet_are_skipped_and_named_on_stderr_and_in_the_top_level_warnings(
        verify_trace: Path) -> None:
    routing = verify_trace / "routing"
    truncated = routing / "part-00001.parquet"
    truncated.write_bytes(truncated.read_bytes()[:200])
    (routing / "part-00002.parquet").write_bytes(b"not parquet at all")
    for flags in ((), ("--json",)):
        result = invoke("report", verify_trace, *flags)
        assert result.exit_code == 0, result.output
        named = [line for line in result.stderr.splitlines() if line.startswith("warning:") and "skipped" in line]
        assert [name for name in ("part-00001.parquet", "part-00002.parquet") if name in " ".join(named)] == [
            "part-00001.parquet", "part-00002.parquet"], result.stderr
    warnings = json.loads(result.stdout)["warnings"]
    assert sum(f"{routing}/part-0000{n}.parquet: skipped, corrupt" in " ".join(warnings) for n in (1, 2)) == 2


def test_budget_command(tmp_path: Path, verify_trace: Path) -> None:
    output = tmp_path / "budgets.json"
    result = invoke("budget", verify_trace, "--k", "3", "--coverage", "0.9", "-o", output)
    assert result.exit_code == 0, result.output
    payload = json.loads(output.read_text())
    assert payload["source"] == "measured" and payload["coverage_target"] == 0.9
    assert set(payload["budgets"]) == {"1", "2"}
    assert all(row["coverage"] >= 0.9 for row in payload["per_layer"])
    one_line_error(invoke("budget", verify_trace, "-o", output), "already exists")
    counterfactual = json.loads(
        (invoke("budget", verify_trace, "--k", "5", "-o", output, "--force"), output.read_text())[1]
    )
    assert counterfactual["source"] == "counterfactual"
    one_line_error(invoke("budget", verify_trace, "--coverage", "1.5", "-o", tmp_path / "x.json"), "--coverage")


def test_cli_as_a_subprocess(verify_trace: Path) -> None:
    command = [sys.executable, "-m", "moetrace"]
    done = subprocess.run([*command, "report", str(verify_trace), "--k", "3", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runs"][0]["primary_k"] == 3
    failed = subprocess.run([*command, "report", str(verify_trace / "missing")], capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().startswith("error:") and len(failed.stderr.strip().splitlines()) == 1


def test_commands_have_help() -> None:
    for command in (report, budget):
        assert isinstance(command, click.Command) and command.help


def test_a_round_robin_placement_in_the_manifest_is_reported_per_rank(tmp_path: Path) -> None:
    """vLLM records ``expert_placement_strategy="round_robin"``; the per-rank view must read it (rank = e mod ep),
    not fail: it must equal the report under an explicit placement file of e mod 2, and differ from linear."""
    model = Model()
    tokens = verify_tokens(np.random.default_rng(3), model, requests=2, steps=8, k=2, accept_prob=0.6)
    root = write_trace(tmp_path / "rr", tokens, model, k=2, ep=2)

    def per_rank(*extra: str | Path) -> list[tuple[float, float]]:
        result = invoke("report", root, "--k", "2", "--json", "--ep", "2", "--force", *extra)
        assert result.exit_code == 0, result.output
        rows = json.loads(result.stdout)["runs"][0]["growth"]
        return [(row["busiest_rank_experts"], row["ranks_touched"]) for row in rows]

    linear = per_rank()
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"expert_to_rank": [e % 2 for e in range(model.num_experts)]}))
    explicit = per_rank("--placement", placement)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["parallel"]["expert_placement"] = "round_robin"
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert per_rank() == explicit != linear


def test_corrupt_pages_under_an_intact_footer_fail_in_one_line_naming_the_file(verify_trace: Path) -> None:
    broken = verify_trace / "routing" / "part-00001.parquet"
    data = bytearray(broken.read_bytes())
    data[8:208] = b"\xff" * 200  # the first data pages; the footer at the end still reads
    broken.write_bytes(bytes(data))
    import pyarrow.parquet as pq

    pq.read_schema(broken)  # the footer vouches for the file
    result = CliRunner().invoke(main, ["report", str(verify_trace), "--json"])
    one_line_error(result, str(broken), "unreadable Parquet data", "--debug")
    for debug in (["--debug"], []):  # the flag, or the environment
        traced = subprocess.run([sys.executable, "-m", "moetrace", *debug, "report", str(verify_trace), "--json",
                                 "--force"], capture_output=True, text=True, timeout=120,
                                env={**os.environ, **({} if debug else {"MOETRACE_DEBUG": "1"})})
        assert traced.returncode != 0 and "Traceback (most recent call last)" in traced.stderr


def test_files_with_float16_and_float32_weights_read_as_one_trace(verify_trace: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    widened = verify_trace / "routing" / "part-00001.parquet"
    table = pq.read_table(widened)
    k = table.schema.field("weights").type.list_size
    weights = table["weights"].cast(pa.list_(pa.float32(), k))
    pq.write_table(table.set_column(table.schema.get_field_index("weights"), "weights", weights), widened)
    result = invoke("report", verify_trace, "--json", "--force")
    assert result.exit_code == 0, result.output
    from moetrace.trace.reader import open_trace

    weights_type = open_trace(verify_trace).routing().collect_schema()["weights"]
    assert weights_type == pl.Array(pl.Float32, k)


def test_the_terminal_report_cuts_nothing_at_80_columns_when_piped(verify_trace: Path, sweep: Path) -> None:
    """Piped output (no terminal) at 80 columns: every header and cell whole, no "…", prediction included."""
    import os

    done = subprocess.run(
        [sys.executable, "-m", "moetrace", "report", str(verify_trace), str(sweep), "--k", "2",
         "--profile", "kimi-k2-tp8", "-o", str(verify_trace.parent / "both.html")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Predicted verify step" in done.stdout and "Side by side" in done.stdout
    assert "…" not in done.stdout
    *tables, next_command = done.stdout.splitlines()
    assert max(len(line) for line in tables) <= 80
    assert next_command.startswith("next: moetrace report ")  # printed whole, to be copied, however long


def test_measured_term_columns_show_only_where_the_traces_measured_them() -> None:
    from rich.console import Console

    from moetrace.report.terminal import _prediction

    row = {"k": 1, "tokens_per_step": 1.6, "acceptance_source": "measured", "union_source": "measured",
           "unique_experts": 12.0,
           "rank_experts": 13.0, "moe_ms": 1.0, "allreduce_ms": 0.0, "attention_ms": 0.5, "other_ms": 0.2,
           "forward_beyond_moe_ms": None, "drafting_ms": None, "scheduling_ms": None, "sampling_ms": None,
           "prefill_ms_per_token": 0.0,
           "step_ms": 3.0, "step_ratio": 1.1,
           "speedup": 1.45}
    basis = {"mode": "m", "tp": 1, "ep": 1, "weight_format": "bf16", "routing": "measured"}

    def rendered(**measured: float) -> str:
        console = Console(width=200, record=True)
        console.print(_prediction({"basis": basis, "per_k": [{**row, **measured}]}, 1, False))
        return console.export_text()

    assert not {"fwd+", "draft", "sched", "rej", "pre"} & set(rendered().split())
    assert "pre" in rendered(prefill_ms_per_token=0.2)
    assert "fwd+" in rendered(forward_beyond_moe_ms=0.4)
    assert "draft" in rendered(drafting_ms=0.75) and "0.75" in rendered(drafting_ms=0.75)
    assert "sched" in rendered(scheduling_ms=0.5) and "rej" in rendered(sampling_ms=0.25)
    assert "rej" not in rendered(drafting_ms=0.75)


def test_the_terminal_report_says_an_extrapolated_all_reduce_once_and_ends_with_the_next_command(
        verify_trace: Path, tmp_path: Path) -> None:
    result = invoke("report", verify_trace, "--k", "3", "-o", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())  # as read, whatever rich wrapped
    assert said.count("EXTRAPOLATED from 2 GPUs") == 1  # the preset's all-reduce curve, measured on 2 H200s
    assert result.stdout.splitlines()[-1] == (f"next: moetrace report {verify_trace} --json > decision.json && "
                                              "moetrace export decision.json --vllm-spec-schedule")
    budget = invoke("budget", verify_trace, "--k", "3", "-o", tmp_path / "budgets.json")
    assert budget.stdout.splitlines()[-1] == (
        f"next: moetrace record MODEL --k 3 --budget {tmp_path / 'budgets.json'},none (what the budget does to "
        "acceptance and output, measured in vLLM)")


def test_budget_export_and_place_name_a_corrupt_file_on_stderr(verify_trace: Path, tmp_path: Path) -> None:
    broken = verify_trace / "routing" / "part-00001.parquet"
    broken.write_bytes(broken.read_bytes()[:200])
    named = f"warning: {broken}: skipped, corrupt or truncated Parquet"
    for args in (["budget", verify_trace, "--k", "3", "-o", tmp_path / "b.json"],
                 ["export", verify_trace, "--sglang-expert-location", "--ep", "2", "-o", tmp_path / "s.json"],
                 ["export", verify_trace, "--eplb", "--ep", "2", "-o", tmp_path / "e.json"],
                 ["place", verify_trace, "--ep", "2", "-o", tmp_path / "p.json"]):
        result = invoke(*args)
        assert result.exit_code in (0, 1), result.output
        assert named in " ".join(result.stderr.split()) and named not in result.stdout, (args[0], result.stderr)
