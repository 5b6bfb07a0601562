#!/usr/bin/env bash
# On the GPU host, once per transfer of the vLLM stream (build-vllm-parts.sh): keep the piece(s) that arrived under
# PARTS_DIR2/*/ in the kit's home (outside the project tree, so they stay while the host stays up); once all are there,
# check them and unpack them once into $GPU_KIT_HOME/vsite, beside the torch tree ($GPU_KIT_HOME/site, receive.sh).
#   bash receive-vllm.sh PARTS_DIR2
set -euo pipefail
source "$(dirname "$0")/env.sh"
H=$GPU_KIT_HOME
mkdir -p "$H/vparts"
for p in "${1:?usage: receive-vllm.sh PARTS_DIR2}"/*/vpart.*; do
  [ -f "$p" ] && [ ! -f "$H/vparts/$(basename "$p")" ] && cp "$p" "$H/vparts/"
done
for f in "$1"/*/vparts.sha256; do [ -f "$f" ] && cp -f "$f" "$H/"; done
have=$(ls "$H/vparts" | wc -l); want=$(wc -l < "$H/vparts.sha256" 2>/dev/null || echo "?")
echo "vLLM pieces: $have of $want"
if [ "$have" = "$want" ] && [ ! -f "$H/vsite/.unpacked" ]; then
  (cd "$H/vparts" && sha256sum -c "$H/vparts.sha256" --quiet) && echo "vLLM pieces: sha256 ok"
  rm -rf "$H/vsite" && mkdir -p "$H/vsite"
  cat "$H"/vparts/vpart.* | xz -d -T0 | tar -x -C "$H/vsite"
  touch "$H/vsite/.unpacked"
  du -sh "$H/vsite"
fi
