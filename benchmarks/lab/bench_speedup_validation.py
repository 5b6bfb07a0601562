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
from pathlib import Path

from speedup_compare import compare
from speedup_load import parse_concurrencies
from speedup_measure import SLICE_POSITIONS, measure, slice_model_dir


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
