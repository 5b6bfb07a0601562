"""On the GPU host, with env.sh sourced: does PyTorch 2.14 load and run on the host's CUDA 13 libraries (its own
NCCL carried)? Each check prints one line, ok or the error; the exit status is the number that failed."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable


def check(name: str, run: Callable[[], str]) -> bool:
    began = time.perf_counter()
    try:
        said = run()
    except Exception as exc:  # a probe: every failure is reported, none stops the others
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        print(f"FAIL {name}: {last[:400]}", flush=True)
        return False
    print(f"ok   {name} ({time.perf_counter() - began:.1f} s): {said}", flush=True)
    return True


def main() -> int:
    import torch

    def loaded() -> str:
        return (f"torch {torch.__version__} from {os.path.dirname(torch.__file__)}, CUDA {torch.version.cuda}, "
                f"{torch.cuda.get_device_name(0)}, cuDNN {torch.backends.cudnn.version()}, "
                f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")

    def matmul() -> str:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        return f"bf16 8192^3 at {10 * 2 * 8192**3 / (time.perf_counter() - began) / 1e12:.0f} TFLOP/s"

    def conv() -> str:
        x = torch.randn(8, 64, 56, 56, device="cuda", dtype=torch.float16)
        w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16)
        return f"cuDNN conv2d sum {float(torch.nn.functional.conv2d(x, w, padding=1).float().sum()):.3e}"

    def all_reduce() -> str:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29555")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        dist.destroy_process_group()
        return f"NCCL all-reduce of one rank: {float(t.sum()):.0f}"

    def graph() -> str:
        x = torch.randn(1024, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2 + 1
        g.replay()
        torch.cuda.synchronize()
        return f"CUDA graph replay ok: {bool(torch.allclose(y, x * 2 + 1))}"

    def compiled() -> str:
        import triton

        f = torch.compile(lambda a: torch.nn.functional.gelu(a) * 2)
        a = torch.randn(4096, device="cuda")
        return f"torch.compile with triton {triton.__version__} from {os.path.dirname(triton.__file__)}: " \
               f"{bool(torch.allclose(f(a), torch.nn.functional.gelu(a) * 2, atol=1e-5))}"

    checks = [("load", loaded), ("matmul", matmul), ("cudnn", conv), ("nccl", all_reduce), ("cuda graph", graph),
              ("torch.compile", compiled)]
    return sum(not check(name, run) for name, run in checks)


if __name__ == "__main__":
    raise SystemExit(main())
