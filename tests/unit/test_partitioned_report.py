"""`moetrace report` over an always-on recording's partitions (``trace.reader.open_partitions``): one trace whose
report equals that of the same rows recorded as one trace; bad partitions named."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from moetrace.cli import main
from moetrace.errors import UserError
from moetrace.trace.reader import open_traces
from trace_builder import Model, Tokens, verify_tokens, write_trace

MODEL = Model(num_experts=32, top_k=2)
HOUR_15, HOUR_16 = "date=2026-12-04/hour=15", "date=2026-12-04/hour=16"


def two_partitions(rng_seed: int = 0) -> tuple[Tokens, Tokens]:
    rng = np.random.default_rng(rng_seed)
    return (verify_tokens(rng, MODEL, requests=4, steps=20, k=2, accept_prob=0.6, variable_drafts=True),
            verify_tokens(rng, MODEL, requests=3, steps=15, k=2, accept_prob=0.6, variable_drafts=True))


def shifted(tokens: Tokens, steps: int, requests: int) -> Tokens:
    return replace(tokens, step=tokens.step + steps, request=tokens.request + requests)


def joined(first: Tokens, second: Tokens) -> Tokens:
    """The two as one recording: the second's steps and requests numbered on after the first's."""
    later = shifted(second, int(first.step.max()) + 1, int(first.request.max()) + 1)
    return Tokens(**{name: (np.concatenate([getattr(first, name), getattr(later, name)])
                            if isinstance(getattr(first, name), np.ndarray) else
                            None if getattr(first, name) is None else getattr(first, name) + getattr(later, name))
                     for name in Tokens.__dataclass_fields__})


def write_partition(root: Path, tokens: Tokens, clock_from_step: int) -> Path:
    """A partition numbers its steps from 0 while the host's clock runs on: its step times start where the partition
    before it ended (the builder times step s at s ms)."""
    written = write_trace(root, tokens, MODEL, k=2)
    for file in (written / "steps").glob("*.parquet"):
        table = pq.read_table(file)
        for column in ("t_start_ns", "t_end_ns"):
            table = table.set_column(table.schema.get_field_index(column), column,
                                     pc.add(table[column], clock_from_step * 1_000_000))
        pq.write_table(table, file)
    return written


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Path, Path]:
    """An always-on recording of two hourly partitions, and the same rows written as one trace."""
    first, second = two_partitions()
    root = tmp_path / "always-on"
    write_partition(root / HOUR_15, first, 0)
    write_partition(root / HOUR_16, second, int(first.step.max()) + 1)
    return root, write_trace(tmp_path / "whole", joined(first, second), MODEL, k=2)


def report_json(path: Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["report", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary: dict[str, Any] = json.loads(result.output)
    return summary


def test_a_report_over_partitions_equals_the_report_of_the_same_rows_as_one_trace(
        recorded: tuple[Path, Path]) -> None:
    root, whole = recorded
    over_partitions, as_one = report_json(root), report_json(whole)
    for key in ("growth", "acceptance_by_position", "acceptance_per_k", "step_reads", "budget"):
        assert over_partitions["runs"][0][key] == as_one["runs"][0][key], key
    assert [d["per_batch"] for d in over_partitions["decision"]] == [d["per_batch"] for d in as_one["decision"]]
    assert over_partitions["runs"][0]["growth"]  # not two empty reports


def test_partitions_are_numbered_on_one_after_another(recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    [trace] = open_traces(root)
    first, second = two_partitions()
    steps = trace.steps().collect()
    # 4 requests over steps 0..20, then 3 over 21..36: 7 requests, 37 steps, none shared
    assert steps["request"].n_unique() == 7 and steps["step"].n_unique() == 37 and steps["step"].max() == 36
    assert trace.routing().collect().height == (len(first.step) + len(second.step)) * len(MODEL.layers)
    assert trace.warnings == []


def test_an_unreadable_partition_is_named_and_left_out(recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    (root / HOUR_16 / "manifest.json").write_text("{ truncated")
    [trace] = open_traces(root)
    assert trace.steps().collect()["request"].n_unique() == 4
    assert len(trace.warnings) == 1 and "hour=16" in trace.warnings[0] and "left out" in trace.warnings[0]


def test_a_partition_of_another_k_is_refused_naming_it(recorded: tuple[Path, Path]) -> None:
    root, _ = recorded
    manifest = json.loads((root / HOUR_16 / "manifest.json").read_text())
    manifest["spec"]["k"] = 3
    (root / HOUR_16 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"hour=16: not a partition of the recording .*spec\.k differs"):
        open_traces(root)
