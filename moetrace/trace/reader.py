"""Trace reader: opens a trace directory (or a parent holding a k sweep) as lazy Polars frames.

Every problem a reader can meet (missing manifest, unknown schema version, truncated or corrupt Parquet, wrong
column types) is either a ``UserError`` with one line naming the file, or, for single damaged files, a warning
naming the file while the intact files are still read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from moetrace.errors import UserError
from moetrace.trace.readable import STILL_OPEN, scan_files, table_files
from moetrace.trace.partitions import partitions
from moetrace.trace.manifest import Manifest
from moetrace.trace.schema import (
    MANIFEST_NAME,
    ROUTING_DIR,
    STEPS_DIR,
    STEPS_SCHEMA,
    TELEMETRY_DIR,
    routing_schema,
)


@dataclass
class Trace:
    """One recording at one k: its manifest and its tables as lazy frames over the intact files."""

    path: Path
    manifest: Manifest
    routing_files: list[Path]
    steps_files: list[Path]
    telemetry_files: list[Path]
    warnings: list[str] = field(default_factory=list)
    ranks: list[Trace] = field(default_factory=list)  # a data-parallel recording: one trace per DP rank
    # an always-on recording: its partitions, oldest first, and where each one's steps and requests start
    parts: list[tuple[Trace, int, int]] = field(default_factory=list)
    # a partition still open: its rows up to this step only (where its closed routing and steps files both reach)
    last_step: int | None = None

    @property
    def k(self) -> int:
        return self.manifest.spec.k

    @property
    def complete(self) -> bool:
        return self.manifest.complete

    def request_ids(self) -> dict[int, str]:
        """vLLM's id of each request index that ``routing()`` and ``steps()`` use (merged indices for DP ranks)."""
        if self.ranks:
            size = len(self.ranks)
            return {request * size + index: rid for index, rank in enumerate(self.ranks)
                    for request, rid in rank.request_ids().items()}
        if self.parts:
            return {first + request: rid
                    for part, _, first in self.parts for request, rid in part.request_ids().items()}
        return dict(enumerate(self.manifest.requests))

    def lacks(self, what: str) -> bool:
        """Whether the trace's source could not know ``what`` (one of ``SOURCE_LACKS``: an imported trace)."""
        return self.manifest.lacks(what)

    @property
    def dp_rank(self) -> int:
        return self.manifest.parallel.dp_rank

    def routing(self) -> pl.LazyFrame:
        """The routing rows, with a ``dp_rank`` column (0 without data parallelism)."""
        if self.ranks:
            return self._merged([rank.routing() for rank in self.ranks])
        if self.parts:
            return self._in_sequence([part.routing() for part, _, _ in self.parts])
        schema = routing_schema(self.manifest.model.top_k, self.manifest.capture.candidates)
        return self._up_to_last_step(scan_files(self.routing_files, schema)).with_columns(
            dp_rank=pl.lit(self.dp_rank, pl.UInt16))

    def steps(self) -> pl.LazyFrame:
        """The steps rows, with a ``dp_rank`` column (0 without data parallelism)."""
        if self.ranks:
            return self._merged([rank.steps() for rank in self.ranks])
        if self.parts:
            return self._in_sequence([part.steps() for part, _, _ in self.parts])
        return self._up_to_last_step(scan_files(self.steps_files, STEPS_SCHEMA)).with_columns(
            dp_rank=pl.lit(self.dp_rank, pl.UInt16))

    def _up_to_last_step(self, frame: pl.LazyFrame) -> pl.LazyFrame:
        return frame if self.last_step is None else frame.filter(pl.col("step") <= self.last_step)

    def _merged(self, frames: list[pl.LazyFrame]) -> pl.LazyFrame:
        """Every DP rank's rows (each with its ``dp_rank``). A rank's steps keep its own numbers (a step is
        ``(dp_rank, step)``); its requests are renumbered apart (request·dp + rank), so a request index is one
        request across the recording."""
        size = len(self.ranks)
        return pl.concat([
            frame.with_columns(request=(pl.col("request").cast(pl.Int64) * size + index).cast(pl.UInt32))
            for index, frame in enumerate(frames)
        ])

    def _in_sequence(self, frames: list[pl.LazyFrame]) -> pl.LazyFrame:
        """Every partition's rows, its steps and requests numbered on after the partition before it's."""
        return pl.concat([numbered_on(frame, first_step, first_request)
                          for frame, (_, first_step, first_request) in zip(frames, self.parts)])

    def telemetry(self) -> pl.LazyFrame | None:
        return pl.scan_parquet(self.telemetry_files, glob=False) if self.telemetry_files else None


def numbered_on(frame: pl.LazyFrame, first_step: int, first_request: int) -> pl.LazyFrame:
    """A partition's routing or steps rows with its steps and requests numbered from ``first_step`` and
    ``first_request`` (where they start in its recording: ``Trace.parts``)."""
    return frame.with_columns(step=(pl.col("step").cast(pl.Int64) + first_step).cast(pl.UInt32),
                              request=(pl.col("request").cast(pl.Int64) + first_request).cast(pl.UInt32))


def unreadable_file(paths: list[Path]) -> str | None:
    """Where a failed read came from: the first Parquet file under these traces whose pages cannot be read (a
    footer can be intact over corrupt pages), as one line; None if every file reads."""
    for path in paths:
        try:
            traces = open_traces(path)
        except UserError:
            continue
        for trace in traces:
            for file in [*trace.routing_files, *trace.steps_files]:
                try:
                    pq.read_table(file)
                except Exception as exc:
                    return f"{file}: unreadable Parquet data ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    return None


def incomplete(directory: Path) -> str:
    """The warning on a trace whose recording neither closed it nor said why it stopped."""
    return f"{directory}: recording incomplete (killed or still running); reading the closed files"


def read_manifest(directory: Path, dp_rank: int | None = None) -> Manifest:
    """The typed manifest of ``directory``; ``dp_rank``: the rank to assume where the manifest does not say (a
    data-parallel rank's folder)."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise UserError(f"{directory}: not a moetrace trace (no {MANIFEST_NAME})")
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(document, dict):
        raise UserError(f"{path}: unreadable manifest (not a JSON object)")
    if dp_rank is not None and isinstance(document.get("parallel"), dict):
        document["parallel"].setdefault("dp_rank", dp_rank)
    try:
        return Manifest.from_document(document)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None


def rank_directories(directory: Path) -> list[Path]:
    """The per-DP-rank traces (``dp0/``, ``dp1/``, …) a data-parallel recording left in ``directory``: each a trace,
    or, recorded always on, a root of partitions."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir()
             if re.fullmatch(r"dp[0-9]+", p.name) and ((p / MANIFEST_NAME).exists() or partitions(p))]
    return sorted(found, key=lambda p: int(p.name[2:]))


def is_trace(directory: Path) -> bool:
    return (directory / MANIFEST_NAME).exists() or bool(rank_directories(directory))


def not_one_recording(traces: list[Trace]) -> tuple[Trace, str] | None:
    """The first of ``traces`` that is not of the first one's recording (another model, drafter or k), and the
    manifest key that differs; None when all are."""
    for trace in traces[1:]:
        differs = first_difference(traces[0].manifest.document, trace.manifest.document,
                                   ("spec.k", "spec.method", *SWEEP_MODEL_KEYS))
        if differs is not None:
            return trace, differs[0]
    return None


def merged_manifest(traces: list[Trace]) -> dict[str, Any]:
    """The first trace's manifest (a copy) with the counts of all, complete when every one is."""
    document: dict[str, Any] = json.loads(json.dumps(traces[0].manifest.document))
    document["complete"] = all(trace.complete for trace in traces)
    counts = [trace.manifest.counts for trace in traces]
    document["counts"] = {key: sum(c.get(key, 0) for c in counts) for key in counts[0]}
    return document


def open_ranks(directory: Path, ranks: list[Path]) -> Trace:
    """One trace over a data-parallel recording's ranks: rank 0's manifest with the counts of all, complete
    when every rank is; the ranks must be one recording (same model, drafter and k; under `vllm serve` each rank
    names its run by its own start time, so run ids may differ by a second). A rank recorded always on is its
    partitions as one trace (``open_partitions``)."""
    traces = [open_rank(rank) for rank in ranks]
    first = traces[0]
    mismatch = not_one_recording(traces)
    if mismatch is not None:
        raise UserError(f"{directory}: DP ranks {first.path.name} and {mismatch[0].path.name} are not one "
                        f"recording ({mismatch[1]} differs)")
    document = merged_manifest(traces)
    document["parallel"]["dp_ranks"] = [t.manifest.parallel.dp_rank for t in traces]
    manifest = Manifest.from_document(document)
    return Trace(path=directory, manifest=manifest,
                 routing_files=[f for t in traces for f in t.routing_files],
                 steps_files=[f for t in traces for f in t.steps_files],
                 telemetry_files=first.telemetry_files,
                 warnings=[w for t in traces for w in t.warnings], ranks=traces)


def open_rank(rank: Path) -> Trace:
    """One data-parallel rank's folder (``dp<r>``): its trace, or, recorded always on, its partitions."""
    dp_rank = int(rank.name[2:])
    if not (rank / MANIFEST_NAME).exists() and (found := partitions(rank)):
        return open_partitions(rank, found, dp_rank)
    return open_trace(rank, dp_rank)


def open_trace(directory: str | os.PathLike[str], dp_rank: int | None = None) -> Trace:
    """Open one trace directory (or a data-parallel recording's, holding one per rank); raises ``UserError`` for
    a directory that is not a readable trace. ``dp_rank``: see ``read_manifest``."""
    directory = Path(directory)
    if not directory.exists():
        raise UserError(f"{directory}: no such trace")
    ranks = rank_directories(directory)
    if ranks and not (directory / MANIFEST_NAME).exists():
        return open_ranks(directory, ranks)
    manifest = read_manifest(directory, dp_rank)
    warnings: list[str] = []
    if manifest.error:
        warnings.append(f"{directory}: recording incomplete, it stopped: {manifest.error}; reading the closed files")
    elif not manifest.complete:
        warnings.append(incomplete(directory))
    return Trace(
        path=directory,
        manifest=manifest,
        routing_files=table_files(directory / ROUTING_DIR,
                                   routing_schema(manifest.model.top_k, manifest.capture.candidates), warnings),
        steps_files=table_files(directory / STEPS_DIR, STEPS_SCHEMA, warnings),
        telemetry_files=table_files(directory / TELEMETRY_DIR, None, warnings),
        warnings=warnings,
    )


def open_partitions(root: Path, found: list[Path], dp_rank: int | None = None) -> Trace:
    """One trace over an always-on recording's partitions ``found`` under ``root``, oldest first: the first one's
    manifest with the counts and requests of all, complete when every one is; each partition's steps and requests
    numbered on after the one before (a request that ran across a boundary is a request in each). A partition whose
    manifest cannot be read is named in the warnings and left out; one of another model, drafter, k or schema
    version is refused, naming it. A partition still open (the one being recorded) is read up to its last step that
    both its closed routing and steps files hold (``open_partition``): its tables agree, and what follows waits for a
    later report. ``dp_rank``: see ``read_manifest``."""
    parts: list[Trace] = []
    warnings: list[str] = []
    for path in found:
        try:
            json.loads((path / MANIFEST_NAME).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            warnings.append(f"{path}: unreadable manifest ({exc}): partition left out")
            continue
        parts.append(open_partition(open_trace(path, dp_rank)))
    if not parts:
        raise UserError(f"{root}: none of its {len(found)} partition(s) is readable")
    first = parts[0]
    mismatch = not_one_recording(parts)
    if mismatch is not None:
        raise UserError(f"{mismatch[0].path}: not a partition of the recording under {root} ({mismatch[1]} differs "
                        f"from {first.path.relative_to(root)})")
    starts: list[tuple[Trace, int, int]] = []
    first_step = first_request = 0
    for part in parts:
        starts.append((part, first_step, first_request))
        last = part.steps().select(pl.col("step").max(), pl.col("request").max()).collect()
        first_step += 0 if last["step"][0] is None else int(last["step"][0]) + 1
        first_request += max(len(part.manifest.requests), 0 if last["request"][0] is None else
                             int(last["request"][0]) + 1)
    document = merged_manifest(parts)
    document["requests"] = [rid for part in parts for rid in part.manifest.requests]
    return Trace(path=root, manifest=Manifest.from_document(document),
                 routing_files=[f for t in parts for f in t.routing_files],
                 steps_files=[f for t in parts for f in t.steps_files],
                 telemetry_files=[f for t in parts for f in t.telemetry_files],
                 warnings=warnings + [w for t in parts for w in t.warnings], parts=starts)


def open_partition(part: Trace) -> Trace:
    """``part`` where its recording closed it or stopped with an error; else (still being written, or killed)
    read up to the last step that its closed routing and its closed steps files both hold (they rotate apart, so one
    may run ahead of the other), said in one line instead of the warnings that its files are open and its manifest
    incomplete. A data-parallel partition: each rank so."""
    if part.ranks:
        ranks = [open_partition(rank) for rank in part.ranks]
        return replace(part, ranks=ranks, warnings=[warning for rank in ranks for warning in rank.warnings])
    if part.complete or part.manifest.error:
        return part

    def last(frame: pl.LazyFrame) -> int:
        value = frame.select(pl.col("step").max()).collect().item()
        return -1 if value is None else int(value)

    routed, stepped = last(part.routing()), last(part.steps())
    cut = min(routed, stepped)
    said = (f"{part.path}: partition still open (being recorded, or its recording was killed): read up to step {cut}, "
            f"where its closed routing (to step {routed}) and steps (to step {stepped}) files both reach")
    other = [warning for warning in part.warnings
             if not warning.endswith(STILL_OPEN) and warning != incomplete(part.path)]
    return replace(part, last_step=cut, warnings=[said, *other])


def is_partition_root(path: Path) -> bool:
    """An always-on recording's root: a folder of partitions, not itself a trace."""
    return path.is_dir() and not is_trace(path) and bool(partitions(path))


def holds_run(directory: Path) -> bool:
    """A trace, or a sweep (a folder holding traces)."""
    return is_trace(directory) or any(is_trace(child) for child in directory.iterdir() if child.is_dir())


def run_path(path: Path) -> Path:
    """``path`` where it is a trace or a sweep; else the one run below it, so the folder given to ``moetrace record
    --out`` (which writes OUT/RUN/k<k>) is enough. A folder of several runs is refused, naming them."""
    if not path.is_dir() or holds_run(path) or partitions(path):  # partitions: an always-on recording's
        return path
    runs = sorted(child for child in path.iterdir() if child.is_dir() and holds_run(child))
    if len(runs) > 1:
        names = ", ".join(run.name for run in runs[:4]) + (", …" if len(runs) > 4 else "")
        raise UserError(f"{path}: holds {len(runs)} runs ({names}): give one of them")
    return runs[0] if runs else path


def open_traces(path: str | os.PathLike[str]) -> list[Trace]:
    """A trace directory, or a parent holding one trace per k (a sweep), ordered by k; or a folder holding one
    such run (``run_path``); or an always-on recording's partitions, as one trace (``open_partitions``)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such trace")
    found = [] if is_trace(path) else partitions(path)
    if found:
        return [open_partitions(path, found)]
    path = run_path(path)
    if is_trace(path):
        return [open_trace(path)]
    children = sorted(p for p in path.iterdir() if is_trace(p)) if path.is_dir() else []
    if not children:
        raise UserError(f"{path}: not a moetrace trace (no {MANIFEST_NAME} here or in its subdirectories)")
    traces = sorted((open_trace(child) for child in children), key=lambda t: t.k)
    check_one_sweep(path, traces)
    return traces


# What every trace of one sweep shares: the same model, and the same drafter wherever k > 0 (k = 0 has none).
SWEEP_MODEL_KEYS = ("model.name", "model.num_experts", "model.top_k", "model.moe_layers")


def check_one_sweep(path: Path, traces: list[Trace]) -> None:
    """A sweep folder holds one run per k; mixed runs are compared by naming each as its own TRACE."""
    for earlier, later in zip(traces, traces[1:]):
        if earlier.k == later.k:
            raise UserError(f"{path}: two traces at k={later.k} ({earlier.path.name}, {later.path.name}); a sweep "
                            "holds one trace per k (give them as separate TRACEs to compare them)")
    speculating = [trace for trace in traces if trace.k > 0]
    for group, keys in ((traces, SWEEP_MODEL_KEYS), (speculating, ("spec.method",))):
        for trace in group[1:]:
            differs = first_difference(group[0].manifest.document, trace.manifest.document, keys)
            if differs is not None:
                key, mine, theirs = differs
                raise UserError(f"{path}: not one sweep: {group[0].path.name} has {key} {mine!r}, "
                                f"{trace.path.name} has {theirs!r} (give them as separate TRACEs to compare them)")


def first_difference(mine: Mapping[str, Any], theirs: Mapping[str, Any],
                     keys: tuple[str, ...]) -> tuple[str, Any, Any] | None:
    """The first of ``keys`` (dotted) two manifest documents disagree on, with both values (None where one lacks
    it); None when they agree."""
    for key in keys:
        a, b = _dotted(mine, key), _dotted(theirs, key)
        if a != b:
            return key, a, b
    return None


def _dotted(document: Mapping[str, Any], key: str) -> Any:
    node: Any = document
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node
