"""NVML telemetry sampled during a recording into ``telemetry/part-*.parquet`` (only where GPUs exist)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.trace.schema import FOOTER_SCHEMA_KEY, SCHEMA_VERSION, TELEMETRY_DIR, TELEMETRY_SCHEMA


def _sample_gpu(pynvml: Any, index: int, handle: Any, t_ns: int) -> dict[str, Any]:
    def read(fn: Any, *args: Any) -> Any:
        try:
            return fn(handle, *args)
        except pynvml.NVMLError:  # counters a GPU or driver lacks stay null
            return None

    util = read(pynvml.nvmlDeviceGetUtilizationRates)
    memory = read(pynvml.nvmlDeviceGetMemoryInfo)
    nvlink_tx = nvlink_rx = None
    counters = read(
        pynvml.nvmlDeviceGetFieldValues,
        [pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX],
    )
    if counters is not None and all(c.nvmlReturn == 0 for c in counters):
        nvlink_tx, nvlink_rx = int(counters[0].value.ullVal), int(counters[1].value.ullVal)
    return {
        "t_ns": t_ns,
        "gpu": index,
        "util_gpu_pct": util.gpu if util is not None else None,
        "util_mem_pct": util.memory if util is not None else None,
        "power_mw": read(pynvml.nvmlDeviceGetPowerUsage),
        "mem_used_bytes": memory.used if memory is not None else None,
        "pcie_tx_kbps": read(pynvml.nvmlDeviceGetPcieThroughput, pynvml.NVML_PCIE_UTIL_TX_BYTES),
        "pcie_rx_kbps": read(pynvml.nvmlDeviceGetPcieThroughput, pynvml.NVML_PCIE_UTIL_RX_BYTES),
        "nvlink_tx_kib": nvlink_tx,
        "nvlink_rx_kib": nvlink_rx,
    }


class TelemetrySampler:
    """Samples every GPU every ``interval`` seconds on a thread; ``stop`` writes the Parquet file."""

    def __init__(self, trace_dir: Path, interval: float = 0.2) -> None:
        self.path = trace_dir / TELEMETRY_DIR / "part-00000.parquet"
        self.interval = interval
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moetrace-telemetry", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            while not self._stop.wait(self.interval):
                now = time.time_ns()
                self.rows.extend(_sample_gpu(pynvml, i, h, now) for i, h in enumerate(handles))
        finally:
            pynvml.nvmlShutdown()

    def stop(self) -> int:
        """Stop sampling and write what was sampled; returns the number of samples."""
        self._stop.set()
        self._thread.join()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        schema = TELEMETRY_SCHEMA.with_metadata({FOOTER_SCHEMA_KEY: SCHEMA_VERSION.encode()})
        pq.write_table(pa.Table.from_pylist(self.rows, schema=schema), self.path, compression="zstd")
        return len(self.rows)
