#!/usr/bin/env bash
# On the GPU host, once per transfer: keep the piece(s) that arrived under PARTS_DIR/*/ in the kit's home (outside
# the project tree, so they stay while the host stays up); once all are there, check them and unpack them once.
#   bash receive.sh PARTS_DIR
set -euo pipefail
source "$(dirname "$0")/env.sh"
H=$GPU_KIT_HOME
mkdir -p "$H/parts"
for p in "${1:?usage: receive.sh PARTS_DIR}"/*/part.*; do
  [ -f "$p" ] && [ ! -f "$H/parts/$(basename "$p")" ] && cp "$p" "$H/parts/"
done
for f in "$1"/*/parts.sha256; do [ -f "$f" ] && cp -f "$f" "$H/"; done
have=$(ls "$H/parts" | wc -l); want=$(wc -l < "$H/parts.sha256" 2>/dev/null || echo "?")
echo "pieces: $have of $want"
if [ "$have" = "$want" ] && [ ! -f "$H/site/.unpacked" ]; then
  (cd "$H/parts" && sha256sum -c "$H/parts.sha256" --quiet) && echo "pieces: sha256 ok"
  rm -rf "$H/site" && mkdir -p "$H/site"
  cat "$H"/parts/part.* | xz -d -T0 | tar -x -C "$H/site"
  touch "$H/site/.unpacked"
  du -sh "$H/site"
fi
