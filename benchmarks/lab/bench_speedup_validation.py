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

Load: closed loop, the shape of a server. At concurrency C exactly C requests are in flight: C are added to vLLM's
engine (``LLMEngine.add_request``, stepped with ``step``), and each one that ends is replaced by the next until a
round's ``max(8, 3 C)`` requests have all been added. A round's throughput is the output tokens generated while C
were in flight (from the end of the step in which C requests had produced a token up to the first completion that
no request replaces: at least 2 C completions, the fill and the drain left out) over that window's wall time. Greedy,
``ignore_eos``, 192 to 320 tokens each (256 on average, ``LENGTHS``), prefix caching off, every round the same
requests.

``--timed`` (default 1,4,16,48): the concurrencies timed, moetrace's hooks paused (the engine exactly as vLLM built
it), over ``--rounds`` rounds that alternate their order, after a short warm-up at each (every batch shape
compiled) and one whole round at each timed or recorded one, not counted. ``--recorded`` (default 1,16): the
concurrencies then recorded, hooks resumed, in as many rounds of the same closed loop, so the trace is of what was
timed: a round's throughput varies by up to ±10% on the H200 (host jitter, and under speculation which requests end
together). ``compare``
predicts every timed concurrency; those not recorded are held out (``held_out_concurrency``). The engine runs at most
max(timed, recorded) requests at once; one engine per (drafter, k). Dummy-weight models get spread routing
(``spread_routing``).

Baseline: k = 0 (no speculation) on the same GPU, same workload, same run (``--sync-baseline``: also k = 0 with
async scheduling off). Measured speedup = median tok/s at k over median tok/s at k = 0; its 95% interval bootstraps
the rounds of both engines.

``--hooks-ab``: the timed concurrencies only, in rounds with the hooks paused and on in turn (``hooks_on_tok_s``
beside ``tok_s``), to tell a paused engine's speed from round order and drift.

Evidence it produced: benchmarks/results/speedup-validation*.json, speedup-*-measurements.json (latest: commit
1c1a27f, an H100, 2026-12-05: the fifth hold-out at 24 slots, the k = 0 hooks A/B, EAGLE-3 k = 3).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kimi_slice import kimi_k2_eagle3_head, kimi_k2_slice

LOAD = "closed-loop"
PROMPT_CUTS = (1.0, 0.9, 0.8, 0.7, 0.6)  # each built-in prompt cut at these fractions: 50 distinct prompts
# output lengths, as fractions of --max-tokens, request by request: requests in flight end at different steps at
# every k, k = 0 included, as a server's do (with equal lengths, C requests started together at k = 0 would end
# together, which is the benchmark's doing, not speculation's)
LENGTHS = (0.75, 1.125, 0.875, 1.25, 1.0)
WARM_UP_TOKENS = 16  # per warm-up request: 2 C of them at each timed concurrency, every batch shape compiled
# the recording times vLLM's calls one step in 8, not the recorder's 1 in 64 on a GPU: a k = 4 run of 16 requests
# has about 150 decode steps, too few for 64 (the timed rounds run with the hooks paused, so this costs them nothing)
TIME_PHASES_EVERY = 8


def parse_concurrencies(text: str) -> list[int]:
    """``1,4,16`` → [1, 4, 16]: distinct, positive, in the order given."""
    values = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be positive integers: {text!r}")
    return values


def requests_per_round(concurrency: int) -> int:
    """Requests of one round at ``concurrency``: eight one after another at 1; 3 C otherwise, so the window in
    which C are in flight covers at least 2 C completions."""
    return max(8, 3 * concurrency)


def distinct_prompts() -> list[str]:
    """The built-in prompts and shorter cuts of them (at a space), all distinct, so no two requests of a step route
    alike because they are the same text."""
    from moetrace.recording.prompts import BUILTIN_PROMPTS

    out: list[str] = []
    for cut in PROMPT_CUTS:
        for prompt in BUILTIN_PROMPTS:
            end = len(prompt) if cut == 1.0 else prompt.rfind(" ", 0, int(len(prompt) * cut))
            out.append(prompt[: max(end, 1)])
    if len(set(out)) != len(out):
        raise RuntimeError("prompt cuts are not distinct")
    return out


def output_lengths(count: int, max_tokens: int, lengths: tuple[float, ...] = LENGTHS) -> list[int]:
    """Tokens each of ``count`` requests generates (``lengths`` in turn, fractions of ``max_tokens``)."""
    return [round(max_tokens * lengths[i % len(lengths)]) for i in range(count)]


def closed_loop(llm: Any, prompts: list[Any], concurrency: int, lengths: list[int], prefix: str) -> float:
    """Output tokens per second while exactly ``concurrency`` requests are in flight: request i (prompt
    ``i % len(prompts)``, ``lengths[i]`` tokens, id ``<prefix>-<i>``, unique within the engine) is added as soon as
    one ends, until all ``len(lengths)`` are. The window opens once ``concurrency`` requests have produced a token
    and closes at the first completion that no request replaces; its tokens are the steps' deltas inside it. The
    engine runs dry before this returns. In flight as a client sees it: vLLM's engine core runs a step or so with
    C − 1 after a completion, before the replacement reaches it, as a server's does."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still runs requests of an earlier round")

    def add(index: int) -> None:
        # DELTA: each step's new tokens alone, as a streaming server gets them (no cumulative copies per step)
        params = SamplingParams(max_tokens=lengths[index], temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(f"{prefix}-{index}", prompts[index % len(prompts)], params)

    added = min(concurrency, len(lengths))
    for index in range(added):
        add(index)
    produced: set[str] = set()
    opened: float | None = None
    closed: float | None = None
    tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        step_tokens = 0
        supply_ran_out = False
        for output in outputs:
            step_tokens += len(output.outputs[0].token_ids) if output.outputs else 0
            produced.add(output.request_id)
            if output.finished:
                if added < len(lengths):
                    add(added)
                    added += 1
                else:
                    supply_ran_out = True
        if opened is not None and closed is None:
            tokens += step_tokens
            if supply_ran_out:
                closed = now
        elif opened is None and len(produced) >= concurrency:
            opened = now
    if opened is None or closed is None or closed <= opened:
        raise RuntimeError(f"{prefix}: no steady window at concurrency {concurrency} ({len(lengths)} requests)")
    return tokens / (closed - opened)


def round_order(round_index: int, concurrencies: list[int]) -> list[int]:
    """The concurrencies of one round in the order they run: alternating, so none always runs first."""
    return concurrencies if round_index % 2 == 0 else concurrencies[::-1]


def run_rounds(llm: Any, prompts: list[Any], rounds: int, concurrencies: list[int], max_tokens: int,
               tag: str) -> dict[str, list[float]]:
    """Tokens per second of ``rounds`` closed-loop rounds, per concurrency (request ids ``<tag><round>c<C>-<i>``)."""
    out: dict[str, list[float]] = {str(c): [] for c in concurrencies}
    for round_index in range(rounds):
        for concurrency in round_order(round_index, concurrencies):
            lengths = output_lengths(requests_per_round(concurrency), max_tokens)
            out[str(concurrency)].append(
                closed_loop(llm, prompts, concurrency, lengths, f"{tag}{round_index}c{concurrency}"))
    return out


def slice_model_dir(model: str, out: Path) -> Path:
    """``<out>/<model>-model``: the config of a Kimi-K2 slice (``kimi-k2-tp8``, ``kimi-k2-tp4``), dummy weights, or
    of a Kimi-K2 EAGLE-3 head (``kimi-k2-eagle3``, for ``moetrace calibrate --drafter``; ``kimi-k2-tp8-eagle3``,
    the drafter of the TP=8 slice)."""
    model_dir = out / f"{model}-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    if model.endswith("eagle3"):
        tp = model.removeprefix("kimi-k2-").removesuffix("eagle3").strip("-").removeprefix("tp") or "1"
        config = kimi_k2_eagle3_head(int(tp))
    else:
        config = kimi_k2_slice(int(model.removeprefix("kimi-k2-tp")))
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def model_settings(model: str, out: Path, method: str, ks: list[int], k: int, trace_dir: Path,
                   max_tokens: int, eager: bool, tp: int, max_num_seqs: int) -> dict[str, Any]:
    """Engine settings of one recorded engine (``moetrace.recording.record.engine_settings``) for the default model or a
    Kimi-K2 slice (``kimi-k2-tp8``: one rank of TP=8 on one GPU; ``kimi-k2-tp4`` at ``tp`` 2: the same per-GPU
    shape with real all-reduces; dummy weights, bytes as token ids), running at most ``max_num_seqs`` requests."""
    from moetrace.default_model import encode_text
    from moetrace.recording.drafters import resolve_drafter
    from moetrace.recording.record import RecordRequest, engine_settings, resolve_model

    prompts = distinct_prompts()
    engine_args: dict[str, Any] = {}
    model_path: str | None = None
    if model.startswith("kimi-k2-tp"):
        model_path = str(slice_model_dir(model, out))
        engine_args = {"load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": 1024}
    # Every round does the same work: no prefix cache hits on prompts an earlier round sent.
    engine_args["enable_prefix_caching"] = False
    drafter = None
    if method == "eagle3":  # the slice's head, dummy weights as the slice's; the default model ships its own
        drafter = (str(slice_model_dir(f"{model}-eagle3", out)) if model_path is not None
                   else resolve_drafter(method, None, resolve_model(None).path, embedded_target=True))
    request = RecordRequest(model=model_path, ks=ks, method=method, drafter=drafter, batch_size=max_num_seqs, tp=tp,
                            max_tokens=max_tokens, out=out, eager=eager, engine_args=engine_args,
                            time_phases_every=TIME_PHASES_EVERY)
    settings = engine_settings(request, resolve_model(model_path), k, trace_dir, prompts,
                               trace_dir / "progress")
    settings["token_prompts"] = [encode_text(p) for p in prompts]  # bytes: inside both models' vocabularies
    if model_path is not None:
        settings["dtype"] = "bfloat16"
        settings["max_model_len"] = 1024
    return settings


def spread_routing(worker: Any) -> int:
    """In the worker: every MoE router loses its selection bias, and gets random gate rows (its own seed per
    layer) where the weight is a plain matrix (CPU builds repack it). vLLM's dummy weights draw every tensor from
    one seed and tiny values, so such a router picks the same experts for every token (its bias decides) and the
    MoE cost never grows with k; a trained router spreads tokens over experts, and so does this one. Parameters
    change in place: compiled graphs read them as they are. Returns the routers changed."""
    import torch

    layers = 0
    for name, module in worker.model_runner.model.named_modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if not name.endswith(".gate") or not isinstance(bias, torch.Tensor):
            continue
        bias.data.zero_()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            generator = torch.Generator(device=weight.device).manual_seed(1 + layers)
            weight.data.normal_(0.0, 1.0, generator=generator)
        layers += 1
    return layers


class EngineStartHung(RuntimeError):
    """vLLM's engine did not start in time (seen: the first engine on a fresh GPU host, before it loaded its model;
    it started when tried again). vLLM itself waits for ever."""


def build_llm_within(settings: dict[str, Any], seconds: float) -> Any:
    """``moetrace.recording.engine.build_llm``, or ``EngineStartHung`` once ``seconds`` pass: from then until vLLM
    gives up, the engine's processes are killed as they appear, which ends vLLM's wait for them."""
    import contextlib
    import threading

    import psutil

    from moetrace.recording.engine import build_llm

    done, hung = threading.Event(), threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        hung.set()
        while not done.is_set():
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            done.wait(1.0)

    threading.Thread(target=watch, name="engine-start-watchdog", daemon=True).start()
    try:
        return build_llm(settings)
    except Exception as exc:
        if hung.is_set():
            raise EngineStartHung(f"the engine did not start in {seconds:.0f} s") from exc
        raise
    finally:
        done.set()


def hooks_ab_rounds(llm: Any, prompts: list[Any], rounds: int, concurrencies: list[int], max_tokens: int
                    ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Tokens per second of ``rounds`` closed-loop rounds with the hooks paused and as many with them on, each round
    of one right after a round of the other (which comes first alternates): (paused, on) per concurrency, and vLLM's
    speculative-decoding counters over the rounds with the hooks on (what the trace holds). Tells whether "paused"
    runs the engine as fast as the recorded rounds, round order and drift aside."""
    from moetrace.recording.engine import spec_decode_counters

    paused: dict[str, list[float]] = {str(c): [] for c in concurrencies}
    hooked: dict[str, list[float]] = {str(c): [] for c in concurrencies}
    counters: dict[str, float] = {}
    for round_index in range(rounds):
        for hooks_on in ((False, True) if round_index % 2 == 0 else (True, False)):
            llm.collective_rpc("moetrace_resume" if hooks_on else "moetrace_pause")
            before = spec_decode_counters(llm)
            for concurrency in round_order(round_index, concurrencies):
                lengths = output_lengths(requests_per_round(concurrency), max_tokens)
                tag = f"{'on' if hooks_on else 'off'}{round_index}c{concurrency}"
                (hooked if hooks_on else paused)[str(concurrency)].append(
                    closed_loop(llm, prompts, concurrency, lengths, tag))
            if hooks_on:
                for name, value in spec_decode_counters(llm).items():
                    counters[name] = counters.get(name, 0.0) + value - before.get(name, 0.0)
    return paused, hooked, counters


def measure_engine(settings: dict[str, Any], rounds: int, max_tokens: int, start_timeout_s: float,
                   timed: list[int], recorded: list[int], hooks_ab: bool = False) -> dict[str, Any]:
    """Start one engine, time ``rounds`` closed-loop rounds at the ``timed`` concurrencies with the hooks paused,
    record as many at the ``recorded`` ones, close the trace. With ``hooks_ab``, the timed concurrencies instead
    in rounds with the hooks paused and on in turn (``hooks_ab_rounds``), and nothing more recorded."""
    from moetrace.recording.engine import engine_prompts, spec_decode_counters
    from moetrace.trace.manifest import amend_manifest
    from moetrace.trace.reader import read_manifest

    started = time.perf_counter()
    llm = build_llm_within(settings, start_timeout_s)
    start_s = time.perf_counter() - started
    try:
        prompts = engine_prompts(settings)
        statuses = llm.collective_rpc("moetrace_status")
        if not any(s["recording"] for s in statuses):
            raise RuntimeError(next((s["error"] for s in statuses if s["error"]), "the plugin did not load"))
        if settings["engine_args"].get("load_format") == "dummy" and not all(llm.collective_rpc(spread_routing)):
            raise RuntimeError("no MoE router found to spread")
        llm.collective_rpc("moetrace_pause")
        for concurrency in timed:  # warm-up, short: Triton compiles each new batch shape
            closed_loop(llm, prompts, concurrency, [min(WARM_UP_TOKENS, max_tokens)] * (2 * concurrency),
                        f"w{concurrency}")
        # then one whole round at each concurrency timed or recorded, not counted: an engine's first full round ran
        # slow after the short warm-up alone (an H100's k = 0 at 16: 1,451 tok/s, its next rounds 1,862-1,979 with
        # the hooks paused or on)
        run_rounds(llm, prompts, 1, list(dict.fromkeys(timed + recorded)), max_tokens, "u")
        hooks_on_rates: dict[str, list[float]] = {}
        if hooks_ab:
            timings, hooks_on_rates, counters = hooks_ab_rounds(llm, prompts, rounds, timed, max_tokens)
            recorded_rates: dict[str, list[float]] = {}
        else:
            timings = run_rounds(llm, prompts, rounds, timed, max_tokens, "t")
            before = spec_decode_counters(llm)
            llm.collective_rpc("moetrace_resume")
            recorded_rates = run_rounds(llm, prompts, rounds, recorded, max_tokens, "r")
            # vLLM's counters over the recorded workload only: the cross-check of the trace's drafts and acceptances
            counters = {name: value - before.get(name, 0.0) for name, value in spec_decode_counters(llm).items()}
        closed = [c for c in llm.collective_rpc("moetrace_close") if c is not None]
    finally:
        llm.llm_engine.engine_core.shutdown()
    trace = Path(settings["out"])
    recorded_k = read_manifest(trace).spec.k
    if recorded_k != settings["k"]:
        raise RuntimeError(f"{trace} holds a trace at k={recorded_k}, not k={settings['k']}")
    amend_manifest(trace, vllm_counters=counters)
    return {"method": settings["method"], "k": settings["k"], "trace": str(trace), "engine_start_s": start_s,
            "tok_s": timings, "recorded_tok_s": recorded_rates, "vllm_counters": counters,
            **({"hooks_on_tok_s": hooks_on_rates} if hooks_ab else {}),
            "recording_complete": all(c["complete"] for c in closed) and bool(closed),
            "engine_thread_us_per_step": [c.get("engine_thread_us_per_step") for c in closed]}


def measure(args: argparse.Namespace) -> None:
    """Every (drafter, k) engine not yet in ``<out>/<model>-measurements.json``, while the time budget allows one
    more (a call that stops early is resumed by running the same command again)."""
    from moetrace.hooks.vllm_api import vllm_version
    from moetrace.hooks.host import gpu_inventory

    began = time.perf_counter()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(spread_routing): a function of this script
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / f"{args.model}-measurements.json"
    ks = [int(k) for k in args.ks.split(",")]
    timed, recorded = args.timed, args.recorded
    max_num_seqs = max(timed + recorded)
    workload = {"load": LOAD, "timed": timed, "recorded": recorded, "max_num_seqs": max_num_seqs,
                "max_tokens": args.max_tokens, "lengths": list(LENGTHS), "rounds": args.rounds,
                "requests": {str(c): requests_per_round(c) for c in sorted(set(timed + recorded))},
                "gpu_memory_utilization": args.gpu_memory_utilization, **({"hooks_ab": True} if args.hooks_ab else {})}
    doc: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {
        "model": args.model, "tp": args.tp, "vllm_version": vllm_version(),
        "device": (gpu_inventory()["gpus"] or ["cpu"])[0], "cuda_graphs": not args.eager, **workload,
        "command": "python benchmarks/lab/bench_speedup_validation.py " + " ".join(sys.argv[1:]),
        "engines": [],
    }
    differs = [name for name, value in workload.items() if doc.get(name) != value]
    if differs:  # a resumed call adds engines to the same workload only
        raise SystemExit(f"{results_path} measured another workload ({', '.join(differs)} differ): "
                         "use another --out or the same arguments")
    done = {(e["method"], e["k"]) for e in doc["engines"] if "tok_s" in e}  # a failed engine is tried again
    # k = 0 runs no drafter: one engine serves as every drafter's baseline; "sync" is k = 0 without vLLM's async
    # scheduling, which vLLM switches off for n-gram drafting (the price of that switch, measured apart)
    # sync right after k = 0: without it no n-gram k > 0 is predicted, so a time budget that ends the call early
    # cuts a k > 0 engine (the next call resumes with it), not the baseline's other half
    methods = args.methods.split(",")
    plan = ([(methods[0], 0)] if 0 in ks else []) + ([("sync", 0)] if args.sync_baseline else []) + [
        (method, k) for method in methods for k in ks if k > 0]
    longest = 0.0
    for method, k in plan:
        sweep = out / f"{args.model}-{method}-k{'-'.join(map(str, ks))}"
        if (method, k) in done:
            continue
        if time.perf_counter() - began + max(longest, 60.0) > args.budget_s:
            print(f"time budget of {args.budget_s:.0f} s reached: run the same command again to go on")
            return
        trace_dir = sweep / f"k{k}"
        settings = model_settings(args.model, out, "ngram" if method == "sync" else method, ks, k, trace_dir,
                                  args.max_tokens, args.eager, args.tp, max_num_seqs)
        if method == "sync":
            settings["engine_args"]["async_scheduling"] = False
        if args.gpu_memory_utilization is not None:
            settings["engine_args"]["gpu_memory_utilization"] = args.gpu_memory_utilization
        print(f"[{time.strftime('%H:%M:%S')}] {args.model} {method} k={k}: starting", flush=True)
        for attempt in (1, 2):
            shutil.rmtree(trace_dir, ignore_errors=True)  # a half-written trace of an interrupted call or attempt
            engine_began = time.perf_counter()
            try:
                engine = measure_engine(settings, args.rounds, args.max_tokens, args.start_timeout_s, timed, recorded,
                                        args.hooks_ab)
            except Exception as exc:  # one engine that vLLM cannot run must not cost the others
                engine = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                print(f"{method} k={k}: FAILED {engine['error']}", flush=True)
                fits = time.perf_counter() - began + max(longest, 60.0) <= args.budget_s
                if isinstance(exc, EngineStartHung) and attempt == 1 and fits:
                    continue  # once more
            break
        if "tok_s" in engine:  # the longest engine that ran estimates the next one
            longest = max(longest, time.perf_counter() - engine_began)
        engine.update(method=method, k=k, trace=str(trace_dir.relative_to(out)))
        doc["engines"] = [e for e in doc["engines"] if (e["method"], e["k"]) != (method, k)] + [engine]
        results_path.write_text(json.dumps(doc, indent=2) + "\n")  # after every engine: nothing lost on a crash
        if "tok_s" in engine:
            medians = {c: round(statistics.median(v), 1) for c, v in engine["tok_s"].items()}
            if "hooks_on_tok_s" in engine:
                medians |= {f"{c} hooks on": round(statistics.median(v), 1)
                            for c, v in engine["hooks_on_tok_s"].items()}
            print(f"[{time.strftime('%H:%M:%S')}] {method} k={k}: start {engine['engine_start_s']:.0f} s, "
                  f"tok/s by concurrency {medians}", flush=True)
    failed = [f"{e['method']} k={e['k']}" for e in doc["engines"] if "tok_s" not in e]
    if failed:  # the driver script runs this again until every engine has measured
        print(f"failed engines, tried again on the next run: {', '.join(failed)}")
    else:
        print(f"measurements: {results_path}")


def ratio_ci95(numerator: list[float], denominator: list[float], resamples: int = 10_000) -> tuple[float, list[float]]:
    """median(numerator) / median(denominator) and its bootstrap 95% interval, each engine's rounds resampled on
    their own (the engines ran one after another, so rounds do not pair)."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(numerator, k=len(numerator)))
                    / statistics.median(rng.choices(denominator, k=len(denominator))) for _ in range(resamples))
    return (statistics.median(numerator) / statistics.median(denominator),
            [ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]])


def report_json(sweep: Path, calibration: Path, scratch: Path, k0_sync: Path | None,
                batches: list[int]) -> dict[str, Any] | None:
    """``moetrace report --profile measured --batch <batches>`` as a user runs it (a subprocess): its JSON, or None
    (and why, printed) where it failed. ``k0_sync``: the k=0 trace with async scheduling off, for a drafter vLLM
    runs that way."""
    command = [sys.executable, "-m", "moetrace", "report", str(sweep), "--calibration", str(calibration),
               "--profile", "measured", "--batch", ",".join(map(str, batches)), "--json",
               "-o", str(scratch / f"{sweep.name}.html"), "--force",
               *(["--k0-sync", str(k0_sync)] if k0_sync is not None else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"{sweep.name}: moetrace report failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def predicted_rows(report: dict[str, Any] | None) -> tuple[dict[tuple[int, int], Any], dict[tuple[int, int], Any]]:
    """The report's predicted rows and its check against the recorded steps, each by (batch, k); empty where the
    report failed or predicted nothing."""
    prediction = report["runs"][0]["prediction"] if report is not None else None
    if prediction is None:
        return {}, {}
    return ({(r["batch"], r["k"]): r for r in prediction["per_batch"]},
            {(r["batch"], r["k"]): r for r in prediction["against_trace"]})


def recommended(report: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """The report's decision by concurrency: its row (``k`` null where it recommends none, ``status`` says why)."""
    if report is None:
        return {}
    run = report["runs"][0]
    decisions = run.get("decision") or [d for d in report.get("decision", []) if d.get("label") == run.get("label")]
    decision = decisions if isinstance(decisions, dict) else (decisions[0] if decisions else {})
    return {int(r["batch"]): r for r in decision.get("per_batch", [])}


def recorded_tok_s(trace: Path, max_tokens: int, lengths: tuple[float, ...], rounds: int,
                   recorded: list[int]) -> dict[int, float]:
    """Per recorded concurrency: output tokens per second in the closed loop's window, from the trace's own steps
    (the median over rounds), so it tells the recorded steps apart from what the host adds around them. Requests
    were recorded in ``round_order``, ``requests_per_round(C)`` each; a request's index in the trace is the order
    vLLM first ran it, which is the order they were added. Per round: the window opens as the step ends in which the
    last of the first C requests produced its first token, and closes as the (n − C + 1)-th of its n requests ends
    (the first that no request replaced); its tokens are what each request gained (1 + accepted drafts a step,
    no more than its output length) in steps that ended inside it."""
    import polars as pl

    steps = (pl.scan_parquet(str(trace / "steps" / "*.parquet"))
             .select(pl.col("request").cast(pl.Int64), "step", "t_end_ns",
                     gained=pl.col("num_accepted").cast(pl.Int64) + 1).collect())
    expected = rounds * sum(requests_per_round(c) for c in recorded)
    if steps.get_column("request").n_unique() != expected:
        raise SystemExit(f"{trace}: {steps.get_column('request').n_unique()} requests recorded, {expected} expected "
                         f"from {rounds} round(s) at {recorded}")
    rates: dict[int, list[float]] = {c: [] for c in recorded}
    first = 0
    for round_index in range(rounds):
        for concurrency in round_order(round_index, recorded):
            count = requests_per_round(concurrency)
            caps = pl.DataFrame({"request": range(first, first + count),
                                 "length": output_lengths(count, max_tokens, lengths)})
            part = steps.join(caps, on="request").sort("request", "step").with_columns(
                emitted=pl.min_horizontal(pl.col("gained").cum_sum().over("request"), pl.col("length")))
            spans = (part.group_by("request").agg(first_end=pl.col("t_end_ns").min(), end=pl.col("t_end_ns").max())
                     .sort("request"))
            opened = int(spans.head(concurrency).get_column("first_end").max())  # type: ignore[arg-type]
            closed = int(spans.get_column("end").sort()[count - concurrency])

            def emitted_by(moment: int, part: pl.DataFrame = part) -> int:
                return int(part.filter(pl.col("t_end_ns") <= moment).group_by("request")
                           .agg(pl.col("emitted").max()).get_column("emitted").sum())

            rates[concurrency].append((emitted_by(closed) - emitted_by(opened)) / ((closed - opened) / 1e9))
            first += count
    return {c: statistics.median(r) for c, r in rates.items()}


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

            def wall(engine: dict[str, Any], doc: dict[str, Any] = doc, lengths: tuple[float, ...] = lengths,
                     recorded: list[int] = recorded) -> dict[int, float]:
                return recorded_tok_s(runs / engine["trace"], doc["max_tokens"], lengths, recorded_rounds(engine),
                                      recorded)

            baseline_wall = wall(baseline)
            sync = next((e for e in engines if e["method"] == "sync"), None)
            models[model] = {
                "device": doc["device"], "vllm_version": doc["vllm_version"], "tp": doc.get("tp", 1),
                "command": doc["command"], "calibration": calibration.name, "load": doc["load"], "timed": timed,
                "recorded": recorded, "max_num_seqs": doc["max_num_seqs"], "requests": doc["requests"],
                "failed_engines": [f"{e['method']} k={e['k']}: {e['error']}" for e in doc["engines"] if "error" in e],
                "async_off_k0": None if sync is None else {
                    c: ratio_ci95(sync["tok_s"][c], baseline["tok_s"][c])[0] for c in sync["tok_s"]},
                "timed_over_recorded": timed_over_recorded(engines),
            }
            for method in dict.fromkeys(e["method"] for e in engines if e["k"] > 0 and e["method"] != "sync"):
                sweep = (runs / next(e["trace"] for e in engines if e["method"] == method)).parent
                if not (sweep / "k0").exists():  # k = 0 runs no drafter: the shared baseline joins each sweep
                    (sweep / "k0").symlink_to(Path("..") / Path(baseline["trace"]))
                # vLLM 0.26 drafts n-gram with async scheduling off, MTP and EAGLE-3 with it on (the manifests say)

                def asynchronous(engine: dict[str, Any]) -> bool:
                    manifest = json.loads((runs / engine["trace"] / "manifest.json").read_text())
                    return bool(manifest["capture"].get("async_scheduling", True))

                drafted_sync = not asynchronous(next(e for e in engines if e["method"] == method and e["k"] > 0))
                k0_sync = (runs / sync["trace"] if sync is not None and drafted_sync and asynchronous(baseline)
                           else None)
                report = report_json(sweep, calibration, Path(scratch), k0_sync, timed)
                if report is not None and report["runs"][0]["prediction"] is not None:
                    models[model].setdefault("prediction_basis", {})[method] = (
                        report["runs"][0]["prediction"]["basis"]["mode"])
                predicted, checked = predicted_rows(report)
                chosen = recommended(report)
                drafted = [e for e in engines if e["method"] == method and e["k"] > 0]
                for engine in drafted:
                    held_out, _ = predicted_rows(report_json(held_out_sweep(sweep, engine["k"], Path(scratch)),
                                                             calibration, Path(scratch), k0_sync, timed))
                    engine_wall = wall(engine)
                    for concurrency in timed:
                        key, at_recorded = (concurrency, engine["k"]), concurrency in recorded
                        measured, interval = ratio_ci95(engine["tok_s"][str(concurrency)],
                                                        baseline["tok_s"][str(concurrency)])
                        row, trace = predicted.get(key), checked.get(key, {})
                        row0 = predicted.get((concurrency, 0))
                        rows.append({
                            "model": model, "drafter": method, "concurrency": concurrency, "k": engine["k"],
                            # predicted at a concurrency no trace recorded: from the recorded ones alone
                            "held_out_concurrency": not at_recorded,
                            "predicted_speedup": row["speedup"] if row else None,
                            "measured_speedup": measured, "measured_ci95": interval,
                            "error": (row["speedup"] - measured) / measured if row else None,
                            # predicted with this k's own timing of vLLM's calls left out (held_out_sweep)
                            "held_out_predicted_speedup": held_out[key]["speedup"] if key in held_out else None,
                            "held_out_error": ((held_out[key]["speedup"] - measured) / measured
                                               if key in held_out else None),
                            "trace_measured_speedup": trace.get("measured_speedup"),
                            "trace_wall_speedup": (engine_wall[concurrency] / baseline_wall[concurrency]
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
                            "command": doc["command"],
                        })
                if drafted_sync and k0_sync is None:
                    models[model].setdefault("missing", []).append(
                        f"{method}: drafted with async scheduling off, but no k=0 trace ran that way (--sync-baseline):"
                        f" its predictions leave out what that switch costs a step")
                for concurrency in timed:  # the k=0 step: time per token the report predicts, the k=0 engine ran
                    row0 = predicted.get((concurrency, 0))
                    ran = concurrency / statistics.median(baseline["tok_s"][str(concurrency)]) * 1e3
                    estimate = (row0["step_ms"] + (row0["prefill_ms_per_token"] or 0.0)) if row0 else None
                    models[model].setdefault("k0_ms_per_token", {})[str(concurrency)] = {
                        "predicted": estimate, "measured": ran, "step_source": row0["step_source"] if row0 else None,
                        "error": (estimate - ran) / ran if estimate is not None else None}
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
                        "recommended_predicted_speedup": decision.get("speedup") if decision else None,
                        "recommended_measured_speedup": pick_measured,
                        "recommended_within_best_ci95": (low <= pick_measured <= high
                                                         if pick_measured is not None else None),
                    })
    show_table(rows)
    for model, facts in models.items():
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
        print(f"{model}: k=0 ms per token, predicted / ran (error): " + ", ".join(
            f"B={c} " + (f"{v['predicted']:.3f} / {v['measured']:.3f} ({100 * v['error']:+.1f}%)"
                         if v["predicted"] is not None else f"- / {v['measured']:.3f}")
            for c, v in facts.get("k0_ms_per_token", {}).items()))
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
          f"{'error':>6} {'held out':>8} {'error':>6} {'wall ×':>6} {'trace ×':>7} {'step ms':>7} {'missing ms':>10} "
          f"{'grew':>6} {'fwd':>6} {'moe':>6} "
          f"{'sample':>6} {'draft':>6} {'async':>6}")
    for r in rows:
        error = 100 * r["error"] if r["error"] is not None else None
        held_error = 100 * r["held_out_error"] if r["held_out_error"] is not None else None
        batch = f"{r['concurrency']}{'*' if r['held_out_concurrency'] else ''}"
        print(f"{r['model']:<12} {r['drafter']:<6} {batch:>4} {r['k']:>2} "
              f"{show(r['predicted_speedup'], 9)} {show(r['measured_speedup'], 8)} "
              f"{r['measured_ci95'][0]:>6.2f}-{r['measured_ci95'][1]:<6.2f} {show(error, 5, 0)}% "
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
    run.add_argument("--model", choices=("default", "kimi-k2-tp8", "kimi-k2-tp4"), default="default")
    run.add_argument("--tp", type=int, default=1, help="tensor-parallel size (kimi-k2-tp4 at 2: TP=8's per-GPU shape)")
    run.add_argument("--methods", default="ngram", help="drafters, e.g. ngram,mtp (mtp: the default model only)")
    run.add_argument("--ks", default="0,1,2,3,4")
    run.add_argument("--timed", type=parse_concurrencies, default=[1, 4, 16, 48],
                     help="concurrencies timed (hooks paused), closed loop")
    run.add_argument("--recorded", type=parse_concurrencies, default=[1, 16],
                     help="concurrencies recorded (hooks resumed) after the timed rounds")
    run.add_argument("--rounds", type=int, default=3, help="timed rounds, and as many recorded ones")
    run.add_argument("--max-tokens", type=int, default=256)
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
    slice_dir = commands.add_parser("model-dir", help="write a Kimi-K2 slice's or EAGLE-3 head's model directory "
                                                      "(for calibrate)")
    slice_dir.add_argument("--model", choices=("kimi-k2-tp8", "kimi-k2-tp4", "kimi-k2-eagle3", "kimi-k2-tp8-eagle3"),
                           required=True)
    slice_dir.add_argument("--out", type=Path, default=Path("speedup-runs"))
    args = parser.parse_args()
    if args.command == "model-dir":
        print(slice_model_dir(args.model, args.out))
    else:
        measure(args) if args.command == "measure" else compare(args)


if __name__ == "__main__":
    main()
