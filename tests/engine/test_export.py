"""``moetrace export --vllm-spec-schedule``: the report's decision as vLLM's dynamic speculative-decoding schedule,
checked by hand and by vLLM 0.32's own parser and batch-size lookup; ``--sglang-expert-location``: a trace's expert
load as SGLang's ``--init-expert-location`` file, checked by a brute-force count and by the rules SGLang's parser
applies (its parser cannot run here: see the test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from moetrace.cli import main
from moetrace.analysis.placement import replicated_placement
from moetrace.formats.export import LAST_BATCH, vllm_spec_schedule
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


def test_export_writes_beside_the_report_json_and_refuses_what_it_cannot_schedule(tmp_path: Path) -> None:
    report = CliRunner().invoke(main, ["report", str(well_sampled_sweep(tmp_path / "sweep")), "--batch", "1,4",
                                       "--json", "-o", str(tmp_path / "r.html")], catch_exceptions=False)
    assert report.exit_code == 0, report.output
    decision_json = tmp_path / "decision.json"
    decision_json.write_text(report.stdout)
    decided = {row["batch"]: row["k"] for row in json.loads(report.stdout)["decision"][0]["per_batch"]}
    done = CliRunner().invoke(main, ["export", str(decision_json), "--vllm-spec-schedule"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    written = json.loads((tmp_path / "decision.vllm-spec-schedule.json").read_text())
    assert written == vllm_spec_schedule(json.loads(report.stdout)["decision"][0])
    ranges = written["num_speculative_tokens_per_batch_size"]
    assert all(any(start <= b <= end and k == decided[b] for start, end, k in ranges) for b in decided)
    assert "next: vllm serve MODEL --speculative-config" in done.output
    # as a subprocess: an existing file is kept without --force
    again = subprocess.run([sys.executable, "-m", "moetrace", "export", str(decision_json), "--vllm-spec-schedule"],
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


def test_a_decision_per_context_exports_the_proposed_five_item_schedule_beside_todays(tmp_path: Path) -> None:
    """By hand: contexts 1,024 and 32,768 split at isqrt(1,024 × 32,768) = 5,792 tokens, concurrencies 1 and 8 at
    isqrt(8) = 2; the cell whose KV cache does not fit is left out and named; --context picks today's table."""
    rows = [(1024, 1, 4), (1024, 8, 3), (32768, 1, 4), (32768, 8, None)]
    decided = {**decision((1, 4), (8, 2)), "by_context": {"recorded_context": 200.0, "per_batch": [
        {"context": c, "batch": b, "k": k, "status": "ok" if k is not None else "does not fit"} for c, b, k in rows]}}
    decision_json = tmp_path / "decision.json"
    decision_json.write_text(json.dumps({"decision": [decided]}))
    done = CliRunner().invoke(main, ["export", str(decision_json), "--vllm-spec-schedule", "--context", "32768"],
                              catch_exceptions=False)
    assert done.exit_code == 1 and "no k is recommended at 8 request(s) per step: does not fit" in done.output
    done = CliRunner().invoke(main, ["export", str(decision_json), "--vllm-spec-schedule", "--context", "1024"],
                              catch_exceptions=False)
    assert done.exit_code == 0, done.output
    today = json.loads((tmp_path / "decision.vllm-spec-schedule.json").read_text())
    assert today["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, LAST_BATCH, 3]]
    proposed = json.loads((tmp_path / "decision.vllm-spec-schedule-by-context.json").read_text())
    assert proposed == {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [
        [1, 2, 1, 5792, 4], [3, LAST_BATCH, 1, 5792, 3], [1, 2, 5793, 2**31 - 1, 4]]}
    assert "open proposal (RFC #48627, PR #48944)" in done.output
    assert "left out: 8 request(s) at 32,768 tokens: does not fit" in done.output
    again = CliRunner().invoke(main, ["export", str(decision_json), "--vllm-spec-schedule", "--context", "999"],
                               catch_exceptions=False)
    lines = [line for line in again.output.splitlines() if line.strip()]
    assert again.exit_code == 1 and lines == [
        f"error: {decision_json}: no decision at context 999 (reported at: 1,024, 32,768)"]

@pytest.mark.vllm
def test_a_cpu_engine_runs_the_exported_schedule(tmp_path: Path) -> None:
    """vLLM 0.32 (CPU build) started with the exported schedule drafts, at each step, at most the k its schedule
    gives the previous step's requests count (vLLM drafts at the end of a step for the next one)."""
    from vllm_fixtures import run_cli

    from moetrace.trace.reader import open_trace

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


def test_replicas_go_to_the_most_picked_per_replica_and_ranks_fill_heaviest_first() -> None:
    # by hand: picks 8, 4, 2, 2 over 2 ranks with 2 extra replicas: expert 0 (8 per replica) gets the first, then
    # 0 and 1 tie at 4 per replica: the lower id, 0, gets the second (3 replicas of 8/3 each). Heaviest first into
    # the least-loaded rank with room (3 slots each): 1 (4) -> r0; 0 -> r1 (2.7); 0 -> r1 (5.3, r0 has 4); 0 -> r0
    # (6.7); 2 -> r1 (7.3, full); 3 -> r0 (8.7)
    slots = replicated_placement([8, 4, 2, 2], ep=2, redundant=2).tolist()
    assert sorted(slots) == [0, 0, 0, 1, 2, 3]
    assert slots == [1, 0, 3, 0, 0, 2]
    with pytest.raises(ValueError, match="do not split evenly"):
        replicated_placement([1, 1, 1], ep=2, redundant=0)


def brute_force_picks(trace: Path) -> dict[tuple[int, int], int]:
    """Picks per (layer, expert) over the trace's decode and verify rows, one row at a time."""
    picks: dict[tuple[int, int], int] = {}
    for row in pq.read_table(trace / "routing").to_pylist():
        if row["phase"] != "prefill":
            for expert in row["experts"]:
                picks[(row["layer"], expert)] = picks.get((row["layer"], expert), 0) + 1
    return picks


def test_sglang_expert_location_holds_the_traces_load_as_sglangs_parser_reads_it(tmp_path: Path) -> None:
    """SGLang's own parser (``sglang.srt.eplb.expert_location.compute_initial_expert_location_metadata``, 0.5.23)
    cannot run without a server: it needs SGLang's published runtime context and a full ``ModelConfig`` (its
    ``init_by_mapping`` / ``init_by_eplb`` read both), and importing it pulls in orjson, msgspec and SGLang's server
    arguments. So this checks the rules it applies: a .json whose only key is ``physical_to_logical_map`` (the dict
    is passed on as keyword arguments) with a row per decoder layer and ids in [0, experts), or one with
    ``logical_count`` [layers, experts]; SGLang itself checks neither, and a negative id wraps around silently."""
    trace = small_k2_trace(tmp_path / "trace")
    manifest = json.loads((trace / "manifest.json").read_text())
    experts, moe_layers = manifest["model"]["num_experts"], manifest["model"]["moe_layers"]
    layers = max(moe_layers) + 1
    done = CliRunner().invoke(main, ["export", str(trace), "--sglang-expert-location"])
    assert done.exit_code == 0, done.output
    count = json.loads((tmp_path / "trace.sglang-expert-location.json").read_text())
    assert list(count) == ["logical_count"] and len(count["logical_count"]) == layers
    expected = brute_force_picks(trace)
    assert {(layer, expert): n for layer, row in enumerate(count["logical_count"]) for expert, n in enumerate(row)
            if n} == expected
    mapped = subprocess.run([sys.executable, "-m", "moetrace", "export", str(trace), "--sglang-expert-location",
                             "--ep", "4", "--redundant", "8", "-o", str(tmp_path / "map.json")],
                            capture_output=True, text=True, check=False)
    assert mapped.returncode == 0, mapped.stderr
    doc = json.loads((tmp_path / "map.json").read_text())
    assert list(doc) == ["physical_to_logical_map"]
    table = doc["physical_to_logical_map"]
    assert len(table) == layers and all(len(row) == experts + 8 for row in table)
    for layer in moe_layers:  # every expert has a slot; ids in range; the rank loads balanced
        row = table[layer]
        assert set(row) == set(range(experts)) and min(row) >= 0
        replicas = {e: row.count(e) for e in set(row)}
        per_rank = len(row) // 4
        rank_load = [sum(expected.get((layer, e), 0) / replicas[e] for e in row[r * per_rank:(r + 1) * per_rank])
                     for r in range(4)]
        linear = [sum(expected.get((layer, e), 0) for e in range(r * experts // 4, (r + 1) * experts // 4))
                  for r in range(4)]
        assert max(rank_load) <= max(linear)
    bad = CliRunner().invoke(main, ["export", str(trace), "--sglang-expert-location", "--ep", "3", "--force"])
    assert bad.exit_code == 1 and "do not split evenly over 3 ranks" in bad.output
    neither = CliRunner().invoke(main, ["export", str(trace)])
    assert neither.exit_code == 1 and "give one of" in neither.output


def test_eplb_export_is_vllms_own_placement_of_the_traces_load(tmp_path: Path) -> None:
    """vLLM's default EPLB policy, run on the trace's decode and verification load: the load equals a brute-force
    count; every expert has a slot; the replica counts and logical map match the physical map (counted by hand);
    and each rank's load (an expert's split evenly over its replicas) is no more than under a linear placement."""
    trace = small_k2_trace(tmp_path / "trace")
    manifest = json.loads((trace / "manifest.json").read_text())
    experts, moe_layers = manifest["model"]["num_experts"], manifest["model"]["moe_layers"]
    done = CliRunner().invoke(main, ["export", str(trace), "--eplb", "--ep", "4", "--redundant", "4"])
    assert done.exit_code == 0, done.output
    doc = json.loads((tmp_path / "trace.eplb.json").read_text())
    picks = brute_force_picks(trace)
    assert doc["layers"] == moe_layers and doc["ep"] == 4 and doc["redundant"] == 4
    assert doc["load"] == [[picks.get((layer, e), 0) for e in range(experts)] for layer in moe_layers]
    for load, row, replicas, logical in zip(doc["load"], doc["physical_to_logical_map"],
                                            doc["logical_replica_count"], doc["logical_to_physical_map"]):
        assert len(row) == experts + 4 and set(row) == set(range(experts))
        assert replicas == [row.count(e) for e in range(experts)]
        assert all(sorted(slot for slot in logical[e] if slot >= 0) == [i for i, x in enumerate(row) if x == e]
                   for e in range(experts))
        per_rank = len(row) // 4
        placed = [sum(load[e] / replicas[e] for e in row[r * per_rank:(r + 1) * per_rank]) for r in range(4)]
        linear = [sum(load[r * experts // 4:(r + 1) * experts // 4]) for r in range(4)]
        assert max(placed) <= max(linear)
    for args, message in ((["--eplb"], "give --ep"), (["--eplb", "--ep", "3"], "do not split evenly over 3")):
        refused = CliRunner().invoke(main, ["export", str(trace), *args, "--force"])
        assert refused.exit_code == 1 and message in refused.output, refused.output


def test_an_sglang_stat_dump_exports_its_counts_summed_over_its_passes(tmp_path: Path) -> None:
    """A stat dump (``_StatAccumulator.dump``, SGLang 0.5.23 L998-1006: ``logical_count`` int32 [buffered passes,
    layers, experts], dense layers all zero) becomes SGLang's location file and vLLM's EPLB placement of the summed
    counts; a per_token dump is sent to `moetrace import` first, and one counted nothing is refused."""
    import torch

    rng = np.random.default_rng(7)
    counts = rng.integers(0, 50, size=(3, 4, 16)).astype(np.int32)
    counts[:, 0] = 0  # layer 0 dense
    torch.save(dict(rank=0, logical_count=torch.from_numpy(counts), average_utilization_rate_over_window=None),
               str(tmp_path / "stat.pt"))
    summed = counts.sum(axis=0).tolist()
    done = CliRunner().invoke(main, ["export", str(tmp_path / "stat.pt"), "--sglang-expert-location"])
    assert done.exit_code == 0, done.output
    assert json.loads((tmp_path / "stat.pt.sglang-expert-location.json").read_text()) == {"logical_count": summed}
    done = CliRunner().invoke(main, ["export", str(tmp_path / "stat.pt"), "--eplb", "--ep", "4"])
    assert done.exit_code == 0, done.output
    doc = json.loads((tmp_path / "stat.pt.eplb.json").read_text())
    assert doc["layers"] == [1, 2, 3] and doc["load"] == summed[1:]
    assert all(sorted(row) == list(range(16)) for row in doc["physical_to_logical_map"])
    torch.save(dict(rank=0, logical_count=torch.zeros((2, 4, 16), dtype=torch.int32),
                    average_utilization_rate_over_window=None), str(tmp_path / "empty.pt"))
    refused = CliRunner().invoke(main, ["export", str(tmp_path / "empty.pt"), "--eplb", "--ep", "4"])
    assert refused.exit_code == 1 and "logical_count holds no pick yet" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
