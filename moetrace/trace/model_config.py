"""What a Hugging Face ``config.json`` says about a MoE model, read one way for recording (which model to record)
and analysis (the shape that prices it): DeepseekV3/Kimi, Qwen-MoE and Mixtral key names, and a multimodal
model's ``text_config`` (Kimi-K2.5)."""

from __future__ import annotations

from typing import Any

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


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
