#!/usr/bin/env bash
# The next H200 checks, decided before they run. Parts:
#   calibrate:  the slice calibrated on the card at hand with the current grid (vLLM's fused-MoE table to 256 tokens),
#               in $OUT (ran on an H200 on 2026-12-05: benchmarks/results/speedup-calibrations/kimi-k2-tp8-h200-256.json;
#               any card other than an H200 calibrates anyway, before the other parts);
#   holdout-48: a seventh n-gram hold-out, decided 2026-12-05 with the prediction code of the commit that adds it
#               (predicted with kimi-k2-tp8-h200-256.json on an H200): 48 slots, k = 0, 4 and k = 0 with async
#               scheduling off, closed loop, recorded at 1 and 16, timed (hooks paused, 3 rounds after one uncounted)
#               at 3, 10, 36 and 48 only (k = 4 at 48: 240 tokens a step; 3: where the fourth and fifth hold-outs
#               missed low, 36 and 48: the fifth's k = 4 miss at a full engine);
#   eagle3:     EAGLE-3 k = 0..4 on the slice, 5 rounds of 256 tokens at 1 and 16 (H100s ran k = 0..3 of it on
#               2026-12-05: docs/validation.md);
#   eagle3-k4:  EAGLE-3 k = 0 and 4 only, as eagle3 (the k the H100 rows lack), when time is short;
#   context-256-ngram, context-8192-ngram, context-256-eagle3, context-8192-eagle3: issue 58's validation by context,
#               decided 2026-12-06 before any ran: the slice on prompts of 256 and of 8,192 tokens (--prompt-tokens),
#               k = 0, 2, 4, 3 rounds, recorded at 1 and 16, timed (hooks paused) at the held-out 2, 8 and 24;
#               predicted by `compare` from each context's own traces with the card's calibration (which times
#               attention to 8,464 tokens), and the 8,192 cells also from the 256 traces moved by `--context 8192`;
#               held out: within 10% of measured. One part (3 engines of 190-330 s) fits a 10-minute call, two a
#               session: run them over sessions, in this order;
#               context-256-ngram ran on an H100 on 2026-12-07 (docs/validation.md: calibration 15 s, 3 engines of
#               145-200 s), on a slice of 4,096 positions, which `report --context 8192` refuses: every slice now
#               holds 8,464 (SLICE_POSITIONS); context-8192-ngram ran on another H100 the same day (engines of
#               200-330 s, the k = 2 and 4 ones in one call), and context-256-ngram again there for the moved
#               prediction, k = 0 and 2 only (k = 4 did not fit the session's GPU time); next: the EAGLE-3 parts;
#   synthetic-chat: issue 70's decision where it is hard, on vLLM 0.26, decided 2026-12-07 before it ran (the plan and
#               the prediction code of the commit that adds it; docs/validation.md, "Decision regret at a set
#               acceptance"): n-gram on the slice with its acceptance set by vLLM's synthetic rejection sampling to
#               the kimi-k2-eagle3-chat profile (0.799, 0.517, 0.306, 0.182 by position), k = 0..4 and k = 0 with
#               async scheduling off, prompts of the built-in cuts, 3 rounds, recorded at 1 and 16, timed (hooks
#               paused) at the held-out 2, 8 and 48 (a full engine); judged by regret per concurrency; ran on an
#               H100 on 2026-12-07 (docs/validation.md) for k = 0..3 and the sync baseline: k = 4 did not fit the
#               session's GPU time (on another host it needs k = 0 timed again beside it);
#   synthetic-chat-k4, synthetic-low: the rest of that grid, decided 2026-12-07 before either ran: k = 0 and 4 at
#               the same profile and load (k = 0 again beside k = 4: one host's timings), and the chat-ngram-low profile
#               (0.25 / 0.12 / 0.06 / 0.03), k = 0..4 and the sync baseline, where k = 0 may be right;
#   synthetic034-<profile>-<context>: issue 70's grid on vLLM 0.34 (its kit, gpu-kit-034/: Model Runner V2, n-gram
#               with async scheduling on, so no sync baseline), decided 2026-12-07 before any ran: profile chat,
#               math or low (kimi-k2-eagle3-chat, kimi-k2-eagle3-math, chat-ngram-low), prompts of 256 or 8,192
#               tokens, k = 0..4, 3 rounds, recorded at 1 and 16, timed at 2, 8 and 48 (at 8,192 tokens 2, 8 and
#               24: 48 requests' cache would not fit an H100's 272K tokens beside the slice); six parts of five engines;
#               changed 2026-12-07, before any ran: k = 0 drafts nothing, so the chat part's k = 0 engine serves the
#               math and low parts of its context (--baseline-from; run chat first); at 256 tokens also recorded at
#               48, a full engine (the step up to there measured, not extrapolated from 16: synthetic-chat's k = 0
#               at 48 was predicted 14.7% slow), and timed at the held-out 2, 8 and 64;
#   k0-ab, holdout-24, holdout-40: run on 2026-12-05 (docs/validation.md), kept to repeat them.
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
