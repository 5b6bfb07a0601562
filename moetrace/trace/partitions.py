"""Always-on recording under ``vllm serve`` (``partition_seconds`` in ``MOETRACE_RECORD``): a complete trace per
period, in Hive-style folders a reader can prune by time, under a disk cap.

    <out>/date=2026-12-04/hour=15/                    hourly (partition_seconds 3600)
    <out>/date=2026-12-04/hour=15/start=153020/       a shorter period: one folder per partition in the hour

At the cap, the oldest partitions are deleted (``at_cap`` "drop-oldest") or recording stops and the server serves on
unhooked ("stop"), as the user chose; the partition being written is never deleted. The cap counts the partitions
alone, what it may drop: a file anyone else keeps under the root (a report, notes) is neither counted nor deleted,
and moetrace's own reports of a root are written beside it, not in it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Collection
from pathlib import Path

from moetrace.trace.schema import MANIFEST_NAME

HOUR = 3600.0


def partition_dir(root: Path, started: float, period: float) -> Path:
    """The folder of the partition that starts at ``started`` (seconds since the epoch, UTC) under ``root``."""
    stamp = time.gmtime(started)
    folder = root / time.strftime("date=%Y-%m-%d", stamp) / time.strftime("hour=%H", stamp)
    return folder if period >= HOUR else folder / time.strftime("start=%H%M%S", stamp)


def partitions(root: Path) -> list[Path]:
    """Every partition under ``root`` (a folder holding a manifest), oldest first."""
    return sorted(manifest.parent for manifest in root.glob(f"date=*/hour=*/**/{MANIFEST_NAME}"))


def bytes_under(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def partition_bytes(root: Path) -> int:
    """Bytes the partitions under ``root`` hold: what the disk cap counts."""
    return sum(bytes_under(partition) for partition in partitions(root))


def over_cap(root: Path, cap: int) -> bool:
    return partition_bytes(root) > cap


def drop_oldest(root: Path, cap: int, keep: Collection[Path]) -> list[Path]:
    """Delete the oldest partitions under ``root`` until it holds at most ``cap`` bytes, never one of ``keep`` (the
    one being written, those still closing); returns those deleted, oldest first. Emptied date and hour folders go
    with them."""
    dropped = []
    sizes = {partition: bytes_under(partition) for partition in partitions(root)}  # walked once
    held = sum(sizes.values())  # less each partition as it goes
    for partition, size in sizes.items():
        if held <= cap:
            break
        if any(path == partition or path.is_relative_to(partition) for path in keep):
            continue
        held -= size
        shutil.rmtree(partition, ignore_errors=True)
        dropped.append(partition)
        for parent in partition.parents:  # hour=, then date= folders left empty
            if parent == root or any(parent.iterdir()):
                break
            parent.rmdir()
    return dropped
