"""The readable part of a trace's Parquet files: those the contract accepts (intact, of its schema version, with
its columns' types or the variants it allows), and one lazy scan over them."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.trace.schema import FOOTER_SCHEMA_KEY, INPROGRESS_SUFFIX, SCHEMA_VERSION


def scan_files(files: list[Path], schema: pa.Schema) -> pl.LazyFrame:
    """One lazy frame over ``files`` (an empty one of ``schema`` where there are none)."""
    if not files:
        return pl.from_arrow(schema.empty_table()).lazy()  # type: ignore[union-attr]
    if "weights" in schema.names:
        kinds = {pq.read_schema(path).field("weights").type for path in files}
        if len(kinds) > 1:  # float16 and float32 weights (both allowed): read every file's as float32
            width = schema.field("weights").type.list_size
            as_float32 = pl.col("weights").cast(pl.Array(pl.Float32, width))
            return pl.concat([pl.scan_parquet(path, glob=False).with_columns(as_float32) for path in files])
    return pl.scan_parquet(files, glob=False)  # paths are files, not patterns: "[...]" in a path is literal


STILL_OPEN = "file was still open when the recording stopped"


def compatible(wanted: pa.DataType, got: pa.DataType) -> bool:
    """The contract's type, or one of the variants it allows (any string dictionary; float16 or float32
    weights)."""
    if bool(got == wanted):
        return True
    if pa.types.is_dictionary(wanted):
        return bool(pa.types.is_dictionary(got) and pa.types.is_string(got.value_type))
    if pa.types.is_fixed_size_list(wanted) and pa.types.is_fixed_size_list(got):
        floats = (pa.float16(), pa.float32())
        return bool(wanted.list_size == got.list_size and wanted.value_type in floats and got.value_type in floats)
    return False


def file_problem(path: Path, expected: pa.Schema) -> str | None:
    """Why ``path`` cannot be used, or None when it is intact and matches the contract."""
    try:
        schema = pq.read_schema(path)
    except Exception as exc:
        return f"{path}: skipped, corrupt or truncated Parquet ({type(exc).__name__})"
    version = (schema.metadata or {}).get(FOOTER_SCHEMA_KEY)
    if version is not None and version.decode() != SCHEMA_VERSION:
        return f"{path}: skipped, unknown schema version {version.decode()!r}"
    for wanted in expected:
        if wanted.name not in schema.names:
            return f"{path}: skipped, missing column {wanted.name!r}"
        got = schema.field(wanted.name).type
        if not compatible(wanted.type, got):
            return f"{path}: skipped, column {wanted.name!r} is {got}, expected {wanted.type}"
    return None


def table_files(directory: Path, expected: pa.Schema | None, warnings: list[str]) -> list[Path]:
    """The intact Parquet files of one of a trace's tables that match ``expected`` (None: any), in name order; each
    file left out is a line in ``warnings``."""
    if not directory.is_dir():
        return []
    for lost in sorted(directory.glob(f"*{INPROGRESS_SUFFIX}")):
        warnings.append(f"{lost}: skipped, {STILL_OPEN}")
    good = []
    for path in sorted(directory.glob("*.parquet")):
        problem = file_problem(path, expected) if expected is not None else None
        if problem is None:
            good.append(path)
        else:
            warnings.append(problem)
    return good
