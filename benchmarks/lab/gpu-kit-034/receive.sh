#!/usr/bin/env bash
# On the GPU host, once per transfer: keep the piece(s) that arrived under PARTS_DIR/*/ in the kit's home (outside
# the project tree, so they stay while the host stays up); once a stream's pieces are all there, check them and
# unpack them once. Two streams: torch 2.14 + NCCL (build-parts.sh: part.*, parts.sha256, into site/) and vLLM 0.34
# + its deps (build-vllm-parts.sh: vpart.*, vparts.sha256, into vsite/).
#   bash receive.sh PARTS_DIR
set -euo pipefail
source "$(dirname "$0")/env.sh"
H=$GPU_KIT_HOME
for stream in "part site torch" "vpart vsite vLLM"; do
  read -r piece tree name <<< "$stream"
  mkdir -p "$H/${piece}s"
  for p in "${1:?usage: receive.sh PARTS_DIR}"/*/"$piece".*; do
    [ -f "$p" ] && [ ! -f "$H/${piece}s/$(basename "$p")" ] && cp "$p" "$H/${piece}s/"
  done
  for f in "$1"/*/"${piece}s.sha256"; do [ -f "$f" ] && cp -f "$f" "$H/"; done
  have=$(ls "$H/${piece}s" | wc -l); want=$(wc -l 2>/dev/null < "$H/${piece}s.sha256" || echo "?")
  echo "$name pieces: $have of $want"
  if [ "$have" = "$want" ] && [ ! -f "$H/$tree/.unpacked" ]; then
    (cd "$H/${piece}s" && sha256sum -c "$H/${piece}s.sha256" --quiet) && echo "$name pieces: sha256 ok"
    rm -rf "$H/$tree" && mkdir -p "$H/$tree"
    cat "$H/${piece}s/$piece".* | xz -d -T0 | tar -x -C "$H/$tree"
    touch "$H/$tree/.unpacked"
    du -sh "$H/$tree"
  fi
done
