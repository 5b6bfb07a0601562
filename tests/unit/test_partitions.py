"""Always-on recording's partitions (``moetrace.trace.partitions``): Hive-style folders by UTC time, and the
disk cap that drops the oldest, never the one being written."""

from __future__ import annotations

import calendar
from pathlib import Path

from moetrace.hooks.options import RecordingOptions
from moetrace.hooks.partitioning import Partitions
from moetrace.trace.partitions import bytes_under, drop_oldest, over_cap, partition_dir, partitions

AFTERNOON = calendar.timegm((2026, 12, 4, 15, 30, 20, 0, 0, 0))  # 2026-12-04 15:30:20 UTC


def test_a_partition_folder_is_its_utc_date_and_hour_and_its_start_below_an_hour() -> None:
    root = Path("/data/prod")
    assert partition_dir(root, AFTERNOON, 3600) == root / "date=2026-12-04" / "hour=15"
    assert partition_dir(root, AFTERNOON, 60) == root / "date=2026-12-04" / "hour=15" / "start=153020"


def test_a_partition_starting_where_another_holds_its_folder_gets_one_of_its_own_in_start_order(
        tmp_path: Path) -> None:
    """Seen under `vllm serve` at a 64 KiB cap: a partition switched to by the cap in the second the last one
    started wrote into the same folder, and one partition's files replaced the other's; a server restarted within
    the hour would do the same to hourly partitions. Each partition claims a folder no other holds."""
    for period, folder in ((60, tmp_path / "date=2026-12-04" / "hour=15" / "start=153020"),
                           (3600, tmp_path / "date=2026-12-04" / "hour=15")):
        options = RecordingOptions(out=str(tmp_path / str(period)), partition_seconds=period, disk_cap_bytes=1)
        claimed = []
        for restart in range(11):  # 11 recordings (a crash loop) starting within 0.5 s, in one folder's second
            recording = Partitions(options)
            partition = Path(recording.options_for(options, now=AFTERNOON + restart / 20).out)
            assert recording.writing == partition and partition.is_dir() and not any(partition.iterdir())
            (partition / "manifest.json").write_text(str(restart))
            claimed.append(partition)
        expected = tmp_path / str(period) / folder.relative_to(tmp_path)
        assert claimed == [expected] + [expected.with_name(f"{expected.name}-{n}") for n in range(2, 12)]
        assert partitions(tmp_path / str(period)) == claimed  # oldest first: -2 ... -9 before -10 and -11
        assert not recording.due(AFTERNOON + 1)
        recording.cap_reached.set()  # the cap switches at once: the next partition claims a folder of its own
        assert recording.due(AFTERNOON + 1)


def write_partition(folder: Path, size: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    (folder / "routing.bin").write_bytes(b"x" * size)
    return folder


def test_at_the_cap_the_oldest_partitions_go_first_and_never_the_one_being_written(tmp_path: Path) -> None:
    old = write_partition(tmp_path / "date=2026-12-03" / "hour=23", 1000)
    middle = write_partition(tmp_path / "date=2026-12-04" / "hour=00", 1000)
    newest = write_partition(tmp_path / "date=2026-12-04" / "hour=01", 1000)
    assert partitions(tmp_path) == [old, middle, newest]
    dropped = drop_oldest(tmp_path, 2100, keep=[newest])
    assert dropped == [old] and not (tmp_path / "date=2026-12-03").exists()  # its emptied date folder too
    assert bytes_under(tmp_path) <= 2100
    # a cap below what the one being written holds: everything else goes, that one stays
    assert drop_oldest(tmp_path, 10, keep=[newest]) == [middle] and partitions(tmp_path) == [newest]


def test_the_cap_counts_and_drops_partitions_only_never_a_file_kept_beside_them_under_the_root(
        tmp_path: Path) -> None:
    old = write_partition(tmp_path / "date=2026-12-03" / "hour=23", 1000)
    newest = write_partition(tmp_path / "date=2026-12-04" / "hour=00", 1000)
    report = tmp_path / "report.html"  # a report someone wrote into the root: 5 MB that the cap may not drop
    report.write_bytes(b"x" * 5_000_000)
    held = sum(bytes_under(partition) for partition in (old, newest))  # 2 x (1000 bytes + the manifest's 2)
    assert held == 2004 and not over_cap(tmp_path, held) and over_cap(tmp_path, held - 1)
    assert drop_oldest(tmp_path, held, keep=[newest]) == [] and partitions(tmp_path) == [old, newest]
    assert drop_oldest(tmp_path, held - 1, keep=[newest]) == [old] and report.stat().st_size == 5_000_000


def test_partitions_deleted_while_the_root_is_walked_are_left_out_not_an_error(tmp_path: Path) -> None:
    """The disk cap deletes partitions on a thread of the recording (or in the server, while a user reports on the
    root): a walk that meets a folder gone under it counts what is still there. Checked by deleting and
    re-creating partitions as fast as possible while other walks run."""
    import shutil
    import threading

    root = tmp_path / "root"
    folders = [root / "date=2026-12-06" / "hour=15" / f"start=1500{i:02d}" for i in range(40)]
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for folder in folders:
                (folder / "routing").mkdir(parents=True, exist_ok=True)
                (folder / "routing" / "part.parquet").write_bytes(b"x" * 64)
                (folder / "manifest.json").write_text("{}")
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)

    walker = threading.Thread(target=churn)
    walker.start()
    try:
        for _ in range(400):
            found = partitions(root)
            assert all(path in folders for path in found) and found == sorted(found)
            assert bytes_under(root) >= 0
    finally:
        stop.set()
        walker.join()
    for folder in folders[:3]:  # once still, every partition is found and counted
        (folder / "routing").mkdir(parents=True)
        (folder / "routing" / "part.parquet").write_bytes(b"x" * 64)
        (folder / "manifest.json").write_text("{}")
    assert partitions(root) == folders[:3] and bytes_under(root) == 3 * (64 + 2)
