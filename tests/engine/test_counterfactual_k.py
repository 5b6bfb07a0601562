"""A k the trace did not record, on real vLLM (CPU): the shared n-gram k=3 recording's counterfactual windows at
k=2 against a k=2 recording of the same workload (the 10 built-in prompts, greedy)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from vllm_fixtures import record_like_the_fixture
from moetrace.analysis.budgets import WINDOW, window_sample
from moetrace.analysis.concurrency import RecordedK, batch_unions, request_prompts
from moetrace.analysis.placement import linear_placement
from moetrace.cli import main
from moetrace.trace.reader import Trace, open_trace

# the shared recording's worker: recorded once per run, not once per worker
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("recorded_trace")]


@pytest.fixture(scope="module")
def recorded_at_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared recording's workload at k=2."""
    return record_like_the_fixture(tmp_path_factory.mktemp("k2"), k=2)


def request_steps(trace: Trace) -> pl.DataFrame:
    """The decoding request-steps: request, the anchor's position, drafts proposed, tokens read."""
    anchors = (trace.routing().filter((pl.col("phase").cast(pl.String) != "prefill") & (pl.col("draft_pos") == 0))
               .select("step", "request", anchor="position").unique())
    steps = trace.steps().filter(pl.col("num_tokens") == pl.col("num_drafts") + 1)
    return steps.join(anchors, on=["step", "request"]).select("request", "anchor", "num_drafts", "num_tokens").collect()


def per_layer_at_one_request(trace: Trace, k: int) -> dict[int, float]:
    """Unique experts per layer one request's step reads at ``k`` (``batch_unions`` at B=1, the trace alone)."""
    model = trace.manifest.model
    recorded = {trace.k: RecordedK(window_sample(trace.routing(), trace.k, ["experts"]), trace.steps(),
                                   request_prompts(trace.routing()))}
    unions = batch_unions(recorded, model.num_experts, model.top_k, linear_placement(model.num_experts, 1), [k], [1])
    return dict(zip(unions["layer"].to_list(), unions["unique_experts"].to_list()))


def test_k2_drawn_from_the_k3_trace_reads_what_the_k2_recording_read(recorded_trace: Path,
                                                                     recorded_at_two: Path) -> None:
    three, two = open_trace(recorded_trace), open_trace(recorded_at_two)
    steps_three, steps_two = request_steps(three), request_steps(two)
    assert (steps_three["num_drafts"] < 3).mean() > 0.2  # n-gram often proposed fewer than k

    # The assumption, checked: where both runs verified from the same position of a request (they decode the same
    # text, greedy), n-gram proposed at k=2 the first min(d, 2) of the d drafts it proposed at k=3.
    shared = steps_two.join(steps_three, on=["request", "anchor"], suffix="_three")
    assert shared.height > steps_two.height // 2
    assert shared["num_drafts"].to_list() == shared["num_drafts_three"].clip(upper_bound=2).to_list()

    # Tokens read per request-step: the windows cut from the k=3 trace at k=2 against the k=2 recording. The two
    # verified from different positions (each run's acceptance placed its anchors), so their means differ as two
    # samples do: within 3 standard errors of the difference.
    windows, _ = window_sample(three.routing(), 3, ["experts"]).request_windows(2, 10**9)
    tokens = windows.collect().filter(pl.col("layer") == pl.col("layer").min()).group_by(WINDOW).len()["len"]
    read_two = steps_two["num_tokens"].cast(pl.Float64)
    standard_error = math.sqrt(float(tokens.var()) / tokens.len() + float(read_two.var()) / read_two.len())
    assert abs(float(tokens.mean()) - float(read_two.mean())) <= 3 * standard_error, (tokens.mean(), read_two.mean())
    # and as the acceptance side reads them from the k=3 steps (1 + mean min(d, 2)), but for the windows that run
    # past a request's end (at most its last 2, each of 1 to 3 tokens: moving the mean by at most 2 / request-steps)
    acceptance_read = 1 + steps_three.select(pl.col("num_drafts").clip(upper_bound=2).mean()).item()
    lost = 2 * steps_three["request"].n_unique()
    assert abs(float(tokens.mean()) - acceptance_read) <= lost * 2 / steps_three.height

    # Unique experts per layer at one request: within 10%. The counterfactual windows hold the accepted tokens
    # where the k=2 run read its rejected drafts (their routing is the one thing a trace at k=3 cannot know). Full
    # windows of 3 tokens (the old rule) read 20.4 against 14.6 on the default workload.
    counterfactual, recorded = per_layer_at_one_request(three, 2), per_layer_at_one_request(two, 2)
    assert counterfactual.keys() == recorded.keys() == {1, 2, 3}
    for layer, unique in recorded.items():
        assert counterfactual[layer] == pytest.approx(unique, rel=0.10), (layer, counterfactual, recorded)


def test_the_report_of_the_k3_trace_reads_less_at_k2_than_at_k3(recorded_trace: Path, tmp_path: Path) -> None:
    done = CliRunner().invoke(main, ["report", str(recorded_trace), "--k", "3", "--json", "-o",
                                     str(tmp_path / "report.html")], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    run = json.loads(done.stdout)["runs"][0]
    reads = {row["k"]: row for row in run["step_reads"] if row["batch"] == 1}
    assert reads[2]["union_source"] == "counterfactual" and reads[3]["union_source"] != "counterfactual"
    assert reads[2]["unique_experts"] < reads[3]["unique_experts"]
    weights = {row["k"]: row["expert_weight_bytes"] for row in run["step_bytes"]}
    assert weights[1] < weights[2] < weights[3] < weights[4]
    assert np.all(np.diff([reads[k]["tokens_read"] for k in sorted(reads)]) >= 0)
