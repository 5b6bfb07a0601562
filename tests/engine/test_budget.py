"""Expert budgets enforced in real vLLM's verification on the CPU (eager), checked against an independent re-routing
of the router's own choice, which the trace keeps as candidates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from safetensors import safe_open

from click.testing import CliRunner

from vllm_fixtures import record_like_the_fixture, run_cli
from moetrace.cli import main
from moetrace.default_model import CONFIG, ensure_default_model
from moetrace.hooks.budget import LayerBudget, TokenGroups, restrict
from moetrace.hooks.planned import PlannedStep
from moetrace.trace.reader import open_trace

pytestmark = pytest.mark.xdist_group("recorded_trace")  # its report test reuses the shared recording

EXPERTS = int(CONFIG["n_routed_experts"])
TOP_K = int(CONFIG["num_experts_per_tok"])
BUDGET = 12
NEAR_TIE = 1e-5  # summed weights closer than this at the budget's edge: either expert may be kept
TOKEN_TIE = 1e-6  # selection scores this close at a token's top-k edge (bfloat16 logits on a GPU tie often)
# eager everywhere; on a GPU also torch.compile with CUDA graphs, where the budget runs inside the captured graphs
MODES = ["eager", *(["compiled"] if torch.cuda.is_available() else [])]


def selection_bias() -> dict[int, np.ndarray]:
    """Each MoE layer's selection bias, read from the checkpoint itself."""
    (weights,) = ensure_default_model().glob("*.safetensors")
    with safe_open(str(weights), "np") as tensors:
        return {int(name.split(".")[2]): tensors.get_tensor(name).astype(np.float64)
                for name in tensors.keys() if name.endswith("e_score_correction_bias")}


def top_k_among(row: dict[str, Any], allowed: set[int] | None) -> set[int] | None:
    """The token's top-k candidates (ranked by selection score) among ``allowed`` (None: all); None at a near-tie."""
    ranked = [(e, s) for e, s in zip(row["cand_experts"], row["cand_scores"]) if allowed is None or e in allowed]
    if len(ranked) > TOP_K and ranked[TOP_K - 1][1] - ranked[TOP_K][1] < TOKEN_TIE:
        return None
    return {e for e, _ in ranked[:TOP_K]}


def reroute(group: list[dict[str, Any]], bias: np.ndarray, budget: int) -> tuple[list[set[int] | None], bool]:
    """The experts each token of one budget group should use (None: undecidable, a near-tie), computed from the
    router's own choice (the first top-k of the recorded candidates, all experts, by selection score): the
    ``budget`` experts of largest summed renormalised weight are kept, and a token that used another is given the
    top-k of its candidates among them. Also whether the budget's edge is a near-tie."""
    summed = np.zeros(EXPERTS)
    for row in group:
        own = np.asarray(row["cand_experts"][:TOP_K])
        scores = np.asarray(row["cand_scores"][:TOP_K], dtype=np.float64) - bias[own]
        summed[own] += scores / scores.sum()
    order = np.argsort(-summed, kind="stable")
    kept = set(order[:budget].tolist())
    near_tie = summed[order[budget - 1]] - summed[order[budget]] < NEAR_TIE
    expected = []
    for row in group:
        own = set(row["cand_experts"][:TOP_K])
        expected.append(top_k_among(row, None if own <= kept else kept))
    return expected, near_tie


@pytest.fixture(scope="session", params=MODES)  # session: xdist interleaves modules on a worker
def budgeted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared recording's workload (n-gram k=3) with every layer limited to 12 experts per verification step,
    every expert kept as a candidate."""
    compiled = ["--compiled"] if request.param == "compiled" else []
    return record_like_the_fixture(tmp_path_factory.mktemp("budget"), "--budget", str(BUDGET),
                                   "--candidates", str(EXPERTS), *compiled)


@pytest.mark.vllm
def test_budgeted_verification_uses_at_most_the_budget_and_matches_an_independent_rerouting(budgeted: Path) -> None:
    trace = open_trace(budgeted)
    budget = trace.manifest.capture.budget
    assert budget is not None and budget.scope == "step" and set(budget.per_layer.values()) == {BUDGET}
    if trace.manifest.document["capture"]["mode"] != "eager":  # compiled: the budget ran inside CUDA graphs
        assert trace.manifest.document["capture_mechanisms"].get("graph", 0) > 0
    used = (trace.routing().filter(pl.col("phase") == "verify").explode("experts").group_by("step", "layer")
            .agg(pl.col("experts").n_unique()).collect())
    assert used.height > 20 and used["experts"].max() <= BUDGET, "every verification step, every layer"
    # a step whose engine ran a request-step the trace left out (run after its request's end: async
    # scheduling) routed tokens the rows lack: the budget there cannot be recomputed from the rows alone
    whole = (trace.steps().group_by("step").agg(rows=pl.len(), batch=pl.col("batch_size").first())
             .filter(pl.col("rows") == pl.col("batch")).select("step"))
    rows = (trace.routing().filter(pl.col("phase") == "verify").join(whole.collect().lazy(), on="step")
            .sort("step", "layer", "request", "position").collect())
    biases = selection_bias()
    checked = rerouted = ties = groups = 0
    for (step, layer), group in rows.group_by(["step", "layer"], maintain_order=True):
        groups += 1
        expected, near_tie = reroute(group.to_dicts(), biases[int(layer)], BUDGET)
        if near_tie:
            ties += 1
            continue
        for row, want in zip(group.to_dicts(), expected):
            if want is None:
                continue
            assert set(row["experts"]) == want, (step, layer, row["request"], row["position"])
            rerouted += set(row["cand_experts"][:TOP_K]) != want
            checked += 1
    # bfloat16 scores (a GPU) tie at the budget's edge in 5-20% of the groups, float32 (the CPU) in 1 of 200
    assert checked > 1000 and rerouted > checked // 10 and ties <= 0.25 * groups


@pytest.mark.vllm
def test_a_rerouted_token_keeps_the_routers_normalisation(budgeted: Path) -> None:
    rows = open_trace(budgeted).routing().filter(pl.col("phase") == "verify").collect()
    biases = selection_bias()
    for row in rows.head(2000).to_dicts():
        ids = np.asarray(row["experts"])
        ranked = list(row["cand_experts"])
        selection = np.asarray([row["cand_scores"][ranked.index(e)] for e in ids], dtype=np.float64)
        base = selection - biases[row["layer"]][ids]
        # the router renormalises its top-k (norm_topk_prob): each token's weights are its scores over their sum
        np.testing.assert_allclose(np.asarray(row["weights"], dtype=np.float64), base / base.sum(), rtol=2e-3)


@pytest.mark.vllm
def test_prefill_and_steps_without_drafts_keep_the_routers_own_choice(budgeted: Path) -> None:
    rows = open_trace(budgeted).routing().filter(pl.col("phase") != "verify").collect()
    assert rows.height > 1000
    own = [(set(r["experts"]), top_k_among(r, None)) for r in rows.to_dicts()]
    assert sum(want is not None and used != want for used, want in own) == 0
    assert sum(want is None for _, want in own) < 0.01 * len(own)


def greedy_tokens(trace: Path) -> dict[str, list[int]]:
    return {o["request_id"]: o["output_token_ids"]
            for o in map(json.loads, (trace / "outputs.jsonl").read_text().splitlines())}


def step_composition(trace: Path) -> pl.DataFrame:
    return (open_trace(trace).steps().select("step", "request", "num_tokens", "num_drafts", "num_accepted",
                                             "batch_size").sort("step", "request").collect())


@pytest.mark.vllm
def test_a_budgeted_recording_run_again_routes_and_generates_the_same(budgeted: Path, tmp_path: Path) -> None:
    """A step-scoped budget makes a step's requests choose its experts together, so a run's outputs depend on which
    requests share each step: every request is queued before the first step, so that is the same run to run (it
    was not while requests arrived as the engine stepped: three runs of this kind gave three outputs)."""
    compiled = [] if open_trace(budgeted).manifest.document["capture"]["mode"] == "eager" else ["--compiled"]
    again = record_like_the_fixture(tmp_path, "--budget", str(BUDGET), "--candidates", str(EXPERTS), *compiled)
    first = step_composition(budgeted)
    # the first step prefilled as many of the 10 requests as the batch holds
    assert first.filter(pl.col("step") == 0)["request"].to_list() == [0, 1, 2, 3]
    if not torch.cuda.is_available():  # the CPU's float32 kernels repeat bit for bit; a GPU's need not
        assert greedy_tokens(again) == greedy_tokens(budgeted)
        assert first.equals(step_composition(again))


@pytest.mark.vllm
def test_report_on_a_budget_sweep_compares_each_budget_with_the_unbudgeted_outputs(
        budgeted: Path, recorded_trace: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "budget-12").symlink_to(budgeted)
    (sweep / "budget-none").symlink_to(recorded_trace)  # the same workload, the router's own routing
    done = CliRunner().invoke(main, ["report", str(sweep), "--k", "3", "--json", "-o", str(tmp_path / "r.html")])
    assert done.exit_code == 0, done.output
    table = json.loads(done.stdout)["budget_sweep"]
    rows = {row["budget"]: row for row in table["rows"]}
    assert list(rows) == ["none", "12"] and table["batch"] == 4 and table["k"] == 3
    assert rows["12"]["limit"] == "12/step" and rows["none"]["limit"] == "none"
    unbudgeted, budgeted_tokens = greedy_tokens(recorded_trace), greedy_tokens(budgeted)
    same = sum(a == b for rid, tokens in unbudgeted.items() for a, b in zip(tokens, budgeted_tokens[rid]))
    assert rows["12"]["agreement"] == pytest.approx(same / sum(map(len, unbudgeted.values())))
    assert rows["none"]["agreement"] == 1.0 and rows["none"]["measured_vs_none"] == 1.0
    # the best budget: the largest predicted speedup among those that keep --min-agreement
    eligible = [name for name, row in rows.items() if row["agreement"] >= 0.99]
    assert table["best"] == max(eligible, key=lambda name: rows[name]["predicted"])
    assert table["measured_best"] == max(eligible, key=lambda name: rows[name]["measured_vs_none"])
    done = CliRunner().invoke(main, ["report", str(sweep), "--k", "3", "--min-agreement", "1", "-o",
                                     str(tmp_path / "r.html")])
    assert done.exit_code == 0 and "none ◀" in done.stdout and "12/step" in done.stdout


@pytest.mark.vllm
def test_a_budget_below_top_k_or_an_unreadable_budget_file_is_one_line(tmp_path: Path) -> None:
    done = run_cli("record", "--budget", "3", "--out", str(tmp_path / "t"))
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"error: --budget: every layer's budget must lie between the model's top-{TOP_K} and its {EXPERTS} experts"]
    (tmp_path / "b.json").write_text(json.dumps({"schema": "other"}))
    done = run_cli("record", "--budget", str(tmp_path / "b.json"), "--out", str(tmp_path / "t"))
    assert done.returncode != 0 and "not a budgets.json written by `moetrace budget`" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_each_request_window_keeps_its_own_budget_and_other_tokens_are_left_alone() -> None:
    """``restrict`` on its own, window scope: three requests of which two verify 3 drafts; brute force in numpy."""
    experts, top_k, budget = 32, 4, 6
    rng = np.random.default_rng(7)
    logits = torch.tensor(rng.normal(size=(12, experts)), dtype=torch.float32)
    bias = torch.tensor(rng.normal(scale=0.05, size=experts), dtype=torch.float32)
    scores = logits.sigmoid()
    ids = (scores + bias).topk(top_k, dim=1).indices
    chosen = scores.gather(1, ids)
    weights = chosen / chosen.sum(dim=1, keepdim=True)
    groups = TokenGroups(max_tokens=16, max_requests=4, scope="window", sizes=[experts, budget],
                         num_experts=experts, device=torch.device("cpu"))
    # tokens 0-3 and 5-8 verify; token 4 decodes
    groups.plan(PlannedStep(np.array([0, 4, 5, 9]), np.array([3, 0, 3]), ["a", "b", "c"]))
    new_weights, new_ids = restrict(groups, LayerBudget(1, "sigmoid", renormalize=True), logits, bias,
                                    weights, ids)
    base = scores.double().numpy()
    selection = base + bias.double().numpy()
    expected = ids.numpy().copy()
    for window in (range(0, 4), range(5, 9)):
        summed = np.zeros(experts)
        for token in window:
            own = ids[token].numpy()
            summed[own] += base[token, own] / base[token, own].sum()
        kept = set(np.argsort(-summed)[:budget].tolist())
        for token in window:
            if not set(ids[token].tolist()) <= kept:
                ranked = [e for e in np.argsort(-selection[token]).tolist() if e in kept]
                expected[token] = ranked[:top_k]
        assert len({e for token in window for e in new_ids[token].tolist()}) <= budget
    assert [set(row) for row in new_ids.tolist()] == [set(row) for row in expected.tolist()]
    assert (new_ids[4] == ids[4]).all() and (new_ids[9:] == ids[9:]).all() and not torch.equal(new_ids[:4], ids[:4])
    picked = base[np.arange(12)[:, None], new_ids.numpy()]
    np.testing.assert_allclose(new_weights.numpy(), picked / picked.sum(axis=1, keepdims=True), rtol=1e-5)
