"""Recording overhead: generation throughput with recording on vs off, in one engine, alternating rounds.

    python benchmarks/bench_recording_overhead.py [--rounds 5] [--max-tokens 64]             # CPU, default model
    python benchmarks/bench_recording_overhead.py --model kimi-k2-tp8 --compiled --batches 1,64 --rounds 10 \\
        --max-tokens 128 --json benchmarks/results/gpu-vllm-overhead.json                   # GPU, Kimi-K2 shape

Baseline: the same vLLM engine with moetrace's hooks uninstalled (``moetrace_pause``: routers and runner exactly
as vLLM built them; under CUDA graphs the captured graphs hold no moetrace kernel, so they are the same too).
n-gram k=3, rounds alternating off/on so that drift hits both sides alike; each round gives one paired on/off
ratio, and the result is their median with a bootstrap 95% interval.

Beside throughput, each round measures the host time in which the GPU idles (sync scheduling, Model Runner V1):
stamps at class level beneath moetrace's hooks, alike in both modes (``idle_time_probe``), give per step the time
from vLLM's sync to the end of ``sample_tokens`` (drafting), from there to the next ``execute_model`` (the engine
loop, the scheduler, the recorder's hooks around both) and from there to the forward's launch (vLLM's input
preparation): medians over thousands of steps, far less noisy than a round's throughput, so what recording adds to
the GPU's idle time is read directly.

Rounds repeat the same work step for step (the same prompts, greedy), so per step position the median over paired
rounds of on minus off is what recording costs at that step, free of the host's random stalls ("recurring"): summed
with a bootstrap interval, and split by the CUDA-graph mode of the forward ending the step (stamped from vLLM's
forward context) and by the step's parts.

Where NVML sees a GPU, each mode's rounds also get the GPU's SM clock, power and the share of time the driver
marked it idle (``GpuClocks``, sampled every 5 ms from this process): a GPU that clocks down in the idle gaps of
host-bound steps would make recording cost more than its host time.

Every round also reads the engine thread's resource usage (page faults, context switches, user and kernel CPU
time: ``engine_thread_usage``); ``--faults`` splits its minor page faults by part of each step and by kind of forward.
Mode ``off-again`` is an A/A control: how far two identical modes drift apart in as many rounds.

``--model kimi-k2-tp8`` is a dummy-weight model of Kimi-K2's per-GPU shape under TP=8 (``kimi_slice.py``): the
step a Kimi deployment's rank runs; ``kimi-k2-tp8-int4`` the same in Kimi-K2.5's format (INT4 experts, group 32),
``kimi-k2-tp8-fp8`` in Kimi-K2's (FP8, 128 x 128 blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from lab.kimi_slice import QUANTIZATION, kimi_k2_slice
from overhead_measures import BUSY_PART, IDLE_PARTS, GpuClocks, added_by_forward, median_ci95, recurring_added


def timed_generate(llm: Any, prompts: list[Any], batch: int, max_tokens: int) -> tuple[float, float, dict[str, float]]:
    """Generated tokens per second, ``batch`` requests at a time, the seconds it took, and the drafts and accepted
    tokens vLLM counted meanwhile (greedy and deterministic: equal in every round unless the kernels are not)."""
    from vllm import SamplingParams

    from moetrace.recording.engine import spec_decode_counters

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = spec_decode_counters(llm)
    started = time.perf_counter()
    generated = 0
    for first in range(0, len(prompts), batch):
        outputs = llm.generate(prompts[first : first + batch], params, use_tqdm=False)
        generated += sum(len(o.outputs[0].token_ids) for o in outputs)
    elapsed = time.perf_counter() - started
    after = spec_decode_counters(llm)
    return generated / elapsed, elapsed, {name: after[name] - before.get(name, 0.0) for name in
                                 ("num_drafts", "num_accepted_tokens") if name in after}


# the calls stamped, in a step's order (True: on return): from vLLM's sync to the forward's launch the GPU idles
IDLE_STAMPS = (("_bookkeeping_sync", True), ("sample_tokens", True), ("execute_model", False),
               ("_model_forward", False))


def idle_time_probe(worker: Any, read: bool, faults: bool = False) -> dict[str, Any] | None:
    """In the worker (through ``collective_rpc``): install (once) stamps on V1's runner at class level, so they run
    beneath the recorder's hooks whether those are installed or not: on return from ``_bookkeeping_sync`` (vLLM has
    synced; the GPU idles from here) and ``sample_tokens``, on entry to ``execute_model`` and ``_model_forward`` (the
    forward's launch). With ``read``: the medians in µs of the steps since the last read (``IDLE_PARTS``,
    ``BUSY_PART`` and ``step_us``, sync to sync), the steps' mean and their sum (``steps_ms``: a median hides what
    only some steps pay, such as prefills or timed steps), and forget them. None where the runner lacks one of the
    four (Model Runner V2).
    With ``faults`` (at install): each stamp also reads the engine thread's minor page faults, and a read says how
    many fell in each part of the steps, and in the steps of each kind of forward."""
    import bisect

    runner_class = type(worker.model_runner)
    if not all(hasattr(runner_class, name) for name, _ in IDLE_STAMPS):
        return None
    stamps: list[list[int]] | None = getattr(runner_class, "_bench_idle_stamps", None)
    if stamps is None:
        stamps = [[] for _ in IDLE_STAMPS]
        runner_class._bench_idle_stamps = stamps
        runner_class._bench_forward_kinds = []  # per forward launched: its CUDA-graph mode and token count
        runner_class._bench_idle_faults = [[] for _ in IDLE_STAMPS] if faults else None
        for index, ((name, on_return), times) in enumerate(zip(IDLE_STAMPS, stamps)):
            kinds = runner_class._bench_forward_kinds if name == "_model_forward" else None
            counts = runner_class._bench_idle_faults[index] if faults else None
            setattr(runner_class, name, stamping(getattr(runner_class, name), times, on_return, kinds, counts))
    if not read:
        return None
    kinds: list[str] = runner_class._bench_forward_kinds
    fault_counts: list[list[int]] | None = runner_class._bench_idle_faults
    faults_by_part = {part: 0 for part in (*IDLE_PARTS, BUSY_PART)}
    faults_by_forward: dict[str, int] = {}
    parts: dict[str, list[int]] = {part: [] for part in (*IDLE_PARTS, BUSY_PART, "step_us")}
    every_step: list[tuple[int, list[int], str]] = []  # per step kept: sync to sync, its parts, the next forward
    syncs = stamps[0]
    for index, sync in enumerate(syncs):
        chain, chain_at = [sync], [index]
        at = 0
        for times in stamps[1:]:
            at = bisect.bisect(times, chain[-1])
            if at == len(times):
                break
            chain.append(times[at])
            chain_at.append(at)
        following = syncs[index + 1] if index + 1 < len(syncs) else None
        if len(chain) < len(IDLE_STAMPS) or chain[-1] - sync > 20_000_000 or (
                following is not None and chain[-1] > following):  # the last step, the engine idled, or no forward
            continue
        step_parts = [end - start for start, end in zip(chain, chain[1:])]
        for part, value in zip(IDLE_PARTS, step_parts):
            parts[part].append(value)
        if following is not None and following - sync < 100_000_000:
            parts[BUSY_PART].append(following - chain[-1])
            parts["step_us"].append(following - sync)
            every_step.append((following - sync, [*step_parts, following - chain[-1]],
                               kinds[at] if at < len(kinds) else "?"))
            if fault_counts is not None:
                counts = [fault_counts[i][a] for i, a in enumerate(chain_at)] + [fault_counts[0][index + 1]]
                for part, first, last in zip((*IDLE_PARTS, BUSY_PART), counts, counts[1:]):
                    faults_by_part[part] += last - first
                kind = every_step[-1][2]
                faults_by_forward[kind] = faults_by_forward.get(kind, 0) + counts[-1] - counts[0]
    for times in (*stamps, kinds, *(fault_counts or [])):
        times.clear()
    medians = {part: statistics.median(values) / 1e3 if values else float("nan") for part, values in parts.items()}
    steps = parts["step_us"]
    return {**medians, "step_mean_us": sum(steps) / len(steps) / 1e3 if steps else float("nan"),
            "steps_ms": sum(steps) / 1e6, "steps": len(steps), "all_steps_us": [t // 1000 for t, _, _ in every_step],
            "all_parts_us": [[t // 1000 for t in step_parts] for _, step_parts, _ in every_step],
            "all_forwards": [kind for _, _, kind in every_step],
            **({"faults_by_part": faults_by_part, "faults_by_forward": faults_by_forward} if fault_counts is not None
               else {})}


def step_quantiles(steps_us: list[int]) -> dict[str, float]:
    """Steps' count, mean and percentiles (µs)."""
    cuts = statistics.quantiles(steps_us, n=100) if len(steps_us) > 1 else [float("nan")] * 99
    return {"steps": len(steps_us), "mean": statistics.fmean(steps_us) if steps_us else float("nan"),
            **{f"p{q}": cuts[q - 1] for q in (10, 50, 90, 95, 99)}}


def stamping(method: Any, times: list[int], on_return: bool, kinds: list[str] | None = None,
             faults: list[int] | None = None) -> Any:
    """``method``, appending ``perf_counter_ns`` to ``times`` on entry, or ``on_return``; with ``kinds``, also the
    forward's CUDA-graph mode and token count (vLLM's forward context is set by then); with ``faults``, the thread's
    minor page faults so far, beside each time."""
    import resource

    def stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kinds is not None:
            from vllm.forward_context import get_forward_context

            context = get_forward_context()
            descriptor = context.batch_descriptor
            kinds.append(f"{context.cudagraph_runtime_mode.name} {getattr(descriptor, 'num_tokens', '?')}")
        if not on_return:
            times.append(time.perf_counter_ns())
            if faults is not None:
                faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
            return method(self, *args, **kwargs)
        result = method(self, *args, **kwargs)
        times.append(time.perf_counter_ns())
        if faults is not None:
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
        return result
    return stamped


# "off": the hooks uninstalled (``moetrace_pause``); "on": recording (``moetrace_resume``); "off-again": off once more,
# an A/A control (how far two modes that differ in nothing drift apart in as many rounds). Modes that switched parts
# of the recorder off (writer-off, untimed, no-layout, no-copy, device-copy, routers-only, runner-only,
# writer-apart, hand-over-each, pack-graph, off-busy, no-layout-busy) measured the design choices in
# docs/validation.md; they are in this file at commit fa7f605.
MODES = ("off", "on", "off-again")


def pin_engine_thread(worker: Any) -> dict[str, int]:
    """In the engine's thread (where collective_rpc runs the worker's calls): run on one CPU from now on, the last
    one it may use (the first ones take most interrupts). Unpinned, the host work of whole rounds ran up to 25%
    faster or slower by turns on an H200 VM (vLLM's input preparation, sampler and drafter alike, the GPU's time
    unchanged), rounds of either mode alike: presumably the thread resuming on another CPU after a round. The
    writer process and the recorder's threads started at load and keep the CPUs they had."""
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {allowed[-1]})  # 0: the calling thread (Linux)
    return {"cpu": allowed[-1], "of_cpus": len(allowed)}


def set_mode(worker: Any, mode: str) -> None:
    """In the worker: recording as ``mode`` asks (one of ``MODES``), through the recorder's public pause and
    resume."""
    if mode == "on":
        worker.moetrace_resume()
    else:
        worker.moetrace_pause()


# Pure Python arithmetic, then a sum over 1 MiB (the size of a core's L2): run on entry to every execute_model, alike
# in every mode (``--cpu-probe``), they say whether the engine thread's CPU itself runs slower while recording is on
# (a busy SMT sibling, a lower clock, caches emptied by other work) or only vLLM's own code does.
CPU_PROBE_ARRAY = np.arange(1 << 18, dtype=np.int32)


def thread_usage(worker: Any) -> dict[str, float]:
    """In the engine's thread (collective_rpc runs there): its resource usage so far (Linux ``RUSAGE_THREAD``):
    page faults (a step that allocates fresh memory pays them), context switches (a thread descheduled mid-step
    loses its time slice), and user and kernel CPU seconds."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return {"minor_faults": usage.ru_minflt, "major_faults": usage.ru_majflt, "voluntary_switches": usage.ru_nvcsw,
            "involuntary_switches": usage.ru_nivcsw, "user_s": usage.ru_utime, "system_s": usage.ru_stime}


def engine_settings_for(model: str, scratch: Path, batch: int, max_tokens: int, compiled: bool,
                        time_phases_every: int | None) -> dict[str, Any]:
    from moetrace.default_model import encode_text
    from moetrace.recording.prompts import BUILTIN_PROMPTS
    from moetrace.recording.record import RecordRequest, engine_settings, resolve_model

    prompts = list(BUILTIN_PROMPTS)
    if model == "default":
        request = RecordRequest(model=None, ks=[3], batch_size=batch, max_tokens=max_tokens, out=scratch,
                                eager=not compiled, time_phases_every=time_phases_every)
        return engine_settings(request, resolve_model(None), 3, scratch / "trace", prompts, scratch / "progress")
    model_dir = scratch / model
    model_dir.mkdir()
    quantization = QUANTIZATION[model.removeprefix("kimi-k2-tp8").removeprefix("-") or "bf16"]
    config = kimi_k2_slice(8) | ({"quantization_config": quantization} if quantization else {})
    (model_dir / "config.json").write_text(json.dumps(config))
    request = RecordRequest(model=str(model_dir), ks=[3], batch_size=batch, max_tokens=max_tokens, out=scratch,
                            eager=not compiled, time_phases_every=time_phases_every,
                            engine_args={"load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": 1024})
    settings = engine_settings(request, resolve_model(str(model_dir)), 3, scratch / "trace", prompts,
                               scratch / "progress")
    # No tokenizer: the built-in prompts as byte ids, which lie inside the model's vocabulary.
    settings["token_prompts"] = [encode_text(p) for p in prompts]
    settings["dtype"] = "bfloat16"
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("default", "kimi-k2-tp8", "kimi-k2-tp8-int4", "kimi-k2-tp8-fp8"),
                        default="default", help="the slice in bf16, or in Kimi-K2.5's INT4 or Kimi-K2's FP8 format")
    parser.add_argument("--compiled", action="store_true", help="torch.compile and CUDA graphs (vLLM's default)")
    parser.add_argument("--batches", default="1,32", help="concurrencies to measure, e.g. 1,64")
    parser.add_argument("--engine-batch", type=int,
                        help="size the engine (its concurrency, and so its CUDA-graph sizes) for this many requests "
                             "(default: the largest of --batches); sized for one request, prefills of 9-16 tokens "
                             "run without a graph, which a deployment's do not")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--steps-json", type=Path, help="write every round's steps (times, parts, forwards) here")
    parser.add_argument("--time-phases-every", type=int, help="as moetrace record's (default: the recorder's)")
    parser.add_argument("--faults", action="store_true",
                        help="count the engine thread's minor page faults in each part of every step, in every mode")
    parser.add_argument("--pin-engine-thread", action="store_true",
                        help="run the engine's thread on one CPU throughout (both modes alike)")
    parser.add_argument("--modes", default="off,on",
                        help=f"modes to alternate, 'off' and 'on' first, then any of {', '.join(MODES[2:])}")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    modes = tuple(args.modes.split(","))
    if modes[:2] != ("off", "on") or not set(modes) <= set(MODES) or len(set(modes)) < len(modes):
        parser.error(f"--modes: 'off,on' first, then any of {', '.join(MODES[2:])} (got {args.modes!r})")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with functions from this script

    from moetrace.recording.engine import build_llm, engine_prompts
    from moetrace.hooks.vllm_api import vllm_version
    from moetrace.hooks.host import gpu_inventory, host_facts

    with tempfile.TemporaryDirectory(prefix="moetrace-bench-") as scratch:
        settings = engine_settings_for(args.model, Path(scratch), args.engine_batch or max(batches), args.max_tokens,
                                       args.compiled, args.time_phases_every)
        llm = build_llm(settings)
        base = engine_prompts(settings)
        clocks = GpuClocks()
        try:
            pinned = llm.collective_rpc(pin_engine_thread)[0] if args.pin_engine_thread else None
            timed_generate(llm, base, len(base), 16)  # warm-up
            llm.collective_rpc(idle_time_probe, args=(False, args.faults))  # hooks reinstalled each round wrap it
            usage: dict[tuple[int, str], list[dict[str, float]]] = {}  # the engine thread's, per round
            idle: dict[tuple[int, str], list[dict[str, float]]] = {}  # per round: the idle time's medians
            results: dict[tuple[int, str], list[float]] = {}
            elapsed_ms: dict[tuple[int, str], list[float]] = {}
            workload: dict[tuple[int, str], list[dict[str, float]]] = {}  # vLLM's counters, per round
            spans: dict[tuple[int, str], list[tuple[int, int]]] = {}  # per mode: when its rounds ran
            clocks.start()
            for round_index in range(args.rounds):
                order = modes if round_index % 2 == 0 else modes[::-1]
                for batch in batches:
                    # batch 1: 8 requests one after another; batch B > 1: 2B requests, B at a time
                    count = 8 if batch == 1 else 2 * batch
                    prompts = [base[i % len(base)] for i in range(count)]
                    for mode in order:
                        llm.collective_rpc(set_mode, args=(mode,))
                        used_before = llm.collective_rpc(thread_usage)[0]
                        began = time.perf_counter_ns()
                        tok_s, elapsed, counted = timed_generate(llm, prompts, batch, args.max_tokens)
                        used_after = llm.collective_rpc(thread_usage)[0]
                        usage.setdefault((batch, mode), []).append(
                            {key: used_after[key] - used_before[key] for key in used_after})
                        spans.setdefault((batch, mode), []).append((began, time.perf_counter_ns()))
                        results.setdefault((batch, mode), []).append(tok_s)
                        elapsed_ms.setdefault((batch, mode), []).append(elapsed * 1e3)
                        workload.setdefault((batch, mode), []).append(counted)
                        medians = llm.collective_rpc(idle_time_probe, args=(True,))[0]
                        if medians is not None:
                            # the round's time beside its steps': engine idle between requests, steps left out
                            medians["outside_steps_ms"] = elapsed * 1e3 - medians["steps_ms"]
                            idle.setdefault((batch, mode), []).append(medians)
            clocks.stop()
            llm.collective_rpc(set_mode, args=("on",))  # recording, whatever mode ran last, to close the trace
            closed = llm.collective_rpc("moetrace_close")
        finally:
            clocks.stop()
            llm.llm_engine.engine_core.shutdown()
    report: dict[str, Any] = {
        "vllm_version": vllm_version(),
        "device": (gpu_inventory()["gpus"] or ["cpu"])[0],
        "host": host_facts(),  # the kernel release tells a gVisor sandbox (4.4.0) from a VM
        "engine_thread_pinned": pinned,  # the CPU the engine's thread ran on, or None: wherever Linux put it
        "model": args.model,
        "cuda_graphs": args.compiled,
        "spec": "ngram k=3",
        "max_tokens": args.max_tokens,
        "recording_complete": [c["complete"] for c in closed if c is not None],
        "engine_thread_us_per_step": [c.get("engine_thread_us_per_step") for c in closed if c is not None],
        "capture_mechanisms": [c.get("capture_mechanisms") for c in closed if c is not None],  # forwards per mechanism
        "host_copy": [c.get("host_copy") for c in closed if c is not None],  # how steps reached the host
        "phases": [c.get("phases") for c in closed if c is not None],  # host and device ms per call, per batch
        "command": "python benchmarks/bench_recording_overhead.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
            for k, v in vars(args).items() if v not in (None, False)),
    }
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'95% interval':>15} {'overhead':>9}")
    for batch in batches:
        off, on = results[(batch, "off")], results[(batch, "on")]
        ratios = [a / b for a, b in zip(on, off)]
        median, ci = median_ci95(ratios)
        report[str(batch)] = {"on_off_median": median, "on_off_ci95": ci, "rounds": args.rounds,
                              "off_tok_s": statistics.median(off), "on_tok_s": statistics.median(on),
                              "ratios": ratios,
                              # on and off verified the same drafts and accepted the same tokens: the rounds did
                              # the same work, so their ratio is the recorder's cost and noise alone
                              "rounds_same_work": sum(a == b for a, b in zip(workload[(batch, "on")],
                                                                             workload[(batch, "off")])),
                              "rounds_other_work": [  # round, (drafts, accepted) off, the same on
                                  [i, list(a.values()), list(b.values())] for i, (a, b) in
                                  enumerate(zip(workload[(batch, "off")], workload[(batch, "on")])) if a != b]}
        if idle.get((batch, "off")):
            parts = (*IDLE_PARTS, BUSY_PART, "step_us", "step_mean_us", "steps_ms", "outside_steps_ms")
            # every step of every round, pooled per mode: where in the distribution recording adds its time
            report[str(batch)]["step_quantiles_us"] = {
                mode: step_quantiles([t for r in idle[(batch, mode)] for t in r["all_steps_us"]]) for mode in modes}
            report[str(batch)]["recurring"] = {  # per mode: what it adds at the same step of every round
                mode: recurring_added(idle[(batch, mode)], idle[(batch, "off")], elapsed_ms[(batch, "off")])
                for mode in modes[1:] if idle.get((batch, mode))}
            report[str(batch)]["by_forward"] = {  # per mode: steps pooled by the kind of forward ending them
                mode: added_by_forward(idle[(batch, mode)], idle[(batch, "off")]) for mode in modes[1:]
                if idle.get((batch, mode))}
            # the GPU's idle time per step (its "idle_window_" keys: as the committed results name them)
            report[str(batch)]["idle_window_off"] = {
                part: statistics.median(r[part] for r in idle[(batch, "off")] if r["steps"]) for part in parts}
            report[str(batch)]["idle_window_added"] = {  # per mode, minus off, per round: median, 95% interval
                mode: {part: median_ci95([a[part] - b[part] for a, b in zip(idle[(batch, mode)], idle[(batch, "off")])
                                          if a["steps"] and b["steps"]]) for part in parts}
                for mode in modes[1:] if idle.get((batch, mode))}
        if args.faults and idle.get((batch, "off")):
            report[str(batch)]["faults"] = {  # per mode, per round (median): by part of the step, by forward
                mode: {"by_part": {part: statistics.median(r["faults_by_part"][part] for r in idle[(batch, mode)])
                                   for part in (*IDLE_PARTS, BUSY_PART)},
                       "by_forward": {kind: statistics.median(r["faults_by_forward"].get(kind, 0)
                                                              for r in idle[(batch, mode)])
                                      for kind in sorted({k for r in idle[(batch, mode)]
                                                          for k in r["faults_by_forward"]})}}
                for mode in modes}
            for mode, counted in report[str(batch)]["faults"].items():
                print(f"{batch:>5} {mode} page faults a round (median) by part: {counted['by_part']}; by forward: "
                      f"{ {k: v for k, v in counted['by_forward'].items() if v} }")
        report[str(batch)]["engine_thread_usage"] = {  # per mode: the median round's faults, switches, CPU s
            mode: {key: statistics.median(r[key] for r in usage[(batch, mode)]) for key in usage[(batch, mode)][0]}
            for mode in modes}
        print(f"{batch:>5} engine thread per round (median): " + "; ".join(
            f"{mode} " + ", ".join(f"{key} {value:.3g}" for key, value in per_mode.items())
            for mode, per_mode in report[str(batch)]["engine_thread_usage"].items()))
        gpu_clocks = {mode: clocks.stats(spans[(batch, mode)]) for mode in modes}
        if any(gpu_clocks.values()):
            report[str(batch)]["gpu_clocks"] = gpu_clocks
            print(f"{batch:>5} GPU while each mode ran (NVML every 5 ms): " + "; ".join(
                f"{mode} SM {c['sm_mhz_median']:.0f} MHz (p10 {c['sm_mhz_p10']:.0f}), {c['power_w_mean']:.0f} W, "
                f"idle {100 * c['idle_share']:.0f}% of {c['samples']}" for mode, c in gpu_clocks.items() if c))
        for mode in modes[2:]:
            mode_median, mode_ci = median_ci95([a / b for a, b in zip(results[(batch, mode)], off)])
            report[str(batch)][f"{mode}_over_off"] = {"median": mode_median, "ci95": mode_ci}
            print(f"{batch:>5} {mode}: over off {mode_median:.3f} ({mode_ci[0]:.3f}-{mode_ci[1]:.3f})")
        print(f"{batch:>5} {statistics.median(off):>10.1f} {statistics.median(on):>10.1f} {median:>7.3f} "
              f"{ci[0]:>7.3f}-{ci[1]:<7.3f} {100 * (1 - median):>8.1f}%   "
              f"same work on and off in {report[str(batch)]['rounds_same_work']}/{args.rounds} rounds")
        for mode, added in report[str(batch)].get("idle_window_added", {}).items():
            off_us = report[str(batch)]["idle_window_off"]
            print(f"{batch:>5} {mode} minus off (median of rounds, 95% interval), of off's: " + "; ".join(
                f"{part} {added[part][0]:+.1f} ({added[part][1][0]:+.1f} to {added[part][1][1]:+.1f}) of "
                f"{off_us[part]:.0f}" for part in added))
        for mode, by_kind in report[str(batch)].get("by_forward", {}).items():
            print(f"{batch:>5} {mode} minus off by forward, steps pooled (steps off; off's median step µs; added to "
                  f"the step, to launch-to-sync): " + "; ".join(
                      f"{kind} {v['steps_off']} {v['off_us']['step_us']:.0f} {v['added_us']['step_us']:+.0f} "
                      f"{v['added_us'][BUSY_PART]:+.0f}" for kind, v in by_kind.items() if v["steps_off"] >= 10))
        for mode, recurring in report[str(batch)].get("recurring", {}).items():
            if "on_off" in recurring:
                (ms, (ms_low, ms_high)), (ratio, (low, high)) = recurring["added_ms_per_round"], recurring["on_off"]
                print(f"{batch:>5} {mode} minus off at the same step of each round, summed: {ms:+.2f} ms a round "
                      f"({ms_low:+.2f} to {ms_high:+.2f}) of {recurring['off_round_ms']:.0f} ms: on/off {ratio:.4f} "
                      f"({low:.4f}-{high:.4f}); by forward, µs: {recurring['added_us_by_forward']}; most at "
                      f"{recurring['most_added'][:3]}")
        for mode, quantiles in report[str(batch)].get("step_quantiles_us", {}).items():
            print(f"{batch:>5} {mode} steps pooled, µs: " + ", ".join(f"{k} {v:.0f}" for k, v in quantiles.items()))
    print("recorder's own time on the engine thread, µs per recorded step:", report["engine_thread_us_per_step"])
    print("engine thread:", f"pinned to CPU {pinned['cpu']} of {pinned['of_cpus']}" if pinned else "not pinned")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.steps_json is not None:
        args.steps_json.write_text(json.dumps({f"{batch} {mode}": rounds for (batch, mode), rounds in idle.items()}))


if __name__ == "__main__":
    main()
