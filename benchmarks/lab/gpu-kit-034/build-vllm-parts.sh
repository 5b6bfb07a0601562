#!/usr/bin/env bash
# Builds the SECOND stream of the kit: a slim vLLM 0.34.0 (CUDA 13, pins torch 2.14.0, which build-parts.sh carries)
# plus the packages of deps.txt (what vLLM 0.34 and moetrace import that the GPU host lacks), as one tar, xz -9, split
# into pieces of PIECE_MB (default 48) MiB: OUTDIR2/a/vpart.00, b/vpart.01, ...; a/ also holds vparts.sha256.
#   bash build-vllm-parts.sh OUTDIR2      (any x86-64 machine with pip and a package index; 6 min on 2 cores with
#                                          VLLM_WHEEL given, plus the download of its 239 MB otherwise)
#   VLLM_WHEEL=path/to/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl  uses that wheel instead of downloading it.
#   XZ_THREADS=1 (default: xz stays on one core; 0 = all cores, same output size within a few hundred KB).
# On the host: receive.sh after each transfer, then setup.sh (see README.md). Triton is NOT carried: torch 2.14's
# own pin is 3.8, but the host's triton 3.6.0 runs torch.compile (measured) and vLLM 0.34 sets no minimum of its own.
set -euo pipefail
OUT=$(mkdir -p "${1:?usage: build-vllm-parts.sh OUTDIR2}" && cd "$1" && pwd)
KIT=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-$(mktemp -d)}
NICE=(nice -n "${NICE_LEVEL:-10}")
PLAT=()
for tag in 2_5 2_12 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35; do PLAT+=(--platform "manylinux_${tag}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
PIP=("${NICE[@]}" python3 -m pip)
V=0.34.0

# 1. slim vLLM: the wheel minus what a Hopper GPU running a bf16 / FP8 / INT4 (compressed-tensors) DeepseekV3-family
#    model never loads. Each removal is either never imported on that path or only behind a switch env.sh sets.
if [ -n "${VLLM_WHEEL:-}" ]; then
  mkdir -p "$WORK/wheel" && cp "$VLLM_WHEEL" "$WORK/wheel/"
else
  "${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
      -d "$WORK/wheel" "vllm==$V"
fi
mkdir -p "$WORK/tree" && unzip -q "$WORK"/wheel/vllm-$V-*.whl -d "$WORK/tree"
(
  cd "$WORK/tree/vllm"
  # FlashAttention 2 (74 MB): Hopper takes FA3 (fa_utils.get_flash_attn_version); FA2_AVAILABLE=False is tolerated.
  rm -f vllm_flash_attn/_vllm_fa2_C.abi3.so
  # Rust frontend binary (64 MB): looked for only when VLLM_USE_RUST_FRONTEND/VLLM_USE_RUST_BENCH=1 (envs.py).
  rm -f vllm-rs
  # DeepGEMM (58 MB, .so + CUTLASS headers for its JIT): compiles every kernel with CUDA_HOME/bin/nvcc (no NVRTC
  # path), which the host lacks; env.sh sets VLLM_USE_DEEP_GEMM=0 so FP8 takes CUTLASS block-FP8 / Triton instead.
  rm -rf third_party/deep_gemm
  # Blackwell-only attention: fmha_sm100 (34 MB; MiniMax-M3 MSA on SM100) and tml_fa4 (SM100 FA4; Inkling model).
  rm -rf third_party/fmha_sm100 third_party/tml_fa4
  # Kimi Delta Attention kernels (7 MB): imported only by models/kimi_k3 and models/glm5next (KDA layers).
  rm -f _flashkda_C.abi3.so
  # Swagger UI of the HTTP server's offline docs: offline_docs.py checks the folder exists and skips the mount.
  rm -rf entrypoints/serve/instrumentator/static
  # Symbol tables only; .dynsym and the CUDA fatbins stay. Kept: _C (CUTLASS GEMMs, attention/cache ops),
  # _moe_C (Marlin MoE for the compressed-tensors INT4 experts, grouped top-k, align), FA3, FlashMLA, DeepSelect
  # (DeepSeek-V3.2 sparse-attention indexer top-k), and the three small helpers.
  for so in $(find . -name '*.so'); do strip --strip-unneeded "$so"; done
)

# 2. dependencies: cp312 wheels installed into the same tree (xz then compresses their contents well).
grep -v '^#' "$KIT/deps.txt" | sed 's/#.*//' | awk 'NF{print $1}' > "$WORK/pins.txt"
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$WORK/whl" -r "$WORK/pins.txt"
PIP_CONSTRAINT= "${PIP[@]}" install -q --no-index --no-deps --no-compile --target "$WORK/tree" --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${PLAT[@]}" --only-binary=:all: "$WORK"/whl/*.whl
rm -rf "$WORK/tree/bin"                       # console scripts point at this machine's interpreter
rm -rf "$WORK/tree/share"                     # plotly's JupyterLab extension
find "$WORK/tree" -name __pycache__ -prune -exec rm -rf {} +
# symbol tables of the dependencies' extensions too (polars' 178 MB engine ships unstripped: 138 MB stripped)
find "$WORK/tree" -name '*.so' -not -path "$WORK/tree/vllm/*" -exec strip --strip-unneeded {} +
du -sm "$WORK/tree"

# 3. one tar, xz -9, split into pieces of PIECE_MB MiB, one piece per transfer beside a working tree of ~13 MB.
[ ! -e "$OUT/a/parts.sha256" ] || { echo "$OUT holds the torch stream: use another OUTDIR2" >&2; exit 2; }
rm -rf "$OUT"/[a-z]
(cd "$WORK/tree" && tar --sort=name -cf - . | "${NICE[@]}" xz -9 -T"${XZ_THREADS:-1}") \
    | split -b "${PIECE_MB:-48}M" -d -a 2 - "$WORK/vpart."
i=0
for p in "$WORK"/vpart.*; do
  d=$(echo a b c d e f g h i j k l m n o p q r s t u v w x y z | cut -d' ' -f$((i + 1))); mkdir -p "$OUT/$d"
  mv "$p" "$OUT/$d/"; i=$((i + 1))
done
(cd "$OUT" && sha256sum */vpart.* | sed 's# [a-z]/# #' > a/vparts.sha256 && cat a/vparts.sha256)
du -b "$OUT"/*/vpart.*
rm -rf "$WORK"
