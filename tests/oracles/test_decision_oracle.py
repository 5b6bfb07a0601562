"""`moetrace report`'s recommended k per concurrency against an independent oracle (``decision_oracle.py``, which
shares no code with analysis/ or moetrace/report/), on synthetic sweeps with request-local routing; and the oracle
itself against hand-computed cases.

Each sweep records every k from 0 to K, each k its own recording with its own per-draft acceptance (as separate
runs of a drafter would), chosen with the cost so that at every asked concurrency the oracle's best k beats the
runner-up by at least ``MARGIN``: a report that estimates unions by sampling must not land on the other side.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import decision_oracle as oracle
from decision_oracle import Cost
from moetrace.cli import main
from trace_builder import Model, Tokens, verify_tokens, write_trace

MARGIN = 0.03  # the best k leads the runner-up by this much (relative speedup) at every designed concurrency


# ---------------------------------------------------------------- builders


def pooled(tokens: Tokens, model: Model, pools: np.ndarray, rng: np.random.Generator) -> Tokens:
    """``tokens`` routed with locality: every token picks top_k distinct experts of its request's pool."""
    count, layers, size = len(tokens.step), len(model.layers), pools.shape[1]
    pool = np.broadcast_to(pools[tokens.request.astype(int)][:, None, :], (count, layers, size))
    order = np.argsort(rng.random((count, layers, size)), axis=-1)[..., : model.top_k]
    weights = -np.sort(-rng.random((count, layers, model.top_k), dtype=np.float32), axis=-1)
    return dataclasses.replace(tokens, experts=np.take_along_axis(pool, order, axis=-1).astype(np.uint16),
                               weights=weights)


@dataclass
class Case:
    accept: dict[int, float]  # per recorded k (0..K): each draft's acceptance in that k's recording
    cost: Cost
    model: Model = field(default_factory=lambda: Model(num_experts=64, top_k=2))
    requests: int = 8  # per step (per DP rank)
    steps: int = 60
    pool: int = 5  # experts in each request's pool
    dp: int = 1
    silent: tuple[int, ...] = ()  # k recorded with no drafts at all
    batches: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0

    @property
    def k(self) -> int:
        return max(self.accept)


def write_sweep(case: Case, root: Path) -> Path:
    """One folder per k (``dp0/``, ``dp1/``, … inside it for DP); request r of rank d draws from pool [d, r] at
    every k, variable drafts (0..k per request-step) everywhere."""
    model = case.model
    pools = np.random.default_rng(case.seed).random((case.dp, case.requests, model.num_experts))
    pools = pools.argsort(axis=-1)[..., : case.pool]
    for k, accept in case.accept.items():
        for rank in range(case.dp):
            rng = np.random.default_rng([case.seed, k, rank])
            tokens = verify_tokens(rng, model, case.requests, case.steps, 0 if k in case.silent else k, accept,
                                   variable_drafts=True)
            folder = root / f"k{k}" / (f"dp{rank}" if case.dp > 1 else "")
            write_trace(folder, pooled(tokens, model, pools[rank], rng), model, k=k)
            if case.dp > 1:
                manifest = json.loads((folder / "manifest.json").read_text())
                manifest["parallel"].update(dp=case.dp, dp_rank=rank)
                (folder / "manifest.json").write_text(json.dumps(manifest))
    return root


def write_calibration(path: Path, cost: Cost) -> Path:
    """A calibration with one expert-layer curve (tp1, or ep{ep}) and no all-reduce measured."""
    config = f"ep{cost.ep}" if cost.ep > 1 else "tp1"
    path.write_text(json.dumps({
        "schema": "moetrace-calibration/1", "device": {"name": "test", "count": 1}, "shape": {"hidden_size": 64},
        "int4_estimate": [], "allreduce": {"measured": []},
        "experts": [{"config": config, "tp": 1, "ep": cost.ep, "format": "bf16", "weight_bits": 16,
                     "fit": {"c0_us": cost.c0_us, "per_expert_us": cost.per_expert_us,
                             "per_row_us": cost.per_row_us}}],
    }))
    return path


def run_report(case: Case, sweep: Path, tmp_path: Path) -> dict[str, Any]:
    args = ["report", str(sweep), "--k", str(case.k), "--calibration",
            str(write_calibration(tmp_path / "calibration.json", case.cost)),
            "--batch", ",".join(map(str, case.batches)), "--json", "-o", str(tmp_path / "report.html")]
    if case.cost.ep > 1:
        args += ["--ep", str(case.cost.ep)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload


def report_speedups(payload: dict[str, Any], batch: int) -> dict[int, float]:
    prediction = payload["runs"][0].get("prediction") or {}
    rows = prediction.get("per_batch") or []
    return {row["k"]: round(row["speedup"], 4) for row in rows if row.get("batch") == batch}


def agrees(case: Case, tmp_path: Path, well_sampled: tuple[int, ...] | None = None) -> dict[int, Any]:
    """Build the sweep, decide with the oracle and the report, and assert they agree at every concurrency the report
    calls "ok" (all of ``well_sampled``, default all); returns the oracle's decisions."""
    sweep = write_sweep(case, tmp_path / "sweep")
    recordings = oracle.read_sweep(sweep)
    assert sorted(recordings) == sorted(case.accept)
    assert all(rec.masks.shape[1] >= 50 for rec in recordings.values())  # decoding request-steps per k
    decided = oracle.decide(recordings, list(case.batches), case.cost)
    for batch in case.batches:
        assert oracle.margin(decided[batch][1]) >= MARGIN, (batch, decided[batch])  # the design is not knife-edge
    assert len({k for k, _ in decided.values()}) >= 2, decided  # the best k depends on B
    payload = run_report(case, sweep, tmp_path)
    assert payload["runs"][0]["checks"] == [], payload["runs"][0]["checks"]  # the self-check passes (DP = 2 too)
    rows = {row["batch"]: row for row in payload["decision"][0]["per_batch"]}
    mismatches = []
    for batch in case.batches:
        row = rows.get(batch) or {"status": "missing"}
        if batch in (well_sampled or case.batches):
            assert row.get("status", "ok") == "ok", (batch, row)
        if row.get("status", "ok") != "ok":  # too small a sample to decide on: the report says so, no k
            continue
        k, per_k = decided[batch]
        if row["k"] != k:
            oracle_speedups = {kk: round(v, 4) for kk, v in per_k.items()}
            mismatches.append(f"B={batch}: report k={row['k']}, oracle k={k}; speedup per k: oracle {oracle_speedups}, "
                              f"report {report_speedups(payload, batch)}")
    assert not mismatches, "\n".join(mismatches)
    return decided


# ---------------------------------------------------------------- the oracle by hand


def hand_trace(root: Path, model: Model, k: int, rows: list[tuple[int, int, str, int, bool | None, tuple[int, ...]]],
               layer2: tuple[int, int] | None = None) -> Path:
    """A trace from (step, request, phase, draft_pos, accepted, layer-1 experts) rows; layer 2 (if any) routes every
    token to ``layer2``."""
    experts = [[list(e)] + ([list(layer2)] if layer2 else []) for *_, e in rows]
    tokens = Tokens(
        step=np.asarray([r[0] for r in rows], dtype=np.uint32),
        request=np.asarray([r[1] for r in rows], dtype=np.uint32),
        position=np.arange(len(rows), dtype=np.uint32),
        phase=[r[2] for r in rows],
        draft_pos=np.asarray([r[3] for r in rows], dtype=np.uint8),
        accepted=[r[4] for r in rows],
        experts=np.asarray(experts, dtype=np.uint16),
        weights=np.ones((len(rows), len(model.layers), model.top_k), dtype=np.float32),
    )
    return write_trace(root, tokens, model, k=k, files=1)


def test_the_oracle_by_hand(tmp_path: Path) -> None:
    """Four windows at k=2 (layer 1): W1 {0,1,2} (1 draft, accepted), W2 {4,5,6,7} (2 rejected), W3 {0,3} (no
    draft), W4 {4,5,6} (2 accepted); a prefill chunk of experts {6,7} that must not count; layer 2 always {0,1}."""
    model = Model(num_experts=8, top_k=2, layers=(1, 2), shared_experts=1)
    root = hand_trace(tmp_path / "k2", model, 2, [
        (0, 0, "prefill", 0, None, (6, 7)), (0, 0, "prefill", 0, None, (6, 7)),
        (1, 0, "verify", 0, None, (0, 1)), (1, 0, "verify", 1, True, (0, 2)),
        (1, 1, "verify", 0, None, (4, 5)), (1, 1, "verify", 1, False, (4, 6)), (1, 1, "verify", 2, False, (7, 5)),
        (2, 0, "decode", 0, None, (0, 3)),
        (2, 1, "verify", 0, None, (4, 5)), (2, 1, "verify", 1, True, (5, 6)), (2, 1, "verify", 2, True, (4, 6)),
    ], layer2=(0, 1))
    rec = oracle.read_recording(root)
    assert rec.masks.shape == (2, 4, 8)  # the prefill chunk is no window
    assert oracle.tokens_per_step(rec) == pytest.approx(1 + 3 / 4)  # accepted 1, 0, 0, 2
    assert oracle.tokens_per_step(rec, conditional=True) == pytest.approx(1 + 2 / 3 + 1 / 2)
    assert oracle.tokens_read(rec) == pytest.approx(9 / 4)  # 2, 3, 1, 3 tokens
    # layer 1 by hand, layer 2 is 2 everywhere; only 2 steps, so unions are of windows drawn as a step holds them:
    # W1, W3 are request 0's (its prompt the prefill's), W2, W4 request 1's (no prefill rows: its own), as likely.
    # B=1: 3, 4, 2, 3 → 3; B=2, one of each request: 7, 6, 6, 5 → 6; B=3, both and one more of either, each
    # occurrence either of its windows: 104/16 = 6.5 (by enumeration); B=4 and above: all windows, 8
    for batch, layer1 in ((1, 3.0), (2, 6.0), (3, 6.5), (4, 8.0), (9, 8.0)):
        u, busiest, how = oracle.union(rec, batch)
        assert u == pytest.approx((layer1 + 2) / 2, abs=0.02) and busiest == pytest.approx(u), batch
        assert how == ("all windows" if batch >= 4 else "drawn")
    # EP=2 (experts 0-3 on rank 0): busiest of W1..W4 is 3, 4, 2, 3; of the pairs W1W2, W1W4, W3W2, W3W4 4, 3, 4, 3
    assert oracle.union(rec, 1, ep=2)[1] == pytest.approx((3.0 + 2) / 2, abs=0.02)
    assert oracle.union(rec, 2, ep=2)[1] == pytest.approx((3.5 + 2) / 2, abs=0.02)
    assert oracle.union(rec, 4, ep=2)[1] == pytest.approx((4 + 2) / 2)  # all windows: 4 and 4 on the two ranks
    cost = Cost(c0_us=10.0, per_expert_us=1.0, per_row_us=0.5)
    # the kernel over 2.5 experts and 1 × 2.25 × 2 rows, plus the shared expert at the one-token point: (10 + 1.5·2) / 2
    assert cost.step_us({"moe_layers": [1, 2], "top_k": 2, "shared_experts": 1}, 2.5, 2.5, 1, 2.25) == pytest.approx(
        2 * (10 + 2.5 + 0.5 * 1 * 2.25 * 2 + 6.5))
    ep2 = Cost(c0_us=10.0, per_expert_us=1.0, per_row_us=0.5, ep=2)
    # EP=2: the busiest rank's 3 experts and their share 3/4 of the rows, half the shared expert
    assert ep2.step_us({"moe_layers": [1, 2], "top_k": 2, "shared_experts": 1}, 4.0, 3.0, 2, 2.0) == pytest.approx(
        2 * (10 + 3 + 0.5 * 2 * 2.0 * 2 * 3 / 4 + 0.5 * 6.5))


def test_the_oracle_measures_unions_of_whole_steps_per_dp_rank(tmp_path: Path) -> None:
    """Five decode steps of two requests: request 0 on {0,1}; request 1 on {2,3} at odd steps, {0,1} at even ones
    (unions 4, 2, 4, 2, 4: 3.2); then a step mixing a decode with a prefill chunk (not a whole decoding step).
    Drawn at random, two of the windows would give less; as two DP ranks, each rank's steps stay its own."""
    model = Model(num_experts=8, top_k=2, layers=(1,))
    rows: list[tuple[int, int, str, int, bool | None, tuple[int, ...]]] = []
    for step in range(1, 6):
        rows += [(step, 0, "decode", 0, None, (0, 1)), (step, 1, "decode", 0, None, (2, 3) if step % 2 else (0, 1))]
    rows += [(6, 0, "decode", 0, None, (2, 3)), (6, 2, "prefill", 0, None, (4, 5)), (6, 2, "prefill", 0, None, (6, 7))]
    rec = oracle.read_recording(hand_trace(tmp_path / "one", model, 0, rows))
    assert len(rec.full_steps) == 5 and rec.masks.shape[1] == 11
    assert oracle.union(rec, 2) == pytest.approx((16 / 5, 16 / 5, "measured"))
    # B=1: no step ran one request; the 11 windows: 7 on {0,1}, 4 on {2,3}
    assert oracle.union(rec, 1)[0] == pytest.approx(2.0)
    for rank in (0, 1):
        hand_trace(tmp_path / "dp" / f"dp{rank}", model, 0, rows)
    both = oracle.read_recording(tmp_path / "dp")
    assert len(both.full_steps) == 10 and oracle.union(both, 2)[2] == "measured"
    assert oracle.union(both, 2)[0] == pytest.approx(16 / 5)
    # B=4 is no rank's step: one window of each of the 4 requests (no prefill rows: each its own prompt); request
    # 0 of a rank reads {0,1} in 5 of its 6 windows, request 1 in 2 of its 5, {2,3} in the others
    drawn = 2 * (1 - (1 / 6) ** 2 * (3 / 5) ** 2) + 2 * (1 - (5 / 6) ** 2 * (2 / 5) ** 2)
    u, busiest, how = oracle.union(both, 4)
    assert (u, busiest, how) == (pytest.approx(drawn, abs=0.03), u, "drawn")


def test_the_decision_rule() -> None:
    assert oracle.best_k({0: 1.0, 1: 1.2, 2: 1.2}) == 1  # ties to the smaller k
    assert oracle.best_k({0: 1.0, 1: 0.9, 2: 0.95}) == 0  # none exceeds 1
    assert oracle.best_k({0: 1.0, 1: 1.0}) == 0
    assert oracle.margin({0: 1.0, 1: 1.1, 2: 1.21}) == pytest.approx(0.1)
    assert oracle.margin({0: 1.0, 1: 0.9}) == pytest.approx(1 / 0.9 - 1)


def test_the_union_rule_matches_enumeration(tmp_path: Path) -> None:
    """One prompt (every request the same token ids): Σ_e 1 − (1 − n_e/N)^B against every B-tuple of windows. Three
    prompts of three requests each: the Monte Carlo mean against every set of B distinct prompts (their windows
    are equally many, so every set alike) with every window of each, and past three prompts every prompt and more."""
    model = Model(num_experts=12, top_k=2, layers=(1,))
    tokens = verify_tokens(np.random.default_rng(5), model, requests=3, steps=2, k=2, accept_prob=0.5,
                           variable_drafts=True)
    tokens = dataclasses.replace(tokens, token=tokens.position.astype(np.uint32))
    rec = oracle.read_recording(write_trace(tmp_path / "one", tokens, model, k=2))
    masks = rec.masks[0]
    for batch in (2, 3):
        unions = [masks[list(t)].any(axis=0).sum() for t in itertools.product(range(len(masks)), repeat=batch)]
        assert oracle.union(rec, batch)[0] == pytest.approx(np.mean(unions))
    tokens = verify_tokens(np.random.default_rng(6), model, requests=9, steps=2, k=2, accept_prob=0.5)
    tokens = dataclasses.replace(tokens, token=(tokens.request % 3 * 100 + tokens.position).astype(np.uint32))
    rec = oracle.read_recording(write_trace(tmp_path / "three", tokens, model, k=2))
    masks, members = rec.masks[0], [np.flatnonzero(rec.prompt == p) for p in range(3)]
    assert sorted(len(m) for m in members) == [6, 6, 6]
    for batch in (2, 3):
        unions = [masks[list(w)].any(axis=0).sum() for ps in itertools.combinations(range(3), batch)
                  for w in itertools.product(*(members[p] for p in ps))]
        assert oracle.union(rec, batch)[0] == pytest.approx(np.mean(unions), abs=0.05)
    # 5 requests over 3 prompts: every prompt once and two of them again, each occurrence any of its windows
    unions = [masks[list(w)].any(axis=0).sum() for extra in itertools.combinations(range(3), 2)
              for w in itertools.product(*(members[p] for p in (0, 1, 2, *extra)))]
    assert oracle.union(rec, 5)[0] == pytest.approx(np.mean(unions), abs=0.05)


# ---------------------------------------------------------------- the report against the oracle


# Acceptances and costs (c0, per expert, per row µs) found by a search over the oracle's margins; all but ep4 also
# decide differently at some B under the old rules (conditional rates, (k+1)·B rows per step).
CASES = {
    "variable-drafts": Case(accept={0: 0.0, 1: 0.9, 2: 0.3, 3: 0.7}, cost=Cost(40.0, 1.0, 11.12)),
    "dp2": Case(accept={0: 0.0, 1: 0.9, 2: 0.7, 3: 0.7}, cost=Cost(40.0, 1.0, 15.47), requests=4, dp=2),
    "ep4": Case(accept={0: 0.0, 1: 0.3, 2: 0.3, 3: 0.5}, cost=Cost(40.0, 1.0, 14.9, ep=4)),
    "shared-experts": Case(accept={0: 0.0, 1: 0.9, 2: 0.3, 3: 0.7}, cost=Cost(80.0, 1.0, 14.84),
                           model=Model(num_experts=64, top_k=2, shared_experts=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_report_recommends_the_oracles_k(name: str, tmp_path: Path) -> None:
    agrees(CASES[name], tmp_path)


def test_a_k_that_drafted_nothing_does_not_win(tmp_path: Path) -> None:
    case = Case(accept={0: 0.0, 1: 0.9, 2: 0.0, 3: 0.7}, silent=(2,), cost=Cost(40.0, 1.0, 11.12))
    decided = agrees(case, tmp_path)
    assert all(k != 2 for k, _ in decided.values())
    assert oracle.tokens_per_step(oracle.read_recording(tmp_path / "sweep" / "k2")) == 1.0


def test_a_concurrency_above_the_windows_unions_them_all(tmp_path: Path) -> None:
    case = Case(accept={0: 0.0, 1: 0.5, 2: 0.5, 3: 0.5}, cost=Cost(10.0, 1.0, 0.09), requests=2, steps=30,
                batches=(1, 512))  # 60 windows per k
    agrees(case, tmp_path, well_sampled=(1,))
    assert all(oracle.union(rec, 512)[2] == "all windows" for rec in oracle.read_sweep(tmp_path / "sweep").values())


def test_conditional_acceptance_rates_would_decide_otherwise(tmp_path: Path) -> None:
    """With 0..k drafts per request-step, accepted-at-i over proposed-at-i overstates the tokens per step; the report
    must decide on the unconditional ones."""
    case = Case(accept={0: 0.0, 1: 0.7, 2: 0.5, 3: 0.7}, cost=Cost(80.0, 1.0, 16.76))
    decided = agrees(case, tmp_path)
    conditional = oracle.decide(oracle.read_sweep(tmp_path / "sweep"), list(case.batches), case.cost,
                                conditional=True)
    assert any(conditional[b][0] != decided[b][0] for b in case.batches), (conditional, decided)


def test_a_k_the_sweep_left_out_reads_as_far_as_its_drafter_proposed(tmp_path: Path) -> None:
    """A sweep of k = 0 and 3 alone (0..3 drafts per request-step): the report decides on k = 1 and 2 too, from the
    k = 3 trace's windows as long as its drafter proposed, and picks the oracle's k. With full windows of k + 1
    accepted tokens for them (the old rule) the oracle would not speculate at one request."""
    case = Case(accept={0: 0.0, 3: 0.4}, cost=Cost(2.0, 1.0, 0.25), pool=40)  # found by a search, as CASES
    decided = agrees(case, tmp_path)
    assert decided[1][0] == 1  # a k the sweep did not record
    full = oracle.decide(oracle.read_sweep(tmp_path / "sweep"), list(case.batches), case.cost, full_windows=True)
    assert full[1][0] == 0, full


def test_the_oracles_windows_by_hand(tmp_path: Path) -> None:
    """One request at K = 3, each kept token on its own two experts (2p, 2p + 1), rejected drafts on 30 and 31.
    Request-steps (anchor: proposed, accepted): 4: 1, 1; 6: 3, 1; 8: 0; 9: 3, 3; 13: 0. At k = 2 they propose
    1, 2, 0, 2, 0 and read 2, 3, 1, 3, 1 tokens (anchor 6: 6, 7 and the next anchor 8); at k = 5, past K, 1, 5
    (capped at K), 0, 5, 0: anchor 9's window (9..14) runs past the last kept token, 13."""
    model = Model(num_experts=32, top_k=2, layers=(1,))
    rows: list[tuple[int, int, str, int, bool | None, tuple[int, ...]]] = []
    positions: list[int] = []
    for step, (anchor, drafts, kept) in enumerate([(4, 1, 1), (6, 3, 1), (8, 0, 0), (9, 3, 3), (13, 0, 0)], 1):
        for j in range(drafts + 1):
            accepted = None if j == 0 else j <= kept
            rows.append((step, 0, "verify" if drafts else "decode", j, accepted,
                         (30, 31) if accepted is False else (2 * (anchor + j), 2 * (anchor + j) + 1)))
            positions.append(anchor + j)
    root = hand_trace(tmp_path / "k3", model, 3, rows)
    table = pq.read_table(root / "routing" / "part-00000.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index("position"), "position",
                                    pa.array(positions, pa.uint32())), root / "routing" / "part-00000.parquet")
    rec = oracle.read_recording(root)
    at_two = oracle.counterfactual({3: rec}, 2)
    assert sorted(at_two.masks[0].sum(axis=1).tolist()) == [2, 2, 4, 6, 6]
    assert oracle.tokens_read(at_two) == pytest.approx((2 + 3 + 1 + 3 + 1) / 5)
    assert oracle.tokens_per_step(at_two) == pytest.approx(1 + (1 + 1 + 0 + 2 + 0) / 5)
    at_five = oracle.counterfactual({3: rec}, 5)
    assert sorted(at_five.masks[0].sum(axis=1).tolist()) == [2, 2, 4, 12]
    assert oracle.tokens_read(at_five) == pytest.approx((2 + 6 + 1 + 6 + 1) / 5)
    full = oracle.counterfactual({3: rec}, 2, full_windows=True)  # positions 6-8, 9-11: 3 tokens each
    assert full.masks[0].sum(axis=1).tolist() == [6, 6]
