"""The embedded default: a tiny model of Kimi-K2's architecture, trained, shipped inside the package.

DeepseekV3 layout, 384 routed experts, top-8, sigmoid scores with a selection bias (``noaux_tc``), one shared
expert, the first layer dense, one MTP layer (so ``--method mtp`` has a drafter), byte-level vocabulary, MLA head
dims that vLLM's GPU backends accept. Trained by ``scripts/train_default_model.py`` on the Python standard
library's source (the metadata of the weights file names the corpus, seed and command), so its routing is learned
routing. The weights ship as int8 with one scale per output row (``data/kimi-k2-tiny.safetensors``, checksummed);
the first use unpacks them into a checkpoint vLLM and transformers load, cached. It runs in float32 on the CPU
(where the transformers comparison needs it) and in bfloat16 on a GPU (no CUDA MLA backend takes float32).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from moetrace.errors import UserError

DEFAULT_MODEL_NAME = "kimi-k2-tiny"
WEIGHTS_FILE = Path(__file__).parent / "data" / "kimi-k2-tiny.safetensors"
WEIGHTS_SHA256 = "538d89cebe20e93fdffd5152cda77d534d99df8be03f22eadcda532ab398d68e"
BYTE_VOCAB = 256
BOS_ID, EOS_ID = 256, 257
# Standard-library modules left out of training: the built-in code prompts come from them.
HELD_OUT_MODULES = ("fractions.py", "textwrap.py", "heapq.py", "json/")

CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "torch_dtype": "float32",
    "vocab_size": 320,  # 256 bytes + BOS/EOS, padded
    "hidden_size": 64,
    "intermediate_size": 256,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
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


def runtime_dtype(on_gpu: bool) -> str:
    """float32 on the CPU (the transformers comparison needs it); bfloat16 on a GPU (no CUDA MLA backend takes
    float32)."""
    return "bfloat16" if on_gpu else "float32"


def cache_root() -> Path:
    return Path(os.environ.get("MOETRACE_CACHE", Path.home() / ".cache" / "moetrace"))


def default_model_dir() -> Path:
    fingerprint = hashlib.sha256(json.dumps([CONFIG, WEIGHTS_SHA256], sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / f"{DEFAULT_MODEL_NAME}-{fingerprint}"


def read_packed_weights(path: Path, sha256: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Packed tensors and their training metadata, after checking the file's checksum (if one is given)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise UserError(f"the default model's weights are missing ({path}: {exc.strerror}); "
                        "reinstall moetrace") from None
    if sha256 is not None and digest != sha256:
        raise UserError(f"the default model's weights are corrupt ({path}: sha256 {digest[:12]}..., expected "
                        f"{sha256[:12]}...); reinstall moetrace")
    with safe_open(str(path), framework="pt") as handle:
        metadata = json.loads((handle.metadata() or {}).get("moetrace_training", "{}"))
    return load_file(path), metadata


def unpack_checkpoint(packed: dict[str, Any]) -> dict[str, Any]:
    """int8 rows times their scales, stacked experts split into DeepseekV3's per-expert names; float32."""
    tensors: dict[str, Any] = {}
    for name, tensor in packed.items():
        if name.endswith(".scale"):
            continue
        scale = packed.get(name + ".scale")
        value = tensor.float() * scale.unsqueeze(-1) if scale is not None else tensor.float()
        stem, _, kind = name.rpartition(".experts.")
        if stem and kind in ("gate_proj", "up_proj", "down_proj"):
            for expert, matrix in enumerate(value):
                tensors[f"{stem}.experts.{expert}.{kind}.weight"] = matrix.contiguous()
        else:
            tensors[name] = value.contiguous()
    return tensors


def write_checkpoint(tensors: dict[str, Any], target: Path, description: dict[str, Any],
                     config: dict[str, Any] | None = None) -> None:
    """A checkpoint directory vLLM and transformers load: config.json (the default model's unless ``config``),
    model.safetensors, moetrace.json."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(CONFIG if config is None else config, indent=2))
    (target / "moetrace.json").write_text(json.dumps(description, indent=2))


def draft_model_config() -> dict[str, Any]:
    """The default model cut to its dense first layer, as a DeepseekV2 model without MTP layers (vLLM runs a
    DeepseekV3 drafter with MTP layers as MTP, not as a draft model)."""
    config = {**CONFIG, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
              "num_hidden_layers": 1}
    config.pop("num_nextn_predict_layers")
    return config


DRAFT_MODEL_TENSORS = ("model.embed_tokens.", "model.layers.0.", "model.norm.", "lm_head.")


def _ensure_checkpoint(target: Path, name: str, config: dict[str, Any] | None, keep: tuple[str, ...] = ()) -> Path:
    """``target``, unpacking the shipped weights there first if needed (only the tensors named with a prefix in
    ``keep``, where given; atomic: a crash leaves no half checkpoint)."""
    if (target / "config.json").exists():
        return target
    packed, training = read_packed_weights(WEIGHTS_FILE, WEIGHTS_SHA256)
    tensors = {key: value for key, value in unpack_checkpoint(packed).items() if not keep or key.startswith(keep)}
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        write_checkpoint(tensors, staging, {"name": name, "random_weights": False, "training": training}, config)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").exists():  # another process may have won the race
            raise
    return target


def ensure_default_model() -> Path:
    """The cached checkpoint of the default model."""
    return _ensure_checkpoint(default_model_dir(), DEFAULT_MODEL_NAME, None)


def ensure_default_draft_model() -> Path:
    """The cached draft model of the default model for ``--method draft_model``: its embedding, dense first
    layer, final norm and LM head (a one-layer early exit of the target; no training of its own)."""
    target = default_model_dir().with_name(default_model_dir().name + "-draft")
    return _ensure_checkpoint(target, f"{DEFAULT_MODEL_NAME}-draft", draft_model_config(), DRAFT_MODEL_TENSORS)


def encode_text(text: str) -> list[int]:
    """Byte-level tokenisation of the default model: one token per UTF-8 byte, after BOS."""
    return [BOS_ID, *text.encode("utf-8")]


def decode_tokens(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < BYTE_VOCAB).decode("utf-8", errors="replace")
