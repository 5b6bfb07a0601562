"""Expert budgets at speed on a GPU: throughput of a Kimi-K2 TP=8 slice (dummy weights) under each per-step budget,
measured and predicted, with routing replayed token by token from a recording of the trained default model.

    # here (CPU): the default model's routing of the benchmark's prompts, top-16 candidates kept: the bank
    python benchmarks/lab/bench_budget_gpu.py bank --out runs
    # on the GPU: one engine per k, every budget in it (``moetrace_next_trace``), CUDA graphs, timed rounds
    python benchmarks/lab/bench_budget_gpu.py measure --bank runs/bank --out runs
    # anywhere moetrace runs: predicted (moetrace report) beside measured, and each budget sweep's table
    python benchmarks/lab/bench_budget_gpu.py compare runs --calibration \\
        benchmarks/results/speedup-calibrations/kimi-k2-tp8.json --json benchmarks/results/budget-sweep-h200.json

Measured: output tokens per second of the same requests at concurrency 1 (4 requests one after another) and 16
(48 requests through 16 slots), greedy, ``ignore_eos``, 96 to 160 tokens each, n-gram drafting at k = 1..4 under
budgets ``none`` and B per MoE layer and step; each (budget, concurrency) recorded into its own trace over
``--rounds`` timed rounds (recording runs in every engine alike; the budgets' work too: ``none`` is B = E). The
dummy weights route every token alike, so every router takes the recorded candidates' scores as its logits
(``moetrace record --replay-routing``): the engine's i-th request replays the bank's i-th, position by position.

Baseline: k = 0 in an engine of its own (asynchronous scheduling off, as vLLM runs n-gram drafting), same requests;
speedup = median tok/s over median tok/s at k = 0, its 95% interval bootstrapped over rounds. Predicted: ``moetrace
report --profile measured --calibration`` on the k-sweep of each (budget, concurrency), from the budgeted traces'
own unique experts per step.

Evidence it produced: benchmarks/results/budget-sweep-h200.json, budget-sweep-h200-k4-reversed.json
(commit 3ca442f, one H200, 2026-12-03).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kimi_slice import kimi_k2_slice
from speedup_predicted import report_json
from speedup_traces import ratio_ci95
from speedup_load import distinct_prompts, output_lengths
from speedup_measure import EngineStartHung, build_llm_within, model_settings

CONCURRENCIES = (1, 16)
REQUESTS = {1: 4, 16: 48}
BANK_CANDIDATES = 16


def bank(args: argparse.Namespace) -> None:
    """Record the default model on the benchmark's prompts (k = 0, top-16 candidates): the routing to replay."""
    out: Path = args.out
    prompts = out / "bank-prompts.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in distinct_prompts()))
    subprocess.run([sys.executable, "-m", "moetrace", "record", "--k", "0", "--prompts", str(prompts),
                    "--max-tokens", str(args.max_tokens), "--batch-size", "16", "--candidates",
                    str(BANK_CANDIDATES), "--out", str(out / "bank-runs"), "--force"], check=True)
    (trace,) = [p for p in (out / "bank-runs").iterdir() if p.is_dir()]
    shutil.rmtree(out / "bank", ignore_errors=True)
    shutil.copytree(trace, out / "bank", ignore=shutil.ignore_patterns("*.npz", "engine.log", "telemetry"))
    print(f"bank: {out / 'bank'}")


def generate(llm: Any, prompts: list[Any], concurrency: int, max_tokens: int) -> tuple[float, list[Any]]:
    """Output tokens per second of one round at ``concurrency``, and its outputs in request order."""
    from vllm import SamplingParams

    requests = [prompts[i % len(prompts)] for i in range(REQUESTS[concurrency])]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in output_lengths(len(requests), max_tokens)]
    groups = [[i] for i in range(len(requests))] if concurrency == 1 else [list(range(len(requests)))]
    started = time.perf_counter()
    outputs = [o for g in groups for o in llm.generate([requests[i] for i in g], [params[i] for i in g],
                                                       use_tqdm=False)]
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, outputs


def next_trace(llm: Any, options: Any, out: Path, budget: int | None, concurrency: int) -> None:
    """Close the trace under way and record the next rounds into ``out`` under ``budget``."""
    chosen = dataclasses.replace(options, out=str(out), run_id=str(out), budget=budget,
                                 workload={**options.workload, "batch_size": concurrency})
    closed = [c for c in llm.collective_rpc("moetrace_next_trace", args=(chosen.to_text(),)) if c is not None]
    if not closed or not all(c["complete"] for c in closed):
        raise RuntimeError(f"the trace before {out} did not close: {closed}")


def write_outputs(trace: Path, outputs: list[Any]) -> None:
    """The rounds' outputs beside the trace (what agreement compares), numbered in request order."""
    with open(trace / "outputs.jsonl", "w") as sink:
        for index, output in enumerate(outputs):
            sink.write(json.dumps({"request_id": str(index), "output_token_ids": list(output.outputs[0].token_ids)})
                       + "\n")


def measure_engine(settings: dict[str, Any], out: Path, budgets: list[str], rounds: int, max_tokens: int,
                   start_timeout_s: float) -> dict[str, Any]:
    """One engine at k: a warm-up round per concurrency, then ``rounds`` timed rounds per (budget, concurrency),
    each recorded into ``<out>/c<concurrency>-k<k>/budget-<name>``."""
    from moetrace.recording.engine import engine_prompts
    from moetrace.hooks.options import RecordingOptions

    k = settings["k"]
    started = time.perf_counter()
    llm = build_llm_within(settings, start_timeout_s)
    start_s = time.perf_counter() - started
    options = RecordingOptions(**settings["recording"])
    tok_s: dict[str, dict[str, list[float]]] = {}
    try:
        statuses = llm.collective_rpc("moetrace_status")
        if not any(s["recording"] for s in statuses):
            raise RuntimeError(next((s["error"] for s in statuses if s["error"]), "the plugin did not load"))
        prompts = engine_prompts(settings)
        for concurrency in CONCURRENCIES:  # warm-up: Triton compiles each new input shape
            generate(llm, prompts, concurrency, max_tokens)
        for name in budgets if k > 0 else ["none"]:
            for concurrency in CONCURRENCIES:
                trace = out / f"c{concurrency}-k{k}" / f"budget-{name}"
                next_trace(llm, options, trace, None if name == "none" else int(name), concurrency)
                timed = [generate(llm, prompts, concurrency, max_tokens) for _ in range(rounds)]
                tok_s.setdefault(name, {})[str(concurrency)] = [rate for rate, _ in timed]
                write_outputs(trace, [o for _, outputs in timed for o in outputs])
                print(f"[{time.strftime('%H:%M:%S')}] k={k} budget {name} c={concurrency}: "
                      f"{statistics.median(tok_s[name][str(concurrency)]):.0f} tok/s", flush=True)
        closed = [c for c in llm.collective_rpc("moetrace_close") if c is not None]
    finally:
        llm.llm_engine.engine_core.shutdown()
    shutil.rmtree(Path(settings["out"]), ignore_errors=True)  # the warm-up's trace
    return {"k": k, "engine_start_s": start_s, "tok_s": tok_s,
            "recording_complete": bool(closed) and all(c["complete"] for c in closed)}


def measure(args: argparse.Namespace) -> None:
    """Every engine (k) not yet in ``<out>/budget-measurements.json``, while the time budget allows one more."""
    from moetrace.hooks.vllm_api import vllm_version
    from moetrace.hooks.host import gpu_inventory

    began = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "budget-measurements.json"
    ks = [int(k) for k in args.ks.split(",")]
    budgets = args.budgets.split(",")
    if "none" not in budgets:
        raise SystemExit("--budgets: the unbudgeted run 'none' is what every budget is compared with")
    doc: dict[str, Any] = json.loads(results.read_text()) if results.exists() else {
        "model": args.model, "vllm_version": vllm_version(), "device": (gpu_inventory()["gpus"] or ["cpu"])[0],
        "cuda_graphs": not args.eager, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "requests": {str(c): n for c, n in REQUESTS.items()}, "budgets": budgets, "bank": str(args.bank),
        "command": "python benchmarks/lab/bench_budget_gpu.py " + " ".join(sys.argv[1:]), "engines": [],
    }
    longest = 0.0
    for k in ks:
        if any(e["k"] == k and "tok_s" in e for e in doc["engines"]):
            continue
        if time.perf_counter() - began + max(longest, 90.0) > args.budget_s:
            print(f"time budget of {args.budget_s:.0f} s reached: run the same command again to go on")
            return
        settings = model_settings(args.model, out, "ngram", ks, k, out / f"warmup-k{k}", args.max_tokens, args.eager, 1,
                                  max(CONCURRENCIES))
        # B = E in every layer: the budgets' work, with nothing re-routed
        experts = int(kimi_k2_slice(8)["n_routed_experts"])
        settings["recording"].update(replay_routing=str(args.bank.resolve()), budget=experts, candidates=0)
        if k == 0:
            settings["engine_args"]["async_scheduling"] = False  # as vLLM runs the n-gram drafter
        print(f"[{time.strftime('%H:%M:%S')}] k={k}: starting", flush=True)
        engine_began = time.perf_counter()
        try:
            engine = measure_engine(settings, out, budgets, args.rounds, args.max_tokens, args.start_timeout_s)
        except Exception as exc:  # one engine that fails must not cost the others
            engine = {"k": k, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      "hung": isinstance(exc, EngineStartHung)}
            print(f"k={k}: FAILED {engine['error']}", flush=True)
        longest = max(longest, time.perf_counter() - engine_began)
        doc["engines"] = [e for e in doc["engines"] if e["k"] != k] + [engine]
        results.write_text(json.dumps(doc, indent=2) + "\n")  # after every engine: nothing lost on a crash
    print(f"measurements: {results}")


def budget_sweep_table(sweep: Path, k: int, scratch: Path) -> dict[str, Any]:
    """``moetrace report SWEEP --k K --json``'s budget table (acceptance, agreement, the marked budget)."""
    done = subprocess.run([sys.executable, "-m", "moetrace", "report", str(sweep), "--k", str(k), "--json",
                           "-o", str(scratch / f"{sweep.name}.html")], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{sweep}: moetrace report failed: {done.stderr.strip()}")
    table: dict[str, Any] = json.loads(done.stdout)["budget_sweep"]
    return table


def verdict(at_k: list[dict[str, Any]], marked: str | None, min_agreement: float) -> dict[str, Any]:
    """One (concurrency, k)'s budgets: the one ``moetrace report`` marked beside the one measured fastest among the
    same candidates (the unbudgeted run and the budgets that bind at ``min_agreement``), and whether they are the
    same, or apart by less than the measurement's noise (their 95% intervals overlap)."""
    eligible = [r for r in at_k if r["agreement"] >= min_agreement and r["binds"] is not False]
    best = max(eligible, key=lambda r: r["measured_speedup"])
    chosen = next((r for r in at_k if r["budget"] == marked), None)
    if chosen is None or chosen is best:
        said = "the same" if chosen is best else "nothing marked"
    else:
        overlap = chosen["measured_ci95"][1] >= best["measured_ci95"][0]
        said = "within the measurement's noise" if overlap else "measured slower"
    return {"concurrency": at_k[0]["concurrency"], "k": at_k[0]["k"], "marked": marked,
            "measured_best": best["budget"], "verdict": said, "min_agreement": min_agreement,
            "predicted_fastest": max((r for r in at_k if r["predicted_speedup"] is not None),
                                     key=lambda r: r["predicted_speedup"])["budget"],
            "measured_fastest": max(at_k, key=lambda r: r["measured_speedup"])["budget"]}


def predicted_speedups(runs: Path, budgets: list[str], ks: list[int], calibration: Path,
                       scratch: Path) -> dict[tuple[str, int, int], float]:
    """``moetrace report``'s predicted speedup per (budget, concurrency, k), from a k-sweep of each (budget,
    concurrency): k = 0 unbudgeted, every other k under the budget."""
    predicted: dict[tuple[str, int, int], float] = {}
    for name in budgets:
        for concurrency in CONCURRENCIES:
            sweep = scratch / f"{name}-c{concurrency}"
            sweep.mkdir()
            (sweep / "k0").symlink_to((runs / f"c{concurrency}-k0" / "budget-none").resolve())
            for k in ks:
                if k > 0:
                    (sweep / f"k{k}").symlink_to((runs / f"c{concurrency}-k{k}" / f"budget-{name}").resolve())
            report = report_json(sweep, calibration, scratch, None, list(CONCURRENCIES))
            if report is None:
                raise SystemExit(f"{sweep}: moetrace report failed")
            for row in report["runs"][0]["prediction"]["per_batch"]:
                if row["batch"] == concurrency:
                    predicted[(name, concurrency, row["k"])] = row["speedup"]
    return predicted


def compared_rows(runs: Path, budgets: list[str], engines: dict[int, dict[str, Any]],
                  predicted: dict[tuple[str, int, int], float],
                  scratch: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per (concurrency, k, budget), measured beside predicted, and one verdict per (concurrency, k)."""
    rows: list[dict[str, Any]] = []
    sweeps: list[dict[str, Any]] = []
    baseline = engines[0]["tok_s"]["none"]
    for concurrency in CONCURRENCIES:
        for k in sorted(k for k in engines if k > 0):
            table = budget_sweep_table(runs / f"c{concurrency}-k{k}", k, scratch)
            marked = {row["budget"]: row for row in table["rows"]}
            rates = engines[k]["tok_s"]
            for name in budgets:
                measured, interval = ratio_ci95(rates[name][str(concurrency)], baseline[str(concurrency)])
                unbudgeted = statistics.median(rates["none"][str(concurrency)])
                rows.append({
                    "concurrency": concurrency, "k": k, "budget": name,
                    "measured_speedup": measured, "measured_ci95": interval,
                    "predicted_speedup": predicted.get((name, concurrency, k)),
                    "measured_vs_none": statistics.median(rates[name][str(concurrency)]) / unbudgeted,
                    "predicted_vs_none": (predicted[(name, concurrency, k)] / predicted[("none", concurrency, k)]
                                          if (name, concurrency, k) in predicted
                                          and ("none", concurrency, k) in predicted else None),
                    "tokens_per_step": marked[name]["tokens_per_step"],
                    "acceptance_by_position": marked[name]["acceptance_by_position"],
                    "agreement": marked[name]["agreement"],
                    "binds": marked[name]["binds"],
                })
            at_k = [r for r in rows if r["concurrency"] == concurrency and r["k"] == k]
            sweeps.append(verdict(at_k, table["best"], table["min_agreement"]))
    return rows, sweeps


def print_comparison(rows: list[dict[str, Any]], sweeps: list[dict[str, Any]]) -> None:
    print(f"{'B':>3} {'k':>2} {'budget':>6} {'predicted':>9} {'measured':>8} {'95% interval':>13} {'error':>6} "
          f"{'pred/none':>9} {'meas/none':>9} {'tok/step':>8} {'agree':>6}")
    for r in rows:
        error = (f"{100 * (r['predicted_speedup'] - r['measured_speedup']) / r['measured_speedup']:>5.0f}%"
                 if r["predicted_speedup"] is not None else f"{'-':>6}")
        print(f"{r['concurrency']:>3} {r['k']:>2} {r['budget']:>6} {r['predicted_speedup'] or float('nan'):>9.2f} "
              f"{r['measured_speedup']:>8.2f} {r['measured_ci95'][0]:>6.2f}-{r['measured_ci95'][1]:<6.2f} {error} "
              f"{r['predicted_vs_none'] or float('nan'):>9.3f} {r['measured_vs_none']:>9.3f} "
              f"{r['tokens_per_step']:>8.2f} {r['agreement']:>6.3f}")
    for s in sweeps:
        print(f"B={s['concurrency']} k={s['k']}: marked {s['marked']} (agreement >= {s['min_agreement']}), measured "
              f"best there {s['measured_best']}: {s['verdict']}; fastest predicted {s['predicted_fastest']}, measured "
              f"{s['measured_fastest']}")


def compare(args: argparse.Namespace) -> None:
    """Per (concurrency, k, budget): measured and predicted speedup over k = 0, and each over the unbudgeted run;
    per (concurrency, k) the budget moetrace marks beside the one measured fastest."""
    runs: Path = args.runs
    doc = json.loads((runs / "budget-measurements.json").read_text())
    engines = {e["k"]: e for e in doc["engines"] if "tok_s" in e}
    if 0 not in engines:
        raise SystemExit("no k = 0 engine measured")
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        predicted = predicted_speedups(runs, doc["budgets"], sorted(engines), args.calibration, scratch)
        rows, sweeps = compared_rows(runs, doc["budgets"], engines, predicted, scratch)
    print_comparison(rows, sweeps)
    errors = [abs(r["predicted_speedup"] - r["measured_speedup"]) / r["measured_speedup"] for r in rows
              if r["predicted_speedup"] is not None]
    result = {"machine": f"{doc['device']}, vLLM {doc['vllm_version']}, CUDA graphs {doc['cuda_graphs']}",
               "command": doc["command"], "rounds": doc["rounds"], "requests": doc["requests"],
               "engine_start_s": {str(k): e["engine_start_s"] for k, e in engines.items()},
               "failed_engines": [e for e in doc["engines"] if "error" in e],
               "largest_error": max(errors) if errors else None, "rows": rows, "sweeps": sweeps}
    if errors:
        print(f"largest |predicted - measured| / measured: {100 * max(errors):.1f}%")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make_bank = commands.add_parser("bank", help="record the default model's routing of the prompts (CPU)")
    make_bank.add_argument("--out", type=Path, default=Path("budget-runs"))
    make_bank.add_argument("--max-tokens", type=int, default=192)
    run = commands.add_parser("measure", help="time and record every k and budget on this machine's vLLM")
    run.add_argument("--bank", type=Path, required=True, help="the trace whose routing is replayed (bank's)")
    run.add_argument("--model", choices=("kimi-k2-tp8", "default"), default="kimi-k2-tp8",
                     help="default: the embedded model, replaying its own routing (a CPU smoke run, with --eager)")
    run.add_argument("--ks", default="0,1,2,3,4")
    run.add_argument("--budgets", default="none,8,16,24,32",
                     help="per step in every MoE layer, in the order they run in each engine ('none' included)")
    run.add_argument("--rounds", type=int, default=3)
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--eager", action="store_true", help="no torch.compile or CUDA graphs")
    run.add_argument("--start-timeout-s", type=float, default=240.0)
    run.add_argument("--out", type=Path, default=Path("budget-runs"))
    run.add_argument("--budget-s", type=float, default=480.0,
                     help="start no engine past this many seconds (the longest engine so far as the estimate)")
    check = commands.add_parser("compare", help="predicted against measured, from a measure directory")
    check.add_argument("runs", type=Path)
    check.add_argument("--calibration", type=Path, required=True)
    check.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    {"bank": bank, "measure": measure, "compare": compare}[args.command](args)


if __name__ == "__main__":
    main()
