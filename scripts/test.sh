#!/usr/bin/env bash
# Sets up, then runs the whole test suite (unit tests, real vLLM on the CPU, headless Chromium) and mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/typecheck.sh
# One worker per core: a vLLM engine on the CPU keeps about one core busy, mostly importing and starting up.
# Tests that share one recording (xdist_group) run on one worker.
python3 -m pytest -q -n auto --dist loadgroup "$@"
