"""``moetrace report --ray``: an always-on recording's partitions summarised as Ray tasks, one per partition
(``analysis.routing_summary``: what the report reads from routing rows, in parts that add up), each summary cached
beside the root (``ROOT.report-cache/<partition>/<key>/``, one summary per partition, gone with its partition) so
that a later report over the same partitions reads it instead of the rows. Not in the root: a live recording's disk
cap counts only its partitions, and a cache there would be neither counted nor dropped. Ray is imported only here,
only when --ray is given: the one-machine report never needs it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moetrace.analysis.budgets import block_sampled, step_sampled
from moetrace.analysis.routing_summary import (SUMMARY_TABLES, RoutingSummary, SummaryRequest, added_summaries,
                                               summarise_routing)
from moetrace.errors import UserError
from moetrace.trace.reader import Trace, numbered_on

CACHE_DIR = "report-cache"
# Bumped whenever what a summary holds or how it is computed changes: a cache of another format is never read.
SUMMARY_FORMAT = 2  # 2: the drafter's proposal lengths (``proposals``)
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PartitionResult:
    """One partition's summary, whether it came from the partition's cache, and what computing it took on the
    worker (seconds, and the worker process's peak resident memory so far)."""

    summary: RoutingSummary
    cached: bool
    rows: int
    seconds: float
    peak_rss_bytes: int


def cache_key(part: Trace, first_step: int, first_request: int, request: SummaryRequest) -> str:
    """What a partition's summary depends on, hashed: its files (name, size, modification time), where its steps
    and requests start in the recording, and the request, except the sample's share (a cached sample serves every
    smaller share: ``cached_summary``)."""
    files = [(str(path.relative_to(part.path)), stat.st_size, stat.st_mtime_ns)
             for path in [*part.routing_files, *part.steps_files] for stat in (path.stat(),)]
    described = {
        "format": SUMMARY_FORMAT, "polars": pl.__version__, "files": files, "first_step": first_step,
        "first_request": first_request, "num_experts": request.num_experts, "ks": list(request.ks),
        "trace_k": request.trace_k, "expert_rank": request.expert_rank.tolist(),
        "sample_columns": list(request.sample_columns),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def cached_summary(folder: Path, share: float) -> RoutingSummary | None:
    """The summary cached in ``folder`` with its sample thinned to ``share``; None where there is none, it cannot
    be read, or it sampled less than ``share``."""
    try:
        cached_share = float(json.loads((folder / "share.json").read_text())["share"])
        if cached_share < share:
            return None
        tables = {name: pl.read_ipc(folder / f"{name}.arrow") for name in SUMMARY_TABLES}
    except (OSError, ValueError, KeyError, TypeError, pl.exceptions.PolarsError):
        return None
    if share < cached_share:  # the hash that kept a row at the cached share decides it at this one
        tables["accepted"] = tables["accepted"].filter(block_sampled(share))
        tables["stepped"] = tables["stepped"].filter(step_sampled(share))
    return RoutingSummary(**tables)


def write_cache(folder: Path, summary: RoutingSummary, share: float) -> None:
    """``summary`` into ``folder`` (written beside it, then renamed: a reader never sees half a cache); a partition
    that cannot be written to (read-only, full disk) is simply not cached."""
    staging = folder.parent / f".staging-{uuid.uuid4().hex}"
    try:
        staging.mkdir(parents=True)
        for name in SUMMARY_TABLES:
            getattr(summary, name).write_ipc(staging / f"{name}.arrow")
        (staging / "share.json").write_text(json.dumps({"share": share}))
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def cache_root(root: Path) -> Path:
    """The folder beside ``root`` that caches its partitions' summaries."""
    root = root.resolve()
    return root.parent / f"{root.name}.{CACHE_DIR}"


def partition_cache(root: Path, partition: Path) -> Path:
    """Where the summary of ``partition`` (a folder under ``root``) is cached."""
    return cache_root(root) / partition.resolve().relative_to(root.resolve())


def prune_cache(root: Path, partitions: list[Path]) -> None:
    """Drop the cached summaries of partitions no longer under ``root`` (the disk cap dropped them): the cache holds
    at most one summary per partition the root holds."""
    kept = {partition_cache(root, partition) for partition in partitions}
    for share in sorted(cache_root(root).glob("**/share.json")):
        folder = share.parent.parent  # <partition>/<key>/share.json
        if folder not in kept:
            shutil.rmtree(folder, ignore_errors=True)


def partition_summary(part: Trace, first_step: int, first_request: int, request: SummaryRequest, cache: Path
                      ) -> PartitionResult:
    """One partition's summary, its steps and requests numbered as in the whole recording: from ``cache`` (its
    ``partition_cache``) where a summary there serves, else from its rows (then cached in place of any other, where
    the partition is complete)."""
    started = time.perf_counter()
    folder = cache / cache_key(part, first_step, first_request, request)
    summary = cached_summary(folder, request.share)
    cached = summary is not None
    rows = 0
    if summary is None:
        summary, _ = summarise_routing(numbered_on(part.routing(), first_step, first_request),
                                       numbered_on(part.steps(), first_step, first_request), request)
        rows = int(summary.load["picks"].sum()) // part.manifest.model.top_k  # every non-prefill row's picks
        if part.complete:
            write_cache(folder, summary, request.share)
            for other in cache.iterdir() if folder.exists() else ():
                if other != folder:
                    shutil.rmtree(other, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return PartitionResult(summary, cached, rows, time.perf_counter() - started, peak)


def check_address(address: str) -> None:
    """A Ray address other than auto and local answers on its port within ``CONNECT_TIMEOUT_S``, or a one-line
    error (``ray.init`` itself may wait minutes for a host that never answers)."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--ray {address}: give auto, local or HOST:PORT (e.g. 10.0.0.5:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise UserError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc})") from None


def connected_ray(address: str) -> Any:
    """The ``ray`` module, connected to ``address``: a running cluster (HOST:PORT, or auto: the one this machine
    belongs to) or a new one on this machine's cores (local). A driver already connected stays so."""
    try:
        import ray
    except ImportError:
        raise UserError(f"--ray {address}: Ray is not installed here (pip install 'ray>=2.40')") from None
    if ray.is_initialized():
        return ray
    check_address(address)
    quiet: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
    try:
        if address == "local":
            ray.init(num_cpus=os.cpu_count(), **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--ray {address}: cannot connect ({first_line})") from None
    return ray


def summarised_partitions(trace: Trace, request: SummaryRequest, address: str) -> list[PartitionResult]:
    """Every partition of ``trace`` (an always-on recording) summarised as one Ray task each, in order."""
    ray = connected_ray(address)
    task = ray.remote(num_cpus=1, max_retries=0)(partition_summary)
    shared = ray.put(request)
    prune_cache(trace.path, [part.path for part, _, _ in trace.parts])
    pending = {task.remote(part, first_step, first_request, shared, partition_cache(trace.path, part.path)): index
               for index, (part, first_step, first_request) in enumerate(trace.parts)}
    results: dict[int, PartitionResult] = {}
    columns = (TextColumn("partitions on Ray"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        progress = bar.add_task("", total=len(pending))
        waiting = list(pending)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            index = pending[done[0]]
            try:
                results[index] = ray.get(done[0])
            except ray.exceptions.RayError as exc:
                cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                raise UserError(f"{trace.parts[index][0].path}: summary failed on Ray ({cause})") from None
            bar.advance(progress)
    return [results[index] for index in range(len(trace.parts))]


def partitioned_summary(trace: Trace, request: SummaryRequest, address: str) -> RoutingSummary:
    """The routing summary of an always-on recording, its partitions summarised on Ray (``summarised_partitions``)
    and added; a line on stderr says how many came from their cache."""
    results = summarised_partitions(trace, request, address)
    reused = sum(result.cached for result in results)
    Console(stderr=True).print(f"{len(results)} partitions summarised on Ray ({reused} from their cache)",
                               markup=False, highlight=False)
    return added_summaries([result.summary for result in results])
