"""On the GPU host, once vLLM 0.34 is unpacked (receive.sh): the one change the kit makes to vLLM's source.
vLLM 0.34's kernel warm-up imports MiniMax-M3's MSA warm-up on every CUDA engine, whatever the model, and that module
imports the CuTe DSL (nvidia-cutlass-dsl), which the kit leaves out: without this an engine of any model fails to
start (seen on an H100: ModuleNotFoundError: No module named 'cutlass'). Idempotent.
    python3 patch_vllm.py VSITE"""

from __future__ import annotations

import sys
from pathlib import Path

WARMUP = Path("vllm/model_executor/warmup/kernel_warmup.py")
UNGUARDED = '''        from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
            minimax_m3_msa_warmup,
        )

        minimax_m3_msa_warmup(worker)'''
GUARDED = '''        try:  # moetrace kit: MiniMax-M3's MSA warm-up imports the CuTe DSL, which the kit leaves out
            from vllm.model_executor.warmup.minimax_m3_msa_warmup import minimax_m3_msa_warmup
        except ModuleNotFoundError:
            minimax_m3_msa_warmup = None
        if minimax_m3_msa_warmup is not None:
            minimax_m3_msa_warmup(worker)'''


def main(vsite: Path) -> None:
    path = vsite / WARMUP
    source = path.read_text()
    if GUARDED in source:
        print(f"{path}: already patched")
        return
    if UNGUARDED not in source:
        raise SystemExit(f"{path}: not vLLM 0.34's kernel warm-up (the MiniMax-M3 import to guard is not there)")
    path.write_text(source.replace(UNGUARDED, GUARDED))
    print(f"{path}: MiniMax-M3's warm-up guarded")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
