"""The GPU side of ``bench_speedup_validation.py``, its ``measure`` command: closed-loop rounds of each k's engine
with moetrace's hooks paused, then recorded in the same closed loop, one engine per (drafter, k).

The load (closed loop, what a round is): ``speedup_load.py``.

``--timed`` (default 1,4,16,48): the concurrencies timed, moetrace's hooks paused (the engine exactly as vLLM built
it), over ``--rounds`` rounds that alternate their order, after a short warm-up at each (every input shape
compiled) and one whole round at each timed or recorded one, not counted. ``--recorded`` (default 1,16): the
concurrencies then recorded, hooks resumed, in as many rounds of the same closed loop, so the trace is of what was
timed: a round's throughput varies by up to ±10% on the H200 (host jitter, and under speculation which requests end
together). ``compare``
predicts every timed concurrency; those not recorded are held out (``held_out_concurrency``). The engine runs at most
max(timed, recorded) requests at once; one engine per (drafter, k). Dummy-weight models get spread routing
(``spread_routing``).

``--hooks-ab``: the timed concurrencies only, in rounds with the hooks paused and on in turn (``hooks_on_tok_s``
beside ``tok_s``), to tell a paused engine's speed from round order and drift.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kimi_slice import KIMI_K3_MXFP4, kimi_k2_eagle3_head, kimi_k2_slice, kimi_k3_slice
from speedup_load import LENGTHS, LOAD, distinct_prompts, model_len, output_lengths, requests_per_round, round_order

WARM_UP_TOKENS = 16  # per warm-up request: 2 C of them at each timed concurrency, every input shape compiled
# the recording times vLLM's calls one step in 8, not the recorder's 1 in 64 on a GPU: a k = 4 run of 16 requests
# has about 150 decode steps, too few for 64 (the timed rounds run with the hooks paused, so this costs them nothing)
TIME_PHASES_EVERY = 8


def closed_loop(llm: Any, prompts: list[Any], concurrency: int, lengths: list[int], prefix: str) -> float:
    """Output tokens per second while exactly ``concurrency`` requests are in flight: request i (prompt
    ``i % len(prompts)``, ``lengths[i]`` tokens, id ``<prefix>-<i>``, unique within the engine) is added as soon as
    one ends, until all ``len(lengths)`` are. The span opens once ``concurrency`` requests have produced a token
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
        raise RuntimeError(f"{prefix}: no steady span at concurrency {concurrency} ({len(lengths)} requests)")
    return tokens / (closed - opened)


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


# Tokens every slice holds (max_position_embeddings): the longest context its traces are moved to
# (`report --context 8192`, 8,192 tokens of prompt and 256 of output: h200_next_checks.sh) and its calibration times
# attention to; `report --context` refuses a context past it. Timing is max_model_len's, not this.
SLICE_POSITIONS = 8464


def slice_model_dir(model: str, out: Path, positions: int = SLICE_POSITIONS) -> Path:
    """``<out>/<model>-model``: the config of a Kimi-K2 slice (``kimi-k2-tp8``, ``kimi-k2-tp4``) or a Kimi-K3-shaped
    one in MXFP4 (``kimi-k3-tp8``, ``kimi_slice.kimi_k3_slice``), dummy weights, or
    of a Kimi-K2 EAGLE-3 head (``kimi-k2-eagle3``, for ``moetrace calibrate --drafter``; ``kimi-k2-tp8-eagle3``,
    the drafter of the TP=8 slice); a slice holds at least ``positions`` tokens, and never fewer than
    ``SLICE_POSITIONS``."""
    model_dir = out / f"{model}-model"
    model_dir.mkdir(parents=True, exist_ok=True)
    if model.endswith("eagle3"):
        tp = model.removeprefix("kimi-k2-").removesuffix("eagle3").strip("-").removeprefix("tp") or "1"
        config = kimi_k2_eagle3_head(int(tp))
    else:
        config = (kimi_k3_slice(int(model.removeprefix("kimi-k3-tp")), KIMI_K3_MXFP4) if model.startswith("kimi-k3")
                  else kimi_k2_slice(int(model.removeprefix("kimi-k2-tp"))))
        config["max_position_embeddings"] = max(config["max_position_embeddings"], positions, SLICE_POSITIONS)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def model_settings(model: str, out: Path, method: str, ks: list[int], k: int, trace_dir: Path,
                   max_tokens: int, eager: bool, tp: int, max_num_seqs: int,
                   prompt_tokens: int | None = None,
                   synthetic_acceptance: tuple[float, ...] | None = None) -> dict[str, Any]:
    """Engine settings of one recorded engine (``moetrace.recording.record.engine_settings``) for the default model or a
    Kimi-K2 slice (``kimi-k2-tp8``: one rank of TP=8 on one GPU; ``kimi-k2-tp4`` at ``tp`` 2: the same per-GPU
    shape with real all-reduces; dummy weights, bytes as token ids), running at most ``max_num_seqs`` requests, on
    prompts of ``prompt_tokens`` characters where given (``distinct_prompts``)."""
    from moetrace.default_model import encode_text
    from moetrace.recording.drafters import resolve_drafter
    from moetrace.recording.record import RecordRequest, engine_settings, resolve_model

    prompts = distinct_prompts(prompt_tokens)  # ``synthetic_acceptance``: as ``moetrace record --synthetic-acceptance``
    engine_args: dict[str, Any] = {}
    model_path: str | None = None
    length = model_len(prompt_tokens, max_tokens)
    if model.startswith(("kimi-k2-tp", "kimi-k3-tp")):
        model_path = str(slice_model_dir(model, out, length))
        engine_args = {"load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": length}
    # Every round does the same work: no prefix cache hits on prompts an earlier round sent.
    engine_args["enable_prefix_caching"] = False
    drafter = None
    if method == "eagle3":  # the slice's head, dummy weights as the slice's; the default model ships its own
        drafter = (str(slice_model_dir(f"{model}-eagle3", out)) if model_path is not None
                   else resolve_drafter(method, None, resolve_model(None).path, embedded_target=True))
    request = RecordRequest(model=model_path, ks=ks, method=method, drafter=drafter, batch_size=max_num_seqs, tp=tp,
                            max_tokens=max_tokens, out=out, eager=eager, engine_args=engine_args,
                            synthetic_acceptance=synthetic_acceptance, time_phases_every=TIME_PHASES_EVERY)
    settings = engine_settings(request, resolve_model(model_path), k, trace_dir, prompts,
                               trace_dir / "progress")
    settings["token_prompts"] = [encode_text(p) for p in prompts]  # bytes: inside both models' vocabularies
    if model_path is not None:
        settings["dtype"] = "bfloat16"
        settings["max_model_len"] = length
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
        for concurrency in timed:  # warm-up, short: Triton compiles each new input shape
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


def adopt_baseline(source: Path, out: Path, doc: dict[str, Any], workload: dict[str, Any], method: str) -> None:
    """k = 0 drafts nothing, so no acceptance applies to it: the k = 0 engine that ``source`` (another measure
    directory) measured on this workload but for its synthetic acceptance joins ``doc`` (its entry and its trace,
    copied into ``out``), unless ``doc`` has one. Refused in one line where anything else differs."""
    if any(e["k"] == 0 and e["method"] == method and "tok_s" in e for e in doc["engines"]):
        return
    path = source / f"{doc['model']}-measurements.json"
    if not path.exists():
        raise SystemExit(f"--baseline-from {source} has no {path.name}: run its part first")
    other = json.loads(path.read_text())
    engine = next((e for e in other["engines"] if e["k"] == 0 and e["method"] == method and "tok_s" in e), None)
    differs = [name for name, value in workload.items()
               if name != "synthetic_acceptance" and other.get(name) != value]
    if differs:
        raise SystemExit(f"--baseline-from {source} measured another workload ({', '.join(differs)} differ)")
    if engine is None:
        raise SystemExit(f"--baseline-from {source} holds no k = 0 {method} engine that measured")
    shutil.copytree(source / engine["trace"], out / engine["trace"], dirs_exist_ok=True)
    doc["engines"].append({**engine, "baseline_from": str(source)})


def workload_of(args: argparse.Namespace) -> dict[str, Any]:
    """What every engine of a measure directory runs alike: a resumed call adds engines to the same workload only."""
    from moetrace.recording.record import parse_synthetic_acceptance

    timed, recorded = args.timed, args.recorded
    synthetic = parse_synthetic_acceptance(args.synthetic_acceptance)
    return {"load": LOAD, "timed": timed, "recorded": recorded, "max_num_seqs": max(timed + recorded),
            "max_tokens": args.max_tokens, "lengths": list(LENGTHS), "rounds": args.rounds,
            "requests": {str(c): requests_per_round(c) for c in sorted(set(timed + recorded))},
            "gpu_memory_utilization": args.gpu_memory_utilization, **({"hooks_ab": True} if args.hooks_ab else {}),
            **({"prompt_tokens": args.prompt_tokens} if args.prompt_tokens else {}),
            **({"synthetic_acceptance": list(synthetic)} if synthetic is not None else {})}


def engine_settings_of(args: argparse.Namespace, workload: dict[str, Any], ks: list[int], method: str, k: int,
                       trace_dir: Path) -> dict[str, Any]:
    """One engine's settings (``model_settings``); "sync" is n-gram's k = 0 with async scheduling off."""
    synthetic = workload.get("synthetic_acceptance")
    settings = model_settings(args.model, args.out, "ngram" if method == "sync" else method, ks, k, trace_dir,
                              args.max_tokens, args.eager, args.tp, workload["max_num_seqs"], args.prompt_tokens,
                              tuple(synthetic) if synthetic is not None else None)
    if method == "sync":
        settings["engine_args"]["async_scheduling"] = False
    if args.gpu_memory_utilization is not None:
        settings["engine_args"]["gpu_memory_utilization"] = args.gpu_memory_utilization
    return settings


def measured_once(args: argparse.Namespace, settings: dict[str, Any], began: float, longest: float,
                  workload: dict[str, Any], attempt: int = 1) -> dict[str, Any]:
    """``measure_engine``, or its error; an engine whose start hung is tried once more while the budget allows."""
    shutil.rmtree(settings["out"], ignore_errors=True)  # a half-written trace of an interrupted call or attempt
    try:
        return measure_engine(settings, args.rounds, args.max_tokens, args.start_timeout_s, workload["timed"],
                              workload["recorded"], args.hooks_ab)
    except Exception as exc:  # one engine that vLLM cannot run must not cost the others
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"{settings['method']} k={settings['k']}: FAILED {error}", flush=True)
        fits = time.perf_counter() - began + max(longest, 60.0) <= args.budget_s
        if isinstance(exc, EngineStartHung) and attempt == 1 and fits:
            return measured_once(args, settings, began, longest, workload, attempt=2)
        return {"error": error}


def show_engine(engine: dict[str, Any]) -> None:
    """One line of an engine that measured: its start and median throughput per concurrency."""
    medians = {c: round(statistics.median(v), 1) for c, v in engine["tok_s"].items()}
    if "hooks_on_tok_s" in engine:
        medians |= {f"{c} hooks on": round(statistics.median(v), 1) for c, v in engine["hooks_on_tok_s"].items()}
    print(f"[{time.strftime('%H:%M:%S')}] {engine['method']} k={engine['k']}: start {engine['engine_start_s']:.0f} s, "
          f"tok/s by concurrency {medians}", flush=True)


def measure(args: argparse.Namespace) -> None:
    """Every (drafter, k) engine not yet in ``<out>/<model>-measurements.json``, while the time budget allows one
    more (a call that stops early is resumed by running the same command again)."""
    from moetrace.hooks.host import gpu_inventory
    from moetrace.hooks.vllm_api import vllm_version

    began = time.perf_counter()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(spread_routing): a function of this script
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / f"{args.model}-measurements.json"
    ks = [int(k) for k in args.ks.split(",")]
    workload = workload_of(args)
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
    methods = args.methods.split(",")
    if args.baseline_from is not None and 0 in ks:
        adopt_baseline(args.baseline_from, out, doc, workload, methods[0])
        results_path.write_text(json.dumps(doc, indent=2) + "\n")
    done = {(e["method"], e["k"]) for e in doc["engines"] if "tok_s" in e}  # a failed engine is tried again
    # k = 0 runs no drafter: one engine serves as every drafter's baseline; "sync" is k = 0 without vLLM's async
    # scheduling, which vLLM switches off for n-gram drafting (the price of that switch, measured apart)
    # sync right after k = 0: without it no n-gram k > 0 is predicted, so a time budget that ends the call early
    # cuts a k > 0 engine (the next call resumes with it), not the baseline's other half
    plan = ([(methods[0], 0)] if 0 in ks else []) + ([("sync", 0)] if args.sync_baseline else []) + [
        (method, k) for method in methods for k in ks if k > 0]
    longest = 0.0
    for method, k in (step for step in plan if step not in done):
        if time.perf_counter() - began + max(longest, 60.0) > args.budget_s:
            print(f"time budget of {args.budget_s:.0f} s reached: run the same command again to go on")
            return
        trace_dir = out / f"{args.model}-{method}-k{'-'.join(map(str, ks))}" / f"k{k}"
        settings = engine_settings_of(args, workload, ks, method, k, trace_dir)
        print(f"[{time.strftime('%H:%M:%S')}] {args.model} {method} k={k}: starting", flush=True)
        engine_began = time.perf_counter()
        engine = measured_once(args, settings, began, longest, workload)
        if "tok_s" in engine:  # the longest engine that ran estimates the next one
            longest = max(longest, time.perf_counter() - engine_began)
        engine.update(method=method, k=k, trace=str(trace_dir.relative_to(out)))
        doc["engines"] = [e for e in doc["engines"] if (e["method"], e["k"]) != (method, k)] + [engine]
        results_path.write_text(json.dumps(doc, indent=2) + "\n")  # after every engine: nothing lost on a crash
        if "tok_s" in engine:
            show_engine(engine)
    failed = [f"{e['method']} k={e['k']}" for e in doc["engines"] if "tok_s" not in e]
    if failed:  # the driver script runs this again until every engine has measured
        print(f"failed engines, tried again on the next run: {', '.join(failed)}")
    else:
        print(f"measurements: {results_path}")
