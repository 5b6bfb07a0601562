#!/usr/bin/env bash
# On the GPU host, after both streams are unpacked (receive.sh: torch 2.14 + NCCL in $GPU_KIT_HOME/site;
# receive.sh: vLLM 0.34 + its deps in $GPU_KIT_HOME/vsite): install the project at PROJECT_DIR with its entry
# points into $GPU_KIT_HOME/project. vLLM finds general plugins through the installed dist-info
# (moetrace's vllm.general_plugins entry point), which PYTHONPATH alone to the source tree would not register.
# Then `source env.sh` before running anything.
#   bash setup.sh PROJECT_DIR
set -euo pipefail
source "$(dirname "$0")/env.sh"
H=$GPU_KIT_HOME
for tree in site vsite; do
  [ -f "$H/$tree/.unpacked" ] || { echo "$H/$tree is not unpacked yet (receive.sh)" >&2; exit 2; }
done
python3 "$(dirname "$0")/patch_vllm.py" "$H/vsite"
rm -rf "$H/project" "$H/src" && mkdir -p "$H/src"
tar -C "${1:?usage: setup.sh PROJECT_DIR}" --exclude=./.gpu --exclude=./.git --exclude=./build \
    --exclude='./*.egg-info' --exclude=./traces -cf - . | tar -C "$H/src" -xf -
# --no-build-isolation: the host's setuptools (81) and wheel build it; --no-deps: the deps are in vsite or on the host.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$H/project" "$H/src"
du -sh "$H/site" "$H/vsite" "$H/project"
