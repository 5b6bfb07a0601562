"""The model shape that turns expert counts into bytes: from a trace's manifest, or a named real-size preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    num_experts: int
    top_k: int
    num_layers: int  # all decoder layers (each has its tensor-parallel all-reduces)
    moe_layers: int
    hidden_size: int
    expert_width: int
    shared_experts: int
    expert_weight_bits: int
    quant_group_size: int | None  # one scale per group of this many weights; None: no scales
    scale_bits: int = 16
    activation_bytes: int = 2  # bf16 activations on the wire

    @property
    def expert_bytes(self) -> int:
        """Bytes read for one expert in one layer: gate, up and down matrices, plus their quantisation scales."""
        weights = 3 * self.hidden_size * self.expert_width
        scales = 0 if not self.quant_group_size else (weights // self.quant_group_size) * self.scale_bits // 8
        return weights * self.expert_weight_bits // 8 + scales

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> ModelShape:
        model = manifest["model"]
        moe_layers = len(model["moe_layers"])
        return cls(
            num_experts=int(model["num_experts"]),
            top_k=int(model["top_k"]),
            num_layers=int(model.get("num_layers") or moe_layers),
            moe_layers=moe_layers,
            hidden_size=int(model["hidden_size"]),
            expert_width=int(model.get("expert_width") or 0),
            shared_experts=int(model.get("shared_experts") or 0),
            expert_weight_bits=int(model.get("expert_weight_bits") or 16),
            quant_group_size=int(model["quant_group_size"]) if model.get("quant_group_size") else None,
        )


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
    ),
}
