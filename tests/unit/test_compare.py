"""Two recordings compared row by row: identical rows, near-ties explained by how far the scores moved, and rows
recorded from the wrong token caught as unexplained."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from run_comparison import compare_runs, windows_after_finish
from trace_builder import Model, Tokens, decode_tokens, default_token_ids, verify_tokens, write_trace

MODEL = Model(num_experts=32, top_k=2, layers=(1,))


def write_run(root: Path, tokens: Tokens) -> Path:
    write_trace(root, tokens, MODEL, k=0)
    manifest = json.loads((root / "manifest.json").read_text())
    requests = sorted({int(r) for r in tokens.request})
    manifest["requests"] = [f"r{r}-0" for r in requests]
    (root / "manifest.json").write_text(json.dumps(manifest))
    outputs = []
    for r in requests:  # the builder's token at position p is p % 256: both runs generate the same tokens
        positions = sorted(int(p) for p, q in zip(tokens.position, tokens.request) if q == r)
        outputs.append({"request_id": f"r{r}", "prompt_token_ids": [p % 256 for p in range(positions[0])],
                        "output_token_ids": [p % 256 for p in positions]})
    (root / "outputs.jsonl").write_text("".join(json.dumps(o) + "\n" for o in outputs))
    return root


def runs(tmp_path: Path) -> tuple[Tokens, Tokens]:
    base = decode_tokens(np.random.default_rng(0), MODEL, requests=2, steps=8, candidates=4)
    assert base.cand_scores is not None and base.cand_experts is not None
    return base, dataclasses.replace(base, experts=base.experts.copy(), cand_experts=base.cand_experts.copy(),
                                     cand_scores=base.cand_scores.copy())


def swap_second_and_third(tokens: Tokens, row: int, second: float, third: float) -> None:
    """Make candidates 2 and 3 of ``row`` trade places with the given scores (the 3rd becomes a pick)."""
    assert tokens.cand_experts is not None and tokens.cand_scores is not None
    cand, scores = tokens.cand_experts[row, 0], tokens.cand_scores[row, 0]
    cand[[1, 2]] = cand[[2, 1]]
    scores[1], scores[2] = second, third
    tokens.experts[row, 0] = cand[:2]


def test_a_swap_no_larger_than_the_rows_score_movement_is_a_near_tie(tmp_path: Path) -> None:
    a, b = runs(tmp_path)
    assert a.cand_scores is not None
    row = 9
    kth = float(a.cand_scores[row, 0, 1])
    a.cand_scores[row, 0, 2] = kth - 0.01  # the 2nd and 3rd candidates 0.01 apart in run A ...
    swap_second_and_third(b, row, kth + 0.005, kth - 0.005)  # ... and swapped in run B, each moved by ~0.01
    result = compare_runs(write_run(tmp_path / "a", a), write_run(tmp_path / "b", b))
    assert result["rows_compared"] == len(a.step) and result["tokens_equal"]
    assert (result["rows_identical"], result["rows_near_tie"], result["rows_unexplained"]) == (len(a.step) - 1, 1, 0)
    assert result["rows_near_tie_within_ulps"] == 0  # 0.01 is far more than 2 bf16 ulps at these scores
    assert result["score_movement"]["differing_rows"]["max"] < 0.02
    assert result["rows_nearer_another_token"] == 0  # nearer its own token than the tokens around it


def test_a_row_recorded_from_another_token_is_unexplained(tmp_path: Path) -> None:
    a, b = runs(tmp_path)
    assert b.cand_experts is not None and b.cand_scores is not None and a.cand_experts is not None
    stale = next(r for r in range(1, len(a.step)) if not set(a.cand_experts[r, 0]) & set(a.cand_experts[0, 0]))
    b.experts[stale] = a.experts[0]  # run B's row holds another token's routing (a stale buffer)
    b.cand_experts[stale] = a.cand_experts[0]
    b.cand_scores[stale] = a.cand_scores[0] if a.cand_scores is not None else b.cand_scores[stale]
    result = compare_runs(write_run(tmp_path / "a", a), write_run(tmp_path / "b", b))
    assert result["rows_unexplained"] == 1 and result["rows_near_tie"] == 0
    (listed,) = result["unexplained_rows"]  # listed with what tells a misattributed row from a moved one
    assert (listed["request_id"], listed["position"]) == (f"r{int(a.request[stale])}", int(a.position[stale]))
    assert listed["common_candidates"] == 0 and listed["experts_swapped"] == 2  # shares nothing with its token's row
    assert result["rows_unexplained_sharing_most_candidates"] == 0
    assert result["rows_nearer_another_token"] == 1
    assert result["score_movement"]["next_token_in_a"]["median"] > 0


def test_runs_are_matched_on_the_callers_request_ids_not_on_request_indices(tmp_path: Path) -> None:
    """Model Runner V2 orders each step's requests its own way, so a trace may number the same requests differently."""
    a, b = runs(tmp_path)
    renumbered = dataclasses.replace(b, request=(1 - b.request).astype(b.request.dtype),  # request 0 <-> 1
                                     token=default_token_ids(b))  # each request's tokens as before
    b_dir = write_run(tmp_path / "b", renumbered)
    manifest = json.loads((b_dir / "manifest.json").read_text())
    manifest["requests"] = ["r1-0", "r0-0"]  # index 0 is the caller's r1 now, index 1 its r0
    (b_dir / "manifest.json").write_text(json.dumps(manifest))
    lines = [json.loads(line) for line in (b_dir / "outputs.jsonl").read_text().splitlines()]
    for line in lines:
        line["request_id"] = {"r0": "r1", "r1": "r0"}[line["request_id"]]
    (b_dir / "outputs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = compare_runs(write_run(tmp_path / "a", a), b_dir)
    assert result["rows_compared"] == len(a.step) and result["rows_identical"] == len(a.step)
    assert result["tokens_equal"]


def previous_tokens_routing_in_b(a: Tokens, b: Tokens) -> tuple[int, int]:
    """A stale buffer: run B's row (``row``) holds the previous position's (``before``) routing of run A, where the
    previous token ranks this token's 2nd and 3rd candidates the other way round. Returns (row, before)."""
    assert a.cand_experts is not None and a.cand_scores is not None
    rows = {(int(r), int(p)): i for i, (r, p) in enumerate(zip(a.request, a.position))}
    row, before = next((i, rows[(r, p - 1)]) for (r, p), i in rows.items() if (r, p - 1) in rows)
    a.cand_experts[before, 0] = a.cand_experts[row, 0][[0, 2, 1, 3]]
    a.cand_scores[before, 0] = a.cand_scores[row, 0]
    a.experts[before, 0] = a.cand_experts[before, 0][:2]
    for name in ("experts", "cand_experts", "cand_scores"):
        getattr(b, name)[row] = getattr(a, name)[before]
        getattr(b, name)[before] = getattr(a, name)[before]
    return row, before


def test_a_row_holding_the_previous_tokens_routing_is_nearer_that_token_though_a_near_tie(tmp_path: Path) -> None:
    """A stale buffer hands a row the previous position's routing: with every score recorded such a swap is always
    within the row's movement, so what gives it away is that it sits nearer the previous token's row."""
    a, b = runs(tmp_path)
    previous_tokens_routing_in_b(a, b)
    result = compare_runs(write_run(tmp_path / "a", a), write_run(tmp_path / "b", b))
    assert result["rows_unexplained"] == 0 and result["rows_near_tie"] == 1
    assert result["rows_nearer_another_token"] == 1


def test_a_row_nearer_a_neighbour_holding_the_same_token_id_is_counted_apart(tmp_path: Path) -> None:
    """A repeated token id (the same embedding, a similar context) can route as the row's own token does: a row
    nearer such a neighbour is listed, but not counted as nearer another token."""
    a, b = runs(tmp_path)
    row, before = previous_tokens_routing_in_b(a, b)
    same_token = default_token_ids(a)
    same_token[before] = same_token[row]  # the previous position holds the same token id
    a, b = dataclasses.replace(a, token=same_token), dataclasses.replace(b, token=same_token)
    result = compare_runs(write_run(tmp_path / "a", a), write_run(tmp_path / "b", b))
    assert result["rows_nearer_another_token"] == 0 and result["rows_nearer_a_same_token_neighbour"] == 1
    (listed,) = result["nearer_rows"]
    assert (listed["position"], listed["offset"], listed["same_token"]) == (int(a.position[row]), -1, True)
    assert listed["neighbour_movement"] == 0.0 < listed["movement"]


def test_a_window_verified_after_its_request_finished_is_found_from_the_final_lengths(tmp_path: Path) -> None:
    """Async scheduling verifies a request once more after its last token: vLLM discards that window and counts
    none of its drafts, so a comparison with its counters must leave it out."""
    tokens = verify_tokens(np.random.default_rng(1), MODEL, requests=2, steps=5, k=3, accept_prob=0.5)
    write_trace(tmp_path, tokens, MODEL, k=3)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["requests"] = ["r0-0", "r1-0"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    last_anchor = {r: max(int(p) for p, q, d in zip(tokens.position, tokens.request, tokens.draft_pos)
                          if q == r and d == 0) for r in (0, 1)}
    # r0 ended at its last window's anchor (that window came after its finish); r1 kept what its last window gave
    final = {0: last_anchor[0] + 1, 1: last_anchor[1] + 2}
    (tmp_path / "outputs.jsonl").write_text("".join(
        json.dumps({"request_id": f"r{r}", "prompt_token_ids": [0] * 4, "output_token_ids": [0] * (n - 4)}) + "\n"
        for r, n in final.items()))
    assert windows_after_finish(tmp_path).rows() == [(5, 0)]
