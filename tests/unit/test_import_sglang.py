"""`moetrace import DUMP.pt`: SGLang's expert distribution recorder dumps read back as a moetrace trace of the logical
experts they were made of, and every trap of the format refused in one line with nothing written."""

from __future__ import annotations

import importlib.util
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

from cli_results import invoke
from moetrace.cli import main

LAYERS, EXPERTS, TOP_K = 4, 384, 8  # the embedded default model: layer 0 dense, layers 1-3 MoE


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
    result = invoke("import", str(dump), "-o", str(tmp_path / "t"))
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
    result = invoke("import", str(save_dump(tmp_path / "d.pt", [record], mapping)), "-o", str(tmp_path / "t"))
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
    assert invoke("import", str(dump), "-o", str(tmp_path / "t")).exit_code == 0
    report = CliRunner().invoke(main, ["report", str(tmp_path / "t"), "--k", "3", "--json", "-o",
                                       str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    notes = json.loads(report.stdout)["runs"][0]["notes"]
    assert "its source does not say which tokens are one request: no windows of 4 consecutive tokens, so no " \
           "growth at k=3; only the union of each step's batch is measured" in notes
    assert not any("counterfactual (windows" in note for note in notes)
