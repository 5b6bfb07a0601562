"""The report of a recording sampled by request (``"sample_requests": N``: routing rows of one request in N, steps
rows of all): acceptance from every request, growth from the sampled ones, no step unions, no false alarm."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from moetrace.cli import main
from trace_builder import Model, Tokens, verify_tokens, write_trace

MODEL = Model(num_experts=32, top_k=2)


def of_requests(tokens: Tokens, kept: np.ndarray) -> Tokens:
    return replace(tokens, **{name: (value[kept] if isinstance(value, np.ndarray) else
                                     [item for item, keep in zip(value, kept) if keep])
                              for name, value in vars(tokens).items() if value is not None})


def sampled_copy(root: Path, tokens: Tokens, one_in: int) -> Path:
    """``tokens`` written as a recording sampled one request in ``one_in`` writes them: routing rows of the requests
    whose index is a multiple of it, every steps row, the manifest saying so."""
    write_trace(root, tokens, MODEL, k=2)
    for file in (root / "routing").glob("*.parquet"):
        table = pq.read_table(file)
        pq.write_table(table.filter(pa.array(table["request"].to_numpy() % one_in == 0)), file)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["capture"]["sampled"] = {"one_request_in": one_in}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def report(path: Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["report", str(path), "--json", "--batch", "1,2,4"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload


def test_a_request_sampled_report_takes_acceptance_from_all_and_growth_from_the_sampled(tmp_path: Path) -> None:
    tokens = verify_tokens(np.random.default_rng(5), MODEL, requests=6, steps=30, k=2, accept_prob=0.6,
                           variable_drafts=True)
    sampled_requests = tokens.request % 3 == 0
    whole = report(write_trace(tmp_path / "whole", tokens, MODEL, k=2))
    sampled = report(sampled_copy(tmp_path / "sampled", tokens, 3))
    only = report(write_trace(tmp_path / "only", of_requests(tokens, sampled_requests), MODEL, k=2))
    run, whole_run, only_run = sampled["runs"][0], whole["runs"][0], only["runs"][0]
    # steps rows of every request: acceptance is the whole recording's
    assert run["acceptance_by_position"] == whole_run["acceptance_by_position"]
    # routing of requests 0 and 3: what one request's windows read is theirs alone
    per_request = [row for row in run["growth"] if row["scope"] == "request"]
    assert per_request == [row for row in only_run["growth"] if row["scope"] == "request"] and per_request
    # a step's union is not measured from a third of its requests (the whole trace has it)
    assert not [row for row in run["growth"] if row["scope"] == "batch"]
    assert [row for row in whole_run["growth"] if row["scope"] == "batch"]
    # two thirds of the request-steps have no routing rows by design: not a disagreement
    assert not [w for w in sampled["warnings"] if "lack routing rows" in w], sampled["warnings"]
    assert any("one request in 3" in note for note in run["notes"])
    decided = [row for drafter in sampled["decision"] for row in drafter["per_batch"]]
    assert [row["batch"] for row in decided] == [1, 2, 4] and all(row["status"] == "ok" for row in decided)
