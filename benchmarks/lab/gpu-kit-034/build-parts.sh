#!/usr/bin/env bash
# Builds the pieces that carry PyTorch 2.14.0 (CUDA 13.0) and the NCCL it links against to the offline GPU host,
# whose own torch is 2.11.0+cu130 with NCCL 2.28.9: the first step towards vLLM 0.33/0.34, which pin torch 2.14.0.
#   bash build-parts.sh OUTDIR        (any x86-64 machine with pip and a package index; ~10 min on 2 cores)
# OUTDIR gets a/part.00, b/part.01, ... (each <= PIECE_MB MiB, default 48: one piece per transfer beside a working
# tree of ~13 MB, under the 64 MiB a call carries); a/ also holds parts.sha256.
# Why NCCL too: libtorch_cuda.so 2.14 calls ncclCommGrow, ncclCommSuspend, ncclPutSignal and others that the host's
# NCCL 2.28.9 lacks (nm -D of both), so torch 2.14 cannot load against it. The host's cuDNN 9.19, cuSPARSELt 0.8.0,
# NVSHMEM 3.4.5 and CUDA 13.0.2 libraries are used as they are (torch 2.14 asks for 9.24, 0.8.1, 3.4.5, 13.0.3).
set -euo pipefail
OUT=$(mkdir -p "${1:?usage: build-parts.sh OUTDIR}" && cd "$1" && pwd)
WORK=${WORK:-$(mktemp -d)}
PLAT=()
for tag in 2_17 2_18 2_27 2_28; do PLAT+=(--platform "manylinux_${tag}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$WORK/whl" torch==2.14.0 nvidia-nccl-cu13==2.30.7
mkdir -p "$WORK/site"
for wheel in "$WORK"/whl/*.whl; do unzip -q -o "$wheel" -d "$WORK/site"; done
rm -rf "$WORK/site/bin" "$WORK/site/torch/include"   # console scripts; C++ headers (nothing builds against them)
(cd "$WORK/site" && tar -cf - . | xz -6 -T0) | split -b "${PIECE_MB:-48}M" -d -a 2 - "$WORK/part."
rm -rf "$OUT"/[a-z]
i=0
for p in "$WORK"/part.*; do
  d=$(echo a b c d e f g h i j k l m n o p q r s t u v w x y z | cut -d' ' -f$((i + 1))); mkdir -p "$OUT/$d"
  mv "$p" "$OUT/$d/"; i=$((i + 1))
done
(cd "$OUT" && sha256sum */part.* | sed 's# [a-z]/# #' > a/parts.sha256 && cat a/parts.sha256)
du -b "$OUT"/*/part.*
rm -rf "$WORK"
