"""The embedded default model: the training script's model is transformers' DeepseekV3, the shipped weights are
what they claim to be, and the built-in prompts were held out of training."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
from repo_scripts import load_script

from moetrace.default_model import (
    CONFIG,
    WEIGHTS_FILE,
    WEIGHTS_SHA256,
    read_packed_weights,
    unpack_checkpoint,
    write_checkpoint,
)
from moetrace.errors import UserError
from moetrace.recording.prompts import BUILTIN_PROMPTS


def training_script() -> ModuleType:
    return load_script("scripts/train_default_model.py")


def test_training_model_computes_what_transformers_deepseek_v3_computes_on_its_checkpoint(tmp_path: Path) -> None:
    from transformers import DeepseekV3ForCausalLM

    train = training_script()
    torch.manual_seed(0)
    model = train.TinyKimi().eval()
    with torch.no_grad():  # a spread selection bias and larger weights, so routing and attention are not trivial
        for moe in model.moe_layers():
            moe.e_score_correction_bias.normal_(0, 0.05)
        for parameter in model.parameters():
            parameter.mul_(4.0)
    write_checkpoint(unpack_checkpoint(train.checkpoint_tensors(model)), tmp_path, {"name": "test"})
    reference = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 258, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(tokens)
        theirs = reference(tokens).logits
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-3), (ours - theirs).abs().max()


def test_quantized_weights_come_back_within_half_a_step_of_each_row() -> None:
    train = training_script()
    torch.manual_seed(0)
    tensors = train.checkpoint_tensors(train.TinyKimi())
    restored = unpack_checkpoint(train.quantize(tensors))
    matrix = tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    step = matrix.abs().amax(dim=-1, keepdim=True) / 127
    error = (restored["model.layers.1.self_attn.kv_b_proj.weight"] - matrix).abs()
    assert bool((error <= step * 0.51 + 1e-7).all())
    expert = tensors["model.layers.2.mlp.experts.down_proj"][5]
    assert torch.allclose(restored["model.layers.2.mlp.experts.5.down_proj.weight"], expert,
                          atol=float(expert.abs().max()) / 127)
    assert torch.equal(restored["model.layers.1.mlp.gate.weight"], tensors["model.layers.1.mlp.gate.weight"])


def test_shipped_weights_are_at_most_8_mb_match_their_checksum_and_name_their_training() -> None:
    assert WEIGHTS_FILE.stat().st_size <= 8_000_000
    packed, training = read_packed_weights(WEIGHTS_FILE, WEIGHTS_SHA256)
    assert training["corpus"]["sha256"] and training["command"].startswith("python scripts/train_default_model.py")
    assert training["settings"]["seed"] and training["history"][-1]["valid_bits_per_byte"] < 3.0
    experts = packed[f"model.layers.{CONFIG['num_hidden_layers']}.mlp.experts.gate_proj"]
    assert experts.dtype == torch.int8 and experts.shape[0] == CONFIG["n_routed_experts"]


def test_corrupt_shipped_weights_give_one_line_error(tmp_path: Path) -> None:
    corrupt = tmp_path / "weights.safetensors"
    data = bytearray(WEIGHTS_FILE.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt .*reinstall moetrace"):
        read_packed_weights(corrupt, WEIGHTS_SHA256)


def test_builtin_prompts_were_held_out_of_the_training_corpus() -> None:
    train = training_script()
    _, training = read_packed_weights(WEIGHTS_FILE, WEIGHTS_SHA256)
    files, identity = train.load_corpus(None)
    if identity["sha256"] != training["corpus"]["sha256"]:
        pytest.skip(f"this Python's standard library is not the training corpus ({training['corpus']['origin']})")
    text = b"\n".join(data for _, data in files)
    for prompt in BUILTIN_PROMPTS:
        assert prompt[:60].encode() not in text, prompt[:60]
