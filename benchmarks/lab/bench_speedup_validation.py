"""Predicted against measured speedup per k: what vLLM delivers on a GPU beside what ``moetrace report`` predicts.

    # on the GPU: serve each k (and drafter) with CUDA graphs, time it, record a trace of the same workload
    python benchmarks/lab/bench_speedup_validation.py measure --model default --methods ngram,mtp --out runs
    python benchmarks/lab/bench_speedup_validation.py measure --model kimi-k2-tp8 --methods ngram --out runs
    moetrace calibrate --model default --tp 1 --ep 1 --formats bf16 --no-allreduce --vllm-kernel \\
        -o runs/calibration-default.json
    moetrace calibrate --model runs/kimi-k2-tp8-model --tp 1 --ep 1 --formats bf16 --no-allreduce --vllm-kernel \\
        -o runs/calibration-kimi-k2-tp8.json   # (model-dir --model kimi-k2-tp8 --out runs writes that folder alone)
    # anywhere: predict from the traces and calibrations, set beside the measurements
    python benchmarks/lab/bench_speedup_validation.py compare runs --json benchmarks/results/speedup-validation.json

What ``measure`` times and records, and how: ``speedup_measure.py``.

Baseline: k = 0 (no speculation) on the same GPU, same workload, same run (``--sync-baseline``: also k = 0 with
async scheduling off). Measured speedup = median tok/s at k over median tok/s at k = 0; its 95% interval bootstraps
the rounds of both engines.

Evidence it produced: benchmarks/results/speedup-validation*.json, speedup-*-measurements.json (latest: commit
1c1a27f, an H100, 2026-12-05: the fifth hold-out at 24 slots, the k = 0 hooks A/B, EAGLE-3 k = 3).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from speedup_measure import (
    LOAD,
    SLICE_POSITIONS,
    measure,
    output_lengths,
    parse_concurrencies,
    requests_per_round,
    round_order,
    slice_model_dir,
    window_prefill_share,
)

def ratio_ci95(numerator: list[float], denominator: list[float], resamples: int = 10_000) -> tuple[float, list[float]]:
    """median(numerator) / median(denominator) and its bootstrap 95% interval, each engine's rounds resampled on
    their own (the engines ran one after another, so rounds do not pair)."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(numerator, k=len(numerator)))
                    / statistics.median(rng.choices(denominator, k=len(denominator))) for _ in range(resamples))
    return (statistics.median(numerator) / statistics.median(denominator),
            [ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]])


def report_json(sweep: Path, calibration: Path, scratch: Path, k0_sync: Path | None,
                batches: list[int], context: int | None = None) -> dict[str, Any] | None:
    """``moetrace report --profile measured --batch <batches>`` as a user runs it (a subprocess): its JSON, or None
    (and why, printed) where it failed. ``k0_sync``: the k=0 trace with async scheduling off, for a drafter vLLM
    runs that way; ``context``: also ``--context <context>``."""
    command = [sys.executable, "-m", "moetrace", "report", str(sweep), "--calibration", str(calibration),
               "--profile", "measured", "--batch", ",".join(map(str, batches)), "--json",
               "-o", str(scratch / f"{sweep.name}.html"), "--force",
               *(["--k0-sync", str(k0_sync)] if k0_sync is not None else []),
               *(["--context", str(context)] if context is not None else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"{sweep.name}: moetrace report failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def predicted_rows(report: dict[str, Any] | None,
                   context: int | None = None) -> tuple[dict[tuple[int, int], Any], dict[tuple[int, int], Any]]:
    """The report's predicted rows and its check against the recorded steps, each by (batch, k); empty where the
    report failed or predicted nothing. ``context``: the rows moved there (``--context``), and no check (its steps
    ran at another context)."""
    prediction = report["runs"][0]["prediction"] if report is not None else None
    if prediction is None:
        return {}, {}
    if context is not None:
        return ({(r["batch"], r["k"]): r for r in decision_of(report)["by_context"]["speedups"]
                 if r["context"] == context}, {})
    return ({(r["batch"], r["k"]): r for r in prediction["per_batch"]},
            {(r["batch"], r["k"]): r for r in prediction["against_trace"]})


def decision_of(report: dict[str, Any]) -> dict[str, Any]:
    """The report's decision for its (one) run."""
    run = report["runs"][0]
    decisions = run.get("decision") or [d for d in report.get("decision", []) if d.get("label") == run.get("label")]
    return decisions if isinstance(decisions, dict) else (decisions[0] if decisions else {})


def recommended(report: dict[str, Any] | None, context: int | None = None) -> dict[int, dict[str, Any]]:
    """The report's decision by concurrency (at ``context``, where given): its row (``k`` null where it recommends
    none, ``status`` says why)."""
    if report is None:
        return {}
    decision = decision_of(report)
    if context is not None:
        return {int(r["batch"]): r for r in decision["by_context"]["per_batch"] if r["context"] == context}
    return {int(r["batch"]): r for r in decision.get("per_batch", [])}


def recorded_windows(trace: Path, max_tokens: int, lengths: tuple[float, ...], rounds: int,
                     recorded: list[int]) -> dict[int, tuple[float, float]]:
    """Per recorded concurrency, from the trace's own steps (the median over rounds): output tokens per second in the
    closed loop's window, so it tells the recorded steps apart from what the host adds around them; and the
    prefills per token in that window over those of its whole round (what ``window_prefill_share`` simulates).
    Requests were recorded in ``round_order``, ``requests_per_round(C)`` each; a request's index in the trace is the
    order vLLM first ran it, which is the order they were added. Per round: the window opens as the step ends in
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


def recorded_rounds(engine: dict[str, Any]) -> int:
    """Rounds an engine recorded (as many as it timed)."""
    return len(next(iter(engine["recorded_tok_s"].values())))


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


def moved_with(row: dict[str, Any], row0: dict[str, Any], own: dict[str, Any], own0: dict[str, Any],
               acceptance: bool) -> float:
    """The speedup of a moved prediction's ``row`` (its k=0 row ``row0``) as the report computes it, a step's time
    per token gained plus the prefill a token carries, with that prefill (and with ``acceptance``, the tokens a step
    gains) taken from the rows ``own``/``own0`` predicted from the run's own traces at its own context: how much of
    the moved prediction's miss each term the move keeps as recorded explains."""
    from moetrace.analysis.cost import end_to_end_speedup

    return end_to_end_speedup(row0["step_ms"], 1.0, own0["prefill_ms_per_token"] or 0.0, row["step_ms"],
                              (own if acceptance else row)["tokens_per_step"], own["prefill_ms_per_token"] or 0.0)


def in_window(row: dict[str, Any], row0: dict[str, Any], share: float, share0: float) -> float:
    """The speedup of a predicted ``row`` (its k=0 row ``row0``) as the report computes it, with the prefill a token
    carries scaled to the closed loop's window (``share``/``share0``: ``window_prefill_shares`` at k and at k = 0)."""
    from moetrace.analysis.cost import end_to_end_speedup

    prefill0, prefill = row0["prefill_ms_per_token"] or 0.0, row["prefill_ms_per_token"] or 0.0
    return float(end_to_end_speedup(row0["step_ms"], 1.0, share0 * prefill0, row["step_ms"], row["tokens_per_step"],
                                    share * prefill))


def longest_output(baseline: Path) -> int:
    """The most tokens a request of the k=0 trace ``baseline`` produced: one a decode step, and its first in its
    (last) prefill step. Requests stop there at the model's last position, short of a longer output length."""
    import polars as pl

    from moetrace.analysis.predicates import decoding

    return int(pl.scan_parquet(str(baseline / "steps" / "*.parquet")).filter(decoding()).group_by("request").len()
               .select(pl.col("len").max() + 1).collect().item())


def window_prefill_shares(trace: Path, longest: int, concurrencies: list[int], max_tokens: int,
                          lengths: tuple[float, ...]) -> dict[int, float]:
    """Per concurrency, ``window_prefill_share`` of a timed round there: its requests' output lengths as the engine
    produced them (none past ``longest``: ``longest_output``) and the tokens the decode steps of ``trace`` gained."""
    import polars as pl

    from moetrace.analysis.predicates import decoding

    gains = (pl.scan_parquet(str(trace / "steps" / "*.parquet")).filter(decoding())
             .select(pl.col("num_accepted") + 1).collect().to_series().to_list())
    return {concurrency: window_prefill_share(concurrency, [min(n, longest) for n in output_lengths(
                requests_per_round(concurrency), max_tokens, lengths)], gains)
            for concurrency in concurrencies}


def measured_best(speedups: dict[int, tuple[float, list[float]]]) -> int:
    """The k of the largest median measured speedup (k = 0 at 1.0 among them; the smaller k on a tie)."""
    return max(sorted(speedups), key=lambda k: speedups[k][0])


def compare(args: argparse.Namespace) -> None:
    """Predicted and measured speedup per (model, drafter, timed concurrency, k): throughput with the hooks paused,
    the report's own check against the recorded decode steps (with the per-step time the prediction leaves out)
    where the concurrency was recorded, and per concurrency the measured best k beside the report's recommended k."""
    import tempfile

    runs: Path = args.runs
    rows: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for path in sorted(runs.glob("*-measurements.json")):
            doc = json.loads(path.read_text())
            model = doc["model"]
            if doc.get("hooks_ab"):  # no prediction to check: paused against recording rounds of the same engine
                for engine in (e for e in doc["engines"] if "tok_s" in e):
                    print(f"{model} {engine['method']} k={engine['k']}, hooks paused / on, median tok/s: " + ", ".join(
                        f"B={c} {statistics.median(v):.0f} / {statistics.median(engine['hooks_on_tok_s'][c]):.0f}"
                        for c, v in engine["tok_s"].items()))
                continue
            calibration = runs / f"calibration-{model}.json"
            engines = [e for e in doc["engines"] if "tok_s" in e]
            baseline = next((e for e in engines if e["k"] == 0 and e["method"] != "sync"), None)
            if doc.get("load") != LOAD:
                print(f"{model}: measured before the {LOAD} load: skipped")
                continue
            if baseline is None or not calibration.exists():
                print(f"{model}: no k=0 engine or no {calibration.name}: skipped")
                continue
            timed, recorded = [int(c) for c in doc["timed"]], [int(c) for c in doc["recorded"]]
            lengths = tuple(doc["lengths"])

            windows: dict[str, dict[int, tuple[float, float]]] = {}  # trace → its recorded windows, read once

            def wall(engine: dict[str, Any], doc: dict[str, Any] = doc, lengths: tuple[float, ...] = lengths,
                     recorded: list[int] = recorded,
                     windows: dict[str, dict[int, tuple[float, float]]] = windows) -> dict[int, tuple[float, float]]:
                if engine["trace"] not in windows:
                    windows[engine["trace"]] = recorded_windows(runs / engine["trace"], doc["max_tokens"], lengths,
                                                                recorded_rounds(engine), recorded)
                return windows[engine["trace"]]

            baseline_wall = wall(baseline)
            sync = next((e for e in engines if e["method"] == "sync"), None)
            # the traces that predict: this run's, or (--moved-from) another's moved to this run's prompts' context
            source, source_engines, context = runs, engines, None
            if args.moved_from is not None:
                context = doc.get("prompt_tokens")
                if context is None or not (args.moved_from / path.name).exists():
                    print(f"{model}: no --prompt-tokens to move to, or no {path.name} in {args.moved_from}: skipped")
                    continue
                source = args.moved_from
                source_engines = [e for e in json.loads((source / path.name).read_text())["engines"] if "tok_s" in e]
            source_baseline = next(e for e in source_engines if e["k"] == 0 and e["method"] != "sync")
            source_sync = next((e for e in source_engines if e["method"] == "sync"), None)
            models[model] = {
                "device": doc["device"], "vllm_version": doc["vllm_version"], "tp": doc.get("tp", 1),
                "command": doc["command"], "calibration": calibration.name, "load": doc["load"], "timed": timed,
                "recorded": recorded, "max_num_seqs": doc["max_num_seqs"], "requests": doc["requests"],
                "failed_engines": [f"{e['method']} k={e['k']}: {e['error']}" for e in doc["engines"] if "error" in e],
                "async_off_k0": None if sync is None else {
                    c: ratio_ci95(sync["tok_s"][c], baseline["tok_s"][c])[0] for c in sync["tok_s"]},
                "timed_over_recorded": timed_over_recorded(engines),
                "predicted_from": None if context is None else f"{source} moved by --context {context}",
            }
            for method in dict.fromkeys(e["method"] for e in engines if e["k"] > 0 and e["method"] != "sync"):
                sweep = (source / next(e["trace"] for e in source_engines if e["method"] == method)).parent
                if not (sweep / "k0").exists():  # k = 0 runs no drafter: the shared baseline joins each sweep
                    (sweep / "k0").symlink_to(Path("..") / Path(source_baseline["trace"]))
                # vLLM 0.26 drafts n-gram with async scheduling off, MTP and EAGLE-3 with it on (the manifests say)

                def asynchronous(engine: dict[str, Any]) -> bool:
                    manifest = json.loads((source / engine["trace"] / "manifest.json").read_text())
                    return bool(manifest["capture"].get("async_scheduling", True))

                drafted_sync = not asynchronous(next(e for e in source_engines if e["method"] == method and e["k"] > 0))
                k0_sync = (source / source_sync["trace"]
                           if source_sync is not None and drafted_sync and asynchronous(source_baseline) else None)
                report = report_json(sweep, calibration, Path(scratch), k0_sync, timed, context)
                if report is not None and report["runs"][0]["prediction"] is not None:
                    models[model].setdefault("prediction_basis", {})[method] = (
                        report["runs"][0]["prediction"]["basis"]["mode"])
                predicted, checked = predicted_rows(report, context)
                chosen = recommended(report, context)
                own: dict[tuple[int, int], Any] = {}
                if context is not None:  # what the move keeps as recorded, as this run's own traces measured it
                    own_sweep = (runs / next(e["trace"] for e in engines if e["method"] == method)).parent
                    if not (own_sweep / "k0").exists():
                        (own_sweep / "k0").symlink_to(Path("..") / Path(baseline["trace"]))
                    own_sync = runs / sync["trace"] if sync is not None and drafted_sync else None
                    own, _ = predicted_rows(report_json(own_sweep, calibration, Path(scratch), own_sync, timed))
                drafted = [e for e in engines if e["method"] == method and e["k"] > 0]
                # the window a timed round measures holds fewer prefills per token than the whole rounds a trace
                # pools its prefill over (``window_prefill_share``): each prediction also in that window
                longest = longest_output(source / source_baseline["trace"])
                window_engines = [source_baseline, *(e for e in source_engines if e["method"] == method and e["k"] > 0)]
                window_shares = {e["k"]: window_prefill_shares(source / e["trace"], longest,
                                                               sorted({*timed, *recorded}), doc["max_tokens"], lengths)
                                 for e in window_engines}
                if context is None:  # the simulation against the recorded rounds' own windows
                    models[model].setdefault("window_prefill_share", {})[method] = {
                        str(e["k"]): {str(c): {"simulated": window_shares[e["k"]][c], "recorded": share}
                                      for c, (_, share) in wall(e).items()} for e in window_engines}
                for engine in drafted:
                    models[model].setdefault("acceptance", {}).setdefault(method, {})[str(engine["k"])] = (
                        acceptance_against_counters(runs / engine["trace"], doc.get("synthetic_acceptance")))
                    held_out, _ = predicted_rows(report_json(held_out_sweep(sweep, engine["k"], Path(scratch)),
                                                             calibration, Path(scratch), k0_sync, timed, context),
                                                 context)
                    engine_wall = wall(engine)
                    for concurrency in timed:
                        key, at_recorded = (concurrency, engine["k"]), concurrency in recorded
                        measured, interval = ratio_ci95(engine["tok_s"][str(concurrency)],
                                                        baseline["tok_s"][str(concurrency)])
                        row, trace = predicted.get(key), checked.get(key, {})
                        row0 = predicted.get((concurrency, 0))
                        window_speedup = (in_window(row, row0, window_shares[engine["k"]][concurrency],
                                                    window_shares[0][concurrency])
                                          if row and row0 and engine["k"] in window_shares else None)
                        rows.append({
                            "model": model, "drafter": method, "concurrency": concurrency, "k": engine["k"],
                            # who kept the drafts: vLLM's synthetic rejection sampling at set rates, or the drafter
                            "acceptance": "synthetic" if doc.get("synthetic_acceptance") else "drafter",
                            # predicted at a concurrency no trace recorded: from the recorded ones alone
                            "held_out_concurrency": not at_recorded,
                            "predicted_speedup": row["speedup"] if row else None,
                            "measured_speedup": measured, "measured_ci95": interval,
                            "error": (row["speedup"] - measured) / measured if row else None,
                            # predicted with this k's own timing of vLLM's calls left out (held_out_sweep)
                            "window_predicted_speedup": window_speedup,
                            "window_error": (window_speedup - measured) / measured if window_speedup else None,
                            "held_out_predicted_speedup": held_out[key]["speedup"] if key in held_out else None,
                            "held_out_error": ((held_out[key]["speedup"] - measured) / measured
                                               if key in held_out else None),
                            "trace_measured_speedup": trace.get("measured_speedup"),
                            "trace_wall_speedup": (engine_wall[concurrency][0] / baseline_wall[concurrency][0]
                                                   if at_recorded else None),
                            "trace_tokens_per_step": trace.get("measured_tokens_per_step"),
                            "trace_step_ms": trace.get("measured_step_ms"),
                            "predicted_step_ms": row["step_ms"] if row else None,
                            "unexplained_ms_per_step": trace.get("unexplained_ms"),
                            # where the recorded step grew against k = 0 (ms per step)
                            "trace_step_growth_ms": trace.get("step_growth_ms"),
                            "predicted_moe_growth_ms": (row["moe_ms"] + row["allreduce_ms"] - row0["moe_ms"]
                                                        - row0["allreduce_ms"]) if row and row0 else None,
                            "trace_forward_growth_ms": trace.get("forward_growth_ms"),
                            "trace_sampling_growth_ms": trace.get("sampling_growth_ms"),
                            "trace_drafting_ms": trace.get("drafting_ms"),
                            "async_off_growth_ms": row.get("scheduling_ms") if row else None,  # --k0-sync's term
                            # --moved-from: the moved steps with this run's own prefill, then also its acceptance
                            **({"moved_with_own_prefill_speedup": moved_with(
                                    row, row0, own[key], own[(concurrency, 0)], acceptance=False),
                                "moved_with_own_prefill_and_acceptance_speedup": moved_with(
                                    row, row0, own[key], own[(concurrency, 0)], acceptance=True)}
                               if row and row0 and key in own and (concurrency, 0) in own else {}),
                            "command": doc["command"],
                        })
                if drafted_sync and k0_sync is None:
                    models[model].setdefault("missing", []).append(
                        f"{method}: drafted with async scheduling off, but no k=0 trace ran that way (--sync-baseline):"
                        f" its predictions leave out what that switch costs a step")
                for concurrency in timed:  # the k=0 step: time per token the report predicts, the k=0 engine ran
                    row0 = predicted.get((concurrency, 0))
                    ran = concurrency / statistics.median(baseline["tok_s"][str(concurrency)]) * 1e3
                    prefill = (row0["prefill_ms_per_token"] or 0.0) if row0 else 0.0
                    estimate = row0["step_ms"] + prefill if row0 else None
                    in_its_window = (row0["step_ms"] + window_shares[0][concurrency] * prefill) if row0 else None
                    models[model].setdefault("k0_ms_per_token", {})[str(concurrency)] = {
                        "predicted": estimate, "measured": ran, "step_source": row0["step_source"] if row0 else None,
                        "error": (estimate - ran) / ran if estimate is not None else None,
                        "window_prefill_share": window_shares[0][concurrency], "window_predicted": in_its_window,
                        "window_error": (in_its_window - ran) / ran if in_its_window is not None else None}
                for concurrency in timed:  # the measured best k beside the one the report recommends
                    base = baseline["tok_s"][str(concurrency)]
                    speedups = {0: ratio_ci95(base, base), **{e["k"]: ratio_ci95(e["tok_s"][str(concurrency)], base)
                                                              for e in drafted}}
                    best = measured_best(speedups)
                    decision = chosen.get(concurrency)
                    pick = decision["k"] if decision else None
                    pick_measured = speedups[pick][0] if pick in speedups else None
                    low, high = speedups[best][1]
                    decisions.append({
                        "model": model, "drafter": method, "concurrency": concurrency,
                        "held_out_concurrency": concurrency not in recorded,
                        "predicted": any(b == concurrency for b, _ in predicted) or decision is not None,
                        "measured_best_k": best, "measured_best_speedup": speedups[best][0],
                        "measured_best_ci95": speedups[best][1],
                        "recommended_k": pick, "recommended_status": decision["status"] if decision else None,
                        # the recommended k is the largest the traces let the report price: a larger may pay more
                        "recommended_at_sweep_edge": bool(decision.get("k_at_sweep_edge")) if decision else None,
                        "recommended_predicted_speedup": decision.get("speedup") if decision else None,
                        "recommended_measured_speedup": pick_measured,
                        "recommended_within_best_ci95": (low <= pick_measured <= high
                                                         if pick_measured is not None else None),
                    })
    show_table(rows)
    for model, facts in models.items():
        if facts["predicted_from"]:
            print(f"{model}: predicted from {facts['predicted_from']} (every cell held out from its context)")
        if facts["async_off_k0"]:
            print(f"{model}: k=0 with async scheduling off / on: "
                  + ", ".join(f"B={c} {v:.3f}" for c, v in facts["async_off_k0"].items()))
        for engine, ratios in facts["timed_over_recorded"].items():
            for c, ratio in ratios.items():
                if abs(ratio - 1.0) > TIMED_RECORDED_TOLERANCE:
                    print(f"{model}: {engine} at {c}: timed rounds at {ratio:.2f}x the recorded rounds' throughput "
                          f"(hooks paused vs on): the timing there is noisier than the check it serves; more rounds")
        for failed in facts["failed_engines"]:
            print(f"{model}: engine failed: {failed}")
        for missing in facts.get("missing", []):
            print(f"{model}: {missing}")
        for method, per_k in facts.get("window_prefill_share", {}).items():
            print(f"{model} {method}: prefills per token in the timed window over a whole round's, simulated / in the "
                  "recorded rounds: " + "; ".join(f"k={k} " + ", ".join(
                      f"B={c} {v['simulated']:.3f} / {v['recorded']:.3f}" for c, v in at.items())
                      for k, at in per_k.items()))
        print(f"{model}: k=0 ms per token, predicted / in the timed window / ran (errors): " + ", ".join(
            f"B={c} " + (f"{v['predicted']:.3f} / {v['window_predicted']:.3f} / {v['measured']:.3f} "
                         f"({100 * v['error']:+.1f}%, {100 * v['window_error']:+.1f}%)"
                         if v["predicted"] is not None else f"- / - / {v['measured']:.3f}")
            for c, v in facts.get("k0_ms_per_token", {}).items()))
    for r in rows:
        if "moved_with_own_prefill_speedup" in r:
            print(f"{r['model']} {r['drafter']} B={r['concurrency']} k={r['k']}: moved {r['predicted_speedup']:.2f}, "
                  f"with this run's own prefill {r['moved_with_own_prefill_speedup']:.2f}, and its acceptance "
                  f"{r['moved_with_own_prefill_and_acceptance_speedup']:.2f}; measured {r['measured_speedup']:.2f}")
    for d in decisions:
        where = f"{d['model']} {d['drafter']} B={d['concurrency']}{' (held out)' if d['held_out_concurrency'] else ''}"
        best = (f"measured best k={d['measured_best_k']} ({d['measured_best_speedup']:.2f}, "
                f"95% {d['measured_best_ci95'][0]:.2f}-{d['measured_best_ci95'][1]:.2f})")
        if not d["predicted"]:
            print(f"{where}: {best}; no prediction")
        elif d["recommended_k"] is None:
            print(f"{where}: {best}; report recommends none: {d['recommended_status']}")
        else:
            measured, predicted = d["recommended_measured_speedup"], d["recommended_predicted_speedup"]
            verdict = ("not measured" if measured is None else f"measured {measured:.2f}, "
                       + ("within" if d["recommended_within_best_ci95"] else "outside") + " the best's interval")
            print(f"{where}: {best}; report recommends k={d['recommended_k']}"
                  + ("+ (the largest k it priced)" if d.get("recommended_at_sweep_edge") else "")
                  + (f" (predicted {predicted:.2f})" if predicted is not None else "") + f": {verdict}")
    errors = [abs(r["error"]) for r in rows if r["error"] is not None and not r["held_out_concurrency"]]
    unrecorded = [abs(r["error"]) for r in rows if r["error"] is not None and r["held_out_concurrency"]]
    held_errors = [abs(r["held_out_error"]) for r in rows
                   if r["held_out_error"] is not None and not r["held_out_concurrency"]]
    if errors or unrecorded:
        print("largest |predicted − measured| / measured: "
              + (f"{100 * max(errors):.1f}% at recorded concurrencies" if errors else "none at recorded concurrencies")
              + (f"; with each k's own timing held out: {100 * max(held_errors):.1f}%" if held_errors else "")
              + (f"; {100 * max(unrecorded):.1f}% at held-out concurrencies" if unrecorded else
                 "; no prediction at held-out concurrencies"))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "models": models, "rows": rows, "decisions": decisions,
            "largest_error": max(errors) if errors else None,  # at recorded concurrencies
            "largest_held_out_error": max(held_errors) if held_errors else None,  # k's own timing held out
            "largest_held_out_concurrency_error": max(unrecorded) if unrecorded else None,
        }, indent=2) + "\n")


# timed (hooks paused) against recorded (hooks on) rounds of one engine at one concurrency: recording costs about 2%,
# so a larger gap is the rounds' noise (the EAGLE-3 k = 0 engine at 16: 0.81x with 2 rounds of 128 tokens)
TIMED_RECORDED_TOLERANCE = 0.10


def timed_over_recorded(engines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per engine (\"method k=K\") and concurrency both timed and recorded: its median timed throughput over its
    median recorded one."""
    return {f"{e['method']} k={e['k']}": {
        c: statistics.median(e["tok_s"][c]) / statistics.median(e["recorded_tok_s"][c])
        for c in e["tok_s"] if e.get("recorded_tok_s", {}).get(c)} for e in engines if "tok_s" in e}


def show_table(rows: list[dict[str, Any]]) -> None:
    """The comparison rows as a table (``*`` after B: a held-out concurrency, predicted without its trace)."""

    def show(value: float | None, width: int, digits: int = 2) -> str:
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    print(f"{'model':<12} {'drafter':<6} {'B':>4} {'k':>2} {'predicted':>9} {'measured':>8} {'95% interval':>13} "
          f"{'error':>6} {'window':>6} {'error':>6} {'held out':>8} {'error':>6} {'wall ×':>6} {'trace ×':>7} "
          f"{'step ms':>7} {'missing ms':>10} "
          f"{'grew':>6} {'fwd':>6} {'moe':>6} "
          f"{'sample':>6} {'draft':>6} {'async':>6}")
    for r in rows:
        error = 100 * r["error"] if r["error"] is not None else None
        held_error = 100 * r["held_out_error"] if r["held_out_error"] is not None else None
        window_error = 100 * r["window_error"] if r["window_error"] is not None else None
        batch = f"{r['concurrency']}{'*' if r['held_out_concurrency'] else ''}"
        print(f"{r['model']:<12} {r['drafter']:<6} {batch:>4} {r['k']:>2} "
              f"{show(r['predicted_speedup'], 9)} {show(r['measured_speedup'], 8)} "
              f"{r['measured_ci95'][0]:>6.2f}-{r['measured_ci95'][1]:<6.2f} {show(error, 5, 0)}% "
              f"{show(r['window_predicted_speedup'], 6)} {show(window_error, 5, 0)}% "
              f"{show(r['held_out_predicted_speedup'], 8)} {show(held_error, 5, 0)}% "
              f"{show(r['trace_wall_speedup'], 6)} "
              f"{show(r['trace_measured_speedup'], 7)} {show(r['trace_step_ms'], 7)} "
              f"{show(r['unexplained_ms_per_step'], 10)} {show(r['trace_step_growth_ms'], 6)} "
              f"{show(r['trace_forward_growth_ms'], 6)} {show(r['predicted_moe_growth_ms'], 6)} "
              f"{show(r['trace_sampling_growth_ms'], 6)} "
              f"{show(r['trace_drafting_ms'], 6)} {show(r['async_off_growth_ms'], 6)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("measure", help="time and record every k on this machine's vLLM")
    run.add_argument("--model", choices=("default", "kimi-k2-tp8", "kimi-k2-tp4", "kimi-k3-tp8"), default="default")
    run.add_argument("--tp", type=int, default=1, help="tensor-parallel size (kimi-k2-tp4 at 2: TP=8's per-GPU shape)")
    run.add_argument("--methods", default="ngram", help="drafters, e.g. ngram,mtp (mtp: the default model only)")
    run.add_argument("--ks", default="0,1,2,3,4")
    run.add_argument("--timed", type=parse_concurrencies, default=[1, 4, 16, 48],
                     help="concurrencies timed (hooks paused), closed loop")
    run.add_argument("--recorded", type=parse_concurrencies, default=[1, 16],
                     help="concurrencies recorded (hooks resumed) after the timed rounds")
    run.add_argument("--rounds", type=int, default=3, help="timed rounds, and as many recorded ones")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--prompt-tokens", type=int, default=None,
                     help="every prompt this many characters (a Kimi-K2 slice's tokens), the built-in ones repeated: "
                          "the context the requests decode at [default: the built-in prompts as they are]")
    run.add_argument("--synthetic-acceptance", metavar="RATES|PROFILE",
                     help="drafts kept at these rates by vLLM's synthetic rejection sampling (as moetrace record's "
                          "option: rates per draft position, or a profile of moetrace/data/acceptance-profiles.json)")
    run.add_argument("--baseline-from", type=Path, metavar="DIR",
                     help="take k = 0's engine and trace from DIR, a run of the same workload at another synthetic "
                          "acceptance (k = 0 drafts nothing: one k = 0 engine serves every profile)")
    run.add_argument("--sync-baseline", action="store_true",
                     help="also k = 0 with async scheduling off (as vLLM runs n-gram drafting)")
    run.add_argument("--hooks-ab", action="store_true",
                     help="time the --timed concurrencies in rounds with the hooks paused and on in turn, record "
                          "nothing more (is a paused engine as fast as a recording one?)")
    run.add_argument("--gpu-memory-utilization", type=float,
                     help="vLLM's share of GPU memory [default: vLLM's] (the TP=8 slice on an 80 GB H100: 0.95)")
    run.add_argument("--eager", action="store_true", help="no torch.compile or CUDA graphs (CPU smoke runs)")
    run.add_argument("--start-timeout-s", type=float, default=240.0,
                     help="an engine not started by then has hung: killed, and tried once more (slowest seen: 108 s)")
    run.add_argument("--out", type=Path, default=Path("speedup-runs"))
    run.add_argument("--budget-s", type=float, default=540.0,
                     help="start no engine past this many seconds (the longest engine so far as the estimate)")
    check = commands.add_parser("compare", help="predicted against measured speedup from a measure directory")
    check.add_argument("runs", type=Path)
    check.add_argument("--json", type=Path, help="also write the table here")
    check.add_argument("--moved-from", type=Path,
                       help="predict from this measure directory's traces instead, moved by `report --context` to "
                            "the context of RUNS's prompts (--prompt-tokens): e.g. 256-token traces for 8,192")
    slice_dir = commands.add_parser("model-dir", help="write a Kimi-K2 slice's or EAGLE-3 head's model directory "
                                                      "(for calibrate)")
    slice_dir.add_argument("--model", choices=("kimi-k2-tp8", "kimi-k2-tp4", "kimi-k3-tp8", "kimi-k2-eagle3",
                                                   "kimi-k2-tp8-eagle3"),
                           required=True)
    slice_dir.add_argument("--out", type=Path, default=Path("speedup-runs"))
    slice_dir.add_argument("--positions", type=int, default=SLICE_POSITIONS,
                           help="tokens a slice holds (max_position_embeddings; calibrate times attention to it)")
    args = parser.parse_args()
    if args.command == "model-dir":
        print(slice_model_dir(args.model, args.out, args.positions))
    else:
        measure(args) if args.command == "measure" else compare(args)


if __name__ == "__main__":
    main()
