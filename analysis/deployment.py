"""What one step runs on (model shape, parallelism, weight format, requests per step), and the one definition of
the work and traffic a step makes there: each rank's experts and rows, the shared experts, the all-reduces and the
expert-parallel exchange. The cost model, the bytes table and the decision all call these.

Collectives: every decoder layer makes ``ALLREDUCES_PER_LAYER`` all-reduce-sized exchanges (attention output and
MLP/MoE output) across ``world_size = max(tp, ep)`` GPUs; each rank sends 2(N−1)/N of the message (ring). Under
expert parallelism, the MoE layer's dispatch and combine also move every token's activations to and from each rank
holding its experts (``ep_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrace.analysis.shape import ModelShape

ALLREDUCES_PER_LAYER = 2  # attention output and MoE/MLP output
FORMAT_BY_BITS = {16: "bf16", 8: "fp8", 4: "int4"}
# 4-bit floating-point formats, priced as themselves (a calibration times them, or their bytes are streamed), never
# as INT4's kernel: the first word of the manifest's format name
FP4_FORMATS = ("mxfp4", "nvfp4")


def ring_factor(world_size: int) -> float:
    """Share of a message each rank sends in a ring all-reduce over ``world_size`` GPUs: 2(N−1)/N."""
    return 2.0 * (world_size - 1) / world_size


@dataclass(frozen=True)
class Deployment:
    shape: ModelShape
    tp: int
    ep: int
    weight_format: str
    batch: int = 1

    @property
    def world_size(self) -> int:
        return max(self.tp, self.ep)

    @property
    def allreduces(self) -> int:
        """All-reduce-sized exchanges per step."""
        return self.shape.num_layers * ALLREDUCES_PER_LAYER if self.world_size > 1 else 0

    def message_bytes(self, tokens: float) -> float:
        """One all-reduce's message: every token's activation row."""
        return tokens * self.shape.hidden_size * self.shape.activation_bytes

    def allreduce_bytes(self, tokens: float) -> float:
        """Bytes each rank sends for a step's all-reduces."""
        return self.allreduces * ring_factor(self.world_size) * self.message_bytes(tokens)

    def ep_bytes(self, tokens: float, ranks_per_token: float) -> float:
        """Expert-parallel dispatch plus combine per step: each token's activations to and from every rank holding
        one of its experts, in every MoE layer (0 without expert parallelism)."""
        if self.ep <= 1:
            return 0.0
        return 2.0 * self.shape.moe_layers * ranks_per_token * self.message_bytes(tokens)

    @property
    def shared_per_rank(self) -> float:
        """Shared experts one rank computes: under EP they are tensor-parallel over the ranks (1/ep of each, as
        vLLM shards them like a dense MLP); under TP every rank computes all of them at width/tp."""
        return self.shape.shared_experts / self.ep if self.ep > 1 else float(self.shape.shared_experts)

    @property
    def rank_expert_bytes(self) -> float:
        """Bytes of one expert (one layer) one rank holds: whole experts under EP, a 1/tp slice under TP."""
        return self.shape.expert_bytes / (1 if self.ep > 1 else self.tp)

    def expert_config(self) -> str:
        return f"ep{self.ep}" if self.ep > 1 else f"tp{self.tp}"

    def rank_shape(self) -> tuple[int, int, int]:
        """(hidden size, expert width, experts) one rank's expert layer computes: EP splits experts, TP widths."""
        if self.ep > 1:
            return self.shape.hidden_size, self.shape.expert_width, self.shape.num_experts // self.ep
        return self.shape.hidden_size, self.shape.expert_width // self.tp, self.shape.num_experts

    def rank_work(self, unique: float, busiest: float, tokens: float) -> tuple[float, float]:
        """(experts, rows) one rank's routed-expert kernel computes in one MoE layer: under EP the busiest rank's
        experts and its share of the routed rows, under TP every unique expert and every routed row. The shared
        experts are not in it: vLLM runs them as a dense MLP beside the fused kernel (``shared_per_rank``)."""
        top_k = self.shape.top_k
        if self.ep > 1:
            return busiest, tokens * top_k * (busiest / unique if unique > 0 else 0.0)
        return unique, tokens * top_k

    def expert_weight_bytes(self, unique: float) -> float:
        """Expert weights a step reads over all ranks: the routed experts it uses and the shared ones, every MoE
        layer."""
        return (unique + self.shape.shared_experts) * self.shape.expert_bytes * self.shape.moe_layers

    def busiest_rank_weight_bytes(self, unique: float, busiest: float) -> float:
        """Expert weights the busiest rank reads per step (``rank_work``'s experts and its shared experts at
        ``rank_expert_bytes``)."""
        experts, _ = self.rank_work(unique, busiest, 1.0)
        return (experts + self.shared_per_rank) * self.rank_expert_bytes * self.shape.moe_layers


def calibration_format(shape: ModelShape) -> str:
    """The calibration curve's format the shape's experts are priced with: an FP4 format by its name, else by the
    weights' bits."""
    named = (shape.expert_format or "").split(" ")[0]
    return named if named in FP4_FORMATS else FORMAT_BY_BITS.get(shape.expert_weight_bits, "bf16")


def deployment_for(shape: ModelShape, tp: int, ep: int, weight_format: str | None = None) -> Deployment:
    fmt = weight_format or calibration_format(shape)
    return Deployment(shape=shape, tp=tp, ep=ep, weight_format=fmt)
