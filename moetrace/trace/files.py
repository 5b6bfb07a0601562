"""One trace directory's files as the writer process writes them: rotated routing and steps Parquet files (a file
being written is ``*.parquet.inprogress``, renamed once closed) and the manifest, rewritten atomically at close;
``StepCapture`` is what one engine step contributes."""

from __future__ import annotations

import dataclasses

import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.trace.manifest import closed_manifest
from moetrace.trace.schema import (
    FOOTER_RUN_KEY,
    FOOTER_SCHEMA_KEY,
    INPROGRESS_SUFFIX,
    ROUTING_DIR,
    SCHEMA_VERSION,
    STEPS_DIR,
    STEPS_SCHEMA,
    TOKEN_PHASES,
    routing_schema,
)

log = logging.getLogger("moetrace")


# How every moetrace Parquet file is encoded (benchmarks write theirs the same way).
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    # Level 1, not 3: files grow 14% on the default model's repetitive routing (0.6% on uniform routing), but the
    # writer thread takes less CPU from an engine that runs on the same cores.
    "compression_level": 1,
    "use_dictionary": ["phase", "step", "request", "draft_pos", "layer"],
    # Expert ids are uint16 stored as INT32: split into byte streams, the two zero bytes and the near-constant
    # third compress away (-2.7 bytes/row on uniform routing). Not for float16 weights: DuckDB cannot read
    # byte-stream-split FIXED_LEN_BYTE_ARRAY.
    "use_byte_stream_split": ["experts.list.element", "cand_experts.list.element"],
    "write_statistics": ["step", "request", "layer", "draft_pos"],
}


def sampled_request(request_id: str, one_in: int) -> bool:
    """Whether a recording of one request in ``one_in`` keeps the routing rows of vLLM's request ``request_id``:
    its id's CRC-32 is a multiple of ``one_in``. The id decides, not the request's index (which each partition
    numbers from 0), so a request running across a partition boundary is kept in both partitions or in neither."""
    return zlib.crc32(request_id.encode()) % one_in == 0


@dataclass
class StepCapture:
    """Everything one engine step contributes to the trace; arrays are host copies owned by the capture.

    T tokens in the step, L recorded MoE layers, K top-k, C candidates, R requests in the step.
    """

    step: int
    request: npt.NDArray[np.uint32]  # [T]
    position: npt.NDArray[np.uint32]  # [T]
    phase: npt.NDArray[np.int8]  # [T] index into TOKEN_PHASES
    draft_pos: npt.NDArray[np.uint8]  # [T]
    token: npt.NDArray[np.uint32] | None  # [T], None when token ids are off
    accepted: npt.NDArray[np.int8]  # [T] 1 accepted, 0 rejected, -1 not a draft
    experts: npt.NDArray[np.uint16]  # [T, L, K]
    weights: npt.NDArray[np.float32]  # [T, L, K]
    cand_experts: npt.NDArray[np.uint16] | None  # [T, L, C]
    cand_scores: npt.NDArray[np.float32] | None  # [T, L, C]
    steps_rows: dict[str, npt.NDArray[Any]]  # one entry per STEPS_SCHEMA column, each [R]
    new_requests: tuple[str, ...] = ()  # vLLM's ids of the requests first seen in this step, in index order
    discarded: tuple[int, int] = (0, 0)  # request-steps and tokens left out: run after their request finished

    PER_TOKEN = ("request", "position", "phase", "draft_pos", "token", "accepted", "experts", "weights",
                 "cand_experts", "cand_scores")

    def of_requests(self, kept: npt.NDArray[np.bool_]) -> StepCapture:
        """The capture with the tokens ``kept`` ([T]) only: its steps rows stay whole."""
        per_token: dict[str, Any] = {name: None if getattr(self, name) is None else getattr(self, name)[kept]
                                     for name in self.PER_TOKEN}
        return dataclasses.replace(self, **per_token)


@dataclass
class RotatingParquet:
    """One table's rotated files: ``<dir>/part-NNNNN.parquet``, with a footer naming the schema and run."""

    directory: Path
    schema: pa.Schema
    run_id: str
    rotate_rows: int
    rotate_seconds: float
    row_group_rows: int
    _writer: pq.ParquetWriter | None = None
    _path: Path | None = None
    _opened_at: float = 0.0
    _rows_in_file: int = 0
    _pending: list[pa.Table] = field(default_factory=list)
    _pending_rows: int = 0
    files_closed: int = 0
    rows_written: int = 0
    bytes_written: int = 0

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        meta = {FOOTER_SCHEMA_KEY: SCHEMA_VERSION.encode(), FOOTER_RUN_KEY: self.run_id.encode()}
        self.schema = self.schema.with_metadata(meta)

    def append(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        if self._pending_rows >= self.row_group_rows:
            self.flush()

    def flush(self) -> None:
        if not self._pending_rows:
            return
        if self._writer is None:
            self._open()
        assert self._writer is not None
        self._writer.write_table(pa.concat_tables(self._pending), row_group_size=self.row_group_rows)
        self._rows_in_file += self._pending_rows
        self._pending.clear()
        self._pending_rows = 0

    def maybe_rotate(self) -> None:
        too_old = time.monotonic() - self._opened_at >= self.rotate_seconds
        if self._writer is not None or self._pending_rows:
            if self._rows_in_file + self._pending_rows >= self.rotate_rows or too_old:
                self.close_file()

    def close_file(self) -> None:
        self.flush()
        if self._writer is None or self._path is None:
            return
        self._writer.close()
        final = self._path.with_name(self._path.name.removesuffix(INPROGRESS_SUFFIX))
        os.replace(self._path, final)
        self.files_closed += 1
        self.rows_written += self._rows_in_file
        self.bytes_written += final.stat().st_size
        self._writer, self._path, self._rows_in_file = None, None, 0

    def _open(self) -> None:
        self._path = self.directory / f"part-{self.files_closed:05d}.parquet{INPROGRESS_SUFFIX}"
        self._writer = pq.ParquetWriter(self._path, self.schema, **PARQUET_OPTIONS)
        self._opened_at = time.monotonic()


class Assemblable(Protocol):
    """A step whose rows are assembled in the writer process, from rows it may have left in the shared ring."""

    def take_rows(self, ring: Any) -> None: ...

    def assemble(self) -> StepCapture: ...


class TraceFiles:
    """The writer process's side: one trace directory's manifest and rotated routing/steps files."""

    def __init__(self, root: Path, manifest: dict[str, Any], moe_layers: list[int], top_k: int, candidates: int,
                 rotate_rows: int, rotate_seconds: float, row_group_rows: int, write_every_seconds: float) -> None:
        self.root = root
        self.manifest = manifest
        self.layers = np.asarray(moe_layers, dtype=np.uint16)
        self.top_k = top_k
        self.candidates = candidates
        self.write_every_seconds = write_every_seconds
        run_id = str(manifest.get("run_id", root.name))
        self._routing = RotatingParquet(
            root / ROUTING_DIR, routing_schema(top_k, candidates), run_id, rotate_rows, rotate_seconds, row_group_rows
        )
        self._steps = RotatingParquet(
            root / STEPS_DIR, STEPS_SCHEMA, run_id, rotate_rows, rotate_seconds, row_group_rows
        )
        self.failed: str | None = None
        self.steps = 0
        self.tokens = 0
        self.drafts = 0
        self.accepted = 0
        self.discarded_request_steps = 0
        self.discarded_tokens = 0
        # vLLM's id of every request index (the manifest's ``requests``): kept here, in the writer process, so that
        # the engine side holds only the requests still running
        self.requests: list[str] = list(manifest.get("requests") or [])
        # sampled by request (``capture.sampled.one_request_in``): routing rows of the requests ``sampled_request``
        # keeps, decided once per request index (only where sampled)
        self.one_request_in = int(((manifest.get("capture") or {}).get("sampled") or {}).get("one_request_in", 1))
        self.kept: list[bool] = []

    def write(self, items: list[StepCapture | Assemblable]) -> list[StepCapture]:
        """Write the steps ``items`` hold; returns them as written."""
        captures = [item if isinstance(item, StepCapture) else item.assemble() for item in items]
        if not captures:
            return captures
        for cap in captures:  # first: every request index these steps use has its id
            self.requests.extend(cap.new_requests)
        routed = captures
        if self.one_request_in > 1:
            self.kept.extend(sampled_request(rid, self.one_request_in) for rid in self.requests[len(self.kept):])
            kept = np.asarray(self.kept, dtype=np.bool_)  # [requests so far]
            routed = [capture.of_requests(kept[capture.request]) for capture in captures]
        self._routing.append(self.routing_table(routed))
        steps = {name: np.concatenate([c.steps_rows[name] for c in captures]) for name in STEPS_SCHEMA.names}
        self._steps.append(pa.Table.from_pydict(steps, schema=self._steps.schema))
        for cap in captures:
            self.steps += 1
            self.tokens += len(cap.request)
            self.drafts += int((cap.accepted >= 0).sum())
            self.accepted += int((cap.accepted == 1).sum())
            self.discarded_request_steps += cap.discarded[0]
            self.discarded_tokens += cap.discarded[1]
        return captures

    def maybe_rotate(self) -> None:
        self._routing.maybe_rotate()
        self._steps.maybe_rotate()

    def close(self, extra: dict[str, Any], error: str | None) -> dict[str, Any]:
        """Rename the open files and rewrite the manifest: complete unless recording failed."""
        for table in (self._routing, self._steps):
            try:
                table.close_file()
            except Exception as exc:  # a full disk at close still leaves the manifest saying what happened
                self.failed = self.failed or f"{type(exc).__name__}: {exc}"
        error = error or self.failed
        try:
            self.manifest = closed_manifest(self.root, self.manifest, counts=self.counts(), requests=self.requests,
                                            error=error, **extra)
        except OSError as exc:
            log.warning("moetrace: could not finalise the manifest: %s", exc)
        return self.manifest

    def counts(self) -> dict[str, int]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "drafts": self.drafts,
            "accepted": self.accepted,
            "routing_rows": self._routing.rows_written,
            "routing_files": self._routing.files_closed,
            "routing_bytes": self._routing.bytes_written,
            "steps_rows": self._steps.rows_written,
            # request-steps (and their tokens) vLLM ran for a request already finished, and dropped: left out
            "discarded_request_steps": self.discarded_request_steps,
            "discarded_tokens": self.discarded_tokens,
        }

    def routing_table(self, captures: list[StepCapture]) -> pa.Table:
        """Expand per-token arrays to one row per (token, layer), token-major so per-token columns run-length
        encode."""

        def joined(name: str) -> npt.NDArray[Any]:
            return np.concatenate([getattr(c, name) for c in captures])

        experts, weights = joined("experts"), joined("weights")
        num_tokens, num_layers = experts.shape[:2]
        # Routers may return top-k unsorted (torch.topk(sorted=False)); the contract orders by weight.
        order = np.argsort(-weights, axis=-1, kind="stable")
        experts = np.take_along_axis(experts, order, axis=-1)
        weights = np.take_along_axis(weights, order, axis=-1)

        def per_row(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return np.repeat(values, num_layers)

        def fixed_list(values: npt.NDArray[Any], width: int, arrow_type: pa.DataType) -> pa.Array:
            flat = pa.array(values.reshape(-1), type=arrow_type)
            return pa.FixedSizeListArray.from_arrays(flat, width)

        step = np.concatenate([np.full(len(c.request), c.step, dtype=np.uint32) for c in captures])
        phase = pa.DictionaryArray.from_arrays(
            pa.array(per_row(joined("phase")), type=pa.int8()), pa.array(TOKEN_PHASES, type=pa.string())
        )
        accepted = per_row(joined("accepted"))
        with_tokens = all(c.token is not None for c in captures)
        columns: dict[str, pa.Array] = {
            "step": pa.array(per_row(step)),
            "request": pa.array(per_row(joined("request"))),
            "position": pa.array(per_row(joined("position"))),
            "phase": phase,
            "draft_pos": pa.array(per_row(joined("draft_pos"))),
            "token": (pa.array(per_row(joined("token"))) if with_tokens
                      else pa.nulls(num_tokens * num_layers, pa.uint32())),
            "accepted": pa.array(accepted == 1, mask=accepted < 0),
            "layer": pa.array(np.tile(self.layers[:num_layers], num_tokens)),
            "experts": fixed_list(experts, self.top_k, pa.uint16()),
            "weights": fixed_list(weights.astype(np.float16), self.top_k, pa.float16()),
        }
        if self.candidates and all(c.cand_experts is not None for c in captures):
            columns["cand_experts"] = fixed_list(joined("cand_experts"), self.candidates, pa.uint16())
            columns["cand_scores"] = fixed_list(joined("cand_scores"), self.candidates, pa.float32())
        return pa.Table.from_pydict(columns, schema=self._routing.schema)
