#!/usr/bin/env bash
# vLLM 0.34 checks on a GPU (issue 57), decided 2026-12-06 before they ran. On the host, after receive.sh and
# setup.sh, with env.sh sourced:
#   bash benchmarks/lab/gpu-kit-034/checks.sh SECONDS [PART ...]     (default parts: default int4 fp8 k25)
# Every recording: --compiled (CUDA graphs), 8 prompts, batch 4, 48 tokens, vLLM's own routed-experts capture on
# (enable_return_routed_experts), then `kimi_formats.py check` (kept rows = vLLM's capture, drafts and accepted =
# vLLM's counters, expert format and bytes = the config's) into $OUT/<part>-check.json. Parts:
#   default:  the embedded default model, n-gram k = 3 (acceptance against vLLM's counters under async scheduling);
#   int4:     the Kimi-K2 TP=8 slice in Kimi-K2.5's format (compressed-tensors INT4 experts, group 32), n-gram k = 2;
#   fp8:      the slice in Kimi-K2's format (FP8, 128 x 128 blocks), n-gram k = 2;
#   k25:      KimiK25ForConditionalGeneration around the default model's config, text only, n-gram k = 2;
#   draft:    the default model drafting for itself with its one-layer cut (draft_model), k = 2, counters only;
#   replay:   tests/engine/test_replay.py and test_budget.py (replayed routing under a budget, budgets eager and
#             with CUDA graphs) into $OUT/replay.log;
#   attention: how a served step grows with context against the calibrated MLA curve (issue 58): `moetrace calibrate`
#             times the slice's attention (Kimi-K2's on one TP=8 rank) to 32K tokens, then the bf16 slice (dummy
#             weights) recorded at 256 and 8,192-token prompts, n-gram k = 0 and 2, 16 prompts, batch 16, 64 tokens, and `attention_by_context.py check`
#             (held out: the curve's growth within 25% of the measured growth, k = 0 and 2) into
#             $OUT/attention-check.json; first the GPU test of vLLM's MLA kernels against the reference. Runs under
#             either kit (vLLM 0.26's kernels are enough); resumable: run it again on the same host to go on;
#   overhead: recording overhead on the INT4 slice, n-gram k = 3, batches 1 and 64, 6 rounds of 128 tokens
#             (benchmarks/bench_recording_overhead.py) into $OUT/overhead-int4.json.
set -o pipefail
export PYTHONUNBUFFERED=1
R=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT:-/tmp/moetrace-out}
end=$(( $(date +%s) + ${1:-540} ))
[ $# -gt 0 ] && shift
parts=" ${*:-default int4 fp8 k25} "
mkdir -p "$OUT"
cd /root || exit 1  # not the project: `python3 -m moetrace` would import its source tree, not the installed package
M=/root/models
T=/root/runs
python3 "$R/benchmarks/lab/kimi_formats.py" model-dirs "$M"
record() {  # PART MOETRACE-RECORD-ARGS...
  local part=$1 left=$(( end - $(date +%s) - 20 ))
  shift
  if [ "$left" -lt 100 ]; then echo "not run now ($left s left): $part"; return 0; fi
  echo "== $part: moetrace record $*"
  local capture=(--engine-arg enable_return_routed_experts=true)
  [ "${CAPTURE:-on}" = off ] && capture=()
  timeout "$left" python3 -m moetrace record "$@" --compiled --max-tokens 48 --num-prompts 8 --batch-size 4 \
    "${capture[@]}" --out "$T/$part" --force 2>&1 | tee "$OUT/$part.log"
  for log in "$T/$part"/*/engine.log; do [ -f "$log" ] && cp "$log" "$OUT/$part-engine.log"; done
  for manifest in "$T/$part"/*/manifest.json; do
    [ -f "$manifest" ] || continue
    trace=$(dirname "$manifest")
    cp "$manifest" "$OUT/$part-manifest.json"
    python3 "$R/benchmarks/lab/kimi_formats.py" check "$trace" --json "$OUT/$part-check.json" 2>&1 | tee -a "$OUT/$part.log"
    timeout 120 python3 -m moetrace report "$trace" --json > "$OUT/$part-report.json" 2>> "$OUT/$part.log"
  done
}
dummy=(--engine-arg load_format=dummy --engine-arg max_model_len=1024)
[[ "$parts" == *" default "* ]] && record default --k 3
[[ "$parts" == *" int4 "* ]] && record int4 "$M/kimi-k2-tp8-int4" --k 2 "${dummy[@]}"
[[ "$parts" == *" fp8 "* ]] && record fp8 "$M/kimi-k2-tp8-fp8" --k 2 "${dummy[@]}"
[[ "$parts" == *" k25 "* ]] && record k25 "$M/kimi-k25-tiny" --k 2 "${dummy[@]}" \
  --engine-arg 'limit_mm_per_prompt={"image": 0, "video": 0}'
# vLLM 0.34's routed-experts capture refuses a draft model ("AuxOutput Connector only supports generate runners")
[[ "$parts" == *" draft "* ]] && CAPTURE=off record draft --method draft_model --k 2
if [[ "$parts" == *" overhead "* ]]; then
  left=$(( end - $(date +%s) - 10 ))
  timeout "$left" python3 "$R/benchmarks/bench_recording_overhead.py" --model kimi-k2-tp8-int4 --compiled \
    --batches 1,64 --rounds 6 --max-tokens 128 --json "$OUT/overhead-int4.json" 2>&1 | tee "$OUT/overhead.log"
fi
if [[ "$parts" == *" attention "* ]]; then  # resumable: run it again on the same host until the check prints
  L="$R/benchmarks/lab/attention_by_context.py"
  # an 80 GB card at vLLM's default 0.9 keeps the KV of 7 requests of 8K tokens beside the slice's 64.5 GiB: 0.95
  mkdir -p "$T" && slice=$(python3 "$L" model-dir "$M")
  python3 "$L" prompts "$T/short.jsonl" --tokens 256 --count 16
  python3 "$L" prompts "$T/long.jsonl" --tokens 8192 --count 16
  timeout 120 python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -p no:cacheprovider -rA \
    "$R/tests/unit/test_calibrate.py::test_vllms_mla_decode_kernels_match_the_reference_and_time_in_a_cuda_graph" \
    2>&1 | tee "$OUT/attention-kernels.log"
  # the slice's attention (Kimi-K2's on one rank of TP=8: 8 heads, latent 512 + rope 64) to its 32K tokens
  cal="$T/attention-calibration.json"
  [ -f "$cal" ] || timeout 300 python3 -m moetrace calibrate --model "$slice" --tp 1 --ep 1 --formats '' \
    --no-allreduce -o "$T/attention-partial.json" --force 2>&1 | tee "$OUT/attention-calibrate.log" &&
    mv "$T/attention-partial.json" "$cal"
  [ -f "$cal" ] && cp "$cal" "$OUT/attention-calibration.json"
  for length in short long; do
    [ "$(ls "$T/context-$length"/*/manifest.json 2>/dev/null | wc -l)" = 2 ] && continue
    left=$(( end - $(date +%s) - 30 ))
    if [ "$left" -lt 240 ]; then echo "not run now ($left s left): context-$length"; continue; fi
    timeout "$left" python3 -m moetrace record "$slice" --k 0,2 --prompts "$T/$length.jsonl" --num-prompts 16 \
      --batch-size 16 --max-tokens 64 --compiled "${dummy[@]/max_model_len=1024/max_model_len=8448}" \
      --engine-arg gpu_memory_utilization=0.95 \
      --out "$T/context-$length" --force 2>&1 | tee "$OUT/attention-$length.log"
  done
  (cd "$T" && find context-short context-long -name engine.log | tar -czf "$OUT/attention-engine-logs.tgz" -T -)
  [ -f "$cal" ] && python3 "$L" check --short "$T/context-short" --long "$T/context-long" --calibration "$cal" \
    --json "$OUT/attention-check.json" 2>&1 | tee -a "$OUT/attention-check.log"
fi
if [[ "$parts" == *" replay "* ]]; then
  left=$(( end - $(date +%s) - 10 ))
  timeout "$left" python3 -m pytest --rootdir="$R" -c "$R/pyproject.toml" -p no:cacheprovider --basetemp=/root/pt \
    -rA "$R/tests/engine/test_replay.py" "$R/tests/engine/test_budget.py" 2>&1 | tee "$OUT/replay.log"
  (cd /root/pt && find . -name engine.log | tar -czf "$OUT/replay-engine-logs.tgz" -T -) 2>/dev/null
fi
ls -la "$OUT"
