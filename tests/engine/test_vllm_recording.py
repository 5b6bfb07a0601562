"""End-to-end: real vLLM on the CPU, recorded by the plugin, checked against transformers and vLLM's own metrics."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from vllm_fixtures import CANDIDATES, K, assert_same_routing_up_to_divergence, record_like_the_fixture, run_cli
import moetrace
from moetrace.cli import main
from run_comparison import load_outputs
from moetrace.default_model import default_model_dir, ensure_default_model
from moetrace.hooks.host import cpu_model
from moetrace.analysis.concurrency import request_prompts
from moetrace.recording.prompts import BUILTIN_PROMPTS
from moetrace.trace.reader import open_trace

pytestmark = pytest.mark.vllm
# the tests of the shared recording run on one pytest-xdist worker: one recording per run, not one per worker
ON_THE_SHARED_RECORDINGS_WORKER = pytest.mark.xdist_group("recorded_trace")


class TransformersRouting:
    """Routing of the same checkpoint computed by transformers' DeepseekV3 implementation, in float32."""

    def __init__(self) -> None:
        import torch
        from transformers import DeepseekV3ForCausalLM

        self.torch = torch
        self.model = DeepseekV3ForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
        self.scale = float(self.model.config.routed_scaling_factor)
        self.captured: dict[int, tuple[Any, Any]] = {}
        for index, layer in enumerate(self.model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.register_forward_hook(self._hook(index))

    def _hook(self, layer: int) -> Any:
        def keep(_module: Any, _inputs: Any, output: tuple[Any, Any, Any]) -> None:
            _, weights, ids = output
            self.captured[layer] = (ids.detach().numpy(), weights.detach().numpy() / self.scale)

        return keep

    def route(self, tokens: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{layer: (ids [T, K], weights [T, K])} for every position of ``tokens``."""
        self.captured.clear()
        with self.torch.no_grad():
            self.model(self.torch.tensor([tokens]))
        return dict(self.captured)


def rows_agree(ids: np.ndarray, weights: np.ndarray, ref_ids: np.ndarray, ref_weights: np.ndarray) -> bool:
    if set(ids.tolist()) != set(ref_ids.tolist()):
        return False
    order, ref_order = np.argsort(ids), np.argsort(ref_ids)
    return bool(np.allclose(weights[order], ref_weights[ref_order], atol=2e-3))


def near_tie(cand_scores: np.ndarray, top_k: int) -> bool:
    """The k-th and (k+1)-th selection scores are so close that float rounding may swap them."""
    return bool(abs(float(cand_scores[top_k - 1]) - float(cand_scores[top_k])) < 1e-4)


@ON_THE_SHARED_RECORDINGS_WORKER
def test_recorded_routing_matches_transformers_on_the_same_weights(recorded_trace: Path) -> None:
    trace = open_trace(recorded_trace)
    routing = trace.routing().collect()
    outputs = load_outputs(recorded_trace)
    reference = TransformersRouting()
    compared = mismatched = unexplained = 0
    rejected_checked = 0
    for request, output in outputs.items():
        sequence = output["prompt_token_ids"] + output["output_token_ids"]
        rows = routing.filter(pl.col("request") == request)
        final = reference.route(sequence)
        # Rows of tokens that are part of the final sequence: prompt, decoded, anchors, accepted drafts.
        kept = (pl.col("accepted").is_null() | pl.col("accepted")) & (pl.col("position") < len(sequence))
        for row in rows.filter(kept).iter_rows(named=True):
            assert row["token"] == sequence[row["position"]], "position/token mapping is wrong"
            ids, weights = final[row["layer"]]
            compared += 1
            if not rows_agree(np.array(row["experts"]), np.array(row["weights"], dtype=np.float32),
                              ids[row["position"]], weights[row["position"]]):
                mismatched += 1
                unexplained += not near_tie(np.array(row["cand_scores"]), 8)
        # Drafts not in the final sequence (rejected, or accepted past max_tokens): route the window as vLLM saw
        # it, the anchor's prefix followed by the window's draft tokens.
        outside = rows.filter(~kept)
        for step in outside.select("step").unique().to_series():
            drafts = rows.filter((pl.col("step") == step) & (pl.col("draft_pos") > 0)).sort("draft_pos", "layer")
            anchor = int(drafts["position"].min()) - 1
            tokens = drafts.unique("draft_pos", maintain_order=True)["token"].to_list()
            routed = reference.route(sequence[: anchor + 1] + tokens)
            for row in outside.filter(pl.col("step") == step).iter_rows(named=True):
                ids, weights = routed[row["layer"]]
                compared += 1
                rejected_checked += row["accepted"] is False
                if not rows_agree(np.array(row["experts"]), np.array(row["weights"], dtype=np.float32),
                                  ids[row["position"]], weights[row["position"]]):
                    mismatched += 1
                    unexplained += not near_tie(np.array(row["cand_scores"]), 8)
    assert rejected_checked > 0, "the recording should contain rejected drafts"
    assert compared == routing.height
    assert 1 - mismatched / compared >= 0.999, f"{mismatched} of {compared} rows differ"
    assert unexplained == 0


@ON_THE_SHARED_RECORDINGS_WORKER
def test_recorded_acceptance_agrees_with_vllm_per_request_metrics(recorded_trace: Path) -> None:
    trace = open_trace(recorded_trace)
    steps = trace.steps().collect()
    outputs = load_outputs(recorded_trace)
    total_drafted = 0
    for request, output in outputs.items():
        mine = steps.filter((pl.col("request") == request) & (pl.col("num_drafts") > 0)).sort("step")
        theirs = output["spec_decode"]
        assert mine["num_drafts"].to_list() == theirs["per_step_drafted"]
        assert mine["num_accepted"].to_list() == theirs["per_step_accepted"]
        total_drafted += sum(theirs["per_step_drafted"])
    assert total_drafted > 0


@ON_THE_SHARED_RECORDINGS_WORKER
def test_recorded_drafts_and_acceptance_equal_vllms_own_spec_decode_counters(recorded_trace: Path) -> None:
    """vLLM's counters (``vllm:spec_decode_num_*``, what ``/metrics`` serves) are the cross-check that every vLLM
    release has, also those without per-request metrics (0.26)."""
    trace = open_trace(recorded_trace)
    counters = trace.manifest.document["vllm_counters"]
    steps = trace.steps().collect()
    verified = steps.filter(pl.col("num_drafts") > 0)
    assert counters["num_drafts"] == verified.height > 0
    assert counters["num_draft_tokens"] == verified["num_drafts"].sum()
    assert counters["num_accepted_tokens"] == verified["num_accepted"].sum()
    for i in range(1, trace.manifest.spec.k + 1):  # and per draft position: what a set acceptance is checked by
        assert counters[f"num_accepted_tokens_at_{i}"] == (verified["num_accepted"] >= i).sum()
    routing = trace.routing().filter(pl.col("draft_pos") > 0).collect()
    layers = len(trace.manifest.document["model"]["moe_layers"])
    assert routing.height == counters["num_draft_tokens"] * layers
    assert routing["accepted"].sum() == counters["num_accepted_tokens"] * layers


@ON_THE_SHARED_RECORDINGS_WORKER
def test_accepted_drafts_are_the_tokens_vllm_returned_and_the_first_rejected_is_not(recorded_trace: Path) -> None:
    """Checked against vLLM's own output tokens, not the recorder's arrays: under greedy verification an accepted
    draft is the token the target produced at its position, and the first rejected draft of a window is not."""
    trace = open_trace(recorded_trace)
    first_layer = trace.manifest.document["model"]["moe_layers"][0]
    drafts = trace.routing().filter((pl.col("draft_pos") > 0) & (pl.col("layer") == first_layer)).collect()
    accepted_per_window = drafts.group_by("step", "request").agg(pl.col("accepted").sum().alias("accepted_in_window"))
    drafts = drafts.join(accepted_per_window, on=["step", "request"])
    outputs = load_outputs(recorded_trace)
    checked_accepted = checked_rejected = 0
    for row in drafts.iter_rows(named=True):
        sequence = outputs[row["request"]]["prompt_token_ids"] + outputs[row["request"]]["output_token_ids"]
        if row["position"] >= len(sequence):
            continue  # verified past max_tokens: vLLM did not return it
        if row["accepted"]:
            assert row["token"] == sequence[row["position"]]
            checked_accepted += 1
        elif row["draft_pos"] == row["accepted_in_window"] + 1:  # the first rejected draft of its window
            assert row["token"] != sequence[row["position"]]
            checked_rejected += 1
    assert checked_accepted > 0 and checked_rejected > 0


@ON_THE_SHARED_RECORDINGS_WORKER
def test_every_window_token_and_layer_is_recorded_with_valid_experts(recorded_trace: Path) -> None:
    trace = open_trace(recorded_trace)
    manifest = trace.manifest.document
    layers = manifest["model"]["moe_layers"]
    experts = manifest["model"]["num_experts"]
    routing = trace.routing().collect()
    per_token = routing.group_by("step", "request", "position").agg(pl.col("layer").sort().alias("layers"))
    assert all(got == layers for got in per_token["layers"].to_list())
    ids = np.stack(routing["experts"].to_numpy())
    assert ids.max() < experts
    assert all(len(set(row)) == len(row) for row in ids.tolist())
    windows = (
        routing.filter(pl.col("phase") == "verify")
        .group_by("step", "request")
        .agg(pl.col("draft_pos").unique().sort().alias("positions"), pl.col("position").unique().sort().alias("abs"))
    )
    assert windows.height > 0
    for positions, absolute in windows.select("positions", "abs").iter_rows():
        assert positions == list(range(len(positions))) and len(positions) - 1 <= K
        assert absolute == list(range(absolute[0], absolute[0] + len(absolute)))
    weights = np.stack(routing["weights"].to_numpy()).astype(np.float32)
    assert (np.diff(weights, axis=1) <= 0).all(), "experts are ordered by weight, highest first"
    assert np.allclose(weights.sum(axis=1), 1.0, atol=5e-3), "vLLM scales the MoE output, not the weights"


@ON_THE_SHARED_RECORDINGS_WORKER
def test_candidates_rank_the_chosen_experts_first(recorded_trace: Path) -> None:
    routing = open_trace(recorded_trace).routing().collect()
    cand = np.stack(routing["cand_experts"].to_numpy())
    chosen = np.stack(routing["experts"].to_numpy())
    assert cand.shape[1] == CANDIDATES
    same = [set(c[:8]) == set(e) for c, e in zip(cand.tolist(), chosen.tolist())]
    assert sum(same) / len(same) >= 0.999


@ON_THE_SHARED_RECORDINGS_WORKER
def test_info_prints_manifest_and_counts(recorded_trace: Path) -> None:
    result = CliRunner().invoke(main, ["info", str(recorded_trace)])
    assert result.exit_code == 0, result.output
    assert "complete" in result.output and "random weights" not in result.output
    as_json = CliRunner().invoke(main, ["info", str(recorded_trace), "--json"])
    (described,) = json.loads(as_json.output)
    assert described["routing_rows_readable"] == described["manifest"]["counts"]["routing_rows"] > 0


def test_sigkill_mid_recording_leaves_readable_files_and_the_writer_process_finishes_the_trace(tmp_path: Path) -> None:
    """SIGKILL on the whole `moetrace record` process group mid-generation: every rotated file is readable at
    once; the writer process (a session of its own) outlives the engine, closes its open file and says in the
    manifest how the recording ended and whether any recorded step was lost."""
    process = subprocess.Popen(
        [sys.executable, "-m", "moetrace", "record", "--k", "2", "--max-tokens", "400", "--num-prompts", "16",
         "--batch-size", "4", "--rotate-seconds", "1", "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    routing_dir = tmp_path / "kimi-k2-tiny-ngram-k2" / "routing"
    deadline = time.monotonic() + 300
    try:
        while len(list(routing_dir.glob("*.parquet"))) < 2:
            assert process.poll() is None, "recording ended before it could be killed"
            assert time.monotonic() < deadline, "no rotated files appeared"
            time.sleep(0.2)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    trace_dir = routing_dir.parent
    for path in routing_dir.glob("*.parquet"):
        assert pq.read_table(path).num_rows > 0
    deadline = time.monotonic() + 60
    while (manifest := json.loads((trace_dir / "manifest.json").read_text())).get("end_time") is None:
        assert time.monotonic() < deadline, "the writer process never finished the trace"
        time.sleep(0.2)
    assert not list(trace_dir.rglob("*.inprogress"))
    ended = manifest.get("end") or manifest.get("error")
    assert "engine process ended" in ended
    assert open_trace(trace_dir).routing().collect().height == manifest["counts"]["routing_rows"] > 0
    shown = run_cli("info", str(trace_dir), timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "engine process ended" in " ".join(shown.stdout.split())


@ON_THE_SHARED_RECORDINGS_WORKER
def test_compiled_capture_records_what_eager_capture_records(recorded_trace: Path, tmp_path: Path) -> None:
    """With vLLM compiling the model (Dynamo traces through the router wrapper), the static-buffer writes are
    part of the compiled graph and record the same routing as eager mode. Compiled kernels round differently, so
    greedy decoding may leave eager's text at some token: rows are compared up to there."""
    compiled = open_trace(record_like_the_fixture(tmp_path, "--compiled", "--time-phases-every", "3"))
    assert compiled.manifest.document["capture"]["mode"] == "graph-safe"
    assert compiled.manifest.document["capture_mechanisms"].get("traced", 0) > 0, "Dynamo traced the router wrapper"
    assert_same_routing_up_to_divergence(recorded_trace, compiled.path)
    # the steps left untimed are recorded all the same; one in three is timed, spread evenly (a Weyl sequence:
    # never in step with the workload's period, within 3 of a third over any number of steps)
    steps = compiled.manifest.document["counts"]["steps"]
    assert compiled.manifest.document["capture"]["phases_timed_every"] == 3
    timed = {phase: sum(t["calls"] for t in per_batch.values())
             for phase, per_batch in compiled.manifest.document["phases"].items()}
    assert abs(timed["forward"] - steps / 3) <= 3
    # the drafter is hooked for the timed steps only, and timed in (nearly) every one of them
    assert timed["forward"] / 2 < timed["drafting"] <= timed["forward"]
    assert open_trace(recorded_trace).manifest.document["capture"]["phases_timed_every"] == 1  # the CPU's default


@ON_THE_SHARED_RECORDINGS_WORKER
def test_routing_recomputed_from_router_logits_equals_the_wrapped_routers(recorded_trace: Path, tmp_path: Path) -> None:
    """The path for kernels that fuse routing (they never call the router): the recorder takes the logits where
    vLLM hands them on and runs the router's own routing function itself. Forced on the CPU's modular kernels, its
    rows must equal the wrapped router's on the same prompts (compared by request, position and layer: the two
    runs may group requests into steps differently)."""
    recomputed = open_trace(record_like_the_fixture(tmp_path, "--recompute-from-logits"))
    assert recomputed.manifest.document["capture"]["recomputed_from_logits"] is True
    assert open_trace(recorded_trace).manifest.document["capture"]["recomputed_from_logits"] is False
    assert_same_routing_up_to_divergence(recorded_trace, recomputed.path)
    counts = recomputed.manifest.counts
    assert counts["routing_rows"] == counts["tokens"] * 3


def record_drafted_trace(method: str, k: int, tmp_path: Path, batch_size: int = 4, num_prompts: int = 10) -> Path:
    """Record the default model with ``method`` at ``k`` and check what every drafter's trace must hold: the
    target's MoE layers only (every token in each), drafts, and per request and step the acceptance vLLM itself
    counted. Returns the trace."""
    done = run_cli("record", "--method", method, "--k", str(k), "--max-tokens", "24", "--batch-size", str(batch_size),
                   "--num-prompts", str(num_prompts), "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    (trace_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    trace = open_trace(trace_dir)
    layers = trace.manifest.document["model"]["moe_layers"]
    assert layers == [1, 2, 3] and trace.manifest.document["spec"]["method"] == method
    routing = trace.routing().collect()
    assert sorted(routing["layer"].unique().to_list()) == layers
    assert routing.height == trace.manifest.document["counts"]["tokens"] * len(layers)
    steps = trace.steps().collect()
    assert steps["num_drafts"].sum() > 0 and steps["num_accepted"].sum() > 0
    for request, output in load_outputs(trace_dir).items():
        mine = steps.filter((pl.col("request") == request) & (pl.col("num_drafts") > 0)).sort("step")
        assert mine["num_accepted"].to_list() == output["spec_decode"]["per_step_accepted"]
    return trace_dir


def test_requests_of_one_prompt_share_it_and_the_steps_that_run_it_twice_are_not_measured(tmp_path: Path) -> None:
    prompts = tmp_path / "three.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in BUILTIN_PROMPTS[:3]))
    done = run_cli("record", "--k", "2", "--max-tokens", "24", "--prompts", str(prompts), "--num-prompts", "6",
                   "--batch-size", "4", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning: 6 requests over 3 distinct prompts, up to 4 at once (--batch-size 4)" in done.stderr
    (trace,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    # the expected prompts from what vLLM was given: each request's prompt token ids, by its id in the manifest
    given = {o["request_id"]: tuple(o["prompt_token_ids"]) for o in map(json.loads, (trace / "outputs.jsonl").open())}
    requests = [given[name.split("-")[0]] for name in json.loads((trace / "manifest.json").read_text())["requests"]]
    numbers: dict[tuple[int, ...], int] = {}
    expected = {request: numbers.setdefault(prompt, len(numbers)) for request, prompt in enumerate(requests)}
    assert len(numbers) == 3
    # (vLLM's CPU build turns prefix caching off for MLA, so every repeat prefilled its whole prompt here; a GPU's
    # cache serves a repeat's head, which the unit tests of request_prompts build as the GPU's traces hold it)
    assert request_prompts(open_trace(trace).routing()) == expected
    # each step of 4 requests ran one prompt twice: the report estimates that concurrency instead of measuring it
    report = run_cli("report", str(trace), "--k", "2", "--batch", "4", "--json")
    assert report.returncode == 0, report.stderr[-3000:]
    (row,) = [r for r in json.loads(report.stdout)["runs"][0]["step_reads"] if (r["batch"], r["k"]) == (4, 2)]
    assert row["union_source"] == "estimated" and row["steps"] == 0


def test_mtp_drafter_moe_layers_stay_out_of_the_target_rows(tmp_path: Path) -> None:
    """The MTP drafter is a MoE decoder layer (layer 4 of the default model) that runs after every target
    forward; only the target's MoE layers may appear in the trace, and acceptance still matches vLLM's."""
    record_drafted_trace("mtp", 1, tmp_path)


def test_the_embedded_eagle3_head_drafts_and_only_the_targets_moe_layers_are_recorded(tmp_path: Path) -> None:
    """The default model's shipped EAGLE-3 head (no MoE: one MLA decoder layer over three of the target's hidden
    states) drafts without --drafter; the trace holds the target's MoE layers only, its acceptance is vLLM's own per
    request and step, and the manifest names the head by architecture, parameters and hash."""
    trace = open_trace(record_drafted_trace("eagle3", 2, tmp_path))
    head = Path(moetrace.__file__).parent / "data" / "eagle3-head"
    parameters = sum(int(np.prod(shape)) for shape in checkpoint_shapes(head).values())
    assert trace.manifest.document["spec"]["drafter_checkpoint"] == {
        "path": str(head.resolve()), "architecture": "Eagle3DeepseekV2ForCausalLM", "parameters": parameters,
        "sha256": hashlib.sha256((head / "model.safetensors").read_bytes()).hexdigest()}


def test_the_default_models_one_layer_draft_model_drafts_as_draft_model(tmp_path: Path) -> None:
    """--method draft_model on the default model without --drafter runs its one-layer cut (embedding, dense
    layer 0, final norm, LM head) as vLLM's draft_model, not as MTP; the trace holds the target's MoE layers
    only and vLLM's own acceptance, and the manifest names a one-layer DeepseekV2 model."""
    # vLLM 0.32 drafts with a draft model one request at a time: 4 requests keep the test short
    trace = open_trace(record_drafted_trace("draft_model", 2, tmp_path, batch_size=1, num_prompts=4))
    checkpoint = trace.manifest.document["spec"]["drafter_checkpoint"]
    config = json.loads((Path(checkpoint["path"]) / "config.json").read_text())
    assert checkpoint["architecture"] == "DeepseekV2ForCausalLM" and config["num_hidden_layers"] == 1
    target = json.loads((ensure_default_model() / "config.json").read_text())
    assert checkpoint["parameters"] == sum(  # the target's embedding, layer 0, final norm and LM head
        int(np.prod(shape)) for name, shape in checkpoint_shapes(ensure_default_model()).items()
        if name.startswith(("model.embed_tokens.", "model.layers.0.", "model.norm.", "lm_head.")))
    assert config["vocab_size"] == target["vocab_size"] and "num_nextn_predict_layers" not in config


def checkpoint_shapes(folder: Path) -> dict[str, list[int]]:
    with safe_open(str(folder / "model.safetensors"), "np") as weights:
        return {name: list(weights.get_slice(name).get_shape()) for name in weights.keys()}


@ON_THE_SHARED_RECORDINGS_WORKER
def test_the_trace_says_what_recording_cost_the_engine_thread_and_on_which_host(recorded_trace: Path) -> None:
    manifest = open_trace(recorded_trace).manifest.document
    assert manifest["host"]["kernel"] == platform.release()  # a sandbox (gVisor: 4.4.0) times differently
    assert manifest["host"]["cpu"] == cpu_model() and manifest["host"]["cpus"] == os.cpu_count()
    cost = manifest["engine_thread_us_per_step"]
    assert set(cost) == {"step", "graph", "hand_over", "layout", "sample", "sample_tokens", "phase_timing"}
    assert cost["layout"] > 0 and cost["hand_over"] > 0  # the layout and the hand-over take measurable time
    assert sum(cost.values()) < 20_000  # and far less than a CPU step (tens of ms)


@ON_THE_SHARED_RECORDINGS_WORKER
def test_the_trace_says_where_each_step_spent_its_time(recorded_trace: Path) -> None:
    trace = open_trace(recorded_trace)
    phases, counts = trace.manifest.document["phases"], trace.manifest.document["counts"]
    assert trace.manifest.capture.async_scheduling is False  # vLLM drafts n-gram with async scheduling off
    assert trace.manifest.document["capture"]["host_copy"] == "host"  # no GPU: the packed block is the host's already
    assert set(phases) == {"forward", "sampling", "drafting"}
    steps = trace.steps().collect()
    durations = (steps.group_by("step").agg((pl.col("t_end_ns").first() - pl.col("t_start_ns").first()) / 1e6)
                 ["t_end_ns"])
    # step bounds on the host's monotonic clock (shared by every process of the host): before this test's now
    assert trace.manifest.document["capture"]["step_clock"] == "monotonic"
    assert 0 < steps["t_start_ns"].min() and steps["t_end_ns"].max() < time.monotonic_ns()
    assert (steps["t_end_ns"] >= steps["t_start_ns"]).all()
    for phase, per_batch in phases.items():
        calls = sum(timing["calls"] for timing in per_batch.values())
        # the forward runs every step, sampling every step that sampled, the drafter once per step that drafted
        assert (calls >= counts["steps"]) if phase == "forward" else (0 < calls <= counts["steps"])
        for batch, timing in per_batch.items():
            assert 1 <= int(batch) <= len(trace.manifest.document["requests"])
            # inside a recorded step's bounds, and not timed on a device here (CPU)
            assert 0 < timing["host_ms_median"] <= durations.max() and timing["device_ms_median"] is None
