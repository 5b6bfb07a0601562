"""The trace's measurements by context length: the default model recorded at two prompt lengths in real vLLM, its
tables by context bucket checked against a brute-force count over the routing and steps rows."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

import polars as pl
import pytest
from vllm_fixtures import run_cli

from moetrace.analysis.context import CONTEXT_BUCKETS, context_tables
from moetrace.default_model import CONFIG
from moetrace.trace.reader import open_trace

SHORT = "def add(a, b):\n    return a + b\n"
LONG = "".join(f"def f{i}(x):\n    return x * {i} + {i}\n" for i in range(60))  # about 1,700 bytes: 1-4K tokens
K = 2


def bucket(context: float) -> int:
    return next((i for i, bound in enumerate(CONTEXT_BUCKETS) if context <= bound), len(CONTEXT_BUCKETS))


@pytest.fixture(scope="module")
def two_lengths(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("context")
    prompts = folder / "prompts.jsonl"
    lengths = (SHORT, LONG, SHORT + "# two\n", LONG + "#\n")
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lengths))
    done = run_cli("record", "--k", str(K), "--max-tokens", "16", "--batch-size", "4", "--prompts", str(prompts),
                   "--out", str(folder / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "out" / "kimi-k2-tiny-ngram-k2"


@pytest.mark.vllm
def test_tables_by_context_equal_a_brute_force_count_over_the_rows(two_lengths: Path) -> None:
    trace = open_trace(two_lengths)
    routing = trace.routing().collect().to_dicts()
    steps = trace.steps().collect().to_dicts()
    first_layer = min(row["layer"] for row in routing)
    context: dict[tuple[int, int], int] = {}
    for row in routing:
        if row["layer"] == first_layer:
            key = (row["step"], row["request"])
            context[key] = min(context.get(key, row["position"]), row["position"])
    stepped = trace.routing().filter(pl.col("phase").cast(pl.String) != "prefill")
    tables = context_tables(stepped, trace.steps(), K, first_layer)

    decoding = [s for s in steps if s["num_tokens"] == s["num_drafts"] + 1 and (s["step"], s["request"]) in context]
    by_bucket: dict[int, list[dict[str, int]]] = defaultdict(list)
    for s in decoding:
        by_bucket[bucket(context[(s["step"], s["request"])])].append(s)
    assert sorted(by_bucket) == [0, 1], "the short prompts ran at ≤1K tokens of context, the long ones at 1-4K"
    got = {row["bucket"]: row for row in tables["acceptance"].to_dicts()}
    assert sorted(got) == [0, 1]
    for index, rows in by_bucket.items():
        row = got[index]
        assert row["request_steps"] == len(rows) > 0
        assert row["mean_context"] == pytest.approx(mean(context[(s["step"], s["request"])] for s in rows))
        for i in range(1, K + 1):
            assert row[f"rate_{i}"] == pytest.approx(sum(s["num_accepted"] >= i for s in rows) / len(rows))
        assert row["tokens_per_step"] == pytest.approx(mean(s["num_accepted"] for s in rows) + 1)
        rejected = [s["num_accepted"] + 1 for s in rows if s["num_drafts"] > 0 and s["num_accepted"] < s["num_drafts"]]
        assert row["first_rejected"] == (pytest.approx(mean(rejected)) if rejected else None)

    unique: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    for row in routing:
        if row["phase"] == "verify":
            unique[(row["step"], row["request"], row["layer"])].update(row["experts"])
    per_cell: dict[tuple[int, int], list[int]] = defaultdict(list)
    for (step, request, layer), experts in unique.items():
        per_cell[(bucket(context[(step, request)]), layer)].append(len(experts))
    got_experts = {(r["bucket"], r["layer"]): r for r in tables["experts"].to_dicts()}
    assert set(got_experts) == set(per_cell) and {b for b, _ in per_cell} == {0, 1}
    for cell, counts in per_cell.items():
        assert got_experts[cell]["windows"] == len(counts)
        assert got_experts[cell]["unique_experts"] == pytest.approx(mean(counts))

    per_step: dict[int, list[dict[str, int]]] = defaultdict(list)
    for s in steps:
        if (s["step"], s["request"]) in context:
            per_step[s["step"]].append(s)
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for step, rows in per_step.items():
        if all(s["num_tokens"] == s["num_drafts"] + 1 for s in rows):
            cell = (bucket(mean(context[(step, s["request"])] for s in rows)), len(rows))
            times[cell].append((rows[0]["t_end_ns"] - rows[0]["t_start_ns"]) / 1e6)
    got_times = {(r["bucket"], r["batch"]): r for r in tables["step_time"].to_dicts()}
    assert set(got_times) == set(times)
    for cell, durations in times.items():
        assert got_times[cell]["steps"] == len(durations)
        assert got_times[cell]["step_ms"] == pytest.approx(mean(durations))


@pytest.mark.vllm
def test_the_report_shows_the_tables_by_context_in_the_terminal_and_json(two_lengths: Path, tmp_path: Path) -> None:
    done = run_cli("report", str(two_lengths), "--k", str(K), "--json", "-o", str(tmp_path / "report.html"))
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout)["runs"][0]
    assert [row["context"] for row in run["by_context"]["acceptance"]] == ["≤1K", "1-4K"]
    assert run["by_context"]["k"] == K and run["by_context"]["share"] == 1.0
    (decision,) = json.loads(done.stdout)["decision"]  # named at the context it holds: the request-steps' mean
    rows = run["by_context"]["acceptance"]
    assert decision["context"]["request_steps"] == sum(r["request_steps"] for r in rows)
    assert decision["context"]["mean_tokens"] == pytest.approx(
        sum(r["mean_context"] * r["request_steps"] for r in rows) / sum(r["request_steps"] for r in rows))
    shown = run_cli("report", str(two_lengths), "--k", str(K), "-o", str(tmp_path / "again.html"))
    assert shown.returncode == 0 and "By context" in shown.stdout and "1-4K" in shown.stdout
    assert "at the context the trace ran at" in shown.stdout


@pytest.mark.vllm
def test_the_recording_says_what_a_token_of_context_holds_and_the_report_decides_per_context_from_it(
        two_lengths: Path, tmp_path: Path) -> None:
    """The manifest's KV bytes per token against the checkpoint's config (MLA: one latent of kv_lora_rank +
    qk_rope_head_dim per token and layer, at the model's dtype); the report then decides at two contexts (under the
    shipped preset, which predicts for Kimi-K2 and reads a token's KV bytes from its shape)."""
    manifest = open_trace(two_lengths).manifest
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[manifest.model.fields["dtype"]]
    assert manifest.model.fields["kv_bytes_per_token"] == (
        (CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"]) * itemsize * CONFIG["num_hidden_layers"])
    assert manifest.model.fields["max_position_embeddings"] == CONFIG["max_position_embeddings"]
    done = run_cli("report", str(two_lengths), "--k", str(K), "--context", "1024,32768",
                   "--json", "-o", str(tmp_path / "report.html"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)["decision"][0]["by_context"]
    assert sorted({row["context"] for row in found["per_batch"]}) == [1024, 32768]
