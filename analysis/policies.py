"""Policies that choose k step by step, replayed against a recorded trace (counterfactual): each concurrency B runs B
request streams in lockstep, closed loop (a stream that ends is replaced by the next request until none is left),
one k per step for all of its requests, as vLLM runs it. A recorded request-step of the trace at its k (K) accepted a
drafts: under a policy's k it gains 1 + min(a, k) tokens (drafts are a prefix: the first k of K are the k a
k-drafter proposes) and the step costs the predicted step at (B, k). Throughput is tokens per ms while all B slots
are busy, over that of k = 0.

Policies (``POLICIES``):
- ``fixed k``: every step at k (``best fixed``: the k of largest replayed throughput, chosen in hindsight);
- ``static table``: the decision's recommended k at B (vLLM's ``num_speculative_tokens_per_batch_size``);
- ``acceptance EMA`` (as SGLang adapts its draft length): k = the moving average of accepted drafts per request-step
  (weight ``EMA_WEIGHT`` per step), rounded, plus one, between 1 and K;
- ``utility`` (Cascade, arXiv 2506.20675): the k of largest predicted utility, expected tokens per step from moving
  averages of the acceptance at each draft position over the step ratio to k = 0, K every ``PROBE_EVERY`` steps so
  that the positions past the chosen k keep being observed.

The noise: the same replay over resampled request streams (``RESAMPLES``, seeded), each policy's throughput over the
static table's on the same resample; a policy beats the table when the lower end of that ratio's 95% interval is
above 1 and it gains at least ``MIN_GAIN``. A concurrency whose replay keeps all B slots busy for fewer than
``MIN_REPLAY_STEPS`` steps is replayed but not judged: the few requests that start it decide the outcome (a demo
trace of 10 requests at B = 8 replays 27 steps, and its recorded order fell outside the spread of 100 reorderings
of the same requests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.predicates import decoding

EMA_WEIGHT = 0.2
PROBE_EVERY = 32
RESAMPLES = 20
# A policy beats the static table only by more than this too: the replay prices every policy with the same
# predicted steps, and a timed comparison on the H200 does not resolve less (its rounds vary by about 5%).
MIN_GAIN = 0.02
MIN_REPLAY_STEPS = 4 * PROBE_EVERY  # utility probes K every PROBE_EVERY steps: fewer than 4 probes judge nothing
MAX_REQUEST_STEPS = 10_000  # per replay: a longer trace is cut to its first requests up to this many request-steps

Choose = Callable[[list[float], int], int]  # (moving averages of acceptance at positions 1..K, step index) → k


def request_streams(steps: pl.LazyFrame) -> list[npt.NDArray[np.int64]]:
    """Per request of a trace, in request order, up to ``MAX_REQUEST_STEPS`` request-steps in all: the drafts each
    of its decoding request-steps accepted, in step order."""
    frame = (steps.filter(decoding()).select("request", "step", "num_accepted").sort("request", "step")
             .collect())
    streams, total = [], 0
    for (_,), part in frame.group_by("request", maintain_order=True):
        if total >= MAX_REQUEST_STEPS:
            break
        streams.append(part["num_accepted"].to_numpy().astype(np.int64))
        total += len(streams[-1])
    return streams


def lockstep(streams: Sequence[npt.NDArray[np.int64]], batch: int) -> npt.NDArray[np.int64]:
    """[steps, batch]: the recorded accepted drafts each slot's request-step had, step by step, while ``batch``
    slots run ``streams`` closed loop (empty when there are fewer streams than slots). The same whatever k each
    step runs at: every step takes one request-step of every slot."""
    if len(streams) < batch:
        return np.zeros((0, batch), dtype=np.int64)
    queue = list(range(len(streams) - 1, batch - 1, -1))
    slots, cursor, rows = list(range(batch)), [0] * batch, []
    while True:
        rows.append([streams[slot][at] for slot, at in zip(slots, cursor)])
        for i in range(batch):
            cursor[i] += 1
            if cursor[i] == len(streams[slots[i]]):
                if not queue:
                    return np.array(rows, dtype=np.int64)
                slots[i], cursor[i] = queue.pop(), 0


def replay(accepted: npt.NDArray[np.int64], step_ms: Mapping[int, float], max_k: int,
           choose: Choose) -> tuple[float, float]:
    """Tokens per ms and the mean k of a ``lockstep`` run, each step at the k ``choose`` picks from the moving
    averages of acceptance at positions 1..K it has seen (from 0.5 each; a step at k sees positions 1..k)."""
    positions = np.arange(1, max_k + 1)
    seen_rates = (accepted[:, :, None] >= positions).mean(axis=1).tolist()  # [steps][K]
    gained = (np.minimum(accepted[:, :, None], np.arange(max_k + 1)) + 1).sum(axis=1).tolist()  # [steps][k]
    seen = [0.5] * max_k
    tokens = time = chosen = 0.0
    for step, (rates, gains) in enumerate(zip(seen_rates, gained)):
        k = choose(seen, step)
        tokens += gains[k]
        time += step_ms[k]
        chosen += k
        for i in range(k):
            seen[i] += EMA_WEIGHT * (rates[i] - seen[i])
    return tokens / time, chosen / len(accepted)


def policies(step_ms: Mapping[int, float], max_k: int, table_k: int) -> dict[str, Choose]:
    """The policies compared at one concurrency (``step_ms``: predicted step per k there; ``table_k``: the static
    table's k), by name."""
    def ema(seen: list[float], step: int) -> int:
        return int(min(max(round(sum(seen)) + 1, 1), max_k))  # accepted drafts per request-step: Σ positions

    def utility(seen: list[float], step: int) -> int:
        if step % PROBE_EVERY == 0:
            return max_k
        gains = [(1.0 + sum(seen[:k])) / (step_ms[k] / step_ms[0]) for k in range(max_k + 1)]
        return int(np.argmax(gains))

    def fixed(k: int) -> Choose:
        return lambda seen, step: k

    named = {f"fixed k={k}": fixed(k) for k in range(max_k + 1)}
    return {**named, "static table": fixed(table_k), "acceptance EMA": ema, "utility": utility}




def compare_policies(steps: pl.LazyFrame, max_k: int, step_ms: Mapping[int, Mapping[int, float]],
                     table: Mapping[int, int], seed: int = 0) -> pl.DataFrame:
    """Per concurrency of ``table`` (batch → the static table's k; ``step_ms``: batch → k → predicted step ms, k =
    0..``max_k``; ``steps``: the steps table of the trace recorded at ``max_k``) that has as many requests as slots:
    each policy's replayed speedup over k = 0, its mean k, and its throughput over the static table's with the 95%
    interval over resampled requests (``vs_table_low``, ``vs_table_high``; None below ``MIN_REPLAY_STEPS`` replayed
    ``steps``). ``best fixed`` is the fixed k of largest speedup (``k``; the static table's k on its row)."""
    streams = request_streams(steps)
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, len(streams), len(streams)) for _ in range(RESAMPLES)] if streams else []
    rows = []
    for batch, table_k in sorted(table.items()):
        accepted = lockstep(streams, batch)
        if not len(accepted):
            continue
        named = policies(step_ms[batch], max_k, min(table_k, max_k))
        found = {name: replay(accepted, step_ms[batch], max_k, choose) for name, choose in named.items()}
        best = max(range(max_k + 1), key=lambda k: found[f"fixed k={k}"][0])
        compared = {"static table": "static table", "best fixed": f"fixed k={best}", "acceptance EMA":
                    "acceptance EMA", "utility": "utility"}
        ratios: dict[str, list[float]] = {name: [] for name in compared}
        for draw in draws if len(accepted) >= MIN_REPLAY_STEPS else []:
            again = lockstep([streams[i] for i in draw], batch)
            table_rate = replay(again, step_ms[batch], max_k, named["static table"])[0]
            for name, policy in compared.items():
                ratios[name].append(replay(again, step_ms[batch], max_k, named[policy])[0] / table_rate)
        for name, policy in compared.items():
            rate, mean_k = found[policy]
            low, high = (float(bound) for bound in np.percentile(ratios[name], [2.5, 97.5])) if ratios[name] \
                else (None, None)
            rows.append({"batch": batch, "policy": name, "steps": len(accepted),
                         "k": best if name == "best fixed" else min(table_k, max_k) if name == "static table" else None,
                         "speedup": rate / found["fixed k=0"][0], "mean_k": mean_k,
                         "vs_table": rate / found["static table"][0], "vs_table_low": low,
                         "vs_table_high": high})
    schema = {"batch": pl.Int32(), "policy": pl.String(), "steps": pl.Int32(), "k": pl.Int32(), "speedup": pl.Float64(),
              "mean_k": pl.Float64(), "vs_table": pl.Float64(), "vs_table_low": pl.Float64(),
              "vs_table_high": pl.Float64()}
    return pl.DataFrame(rows, schema=schema, orient="row")


def policy_verdict(compared: pl.DataFrame, batches: Sequence[int], requests: int,
                   unpriced: Mapping[int, str] | None = None) -> list[str]:
    """Per concurrency of ``batches``: which policy replayed fastest and whether it beats the static table beyond
    the noise, or that it was not replayed or judged (``requests``: the requests the replayed trace holds;
    ``unpriced``: concurrencies left out of ``compared`` for want of a predicted step, and why)."""
    lines = []
    for batch in batches:
        rows = compared.filter(pl.col("batch") == batch).to_dicts()
        if batch in (unpriced or {}):
            lines.append(f"B={batch}: not replayed: {(unpriced or {})[batch]}")
            continue
        if not rows:
            lines.append(f"B={batch}: not replayed: the trace holds {requests} request(s), fewer than {batch} slots")
            continue
        if rows[0]["steps"] < MIN_REPLAY_STEPS:
            lines.append(f"B={batch}: not judged: {rows[0]['steps']} replayed steps with all {batch} slots busy, "
                         f"fewer than {MIN_REPLAY_STEPS}")
            continue
        winner = max(rows, key=lambda row: row["vs_table"])
        if winner["policy"] == "static table" or winner["vs_table_low"] <= 1.0 or winner["vs_table"] < 1 + MIN_GAIN:
            lines.append(f"B={batch}: no policy beats the static table beyond the noise (best: {winner['policy']} "
                         f"{winner['vs_table']:.3f}x, 95% {winner['vs_table_low']:.3f}-{winner['vs_table_high']:.3f})")
        else:
            lines.append(f"B={batch}: {winner['policy']} beats the static table by "
                         f"{winner['vs_table'] - 1:+.1%} (95% {winner['vs_table_low']:.3f}-"
                         f"{winner['vs_table_high']:.3f}x)")
    return lines
