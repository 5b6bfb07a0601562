"""NVML telemetry during a recording, on a machine with NVIDIA GPUs (skipped where NVML sees none)."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moetrace.host import gpu_inventory
from moetrace.schema import FOOTER_SCHEMA_KEY, SCHEMA_VERSION, TELEMETRY_SCHEMA
from moetrace.telemetry import TelemetrySampler

GPUS = gpu_inventory()["gpus"]


def test_without_gpus_the_inventory_says_why() -> None:
    inventory = gpu_inventory()
    assert (inventory["note"] is None) == bool(inventory["gpus"])


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
