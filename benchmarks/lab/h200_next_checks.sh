#!/usr/bin/env bash
# The next H200 checks, decided before the run (2026-12-04, prediction code at the commit that added this file):
#   1. a fourth n-gram hold-out on the Kimi-K2 TP=8 slice: 32 slots, k = 0, 1, 3 and k = 0 with async scheduling
#      off, closed loop, recorded at 1 and 16, timed (hooks paused, 3 rounds) at 2, 6, 12 and 32 only: a slot
#      count, a k set and concurrencies (6, 12) no earlier run timed; it tests the rule that at a concurrency the
#      k = 0 trace passed through only the k = 0 step is taken from those steps;
#   2. EAGLE-3 k = 0..4 on the slice again, 5 rounds of 256 tokens at 1 and 16 (the 2-round, 128-token run's k = 0
#      timed rounds at 16 ran at 0.81x its recorded ones).
# Part 1 ran on 2026-12-05 (docs/validation.md, "A fourth hold-out"); part 2 reached its k = 0 engine only.
# Usage, on a GPU machine with vLLM 0.26 (resumable: run the same command again on the same machine until each part
# prints "measurements:"): bash benchmarks/lab/h200_next_checks.sh SECONDS [PART ...], PART holdout-32 or eagle3
# (default both); results in $OUT/holdout-32.tar.gz, eagle3.tar.gz.
# On another card (an 80 GB H100; CARD, default from nvidia-smi) it calibrates the slice on that card first (the
# committed calibration is the H200's; it lands in each run folder and in $OUT) and gives vLLM 0.95 of the GPU's
# memory (the slice's weights take 64.5 GiB).
set -o pipefail
export PYTHONUNBUFFERED=1
R=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/moetrace-out}
end=$(( $(date +%s) + ${1:-540} ))
[ $# -gt 0 ] && shift
parts=" ${*:-holdout-32 eagle3} "
mkdir -p "$OUT"
cd /tmp || exit 1
memory=()
CARD=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)}
echo "card: $CARD"
if [[ "$CARD" != *H200* ]]; then
  memory=(--gpu-memory-utilization 0.95)
  cal=/root/calibration-kimi-k2-tp8.json
  if [ ! -f "$cal" ]; then
    model=$(python "$R/benchmarks/lab/bench_speedup_validation.py" model-dir --model kimi-k2-tp8 --out /root/cal) &&
      timeout $(( end - $(date +%s) )) moetrace calibrate --model "$model" --tp 1 --ep 1 --formats bf16 \
        --no-allreduce --vllm-kernel -o /root/cal/partial.json --force && mv /root/cal/partial.json "$cal"
  fi
  [ -f "$cal" ] || { echo "no calibration of this card"; exit 1; }
  cp "$cal" "$OUT/"
  for run in holdout-32 eagle3; do mkdir -p "/root/$run" && cp "$cal" "/root/$run/"; done
fi
bench() {
  local left=$(( end - $(date +%s) - 25 ))
  if [ "$left" -lt 150 ]; then echo "not run now ($left s left): $*"; return 0; fi
  timeout $(( left + 15 )) python "$R/benchmarks/lab/bench_speedup_validation.py" measure --model kimi-k2-tp8 "$@" \
    "${memory[@]}" --budget-s "$left"
}
[[ "$parts" == *" holdout-32 "* ]] &&
  bench --methods ngram --ks 0,1,3 --sync-baseline --rounds 3 --timed 2,6,12,32 --recorded 1,16 --out /root/holdout-32
[[ "$parts" == *" eagle3 "* ]] &&
  bench --methods eagle3 --ks 0,1,2,3,4 --rounds 5 --timed 1,16 --recorded 1,16 --max-tokens 256 --out /root/eagle3
for run in holdout-32 eagle3; do
  [ -d "/root/$run" ] && tar -C /root --exclude='*-model' -czf "$OUT/$run.tar.gz" "$run"
done
ls -la "$OUT"
