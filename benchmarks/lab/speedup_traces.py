"""What ``bench_speedup_validation.py compare`` reads from a measure directory besides the report: the engines'
throughput ratios with their intervals, the recorded rounds' own spans in the traces, the acceptance against
vLLM's counters, and the copies of a sweep with one k's timing held out."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

from speedup_load import output_lengths, requests_per_round, round_order, span_prefill_share


def ratio_ci95(numerator: list[float], denominator: list[float], resamples: int = 10_000) -> tuple[float, list[float]]:
    """median(numerator) / median(denominator) and its bootstrap 95% interval, each engine's rounds resampled on
    their own (the engines ran one after another, so rounds do not pair)."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(numerator, k=len(numerator)))
                    / statistics.median(rng.choices(denominator, k=len(denominator))) for _ in range(resamples))
    return (statistics.median(numerator) / statistics.median(denominator),
            [ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]])


def measured_best(speedups: dict[int, tuple[float, list[float]]]) -> int:
    """The k of the largest median measured speedup (k = 0 at 1.0 among them; the smaller k on a tie)."""
    return max(sorted(speedups), key=lambda k: speedups[k][0])


def recorded_rounds(engine: dict[str, Any]) -> int:
    """Rounds an engine recorded (as many as it timed)."""
    return len(next(iter(engine["recorded_tok_s"].values())))


def recorded_spans(trace: Path, max_tokens: int, lengths: tuple[float, ...], rounds: int,
                   recorded: list[int]) -> dict[int, tuple[float, float]]:
    """Per recorded concurrency, from the trace's own steps (the median over rounds): output tokens per second in the
    closed loop's span, so it tells the recorded steps apart from what the host adds around them; and the
    prefills per token in that span over those of its whole round (what ``span_prefill_share`` simulates).
    Requests were recorded in ``round_order``, ``requests_per_round(C)`` each; a request's index in the trace is the
    order vLLM first ran it, which is the order they were added. Per round: the span opens as the step ends in
    which the last of the first C requests produced its first token, and closes as the (n − C + 1)-th of its n
    requests ends (the first that no request replaced); its tokens are what each request gained (1 + accepted
    drafts a step, no more than its output length) in steps that ended inside it, its prefills the requests whose
    first step did."""
    import polars as pl

    steps = (pl.scan_parquet(str(trace / "steps" / "*.parquet"))
             .select(pl.col("request").cast(pl.Int64), "step", "t_end_ns",
                     gained=pl.col("num_accepted").cast(pl.Int64) + 1).collect())
    expected = rounds * sum(requests_per_round(c) for c in recorded)
    if steps.get_column("request").n_unique() != expected:
        raise SystemExit(f"{trace}: {steps.get_column('request').n_unique()} requests recorded, {expected} expected "
                         f"from {rounds} round(s) at {recorded}")
    rates: dict[int, list[float]] = {c: [] for c in recorded}
    shares: dict[int, list[float]] = {c: [] for c in recorded}
    first = 0
    for round_index in range(rounds):
        for concurrency in round_order(round_index, recorded):
            count = requests_per_round(concurrency)
            caps = pl.DataFrame({"request": range(first, first + count),
                                 "length": output_lengths(count, max_tokens, lengths)})
            part = steps.join(caps, on="request").sort("request", "step").with_columns(
                emitted=pl.min_horizontal(pl.col("gained").cum_sum().over("request"), pl.col("length")))
            spans = (part.group_by("request").agg(first_end=pl.col("t_end_ns").min(), end=pl.col("t_end_ns").max(),
                                                  emitted=pl.col("emitted").max())
                     .sort("request"))
            opened = int(spans.head(concurrency).get_column("first_end").max())  # type: ignore[arg-type]
            closed = int(spans.get_column("end").sort()[count - concurrency])

            def emitted_by(moment: int, part: pl.DataFrame = part) -> int:
                return int(part.filter(pl.col("t_end_ns") <= moment).group_by("request")
                           .agg(pl.col("emitted").max()).get_column("emitted").sum())

            tokens = emitted_by(closed) - emitted_by(opened)
            prefills = spans.filter((pl.col("first_end") > opened) & (pl.col("first_end") <= closed)).height
            rates[concurrency].append(tokens / ((closed - opened) / 1e9))
            shares[concurrency].append(prefills / tokens / (count / int(spans.get_column("emitted").sum())))
            first += count
    return {c: (statistics.median(rates[c]), statistics.median(shares[c])) for c in recorded}


def acceptance_against_counters(trace_dir: Path, set_rates: list[float] | None) -> dict[str, Any]:
    """Per draft position of the trace at ``trace_dir``: the rate vLLM's synthetic rejection sampling was set to
    (``set_rates``; None: the drafter's own), vLLM's counters' rate (accepted at i over request-steps that drafted,
    the manifest's ``vllm_counters``) and the trace's (request-steps that accepted at least i, over those that
    drafted), with whether the trace's counts equal vLLM's and the largest gap between set and counted rates."""
    import polars as pl

    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    counters = trace.manifest.document.get("vllm_counters") or {}
    drafted = trace.steps().filter(pl.col("num_drafts") > 0).select("num_accepted").collect()["num_accepted"]
    k = trace.manifest.spec.k
    windows = int(counters.get("num_drafts", 0))
    positions = []
    for i in range(1, k + 1):
        theirs = counters.get(f"num_accepted_tokens_at_{i}")
        ours = int((drafted >= i).sum())
        positions.append({"draft_pos": i, "set_rate": set_rates[i - 1] if set_rates else None,
                          "vllm_rate": theirs / windows if theirs is not None and windows else None,
                          "trace_rate": ours / drafted.len() if drafted.len() else None,
                          "trace_accepted": ours, "vllm_accepted": theirs})
    gaps = [abs(p["vllm_rate"] - p["set_rate"]) for p in positions
            if p["set_rate"] is not None and p["vllm_rate"] is not None]
    return {"acceptance": "synthetic" if set_rates else "drafter", "windows_trace": drafted.len(),
            "windows_vllm": windows, "positions": positions,
            "trace_equals_vllm": drafted.len() == windows and all(p["trace_accepted"] == p["vllm_accepted"]
                                                                 for p in positions),
            "largest_set_gap": max(gaps) if gaps else None}


def held_out_sweep(sweep: Path, k: int, scratch: Path) -> Path:
    """A copy of ``sweep`` (links to its traces) in which the trace at ``k`` keeps its routing and steps but not its
    timing of vLLM's calls (the manifest's ``phases``): the prediction at k then takes the forward's growth, the
    rejection sampler and the drafter from the nearest other recorded k, as it must for a k nobody timed."""
    out = scratch / f"{sweep.name}-without-k{k}-timing"
    out.mkdir()
    for trace in sorted(p for p in sweep.iterdir() if p.is_dir()):
        if trace.name != f"k{k}":
            (out / trace.name).symlink_to(trace.resolve())
            continue
        (out / trace.name).mkdir()
        for part in trace.resolve().iterdir():
            if part.name != "manifest.json":
                (out / trace.name / part.name).symlink_to(part)
        manifest = json.loads((trace / "manifest.json").read_text())
        manifest.pop("phases", None)
        (out / trace.name / "manifest.json").write_text(json.dumps(manifest))
    return out


def longest_output(baseline: Path) -> int:
    """The most tokens a request of the k=0 trace ``baseline`` produced: one a decode step, and its first in its
    (last) prefill step. Requests stop there at the model's last position, short of a longer output length."""
    import polars as pl

    from moetrace.analysis.predicates import decoding

    return int(pl.scan_parquet(str(baseline / "steps" / "*.parquet")).filter(decoding()).group_by("request").len()
               .select(pl.col("len").max() + 1).collect().item())


def span_prefill_shares(trace: Path, longest: int, concurrencies: list[int], max_tokens: int,
                        lengths: tuple[float, ...]) -> dict[int, float]:
    """Per concurrency, ``span_prefill_share`` of a timed round there: its requests' output lengths as the engine
    produced them (none past ``longest``: ``longest_output``) and the tokens the decode steps of ``trace`` gained."""
    import polars as pl

    from moetrace.analysis.predicates import decoding

    gains = (pl.scan_parquet(str(trace / "steps" / "*.parquet")).filter(decoding())
             .select(pl.col("num_accepted") + 1).collect().to_series().to_list())
    return {concurrency: span_prefill_share(concurrency, [min(n, longest) for n in output_lengths(
                requests_per_round(concurrency), max_tokens, lengths)], gains)
            for concurrency in concurrencies}


# timed (hooks paused) against recorded (hooks on) rounds of one engine at one concurrency: recording costs about 2%,
# so a larger gap is the rounds' noise (the EAGLE-3 k = 0 engine at 16: 0.81x with 2 rounds of 128 tokens)
TIMED_RECORDED_TOLERANCE = 0.10


def timed_over_recorded(engines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per engine (\"method k=K\") and concurrency both timed and recorded: its median timed throughput over its
    median recorded one."""
    return {f"{e['method']} k={e['k']}": {
        c: statistics.median(e["tok_s"][c]) / statistics.median(e["recorded_tok_s"][c])
        for c in e["tok_s"] if e.get("recorded_tok_s", {}).get(c)} for e in engines if "tok_s" in e}
