"""The embedded default: a tiny checkpoint of Kimi-K2's architecture with random weights.

DeepseekV3 layout, 384 routed experts, top-8, sigmoid scores with a selection bias (``noaux_tc``), one shared
expert, the first layer dense, byte-level vocabulary, MLA head dims that vLLM's GPU backends accept. It runs in
float32 on the CPU (where the transformers comparison needs it) and in bfloat16 on a GPU (no CUDA MLA backend
takes float32). Built once, deterministically, by transformers' own
initialisation, and cached. Its routing is a random network's routing: it exists so that the whole path runs
anywhere and so that vLLM's routing can be checked against transformers on the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "kimi-k2-tiny-random"
BYTE_VOCAB = 256
BOS_ID, EOS_ID = 256, 257

CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "torch_dtype": "float32",
    "vocab_size": 320,  # 256 bytes + BOS/EOS, padded
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 512,  # CPU MLA takes head size 576 = kv_lora_rank + qk_rope_head_dim only
    # (qk_nope, qk_rope, v) = (64, 64, 128): one of the three head-dim triples that vLLM's only MLA prefill backend
    # on Hopper (FlashAttention) accepts, besides Kimi/DeepSeek's (128, 64, 128) and (192, 64, 256).
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    # YaRN with factor 1 is plain RoPE (theta 50000), but it makes vLLM build DeepseekScalingRotaryEmbedding (the
    # class real Kimi-K2 gets), whose CPU path is PyTorch-native. With rope_type "default" vLLM builds
    # RotaryEmbedding, whose CPU kernel (_C.rotary_embedding) mis-rotates MLA's strided q_pe/k_pe views (it takes the
    # token stride from dim -2): hidden states drift from transformers from the second token on.
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,  # one MTP layer (a MoE decoder layer), so `--method mtp` has a drafter
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "initializer_range": 0.02,
}
SEED = 20261129
# Spread of the selection bias: transformers initialises it to zero, which would hide the noaux_tc path.
BIAS_STD = 0.02


def runtime_dtype(on_gpu: bool) -> str:
    """float32 on the CPU (the transformers comparison needs it); bfloat16 on a GPU (no CUDA MLA backend takes
    float32)."""
    return "bfloat16" if on_gpu else "float32"


def cache_root() -> Path:
    return Path(os.environ.get("MOETRACE_CACHE", Path.home() / ".cache" / "moetrace"))


def default_model_dir() -> Path:
    fingerprint = hashlib.sha256(json.dumps([CONFIG, SEED, BIAS_STD], sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / f"{DEFAULT_MODEL_NAME}-{fingerprint}"


def ensure_default_model() -> Path:
    """Return the cached checkpoint, building it first if needed (atomic: a crash leaves no half checkpoint)."""
    target = default_model_dir()
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    # transformers has no MTP module: build the MTP layer's decoder as one more ordinary layer (same names as the
    # checkpoint's layer L), then add the MTP-only tensors. vLLM's target model skips them; its MTP drafter loads
    # them. transformers, loading the L-layer config, ignores them.
    num_layers, mtp_layers = CONFIG["num_hidden_layers"], CONFIG["num_nextn_predict_layers"]
    config = DeepseekV3Config(**{
        **{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")},
        "num_hidden_layers": num_layers + mtp_layers,
    })
    model = DeepseekV3ForCausalLM(config).float().eval()  # type: ignore[no-untyped-call]
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                bias = torch.randn(gate.e_score_correction_bias.shape, generator=generator) * BIAS_STD
                gate.e_score_correction_bias.copy_(bias)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        add_mtp_tensors(staging / "model.safetensors", num_layers, mtp_layers, generator)
        config_json = json.loads((staging / "config.json").read_text())
        config_json.update({"topk_method": CONFIG["topk_method"], "scoring_func": CONFIG["scoring_func"],
                            "num_hidden_layers": num_layers, "num_nextn_predict_layers": mtp_layers})
        (staging / "config.json").write_text(json.dumps(config_json, indent=2))
        (staging / "moetrace.json").write_text(json.dumps({"name": DEFAULT_MODEL_NAME, "random_weights": True}))
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").exists():  # another process may have won the race
            raise
    return target


def add_mtp_tensors(path: Path, first_mtp_layer: int, mtp_layers: int, generator: Any) -> None:
    """The tensors DeepSeek's MTP layer has beyond a decoder layer: input norms, the projection of
    [embedding; hidden] and the shared head."""
    import torch
    from safetensors.torch import load_file, save_file

    hidden, vocab, std = CONFIG["hidden_size"], CONFIG["vocab_size"], CONFIG["initializer_range"]
    tensors = load_file(path)
    for layer in range(first_mtp_layer, first_mtp_layer + mtp_layers):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "enorm.weight"] = torch.ones(hidden)
        tensors[prefix + "hnorm.weight"] = torch.ones(hidden)
        tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * std
        tensors[prefix + "shared_head.norm.weight"] = torch.ones(hidden)
        tensors[prefix + "shared_head.head.weight"] = torch.randn(vocab, hidden, generator=generator) * std
    save_file(tensors, path, metadata={"format": "pt"})


def encode_text(text: str) -> list[int]:
    """Byte-level tokenisation of the default model: one token per UTF-8 byte, after BOS."""
    return [BOS_ID, *text.encode("utf-8")]


def decode_tokens(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < BYTE_VOCAB).decode("utf-8", errors="replace")
