"""Recording overhead: generation throughput with recording on vs off, in one engine, alternating rounds.

    python benchmarks/bench_recording_overhead.py [--rounds 3] [--max-tokens 64]

Baseline: the same vLLM engine with moetrace's hooks uninstalled (``moetrace_pause``: routers and runner exactly
as vLLM built them). Measured at batch 1 (one request at a time) and at 32 concurrent requests, default model,
n-gram k=3, rounds alternating off/on so that drift on this noisy machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def timed_generate(llm: Any, prompts: list[Any], batch: int, max_tokens: int) -> float:
    """Generated tokens per second, ``batch`` requests at a time."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    generated = 0
    for first in range(0, len(prompts), batch):
        outputs = llm.generate(prompts[first : first + batch], params, use_tqdm=False)
        generated += sum(len(o.outputs[0].token_ids) for o in outputs)
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from moetrace.engine import build_llm, engine_prompts
    from moetrace.record import RecordRequest, engine_settings, resolve_model

    with tempfile.TemporaryDirectory(prefix="moetrace-bench-") as scratch:
        request = RecordRequest(model=None, ks=[3], batch_size=32, max_tokens=args.max_tokens, out=Path(scratch))
        settings = engine_settings(request, resolve_model(None), 3, Path(scratch) / "trace",
                                   [p for p in __import__("moetrace.prompts").prompts.BUILTIN_PROMPTS] * 4,
                                   Path(scratch) / "progress")
        llm = build_llm(settings)
        prompts = engine_prompts(settings)
        try:
            timed_generate(llm, prompts[:8], 8, 16)  # warm-up
            results: dict[tuple[int, str], list[float]] = {}
            for round_index in range(args.rounds):
                order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
                for batch, count in ((1, 4), (32, 32)):
                    for mode in order:
                        llm.collective_rpc("moetrace_pause" if mode == "off" else "moetrace_resume")
                        results.setdefault((batch, mode), []).append(
                            timed_generate(llm, prompts[:count], batch, args.max_tokens))
            llm.collective_rpc("moetrace_close")
        finally:
            llm.llm_engine.engine_core.shutdown()
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'overhead':>9}")
    for batch in (1, 32):
        off = statistics.median(results[(batch, "off")])
        on = statistics.median(results[(batch, "on")])
        print(f"{batch:>5} {off:>10.1f} {on:>10.1f} {on / off:>7.3f} {100 * (1 - on / off):>8.1f}%")


if __name__ == "__main__":
    main()
