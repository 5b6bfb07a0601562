#!/usr/bin/env bash
# Sets up, then runs the whole test suite (unit tests, real vLLM on the CPU, headless Chromium) and mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/typecheck.sh
python3 -m pytest -q "$@"
