"""The model shape that turns expert counts into bytes: from a trace's manifest, or a named real-size preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetrace.trace.model_config import attention_layers, config_expert_count, config_value, expert_hidden_size

if TYPE_CHECKING:
    from moetrace.trace.manifest import Manifest


class UnpricedFormat(ValueError):
    """The recorded experts' weight format (named) is one whose bytes the cost model cannot count."""


@dataclass(frozen=True)
class ModelShape:
    num_experts: int
    top_k: int
    num_layers: int  # all decoder layers (each has its tensor-parallel all-reduces)
    moe_layers: int
    hidden_size: int
    expert_width: int
    shared_experts: int
    expert_weight_bits: int  # 0 where ``unpriced_format`` names the format
    quant_group_size: int | None  # one scale per group of this many weights; None: no scales
    scale_bits: int = 16
    activation_bytes: int = 2  # bf16 activations on the wire
    unpriced_format: str | None = None  # the experts' format, where the cost model cannot count its bytes
    kv_bytes_per_token: int | None = None  # KV cache one token of context holds on one rank, all layers
    max_context: int | None = None  # the model's max_position_embeddings
    tensor_scale_bits: int = 0  # one more scale per whole weight tensor (NVFP4: an FP32 global scale)
    expert_hidden_size: int | None = None  # latent MoE: the width the routed experts compute in; None: hidden_size
    # layers whose attention cache grows with context (a hybrid model's full-attention ones); None: all num_layers
    attention_layers: int | None = None
    expert_format: str | None = None  # the experts' format as the manifest names it (e.g. "mxfp4"); None: unnamed

    @property
    def expert_bytes(self) -> int:
        """Bytes read for one expert in one layer: gate, up and down matrices (``expert_hidden_size`` x
        ``expert_width`` each in a latent MoE, whose experts compute in the latent width; else ``hidden_size`` x
        ``expert_width``), plus their quantisation scales: one per group of ``quant_group_size`` weights and one per
        tensor where the format has one (NVFP4). ``UnpricedFormat`` where the format is one the cost model cannot
        count (``unpriced_format``). The latent down- and up-projections around the experts are dense weights that
        every step reads once per layer, whichever experts it routes to: not expert bytes."""
        if self.unpriced_format is not None:
            raise UnpricedFormat(self.unpriced_format)
        weights = 3 * (self.expert_hidden_size or self.hidden_size) * self.expert_width
        scales = 0 if not self.quant_group_size else (weights // self.quant_group_size) * self.scale_bits // 8
        return weights * self.expert_weight_bits // 8 + scales + 3 * self.tensor_scale_bits // 8

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> ModelShape:
        """The recorded model's shape; ``unpriced_format`` set where its experts are stored in a format whose bytes
        the cost model cannot count (the manifest names it, with no ``expert_weight_bits``)."""
        model = manifest.model.fields
        unpriced = str(model["expert_format"]) if model.get("expert_format") and not model.get(
            "expert_weight_bits") else None
        moe_layers = len(manifest.model.moe_layers)
        return cls(
            num_experts=manifest.model.num_experts,
            top_k=manifest.model.top_k,
            num_layers=manifest.model.num_layers or moe_layers,
            moe_layers=moe_layers,
            hidden_size=manifest.model.hidden_size,
            expert_width=int(model.get("expert_width") or 0),
            shared_experts=int(model.get("shared_experts") or 0),
            expert_weight_bits=0 if unpriced else int(model.get("expert_weight_bits") or 16),
            quant_group_size=int(model["quant_group_size"]) if model.get("quant_group_size") else None,
            scale_bits=int(model.get("quant_scale_bits") or 16),
            unpriced_format=unpriced,
            kv_bytes_per_token=int(model["kv_bytes_per_token"]) if model.get("kv_bytes_per_token") else None,
            max_context=int(model["max_position_embeddings"]) if model.get("max_position_embeddings") else None,
            tensor_scale_bits=int(model.get("quant_tensor_scale_bits") or 0),
            expert_hidden_size=int(model["expert_hidden_size"]) if model.get("expert_hidden_size") else None,
            attention_layers=int(model["attention_layers"]) if model.get("attention_layers") else None,
            expert_format=str(model["expert_format"]) if model.get("expert_format") else None,
        )

    def unpriced_note(self) -> str | None:
        """What a report leaves out where the experts' bytes cannot be counted (None: nothing)."""
        if self.unpriced_format is None:
            return None
        return (f"its experts are stored as {self.unpriced_format}, whose bytes the cost model cannot count: left "
                f"out the expert bytes per step, the bytes budgets save and the predicted speedup (give --shape "
                f"{min(SHAPE_PRESETS)} or another preset to price them as that model's)")


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """The expert shape a Hugging Face ``config.json`` describes (DeepseekV3/Kimi, Qwen-MoE, Mixtral, Kimi-K3 key
    names; a latent MoE's expert width from ``LATENT_WIDTH_KEYS``), in the model's 16-bit dtype."""
    experts = config_expert_count(config)
    if not experts:
        raise ValueError("the config names no routed experts: not a MoE model")
    layers = int(config_value(config, "num_hidden_layers") or 0)
    dense = int(config_value(config, "first_k_dense_replace") or 0)
    width = config_value(config, "moe_intermediate_size", "intermediate_size")
    top_k = config_value(config, "num_experts_per_tok", "num_experts_per_token", "top_k")
    hidden = config_value(config, "hidden_size")
    if not (layers and width and top_k and hidden):
        raise ValueError("the config lacks one of num_hidden_layers, moe_intermediate_size, num_experts_per_tok, "
                         "hidden_size")
    return ModelShape(num_experts=experts, top_k=int(top_k), num_layers=layers, moe_layers=layers - dense,
                      hidden_size=int(hidden), expert_width=int(width),
                      shared_experts=int(config_value(config, "n_shared_experts", "num_shared_experts") or 0),
                      expert_weight_bits=16, quant_group_size=None, expert_hidden_size=expert_hidden_size(config),
                      attention_layers=attention_layers(config))


SHAPE_PRESETS: dict[str, ModelShape] = {
    "kimi-k2": ModelShape(
        num_experts=384,
        top_k=8,
        num_layers=61,
        moe_layers=60,
        hidden_size=7168,
        expert_width=2048,
        shared_experts=1,
        expert_weight_bits=4,
        quant_group_size=32,
        kv_bytes_per_token=(512 + 64) * 2 * 61,  # MLA: latent 512 + rope 64, bf16, every layer, on every rank
        max_context=262_144,  # Kimi-K2.5
    ),
}
