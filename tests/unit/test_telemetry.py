"""Host facts (CPU model), and NVML telemetry during a recording on a machine with NVIDIA GPUs (skipped where NVML
sees none)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moetrace.hooks.host import cpu_model, gpu_inventory
from moetrace.trace.schema import FOOTER_SCHEMA_KEY, SCHEMA_VERSION, TELEMETRY_SCHEMA
from moetrace.recording.telemetry import TelemetrySampler

GPUS = gpu_inventory()["gpus"]


def gpus_the_driver_lists() -> int:
    """GPUs as the driver's own tool lists them (``nvidia-smi -L``), else 0 where it is not installed."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    listed = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=60)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def test_the_inventory_lists_the_gpus_the_driver_lists_else_says_why() -> None:
    inventory = gpu_inventory()
    assert len(inventory["gpus"]) == gpus_the_driver_lists()
    if inventory["gpus"]:
        assert inventory["note"] is None and inventory["driver"]
    else:
        assert inventory["note"].startswith("no NVIDIA GPU visible (") and inventory["driver"] is None


def test_the_cpu_model_is_read_from_cpuinfo_else_from_python(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n\n"
                       "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\n")
    assert cpu_model(cpuinfo) == "Intel(R) Xeon(R) Processor"
    fallback = cpu_model(tmp_path / "absent")
    assert fallback and fallback != "Intel(R) Xeon(R) Processor"  # the architecture at least, never empty


@pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible to NVML")
def test_sampler_writes_one_row_per_gpu_per_interval(tmp_path: Path) -> None:
    sampler = TelemetrySampler(tmp_path, interval=0.05)
    sampler.start()
    time.sleep(1.0)
    samples = sampler.stop()
    table = pq.read_table(sampler.path)
    assert table.schema.metadata[FOOTER_SCHEMA_KEY] == SCHEMA_VERSION.encode()
    assert table.schema.remove_metadata() == TELEMETRY_SCHEMA
    assert samples == table.num_rows >= 5 * len(GPUS)
    assert sorted(set(table.column("gpu").to_pylist())) == list(range(len(GPUS)))
    assert min(table.column("power_mw").to_pylist()) > 0
    assert min(table.column("mem_used_bytes").to_pylist()) > 0
