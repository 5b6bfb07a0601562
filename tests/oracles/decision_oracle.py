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
- speedup(k, B) = tokens_per_step(k) / (step(k, B) / step(0, B)); the recommended k is the recorded k with the
  largest speedup, 0 when none exceeds 1, ties to the smaller k.
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
    prompt = [numbers.setdefault(tuple(sorted(prompt_rows[key])) if greedy and key in prompt_rows
                                 and all(t is not None for _, t in prompt_rows[key]) else key, len(numbers))
              for key in request_of]
    return Recording(int(manifest["spec"]["k"]), manifest, masks, step_of, np.asarray(drafts), np.asarray(accepted),
                     np.asarray(tokens), full_steps, np.asarray(prompt, dtype=np.int64))


def read_sweep(folder: Path) -> dict[int, Recording]:
    """A sweep folder: one trace (or DP recording) per k."""
    recordings = [read_recording(child) for child in sorted(folder.iterdir()) if child.is_dir()]
    return {rec.k: rec for rec in recordings}


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
    """speedup(k, batch) for every recorded k (k = 0 is 1 by definition)."""
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


def decide(sweep: dict[int, Recording], batches: list[int], cost: Cost,
           conditional: bool = False) -> dict[int, tuple[int, dict[int, float]]]:
    """Per batch: the recommended k and the speedup of every recorded k behind it."""
    out = {}
    for batch in batches:
        per_k = speedups(sweep, batch, cost, conditional)
        out[batch] = (best_k(per_k), per_k)
    return out
