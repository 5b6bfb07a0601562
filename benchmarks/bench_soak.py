"""Memory over a long always-on recording under `vllm serve`: thousands of requests, a partition every few seconds.

    python benchmarks/bench_soak.py [--requests 2000] [--concurrency 4] [--partition-seconds 2] \\
        [--json benchmarks/results/soak-cpu.json]

A real `vllm serve` on the CPU (the default model, n-gram k = 3) serves ``--requests`` requests of 24 tokens from an
`openai` client that keeps ``--concurrency`` in flight, in 20 slices; after each slice the resident memory of the API
server, of the engine (the server's descendants) and of the trace writer processes is read
(``served.server_memory``). Twice, in this order: **baseline**, the server without moetrace; then recording always
on (``partition_seconds``). Each mode's growth is from its memory once the first tenth of the requests has run
(warm: every kernel and buffer allocated) to the end. Printed: the engine's growth recording over its growth
without (MiB, and the ratio of end memory, recording over baseline), the writers', and the partitions written.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"),
                str(Path(__file__).resolve().parents[1] / "tests" / "fixtures")]

from served import send_traffic, server_memory, vllm_server  # noqa: E402

from moetrace.trace.partitions import bytes_under, partitions  # noqa: E402

SLICES = 20
WARM = SLICES // 10  # slices run before the warm reading


def soak(recording: bool, args: argparse.Namespace, progress: Progress) -> list[dict[str, Any]]:
    """One server's memory after each slice of the requests, recording always on or not at all."""
    per_slice = max(1, args.requests // SLICES)
    samples = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "always-on"
        options = {"out": str(root), "partition_seconds": args.partition_seconds} if recording else None
        task = progress.add_task("recording" if recording else "baseline", total=per_slice * SLICES)
        began = time.monotonic()
        with vllm_server(options, Path(scratch) / "server.log") as base:
            for done in range(1, SLICES + 1):
                send_traffic(base, requests=per_slice, concurrency=args.concurrency)
                samples.append({"requests": done * per_slice, "seconds": round(time.monotonic() - began, 1),
                                **server_memory(base, root), "partitions": len(partitions(root)) if recording else 0,
                                "disk_bytes": bytes_under(root) if recording else 0})
                progress.update(task, completed=done * per_slice)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--partition-seconds", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console(width=120)
    with Progress(console=console) as progress:
        runs = {"baseline": soak(False, args, progress), "recording": soak(True, args, progress)}
    growth = {mode: {group: samples[-1][group] - samples[WARM - 1][group] for group in ("engine_mib", "writer_mib")}
              for mode, samples in runs.items()}
    end = runs["recording"][-1]
    ratio = end["engine_mib"] / runs["baseline"][-1]["engine_mib"]
    console.print(f"{end['requests']} requests a mode; recording: {end['seconds']:.0f} s, {end['partitions']} "
                  f"partitions ({end['disk_bytes'] / 2**20:.1f} MiB), {end['writers']:.0f} writer process(es) at the "
                  f"end")
    console.print(f"engine growth from warm (after {runs['recording'][WARM - 1]['requests']} requests) to the end: "
                  f"baseline {growth['baseline']['engine_mib']:+.1f} MiB, recording "
                  f"{growth['recording']['engine_mib']:+.1f} MiB; engine memory at the end, recording over baseline: "
                  f"{ratio:.3f}x")
    console.print(f"writer processes' memory: {runs['recording'][WARM - 1]['writer_mib']:.1f} MiB warm, "
                  f"{end['writer_mib']:.1f} MiB at the end ({growth['recording']['writer_mib']:+.1f} MiB)")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs, "growth_mib": growth,
                                         "engine_end_ratio_recording_over_baseline": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()
