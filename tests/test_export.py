"""``moetrace export --vllm-spec-schedule``: the report's decision as vLLM's dynamic speculative-decoding schedule,
checked by hand and by vLLM 0.32's own parser and batch-size lookup."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner

from moetrace.cli import main
from moetrace.export import LAST_BATCH, vllm_spec_schedule
from trace_builder import small_k2_trace, well_sampled_sweep


def decision(*rows: tuple[int, int | None], status: str = "ok") -> dict[str, Any]:
    return {"drafter": "ngram", "label": "sweep",
            "per_batch": [{"batch": b, "k": k, "status": status if k is not None else "too few windows"}
                          for b, k in rows]}


def test_each_concurrency_covers_batch_sizes_up_to_the_geometric_midpoint_with_the_next() -> None:
    # by hand: sqrt(1·8) = 2.8 → 1-2; sqrt(8·32) = 16 → 3-16; sqrt(32·128) = 64 → 17-64, but 32 and 128 both run
    # k = 1: merged into 17 to the end
    doc = vllm_spec_schedule(decision((32, 1), (1, 4), (8, 3), (128, 1)))
    assert doc == {"method": "ngram", "num_speculative_tokens": 4,
                   "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 16, 3], [17, LAST_BATCH, 1]]}
    # neighbours one apart: each keeps its own batch size; k = 0 is a range too (vLLM then drafts nothing)
    assert vllm_spec_schedule(decision((1, 2), (2, 0)))["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 2], [2, LAST_BATCH, 0]]


def test_a_schedule_is_refused_where_the_decision_recommends_nothing() -> None:
    with pytest.raises(ValueError, match="no k is recommended at 8 request"):
        vllm_spec_schedule(decision((1, 3), (8, None)))
    with pytest.raises(ValueError, match="no concurrency pays"):
        vllm_spec_schedule(decision((1, 0), (8, 0)))
    with pytest.raises(ValueError, match="empty"):
        vllm_spec_schedule({"drafter": "ngram", "per_batch": []})


def test_vllm_reads_the_schedule_as_the_decision_says() -> None:
    from vllm.config import SpeculativeConfig
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    rows = ((1, 4), (8, 3), (32, 1), (128, 1))
    doc = vllm_spec_schedule(decision(*rows))
    config = SpeculativeConfig(**doc)
    assert config.uses_dynamic_speculative_decoding() and config.num_speculative_tokens == 4
    # the dense batch size -> k lookup vLLM's scheduler runs on, at vLLM's default 256 sequences
    lookup = build_dynamic_sd_schedule_lookup(config.num_speculative_tokens_per_batch_size, 256, 4)
    assert [lookup[batch] for batch, _ in rows] == [k for _, k in rows]
    assert lookup[2] == 4 and lookup[3] == 3 and lookup[16] == 3 and lookup[17] == 1 and lookup[256] == 1


def test_export_writes_beside_the_summary_and_refuses_what_it_cannot_schedule(tmp_path: Path) -> None:
    report = CliRunner().invoke(main, ["report", str(well_sampled_sweep(tmp_path / "sweep")), "--batch", "1,4",
                                       "--json", "-o", str(tmp_path / "r.html")], catch_exceptions=False)
    assert report.exit_code == 0, report.output
    summary = tmp_path / "summary.json"
    summary.write_text(report.stdout)
    decided = {row["batch"]: row["k"] for row in json.loads(report.stdout)["decision"][0]["per_batch"]}
    done = CliRunner().invoke(main, ["export", str(summary), "--vllm-spec-schedule"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    written = json.loads((tmp_path / "summary.vllm-spec-schedule.json").read_text())
    assert written == vllm_spec_schedule(json.loads(report.stdout)["decision"][0])
    ranges = written["num_speculative_tokens_per_batch_size"]
    assert all(any(start <= b <= end and k == decided[b] for start, end, k in ranges) for b in decided)
    assert "next: vllm serve MODEL --speculative-config" in done.output
    # as a subprocess: an existing file is kept without --force
    again = subprocess.run([sys.executable, "-m", "moetrace", "export", str(summary), "--vllm-spec-schedule"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "already exists (use --force to overwrite)" in again.stderr
    assert "Traceback" not in again.stderr

    small = CliRunner().invoke(main, ["report", str(small_k2_trace(tmp_path / "small")), "--json", "-o",
                                      str(tmp_path / "s.html")], catch_exceptions=False)
    (tmp_path / "small.json").write_text(small.stdout)
    for path, fragment in ((tmp_path / "small.json", "no k is recommended at 1 request(s) per step: too few windows"),
                           (tmp_path / "r.html", "not the JSON of `moetrace report --json`"),
                           (tmp_path / "missing.json", "no such file")):
        refused = CliRunner().invoke(main, ["export", str(path), "--vllm-spec-schedule"], catch_exceptions=False)
        lines = [line for line in refused.output.splitlines() if line.strip()]
        assert refused.exit_code == 1 and len(lines) == 1 and fragment in lines[0], refused.output


@pytest.mark.vllm
def test_a_cpu_engine_runs_the_exported_schedule(tmp_path: Path) -> None:
    """vLLM 0.32 (CPU build) started with the exported schedule drafts, at each step, at most the k its schedule
    gives the previous step's requests count (vLLM drafts at the end of a step for the next one)."""
    from vllm_fixtures import run_cli

    from moetrace.reader import open_trace

    doc = vllm_spec_schedule(decision((1, 4), (4, 1)))
    ranges = doc["num_speculative_tokens_per_batch_size"]
    assert ranges == [[1, 2, 4], [3, LAST_BATCH, 1]]
    done = run_cli("record", "--k", str(doc["num_speculative_tokens"]), "--batch-size", "4", "--num-prompts", "8",
                   "--max-tokens", "24", "--out", str(tmp_path),
                   "--spec-arg", f"num_speculative_tokens_per_batch_size={json.dumps(ranges)}")
    assert done.returncode == 0, done.stderr[-3000:]
    (trace_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    steps = open_trace(trace_dir).steps().collect()
    per_step = {step: (len(rows), max(rows)) for step, rows in
                steps.group_by("step").agg(drafts=pl.col("num_drafts")).sort("step").iter_rows()}
    allowed = {n: next(k for start, end, k in ranges if start <= n <= end) for n in range(1, 5)}
    pairs = [(per_step[s][0], per_step[s + 1][1]) for s in per_step if s + 1 in per_step]
    assert all(drafts <= allowed[requests] for requests, drafts in pairs)
    # both ranges ran: steps after a step of 4 requests drafted 1 at most, after 1 or 2 requests up to 4
    assert {allowed[requests] for requests, _ in pairs} == {1, 4}
    assert max(drafts for requests, drafts in pairs if allowed[requests] == 4) > 1
