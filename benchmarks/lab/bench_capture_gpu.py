"""Benchmark: graph-safe routing capture (hooks/capture.py) inside CUDA graphs around Kimi-K2-shaped MoE layers.

    python benchmarks/lab/bench_capture_gpu.py [--layers 60] [--out DIR]      # on a CUDA GPU
    python benchmarks/lab/bench_capture_gpu.py --device cpu --smoke            # tiny sizes, eager paths only

# T real tokens, P padded tokens (a CUDA-graph size), L layers, K top-k, E experts, H hidden, I expert width

Each layer: RMS norm, bf16 gate linear H→E, the router (sigmoid scores, + bias for selection, top-K, gather the
unbiased scores, renormalise) called through ``_compute_routing`` as vLLM's routers are, then the experts as a
grouped GEMM at per-TP-rank width I (``torch._grouped_mm``). ``--no-experts`` replaces the experts by a cheap
embedding sum, so that per-layer overheads stand out against a short step.

Variants, captured as CUDA graphs at the padded sizes vLLM uses (1, 2, 4, 8, 16) and replayed with changing inputs
and real token counts 1..16 (padding rows hold junk):
- none: no capture (baseline);
- obvious: two ``copy_`` per layer into static buffers [T_max, L, K] inside the graph, rows copied out after;
- design: hooks.capture.RoutingCapture (references to the router's outputs kept at capture, no kernel in the
  graph; after the replay one stack per field and one non-blocking copy to pinned memory);
and eagerly (graphs cannot hold a host sync): none-eager, naive (``.cpu()`` of ids and weights per layer inside the
forward), design-eager.

Correctness: after each checked replay, the router logits the graph computed (references kept at capture, like the
design's) are routed again eagerly by an independent implementation; the captured rows [:T] must equal it (ids as
sets, weights to 1e-6), padding rows excluded; a row may differ only where the K-th and (K+1)-th selection scores
tie.

Evidence it produced: benchmarks/results/capture_h200.md, capture_h200_full.json, capture_h200_router_only.json
(commit b38e599, one H200, 2026-11-29).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from capture_model import SIZES, Model, check_grouped_mm, compare, padded, reference_routing
from cuda_graphs import graph_nodes, new_graph
from moetrace.hooks import capture as cap

REFERENCE_STEP_MS = 12.1


def wrap_obvious(router: Any, slot: int, ids_buf: torch.Tensor, w_buf: torch.Tensor) -> None:
    """The obvious graph-safe capture: two copy_ per layer into static buffers [T_max, L, K]."""
    original = router._compute_routing
    top_k = ids_buf.shape[-1]

    def compute(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original(*args, **kwargs)
        n = ids.shape[0]
        ids_buf[:n, slot].copy_(ids[:, :top_k])
        w_buf[:n, slot].copy_(weights[:, :top_k])
        return weights, ids

    router._compute_routing = compute


def wrap_naive(router: Any, sink: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The naive capture: a host copy of ids and weights per layer, inside the forward (a sync per layer)."""
    original = router._compute_routing

    def compute(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original(*args, **kwargs)
        sink.append((ids.cpu(), weights.cpu()))
        return weights, ids

    router._compute_routing = compute


def unwrap_plain(router: Any) -> None:
    vars(router).pop("_compute_routing", None)


class Variant:
    """One capture variant: install/uninstall on the model's routers, and what runs after each forward."""

    def __init__(self, name: str, model: Model, args: argparse.Namespace, device: torch.device):
        self.name, self.model = name, model
        L, K, T_max = len(model.layers), args.top_k, args.max_tokens
        self.key: list[Any] = [None]
        self.capture = cap.RoutingCapture(T_max, L, K, 0, device, graph_key=lambda: self.key[0])
        self.ids_buf = torch.zeros(T_max, L, K, dtype=torch.int32, device=device)
        self.w_buf = torch.zeros(T_max, L, K, dtype=torch.float32, device=device)
        pin = device.type == "cuda"
        self.ids_host = torch.zeros(T_max, L, K, dtype=torch.int32, pin_memory=pin)
        self.w_host = torch.zeros(T_max, L, K, dtype=torch.float32, pin_memory=pin)
        self.sink: list[tuple[torch.Tensor, torch.Tensor]] = []

    def install(self) -> None:
        for slot, layer in enumerate(self.model.layers):
            if self.name.startswith("design"):
                cap.wrap_router(layer.router, slot, self.capture)
            elif self.name == "obvious":
                wrap_obvious(layer.router, slot, self.ids_buf, self.w_buf)
            elif self.name == "naive":
                wrap_naive(layer.router, self.sink)

    def uninstall(self) -> None:
        for layer in self.model.layers:
            cap.unwrap_router(layer.router) if self.name.startswith("design") else unwrap_plain(layer.router)

    def before(self) -> None:
        if self.name.startswith("design"):
            self.capture.begin_step()
        self.sink.clear()

    def after(self, num_tokens: int, replayed: Any) -> Any:
        """Start the copy-out of rows [:T]; returns something whose .wait() gives {ids, weights} on the host."""
        if self.name.startswith("design"):
            # int32 columns that side by side are [N, L*K ids | L*K weights], the forward's T rows first
            _, columns = self.capture.collect(num_tokens, replayed)
            block = torch.cat(columns, dim=1)[:num_tokens]
            layers, top_k = self.capture.num_layers, self.capture.top_k
            ids, weights = torch.split(block, layers * top_k, dim=1)
            return Done({"ids": ids.reshape(num_tokens, layers, top_k),
                         "weights": weights.view(torch.float32).reshape(num_tokens, layers, top_k)})
        if self.name == "obvious":
            self.ids_host[:num_tokens].copy_(self.ids_buf[:num_tokens], non_blocking=True)
            self.w_host[:num_tokens].copy_(self.w_buf[:num_tokens], non_blocking=True)
            return Done({"ids": self.ids_host[:num_tokens], "weights": self.w_host[:num_tokens]})
        if self.name == "naive":
            ids = torch.stack([i[:num_tokens] for i, _ in self.sink], dim=1)
            weights = torch.stack([w[:num_tokens] for _, w in self.sink], dim=1)
            return Done({"ids": ids, "weights": weights}, synced=True)
        return None


class Done:
    def __init__(self, rows: dict[str, torch.Tensor], synced: bool = False):
        self.rows, self.synced = rows, synced

    def wait(self) -> dict[str, torch.Tensor]:
        if not self.synced and torch.cuda.is_available():
            torch.cuda.synchronize()
        return {k: v.clone() for k, v in self.rows.items()}


# -- correctness -----------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.model = Model(args, device)
        self.experts = check_grouped_mm(self.model)
        gen = torch.Generator(device=device).manual_seed(2)
        self.pool_inputs = torch.randn(args.input_pool, args.max_tokens, args.hidden, device=device, generator=gen)
        self.pool_inputs = self.pool_inputs.bfloat16()
        self.static_x = {p: torch.zeros(p, args.hidden, dtype=torch.bfloat16, device=device) for p in SIZES}
        self.graphs: dict[str, dict[int, torch.cuda.CUDAGraph]] = {}
        self.nodes: dict[tuple[str, int], dict[str, int] | str] = {}
        self.variants: dict[str, Variant] = {}

    def variant(self, name: str) -> Variant:
        if name not in self.variants:
            self.variants[name] = Variant(name, self.model, self.args, self.device)
        return self.variants[name]

    def load_input(self, x: torch.Tensor, step: int, num_tokens: int) -> None:
        """Real rows [:T] from the input pool; padding rows [T:P] junk, as stale vLLM input buffers are."""
        src = self.pool_inputs[step % self.args.input_pool]
        x[:num_tokens].copy_(src[:num_tokens])
        if num_tokens < x.shape[0]:
            x[num_tokens:].copy_(self.pool_inputs[(step * 7 + 3) % self.args.input_pool][: x.shape[0] - num_tokens])

    def capture_graphs(self, name: str, pool: Any) -> None:
        v = self.variant(name)
        v.install()
        graphs = {}
        for p in sorted(SIZES, reverse=True):  # vLLM captures the largest first, into one shared pool
            x = self.static_x[p]
            self.load_input(x, 0, p)
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    v.before()
                    self.model(x)
            torch.cuda.current_stream().wait_stream(side)
            v.key[0] = p
            graph = new_graph()
            v.before()
            with torch.cuda.graph(graph, pool=pool):
                self.model(x, key=(name, p))
            self.nodes[(name, p)] = graph_nodes(graph)
            graph.instantiate()
            graphs[p] = graph
        v.uninstall()  # the graphs keep what they captured; the wrapper is not needed to replay
        self.graphs[name] = graphs

    def step(self, name: str, step: int, num_tokens: int, graph: bool) -> Any:
        v = self.variant(name)
        p = padded(num_tokens) if graph else num_tokens
        x = self.static_x[p] if graph else self.pool_inputs[step % self.args.input_pool][:num_tokens]
        if graph:
            self.load_input(x, step, num_tokens)
        v.before()
        if graph:
            self.graphs[name][p].replay()
        else:
            self.model(x, key=(name, "eager"))
        return v.after(num_tokens, p if graph else None)

    def check(self, name: str, graph: bool, steps: int, tokens: list[int]) -> dict[str, int]:
        v = self.variant(name)
        if not graph:
            v.install()
        total = {"steps": 0, "rows": 0, "mismatched": 0, "ties": 0}
        for i in range(steps):
            t = tokens[i % len(tokens)]
            pending = self.step(name, 1000 + i, t, graph)
            rows = pending.wait()
            key = (name, padded(t)) if graph else (name, "eager")
            n, bad, tie = compare(rows, reference_routing(self.model, key, t, self.args.top_k))
            total["steps"] += 1
            total["rows"] += n
            total["mismatched"] += bad
            total["ties"] += tie
        if not graph:
            v.uninstall()
        return total

    def time_block(self, name: str, graph: bool, tokens: list[int], start: int) -> float:
        """Mean ms per step over one block of steps (CUDA events around the block, no host sync inside)."""
        v = self.variant(name)
        if not graph:
            v.install()
        sync: Callable[[], None] = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        if self.device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record()
        t0 = time.perf_counter()
        for i, t in enumerate(tokens):
            self.step(name, start + i, t, graph)
        if self.device.type == "cuda":
            end.record()
            end.synchronize()
            ms: float = begin.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if not graph:
            v.uninstall()
        return ms / len(tokens)

    def host_collect_us(self, name: str, tokens: list[int]) -> float:
        """Host (CPU) time of the design's post-forward gather call alone, µs per step."""
        v = self.variant(name)
        total = 0.0
        for i, t in enumerate(tokens):
            p = padded(t)
            v.before()
            self.graphs[name][p].replay()
            t0 = time.perf_counter()
            v.after(t, p)
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
        return total / len(tokens) * 1e6


def token_counts(n: int, low: int, high: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few steps (a CPU dry run)")
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--width", type=int, default=256, help="expert width per TP rank (2048 / TP=8)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-sets", type=int, default=2, help="distinct expert weight sets, cycled")
    parser.add_argument("--no-experts", action="store_true", help="router-only layers (embedding-sum experts)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=40, help="steps per timed block")
    parser.add_argument("--eager-rounds", type=int, default=7)
    parser.add_argument("--eager-block", type=int, default=20)
    parser.add_argument("--check-steps", type=int, default=200, help="checked replays per graph variant")
    parser.add_argument("--input-pool", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.experts, args.width = 4, 256, 64, 32
        args.rounds, args.block, args.eager_rounds, args.eager_block, args.check_steps = 2, 4, 2, 3, 6
    args.max_tokens = max(SIZES) * 2  # eager steps use up to 32 tokens (beyond the largest graph, as vLLM does)
    return args


def capture_every_graph(bench: Bench, graph_names: list[str], info: dict[str, Any]) -> None:
    """Each variant's graphs at every size, into one pool; ``info`` records the experts' kernel they hold."""
    pool = torch.cuda.graph_pool_handle()
    t0 = time.perf_counter()
    try:
        for name in graph_names:
            bench.capture_graphs(name, pool)
    except Exception as exc:  # noqa: BLE001 - e.g. a grouped GEMM that cannot be captured: fall back, once
        print(f"capture failed ({type(exc).__name__}: {exc}); retrying with gather+bmm experts", flush=True)
        for s in bench.model.sets:
            s.grouped = False
        bench.experts = info["expert_kernel"] = f"gather+bmm (grouped_mm capture failed: {type(exc).__name__})"
        bench.graphs.clear()
        bench.variants.clear()
        pool = torch.cuda.graph_pool_handle()
        for name in graph_names:
            bench.capture_graphs(name, pool)
    print(f"captured {len(graph_names) * len(SIZES)} graphs in {time.perf_counter() - t0:.1f}s", flush=True)


def check_correctness(bench: Bench, args: argparse.Namespace, graph: bool) -> dict[str, dict[str, int]]:
    """Real token counts 1..16 padded to graph sizes; eager steps 1..32 unpadded."""
    checks = {}
    check_tokens = token_counts(max(args.check_steps, 1), 1, max(SIZES), seed=5)
    for name in ["design", "obvious"] if graph else []:
        checks[name] = bench.check(name, True, args.check_steps, check_tokens)
        print(f"check {name}: {checks[name]}", flush=True)
    for name in ["design-eager", "naive"]:
        checks[name] = bench.check(name, False, max(args.check_steps // 10, 3), token_counts(32, 1, 32, seed=6))
        print(f"check {name}: {checks[name]}", flush=True)
    return checks


def time_variants(bench: Bench, args: argparse.Namespace, graph_names: list[str], eager_names: list[str],
                  graph: bool) -> dict[str, list[float]]:
    """Interleaved rounds, the same token sequence for every variant in a round: ms per step of each block."""
    times: dict[str, list[float]] = {n: [] for n in graph_names + eager_names}
    warm = token_counts(4, 1, max(SIZES), seed=99)
    for name in graph_names:
        bench.time_block(name, True, warm, start=0)
    for name in eager_names:
        bench.time_block(name, False, warm, start=0)
    t0 = time.perf_counter()
    for r in range(args.rounds if graph else 0):
        tokens = token_counts(args.block, 1, max(SIZES), seed=100 + r)
        order = graph_names if r % 2 == 0 else graph_names[::-1]
        for name in order:
            times[name].append(bench.time_block(name, True, tokens, start=r * args.block))
    for r in range(args.eager_rounds):
        tokens = token_counts(args.eager_block, 1, max(SIZES), seed=200 + r)
        order = eager_names if r % 2 == 0 else eager_names[::-1]
        for name in order:
            times[name].append(bench.time_block(name, False, tokens, start=r * args.eager_block))
    print(f"timed in {time.perf_counter() - t0:.1f}s", flush=True)
    return times


def overhead_rows(times: dict[str, list[float]], graph_names: list[str], eager_names: list[str],
                  L: int) -> list[dict[str, Any]]:
    """Each variant's overhead over its baseline (no capture, graphs or eager alike): medians over rounds."""
    rows = []
    for name in graph_names + eager_names:
        base = "none" if name in graph_names else "none-eager"
        # Paired per round: the variant's block minus the baseline's block of the same round (same tokens).
        diffs = [(t - b) * 1e3 for t, b in zip(times[name], times[base])]  # µs per step
        over_us = statistics.median(diffs)
        base_ms = statistics.median(times[base])
        rows.append({
            "variant": name, "graphs": name in graph_names, "step_ms": statistics.median(times[name]),
            "baseline_ms": base_ms, "ratio": 1 + over_us / (base_ms * 1e3), "us_per_step": over_us,
            "us_per_layer": over_us / L, "us_per_layer_range": [min(diffs) / L, max(diffs) / L],
            "pct_of_12_1ms_step": over_us / (REFERENCE_STEP_MS * 1e3) * 100,
            "pct_of_own_step": over_us / (base_ms * 1e3) * 100, "blocks_ms": times[name],
        })
    return rows


def print_overhead_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    rounds = f"{args.rounds} graph / {args.eager_rounds} eager rounds"
    print()
    print(f"| variant | CUDA graphs | step ms (median, {rounds}) | vs baseline | overhead µs/layer/step (median "
          f"of paired rounds) | range over rounds | % of a 12.1 ms step | % of this step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        low, high = row["us_per_layer_range"]
        print(f"| {row['variant']} | {'yes' if row['graphs'] else 'no (eager)'} | {row['step_ms']:.3f} "
              f"| {row['ratio']:.4f} | {row['us_per_layer']:.3f} | {low:.2f} .. {high:.2f} "
              f"| {row['pct_of_12_1ms_step']:.3f} | {row['pct_of_own_step']:.3f} |")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    graph = device.type == "cuda"
    torch.manual_seed(0)
    bench = Bench(args, device)
    info = {
        "device": torch.cuda.get_device_name(device) if graph else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "layers": args.layers, "hidden": args.hidden,
        "experts": args.experts, "width": args.width, "top_k": args.top_k, "expert_kernel": bench.experts,
        "no_experts": args.no_experts,
    }
    print(json.dumps(info), flush=True)
    results: dict[str, Any] = {"info": info, "command": " ".join(sys.argv)}

    graph_names = ["none", "obvious", "design"] if graph else []
    eager_names = ["none-eager", "naive", "design-eager"]
    if graph:
        capture_every_graph(bench, graph_names, info)
        results["graph_nodes"] = {f"{n}/{p}": bench.nodes[(n, p)] for n in graph_names for p in SIZES}
        for n in graph_names:
            print(f"graph nodes {n}: " + ", ".join(f"P={p}: {bench.nodes[(n, p)]}" for p in SIZES), flush=True)
    checks = check_correctness(bench, args, graph)
    results["checks"] = checks
    times = time_variants(bench, args, graph_names, eager_names, graph)
    if graph:
        results["design_host_collect_us"] = bench.host_collect_us("design", token_counts(50, 1, 16, seed=7))
    results["rows"] = overhead_rows(times, graph_names, eager_names, args.layers)
    print_overhead_table(results["rows"], args)
    if "design_host_collect_us" in results:
        print(f"\ndesign: host time of collect() after the forward: {results['design_host_collect_us']:.1f} µs/step")
    ok = all(c["mismatched"] == c["ties"] for c in checks.values())
    print(f"\ncorrectness: {'OK' if ok else 'FAILED'} {json.dumps(checks)}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
