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

from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape, shape_from_config
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
# 4-bit float experts as vLLM 0.32 recognises them: MXFP4 ("mxfp4", GPT-OSS's config.json), ModelOpt NVFP4 (config.json
# form and hf_quant_config.json form), and compressed-tensors' NVFP4 and MXFP4 presets (weights as
# ``QuantizationArgs.model_dump`` writes them)
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}
NVFP4_MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                  "ignore": ["lm_head", "re:.*self_attn.*"]}
NVFP4_HF_QUANT = {"producer": {"name": "modelopt", "version": "0.37.0"}, "quant_method": "modelopt",
                  "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16,
                                   "exclude_modules": ["lm_head", "*self_attn*", "*block_sparse_moe.shared_experts*"]}}
NVFP4_CT = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                                       "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn"}}},
    "ignore": ["lm_head"]}
MXFP4_CT = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                                       "strategy": "group", "scale_dtype": "torch.uint8"}}}, "ignore": ["lm_head"]}
BITSANDBYTES = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}

# A Kimi-K3-shaped text config as vLLM 0.32's KimiLinearConfig names it (the text_config of KimiK3Config): 896
# routed experts, top-16, grouped top-k, experts in a latent width (``routed_expert_hidden_size``). The widths are
# illustrative, not K3's published ones.
K3_LATENT, K3_WIDTH, K3_HIDDEN = 3072, 1024, 7168
KIMI_K3 = {"model_type": "kimi_k3", "text_config": {
    "model_type": "kimi_linear", "num_hidden_layers": 64, "first_k_dense_replace": 1, "hidden_size": K3_HIDDEN,
    "moe_intermediate_size": K3_WIDTH, "routed_expert_hidden_size": K3_LATENT, "num_experts": 896,
    "num_experts_per_token": 16, "num_shared_experts": 1, "use_grouped_topk": True, "num_expert_group": 8,
    "topk_group": 4}}


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
    assert read(BITSANDBYTES) == ExpertFormat(0, None, 0, "bitsandbytes")
    model = Model(num_experts=8, top_k=2)
    root = write_trace(tmp_path / "t", verify_tokens(np.random.default_rng(0), model, requests=2, steps=3, k=2,
                                                     accept_prob=0.5), model, k=2)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["model"].update(expert_format="bitsandbytes", expert_weight_bits=None)
    (root / "manifest.json").write_text(json.dumps(manifest))
    steps = open_trace(root).steps().collect()
    result = CliRunner().invoke(main, ["report", str(root), "--k", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    run = report["runs"][0]
    left_out = ("its experts are stored as bitsandbytes, whose bytes the cost model cannot count: left out the expert "
                "bytes per step, the bytes budgets save and the predicted speedup (give --shape kimi-k2 or another "
                "preset to price them as that model's)")
    assert [line for line in report["warnings"] if "bitsandbytes" in line] == [
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


@pytest.mark.parametrize(("quant", "found"), [
    (MXFP4, ExpertFormat(4, 32, 8, "mxfp4")),
    (MXFP4_CT, ExpertFormat(4, 32, 8, "mxfp4 compressed-tensors group 32")),
    (NVFP4_MODELOPT, ExpertFormat(4, 16, 8, "nvfp4 modelopt NVFP4 16", 32)),
    (NVFP4_HF_QUANT, ExpertFormat(4, 16, 8, "nvfp4 modelopt W4A16_NVFP4 16", 32)),
    (NVFP4_CT, ExpertFormat(4, 16, 8, "nvfp4 compressed-tensors tensor_group 16", 32)),
])
def test_mxfp4_and_nvfp4_experts_are_read_from_the_configs_vllm_recognises(
        quant: dict[str, object], found: ExpertFormat) -> None:
    assert expert_weight_format(SimpleNamespace(quantization_config=quant, model_type="kimi_k3"),
                                torch.bfloat16) == found


def test_a_modelopt_checkpoint_that_excludes_the_experts_keeps_the_models_dtype() -> None:
    excluded = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4",
                                                            "exclude_modules": ["*block_sparse_moe.experts*"]}}
    assert expert_weight_format(SimpleNamespace(quantization_config=excluded, model_type="kimi_k3"),
                                torch.bfloat16) == ExpertFormat(16, None, 0, "bfloat16")


def test_the_kimi_k3_config_gives_896_experts_top_16_computed_in_the_latent_width() -> None:
    shape = shape_from_config(KIMI_K3)
    assert (shape.num_experts, shape.top_k, shape.moe_layers, shape.shared_experts) == (896, 16, 63, 1)
    assert (shape.hidden_size, shape.expert_hidden_size, shape.expert_width) == (K3_HIDDEN, K3_LATENT, K3_WIDTH)
    assert shape.expert_bytes == 3 * K3_LATENT * K3_WIDTH * 2  # bf16, no scales, the latent width not the hidden


@pytest.mark.parametrize(("quant", "nvfp4"), [(MXFP4, False), (MXFP4_CT, False), (NVFP4_MODELOPT, True),
                                             (NVFP4_HF_QUANT, True), (NVFP4_CT, True)])
def test_fp4_expert_bytes_of_a_kimi_k3_expert_are_its_values_at_4_bits_plus_its_scales(
        quant: dict[str, object], nvfp4: bool, tmp_path: Path) -> None:
    text = KIMI_K3["text_config"]
    assert isinstance(text, dict)
    # counted by hand from the config: gate and up (latent -> width) and down (width -> latent)
    values = 3 * text["routed_expert_hidden_size"] * text["moe_intermediate_size"]
    if nvfp4:  # one E4M3 byte per 16 values, one FP32 global scale per tensor (gate, up, down)
        by_hand = values // 2 + values // 16 * 1 + 3 * 4
    else:  # one E8M0 byte per 32 values
        by_hand = values // 2 + values // 32 * 1
    found = expert_weight_format(SimpleNamespace(quantization_config=quant, model_type="kimi_k3"), torch.bfloat16)
    shape = shape_from_config(KIMI_K3)
    priced = ModelShape(**{**shape.__dict__, "expert_weight_bits": found.bits, "quant_group_size": found.group,
                           "scale_bits": found.scale_bits, "tensor_scale_bits": found.tensor_scale_bits})
    assert priced.expert_bytes == by_hand
    # the same bytes from a recorded manifest, which names the format, its scales and the latent width as the
    # worker writes them
    model = Model(num_experts=896, top_k=16, hidden_size=K3_HIDDEN, expert_width=K3_WIDTH,
                  expert_weight_bits=found.bits, quant_group_size=found.group,
                  extra={"expert_format": found.name, "quant_scale_bits": found.scale_bits,
                         "quant_tensor_scale_bits": found.tensor_scale_bits or None,
                         "expert_hidden_size": K3_LATENT})
    root = write_trace(tmp_path / "k3", verify_tokens(np.random.default_rng(0), model, requests=1, steps=2, k=1,
                                                      accept_prob=0.5), model, k=1)
    assert ModelShape.from_manifest(open_trace(root).manifest).expert_bytes == by_hand


@pytest.mark.parametrize(("quant", "name"), [
    (BITSANDBYTES, "bitsandbytes"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "modelopt MIXED_PRECISION"),
    ({**MXFP4_CT, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                       "group_size": "thirty-two"}}}},
     "compressed-tensors (config not read: ValueError)"),
])
def test_a_format_or_config_moetrace_cannot_read_is_one_name_with_no_bits_never_a_traceback(
        quant: dict[str, object], name: str) -> None:
    found = read(quant)
    assert found == ExpertFormat(0, None, 0, name)
    shape = ModelShape(num_experts=896, top_k=16, num_layers=2, moe_layers=1, hidden_size=64, expert_width=32,
                       shared_experts=0, expert_weight_bits=0, quant_group_size=None, unpriced_format=found.name)
    note = shape.unpriced_note()
    assert note is not None and "\n" not in note and note.startswith(f"its experts are stored as {name}, ")
