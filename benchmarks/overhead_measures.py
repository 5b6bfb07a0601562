"""What ``bench_recording_overhead.py`` measures beside the engine, in its own process: the GPU's clocks while
each mode's rounds run, and the statistics over paired rounds (what recording adds per step, split by part and
by forward; medians with bootstrap intervals)."""

from __future__ import annotations

import collections
import random
import statistics
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

# A step's parts as the engine thread's stamps cut it: where the GPU idles under sync scheduling, and the forward
IDLE_PARTS = ("drafting_us", "between_steps_us", "prep_us")
BUSY_PART = "launch_to_sync_us"  # the forward's launch to the next sync: the GPU's work, unless the host lags it


class GpuClocks:
    """NVML samples of the engine's GPU (the first visible) every ``interval`` seconds, on a thread of this client
    process (the engine's run in others): SM clock, power, and whether the driver says the GPU idled (its clocks
    event reasons). Host-bound steps leave the GPU idle between launches; if recording lengthens those gaps, a GPU
    that lowers its clocks while idle would run vLLM's next kernels slower, a cost no host timer sees. Without NVML
    it samples nothing."""

    def __init__(self, interval: float = 0.005) -> None:
        self.samples: list[tuple[int, int, int, bool]] = []  # t_ns, SM MHz, power mW, idle reason set
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self, interval: float) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no driver, no library, no GPU: nothing to sample
            return
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons")
        idle_bit = getattr(pynvml, "nvmlClocksEventReasonGpuIdle", 1)
        try:
            while not self._stop.wait(interval):
                sm_mhz = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
                self.samples.append((time.perf_counter_ns(), sm_mhz, pynvml.nvmlDeviceGetPowerUsage(handle),
                                     bool(reasons(handle) & idle_bit)))
        finally:
            pynvml.nvmlShutdown()

    def stats(self, spans: list[tuple[int, int]]) -> dict[str, float] | None:
        """The samples taken inside ``spans`` (perf_counter ns): median and 10th percentile SM MHz, mean power W,
        and the share of samples the driver marked idle; None when there are none."""
        import bisect

        times = [sample[0] for sample in self.samples]  # in order: one thread appends them
        inside = [sample for start, end in spans
                  for sample in self.samples[bisect.bisect_left(times, start) : bisect.bisect_left(times, end)]]
        if not inside:
            return None
        clocks = sorted(s[1] for s in inside)
        return {"samples": len(inside), "sm_mhz_median": statistics.median(clocks),
                "sm_mhz_p10": clocks[len(clocks) // 10], "power_w_mean": statistics.fmean(s[2] for s in inside) / 1e3,
                "idle_share": sum(s[3] for s in inside) / len(inside)}


# Model Runner V1's calls from vLLM's sync to the next forward's launch, stamped on return (True) or on entry, and
# the parts between them


def recurring_added(on_rounds: list[dict[str, Any]], off_rounds: list[dict[str, Any]], off_round_ms: list[float],
                    resamples: int = 2_000) -> dict[str, Any]:
    """What recording adds at the same step of every round. Rounds repeat the same work step for step (the same
    prompts, greedy, ``rounds_same_work``), so step i of an on round pairs with step i of the off round beside it;
    per step position, the median over rounds of on minus off is what recording costs there, free of the host's
    random stalls (they land on random steps, the noise that spreads a round's throughput by several percent).
    Summed over positions: the added ms per round, its bootstrap 95% interval over rounds, and the throughput ratio
    it implies against the off rounds' median time; with the positions that add the most: the forward that ends
    the step there (CUDA-graph mode, tokens), off's median µs, the median added µs, and that split into the
    step's parts (``IDLE_PARTS``, ``BUSY_PART``)."""
    # Step i means the same step in every round only where the rounds ran the same forwards (none dropped, none
    # scheduled otherwise): the pairs whose on and off rounds ran the sequence of forwards most pairs ran.
    agreeing = [(a, b) for a, b in zip(on_rounds, off_rounds) if a["all_forwards"] == b["all_forwards"]]
    common = collections.Counter(tuple(a["all_forwards"]) for a, _ in agreeing).most_common(1)
    forwards = list(common[0][0]) if common else []
    pairs = [(a, b) for a, b in agreeing if a["all_forwards"] == forwards]
    if len(pairs) < 2 or not forwards:
        return {"rounds": len(pairs), "why_not": "fewer than two pairs of rounds ran the same forwards"}

    def stacked(key: str, side: int) -> npt.NDArray[np.float64]:
        return np.array([pair[side][key] for pair in pairs], dtype=np.float64)

    added = stacked("all_steps_us", 0) - stacked("all_steps_us", 1)  # [rounds, steps]
    added_parts = np.median(stacked("all_parts_us", 0) - stacked("all_parts_us", 1), axis=0)  # [steps, parts]
    off = np.median(stacked("all_steps_us", 1), axis=0)
    per_step = np.median(added, axis=0)
    rng = np.random.default_rng(0)
    sums = np.sort([np.median(added[rng.integers(0, len(pairs), len(pairs))], axis=0).sum() / 1e3
                    for _ in range(resamples)])
    ci = [float(sums[int(0.025 * resamples)]), float(sums[int(0.975 * resamples) - 1])]
    round_ms = statistics.median(off_round_ms)
    return {"rounds": len(pairs), "rounds_left_out": len(off_rounds) - len(pairs),
            "steps_per_round": int(added.shape[1]),
            "added_ms_per_round": [float(per_step.sum() / 1e3), ci], "off_round_ms": round_ms,
            "on_off": [1 - per_step.sum() / 1e3 / round_ms, [1 - ci[1] / round_ms, 1 - ci[0] / round_ms]],
            "added_us_by_forward": {kind: float(per_step[[f == kind for f in forwards]].sum())
                                    for kind in sorted(set(forwards))},
            "most_added": [{"step": int(i), "forward": forwards[i], "off_us": float(off[i]),
                            "added_us": float(per_step[i]),
                            "added_parts_us": dict(zip((*IDLE_PARTS, BUSY_PART), added_parts[i].tolist()))}
                           for i in np.argsort(per_step)[::-1][:8]]}


def added_by_forward(on_rounds: list[dict[str, Any]], off_rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of forward ending a step (CUDA-graph mode, tokens), every round's steps pooled per mode: steps off
    and on, off's median step and parts (µs), and on's medians minus off's. Needs no step-for-step alignment of the
    rounds (at high concurrency their scheduling differs)."""
    pooled: dict[str, dict[str, list[list[int]]]] = {"on": {}, "off": {}}
    for mode, rounds in (("on", on_rounds), ("off", off_rounds)):
        for measured in rounds:
            for kind, parts, step in zip(measured["all_forwards"], measured["all_parts_us"], measured["all_steps_us"]):
                pooled[mode].setdefault(kind, []).append([*parts, step])
    names = (*IDLE_PARTS, BUSY_PART, "step_us")
    by_kind = {}
    for kind in sorted(set(pooled["off"]) & set(pooled["on"])):
        off = np.median(np.array(pooled["off"][kind], dtype=np.float64), axis=0)
        on = np.median(np.array(pooled["on"][kind], dtype=np.float64), axis=0)
        by_kind[kind] = {"steps_off": len(pooled["off"][kind]), "steps_on": len(pooled["on"][kind]),
                         "off_us": dict(zip(names, off.tolist())), "added_us": dict(zip(names, (on - off).tolist()))}
    return by_kind


def median_ci95(ratios: list[float], resamples: int = 10_000) -> tuple[float, list[float]]:
    """Median of paired ratios and its bootstrap percentile 95% interval."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]
