"""Facts about the machine a trace was recorded on (NVML where GPUs exist); no torch, no polars."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def gpu_inventory() -> dict[str, Any]:
    """GPU names and driver version from NVML, or a note saying why there are none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no driver, no library, no GPU: all mean "no GPU telemetry here"
        return {"gpus": [], "driver": None, "note": f"no NVIDIA GPU visible ({type(exc).__name__})"}
    try:
        count = pynvml.nvmlDeviceGetCount()
        names = [str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
        return {"gpus": names, "driver": str(pynvml.nvmlSystemGetDriverVersion()), "note": None}
    finally:
        pynvml.nvmlShutdown()


def host_facts() -> dict[str, Any]:
    """The host's name, architecture, Python, kernel release, CPU model and logical CPUs (a sandbox says what it is
    there: gVisor reports 4.4.0; host-side costs such as CUDA calls differ between runtimes and CPUs, which matters
    to any timing)."""
    return {"hostname": platform.node(), "machine": platform.machine(), "python": platform.python_version(),
            "kernel": platform.release(), "cpu": cpu_model(), "cpus": os.cpu_count()}


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as Linux reports it, else what Python knows (often only the architecture)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
