"""``moetrace place``: a verification-aware placement of experts on EP ranks, checked against placements and scores
worked out by hand (co-occurring pairs, a 3-window score, the replica rule), against a brute force over every
balanced placement of 6 experts on 2 ranks, and through the command line (CliRunner and a subprocess)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt
import polars as pl
import pytest
from click.testing import CliRunner

from moetrace.analysis.placement import replicated_placement, round_robin_placement
from moetrace.analysis.verification_placement import (
    LayerWindows,
    PlacementScore,
    compare_placements,
    ranks_touched,
    route_windows,
    verification_placement,
)
from moetrace.analysis.predicates import DP_RANK_SHIFT
from moetrace.cli import main
from trace_builder import Model, verify_tokens, write_trace


def pair_windows(pairs: list[tuple[int, int]], windows: int) -> npt.NDArray[np.int64]:
    """picks [windows, 4]: window w's two tokens both pick the pair w mod len(pairs)."""
    picks = np.zeros((windows, 4), dtype=np.int64)
    for w in range(windows):
        picks[w, list(pairs[w % len(pairs)])] = 2
    return picks


def pair_trace(root: Path, pairs: list[tuple[int, int]]) -> Path:
    """4 experts, top-2, 2 MoE layers (1, 3 of 4 decoder layers), k = 1, 2 requests × 16 steps: every token of a
    (step, request) window picks the same pair, request r at step s the pair (r + s) mod 2."""
    model = Model(num_experts=4, top_k=2, layers=(1, 3))
    tokens = verify_tokens(np.random.default_rng(0), model, requests=2, steps=16, k=1, accept_prob=0.5)
    chosen = np.asarray([pairs[(r + s) % 2] for r, s in zip(tokens.request.tolist(), tokens.step.tolist())])
    tokens.experts = np.repeat(chosen[:, None, :], 2, axis=1).astype(np.uint16)
    return write_trace(root, tokens, model, k=1)


KIMI_BONUS = 5.0


def kimi_shaped_trace(root: Path, layers: int = 4, requests: int = 16, steps: int = 64, k: int = 3,
                      seed: int = 0) -> Path:
    """A Kimi-shaped synthetic trace (384 experts, top-8, MoE layers 1..layers) with correlated windows: per layer
    the experts fall into 48 fixed random clusters of 8 and have a fixed Zipf(1.6) popularity (capped at 50);
    each (step, request) window draws 2 clusters; each of its tokens scores every expert log(popularity) + Gumbel
    noise + 5 on its window's 16 cluster experts and picks the top 8 (``verify_tokens``' steps: 70% acceptance)."""
    model = Model(num_experts=384, top_k=8, layers=tuple(range(1, layers + 1)), name="kimi-shaped")
    rng = np.random.default_rng(seed)
    tokens = verify_tokens(rng, model, requests=requests, steps=steps, k=k, accept_prob=0.7)
    count = len(tokens.step)
    window = np.unique(tokens.step.astype(np.int64) * (requests + 1) + tokens.request, return_inverse=True)[1]
    experts = np.zeros((count, layers, 8), dtype=np.uint16)
    for layer in range(layers):
        popularity = np.log(rng.zipf(1.6, size=384).clip(max=50).astype(np.float64))
        clusters = rng.permutation(384).reshape(48, 8)
        topic = rng.integers(0, 48, size=(int(window.max()) + 1, 2))
        score = popularity[None, :] + rng.gumbel(size=(count, 384))
        score[np.repeat(np.arange(count), 16), clusters[topic[window]].reshape(count, 16).ravel()] += KIMI_BONUS
        experts[:, layer] = np.argsort(-score, axis=1)[:, :8]
    tokens.experts = experts
    tokens.weights = np.full((count, layers, 8), 0.125, dtype=np.float32)
    return write_trace(root, tokens, model, k=k)


def on_one_rank(physical: npt.NDArray[np.int64], ep: int) -> list[set[int]]:
    per = len(physical) // ep
    return [set(physical[r * per:(r + 1) * per].tolist()) for r in range(ep)]


def test_experts_that_always_appear_together_share_a_rank() -> None:
    """Experts {0, 1} always in the same windows, {2, 3} likewise, 2 ranks: each pair lands on one rank, so every
    window touches 1 rank; round robin ({0, 2}, {1, 3}) splits both pairs: 2 ranks a window (by hand)."""
    picks = pair_windows([(0, 1), (2, 3)], 20)
    request = np.arange(20) % 2
    physical = verification_placement(picks, 2, request=request, step=np.arange(20) // 2)
    assert sorted(map(sorted, on_one_rank(physical, 2))) == [[0, 1], [2, 3]]
    present = picks > 0
    assert ranks_touched(present, physical, 2, request).tolist() == [1] * 20
    round_robin = np.argsort(round_robin_placement(4, 2), kind="stable")  # slots: rank 0 {0, 2}, rank 1 {1, 3}
    assert round_robin.tolist() == [0, 2, 1, 3]
    assert ranks_touched(present, round_robin, 2, request).tolist() == [2] * 20


def rank_count(windows: list[set[int]], placement: tuple[set[int], ...]) -> int:
    return sum(sum(1 for held in placement if window & held) for window in windows)


@pytest.mark.parametrize("seed", range(25))
def test_local_search_reaches_the_brute_force_optimum_of_6_experts_on_2_ranks(seed: int) -> None:
    """Random windows of 2–4 of 6 experts, ranks touched alone (spread 0, no load cap): the ranks touched summed
    over the windows equal the least over all 10 balanced placements (3 experts a rank), counted by brute force."""
    rng = np.random.default_rng(seed)
    windows = [set(rng.choice(6, size=int(rng.integers(2, 5)), replace=False).tolist()) for _ in range(12)]
    picks = np.zeros((len(windows), 6), dtype=np.int64)
    for w, experts in enumerate(windows):
        picks[w, sorted(experts)] = 1
    best = min(rank_count(windows, (set(a), set(range(6)) - set(a))) for a in itertools.combinations(range(6), 3))
    physical = verification_placement(picks, 2, spread=0.0, max_load_ratio=float("inf"))
    assert sorted(physical.tolist()) == list(range(6))
    assert rank_count(windows, tuple(on_one_rank(physical, 2))) == best


def step_key(step: int) -> int:
    return step << DP_RANK_SHIFT


def test_held_out_scores_match_a_hand_count_of_three_windows() -> None:
    """Experts {0, 1} on rank 0, {2, 3} on rank 1. Step 1: window A (tokens: 0, 0, 2) touches 2 ranks, window B
    (1, 0) 1 rank; step 3: window C (3, 3) 1 rank. Ranks touched: (2 + 1 + 1) / 3. Busiest rank's unique experts:
    step 1 {0, 1 | 2} → 2, step 3 {| 3} → 1, mean 1.5. Tokens per rank: step 1 (4, 1) → mean 2.5 / max 4 = 0.625,
    step 3 (0, 2) → 1 / 2 = 0.5; balancedness 0.5625."""
    picks = np.asarray([[2, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 2]], dtype=np.uint8)
    held = LayerWindows(1, np.asarray([step_key(1), step_key(1), step_key(3)]), np.asarray([0, 1, 0]), picks)
    score = PlacementScore()
    score.add(held, np.asarray([0, 1, 2, 3]), 2)
    row = score.row("hand")
    assert row["windows"] == 3 and row["steps"] == 2
    assert row["ranks_touched"] == pytest.approx(4 / 3)
    assert row["busiest_rank_experts"] == pytest.approx(1.5)
    assert row["balancedness"] == pytest.approx(0.5625)


def test_a_replicated_expert_is_read_on_a_rank_its_window_already_touches() -> None:
    """Slots [0, 1 | 0, 2] (expert 0 on both ranks): window {0, 2} reads 0 on rank 1 beside 2 (slot 2), window
    {0, 1} on rank 0 (slot 0); window {0} alone goes to replica request mod 2: request 1 → slot 2, request 0 →
    slot 0."""
    present = np.asarray([[1, 0, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]], dtype=bool)
    used = route_windows(present, np.asarray([0, 1, 0, 2]), 2, np.asarray([0, 0, 1, 0]))
    assert used.astype(int).tolist() == [[0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0], [1, 0, 0, 0]]


def test_every_rank_keeps_its_slots_and_its_load_within_the_cap(tmp_path: Path) -> None:
    """384 experts, 8 redundant slots, 8 ranks, on Kimi-shaped windows: every rank holds 49 slots, replica counts
    as the balanced start gives them (extra replicas to the most picked per replica), and each rank's load (an
    expert's picks split over its replicas) at most 1.1 × the mean or the start's busiest rank."""
    from moetrace.analysis.window_rows import decode_and_verify
    from moetrace.analysis.verification_placement import layer_windows
    from moetrace.trace.reader import open_traces

    trace = open_traces(kimi_shaped_trace(tmp_path / "kimi", layers=1, requests=8, steps=24))[0]
    part = next(layer_windows(decode_and_verify(trace.routing()), 384))
    load = part.picks.sum(axis=0, dtype=np.int64)
    physical = verification_placement(part.picks, 8, 8, part.request, part.step)
    start = replicated_placement(load.tolist(), 8, 8)
    assert len(physical) == 392
    assert np.bincount(physical, minlength=384).tolist() == np.bincount(start, minlength=384).tolist()
    replicas = np.bincount(physical, minlength=384)

    def rank_loads(slots: npt.NDArray[np.int64]) -> list[float]:
        return [float(sum(load[e] / replicas[e] for e in slots[r * 49:(r + 1) * 49])) for r in range(8)]

    cap = max(1.1 * float(load.sum()) / 8, max(rank_loads(start)))
    assert max(rank_loads(physical)) <= cap + 1e-6
    assert physical.tolist() != start.tolist()  # it moved experts


def test_compare_scores_the_fitted_placement_on_odd_steps_beside_the_baselines() -> None:
    """Pairs {0, 1} and {2, 3}, windows of even and odd steps alike: fitted on the even ones, the placement touches
    1 rank per held-out window; round robin, given as a baseline, 2; each step holds one window of each pair, so
    its busiest rank reads 2 experts either way."""
    picks = pair_windows([(0, 1), (2, 3)], 24)
    step = np.asarray([step_key(s) for s in np.arange(24) // 2])
    windows = [LayerWindows(1, step, np.arange(24) % 2, picks.astype(np.uint8))]
    done = compare_placements(windows, [1], 4, 2, 0, {"round robin": np.asarray([[0, 2, 1, 3]])})
    rows = {row["placement"]: row for row in done.scores.iter_rows(named=True)}
    assert rows["round robin"]["windows"] == 12 and rows["moetrace"]["windows"] == 12
    assert rows["round robin"]["ranks_touched"] == 2.0 and rows["moetrace"]["ranks_touched"] == 1.0
    assert rows["round robin"]["busiest_rank_experts"] == 2.0 and rows["moetrace"]["busiest_rank_experts"] == 2.0
    assert sorted(map(sorted, on_one_rank(done.placement[0], 2))) == [[0, 1], [2, 3]]


def test_place_writes_eplb_and_sglang_files_and_prints_the_held_out_table(tmp_path: Path) -> None:
    """Pairs {0, 2} and {1, 3} (linear splits both): the table shows 2.00 ranks a window for linear and 1.00 for
    moetrace; the EPLB-style file holds the MoE layers' maps (logical map and replica counts matching the physical
    map, checked by hand), SGLang's file a row for each of the 4 decoder layers (dense ones in logical order);
    a second run without --force is refused."""
    trace = pair_trace(tmp_path / "pairs", [(0, 2), (1, 3)])
    done = CliRunner().invoke(main, ["place", str(trace), "--ep", "2"])
    assert done.exit_code == 0, done.output
    rows = {line.split("│")[1].strip(): line for line in done.output.splitlines() if line.count("│") >= 4}
    assert "2.00" in rows["linear"].split("│")[2] and "1.00" in rows["moetrace"].split("│")[2]
    assert "vLLM EPLB" in rows
    assert "next: python -m sglang.launch_server" in done.output
    doc = json.loads((tmp_path / "pairs.placement-ep2.json").read_text())
    assert doc["ep"] == 2 and doc["redundant"] == 0 and doc["layers"] == [1, 3]
    assert [row["placement"] for row in doc["held_out"]] == ["linear", "vLLM EPLB", "moetrace"]
    for physical, logical, replicas in zip(doc["physical_to_logical_map"], doc["logical_to_physical_map"],
                                           doc["logical_replica_count"]):
        assert sorted(map(sorted, on_one_rank(np.asarray(physical), 2))) == [[0, 2], [1, 3]]
        assert replicas == [physical.count(e) for e in range(4)]
        assert all([s for s in logical[e] if s >= 0] == [i for i, x in enumerate(physical) if x == e]
                   for e in range(4))
    sglang = json.loads((tmp_path / "pairs.placement-ep2.sglang-expert-location.json").read_text())
    assert list(sglang) == ["physical_to_logical_map"]
    assert [sglang["physical_to_logical_map"][layer] for layer in (1, 3)] == doc["physical_to_logical_map"]
    assert sglang["physical_to_logical_map"][0] == sglang["physical_to_logical_map"][2] == [0, 1, 2, 3]
    again = CliRunner().invoke(main, ["place", str(trace), "--ep", "2"])
    assert again.exit_code == 1 and "already exists (use --force to overwrite)" in again.output


@pytest.mark.parametrize("args, message", [
    (["--ep", "0"], "--ep 0: needs at least 1 rank"),
    (["--ep", "3"], "4 experts + 0 redundant do not split evenly over 3 ranks"),
    (["--ep", "2", "--redundant", "-1"], "--redundant -1: must be 0 or more"),
])
def test_bad_options_are_one_line_errors(tmp_path: Path, args: list[str], message: str) -> None:
    trace = pair_trace(tmp_path / "pairs", [(0, 1), (2, 3)])
    done = CliRunner().invoke(main, ["place", str(trace), *args])
    assert done.exit_code == 1 and message in done.output and "Traceback" not in done.output


def test_a_trace_without_speculation_is_refused_with_what_to_do(tmp_path: Path) -> None:
    model = Model(num_experts=4, top_k=2, layers=(1,))
    tokens = verify_tokens(np.random.default_rng(0), model, requests=2, steps=4, k=0, accept_prob=0.5)
    trace = write_trace(tmp_path / "k0", tokens, model, k=0)
    done = CliRunner().invoke(main, ["place", str(trace), "--ep", "2"])
    assert done.exit_code == 1 and "recorded at k = 0" in done.output and "moetrace record --k 3" in done.output


def test_place_as_a_subprocess_fails_in_one_line_without_a_traceback(tmp_path: Path) -> None:
    trace = pair_trace(tmp_path / "pairs", [(0, 1), (2, 3)])
    done = subprocess.run([sys.executable, "-m", "moetrace", "place", str(trace), "--ep", "3"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: --ep 3 --redundant 0: 4 experts + 0 redundant do not split evenly over " \
        "3 ranks"
    assert not list(tmp_path.glob("*.json"))


def test_the_verdict_names_the_placement_with_the_fewest_busiest_rank_experts_held_out() -> None:
    from moetrace.report.placements import held_out_verdict

    def scores(mine: tuple[float, float]) -> pl.DataFrame:
        return pl.DataFrame({"placement": ["linear", "vLLM EPLB", "moetrace"],
                             "ranks_touched": [7.42, 7.45, mine[0]], "busiest_rank_experts": [27.63, 27.07, mine[1]]})

    assert held_out_verdict(scores((7.20, 27.52))) == (
        "held out, vLLM EPLB reads fewer experts on the busiest rank per step (27.07 against 27.52), what a verify "
        "step waits for under EP; moetrace touches fewer ranks a window (7.20 against 7.45): use vLLM EPLB's "
        "placement unless dispatches dominate the step")
    assert held_out_verdict(scores((7.20, 26.00))) == (
        "held out, moetrace reads the fewest experts on the busiest rank per step (26.00) and touches 7.20 ranks "
        "a window")
