"""An independent decision oracle: the best draft length k per concurrency B, brute-forced from a sweep's raw rows
and a stated step cost. It shares no code with ``analysis/`` or ``moetrace/report/``; it reads the Parquet files
itself (pyarrow) and follows these rules:

- A decoding request-step is a steps-table row with num_tokens == num_drafts + 1 (a prefill chunk is not). Its
  window is every routing row of that (step, request): anchor, accepted and rejected drafts. A data-parallel
  recording (``dp0/``, ``dp1/``, … each a trace) keeps its steps per rank: rank 0's step 5 is not rank 1's.
- tokens_per_step(k) = 1 + mean num_accepted over the decoding request-steps of the trace at k (so request-steps
  that proposed fewer or no drafts count). The old, conditional form (``conditional=True``) is
  1 + Σ_{i≤k} #(num_accepted ≥ i) / #(num_drafts ≥ i), kept only to show where it decides differently.
- tokens_read(k) = mean num_tokens over the decoding request-steps (1 at k = 0).
- U(k, B), per MoE layer then averaged over layers: with ≥ 5 steps of the trace at k (per rank) in which every request
  decodes and exactly B requests of B distinct prompts ran, the mean over those steps of the distinct experts of the
  step; otherwise the expected distinct experts of B windows as a step holds them: B distinct prompts drawn one after
  another, each remaining prompt as likely as its share of the windows (over P < B prompts, every prompt ⌊B/P⌋ times
  and B mod P more drawn so), then one window of each drawn prompt at random. A prompt is the (position, token) pairs
  of a request's prefill rows, under greedy sampling (temperature 0 or unstated); otherwise, or without token ids,
  each request is its own. With one prompt this is exact: Σ_e 1 − (1 − n_e / N)^B (N windows, n_e of them use expert
  e); otherwise a seeded Monte Carlo mean (``UNION_SAMPLES`` draws); with N ≤ B, the union of all.
  busiest(k, B): the same steps/draws, the most experts of the union on one EP rank (expert e on rank
  e // (num_experts / ep)); for random draws it is a seeded Monte Carlo mean (``SAMPLES`` draws).
- step(k, B) = moe_layers × (c0 + per_expert·E + per_row·R + S·(c0 + (per_expert + per_row)·top_k) / top_k) µs,
  with ep = 1: E = U, R = B·tokens_read·top_k, S = shared; with ep > 1: E = busiest,
  R = B·tokens_read·top_k·busiest/U, S = shared/ep (the routed experts' kernel, plus the shared experts as a dense
  MLP read once a step, each costing one expert of the kernel's one-token point). No all-reduce.
- A k the sweep did not record stands for the trace of the smallest recorded k above it, K (past the largest: the
  largest, where the report extrapolates acceptance and decides nothing). Each decoding request-step of that trace
  proposed d drafts (the largest draft_pos of its rows) and accepted a; at k it would propose t = min(d, k) drafts
  (past K: d where d < K, else k) and accept min(a, k), so tokens_per_step(k) = 1 + mean min(a, k) and
  tokens_read(k) = 1 + mean t. Its window at k is, in every layer, the tokens its request kept (decode tokens,
  verification anchors, accepted drafts) at positions p … p + t, p its anchor's position; none where the request
  kept no token at one of them (it ended). A trace recorded at K = 0 has full windows: a request's kept tokens
  grouped by position // (k + 1), a group of exactly k + 1 rows a window. These windows ran in no step: U(k, B) is
  drawn from them as above. The old rule (``full_windows=True``), windows of k + 1 accepted tokens whatever the
  drafter proposed (as a K = 0 trace's), is kept only to show where it decides differently.
- speedup(k, B) = tokens_per_step(k) / (step(k, B) / step(0, B)); the recommended k is the k up to the largest
  recorded with the largest speedup, 0 when none exceeds 1, ties to the smaller k.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

MIN_STEPS = 5  # steps of exactly B decoding requests needed to measure U(k, B) directly
SAMPLES = 20_000  # Monte Carlo draws for the busiest rank of random windows
UNION_SAMPLES = 4_000  # Monte Carlo draws for the union over several prompts


@dataclass
class Recording:
    """One trace at one k (every DP rank's rows together)."""

    k: int
    manifest: dict[str, Any]
    masks: npt.NDArray[np.bool_]  # [layer, window, expert]: experts each decoding request-step used
    step_of: list[tuple[int, int]]  # per window: its (rank, step)
    drafts: npt.NDArray[np.int64]  # per window: num_drafts
    accepted: npt.NDArray[np.int64]  # per window: num_accepted
    tokens: npt.NDArray[np.int64]  # per window: num_tokens
    full_steps: dict[tuple[int, int], list[int]]  # (rank, step) where every request decodes -> its windows
    prompt: npt.NDArray[np.int64]  # per window: its request's prompt number
    rows: list[dict[str, Any]]  # every routing row, its step and request as (rank, step) and (rank, request)
    prompt_of: dict[tuple[int, int], int]  # (rank, request) -> its prompt number


def _read(folder: Path) -> dict[str, list[Any]]:
    """Every Parquet file of a table folder, as columns of Python values."""
    table = pa.concat_tables([pq.read_table(path) for path in sorted(folder.glob("*.parquet"))])
    columns: dict[str, list[Any]] = table.to_pydict()
    return columns


def read_recording(path: Path) -> Recording:
    """A trace folder, or a DP recording's folder holding ``dp0/``, ``dp1/``, …"""
    single = (path / "manifest.json").exists()
    ranks = [path] if single else sorted(path.glob("dp[0-9]*"), key=lambda rank: int(rank.name[2:]))
    manifest = json.loads((ranks[0] / "manifest.json").read_text())
    model = manifest["model"]
    layers = {layer: i for i, layer in enumerate(model["moe_layers"])}
    window: dict[tuple[int, int, int], int] = {}
    drafts: list[int] = []
    accepted: list[int] = []
    tokens: list[int] = []
    step_of: list[tuple[int, int]] = []
    all_decoding: dict[tuple[int, int], bool] = {}
    hits: list[tuple[int, int, int]] = []  # (layer index, window, expert)
    rows: list[dict[str, Any]] = []
    request_of: list[tuple[int, int]] = []  # per window: (rank, request)
    prompt_rows: dict[tuple[int, int], list[tuple[int, int | None]]] = {}  # (rank, request) -> (position, token)
    first_layer = min(layers)
    for rank, folder in enumerate(ranks):
        steps = _read(folder / "steps")
        for s, r, nt, nd, na in zip(steps["step"], steps["request"], steps["num_tokens"], steps["num_drafts"],
                                    steps["num_accepted"]):
            decoding = nt == nd + 1
            all_decoding[(rank, s)] = all_decoding.get((rank, s), True) and decoding
            if decoding:
                window[(rank, s, r)] = len(drafts)
                drafts.append(nd)
                accepted.append(na)
                tokens.append(nt)
                step_of.append((rank, s))
                request_of.append((rank, r))
        routing = _read(folder / "routing")
        rows += [{"step": (rank, s), "request": (rank, r), "position": position, "phase": phase, "draft_pos": d,
                  "accepted": a, "layer": layer, "experts": experts}
                 for s, r, position, phase, d, a, layer, experts in zip(
                     routing["step"], routing["request"], routing["position"], routing["phase"], routing["draft_pos"],
                     routing["accepted"], routing["layer"], routing["experts"])]
        for s, r, layer, experts, phase, position, token in zip(
                routing["step"], routing["request"], routing["layer"], routing["experts"], routing["phase"],
                routing["position"], routing["token"]):
            w = window.get((rank, s, r))
            if w is not None:
                hits.extend((layers[layer], w, e) for e in experts)
            if phase == "prefill" and layer == first_layer:
                prompt_rows.setdefault((rank, r), []).append((position, token))
    masks = np.zeros((len(layers), len(drafts), int(model["num_experts"])), dtype=bool)
    if hits:
        masks[tuple(np.asarray(hits).T)] = True
    full_steps: dict[tuple[int, int], list[int]] = {}
    for w, key in enumerate(step_of):
        if all_decoding[key]:
            full_steps.setdefault(key, []).append(w)
    greedy = float(((manifest.get("workload") or {}).get("sampling") or {}).get("temperature") or 0.0) == 0.0
    numbers: dict[object, int] = {}
    prompt_of = {key: numbers.setdefault(tuple(sorted(prompt_rows[key])) if greedy and key in prompt_rows
                                         and all(t is not None for _, t in prompt_rows[key]) else key, len(numbers))
                 for key in sorted(set(request_of) | {row["request"] for row in rows})}
    return Recording(int(manifest["spec"]["k"]), manifest, masks, step_of, np.asarray(drafts), np.asarray(accepted),
                     np.asarray(tokens), full_steps, np.asarray([prompt_of[key] for key in request_of], dtype=np.int64),
                     rows, prompt_of)


def read_sweep(folder: Path) -> dict[int, Recording]:
    """A sweep folder: one trace (or DP recording) per k."""
    recordings = [read_recording(child) for child in sorted(folder.iterdir()) if child.is_dir()]
    return {rec.k: rec for rec in recordings}


def drafts_at(proposed: int, k: int, trace_k: int) -> int:
    """Drafts a request-step that proposed ``proposed`` at ``trace_k`` would propose at ``k`` (module doc)."""
    if k <= trace_k:
        return min(proposed, k)
    return proposed if proposed < trace_k else k


def counterfactual_windows(rows: list[dict[str, Any]], k: int,
                           trace_k: int) -> dict[int, dict[tuple[Any, int], set[int]]]:
    """Per layer, {(request, first position): experts} of every window at ``k`` (module doc) of a trace recorded at
    ``trace_k``; ``rows``: its routing rows as dicts (step, request, position, phase, draft_pos, accepted, layer,
    experts)."""
    proposed: dict[tuple[Any, Any], int] = {}
    for row in rows:
        if row["phase"] != "prefill":
            key = (row["step"], row["request"])
            proposed[key] = max(proposed.get(key, 0), int(row["draft_pos"]))
    kept: dict[tuple[int, Any], dict[int, list[set[int]]]] = {}  # (layer, request) -> position -> expert sets
    anchors: list[tuple[int, Any, int, int]] = []  # layer, request, position, drafts proposed
    for row in rows:
        if not (row["phase"] == "decode" or (row["phase"] == "verify" and (row["draft_pos"] == 0 or row["accepted"]))):
            continue
        kept.setdefault((row["layer"], row["request"]), {}).setdefault(row["position"], []).append(set(row["experts"]))
        if row["draft_pos"] == 0:
            anchors.append((row["layer"], row["request"], row["position"], proposed[(row["step"], row["request"])]))
    found: dict[int, dict[tuple[Any, int], set[int]]] = {}
    if trace_k == 0:
        for (layer, request), by_position in kept.items():
            groups: dict[int, list[set[int]]] = {}
            for position, sets in by_position.items():
                groups.setdefault(position // (k + 1), []).extend(sets)
            for group, sets in groups.items():
                if len(sets) == k + 1:
                    found.setdefault(layer, {})[(request, group * (k + 1))] = set().union(*sets)
        return found
    for layer, request, position, drafts in anchors:
        span = range(position, position + drafts_at(drafts, k, trace_k) + 1)
        held = kept[(layer, request)]
        if all(p in held for p in span):
            found.setdefault(layer, {})[(request, position)] = set().union(*(s for p in span for s in held[p]))
    return found


def counterfactual(sweep: dict[int, Recording], k: int, full_windows: bool = False) -> Recording:
    """What the trace of the smallest recorded k above ``k`` (else the largest) says of ``k`` (module doc)."""
    above = [at for at in sweep if at > k]
    trace_k = min(above) if above else max(sweep)
    rec = sweep[trace_k]
    windows = counterfactual_windows(rec.rows, k, 0 if full_windows else trace_k)
    layers = sorted(windows)
    keys = sorted(windows[layers[0]]) if layers else []
    masks = np.zeros((len(layers), len(keys), int(rec.manifest["model"]["num_experts"])), dtype=bool)
    for index, layer in enumerate(layers):
        assert sorted(windows[layer]) == keys  # every token routed in every layer
        for w, key in enumerate(keys):
            masks[index, w, sorted(windows[layer][key])] = True
    drafts = np.asarray([drafts_at(int(d), k, trace_k) for d in rec.drafts], dtype=np.int64)
    return Recording(k, rec.manifest, masks, [], drafts, np.minimum(rec.accepted, k), drafts + 1, {},
                     np.asarray([rec.prompt_of[request] for request, _ in keys], dtype=np.int64), [], rec.prompt_of)


def every_k(sweep: dict[int, Recording], full_windows: bool = False) -> dict[int, Recording]:
    """The sweep's recordings, and for every k below its largest that it did not record, ``counterfactual``."""
    return {k: sweep[k] if k in sweep else counterfactual(sweep, k, full_windows) for k in range(max(sweep) + 1)}


def tokens_per_step(rec: Recording, conditional: bool = False) -> float:
    if not conditional:
        return 1.0 + float(rec.accepted.mean())
    return 1.0 + sum(float((rec.accepted >= i).sum() / (rec.drafts >= i).sum())
                     for i in range(1, rec.k + 1) if (rec.drafts >= i).any())


def tokens_read(rec: Recording) -> float:
    return float(rec.tokens.mean()) if rec.k > 0 else 1.0


def _busiest(unions: npt.NDArray[np.bool_], ep: int) -> npt.NDArray[np.int64]:
    """Per union (last axis experts): the most experts on one rank, experts placed linearly over ``ep`` ranks."""
    per_rank = unions.reshape(*unions.shape[:-1], ep, unions.shape[-1] // ep).sum(axis=-1)
    busiest: npt.NDArray[np.int64] = per_rank.max(axis=-1)
    return busiest


def prompt_draws(rec: Recording, batch: int, samples: int, seed: int) -> npt.NDArray[np.int64]:
    """[samples, batch] window indices, each row a step's windows drawn by the rule in the module doc."""
    rng = np.random.default_rng(seed)
    if len(set(rec.prompt.tolist())) == 1:
        return rng.integers(len(rec.prompt), size=(samples, batch))
    prompts = sorted(set(rec.prompt.tolist()))
    members = [np.flatnonzero(rec.prompt == p) for p in prompts]
    weights = np.array([len(m) for m in members], dtype=float)
    every, rest = divmod(batch, len(prompts))
    rows = []
    for _ in range(samples):
        drawn = list(range(len(prompts))) * every + list(rng.choice(len(prompts), rest, replace=False,
                                                                     p=weights / weights.sum()))
        rows.append([members[p][rng.integers(len(members[p]))] for p in drawn])
    return np.asarray(rows, dtype=np.int64)


def union(rec: Recording, batch: int, ep: int = 1, seed: int = 0) -> tuple[float, float, str]:
    """(U, busiest, how) at ``batch`` requests per step, each averaged over layers."""
    measured = [ws for ws in rec.full_steps.values()
                if len(ws) == batch and len(set(rec.prompt[ws].tolist())) == batch]
    n = rec.masks.shape[1]
    one_prompt = len(set(rec.prompt.tolist())) == 1
    draws = None if len(measured) >= MIN_STEPS or n <= batch or (one_prompt and ep == 1) else prompt_draws(
        rec, batch, SAMPLES if ep > 1 else UNION_SAMPLES, seed)
    per_layer = []
    for masks in rec.masks:
        if len(measured) >= MIN_STEPS:
            unions = np.stack([masks[ws].any(axis=0) for ws in measured])
            per_layer.append((unions.sum(axis=1).mean(), _busiest(unions, ep).mean()))
            continue
        if n <= batch:
            everything = masks.any(axis=0)
            per_layer.append((everything.sum(), _busiest(everything, ep)))
            continue
        # one prompt: B windows drawn at random, each independently, exactly
        exact = float(sum(1.0 - (1.0 - int(n_e) / n) ** batch for n_e in masks.sum(axis=0))) if one_prompt else None
        if draws is None:
            assert exact is not None
            per_layer.append((exact, exact))
            continue
        drawn = masks[draws].any(axis=1)
        u = exact if exact is not None else float(drawn.sum(axis=1).mean())
        per_layer.append((u, u if ep == 1 else float(_busiest(drawn, ep).mean())))
    how = "measured" if len(measured) >= MIN_STEPS else "all windows" if n <= batch else "drawn"
    return float(np.mean([p[0] for p in per_layer])), float(np.mean([p[1] for p in per_layer])), how


@dataclass(frozen=True)
class Cost:
    """The stated expert-layer curve (µs) and the deployment it prices."""

    c0_us: float
    per_expert_us: float
    per_row_us: float
    ep: int = 1

    def step_us(self, model: dict[str, Any], u: float, busiest: float, batch: int, read: float) -> float:
        top_k, shared = int(model["top_k"]), int(model.get("shared_experts") or 0)
        if self.ep > 1:
            experts, rows, dense = busiest, batch * read * top_k * busiest / u, shared / self.ep
        else:
            experts, rows, dense = u, batch * read * top_k, float(shared)
        one_token_expert = (self.c0_us + (self.per_expert_us + self.per_row_us) * top_k) / top_k
        layer = self.c0_us + self.per_expert_us * experts + self.per_row_us * rows + dense * one_token_expert
        return len(model["moe_layers"]) * layer


def speedups(sweep: dict[int, Recording], batch: int, cost: Cost, conditional: bool = False) -> dict[int, float]:
    """speedup(k, batch) for every k of ``sweep`` (k = 0 is 1 by definition)."""
    steps = {}
    for k, rec in sweep.items():
        u, busiest, _ = union(rec, batch, cost.ep)
        steps[k] = cost.step_us(rec.manifest["model"], u, busiest, batch, tokens_read(rec))
    return {k: tokens_per_step(rec, conditional) / (steps[k] / steps[0]) for k, rec in sorted(sweep.items())}


def best_k(per_k: dict[int, float]) -> int:
    """The k with the largest speedup, 0 when none exceeds 1; ties to the smaller k."""
    k, value = max(sorted(per_k.items()), key=lambda kv: kv[1])  # max keeps the first (smallest k) of equals
    return k if value > 1.0 else 0


def margin(per_k: dict[int, float]) -> float:
    """How much the chosen k beats the runner-up (k = 0 counting as speedup 1), relatively."""
    options = sorted([*(v for k, v in per_k.items() if k > 0), 1.0], reverse=True)
    return options[0] / options[1] - 1.0 if len(options) > 1 else math.inf


def decide(sweep: dict[int, Recording], batches: list[int], cost: Cost, conditional: bool = False,
           full_windows: bool = False) -> dict[int, tuple[int, dict[int, float]]]:
    """Per batch: the recommended k and the speedup of every k up to the largest recorded behind it."""
    out = {}
    compared = every_k(sweep, full_windows)
    for batch in batches:
        per_k = speedups(compared, batch, cost, conditional)
        out[batch] = (best_k(per_k), per_k)
    return out
