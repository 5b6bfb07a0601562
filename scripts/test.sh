#!/usr/bin/env bash
# Sets up, then runs the whole test suite (unit tests, real vLLM on the CPU, headless Chromium) and mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/typecheck.sh
python3 tools/prediction_errors.py --check  # the record the report's intervals come from is the results'
python3 tools/results_index.py --check  # every evidence file cited, docs/results.md current
# One worker per core, at most 2 (a worker running a vLLM engine holds up to 5 GiB): an engine on the CPU keeps
# about one core busy, mostly importing and starting up. Tests that share one recording (xdist_group) run on one
# worker.
python3 -m pytest -q -n auto --maxprocesses 2 --dist loadgroup --durations=15 "$@"
# The report at scale, against the figures committed for it: fails where it slid past their margin.
if [ $# -eq 0 ]; then
    python3 benchmarks/bench_report_scale.py --guard benchmarks/results/report-scale-guard.json
fi
