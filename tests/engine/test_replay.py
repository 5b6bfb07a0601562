"""Routing replayed from a recorded trace (``moetrace record --replay-routing``), and one engine recording a sweep of
budgets (``moetrace_next_trace``), in real vLLM on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch

from trace_builder import Model, verify_tokens, write_trace
from vllm_fixtures import record_like_the_fixture, run_cli
from moetrace.default_model import CONFIG
from moetrace.hooks.budget import LayerBudget, TokenGroups, restrict
from moetrace.hooks.planned import PlannedStep
from moetrace.hooks.replay import ReplayedRouting, RoutingBank, strictly_ordered
from moetrace.trace.reader import open_trace

TOP_K = int(CONFIG["num_experts_per_tok"])
EXPERTS = int(CONFIG["n_routed_experts"])
TIE = 1e-5  # the trace's selection scores this close at a token's top-k edge: either expert may be chosen


def kept_tokens(trace: Path) -> tuple[dict[tuple[int, int, int], dict[str, Any]], dict[int, int], list[int]]:
    """The trace's last row at each (request, position, layer), the routed tokens of each request, its layers."""
    rows = open_trace(trace).routing().sort("step").group_by("request", "position", "layer").last().collect()
    first_layer = rows["layer"].min()
    lengths = rows.filter(pl.col("layer") == first_layer).group_by("request").len()
    return ({(r["request"], r["position"], r["layer"]): r for r in rows.to_dicts()},
            dict(zip(lengths["request"].to_list(), lengths["len"].to_list())), sorted(rows["layer"].unique()))


@pytest.mark.vllm
@pytest.mark.xdist_group("recorded_trace")
def test_replayed_routing_routes_every_token_as_the_trace_did_and_a_budget_still_holds(
        recorded_trace: Path, tmp_path: Path) -> None:
    replayed = record_like_the_fixture(tmp_path, "--replay-routing", str(recorded_trace), "--budget", "12",
                                       "--num-prompts", "4", "--max-tokens", "24")  # the last value of each wins
    manifest = open_trace(replayed).manifest.document
    assert manifest["capture"]["replayed_routing"] == str(recorded_trace.resolve())
    bank, lengths, layers = kept_tokens(recorded_trace)
    rows = open_trace(replayed).routing().collect()
    requests = len(lengths)
    same = ties = 0
    for row in rows.to_dicts():
        request = row["request"] % requests  # the i-th request replays the trace's i-th, position by position
        want = bank[(request, row["position"] % lengths[request], layers[layers.index(row["layer"]) % len(layers)])]
        chosen = set(want["cand_experts"][:TOP_K])
        if want["cand_scores"][TOP_K - 1] - want["cand_scores"][TOP_K] < TIE:
            ties += 1
            continue
        assert set(row["cand_experts"][:TOP_K]) == chosen, (row["step"], row["request"], row["position"])
        if row["phase"] != "verify":  # the budget re-routes only verification
            assert set(row["experts"]) == chosen, (row["step"], row["request"], row["position"])
            same += 1
    assert same > 1000 and ties < 0.01 * rows.height
    verify = rows.filter(pl.col("phase") == "verify").explode("experts").group_by("step", "layer").agg(
        used=pl.col("experts").n_unique())
    assert verify.height > 20 and verify["used"].max() <= 12


def test_a_trace_that_kept_too_few_candidates_cannot_be_replayed_in_one_line(tmp_path: Path) -> None:
    done = run_cli("record", "--replay-routing", str(tmp_path / "nowhere"), "--out", str(tmp_path / "t"))
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nowhere'}: not a moetrace trace (no manifest.json)"]
    model = Model(num_experts=EXPERTS, top_k=TOP_K)  # the default model's shape
    tokens = verify_tokens(np.random.default_rng(0), model, requests=2, steps=4, k=1, accept_prob=0.5)
    thin = write_trace(tmp_path / "thin", tokens, model, k=1)
    manifest = json.loads((thin / "manifest.json").read_text())
    manifest["capture"]["candidates"] = 4  # what the manifest says decides, before any engine starts
    (thin / "manifest.json").write_text(json.dumps(manifest))
    done = run_cli("record", "--replay-routing", str(thin), "--out", str(tmp_path / "t"))
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1
    assert "keeps 4 candidates per token; replaying needs at least the model's top-8" in done.stderr


def test_a_budget_that_leaves_a_token_none_of_its_replayed_candidates_weighs_the_kept_experts_evenly() -> None:
    """Three tokens of one verify window replay a bank of 4 candidates; tokens 0 and 1 pick experts 8 and 9, token 2
    picks 0 and 1, so a budget of 2 keeps 8 and 9: token 2 must move to experts it never had as candidates. Its
    router scores them alike (the floor), so each takes half its weight (by hand), not 0 / 0."""
    experts, top_k = 16, 2
    ids = torch.tensor([[[8, 9, 10, 11]], [[8, 9, 12, 13]], [[0, 1, 2, 3]]])  # [N=3, Lt=1, C=4]
    scores = torch.tensor([[[0.9, 0.8, 0.2, 0.1]], [[0.9, 0.7, 0.2, 0.1]], [[0.6, 0.5, 0.4, 0.3]]])
    bank = RoutingBank(ids=ids, scores=scores, starts=np.array([0]), lengths=np.array([3]))
    step = PlannedStep(np.array([0, 3]), np.array([2]), ["a"])  # one request verifying 2 drafts
    replay = ReplayedRouting(bank, max_tokens=8, positions=torch.arange(8))
    replay.plan(step, ())
    logits = replay.logits(0, torch.zeros(3, experts))
    routed = logits.sigmoid().topk(top_k, dim=1)  # the router: sigmoid, top-k, renormalised
    weights, chosen = routed.values / routed.values.sum(dim=1, keepdim=True), routed.indices
    groups = TokenGroups(max_tokens=8, max_requests=2, scope="window", sizes=[top_k], num_experts=experts,
                         device=torch.device("cpu"))
    groups.plan(step)
    new_weights, new_ids = restrict(groups, LayerBudget(0, "sigmoid", renormalize=True), logits, None, weights, chosen)
    assert [sorted(row) for row in new_ids.tolist()] == [[8, 9], [8, 9], [8, 9]]
    assert torch.equal(new_weights[:2], weights[:2])
    assert new_weights[2].tolist() == pytest.approx([0.5, 0.5])


def test_replayed_scores_keep_every_tokens_recorded_order_where_bfloat16_rounding_ties_them() -> None:
    """A GPU's router logits are bfloat16, whose 8 bits tie scores 0.004 apart: on an H100 (vLLM 0.34) the replay
    swapped a token's 8th and 9th experts. Each row must stay strictly decreasing, within a few bfloat16 steps of its
    rounded score (counted here on the bit patterns)."""
    scores = torch.tensor([[0.90001, 0.90000, 0.89999, 0.5, 0.49999, -0.2],
                           [1.25, 0.7500001, 0.75, 0.25, 0.1, 0.0]])
    ordered = strictly_ordered(scores, torch.bfloat16)
    assert ordered.dtype == torch.bfloat16
    assert (ordered[:, :-1] > ordered[:, 1:]).all()
    rounded = scores.to(torch.bfloat16)
    assert (scores.to(torch.bfloat16)[:, 1:] == rounded[:, :-1]).any()  # the input does tie in bfloat16
    steps = (rounded.view(torch.int16).int() - ordered.view(torch.int16).int()).abs()  # same sign: bits count steps
    assert steps.max() <= 2 and (steps[:, 0] == 0).all()
    assert torch.equal(strictly_ordered(scores, torch.float32), scores)  # float32 keeps them all apart already


def test_model_runner_v2_warm_up_requests_do_not_shift_which_trace_request_a_served_one_replays() -> None:
    """V2 warms its kernels up through ``prepare_inputs`` with requests of its own, which no trace holds: they take
    no trace request, so the first request served replays the trace's first, token by token, from its position."""
    from moetrace.hooks.vllm_api import RunnerV2

    def batch(*req_ids: str) -> SimpleNamespace:  # what V2's prepare_inputs returns, as planned_step reads it
        return SimpleNamespace(num_reqs=len(req_ids), req_ids=list(req_ids), num_draft_tokens_per_req=None,
                               query_start_loc_np=np.arange(0, 3 * len(req_ids) + 1, 3, dtype=np.int32))

    ids = torch.arange(5 * 8).reshape(5, 1, 8)  # [N=5 rows: the trace's request 0 (2 tokens), request 1 (3)]
    bank = RoutingBank(ids=ids, scores=strictly_ordered(torch.linspace(1, 0.1, 8).expand(5, 1, 8), torch.float32),
                       starts=np.array([0, 2]), lengths=np.array([2, 3]))
    positions = torch.tensor([0, 1, 2, 0, 1, 2])
    replay = ReplayedRouting(bank, max_tokens=8, positions=positions)
    for warm_up in (batch("_v2_mixed_warmup_decode_", "_v2_mixed_warmup_prefill_0_"), batch("_warmup_0_")):
        replay.plan(RunnerV2.planned_step(warm_up), ())
    replay.plan(RunnerV2.planned_step(batch("cmpl-1", "cmpl-2")), ())
    top = replay.logits(0, torch.zeros(6, 40)).topk(8, dim=1).indices.sort(dim=1).values
    # request 1 replays the trace's rows 0, 1, 0 (positions mod 2), request 2 its rows 2, 3, 4
    assert torch.equal(top, ids[[0, 1, 0, 2, 3, 4], 0])


SWEEP_IN_ONE_ENGINE = """
import dataclasses, json, sys
from pathlib import Path
from vllm import SamplingParams
from moetrace.recording.engine import build_llm, engine_prompts
from moetrace.hooks.options import RecordingOptions
from moetrace.recording.prompts import BUILTIN_PROMPTS
from moetrace.recording.record import RecordRequest, engine_settings, resolve_model

if __name__ == "__main__":
    out = Path(sys.argv[1])
    request = RecordRequest(model=None, ks=[3], batch_size=4, max_tokens=24, out=out, budgets=(("12", 12),))
    settings = engine_settings(request, resolve_model(None), 3, out / "b12", list(BUILTIN_PROMPTS)[:4],
                               out / "progress", budget=12)
    options = RecordingOptions(**settings["recording"])
    llm = build_llm(settings)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    closed, refused = [], None
    try:
        llm.generate(engine_prompts(settings), params, use_tqdm=False)
        for name, budget in (("none", None), ("b8", 8)):
            chosen = dataclasses.replace(options, out=str(out / name), run_id=name, budget=budget)
            closed += llm.collective_rpc("moetrace_next_trace", args=(chosen.to_text(),))
            llm.generate(engine_prompts(settings), params, use_tqdm=False)
        try:
            llm.collective_rpc("moetrace_next_trace", args=(dataclasses.replace(options, candidates=32).to_text(),))
        except Exception as exc:
            refused = str(exc)
        closed += llm.collective_rpc("moetrace_close")
    finally:
        llm.llm_engine.engine_core.shutdown()
    print(json.dumps({"complete": [c["complete"] for c in closed], "refused": refused}))
"""


@pytest.mark.vllm
def test_one_engine_records_a_sweep_of_budgets_each_into_its_own_complete_trace(tmp_path: Path) -> None:
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_IN_ONE_ENGINE)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["complete"] == [True, True, True]
    assert "a new trace keeps the engine's candidates" in result["refused"]
    for name, budget in (("b12", 12), ("none", None), ("b8", 8)):
        trace = open_trace(tmp_path / name)
        recorded = trace.manifest.capture.budget
        assert (recorded is None) == (budget is None) and (budget is None or set(recorded.per_layer.values()) == {
            budget})
        steps = trace.steps().collect()
        assert sorted(steps["request"].unique().to_list()) == [0, 1, 2, 3]  # each trace numbers its own requests
        rows = trace.routing().filter(pl.col("phase") == "verify").collect()
        used = rows.explode("experts").group_by("step", "layer").agg(n=pl.col("experts").n_unique())["n"]
        assert rows.height > 100 and used.max() <= (budget or TOP_K * 16)
        rerouted = sum(set(r["experts"]) != set(r["cand_experts"][:TOP_K]) for r in rows.to_dicts())
        # none: B = E, nothing re-routed (but for a near-tie at a token's top-k edge, 1 in 200 on the CPU)
        assert rerouted <= rows.height // 100 if budget is None else rerouted > rows.height // 10, (name, rerouted)
