"""The report's self-check: the prediction's inputs against the measured tables of the same report."""

from __future__ import annotations

from typing import Any

import polars as pl

CHECK_TOLERANCE = 0.01


def self_check(speedups: pl.DataFrame | None, basis: dict[str, Any] | None, acceptance_per_k: pl.DataFrame,
               unions: pl.DataFrame, step_bytes: pl.DataFrame) -> list[str]:
    """At every recorded k, the prediction's inputs (``speedups`` per batch and k, on ``basis``) against the measured
    tables of the same report: tokens per step (``acceptance_per_k``), unique experts per (batch, k) (``unions``,
    what a step reads) and expert bytes (``step_bytes``, where both price the same shape); a difference over
    ``CHECK_TOLERANCE`` is a warning naming both numbers."""
    if speedups is None or basis is None:
        return []
    found = []
    measured = {int(row["k"]): row for row in acceptance_per_k.to_dicts()}
    read = {(int(row["batch"]), int(row["k"])): row for row in unions.to_dicts()}
    byte_rows = {int(row["k"]): row for row in step_bytes.to_dicts()}

    def compare(what: str, predicted: float, table: str, value: float | None) -> None:
        if value is None:
            return
        if abs(predicted - value) > CHECK_TOLERANCE * max(abs(value), 1e-12):
            found.append(f"self-check: the prediction's {what} is {predicted:.4g}, the {table} measured {value:.4g} "
                         f"({(predicted - value) / value:+.1%})")

    for row in speedups.to_dicts():
        k, batch = int(row["k"]), int(row["batch"])
        if k not in measured:
            continue
        where = f"at k={k}, {batch} request(s)"
        compare(f"tokens per step {where}", row["tokens_per_step"], "acceptance table", measured[k]["tokens_per_step"])
        union = read.get((batch, k))
        if union is not None:
            compare(f"unique experts per layer {where}", row["unique_experts"], "table of what a step reads",
                    union["unique_experts"])
        if batch == 1 and basis["same_shape"] and k in byte_rows:
            compare(f"expert bytes per step {where}", row["expert_weight_bytes"], "bytes table",
                    byte_rows[k]["expert_weight_bytes"])
    return found
