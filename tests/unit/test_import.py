"""`moetrace import`: vLLM's own routed experts written as a moetrace trace, checked against what moetrace recorded
in the same engine run, and every trap of the format refused in one line with nothing written."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
import pytest
from click.testing import CliRunner

import moetrace
from cli_results import invoke
from moetrace.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm-routed-experts"
LAYERS, EXPERTS, TOP_K = 4, 384, 8  # the embedded default model: layer 0 dense, layers 1-3 MoE


def imported_rows(trace: Path) -> pl.DataFrame:
    ids = json.loads((trace / "manifest.json").read_text())["requests"]
    return pl.read_parquet(trace / "routing").with_columns(
        request_id=pl.col("request").replace_strict(dict(enumerate(ids)), return_dtype=pl.String))


def test_import_of_vllms_arrays_equals_the_rows_moetrace_recorded_in_the_same_h200_run(tmp_path: Path) -> None:
    """The fixture is one H200 run (vLLM 0.26.0, Model Runner V1, CUDA graphs, the default model, n-gram k=3,
    16 requests of which 3 kept here) with both vLLM's capture and moetrace's recorder on:
    `moetrace record --k 3 --compiled --num-prompts 16 --batch-size 8 --max-tokens 96
    --engine-arg enable_return_routed_experts=true`. Every token both hold routed alike in every MoE layer; moetrace
    alone holds the accepted drafts past max_tokens, which vLLM drops; vLLM alone holds request 13's prompt
    positions that its prefix cache served from request 3 (the same prompt), which are request 3's routing."""
    out = tmp_path / "imported"
    result = invoke("import", str(FIXTURE / "vllm-routed-experts.npz"), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert f"next: moetrace report {out}" in result.output
    recorded = pl.read_parquet(FIXTURE / "recorded-routing.parquet")
    kept = recorded.filter((pl.col("phase") != "verify") | (pl.col("draft_pos") == 0) | pl.col("accepted"))
    key = ["request_id", "position", "layer"]
    ours = kept.select(*key, experts=pl.col("experts").arr.sort(), token=pl.col("token"))
    theirs = imported_rows(out).select(*key, experts=pl.col("experts").arr.sort(), token=pl.col("token"))
    both = ours.join(theirs, on=key, suffix="_vllm")
    # vLLM's rows: 186, 182 and 186 tokens (each request's length less one); all but request 13's 80 cached prompt
    # positions are in both, in 3 MoE layers each
    assert both.height == (186 + 182 + 186 - 80) * 3
    assert (both["experts"] == both["experts_vllm"]).all() and (both["token"] == both["token_vllm"]).all()
    outputs = {json.loads(line)["request_id"]: json.loads(line) for line in
               (FIXTURE / "outputs.jsonl").read_text().splitlines()}
    length = {rid: len(o["prompt_token_ids"]) + len(o["output_token_ids"]) for rid, o in outputs.items()}
    only_ours = ours.join(theirs, on=key, how="anti").join(kept.select(*key, "phase", "accepted"), on=key)
    assert only_ours.height > 0
    for row in only_ours.iter_rows(named=True):  # drafts accepted past the request's last token
        assert row["phase"] == "verify" and row["accepted"] and row["position"] >= length[row["request_id"]] - 1
    only_theirs = theirs.join(ours, on=key, how="anti")
    assert set(only_theirs["request_id"]) == {"13"}
    assert sorted(set(only_theirs["position"])) == list(range(80))  # 5 cached blocks of 16 of a 91-token prompt
    assert outputs["13"]["prompt_token_ids"] == outputs["3"]["prompt_token_ids"]
    cached = only_theirs.join(ours.filter(pl.col("request_id") == "3").drop("request_id"),
                              on=["position", "layer"], suffix="_computed")
    assert cached.height == 80 * 3 and (cached["experts"] == cached["experts_computed"]).all()


def test_imported_trace_reports_only_what_its_source_knows(tmp_path: Path) -> None:
    """As a subprocess: the report of an imported trace names its source and what it lacks, shows growth and bytes,
    and leaves out budgets (no router weights) and step times (no timing); a measured profile is refused."""
    out = tmp_path / "imported"
    done = subprocess.run([sys.executable, "-m", "moetrace", "import", str(FIXTURE / "vllm-routed-experts.npz"),
                           "--outputs", str(FIXTURE / "outputs.jsonl"), "-o", str(out)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    report = subprocess.run([sys.executable, "-m", "moetrace", "report", str(out), "--json", "-o",
                             str(tmp_path / "r.html")], capture_output=True, text=True, check=False)
    assert report.returncode == 0, report.stderr
    run = json.loads(report.stdout)["runs"][0]
    assert any(n.startswith("imported from vllm") and "router weights" in n for n in run["notes"])
    assert run["budget"]["per_layer"] == [] and run["budget"]["median_budget"] is None
    assert [row["step_ms"] for row in run["acceptance_per_k"]] == [None]
    assert run["budget_curves"] == []
    assert len(run["growth"]) > 1
    refused = subprocess.run([sys.executable, "-m", "moetrace", "report", str(out), "--profile", "measured",
                              "--calibration", str(Path(moetrace.__file__).parent / "data" / "calibration-h200.json"),
                              "-o", str(tmp_path / "r.html"), "--force"], capture_output=True, text=True, check=False)
    assert refused.returncode == 1 and "imported without step timing" in refused.stderr
    assert "Traceback" not in refused.stderr
    no_budget = CliRunner().invoke(main, ["budget", str(out), "-o", str(tmp_path / "budgets.json")])
    assert no_budget.exit_code == 1 and "without router weights" in no_budget.output
    assert not (tmp_path / "budgets.json").exists()


def routed(tokens: int, seed: int, dtype: type = np.uint16) -> npt.NDArray[Any]:
    """[tokens - 1, 4, 8] as vLLM returns it: layer 0 (dense) zeros, 8 distinct experts per MoE layer."""
    rng = np.random.default_rng(seed)
    out = np.zeros((tokens - 1, LAYERS, TOP_K), dtype=np.int64)
    for t in range(tokens - 1):
        for layer in range(1, LAYERS):
            out[t, layer] = rng.choice(EXPERTS, TOP_K, replace=False)
    return out.astype(dtype)


def offline(tmp_path: Path, arrays: dict[str, npt.NDArray[Any]], prompt: int = 5, output: int = 4) -> Path:
    source = tmp_path / "routed.npz"
    np.savez(source, **arrays)
    lines = [{"request_id": rid, "prompt_token_ids": list(range(prompt)),
              "output_token_ids": list(range(100, 100 + output))} for rid in arrays]
    (tmp_path / "outputs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return source


def test_dense_layers_are_dropped_and_rows_are_placed_by_position_and_phase(tmp_path: Path) -> None:
    arrays = {"a": routed(9, 0), "b": routed(9, 1, np.int32)}  # 5 prompt + 4 output tokens: 8 rows
    result = invoke("import", str(offline(tmp_path, arrays)), "-o", str(tmp_path / "t"))
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["model"]["moe_layers"] == [1, 2, 3]
    assert manifest["spec"] == {"method": None, "k": 0} and "router_weights" in manifest["source"]["lacks"]
    rows = imported_rows(tmp_path / "t").filter(pl.col("request_id") == "a").sort("position", "layer")
    assert rows["position"].to_list() == [p for p in range(8) for _ in range(3)]
    assert rows["phase"].cast(pl.String).to_list() == ["prefill"] * 15 + ["decode"] * 9
    assert rows["token"].to_list() == [t for t in [0, 1, 2, 3, 4, 100, 101, 102] for _ in range(3)]
    assert np.array_equal(np.stack(rows["experts"].to_list()).reshape(8, 3, TOP_K), arrays["a"][:, 1:, :])
    steps = pl.read_parquet(tmp_path / "t" / "steps").filter(pl.col("request") == 0).sort("step")
    assert steps["num_tokens"].to_list() == [5, 1, 1, 1]  # the prompt in one step, then one step per token


def test_prompt_start_offsets_positions_and_padding_rows_are_left_out(tmp_path: Path) -> None:
    array = routed(9, 2, np.int32)[2:]  # routed_experts_prompt_start=2: positions 2..7
    array[3] = -1  # position 5: a padding row in every layer
    result = invoke("import", str(offline(tmp_path, {"a": array})), "--prompt-start", "2", "-o", str(tmp_path / "t"))
    assert result.exit_code == 0, result.output
    rows = imported_rows(tmp_path / "t")
    assert sorted(set(rows["position"])) == [2, 3, 4, 6, 7]
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["source"]["padding_rows"] == 1


def test_http_responses_carry_base64_npy_and_token_ids(tmp_path: Path) -> None:
    array = routed(9, 3)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    response = {"id": "cmpl-1", "choices": [{"index": 0, "routed_experts": base64.b64encode(buffer.getvalue()).decode(),
                                             "prompt_token_ids": [1, 2, 3, 4, 5], "token_ids": [6, 7, 8, 9]}]}
    (tmp_path / "responses.jsonl").write_text(json.dumps(response) + "\n")
    result = invoke("import", str(tmp_path / "responses.jsonl"))
    assert result.exit_code == 0, result.output
    rows = imported_rows(tmp_path / "responses-trace").sort("position", "layer")
    assert set(rows["request_id"]) == {"cmpl-1-0"}
    assert np.array_equal(np.stack(rows["experts"].to_list()).reshape(8, 3, TOP_K), array[:, 1:, :])


def corrupt_npz(tmp_path: Path) -> list[str]:
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 not a zip")
    return [str(tmp_path / "bad.npz"), "--outputs", str(offline(tmp_path, {"a": routed(9, 0)}).with_name(
        "outputs.jsonl"))]


@pytest.mark.parametrize("make, message", [
    (lambda p: [str(offline(p, {"a": routed(9, 0)[:-1]}))], "7 rows for 9 tokens"),
    (lambda p: [str(offline(p, {"a": np.full((8, LAYERS, TOP_K), 400, np.int32)}))], "physical ids"),
    (lambda p: [str(offline(p, {"a": routed(9, 0)[:, :, :4]}))], "not [tokens, layers, 8]"),
    (lambda p: [str(offline(p, {"a": routed(9, 0).astype(np.float32)}))], "not an integer type"),
    (lambda p: [str(offline(p, {"a": np.where(np.arange(TOP_K) < 2, -1, routed(9, 0).astype(np.int32))}))],
     "-1 padding in part of a token's experts"),
    (lambda p: [str(offline(p, {"a": np.where(np.arange(LAYERS)[:, None] == 2, 0, routed(9, 0))}))],
     "2 layers routed"),
    (corrupt_npz, "not a readable .npz"),
    (lambda p: [str(p / "missing.npz")], "no such file"),
    (lambda p: [str(p / "trace.parquet")], "give a .npz"),
])
def test_bad_input_gets_one_line_and_nothing_is_written(tmp_path: Path, make: Any, message: str) -> None:
    args = make(tmp_path)
    result = CliRunner().invoke(main, ["import", *args, "-o", str(tmp_path / "t")])
    assert result.exit_code == 1 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) <= 2 and "Traceback" not in result.output
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".t.*"))


def test_http_response_without_token_ids_says_how_to_get_them(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    np.save(buffer, routed(9, 0))
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "x", "choices": [
        {"routed_experts": base64.b64encode(buffer.getvalue()).decode()}]}) + "\n")
    result = CliRunner().invoke(main, ["import", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 1 and "return_token_ids" in result.output
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "x", "choices": [{"routed_experts": "%%%"}]}) + "\n")
    result = CliRunner().invoke(main, ["import", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 1 and "not a base64 .npy" in result.output


def test_an_existing_trace_is_not_overwritten_without_force(tmp_path: Path) -> None:
    source = offline(tmp_path, {"a": routed(9, 0)})
    assert invoke("import", str(source)).exit_code == 0
    again = CliRunner().invoke(main, ["import", str(source)])
    assert again.exit_code == 1 and "--force" in again.output
    assert invoke("import", str(source), "--force").exit_code == 0


def test_record_keeps_vllms_arrays_by_request_id_when_the_engine_returns_them(tmp_path: Path) -> None:
    """``moetrace record`` with ``enable_return_routed_experts`` (vLLM's CPU build cannot: the H200 fixture above
    came this way): outputs as vLLM's ``RequestOutput`` holds them."""
    from types import SimpleNamespace

    from moetrace.recording.engine import save_engine_routed_experts

    arrays = {"0": routed(9, 0), "1": routed(5, 1)}
    outputs = [SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(routed_experts=array)])
               for rid, array in arrays.items()]
    save_engine_routed_experts(outputs, tmp_path / "r.npz")
    with np.load(tmp_path / "r.npz") as saved:
        assert sorted(saved.files) == ["0", "1"] and all(np.array_equal(saved[k], arrays[k]) for k in arrays)
    save_engine_routed_experts([SimpleNamespace(request_id="0", outputs=[SimpleNamespace(routed_experts=None)])],
                               tmp_path / "none.npz")
    assert not (tmp_path / "none.npz").exists()


def test_sglang_generate_responses_carry_raw_int32_rows(tmp_path: Path) -> None:
    """SGLang 0.5.23 (``extract_routed_experts_from_meta_info``): base64 of the int32 bytes, C order [tokens,
    layers, top_k], over prompt + output − 1 tokens; dense layers as zeros."""
    array = routed(9, 4).astype(np.int32)  # 5 prompt + 4 completion tokens
    meta = {"id": "s1", "prompt_tokens": 5, "completion_tokens": 4,
            "routed_experts": base64.b64encode(array.tobytes()).decode()}
    (tmp_path / "generate.jsonl").write_text(json.dumps({"text": "...", "meta_info": meta}) + "\n")
    result = invoke("import", str(tmp_path / "generate.jsonl"))
    assert result.exit_code == 0, result.output
    trace = tmp_path / "generate-trace"
    rows = imported_rows(trace).sort("position", "layer")
    assert np.array_equal(np.stack(rows["experts"].to_list()).reshape(8, 3, TOP_K), array[:, 1:, :])
    assert rows["token"].null_count() == rows.height  # the prompt's ids are not in the response
    assert json.loads((trace / "manifest.json").read_text())["source"]["engine"] == "sglang"
    meta["routed_experts"] = base64.b64encode(array.tobytes()[:-4]).decode()
    (tmp_path / "generate.jsonl").write_text(json.dumps({"meta_info": meta}) + "\n")
    result = CliRunner().invoke(main, ["import", str(tmp_path / "generate.jsonl"), "--force"])
    assert result.exit_code == 1 and "not whole rows of 4 layers x top-8" in result.output
