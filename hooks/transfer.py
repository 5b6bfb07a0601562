"""A step's rows from the device to the writer process's ring: the columns a step is packed from
(``PackingColumns``), the copy that lands them in the shared ring without blocking (``StepCopier``), and the step as
the engine thread leaves it while that copy is in flight (``PendingStep``)."""

from __future__ import annotations

import ctypes
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from moetrace.hooks.rows import PackedLayout, StepRecord
from moetrace.hooks.vllm_api import StepInputs
from moetrace.writer.ring import RingRows, SharedRows

def int32_column(values: torch.Tensor) -> torch.Tensor:
    """Non-negative values below 2**31 [T] as an int32 column [T, 1]: a view where they are int32 or int64 (its low
    words: little-endian), so packing positions costs no kernel."""
    if values.dtype == torch.int64 and values.is_contiguous():
        return values.view(torch.int32).view(-1, 2)[:, :1]
    return values.to(torch.int32).unsqueeze(1)


class PackingColumns:
    """Which columns a step is packed from, side by side, [N, w] each with the step's T rows first: routing,
    positions, token ids (one int32 block, floats by their bits, so one kernel brings the whole step to the host).
    Where a CUDA graph padded the forward (N > T), the padding rows are packed too and dropped from the host block:
    slicing every column would cost µs per view (some hosts take 3-4 µs a tensor view). A CUDA graph's list is made
    once and reused while the capture hands out the same columns and the runner the same buffers (Model Runner
    V1's persistent ones); otherwise each step gets a list of its own (the capture's may be one it keeps)."""

    def __init__(self, token_ids: bool) -> None:
        self.token_ids = token_ids
        self._kept: dict[Hashable, tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}

    def columns(self, graph: Hashable | None, routing: list[torch.Tensor], inputs: StepInputs, num_tokens: int
                ) -> list[torch.Tensor]:
        """The columns of a step whose routing the capture collected (``routing``, [N, w] each), ``graph`` the CUDA
        graph whose columns they are (None: the forward replayed none, or its routing was not the graph's)."""
        kept = self._kept.get(graph) if graph is not None else None
        if kept is not None and kept[0] is routing and kept[1] is inputs.positions and kept[2] is inputs.input_ids:
            columns = kept[3]
        else:
            rows = routing[0].shape[0]
            padded = routing
            if min(inputs.positions.shape[0], inputs.input_ids.shape[0]) < rows:  # the runner's arrays hold T rows
                padded, rows = [column[:num_tokens] for column in routing], num_tokens
            columns = [*padded, int32_column(inputs.positions[:rows])]
            if self.token_ids:
                columns.append(int32_column(inputs.input_ids[:rows]))
            if graph is not None and padded is routing:  # a list cut to this step's tokens is this step's only
                self._kept[graph] = (routing, inputs.positions, inputs.input_ids, columns)
        if columns[0].shape[0] < num_tokens:
            raise RuntimeError(f"the routers saw {columns[0].shape[0]} rows for the step's {num_tokens} tokens")
        return columns


class StepCopier:
    """Brings each step's columns to the host as one int32 block [T, W], written where the recorder reserved rows
    for it in the ring shared with the writer process (``SharedRows``), without blocking, in as few CUDA calls as
    can be: each one costs the engine thread tens of µs on some hosts (gVisor), paid in full by steps whose host
    work outlasts the GPU's (prefills, PIECEWISE graphs). On CUDA the ring is registered as pinned memory once, at
    load, and, where the GPU can address it at the host's own address (unified addressing), the columns are packed
    (one ``torch.cat``) straight into it: the GPU writes across the bus, one kernel, no copy. Else packed into a
    device buffer allocated once and copied into the ring (``device-copy``), or, where the ring could not be
    registered, copied with a wait (``pageable-copy``: correct, but a host sync per step). Everything runs on vLLM's
    own stream, right after the forward: stream order keeps a later step from overwriting what the pack reads (the
    runner's input buffers, a CUDA graph's outputs, router outputs once freed), and vLLM's own sync after sampling
    covers it (with async scheduling an event after it says when the step is ready). (A stream of its own, with
    events to order it, spared the GPU about 4 µs per step but cost the engine thread about three times the host
    time, measured on an H200.)"""

    def __init__(self, device: torch.device, ring: SharedRows, max_rows: int) -> None:
        self._host = torch.from_numpy(ring.rows)  # [capacity, W] in the memory both processes map
        self._block: torch.Tensor | None = None  # the device buffer packed into before a copy
        self._mapped: torch.Tensor | None = None  # the ring as a CUDA tensor, written by the pack itself
        self._registered = False
        if device.type != "cuda":
            return
        self._registered = register_pinned(self._host)
        self._mapped = mapped_on_device(self._host, device) if self._registered else None
        if self._mapped is None:
            self._block = torch.empty((max_rows, ring.width), dtype=torch.int32, device=device)

    @property
    def path(self) -> str:
        """How steps reach the ring: ``mapped`` (packed straight into it), ``device-copy`` (packed on the device,
        then copied without a wait), ``pageable-copy`` (copied with a wait) or ``host`` (no GPU)."""
        if self._mapped is not None:
            return "mapped"
        return "host" if self._block is None else "device-copy" if self._registered else "pageable-copy"

    def copy(self, columns: list[torch.Tensor], where: RingRows) -> None:
        """``columns`` [N, w_i] side by side into the ring's rows from ``where.offset`` (N rows reserved there)."""
        rows = columns[0].shape[0]
        if self._mapped is not None:
            torch.cat(columns, dim=1, out=self._mapped[where.offset : where.offset + rows])
        elif self._block is None:
            torch.cat(columns, dim=1, out=self._host[where.offset : where.offset + rows])
        else:
            packed = torch.cat(columns, dim=1, out=self._block[:rows])
            self._host[where.offset : where.offset + rows].copy_(packed, non_blocking=self._registered)

    def release(self) -> None:
        """Unregister the ring (once no step can still be written into it): pinned memory is the host's to keep."""
        if self._registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())  # type: ignore[no-untyped-call]
            self._registered = False
        self._mapped = self._block = None


def register_pinned(host: torch.Tensor) -> bool:
    """Page-lock ``host``'s memory for the GPU (``cudaHostRegister``); False where the driver refuses."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    error = cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
    return bool(error == cudart.cudaError.success)


class _CudaArray:
    """A pinned host tensor's memory described as device memory (``__cuda_array_interface__``): under unified
    addressing a pinned host pointer is also a device pointer."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # the view made from this keeps it, and so the memory, alive
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i4", "version": 2,
                                         "data": (host.data_ptr(), False), "strides": None}


def device_pointer(host_pointer: int) -> int | None:
    """Where the GPU addresses registered host memory (the driver's ``cuMemHostGetDevicePointer``), None where
    the driver cannot be asked."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        pointer = ctypes.c_uint64()
        status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(host_pointer), 0)
    except (OSError, AttributeError):
        return None
    return int(pointer.value) if status == 0 else None


def mapped_on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``host`` (registered pinned memory, int32) as a CUDA tensor over the same memory, or None where that is not
    possible here: the GPU must address it at the host's own address (a kernel writing through another address
    would break the CUDA context, so that is asked of the driver first), then checked once, at load, by a kernel
    writing a row and the host reading it back."""
    if torch.version.cuda is None or device_pointer(host.data_ptr()) != host.data_ptr():
        return None
    try:
        mapped = torch.as_tensor(_CudaArray(host), device=device)
        if mapped.data_ptr() != host.data_ptr() or not mapped.is_cuda:
            return None
        row = torch.arange(1, host.shape[1] + 1, dtype=torch.int32, device=device).unsqueeze(0)
        torch.cat([row[:, :1], row[:, 1:]], dim=1, out=mapped[:1])
        torch.cuda.synchronize(device)
        return mapped if torch.equal(host[:1], row.cpu()) else None
    except (RuntimeError, TypeError, ValueError):
        return None


def copied_event() -> torch.cuda.Event:
    """Recorded after a step's device-to-host copies: done once they have landed (no timing: cheaper)."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in fresh pinned host memory, without blocking (PyTorch's caching host allocator
    reuses a block only once the copy into it has completed); host tensors are returned as they are."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass
class PendingStep:
    """One step as the engine thread left it: host arrays copied, device copies in flight. Under async scheduling
    it is ready once the event recorded after the last copy has completed; without an event (sync scheduling, and
    the CPU) it is submitted only once vLLM's ``sample_tokens`` has returned host lists, that is after vLLM synced
    the stream that the copies were queued on."""

    step: int
    t_start: int
    requests: npt.NDArray[np.uint32]  # [R]
    query_start: npt.NDArray[np.int64]  # [R + 1]
    num_prompt_tokens: npt.NDArray[np.int64]  # [R]
    drafts: npt.NDArray[np.int64]  # [R]
    sequence_limit: npt.NDArray[np.int64]  # [R] prompt + max_tokens (0: none given)
    packed: RingRows  # where its [T, W] int32 block (see PackedLayout) lands in the ring shared with the writer
    layout: PackedLayout
    copied: torch.cuda.Event | None = None
    kept: torch.Tensor | list[int] | None = None  # [R] accepted drafts + 1 (host lists, or a copy in flight)
    t_end: int = 0
    new_requests: tuple[str, ...] = ()  # vLLM's ids of the requests first seen in this step, in index order

    def is_ready(self) -> bool:
        return self.copied is None or bool(self.copied.query())  # type: ignore[no-untyped-call]

    def ready(self) -> StepRecord:
        assert self.kept is not None
        if self.copied is not None:
            self.copied.synchronize()
        return StepRecord(self.step, self.t_start, self.t_end, self.requests, self.query_start, self.num_prompt_tokens,
                          self.drafts, np.asarray(self.kept, dtype=np.int64), self.packed, self.layout,
                          self.new_requests, self.sequence_limit)
