#!/usr/bin/env bash
# Sets up, then records the embedded default model with the two drafters a Kimi-K2.5 user can run — n-gram at
# k = 0..4 and its shipped EAGLE-3 head at k = 1..4 — and n-gram at k = 3 once more on prompts of 1,024 tokens, and
# reports on them side by side, starting with the recommended k per drafter and concurrency, then per context
# length. (MTP, DeepSeek's drafter, is `moetrace record --method mtp`.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
moetrace record --method ngram --k 0,1,2,3,4 --out traces --force
moetrace record --method eagle3 --k 1,2,3,4 --out traces --force
python3 scripts/long_prompts.py > traces/long-prompts.jsonl
moetrace record --method ngram --k 3 --prompts traces/long-prompts.jsonl --num-prompts 4 --batch-size 4 --max-tokens 48 --out traces/long-context --force
moetrace report traces/kimi-k2-tiny-ngram-k0-1-2-3-4 traces/kimi-k2-tiny-eagle3-k1-2-3-4 \
    traces/long-context/kimi-k2-tiny-ngram-k3 --k 3 --context 1024,8192,32768 -o traces/demo-report.html --force
