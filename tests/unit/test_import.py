"""`moetrace import`: vLLM's own routed experts written as a moetrace trace, checked against what moetrace recorded
in the same engine run, and every trap of the format refused in one line with nothing written."""

from __future__ import annotations

import base64
import importlib.util
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
from moetrace.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm-routed-experts"
LAYERS, EXPERTS, TOP_K = 4, 384, 8  # the embedded default model: layer 0 dense, layers 1-3 MoE


def import_trace(*args: str) -> Any:
    return CliRunner().invoke(main, ["import", *args], catch_exceptions=False)


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
    result = import_trace(str(FIXTURE / "vllm-routed-experts.npz"), "-o", str(out))
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
    result = import_trace(str(offline(tmp_path, arrays)), "-o", str(tmp_path / "t"))
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
    result = import_trace(str(offline(tmp_path, {"a": array})), "--prompt-start", "2", "-o", str(tmp_path / "t"))
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
    result = import_trace(str(tmp_path / "responses.jsonl"))
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
    assert import_trace(str(source)).exit_code == 0
    again = CliRunner().invoke(main, ["import", str(source)])
    assert again.exit_code == 1 and "--force" in again.output
    assert import_trace(str(source), "--force").exit_code == 0


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
    result = import_trace(str(tmp_path / "generate.jsonl"))
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


# SGLang's expert distribution recorder (`moetrace import DUMP.pt`). The dumps below are built by hand in the layout
# of SGLang 0.5.23's python/sglang/srt/eplb/expert_distribution.py: a record per forward pass as
# _DetailAccumulator.append makes it (L925-932: forward_pass_id, rank, gatherer_key, then what
# _DetailSinglePassGatherer.collect returns, L539-544: the metadata of L489-496 (input_ids, positions,
# extend_seq_lens, forward_mode), topk_ids_of_layer int32 [layers, tokens, 8] of physical ids, -1 where nothing was
# routed (reset, L524-525), misc_objects, global_physical_count), the dump dict of _DetailAccumulator.dump (L940-944)
# and torch.save (_dump_to_file, L1044).

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="SGLang dumps are torch files")
EXTEND, DECODE, MIXED, TARGET_VERIFY = 1, 2, 3, 5  # SGLang's ForwardMode values (forward_batch_info.py L198-212)
REDUNDANT = 8  # --ep-num-redundant-experts 8: physical slots 384..391


def sglang_map(permuted: bool = True) -> npt.NDArray[np.int64]:
    """last_physical_to_logical_map [layers, physical]: ExpertLocationMetadata.init_trivial's (expert_location.py
    L121-130: arange % experts, then append_trivial_expert_slots, L492-507), or each layer's logical ids shuffled
    over the physical slots, as an EPLB placement (init_by_mapping) has them."""
    base = np.concatenate([np.arange(EXPERTS), np.arange(REDUNDANT) % EXPERTS])
    rng = np.random.default_rng(7)
    return np.stack([rng.permutation(base) if permuted else base for _ in range(LAYERS)])


def sglang_pass(forward_pass_id: int, mode: int, logical: npt.NDArray[np.int64], mapping: npt.NDArray[np.int64],
                positions: list[int], extend_seq_lens: list[int] | None, seed: int) -> dict[str, Any]:
    """One record: ``logical`` [tokens, layers, 8] (-1: nothing routed) written as physical ids through
    ``mapping``, a random one of the slots that hold each logical expert."""
    import torch

    rng = np.random.default_rng(seed)
    tokens = logical.shape[0]
    physical = np.full((LAYERS, tokens, TOP_K), -1, dtype=np.int64)
    for t, layer, slot in zip(*np.nonzero(logical != -1)):
        physical[layer, t, slot] = rng.choice(np.flatnonzero(mapping[layer] == logical[t, layer, slot]))
    count = np.zeros((LAYERS, mapping.shape[1]), dtype=np.int32)
    return dict(forward_pass_id=forward_pass_id, rank=0, gatherer_key="primary",
                input_ids=[int(i) for i in rng.integers(0, 320, tokens)], positions=positions,
                extend_seq_lens=extend_seq_lens, forward_mode=mode,
                topk_ids_of_layer=torch.from_numpy(physical).to(torch.int32), misc_objects=[],
                global_physical_count=torch.from_numpy(count))


def sglang_logical(tokens: int, seed: int) -> npt.NDArray[np.int64]:
    """[tokens, 4, 8]: layer 0 (dense) all -1, as SGLang leaves it; 8 distinct logical experts per MoE layer."""
    rng = np.random.default_rng(seed)
    out = np.full((tokens, LAYERS, TOP_K), -1, dtype=np.int64)
    for t in range(tokens):
        for layer in range(1, LAYERS):
            out[t, layer] = rng.choice(EXPERTS, TOP_K, replace=False)
    return out


def save_dump(path: Path, records: list[dict[str, Any]], mapping: npt.NDArray[np.int64], dtype: str = "int64",
              ids_dtype: str | None = None) -> Path:
    import torch

    if ids_dtype is not None:
        for record in records:
            record["topk_ids_of_layer"] = record["topk_ids_of_layer"].to(getattr(torch, ids_dtype))
    torch.save(dict(records=records, last_physical_to_logical_map=torch.from_numpy(mapping).to(getattr(torch, dtype))),
               str(path))
    return path


def served(tmp_path: Path, mapping: npt.NDArray[np.int64] | None = None, dtype: str = "int64",
           ids_dtype: str | None = None) -> tuple[Path, list[tuple[dict[str, Any], npt.NDArray[np.int64]]]]:
    """A dump of two prompts (5 and 3 tokens) prefilled in one pass, then three decode passes of both; between
    them a pass that routed nothing (a dense drafter's); in the last decode pass a third, padding token (-1 in every
    layer). Returns the file and each record with its logical ids."""
    mapping = sglang_map() if mapping is None else mapping
    plan = [(1, EXTEND, [*range(5), *range(3)], [5, 3])] + [(2 + s, DECODE, [5 + s, 3 + s], None) for s in range(3)]
    records = []
    for seed, (forward_pass_id, mode, positions, lens) in enumerate(plan):
        logical = sglang_logical(len(positions), seed)
        records.append((sglang_pass(forward_pass_id, mode, logical, mapping, positions, lens, seed), logical))
    padded = np.concatenate([records[-1][1], np.full((1, LAYERS, TOP_K), -1)])
    records[-1] = (sglang_pass(4, DECODE, padded, mapping, [7, 5, 0], None, 3), padded[:2])
    drafter = sglang_pass(1, DECODE, np.full((2, LAYERS, TOP_K), -1), mapping, [5, 3], None, 9)
    dump = save_dump(tmp_path / "expert_distribution_recorder_1730000000.0_0.pt",
                     [records[0][0], drafter, *[r for r, _ in records[1:]]], mapping, dtype, ids_dtype)
    return dump, records


def trace_rows(trace: Path) -> pl.DataFrame:
    from moetrace.trace.reader import open_traces

    return open_traces(trace)[0].routing().collect().sort("step", "request", "position", "layer")


@needs_torch
@pytest.mark.parametrize("dtype, ids_dtype", [("int64", None), ("int32", "int16"), ("int16", "int64")])
def test_sglang_per_token_dump_reads_back_as_the_logical_ids_it_was_made_of(tmp_path: Path, dtype: str,
                                                                            ids_dtype: str | None) -> None:
    """Physical ids, redundant slots included, come back as the logical ids they were drawn for, whatever integer
    dtype the map and the ids have; each pass is a step, each token group of it a request of its own."""
    dump, records = served(tmp_path, dtype=dtype, ids_dtype=ids_dtype)
    result = import_trace(str(dump), "-o", str(tmp_path / "t"))
    assert result.exit_code == 0, result.output
    assert "imported 4 forward passes, 14 tokens" in result.output
    rows = trace_rows(tmp_path / "t")
    assert rows.height == 14 * 3 and rows["weights"].explode().is_nan().all()
    for step, (record, logical) in enumerate(records):
        got = rows.filter(pl.col("step") == step)
        tokens = len(logical)
        assert got["position"].to_list()[::3] == record["positions"][:tokens]
        assert got["token"].to_list()[::3] == record["input_ids"][:tokens]
        assert sorted(set(got["layer"])) == [1, 2, 3]
        expected = np.sort(logical[:, 1:, :], axis=-1).reshape(-1, TOP_K)
        assert np.array_equal(np.sort(np.stack(got["experts"].to_list()), axis=-1), expected)
        assert set(got["phase"].cast(pl.String)) == {"prefill" if step == 0 else "decode"}
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["requests"][:3] == ["pass1-0", "pass1-1", "pass2-0"] and len(manifest["requests"]) == 8
    assert manifest["model"]["moe_layers"] == [1, 2, 3] and manifest["spec"] == {"method": None, "k": 0}
    source = manifest["source"]
    assert source["engine"] == "sglang" and source["lacks"] == ["request_identity", "router_weights", "step_timing"]
    assert (source["forward_passes"], source["passes_without_routing"], source["padding_rows"]) == (4, 1, 1)
    steps = pl.read_parquet(tmp_path / "t" / "steps").sort("step", "request")
    assert steps["num_tokens"].to_list() == [5, 3] + [1, 1] * 3 and set(steps["batch_size"]) == {2}


@needs_torch
def test_sglang_mixed_pass_takes_one_token_groups_as_decodes(tmp_path: Path) -> None:
    """--enable-mixed-chunk: a prefill chunk of 4 tokens and two running requests' decode tokens in one pass."""
    mapping = sglang_map(permuted=False)
    record = sglang_pass(1, MIXED, sglang_logical(6, 0), mapping, [0, 1, 2, 3, 9, 4], [4, 1, 1], 0)
    result = import_trace(str(save_dump(tmp_path / "d.pt", [record], mapping)), "-o", str(tmp_path / "t"))
    assert result.exit_code == 0, result.output
    rows = trace_rows(tmp_path / "t").filter(pl.col("layer") == 1)
    assert rows["phase"].cast(pl.String).to_list() == ["prefill"] * 4 + ["decode"] * 2
    assert rows["request"].to_list() == [0, 0, 0, 0, 1, 2]


@needs_torch
@pytest.mark.parametrize("mode, message", [("stat", "stat dump holds expert counts (logical_count [3, 4, 384])"),
                                           ("per_pass", "per_pass dump holds expert counts per forward pass")])
def test_sglang_count_dumps_are_refused_with_what_they_lack(tmp_path: Path, mode: str, message: str) -> None:
    """stat (_StatAccumulator.dump, L998-1006: rank 0's file) and per_pass (_SelectExpertsSinglePassGatherer's
    global_physical_count per record, L614-626) hold counts, not a token's experts: no trace, nothing written."""
    import torch

    if mode == "stat":
        dump: dict[str, Any] = dict(rank=0, logical_count=torch.zeros((3, LAYERS, EXPERTS), dtype=torch.int32),
                                    average_utilization_rate_over_window=None)
    else:
        dump = dict(records=[dict(forward_pass_id=1, rank=0, gatherer_key="primary",
                                  global_physical_count=torch.zeros((LAYERS, EXPERTS), dtype=torch.int32))],
                    last_physical_to_logical_map=torch.arange(EXPERTS).repeat(LAYERS, 1))
    torch.save(dump, str(tmp_path / "d.pt"))
    result = CliRunner().invoke(main, ["import", str(tmp_path / "d.pt"), "-o", str(tmp_path / "t")])
    assert result.exit_code == 1 and message in result.output, result.output
    assert ("--init-expert-location" in result.output) == (mode == "stat") and "per_token" in result.output
    assert not (tmp_path / "t").exists()


def sglang_trap(change: Any) -> Any:
    """A dump of two passes (one extend of 3 tokens, one decode of 2) with ``change(records, mapping)`` applied
    before saving; ``change`` may return the object to save instead."""
    def make(tmp_path: Path) -> list[str]:
        import torch

        mapping = sglang_map()
        records = [sglang_pass(1, EXTEND, sglang_logical(3, 0), mapping, [0, 1, 2], [3], 0),
                   sglang_pass(2, DECODE, sglang_logical(2, 1), mapping, [3, 7], None, 1)]
        dump: Any = dict(records=records, last_physical_to_logical_map=torch.from_numpy(mapping))
        dump = change(dump) or dump
        torch.save(dump, str(tmp_path / "d.pt"))
        return [str(tmp_path / "d.pt")]
    return make


def set_ids(record: dict[str, Any], layer: int, token: int, slots: slice, value: int) -> None:
    record["topk_ids_of_layer"][layer, token, slots] = value


def cut_file(tmp_path: Path) -> list[str]:
    sglang_trap(lambda d: None)(tmp_path)
    data = (tmp_path / "d.pt").read_bytes()
    (tmp_path / "d.pt").write_bytes(data[: len(data) // 2])
    return [str(tmp_path / "d.pt")]


def pickled_object(tmp_path: Path) -> list[str]:
    import torch

    torch.save({"records": np.zeros(3)}, str(tmp_path / "d.pt"))  # a numpy array: unpickled only by running code
    return [str(tmp_path / "d.pt")]


def not_torch(tmp_path: Path) -> list[str]:
    (tmp_path / "d.pt").write_text("routing, but not a torch file\n")
    return [str(tmp_path / "d.pt")]


@needs_torch
@pytest.mark.parametrize("make, message", [
    (not_torch, "d.pt: not a readable torch.save file"),
    (cut_file, "d.pt: not a readable torch.save file (truncated"),
    (pickled_object, "will not unpickle"),
    (lambda p: [str(p / "missing.pt")], "missing.pt: no such file"),
    (sglang_trap(lambda d: {"records": d["records"], "physical_to_logical_map": d["last_physical_to_logical_map"]}),
     "not an SGLang expert distribution dump (keys ['physical_to_logical_map', 'records']"),
    (sglang_trap(lambda d: {**d, "records": []}), "holds no forward passes"),
    (sglang_trap(lambda d: d["records"][1].pop("positions") and None), "record 1 lacks positions"),
    (sglang_trap(lambda d: set_ids(d["records"][1], 2, 0, slice(0, 1), EXPERTS + REDUNDANT)),
     "forward pass 2 (record 1): physical expert id 392 but last_physical_to_logical_map has 392 physical experts"),
    (sglang_trap(lambda d: d["last_physical_to_logical_map"].__setitem__((1, 5), EXPERTS)),
     "last_physical_to_logical_map names logical expert 384 but the model has 384 experts"),
    (sglang_trap(lambda d: {**d, "last_physical_to_logical_map": d["last_physical_to_logical_map"][1:]}),
     "last_physical_to_logical_map has shape [3, 392], not [4 layers (the model's)"),
    (sglang_trap(lambda d: d["records"][0].__setitem__("topk_ids_of_layer",
                                                       d["records"][0]["topk_ids_of_layer"][:, :, :4])),
     "4 expert ids per token, the model's top-k is 8"),
    (sglang_trap(lambda d: d["records"][0].__setitem__("topk_ids_of_layer",
                                                       d["records"][0]["topk_ids_of_layer"].float())),
     "topk_ids_of_layer: dtype float32, not an integer type (int16/int32/int64)"),
    (sglang_trap(lambda d: d["records"][1].__setitem__("forward_mode", TARGET_VERIFY)),
     "forward pass 2 (record 1): a speculative verification pass (TARGET_VERIFY)"),
    (sglang_trap(lambda d: d["records"][1].__setitem__("forward_mode", 6)), "forward mode 6 routed tokens"),
    (sglang_trap(lambda d: set_ids(d["records"][0], 0, 1, slice(0, 8), 3)),
     "layers [0, 1, 2, 3] routed, the model's MoE layers are [1, 2, 3]"),
    (sglang_trap(lambda d: set_ids(d["records"][0], 1, 1, slice(0, 2), -1)), "-1 padding in part of a token's experts"),
    (sglang_trap(lambda d: set_ids(d["records"][0], 3, 2, slice(0, 8), -1)),
     "tokens routed in some MoE layers and not in others"),
    (sglang_trap(lambda d: d["records"][0].__setitem__("extend_seq_lens", [2, 2])),
     "extend_seq_lens [2, 2] do not add up to its 3 tokens"),
    (sglang_trap(lambda d: d["records"][1].__setitem__("forward_pass_id", 1)),
     "pass 1 (record 1): an earlier pass of this forward_pass_id"),
    (sglang_trap(lambda d: d["records"][1].__setitem__("rank", 1)), "records of ranks 0, 1"),
    (sglang_trap(lambda d: [set_ids(r, slice(None), slice(None), slice(None), -1) for r in d["records"]] and None),
     "no forward pass in it routed a token"),
    (lambda p: [*sglang_trap(lambda d: None)(p), "--prompt-start", "2"], "--outputs and --prompt-start"),
])
def test_bad_sglang_dump_gets_one_line_and_nothing_is_written(tmp_path: Path, make: Any, message: str) -> None:
    args = make(tmp_path)
    result = CliRunner().invoke(main, ["import", *args, "-o", str(tmp_path / "t")])
    assert result.exit_code == 1 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob(".t.*"))


@needs_torch
def test_sglang_dump_imports_as_a_subprocess_and_fails_in_one_line(tmp_path: Path) -> None:
    dump, records = served(tmp_path)
    done = subprocess.run([sys.executable, "-m", "moetrace", "import", str(dump), "-o", str(tmp_path / "t")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "imported 4 forward passes, 14 tokens" in done.stdout
    rows = trace_rows(tmp_path / "t").filter(pl.col("step") == 0)
    assert np.array_equal(np.sort(np.stack(rows["experts"].to_list()), axis=-1),
                          np.sort(records[0][1][:, 1:, :], axis=-1).reshape(-1, TOP_K))
    sglang_trap(lambda d: d["records"][1].__setitem__("forward_mode", TARGET_VERIFY))(tmp_path)
    failed = subprocess.run([sys.executable, "-m", "moetrace", "import", str(tmp_path / "d.pt"), "-o",
                             str(tmp_path / "v")], capture_output=True, text=True, check=False)
    assert failed.returncode == 1 and "TARGET_VERIFY" in failed.stderr and "Traceback" not in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1 and not (tmp_path / "v").exists()


@needs_torch
def test_report_of_a_recorder_dump_says_no_growth_per_k_without_request_identity(tmp_path: Path) -> None:
    """Each token group is its own request: no windows of k+1 consecutive tokens exist, and the report says so in
    place of calling its k>0 figures counterfactual."""
    dump, _ = served(tmp_path)
    assert import_trace(str(dump), "-o", str(tmp_path / "t")).exit_code == 0
    report = CliRunner().invoke(main, ["report", str(tmp_path / "t"), "--k", "3", "--json", "-o",
                                       str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    notes = json.loads(report.stdout)["runs"][0]["notes"]
    assert "its source does not say which tokens are one request: no windows of 4 consecutive tokens, so no " \
           "growth at k=3; only the union of each step's batch is measured" in notes
    assert not any("counterfactual (windows" in note for note in notes)
