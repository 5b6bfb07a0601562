"""Always-on recording under ``vllm serve`` (``partition_seconds`` in ``MOETRACE_RECORD``): a complete trace per
period, in Hive-style folders a reader can prune by time, under a disk cap.

    <out>/date=2026-12-04/hour=15/                    hourly (partition_seconds 3600)
    <out>/date=2026-12-04/hour=15/start=153020/       a shorter period: one folder per partition in the hour
    <out>/date=2026-12-04/hour=15-2/                  a second partition in a folder already held (a server
                                                      restarted within the hour, a cap switch): never shared

At the cap, the oldest partitions are deleted (``at_cap`` "drop-oldest") or recording stops and the server serves on
unhooked ("stop"), as the user chose; the partition being written is never deleted. The cap counts the partitions
alone, what it may drop: a file anyone else keeps under the root (a report, notes) is neither counted nor deleted,
and moetrace's own reports of a root are written beside it, not in it.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from collections.abc import Collection
from pathlib import Path

from moetrace.trace.schema import MANIFEST_NAME

HOUR = 3600.0
SUFFIXED = re.compile(r"(.*=[0-9]+)-([0-9]+)")  # a partition folder claimed second in its hour or second


def partition_dir(root: Path, started: float, period: float) -> Path:
    """The folder of the partition that starts at ``started`` (seconds since the epoch, UTC) under ``root``."""
    stamp = time.gmtime(started)
    folder = root / time.strftime("date=%Y-%m-%d", stamp) / time.strftime("hour=%H", stamp)
    return folder if period >= HOUR else folder / time.strftime("start=%H%M%S", stamp)


def new_partition_dir(root: Path, started: float, period: float) -> Path:
    """Create the folder of a partition that starts at ``started`` and return it: ``partition_dir``'s, or where a
    partition already holds that (a server restarted within the hour, a cap switch within the second), the first
    free of its ``-2``, ``-3``, ...: created here, never shared, so no recording writes over another's files."""
    folder = partition_dir(root, started, period)
    claimed, claim = folder, 1
    while True:
        try:
            claimed.mkdir(parents=True)  # atomic: of two recordings asking for one folder, one gets it
            return claimed
        except FileExistsError:
            claim += 1
            claimed = folder.with_name(f"{folder.name}-{claim}")


def partition_order(partition: Path) -> tuple[tuple[str, int], ...]:
    """The key that sorts partitions by their start: folder by folder, ``hour=15`` before ``hour=15-2`` before
    ``hour=15-10`` (each with the number of its claim in its hour or second)."""
    return tuple((m[1], int(m[2])) if (m := SUFFIXED.fullmatch(part)) else (part, 1) for part in partition.parts)


def partitions(root: Path) -> list[Path]:
    """Every partition under ``root`` (a folder ``date=*/hour=*[/...]`` holding a manifest), oldest first. The disk
    cap deletes partitions while others walk the root (its own threads, a user's report): one gone mid-walk is left
    out (``os.walk`` skips a folder it cannot list; ``Path.glob`` raises)."""
    found = []
    for folder, _, files in os.walk(root):
        parts = Path(folder).relative_to(root).parts
        if MANIFEST_NAME in files and len(parts) >= 2 and parts[0].startswith("date=") and parts[1].startswith("hour="):
            found.append(Path(folder))
    return sorted(found, key=partition_order)


def bytes_under(path: Path) -> int:
    """Bytes of the files under ``path``; one deleted while it is walked counts nothing (as ``partitions``)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                found = os.stat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            total += found.st_size if stat.S_ISREG(found.st_mode) else 0
    return total


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
            try:
                if parent == root or any(parent.iterdir()):
                    break
                parent.rmdir()
            except OSError:  # gone, or filled again, under another thread's hands
                break
    return dropped
