"""Two recordings of the same prompts compared row by row, and a recording checked against its own router logits.

Used to prove that a capture mechanism records the truth: eager against compiled (CUDA graphs) on the same
prompts, greedy, up to where the generated tokens diverge; and every recorded row against the top-k of the
selection scores that the wrapper computed from the same router logits in float32 (``--candidates``).

A row whose expert set differs is a *near-tie* when every swapped expert's selection score lies, in each run's own
scores, within the tolerance of that run's K-th score: 2 bfloat16 ulps (two kernels rounding the same logits), or,
when the two runs' scores for the same experts moved further than that (bf16 hidden states computed by different
kernels: eager and compiled fuse differently), twice the row's own movement, the largest change of any candidate's
score between the runs (a swap takes a gap that the two experts' changes close). Each run choosing the top-k of
its own scores is what ``reference_check`` proves; the movement statistics say how far the scores moved: rounding
moves them by a few ulps, a row recorded from the wrong token or a stale buffer by the scores' whole spread. Any
other difference is *unexplained*; each is listed, with how many of its top-C candidates it shares with the other
run's row: a row whose hidden state really moved (deep layers, where a run's different rounding has accumulated)
keeps most of them, a row recorded from another token shares few (``next_token_common_candidates_in_a``: each row
of run A against the next position's, measured in the same comparison).

With every expert's score recorded (``--candidates`` = experts), the movement is the exact largest change of the
row's score vector, and a run that picks the top-k of its own scores can only swap experts within twice that: every
differing row is then a near-tie by construction, and what tells a moved row from a misattributed one is where it
moved: ``rows_nearer_another_token`` counts differing rows of run B that are not nearer (in score movement) to their
own token's row of run A than to the rows of the other tokens around it (``NEIGHBOURS`` positions either side, same
request and layer: where a stale buffer or a shifted step layout would have taken them from), or that share no
candidate with their own token's row. A neighbour holding the same token id is no other token: in a small
random-weight model its hidden state, and so its scores, can lie as near as rounding moves them (such rows are
counted apart, ``rows_nearer_a_same_token_neighbour``). Every row counted is listed (``nearer_rows``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moetrace.trace.reader import open_trace, read_manifest

# Float32 reference against the router's own kernel on the same logits: both compute sigmoid + bias in float32,
# so only summation order can differ.
REFERENCE_TOLERANCE = 1e-4
MAX_ROWS_LISTED = 1000  # unexplained rows listed one by one in a comparison
NEIGHBOURS = 4  # positions either side that a differing row must be farther from than from its own token


def bf16_tie_tolerance(kth_score: float, ulps: int = 2) -> float:
    """``ulps`` bfloat16 units in the last place at the K-th score's magnitude (8 significant bits)."""
    return ulps * 2.0 ** (math.floor(math.log2(max(abs(kth_score), 1e-30))) - 7)


def load_outputs(trace_dir: Path) -> dict[int, dict[str, Any]]:
    """vLLM's outputs keyed by the trace's request index (worker ids are "<external id>-<suffix>")."""
    index = {rid.rsplit("-", 1)[0]: i for i, rid in open_trace(trace_dir).request_ids().items()}
    outputs = [json.loads(line) for line in (trace_dir / "outputs.jsonl").read_text().splitlines()]
    return {index[o["request_id"]]: o for o in outputs}


def windows_after_finish(trace_dir: Path) -> pl.DataFrame:
    """(step, request) of the verification windows that vLLM ran for a request it had already finished, as the
    caller's outputs (``outputs.jsonl``) show: their anchor lies at or past the final sequence's last token. Async
    scheduling schedules each step before the last one's tokens are known, so a request that has just reached its
    last token is verified once more; vLLM discards that window's tokens and counts none of its drafts. The rows are
    kept (the GPU did route them); a comparison with vLLM's counters leaves these windows out."""
    trace = open_trace(trace_dir)
    final_length = pl.DataFrame(
        [(index, len(o["prompt_token_ids"]) + len(o["output_token_ids"]))
         for index, o in load_outputs(trace_dir).items()],
        schema={"request": pl.UInt32, "final_length": pl.Int64}, orient="row")
    layer = trace.manifest.model.moe_layers[0]
    anchors = (trace.routing().filter(pl.col("layer") == layer)
               .group_by("step", "request").agg(anchor=pl.col("position").min().cast(pl.Int64)).collect())
    verified = trace.steps().filter(pl.col("num_drafts") > 0).select("step", "request").collect()
    return (verified.join(anchors, on=["step", "request"]).join(final_length, on="request")
            .filter(pl.col("anchor") >= pl.col("final_length") - 1).select("step", "request").sort("step", "request"))


def agreeing_prefix(a_dir: Path, b_dir: Path) -> pl.DataFrame:
    """Per request (the caller's id): how many leading tokens (prompt + output) the two runs share, and the prompt
    length. Runs are matched on the caller's ids, not on request indices: a trace numbers requests in the order its
    runner first scheduled them, and Model Runner V2 orders each step's requests its own way."""
    a_outputs, b_outputs = ({o["request_id"]: o
                             for o in map(json.loads, (d / "outputs.jsonl").read_text().splitlines())}
                            for d in (a_dir, b_dir))
    rows = []
    for request_id, a in a_outputs.items():
        x = a["prompt_token_ids"] + a["output_token_ids"]
        b = b_outputs[request_id]
        y = b["prompt_token_ids"] + b["output_token_ids"]
        agree = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        rows.append({"request_id": request_id, "agree": agree, "prompt": len(a["prompt_token_ids"])})
    return pl.DataFrame(rows, schema={"request_id": pl.String, "agree": pl.Int64, "prompt": pl.Int64})


def in_sequence_rows(trace_dir: Path) -> pl.DataFrame:
    """Rows of tokens in the final sequence (prompt, decoded, anchors and accepted drafts), with the caller's id of
    each row's request (vLLM's worker ids are "<caller's id>-<suffix>")."""
    trace = open_trace(trace_dir)
    ids = trace.request_ids()
    callers = pl.DataFrame({"request": list(ids), "request_id": [rid.rsplit("-", 1)[0] for rid in ids.values()]},
                           schema={"request": pl.UInt32, "request_id": pl.String})
    rows = trace.routing().filter(pl.col("accepted").is_null() | pl.col("accepted")).collect()
    return rows.join(callers, on="request")


def score_movement(cand_a: list[int], scores_a: list[float], cand_b: list[int], scores_b: list[float]) -> float:
    """The largest change of one expert's selection score between two runs, over the candidates both listed (0
    when they list none in common: then nothing bounds a swap but rounding)."""
    b = dict(zip(cand_b, scores_b))
    changes = [abs(score - b[e]) for e, score in zip(cand_a, scores_a) if e in b]
    return max(changes, default=0.0)


def _swapped_within(experts: list[int], other: list[int], cand_experts: list[int], cand_scores: list[float],
                    top_k: int, ulps: int, movement: float) -> bool:
    swapped = set(experts) ^ set(other)
    scores = dict(zip(cand_experts, cand_scores))
    kth = cand_scores[top_k - 1]
    tolerance = max(bf16_tie_tolerance(kth, ulps), 2.0 * movement)
    return all(e in scores and abs(scores[e] - kth) <= tolerance for e in swapped)


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    array = np.asarray(values)
    return {"median": float(np.median(array)), "p99": float(np.quantile(array, 0.99)), "max": float(array.max())}


def compare_runs(a_dir: Path, b_dir: Path, ulps: int = 2) -> dict[str, Any]:
    """Rows of run B against run A on (request, position, layer), up to each request's divergence."""
    limits = agreeing_prefix(a_dir, b_dir)
    a = in_sequence_rows(a_dir).join(limits, on="request_id").filter(pl.col("position") < pl.col("agree"))
    joined = in_sequence_rows(b_dir).join(a, on=["request_id", "position", "layer"], suffix="_a")
    top_k = read_manifest(a_dir).model.top_k
    has_candidates = "cand_experts" in joined.columns
    identical = near_tie = within_ulps = sharing_most = 0
    movements: list[float] = []
    differing_movements: list[float] = []
    unexplained: list[dict[str, Any]] = []
    next_movements, next_common = next_token_rows(a) if has_candidates else ([], [])
    a_rows = {(r["request_id"], r["layer"], r["position"]): (r["token"], r["cand_experts"], r["cand_scores"])
              for r in a.select("request_id", "layer", "position", "token", "cand_experts", "cand_scores")
              .iter_rows(named=True)} if has_candidates else {}
    nearer: list[dict[str, Any]] = []
    for row in joined.iter_rows(named=True):
        movement = (score_movement(row["cand_experts"], row["cand_scores"], row["cand_experts_a"],
                                   row["cand_scores_a"]) if has_candidates else 0.0)
        movements.append(movement)
        if set(row["experts"]) == set(row["experts_a"]):
            identical += 1
            continue
        differing_movements.append(movement)
        if not has_candidates:
            continue
        nearest = nearest_neighbour(row, movement, a_rows)
        if nearest is not None:
            nearer.append(nearest)
        pairs = (("", "_a"), ("_a", ""))
        if all(_swapped_within(row[f"experts{s}"], row[f"experts{o}"], row[f"cand_experts{s}"],
                               row[f"cand_scores{s}"], top_k, ulps, 0.0) for s, o in pairs):
            within_ulps += 1
        if all(_swapped_within(row[f"experts{s}"], row[f"experts{o}"], row[f"cand_experts{s}"],
                               row[f"cand_scores{s}"], top_k, ulps, movement) for s, o in pairs):
            near_tie += 1
        else:
            common = len(set(row["cand_experts"]) & set(row["cand_experts_a"]))
            # A row moved by rounding keeps most of its candidates; one recorded from another token shares few
            sharing_most += 2 * common > len(row["cand_experts"])
            if len(unexplained) < MAX_ROWS_LISTED:
                unexplained.append({
                    "request_id": row["request_id"], "position": row["position"], "layer": row["layer"],
                    "experts_swapped": len(set(row["experts"]) - set(row["experts_a"])), "movement": movement,
                    "common_candidates": common})
    return {
        "rows_in_a": a.height,
        "rows_compared": joined.height,
        "tokens_equal": bool((joined["token"] == joined["token_a"]).all()) if joined.height else True,
        "decoded_rows_compared": joined.filter(pl.col("position") >= pl.col("prompt")).height,
        "rows_identical": identical,
        "rows_near_tie": near_tie,
        "rows_near_tie_within_ulps": within_ulps,
        "rows_unexplained": joined.height - identical - near_tie,
        "tie_tolerance": f"{ulps} bfloat16 ulps of the K-th selection score, or twice the row's score movement "
                         "between the runs where that is larger",
        "score_movement": {"all_rows": _quantiles(movements), "differing_rows": _quantiles(differing_movements),
                           "next_token_in_a": _quantiles(next_movements)} if has_candidates else None,
        "next_token_common_candidates_in_a": _quantiles([float(c) for c in next_common]) if has_candidates else None,
        "rows_unexplained_sharing_most_candidates": sharing_most,
        "rows_nearer_another_token": sum(not n["same_token"] for n in nearer) if has_candidates else None,
        "rows_nearer_a_same_token_neighbour": sum(n["same_token"] for n in nearer) if has_candidates else None,
        "nearer_rows": nearer[:MAX_ROWS_LISTED],
        "unexplained_rows": unexplained,
    }


def nearest_neighbour(row: dict[str, Any], movement: float,
                      a_rows: dict[tuple[str, int, int], tuple[int, list[int], list[float]]]) -> dict[str, Any] | None:
    """None when run B's ``row`` shares candidates with its own token's row of run A and moved less from it than
    from the row of any token up to ``NEIGHBOURS`` positions away (same request and layer) that it shares candidates
    with; else the row, described: the nearest such neighbour (one holding another token id, if any does), its
    offset and movement, and whether it holds the same token id (offset None: the row shares no candidate with its
    own token's)."""
    described = {"request_id": row["request_id"], "position": row["position"], "layer": row["layer"],
                 "token": row["token"], "movement": movement, "offset": None, "neighbour_movement": None,
                 "same_token": False}
    if not set(row["cand_experts"]) & set(row["cand_experts_a"]):
        return described
    nearer: list[tuple[bool, float, int]] = []  # (same token, movement, offset) of each neighbour nearer
    for offset in (*range(-NEIGHBOURS, 0), *range(1, NEIGHBOURS + 1)):
        other = a_rows.get((row["request_id"], row["layer"], row["position"] + offset))
        if other is None or not set(row["cand_experts"]) & set(other[1]):
            continue
        moved = score_movement(row["cand_experts"], row["cand_scores"], other[1], other[2])
        if moved <= movement:
            nearer.append((other[0] == row["token"], moved, offset))
    if not nearer:
        return None
    same_token, moved, offset = min(nearer)
    return {**described, "neighbour_movement": moved, "offset": offset, "same_token": same_token}


def next_token_rows(rows: pl.DataFrame, limit: int = 20_000) -> tuple[list[float], list[int]]:
    """What a row recorded from the wrong token would show: each row against the next position's row of the same
    request and layer, its score movement (over the candidates they share) and how many candidates they share."""
    ordered = rows.sort("request", "layer", "position").head(limit + 1)
    same = ordered.select((pl.col("request") == pl.col("request").shift(-1))
                          & (pl.col("layer") == pl.col("layer").shift(-1))).to_series().to_list()
    cands, scores = ordered["cand_experts"].to_list(), ordered["cand_scores"].to_list()
    pairs = [i for i in range(len(same) - 1) if same[i]]
    return ([score_movement(cands[i], scores[i], cands[i + 1], scores[i + 1]) for i in pairs
             if set(cands[i]) & set(cands[i + 1])],
            [len(set(cands[i]) & set(cands[i + 1])) for i in pairs])


def reference_check(trace_dir: Path) -> dict[str, Any]:
    """Every row against the top-k of its own float32 selection scores (needs ``--candidates``)."""
    trace = open_trace(trace_dir)
    top_k = trace.manifest.model.top_k
    routing = trace.routing().select("experts", "cand_experts", "cand_scores").collect()
    experts = np.sort(routing["experts"].to_numpy(), axis=1)  # fixed-size lists: [rows, K]
    cand = routing["cand_experts"].to_numpy()
    scores = routing["cand_scores"].to_numpy().astype(np.float64)
    same = (np.sort(cand[:, :top_k], axis=1) == experts).all(axis=1)
    explained = 0
    for i in np.flatnonzero(~same):
        chosen = set(experts[i].tolist())
        reference = set(cand[i, :top_k].tolist())
        by_id = dict(zip(cand[i].tolist(), scores[i].tolist()))
        kth = scores[i, top_k - 1]
        explained += all(e in by_id and abs(by_id[e] - kth) <= REFERENCE_TOLERANCE for e in chosen ^ reference)
    return {
        "rows": routing.height,
        "rows_equal_reference": int(same.sum()),
        "rows_reference_near_tie": explained,
        "rows_reference_unexplained": int((~same).sum()) - explained,
        "reference_tolerance": REFERENCE_TOLERANCE,
    }
