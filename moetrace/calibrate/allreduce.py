"""All-reduce time against message size: one process per device (torch.multiprocessing, spawn), NCCL on GPUs,
gloo on the CPU (tests). Rank 0 times back-to-back all-reduces of bf16 messages with CUDA events (host clock on
the CPU), after checking that the sum is right, and reports through a queue."""

from __future__ import annotations

import os
import queue
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _gpu_us_per_call(call: Callable[[], None], iters: int) -> float:
    """µs per call of ``iters`` calls, timed by CUDA events on the current stream."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / iters


def _time_eager(buffer: torch.Tensor, iters: int, replays: int) -> list[float]:
    """µs per all-reduce of a loop issued from the host: on GPUs this is bound by whichever is slower, the host
    issuing the calls or the GPUs running them."""
    samples = []
    for _ in range(replays):
        dist.barrier()
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
            samples.append(_gpu_us_per_call(lambda: dist.all_reduce(buffer), iters))
        else:
            begin = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buffer)
            samples.append((time.perf_counter() - begin) * 1e6 / iters)
    return samples


def _time_queued(buffer: torch.Tensor, iters: int, replays: int) -> list[float]:
    """µs per all-reduce when the host has queued them all behind a GPU sleep: the GPUs' own time per call."""
    samples = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize(buffer.device)
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call] # ~10 ms at 2 GHz: longer than the host needs to queue every call
        samples.append(_gpu_us_per_call(lambda: dist.all_reduce(buffer), iters))
    return samples


def _time_graph(buffer: torch.Tensor, iters: int, replays: int) -> list[float]:
    """µs per all-reduce replayed from a CUDA graph (as vLLM decodes)."""
    device = buffer.device
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            dist.all_reduce(buffer)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            dist.all_reduce(buffer)
    graph.replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    del graph
    return samples


def _worker(rank: int, world_size: int, backend: str, port: int, sizes: Sequence[int], iters: int, replays: int,
            graph_sizes: int, results: Any) -> None:
    try:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (see the device notes)
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size, device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size)
        expected = world_size * (world_size + 1) / 2
        buffers = []
        for index, nbytes in enumerate(sizes):
            numel = max(1, nbytes // 2)
            buffer = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device=device)
            dist.all_reduce(buffer)
            if not bool((buffer == expected).all()):
                raise RuntimeError(f"all-reduce of {nbytes} bytes gave a wrong sum")
            for _ in range(5):
                dist.all_reduce(buffer)
            point: dict[str, Any] = {"bytes": numel * 2, "index": index}
            eager = _time_eager(buffer, iters, replays)
            point["eager_us"] = statistics.median(eager)
            if device.type == "cuda":
                point["queued_us"] = statistics.median(_time_queued(buffer, iters, replays))
            point["time_us"] = point.get("queued_us", point["eager_us"])
            point["timing"] = "queued" if "queued_us" in point else "host-clock"
            buffers.append(buffer)
            if rank == 0:
                results.put(("point", point))
        dist.barrier()
        if rank == 0:
            version: Any = None
            if backend == "nccl":
                version = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
            results.put(("eager_done", {"backend_version": version}))
        if device.type == "cuda" and graph_sizes:
            # last, since a failed capture can leave the communicator unusable; the parent waits less for it
            for index, buffer in enumerate(buffers[:graph_sizes]):
                try:
                    graph_us = statistics.median(_time_graph(buffer, iters, replays))
                except Exception as exc:
                    if rank == 0:
                        results.put(("graph_error", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:300]))
                    break
                if rank == 0:
                    results.put(("graph_point", {"index": index, "graph_us": graph_us}))
            dist.barrier()
        if rank == 0:
            results.put(("done", {}))
        dist.destroy_process_group()
    except Exception:
        results.put(("error", f"rank {rank}: {traceback.format_exc(limit=3)}"))


def measure_allreduce(world_size: int, backend: str, sizes: Sequence[int], iters: int, replays: int,
                      tick: Callable[[], None], timeout_s: float = 240.0, graph_sizes: int = 0,
                      graph_timeout_s: float = 60.0) -> dict[str, Any]:
    """µs per all-reduce at every message size (bytes) across ``world_size`` processes: host-issued loop
    (``eager_us``), GPU time with the calls queued ahead (``queued_us``), and for the first ``graph_sizes`` sizes
    replayed from a CUDA graph (``graph_us``). ``time_us`` is the GPU-side figure where there is one."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    context = mp.get_context("spawn")
    results: Any = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, backend, port, list(sizes), iters, replays,
                                              graph_sizes, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    points: list[dict[str, Any]] = []
    info: dict[str, Any] | None = None
    graph_note: str | None = None
    finished = False
    deadline = time.monotonic() + timeout_s
    try:
        while not finished:
            try:
                kind, payload = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    if info is None:
                        raise RuntimeError(f"all-reduce across {world_size} processes timed out") from None
                    graph_note = f"CUDA-graph all-reduce did not finish within {graph_timeout_s:.0f} s"
                    break
                if any(p.exitcode not in (None, 0) for p in processes):
                    if info is None:
                        raise RuntimeError(
                            f"an all-reduce worker died (exit codes {[p.exitcode for p in processes]})")
                    graph_note = "a worker died during the CUDA-graph all-reduce"
                    break
                continue
            if kind == "error":
                lines = str(payload).strip().splitlines()
                if info is None:
                    raise RuntimeError(f"{lines[0].split(':')[0]}: {lines[-1]}")
                graph_note = f"CUDA-graph all-reduce failed: {lines[-1]}"
                break
            if kind == "point":
                points.append(payload)
                tick()
            elif kind == "eager_done":
                info = payload
                deadline = time.monotonic() + graph_timeout_s
            elif kind == "graph_point":
                points[payload["index"]]["graph_us"] = payload["graph_us"]
            elif kind == "graph_error":
                graph_note = f"CUDA-graph all-reduce failed: {payload}"
            else:
                finished = True
    finally:
        for process in processes:
            process.join(timeout=10 if finished else 1)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    points.sort(key=lambda p: p["index"])
    for point in points:
        del point["index"]
        if "graph_us" in point:
            point["time_us"], point["timing"] = point["graph_us"], "cuda-graph"
    out: dict[str, Any] = {"world_size": world_size, "backend": backend, "points": points, **(info or {})}
    if graph_note:
        out["graph_note"] = graph_note
    return out
