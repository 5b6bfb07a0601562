"""What a Hugging Face ``config.json`` says about a MoE model, read one way for recording (which model to record)
and analysis (the shape that prices it): DeepseekV3/Kimi, Qwen-MoE and Mixtral key names, and a multimodal
model's ``text_config`` (Kimi-K2.5)."""

from __future__ import annotations

from typing import Any

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")

# The width a latent MoE's routed experts compute in: the hidden state is projected down to it before the experts
# and back up after them (Kimi-K3: ``routed_expert_hidden_size`` of vLLM 0.32's ``KimiLinearConfig``, the text
# config of ``KimiK3Config``). Absent or null: the experts take the hidden size.
LATENT_WIDTH_KEYS = ("routed_expert_hidden_size",)


def config_value(config: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` set in a Hugging Face config or its ``text_config`` (multimodal models)."""
    for node in (config, config.get("text_config") or {}):
        for key in keys:
            if node.get(key) is not None:
                return node[key]
    return None


def config_expert_count(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer named by a Hugging Face config; 0 for a dense model."""
    count = config_value(config, *EXPERT_COUNT_KEYS)
    return int(count) if isinstance(count, int) and count > 1 else 0


def expert_hidden_size(config: dict[str, Any]) -> int | None:
    """The width a latent MoE's routed experts compute in (``LATENT_WIDTH_KEYS``); None where the experts take
    the hidden size."""
    width = config_value(config, *LATENT_WIDTH_KEYS)
    return int(width) if isinstance(width, int) and width > 0 else None


def attention_layers(config: dict[str, Any]) -> int | None:
    """Decoder layers whose attention cache grows with context: all of them, except in a hybrid model whose
    ``linear_attn_config`` names its full-attention layers (Kimi-Linear and Kimi-K3: ``full_attn_layers`` MLA,
    ``kda_layers`` Kimi Delta Attention, whose state per request is fixed). None where the config does not say."""
    linear = config_value(config, "linear_attn_config")
    if isinstance(linear, dict) and linear.get("full_attn_layers") is not None:
        return len(linear["full_attn_layers"])
    layers = config_value(config, "num_hidden_layers")
    return int(layers) if layers else None


def kv_bytes_per_token(config: dict[str, Any], tp: int, cache_bytes: int) -> int | None:
    """KV-cache bytes one token holds on one of ``tp`` tensor-parallel ranks, over the layers whose cache grows
    with context (``attention_layers``), at
    ``cache_bytes`` per element: MLA keeps one latent (``kv_lora_rank`` + ``qk_rope_head_dim``) per token and layer
    on every rank; multi-head and grouped-query attention keep keys and values of their KV heads, split over the
    ranks. None where the config does not say."""
    layers = attention_layers(config)  # a hybrid model's linear-attention layers keep a fixed state, no KV
    latent = config_value(config, "kv_lora_rank")
    if not layers:
        return None
    if latent:
        return (int(latent) + int(config_value(config, "qk_rope_head_dim") or 0)) * cache_bytes * int(layers)
    heads = config_value(config, "num_key_value_heads", "num_attention_heads")
    hidden = config_value(config, "hidden_size")
    if not heads or not hidden:
        return None
    head_dim = int(config_value(config, "head_dim") or int(hidden) // int(config_value(config, "num_attention_heads")
                                                                         or heads))
    return 2 * max(1, int(heads) // tp) * head_dim * cache_bytes * int(layers)
