#!/usr/bin/env bash
# The slice's GPU checks of the prediction, each part decided (its plan and this script committed) before it runs;
# which ran, with their results, and which are decided and not yet run: docs/validation.md. Parts:
#   calibrate:           the slice calibrated on the card at hand (vLLM's fused-MoE table to 256 tokens, attention
#                        timed); any card but an H200, and the context and synthetic parts, calibrate anyway first;
#   k0-ab:               k = 0 timed with the hooks paused and on in turn (is a paused engine as fast?);
#   holdout-24/40/48:    n-gram hold-outs at 24, 40 and 48 slots (k = 0, the sync baseline and k = 2..4);
#   eagle3, eagle3-k4:   EAGLE-3 k = 0..4 (or 0 and 4) at 1 and 16 requests, 5 rounds of 256 tokens;
#   context-<256|8192>-<ngram|eagle3>: prompts of 256 or 8,192 tokens, k = 0, 2, 4, timed at 2, 8 and 24;
#   synthetic-chat, synthetic-chat-k4, synthetic-low: n-gram with its acceptance set by vLLM's synthetic rejection
#                        sampling (kimi-k2-eagle3-chat; chat-ngram-low), k = 0..4 and the sync baseline, timed at 2, 8
#                        and 48;
#   synthetic034-<chat|math|low>-<256|8192>: the same on vLLM 0.34 (gpu-kit-034/: Model Runner V2, n-gram with async
#                        scheduling on), one k = 0 engine per context (the chat part's: run it first), at 256 tokens
#                        recorded at 1, 16 and 48 and timed at 2, 8 and 64, at 8,192 recorded at 1 and 16, timed at
#                        2, 8 and 24.
# Usage, on a GPU machine with vLLM 0.26 (resumable: run the same command again on the same machine until each part
# prints "measurements:"): bash benchmarks/lab/h200_next_checks.sh SECONDS [PART ...] (default: holdout-48
# eagle3, run in the order of the parts list above); results in $OUT: <part>.tar.gz (the measurements) and
# <part>-<folder>-k<k>.tar.gz.part-* (each engine's trace in pieces: `cat` them into `tar -xz`); what does not fit
# one call's return waits on the machine for the next call (the part `send` only sends).
# On another card (an 80 GB H100; CARD, default from nvidia-smi) it calibrates the slice on that card first (the
# committed calibration is the H200's; it lands in each run folder and in $OUT) and gives vLLM 0.95 of the GPU's
# memory (the slice's weights take 64.5 GiB).
set -o pipefail
export PYTHONUNBUFFERED=1
R=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/moetrace-out}
end=$(( $(date +%s) + ${1:-540} ))
[ $# -gt 0 ] && shift
parts=" ${*:-holdout-48 eagle3} "
[[ "$parts" == " send " ]] && parts=" "  # no part to run: only what waits to come back
# what comes back from a call is at most 8 files of 16 MiB, 64 MiB together: results wait in PENDING, each call
# sends what fits (smallest first) and keeps a copy in SENT; the part "send" only sends
PENDING=/root/pending SENT=/root/sent
mkdir -p "$OUT" "$PENDING" "$SENT"
cd /tmp || exit 1
memory=()
CARD=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)}
echo "card: $CARD"
if [[ "$CARD" != *H200* ]]; then memory=(--gpu-memory-utilization 0.95); fi
if [[ "$CARD" != *H200* || "$parts" == *" calibrate "* || "$parts" == *" context-"* || "$parts" == *" synthetic"* ]]
then  # context and synthetic: the card's calibration with attention timed
  cal=/root/calibration-kimi-k2-tp8.json
  if [ ! -f "$cal" ]; then
    model=$(python "$R/benchmarks/lab/bench_speedup_validation.py" model-dir --model kimi-k2-tp8 --out /root/cal) &&
      timeout $(( end - $(date +%s) )) python -m moetrace calibrate --model "$model" --tp 1 --ep 1 --formats bf16 \
        --no-allreduce --vllm-kernel -o /root/cal/partial.json --force && mv /root/cal/partial.json "$cal"
  fi
  [ -f "$cal" ] || { echo "no calibration of this card"; exit 1; }
  name="calibration-kimi-k2-tp8-$(echo "$CARD" | tr -c 'A-Za-z0-9\n' - | tr -s -).json"
  [ -f "$SENT/$name" ] || cp "$cal" "$PENDING/$name"
  for run in ${parts/ calibrate / }; do mkdir -p "/root/$run" && cp "$cal" "/root/$run/"; done
fi
bench() {
  local left=$(( end - $(date +%s) - 25 ))
  # an engine takes 190-330 s (start, rounds, teardown): one cut by the timeout loses its timings
  if [ "$left" -lt 330 ]; then echo "not run now ($left s left): $*"; return 0; fi
  timeout $(( left + 15 )) python "$R/benchmarks/lab/bench_speedup_validation.py" measure --model kimi-k2-tp8 "$@" \
    "${memory[@]}" --budget-s "$left"
}
[[ "$parts" == *" k0-ab "* ]] &&
  bench --methods ngram --ks 0 --rounds 5 --timed 1,16 --recorded 1,16 --hooks-ab --out /root/k0-ab
[[ "$parts" == *" holdout-24 "* ]] &&
  bench --methods ngram --ks 0,2,4 --sync-baseline --rounds 3 --timed 3,8,20,24 --recorded 1,16 --out /root/holdout-24
[[ "$parts" == *" holdout-40 "* ]] &&
  bench --methods ngram --ks 0,3 --sync-baseline --rounds 3 --timed 2,5,28,40 --recorded 1,16 --out /root/holdout-40
[[ "$parts" == *" holdout-48 "* ]] &&
  bench --methods ngram --ks 0,4 --sync-baseline --rounds 3 --timed 3,10,36,48 --recorded 1,16 --out /root/holdout-48
[[ "$parts" == *" eagle3 "* ]] &&
  bench --methods eagle3 --ks 0,1,2,3,4 --rounds 5 --timed 1,16 --recorded 1,16 --max-tokens 256 --out /root/eagle3
[[ "$parts" == *" eagle3-k4 "* ]] &&
  bench --methods eagle3 --ks 0,4 --rounds 5 --timed 1,16 --recorded 1,16 --max-tokens 256 --out /root/eagle3-k4
[[ "$parts" == *" synthetic-chat "* ]] &&
  bench --methods ngram --ks 0,1,2,3,4 --sync-baseline --synthetic-acceptance kimi-k2-eagle3-chat --rounds 3 \
    --timed 2,8,48 --recorded 1,16 --out /root/synthetic-chat
[[ "$parts" == *" synthetic-chat-k4 "* ]] &&
  bench --methods ngram --ks 0,4 --sync-baseline --synthetic-acceptance kimi-k2-eagle3-chat --rounds 3 \
    --timed 2,8,48 --recorded 1,16 --out /root/synthetic-chat-k4
[[ "$parts" == *" synthetic-low "* ]] &&
  bench --methods ngram --ks 0,1,2,3,4 --sync-baseline --synthetic-acceptance chat-ngram-low --rounds 3 \
    --timed 2,8,48 --recorded 1,16 --out /root/synthetic-low
for context in 256 8192; do
  if [ "$context" = 256 ]; then load=(--timed 2,8,64 --recorded 1,16,48); else load=(--timed 2,8,24 --recorded 1,16); fi
  for profile in chat:kimi-k2-eagle3-chat math:kimi-k2-eagle3-math low:chat-ngram-low; do
    name=${profile%%:*} from=()
    [ "$name" = chat ] || from=(--baseline-from "/root/synthetic034-chat-$context")
    [[ "$parts" == *" synthetic034-$name-$context "* ]] &&
      bench --methods ngram --ks 0,1,2,3,4 --synthetic-acceptance "${profile#*:}" --rounds 3 "${load[@]}" \
        --prompt-tokens "$context" --out "/root/synthetic034-$name-$context" "${from[@]}"
  done
  for method in ngram eagle3; do
    [[ "$parts" == *" context-$context-$method "* ]] &&
      bench --methods "$method" --ks 0,2,4 --rounds 3 --timed 2,8,24 --recorded 1,16 --prompt-tokens "$context" \
        --out "/root/context-$context-$method"
  done
done
for run in ${parts/ calibrate / }; do  # the measurements and calibration, then each engine's trace apart
  [ -d "/root/$run" ] || continue
  tar -C /root --exclude='*-model' --exclude="$run/*/k*" -czf "$PENDING/$run.tar.gz" "$run"
  # each engine that measured (a cut one's folder is half written until the next call runs it again), once; an
  # 8,192-token trace packs to 24 MB: in pieces of 15 MB (cat them back)
  for trace in $(python3 -c 'import json, sys; print(*(e["trace"] for e in json.load(open(sys.argv[1]))["engines"]
                                                   if "tok_s" in e))' /root/"$run"/*-measurements.json 2>/dev/null); do
    name="$run-$(basename "$(dirname "$trace")")-$(basename "$trace").tar.gz"
    if ! ls "$SENT/$name".part-* >/dev/null 2>&1; then
      rm -f "$PENDING/$name".part-* && tar -C /root -czf - "$run/$trace" | split -b 15M - "$PENDING/$name.part-"
    fi
  done
done
files=0 bytes=0
for f in $(ls -Sr "$PENDING"); do  # smallest first: the measurements and calibration, then the traces' pieces
  size=$(stat -c %s "$PENDING/$f")
  if [ $files -ge 8 ] || [ $(( bytes + size )) -gt $(( 63 * 1024 * 1024 )) ]; then continue; fi
  cp "$PENDING/$f" "$OUT/" && mv "$PENDING/$f" "$SENT/" && files=$(( files + 1 )) bytes=$(( bytes + size ))
done
ls -la "$OUT"
left=$(ls "$PENDING" | wc -l)
[ "$left" -eq 0 ] || echo "$left file(s) wait to come back: run this again with the part send"
