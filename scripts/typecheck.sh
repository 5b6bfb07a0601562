#!/usr/bin/env bash
# mypy --strict on the package as installed: moetrace.hooks and moetrace.analysis live in top-level folders
# mapped by package-dir, which mypy cannot follow in the source tree, so check a plain install of it, and the
# development tools (tools/) beside it.
# Then ruff on the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# setuptools reuses build/lib: a module moved or deleted since the last build would still be installed and checked
rm -rf build
python3 -m pip install -q --root-user-action=ignore --no-deps --no-build-isolation --target "$site" . >/dev/null
cp pyproject.toml "$site/"
repo=$PWD
cd "$site" && python3 -m mypy --strict --cache-dir "$repo/.mypy_cache" -p moetrace
# the development tools (not installed) against that install
python3 -m mypy --strict --cache-dir "$repo/.mypy_cache" "$repo"/tools/*.py
# ruff (configured in pyproject.toml) on the source tree.
cd "$repo" && python3 -m ruff check .
