"""Issue 71, item 4, variable k: an adaptive schedule (DSpark's confidence-scheduled verification, vLLM PR #47808)
verifies a k of its own at every request-step. A Kimi-K3-shaped sweep (896 experts, top-16; k = 0 and an adaptive
k = 4 trace whose engine chose 0..4 drafts per request-step) through the analyses and the report, each figure
against the same figure computed here from the Parquet rows, by brute force."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from moetrace.analysis.acceptance import acceptance_by_position, acceptance_per_k
from moetrace.analysis.policies import MIN_GAIN
from moetrace.cli import main
from moetrace.trace.reader import open_trace
from trace_builder import Model, decode_tokens, scheduled_by_the_engine, verify_tokens, write_trace

MODEL = Model(num_experts=896, top_k=16, name="kimi-k3-shaped")
K = 4
REQUESTS, STEPS = 4, 40


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k = 0 and the adaptive k = 4 trace, 4 requests over 40 steps each (160 decoding request-steps)."""
    root = tmp_path_factory.mktemp("k3-adaptive")
    write_trace(root / "k0", decode_tokens(np.random.default_rng(0), MODEL, REQUESTS, STEPS), MODEL, k=0)
    tokens = verify_tokens(np.random.default_rng(K), MODEL, REQUESTS, STEPS, K, accept_prob=0.7, prefill=2,
                           variable_drafts=True)
    scheduled_by_the_engine(write_trace(root / f"k{K}", tokens, MODEL, k=K))
    return root


@pytest.fixture(scope="module")
def payload(sweep: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["report", str(sweep), "--json", "-o",
                                       str(tmp_path_factory.mktemp("out") / "r.html")])
    assert result.exit_code == 0, result.output[-3000:]
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def decoding(sweep: Path, k: int) -> list[dict[str, Any]]:
    """The decoding request-steps of the k trace's steps table (no prompt tokens in them)."""
    return [row for row in pl.read_parquet(sweep / f"k{k}" / "steps").to_dicts()
            if row["num_tokens"] == row["num_drafts"] + 1]


def reached(rows: list[dict[str, Any]], position: int) -> list[dict[str, Any]]:
    """The request-steps that verified draft ``position`` with every draft before it accepted."""
    return [row for row in rows if row["num_drafts"] >= position and row["num_accepted"] >= position - 1]


def fixed_k_tokens(rows: list[dict[str, Any]], k: int) -> float:
    """Tokens per step of a run verifying all k drafts: 1 + the rates, each the product of the acceptance of the
    drafts verified at positions 1..i once all before them were."""
    rate, total = 1.0, 1.0
    for i in range(1, k + 1):
        rate *= sum(row["num_accepted"] >= i for row in reached(rows, i)) / len(reached(rows, i))
        total += rate
    return total


def routing(sweep: Path) -> list[dict[str, Any]]:
    return pl.read_parquet(sweep / f"k{K}" / "routing").to_dicts()


def mean_union(groups: dict[Any, set[int]], layers: int) -> float:
    """The mean over layers of the mean unique experts of each layer's groups (keys end with the layer)."""
    per_layer: dict[int, list[int]] = {}
    for key, experts in groups.items():
        per_layer.setdefault(key[-1], []).append(len(experts))
    assert len(per_layer) == layers
    return float(np.mean([np.mean(sizes) for sizes in per_layer.values()]))


def test_acceptance_by_position_of_a_variable_k_trace_counts_only_request_steps_that_verified_the_position(
        sweep: Path) -> None:
    rows = decoding(sweep, K)
    assert len({row["num_drafts"] for row in rows}) == K + 1  # every k from 0 to 4 ran
    table = acceptance_by_position(open_trace(sweep / f"k{K}").steps(), K).to_dicts()
    for i, found in enumerate(table, start=1):
        accepted = sum(row["num_accepted"] >= i for row in rows)
        assert found["proposed"] == sum(row["num_drafts"] >= i for row in rows)
        assert found["acceptance_rate"] == pytest.approx(accepted / len(rows))
        assert found["conditional_rate"] == pytest.approx(accepted / len(reached(rows, i)))


def test_every_fixed_k_drawn_from_an_adaptive_schedule_verifies_all_k_drafts_at_the_rates_it_verified(
        sweep: Path) -> None:
    rows = decoding(sweep, K)
    table = acceptance_per_k({K: open_trace(sweep / f"k{K}").steps()}, range(K + 2), scheduled={K}).to_dicts()
    for found in table[1:K + 1]:
        assert found["tokens_per_step"] == pytest.approx(fixed_k_tokens(rows, found["k"]))
        assert (found["tokens_read"], found["acceptance_source"]) == (found["k"] + 1, "estimated")
    assert (table[K + 1]["tokens_read"], table[K + 1]["acceptance_source"]) == (K + 2, "extrapolated")
    # as it ran, the k = 4 trace gained 1 + its accepted drafts and read its own drafts
    [as_run] = acceptance_per_k({K: open_trace(sweep / f"k{K}").steps()}, [K]).to_dicts()
    assert as_run["tokens_per_step"] == pytest.approx(np.mean([1 + row["num_accepted"] for row in rows]))
    assert as_run["tokens_read"] == pytest.approx(np.mean([1 + row["num_drafts"] for row in rows]))


def test_the_report_prices_the_static_table_of_an_adaptive_trace_at_k_plus_1_tokens_and_checks_itself_clean(
        sweep: Path, payload: dict[str, Any]) -> None:
    run = payload["runs"][0]
    rows = decoding(sweep, K)
    per_k = {row["k"]: row for row in run["prediction"]["per_k"]}
    for k in range(1, K + 1):
        assert per_k[k]["tokens_per_step"] == pytest.approx(fixed_k_tokens(rows, k))
        assert per_k[k]["acceptance_source"] == "estimated"
    assert all(row["tokens_read"] == row["k"] + 1 for row in run["step_reads"])
    assert run["checks"] == [] and not any("self-check" in line for line in payload["warnings"])


def test_growth_of_a_variable_k_trace_reads_each_request_step_at_its_own_k(
        sweep: Path, payload: dict[str, Any]) -> None:
    """Measured per request-step, drafts capped at k: a request-step that verified d < k drafts reads d + 1."""
    measured = [row for row in payload["runs"][0]["growth"] if row["source"] == "measured"
                and row["scope"] == "request"]
    tokens = [row for row in routing(sweep) if row["phase"] != "prefill"]
    for k in range(K + 1):
        groups: dict[tuple[int, int, int], set[int]] = {}
        for row in tokens:
            if row["draft_pos"] <= k:
                groups.setdefault((row["step"], row["request"], row["layer"]), set()).update(row["experts"])
        found = {row["layer"]: row["unique_experts"] for row in measured if row["k"] == k}
        for layer in MODEL.layers:
            sizes = [len(experts) for key, experts in groups.items() if key[-1] == layer]
            assert found[layer] == pytest.approx(np.mean(sizes))


def test_one_requests_step_at_a_fixed_k_reads_k_plus_1_consecutive_accepted_tokens_from_each_anchor(
        sweep: Path, payload: dict[str, Any]) -> None:
    """What the static table prices at one request: counterfactual windows of the drafter's k drafts."""
    rows = routing(sweep)
    kept = [row for row in rows if row["phase"] == "decode" or (row["phase"] == "verify" and (
        row["draft_pos"] == 0 or row["accepted"]))]
    sequence = {(row["request"], row["layer"], row["position"]): set(row["experts"]) for row in kept}
    anchors = {(row["request"], row["position"]) for row in kept if row["draft_pos"] == 0}
    one = {row["k"]: row for row in payload["runs"][0]["step_reads"] if row["batch"] == 1}
    for k in range(1, K + 1):
        windows: dict[tuple[int, int, int], set[int]] = {}
        for request, start in anchors:
            for layer in MODEL.layers:
                tokens = [sequence.get((request, layer, start + i)) for i in range(k + 1)]
                if all(experts is not None for experts in tokens):
                    windows[(request, start, layer)] = set().union(*tokens)  # type: ignore[arg-type]
        assert one[k]["unique_experts"] == pytest.approx(mean_union(windows, len(MODEL.layers)))
        assert one[k]["union_source"] == "counterfactual"


def periods(steps: list[dict[str, Any]], requests: int) -> list[float]:
    """Start-to-start ms of consecutive steps of ``requests`` requests, every one decoding, the step right after a
    prefill left out (its period holds the prefill's)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in steps:
        by_step.setdefault(row["step"], []).append(row)

    def decoding_step(step: int) -> bool:
        return step in by_step and all(r["num_tokens"] == r["num_drafts"] + 1 for r in by_step[step])

    def after_prefill(step: int) -> bool:
        return step - 1 in by_step and not decoding_step(step - 1)

    return [(by_step[step + 1][0]["t_start_ns"] - by_step[step][0]["t_start_ns"]) / 1e6 for step in sorted(by_step)
            if decoding_step(step) and not after_prefill(step) and decoding_step(step + 1)
            and len(by_step[step]) == len(by_step[step + 1]) == requests]


def test_the_adaptive_schedule_is_set_beside_the_static_table_with_the_k_it_used_per_concurrency(
        sweep: Path, payload: dict[str, Any]) -> None:
    schedule = payload["runs"][0]["adaptive_schedule"]
    assert schedule["trace_k"] == K
    [row] = schedule["rows"]  # every step ran the 4 requests
    rows = decoding(sweep, K)
    assert row["batch"] == REQUESTS and row["request_steps"] == len(rows)
    assert row["mean_drafts"] == pytest.approx(np.mean([r["num_drafts"] for r in rows]))
    assert row["drafts_share"] == pytest.approx([np.mean([r["num_drafts"] == d for r in rows]) for d in range(K + 1)])
    assert row["tokens_per_step"] == pytest.approx(np.mean([1 + r["num_accepted"] for r in rows]))
    steps = pl.read_parquet(sweep / f"k{K}" / "steps").to_dicts()
    assert row["step_ms"] == pytest.approx(np.mean(periods(steps, REQUESTS)))
    baseline = np.mean(periods(pl.read_parquet(sweep / "k0" / "steps").to_dicts(), REQUESTS))
    assert row["measured_speedup"] == pytest.approx(row["tokens_per_step"] / row["step_ms"] * baseline)
    # the schedule's steps as they ran: every token each of its steps of 4 requests read
    unions: dict[tuple[int, int], set[int]] = {}
    for token in routing(sweep):
        if token["phase"] != "prefill":
            unions.setdefault((token["step"], token["layer"]), set()).update(token["experts"])
    assert row["unique_experts"] == pytest.approx(mean_union(unions, len(MODEL.layers)))
    assert row["union_source"] == "measured"
    # the static table's k: the fixed k <= 4 of largest predicted speedup at 4 requests, and which pays more
    static = {r["k"]: r["speedup"] for r in payload["runs"][0]["prediction"]["per_batch"]
              if r["batch"] == REQUESTS and r["k"] <= K}
    best = max(static, key=lambda k: (static[k], -k))
    assert row["table_k"] == (best if static[best] > 1 else 0)
    ratio = row["predicted_speedup"] / row["table_speedup"]
    assert row["pays_more"] == ("adaptive schedule" if ratio >= 1 + MIN_GAIN else
                                "static table" if 1 / ratio >= 1 + MIN_GAIN else "neither")
    [line] = schedule["verdict"]
    assert line.startswith(f"B={REQUESTS}: ") and f"k={row['table_k']}" in line


def test_the_terminal_report_shows_the_schedule_and_which_pays_more(sweep: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", str(sweep), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output[-3000:]
    assert "Adaptive schedule (the drafter drafts 4, each request-step verifies its own k)" in result.stdout
    assert f"B={REQUESTS}: " in result.stdout and "pays more" in result.stdout


def test_a_kimi_k3_shaped_sweep_is_reported_with_figures_at_its_896_experts_and_top_16(
        payload: dict[str, Any]) -> None:
    """Each step reads 16 experts a token: at one request a plain decode step reads 16 of the 896, a window of 5
    tokens (k = 4) at most 80; the uniform bound is that of 5 tokens' random top-16 sets."""
    run = payload["runs"][0]
    assert run["recorded_k"] == [0, K]
    one = {row["k"]: row for row in run["step_reads"] if row["batch"] == 1}
    assert one[0]["unique_experts"] == 16 and one[K]["unique_experts"] <= 80
    assert one[K]["uniform_bound"] == pytest.approx(896 * (1 - (1 - 16 / 896) ** (K + 1)))
