"""MoE expert time with real grouped-GEMM kernels: ``torch._grouped_mm`` (bf16) and ``torch._scaled_grouped_mm``
(fp8 e4m3, row-wise scales), one expert layer as vLLM runs it per rank: gate+up GEMM, SiLU·mul, down GEMM; and,
where vLLM is installed on a CUDA GPU, vLLM's own fused-MoE kernel (``fused_experts``, Triton, bf16), whose time at
a given number of experts also grows with the tokens (its block padding), so it is kept as a table, not a line.

Weights live in a pool of experts and every timed call reads its experts from a different offset of it, so small
sets are not served from L2. On CUDA the calls are captured in a CUDA graph (as vLLM decodes) and timed by events
over replays; on the CPU (tests, smoke runs) they are timed with a host clock.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
POOL_OFFSETS = 8  # distinct offsets into the pool the timed calls read from in turn


def weight_bytes_per_expert(hidden: int, width: int, bits: int, group_size: int | None = None,
                            scale_bits: int = 16) -> int:
    """Gate, up and down matrices of one expert (3·hidden·width weights) plus group scales when quantised."""
    weights = 3 * hidden * width
    scales = 0 if not group_size else (weights // group_size) * scale_bits // 8
    return weights * bits // 8 + scales


def group_offsets(rows: int, groups: int, device: torch.device, multiple: int = 1) -> tuple[torch.Tensor, int]:
    """Cumulative row offsets (int32) spreading ``rows`` over ``groups`` as evenly as possible, each group padded
    up to ``multiple`` rows; returns the offsets and the padded total."""
    if groups < 1 or rows < groups:
        raise ValueError(f"{rows} rows cannot give each of {groups} experts a row")
    base, extra = divmod(rows, groups)
    sizes = [base + (1 if g < extra else 0) for g in range(groups)]
    sizes = [-(-s // multiple) * multiple for s in sizes]
    offsets, total = [], 0
    for size in sizes:
        total += size
        offsets.append(total)
    return torch.tensor(offsets, dtype=torch.int32, device=device), total


def time_calls(call: Callable[[int], object], device: torch.device, reps: int, replays: int,
               use_graph: bool = True) -> tuple[float, str]:
    """Median µs of one ``call(i)`` (i = 0..reps−1 picks the offset into the pool) and how it was timed."""
    for i in range(min(reps, 3)):
        call(i)
    if device.type != "cuda":
        samples = []
        for _ in range(replays):
            began = time.perf_counter()
            for i in range(reps):
                call(i)
            samples.append((time.perf_counter() - began) * 1e6 / reps)
        return statistics.median(samples), "host-clock"
    torch.cuda.synchronize(device)
    graph: Any = None
    mode = "eager-events"
    if use_graph:
        try:
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for i in range(min(reps, 2)):
                    call(i)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(reps):
                    call(i)
            mode = "cuda-graph"
        except Exception:  # capture unsupported for this kernel: time eagerly instead
            graph = None
            torch.cuda.synchronize(device)

    def once() -> None:
        if graph is not None:
            graph.replay()
        else:
            for i in range(reps):
                call(i)

    once()
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    samples = []
    for _ in range(replays):
        start.record()
        once()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    graph = None  # release the captured graph now (the closure above still refers to the name)
    return statistics.median(samples), mode


class ExpertPool:
    """Weights of ``pool`` experts at one per-rank shape in one format, and the expert-layer call over consecutive
    experts of it."""

    def __init__(self, hidden: int, width: int, pool: int, fmt: str, device: torch.device, seed: int = 0) -> None:
        self.hidden, self.width, self.pool, self.fmt, self.device = hidden, width, pool, fmt, device
        self.row_multiple = 1
        generator = torch.Generator(device=device).manual_seed(seed)
        # stored [experts, out, in] (as checkpoints are); the kernels get the [experts, in, out] transposed view
        w13 = self._random((pool, 2 * width, hidden), generator)
        w2 = self._random((pool, hidden, width), generator)
        if fmt == "bf16":
            self.w13, self.w2 = w13, w2
            self.s13 = self.s2 = None
            self.kernel = "torch._grouped_mm"
        elif fmt == "fp8":
            self.w13, self.w2 = self._to_fp8(w13), self._to_fp8(w2)
            del w13, w2
            self.s13 = torch.ones(pool, 2 * width, dtype=torch.float32, device=device)
            self.s2 = torch.ones(pool, hidden, dtype=torch.float32, device=device)
            self.kernel = "torch._scaled_grouped_mm (e4m3, row-wise scales)"
        else:
            raise ValueError(f"unknown weight format {fmt!r}")
        self.bits = 8 if fmt == "fp8" else 16

    def _random(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        for e in range(shape[0]):  # one expert at a time: no float32 temporary of the whole pool
            out[e].copy_(torch.randn(shape[1:], generator=generator, device=self.device) * 0.05)
        return out

    def _to_fp8(self, weights: torch.Tensor) -> torch.Tensor:
        out = torch.empty(weights.shape, dtype=FP8, device=self.device)
        for e in range(weights.shape[0]):
            out[e].copy_(weights[e].to(FP8))
        return out

    @property
    def bytes_per_expert(self) -> int:
        return weight_bytes_per_expert(self.hidden, self.width, self.bits)

    def pool_offsets(self, experts: int) -> list[int]:
        count = max(1, min(POOL_OFFSETS, self.pool // experts))
        return [i * experts for i in range(count)]

    def layer_call(self, experts: int, rows: int) -> tuple[Callable[[int], object], int]:
        """The expert layer over ``experts`` experts holding ``rows`` routed rows; returns the call (its argument
        picks the offset into the pool) and the rows actually computed (padded where the kernel needs it)."""
        offs, total = group_offsets(rows, experts, self.device, self.row_multiple)
        x = torch.randn(total, self.hidden, device=self.device).to(torch.bfloat16)
        starts = self.pool_offsets(experts)
        width = self.width
        if self.fmt == "bf16":
            w13t = [self.w13[s:s + experts].transpose(1, 2) for s in starts]
            w2t = [self.w2[s:s + experts].transpose(1, 2) for s in starts]

            def call_bf16(i: int) -> object:
                j = i % len(starts)
                h = torch._grouped_mm(x, w13t[j], offs=offs)
                a = F.silu(h[:, :width]) * h[:, width:]
                return torch._grouped_mm(a, w2t[j], offs=offs)

            return call_bf16, total
        assert self.s13 is not None and self.s2 is not None
        w13t = [self.w13[s:s + experts].transpose(1, 2) for s in starts]
        w2t = [self.w2[s:s + experts].transpose(1, 2) for s in starts]
        s13 = [self.s13[s:s + experts] for s in starts]
        s2 = [self.s2[s:s + experts] for s in starts]
        row_scale = torch.ones(total, dtype=torch.float32, device=self.device)

        def call_fp8(i: int) -> object:
            j = i % len(starts)
            h = torch._scaled_grouped_mm(x.to(FP8), w13t[j], row_scale, s13[j], offs=offs, out_dtype=torch.bfloat16)
            a = F.silu(h[:, :width]) * h[:, width:]
            return torch._scaled_grouped_mm(a.to(FP8), w2t[j], row_scale, s2[j], offs=offs,
                                            out_dtype=torch.bfloat16)

        return call_fp8, total

    def fused_moe_call(self, experts: int, tokens: int, top_k: int) -> Callable[[int], object]:
        """vLLM's ``fused_experts`` over ``tokens`` tokens routed top-``top_k`` over exactly ``experts`` consecutive
        experts from an offset into the pool: token i takes slots top_k·i … top_k·i + top_k − 1 modulo ``experts``
        (distinct while experts ≥ top_k). Call it inside ``vllm_kernel_context()``."""
        from vllm.model_executor.layers.fused_moe import fused_experts

        x = (torch.randn(tokens, self.hidden, device=self.device) * 0.1).to(torch.bfloat16)
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=self.device, dtype=torch.float32)
        slots = (torch.arange(tokens * top_k, device=self.device) % experts).view(tokens, top_k)
        ids = [((slots + start) % self.pool).to(torch.int32) for start in self.pool_offsets(experts)]

        def call(i: int) -> object:
            return fused_experts(x, self.w13, self.w2, weights, ids[i % len(ids)])

        return call

    def fused_moe_check(self, top_k: int) -> str | None:
        """Why vLLM's fused-MoE kernel cannot run on this pool, or None once one token routed to experts
        0 … top_k − 1 at weight 1/top_k matches a float32 reference of the same expert layer."""
        if self.device.type != "cuda":
            return "vLLM's fused_experts is a Triton kernel for CUDA GPUs"
        if self.fmt != "bf16":
            return f"timed unquantised (bf16) only, not {self.fmt}"
        x = (torch.randn(1, self.hidden, device=self.device) * 0.1).to(torch.bfloat16)
        ids = torch.arange(top_k, device=self.device, dtype=torch.int32).view(1, top_k)
        weights = torch.full((1, top_k), 1.0 / top_k, device=self.device, dtype=torch.float32)
        try:
            from vllm.model_executor.layers.fused_moe import fused_experts

            with vllm_kernel_context():
                out = fused_experts(x, self.w13, self.w2, weights, ids).float()
        except Exception as exc:  # vLLM missing, or its kernel refuses this shape
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        ref = torch.zeros_like(out)
        for e in range(top_k):  # gate rows first, then up (vLLM's w13 layout): silu(gate)·up, then down
            h = x.float() @ self.w13[e].float().T
            ref += (F.silu(h[:, :self.width]) * h[:, self.width:]) @ self.w2[e].float().T / top_k
        error = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
        return None if error <= 0.05 else f"relative error {error:.3g} against a float32 reference"

    def check(self) -> str | None:
        """Run a small call once and compare with a float32 reference; returns why the format cannot run here, or
        None. For fp8 it retries with every expert's rows padded to 16 (what some kernels require)."""
        for multiple in ((1, 16) if self.fmt == "fp8" else (1,)):
            self.row_multiple = multiple
            try:
                call, _ = self.layer_call(2, 5)
                out = call(0)
                assert isinstance(out, torch.Tensor)
                if not bool(torch.isfinite(out.float()).all()):
                    return "non-finite output"
                error = self._reference_error()
                if error > 0.05:
                    return f"relative error {error:.3g} against a float32 reference"
                return None
            except Exception as exc:  # the kernel refuses this format, layout or device
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        return reason

    def _scales13(self) -> torch.Tensor:
        assert self.s13 is not None
        return self.s13

    def _reference_error(self) -> float:
        offs, total = group_offsets(5, 2, self.device, self.row_multiple)
        x = torch.randn(total, self.hidden, device=self.device).to(torch.bfloat16)
        if self.fmt == "fp8":  # compare on the values the fp8 kernel sees
            x = x.to(FP8).to(torch.bfloat16)
        w13t = self.w13[0:2].transpose(1, 2)
        h = (torch._grouped_mm(x, w13t, offs=offs) if self.fmt == "bf16" else
             torch._scaled_grouped_mm(x.to(FP8), w13t, torch.ones(total, device=self.device),
                                      self._scales13()[0:2], offs=offs,
                                      out_dtype=torch.bfloat16)).float()
        bounds = [0] + offs.tolist()
        ref = torch.cat([x[a:b].float() @ self.w13[g].float().T for g, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        return float((h - ref).norm() / ref.norm().clamp_min(1e-30))


def copy_bandwidth_gbs(device: torch.device, nbytes: int, replays: int = 10) -> float:
    """Device-memory bandwidth of a large copy (bytes read plus bytes written), the ceiling for weight streaming."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    time_us, _ = time_calls(lambda i: dst.copy_(src), device, reps=2, replays=replays, use_graph=False)
    return 2 * nbytes / (time_us * 1e3)


def vllm_kernel_context() -> Any:
    """vLLM's kernels read the current vLLM config: its defaults, set for the calls made inside."""
    from vllm.config import VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig())


def fit_weight_bandwidth(fit: dict[str, Any], bytes_per_expert: int,
                         points: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The weight bandwidth a curve shows: marginal (bytes per expert over the fitted µs per expert) and peak."""
    marginal = bytes_per_expert / (fit["per_expert_us"] * 1e3) if fit["per_expert_us"] > 0 else None
    return {"marginal_weight_gbs": marginal, "peak_weight_gbs": max(p["weight_gbs"] for p in points)}


def measure_curve(pool: ExpertPool, grid: Sequence[tuple[int, int]], reps: int, replays: int,
                  tick: Callable[[], None], fused_moe_top_k: int | None = None) -> list[dict[str, Any]]:
    """Time the expert layer at every (experts, rows) of ``grid``; ``tick`` is called after each point. With
    ``fused_moe_top_k``, vLLM's fused-MoE kernel over rows ÷ top-k tokens instead of the grouped GEMMs."""
    points = []
    for experts, rows in grid:
        if fused_moe_top_k is None:
            call, computed = pool.layer_call(experts, rows)
        else:
            call, computed = pool.fused_moe_call(experts, rows // fused_moe_top_k, fused_moe_top_k), rows
        time_us, mode = time_calls(call, pool.device, reps, replays)
        points.append({
            "experts": experts,
            "rows": rows,
            "rows_computed": computed,
            "time_us": time_us,
            "weight_gbs": experts * pool.bytes_per_expert / (time_us * 1e3),
            "timing": mode,
        })
        tick()
    return points
