"""Launch tax: does the recorder's per-step pack make the engine's own CUDA launches slower? (GPU only)

    python benchmarks/lab/bench_launch_tax.py [--launches 200] [--sample-launches 20] [--rows 4] [--steps 3000]

Inside vLLM (H200, CUDA graphs) the host time of vLLM's own launches grew with recording on: a PIECEWISE forward's
launch by 0.36-0.54 ms, the sampler's by 23-53 µs, but only in modes where the recorder's pack kernel ran. This
replays that pattern without vLLM, so each candidate cause can be tried in seconds: a step launches ``--launches``
small kernels (the forward), then the recorder's pack of a step's routing columns (17 layers of ids and weights,
positions, token ids, ``--rows`` rows) as the variant says, then ``--sample-launches`` kernels (the sampler), then
synchronizes (vLLM's sync after sampling). Per step the host time of both launch blocks is kept; variants run in
alternating blocks of steps, so that drift hits them alike. Printed per variant: the median of each block's host
time and its ratio to the baseline's.

Variants: ``none`` (baseline: no pack), ``mapped`` (the recorder's copier: one ``torch.cat`` straight into the
ring of rows shared with the writer process, registered pinned memory that the GPU addresses), ``device-copy`` (the
copier's fallback: pack into device memory, then copy into the ring), ``device-only`` (pack into device memory,
nothing copied), ``batched`` (pack into a
device ring, one copy to pinned memory every 16 steps), ``one-kernel`` (one plain copy of a step-sized device tensor
into device memory: a kernel whose arguments are a few pointers, where the pack's ``torch.cat`` passes its inputs'
table, some kilobytes, as arguments).

Evidence it produced: benchmarks/results/gpu-launch-tax.json (commit 2069aea, one H200, 2026-12-01).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from moetrace.hooks.transfer import StepCopier, int32_column
from moetrace.writer.ring import RingRows, SharedRows

VARIANTS = ("none", "mapped", "device-copy", "device-only", "batched", "one-kernel")
BATCHED_STEPS = 16
LAYERS, TOP_K = 17, 8


def step_columns(rows: int, device: torch.device) -> list[torch.Tensor]:
    """A step's columns as the recorder packs them: per layer ids [N, K] and weights [N, K] (float bits), then
    positions and token ids (int64 buffers seen as their low int32 words)."""
    ids = [torch.randint(0, 384, (rows, TOP_K), dtype=torch.int32, device=device) for _ in range(LAYERS)]
    weights = [torch.rand(rows, TOP_K, device=device).view(torch.int32) for _ in range(LAYERS)]
    positions = torch.arange(rows, dtype=torch.int64, device=device)
    tokens = torch.randint(0, 1000, (rows,), dtype=torch.int64, device=device)
    return [*ids, *weights, int32_column(positions), int32_column(tokens)]


def packers(columns: list[torch.Tensor], max_rows: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Per variant, the work the recorder would add after a forward's launch."""
    width = sum(column.shape[1] for column in columns)
    ring = SharedRows.create(max_rows, width)
    where = RingRows(0, max_rows, 0)  # every step packed over the same rows: nothing reads them here
    mapped = StepCopier(device, ring, max_rows)
    if mapped.path != "mapped":
        raise SystemExit(f"the shared ring is not mapped here (copier path {mapped.path})")
    fallback = StepCopier(device, SharedRows.create(max_rows, width), max_rows)
    fallback._mapped = None
    fallback._block = torch.empty((max_rows, width), dtype=torch.int32, device=device)
    block = torch.empty((max_rows * BATCHED_STEPS, width), dtype=torch.int32, device=device)
    staging = torch.empty(block.shape, dtype=torch.int32, pin_memory=True)
    rows = columns[0].shape[0]
    filled = [0]
    packed = torch.cat(columns, dim=1)  # one contiguous step-sized block

    def batched() -> None:
        torch.cat(columns, dim=1, out=block[filled[0] : filled[0] + rows])
        filled[0] += rows
        if filled[0] == rows * BATCHED_STEPS:
            staging[: filled[0]].copy_(block[: filled[0]], non_blocking=True)
            filled[0] = 0

    return {"none": lambda: None, "mapped": lambda: mapped.copy(columns, where),
            "device-copy": lambda: fallback.copy(columns, where),
            "device-only": lambda: torch.cat(columns, dim=1, out=block[:rows]), "batched": batched,
            "one-kernel": lambda: block[:rows].copy_(packed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200, help="kernels a forward launches")
    parser.add_argument("--sample-launches", type=int, default=20, help="kernels the sampler launches")
    parser.add_argument("--rows", type=int, default=4, help="rows (tokens) a step packs")
    parser.add_argument("--steps", type=int, default=3000, help="steps per variant")
    parser.add_argument("--block", type=int, default=50, help="steps a variant runs before the next takes over")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    columns = step_columns(args.rows, device)
    pack = packers(columns, max(args.rows, 256), device)
    work = torch.zeros(1024, device=device)
    forward_us: dict[str, list[float]] = {v: [] for v in VARIANTS}
    sample_us: dict[str, list[float]] = {v: [] for v in VARIANTS}

    def step(variant: str) -> tuple[float, float]:
        began = time.perf_counter_ns()
        for _ in range(args.launches):
            work.add_(1.0)
        launched = time.perf_counter_ns()
        pack[variant]()
        sampling = time.perf_counter_ns()
        for _ in range(args.sample_launches):
            work.mul_(0.5)
        sampled = time.perf_counter_ns()
        torch.cuda.synchronize(device)
        return (launched - began) / 1e3, (sampled - sampling) / 1e3

    for variant in VARIANTS:  # warm-up: module loads, allocations
        for _ in range(20):
            step(variant)
    rounds = -(-args.steps // args.block)
    for index in range(rounds):
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            for _ in range(args.block):
                forward, sample = step(variant)
                forward_us[variant].append(forward)
                sample_us[variant].append(sample)
    base_forward, base_sample = statistics.median(forward_us["none"]), statistics.median(sample_us["none"])
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "args": vars(args) | {"json": None},
                              "variants": {}}
    print(f"{'variant':>12} {'forward µs':>11} {'ratio':>7} {'sampler µs':>11} {'ratio':>7}   (medians of "
          f"{args.steps} steps; baseline: none)")
    for variant in VARIANTS:
        forward, sample = statistics.median(forward_us[variant]), statistics.median(sample_us[variant])
        report["variants"][variant] = {"forward_us": forward, "forward_ratio": forward / base_forward,
                                       "sampler_us": sample, "sampler_ratio": sample / base_sample}
        print(f"{variant:>12} {forward:>11.1f} {forward / base_forward:>7.3f} {sample:>11.1f} "
              f"{sample / base_sample:>7.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
