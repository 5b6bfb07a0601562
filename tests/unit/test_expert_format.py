"""The routed experts' weight format read from a checkpoint's quantisation config, priced with its scales; a format
the cost model cannot price is named, and the report asks for a shape in one line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner
from trace_builder import Model, verify_tokens, write_trace

from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.cli import main
from moetrace.hooks.manifest import ExpertFormat, expert_weight_format
from moetrace.trace.reader import open_trace

# Kimi-K2.5's quantization_config (config.json of moonshotai/Kimi-K2.5), and Kimi-K2's
KIMI_K25 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}
KIMI_K2 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def read(quant: dict[str, object] | None) -> ExpertFormat:
    return expert_weight_format(SimpleNamespace(quantization_config=quant), torch.bfloat16)


def test_kimi_k25_int4_experts_and_kimi_k2_fp8_blocks_are_read_with_their_scales() -> None:
    assert read(KIMI_K25) == ExpertFormat(4, 32, 16, "compressed-tensors int4 group 32")
    assert read(KIMI_K2) == ExpertFormat(8, 128 * 128, 32, "fp8 block 128x128")
    assert read(None) == ExpertFormat(16, None, 0, "bfloat16")


def test_experts_a_compressed_tensors_checkpoint_leaves_unquantized_keep_the_models_dtype() -> None:
    attention_only = {**KIMI_K25, "ignore": ["lm_head", "re:.*mlp\\.experts.*"]}
    assert read(attention_only) == ExpertFormat(16, None, 0, "bfloat16")


@pytest.mark.parametrize(("quant", "bits", "per_scale", "scale_bytes"), [(KIMI_K25, 4, 32, 2), (KIMI_K2, 8, 16384, 4)])
def test_the_bytes_priced_per_expert_count_weights_and_one_scale_per_group(
        quant: dict[str, object], bits: int, per_scale: int, scale_bytes: int) -> None:
    found = read(quant)
    shape = ModelShape(num_experts=384, top_k=8, num_layers=61, moe_layers=60, hidden_size=7168, expert_width=2048,
                       shared_experts=1, expert_weight_bits=found.bits, quant_group_size=found.group,
                       scale_bits=found.scale_bits)
    weights = 3 * 7168 * 2048  # gate, up and down of one Kimi-K2 expert
    assert shape.expert_bytes == weights * bits // 8 + (weights // per_scale) * scale_bytes
    if quant is KIMI_K25:
        assert shape.expert_bytes == SHAPE_PRESETS["kimi-k2"].expert_bytes == 24_772_608


def test_a_format_the_cost_model_cannot_price_leaves_only_the_byte_figures_out_and_says_which(
        tmp_path: Path) -> None:
    assert read({"quant_method": "mxfp4"}) == ExpertFormat(0, None, 0, "mxfp4")
    model = Model(num_experts=8, top_k=2)
    root = write_trace(tmp_path / "t", verify_tokens(np.random.default_rng(0), model, requests=2, steps=3, k=2,
                                                     accept_prob=0.5), model, k=2)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["model"].update(expert_format="mxfp4", expert_weight_bits=None)
    (root / "manifest.json").write_text(json.dumps(manifest))
    steps = open_trace(root).steps().collect()
    result = CliRunner().invoke(main, ["report", str(root), "--k", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    run = report["runs"][0]
    left_out = ("its experts are stored as mxfp4, whose bytes the cost model cannot count: left out the expert bytes "
                "per step, the bytes budgets save and the predicted speedup (give --shape kimi-k2 or another preset "
                "to price them as that model's)")
    assert [line for line in report["warnings"] if "mxfp4" in line] == [
        f"t: no recommendation at 1, 8, 32, 128 request(s) per step: {left_out}"]
    assert {row["k"] for row in report["decision"][0]["per_batch"]} == {None}
    # everything else is there: acceptance (against the steps table), experts read, budgets, the other bytes
    at_k = next(row for row in run["acceptance_per_k"] if row["k"] == 2)
    drafted = steps.filter(pl.col("num_drafts") > 0)
    assert at_k["mean_accepted"] == pytest.approx(drafted["num_accepted"].mean())
    assert all(row["unique_experts"] > 0 and row["expert_weight_bytes"] is None and row["allreduce_bytes"] == 0
               for row in run["step_bytes"])
    assert run["budget"]["min_budget"] >= 2 and run["budget"]["bytes_saved_per_window"] is None
    priced = CliRunner().invoke(main, ["report", str(root), "--k", "2", "--json", "--shape", "kimi-k2"])
    assert priced.exit_code == 1  # the preset is checked against the trace's experts: 8 here, not Kimi-K2's 384
    assert priced.output.splitlines() == [
        f"error: --shape kimi-k2: 384 experts top-8, but {open_trace(root).path} routes over 8 experts top-2"]
