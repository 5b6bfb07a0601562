#!/usr/bin/env bash
# The GPU side of benchmarks/lab/bench_speedup_validation.py in as few machine calls as possible: on a GPU machine
# with vLLM installed, run it again and again (same machine, same $SV) until it prints "speedup validation: all
# measured". Each call measures what is missing while the time budget lasts, then packs $SV into $OUT/sv.tar.xz.
# Evidence it produced: benchmarks/results/speedup-validation.json (commit 94e2e08, one H200, 2026-12-03).
#   phase 1: the default model (n-gram k=0..4, MTP k=1..4) and the Kimi-K2 TP=8 slice (n-gram k=0..4), one GPU
#            each, side by side when there are two GPUs; both with a k=0 run without async scheduling
#   calibrations of the same shapes (expert curves) on the Kimi slice's GPU once it is done, while time is left;
#   then (two GPUs, once phase 1 is done) the Kimi-K2 TP=4 slice at TP=2, k = 0 and 3 (TP=8's per-GPU shape, real
#   all-reduces), and its calibration (all-reduce on 2 GPUs)
# PARTS picks which (default "sweep calibrations tp2"); without "sweep", the calibrations run side by side, one GPU
# each, and TP=2 does not wait for phase 1.
set -u
PARTS=" ${PARTS:-sweep calibrations tp2} "
wants() { [[ $PARTS == *" $1 "* ]]; }
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/moetrace-out}
SV=${SV:-/root/sv}
BUDGET=${BUDGET:-480}
mkdir -p "$SV" "$OUT"
cd /tmp || exit 1
export PYTHONUNBUFFERED=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
GPUS=$(nvidia-smi -L | wc -l)
began=$(date +%s)

measure() {  # MODEL [args...]: resumable; done once its log ends with "measurements:"
  local model=$1; shift
  grep -q '^measurements:' "$SV/$model.log" 2>/dev/null && return 0
  timeout -k 20 $((BUDGET + 90)) python3 "$R/benchmarks/lab/bench_speedup_validation.py" measure --model "$model" \
    --out "$SV" --budget-s "$(left)" "$@" >> "$SV/$model.log" 2>&1
}
measured() { grep -q '^measurements:' "$SV/$1.log" 2>/dev/null; }
left() { echo $((BUDGET - ($(date +%s) - began))); }
calibrate() {  # NAME [args...]: when at least 3 minutes are left
  [ -s "$SV/calibration-$1.json" ] && return 0
  [ "$(left)" -ge 180 ] || return 0
  local name=$1; shift
  timeout 240 python3 -m moetrace calibrate --formats bf16 --ep 1 --vllm-kernel -o "$SV/calibration-$name.json" --force "$@" \
    >> "$SV/calibrate-$name.log" 2>&1
}
slice_dir() { python3 "$R/benchmarks/lab/bench_speedup_validation.py" model-dir --model "$1" --out "$SV"; }
calibrate_default() { calibrate default --model default --tp 1 --no-allreduce; }
calibrate_kimi() { calibrate kimi-k2-tp8 --model "$(slice_dir kimi-k2-tp8)" --tp 1 --no-allreduce; }

kimi_then_calibrations() {  # the Kimi slice is done long before the default model's 10 engines: calibrate after it
  measure kimi-k2-tp8 --methods ngram --sync-baseline
  if wants calibrations; then calibrate_kimi; calibrate_default; fi
}
export R SV BUDGET began PARTS && export -f wants measure measured left calibrate slice_dir calibrate_default \
  calibrate_kimi kimi_then_calibrations
if ! wants sweep; then
  if wants calibrations && [ "$GPUS" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES=0 bash -c calibrate_default & first=$!
    CUDA_VISIBLE_DEVICES=1 bash -c calibrate_kimi
    wait $first
  elif wants calibrations; then
    calibrate_default && calibrate_kimi
  fi
elif [ "$GPUS" -ge 2 ]; then
  # each side on its own half of the host's cores: the default model's step is host-bound, and the other side's
  # engine start (torch.compile workers) would otherwise slow it at random
  # (the cores this process may use, split in two; no pinning where taskset cannot)
  read -r first_half second_half < <(python3 -c "import os; c = sorted(os.sched_getaffinity(0)); h = len(c) // 2
print(','.join(map(str, c[:h])), ','.join(map(str, c[h:])))")
  pin0=() pin1=()
  if taskset -c "$first_half" true 2>/dev/null && taskset -c "$second_half" true 2>/dev/null; then
    pin0=(taskset -c "$first_half") pin1=(taskset -c "$second_half")
  fi
  CUDA_VISIBLE_DEVICES=0 "${pin0[@]}" bash -c 'measure default --methods ngram,mtp --sync-baseline' & first=$!
  CUDA_VISIBLE_DEVICES=1 "${pin1[@]}" bash -c kimi_then_calibrations
  wait $first
else
  measure default --methods ngram,mtp --sync-baseline
  kimi_then_calibrations
fi
# TP=2 on two GPUs: k = 0 and one k > 0 are enough to set the all-reduce term against the NCCL curve
if wants tp2 && [ "$GPUS" -ge 2 ] && { ! wants sweep || { measured default && measured kimi-k2-tp8; }; } \
   && [ "$(left)" -ge 150 ]; then
  measure kimi-k2-tp4 --tp 2 --methods ngram --ks 0,3
  wants calibrations && calibrate kimi-k2-tp4 --model "$(slice_dir kimi-k2-tp4)" --tp 2
fi
tar -C "$(dirname "$SV")" -cJf "$OUT/sv.tar.xz" "$(basename "$SV")"
grep -h '^\[\|budget\|^measurements\|FAILED\|Error' "$SV"/*.log | tail -n 60
if { ! wants sweep || { measured default && measured kimi-k2-tp8; }; } \
   && { ! wants calibrations || { [ -s "$SV/calibration-default.json" ] && [ -s "$SV/calibration-kimi-k2-tp8.json" ] \
        && { [ "$GPUS" -lt 2 ] || ! wants tp2 || [ -s "$SV/calibration-kimi-k2-tp4.json" ]; }; }; } \
   && { [ "$GPUS" -lt 2 ] || ! wants tp2 || measured kimi-k2-tp4; }; then
  echo "speedup validation: all measured"
else
  echo "speedup validation: not finished; run again on the same machine"
fi
