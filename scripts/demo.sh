#!/usr/bin/env bash
# Sets up, then records the embedded default model at k = 0..4 with n-gram speculation and reports on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
moetrace record --k 0,1,2,3,4 --out traces --force
moetrace report traces/kimi-k2-tiny-random-ngram-k0-1-2-3-4 --k 3 --force
