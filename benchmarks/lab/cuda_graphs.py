"""CUDA graphs whose nodes can be counted by type: what each capture variant of ``bench_capture_gpu.py`` adds to a
graph, read through the CUDA runtime."""

from __future__ import annotations

import torch


def new_graph() -> torch.cuda.CUDAGraph:
    """A graph that keeps its cudaGraph_t after instantiation, so that its nodes can be counted."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return torch.cuda.CUDAGraph()


def graph_nodes(graph: torch.cuda.CUDAGraph) -> dict[str, int] | str:
    """Nodes of a captured graph by type (cudaGraphGetNodes / cudaGraphNodeGetType through the CUDA runtime)."""
    import ctypes

    try:
        raw = ctypes.c_void_p(graph.raw_cuda_graph())
        import glob
        import os

        lib = None
        torch_dir = os.path.dirname(torch.__file__)
        found = sorted(glob.glob(os.path.join(torch_dir, "..", "nvidia", "**", "libcudart.so*"), recursive=True))
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so", *found):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            return "no libcudart"
        count = ctypes.c_size_t(0)
        if lib.cudaGraphGetNodes(raw, None, ctypes.byref(count)) != 0:
            return "cudaGraphGetNodes failed"
        nodes = (ctypes.c_void_p * count.value)()
        if lib.cudaGraphGetNodes(raw, nodes, ctypes.byref(count)) != 0:
            return "cudaGraphGetNodes failed"
        names = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty"}
        kinds: dict[str, int] = {}
        for node in nodes:
            kind = ctypes.c_int(-1)
            lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
            key = names.get(kind.value, f"type{kind.value}")
            kinds[key] = kinds.get(key, 0) + 1
        return kinds
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"{type(exc).__name__}: {exc}"
