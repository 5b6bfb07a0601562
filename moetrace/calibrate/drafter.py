"""Time a model drafter's forward passes at its per-rank shape (``moetrace calibrate --drafter``): the drafter's
decoder layers over T tokens, its LM head and argmax over T rows, and (EAGLE-3) the fc that folds the target's
auxiliary hidden states into one, each a curve against T.

A speculative step of vLLM's EAGLE-style proposer (EAGLE, EAGLE-3, MTP, a draft model) runs the layers once over
every token the step verified, B·(k+1) at B requests, the LM head on the B last ones, then k−1 more passes of B
tokens (``analysis.calibration.drafter_step_ms`` adds them up). The weights are random: the time of a GEMM does
not depend on its values.

Shapes, per tensor-parallel rank (vLLM runs the drafter at the target's TP: projections split by heads, the MLP by
its width, the LM head by vocabulary; EAGLE-3's fc is replicated):
    # T tokens, H hidden, Hq heads per rank, D q/k head dim, Dv value dim, C context tokens attended
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from moetrace.calibrate.experts import time_calls

CONTEXT_TOKENS = 512  # KV positions each draft token attends to: a decode step of a few-hundred-token request


@dataclass(frozen=True)
class DrafterShape:
    """One drafter's per-rank work. ``projections``: (in, out) of every GEMM of one decoder layer in order
    (attention projections, then the MLP); ``first_input``: the first projection's input width in the first layer
    (EAGLE-3 reads its embeddings beside the hidden state: 2 H); ``fc_input``: EAGLE-3's fc input (aux layers × H
    of the target; 0 for other drafters)."""

    architecture: str
    hidden: int
    layers: int
    heads: int
    qk_dim: int
    v_dim: int
    projections: tuple[tuple[int, int], ...]
    first_input: int
    lm_head_rows: int
    fc_input: int
    tp: int

    def parameters(self) -> int:
        """Weights one rank reads in one pass over every layer and the LM head (the fc apart)."""
        first_in, first_out = self.projections[0]
        return (self.layers * sum(i * o for i, o in self.projections) + (self.first_input - first_in) * first_out
                + self.hidden * self.lm_head_rows)


def drafter_shape(config: Mapping[str, Any], tp: int) -> DrafterShape:
    """A drafter's per-rank shape at tensor-parallel size ``tp`` from its Hugging Face config: MLA attention where
    it has ``kv_lora_rank`` (DeepSeek-style heads), grouped-query attention otherwise; a dense MLP. ValueError in
    one line for what cannot be timed (routed experts, sizes that do not split over ``tp``)."""
    def size(name: str) -> int:
        value = config.get(name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"drafter config has no {name}")
        return value

    def split(total: int, what: str) -> int:
        if total % tp:
            raise ValueError(f"drafter {what} ({total}) does not split over tp={tp}")
        return total // tp

    if config.get("n_routed_experts") and int(config.get("first_k_dense_replace", 0)) < size("num_hidden_layers"):
        raise ValueError("drafter has routed experts: only dense drafters (EAGLE heads, dense draft models) are timed")
    hidden, layers, width = size("hidden_size"), size("num_hidden_layers"), size("intermediate_size")
    heads = split(size("num_attention_heads"), "attention heads")
    eagle3 = "eagle3" in " ".join(config.get("architectures") or []).lower() or \
        "eagle_aux_hidden_state_layer_ids" in config
    if config.get("kv_lora_rank"):
        rope, nope, v_dim = size("qk_rope_head_dim"), size("qk_nope_head_dim"), size("v_head_dim")
        kv_lora, q_lora = size("kv_lora_rank"), config.get("q_lora_rank")
        qk_dim = nope + rope
        attention = ([(hidden, q_lora + kv_lora + rope), (q_lora, heads * qk_dim)] if q_lora else
                     [(hidden, heads * qk_dim), (hidden, kv_lora + rope)])
        attention += [(kv_lora, heads * (nope + v_dim)), (heads * v_dim, hidden)]
    else:
        qk_dim = v_dim = int(config.get("head_dim") or hidden // size("num_attention_heads"))
        kv_heads = max(1, int(config.get("num_key_value_heads") or size("num_attention_heads")) // tp)
        attention = [(hidden, (heads + 2 * kv_heads) * qk_dim), (heads * v_dim, hidden)]
    mlp = [(hidden, 2 * split(width, "intermediate size")), (width // tp, hidden)]
    vocab = int(config.get("draft_vocab_size") or size("vocab_size"))
    aux = config.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0]
    target_hidden = int(config.get("target_hidden_size") or hidden)
    return DrafterShape(architecture=", ".join(config.get("architectures") or ["unnamed"]), hidden=hidden,
                        layers=layers, heads=heads, qk_dim=qk_dim, v_dim=v_dim,
                        projections=tuple(attention + mlp), first_input=2 * hidden if eagle3 else hidden,
                        lm_head_rows=math.ceil(vocab / tp), fc_input=len(aux) * target_hidden if eagle3 else 0, tp=tp)


class DrafterPasses:
    """Random weights of one drafter rank on ``device`` and the three timed calls over ``tokens`` tokens."""

    def __init__(self, shape: DrafterShape, device: torch.device, context: int = CONTEXT_TOKENS) -> None:
        self.shape, self.device, self.context = shape, device, context
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.generator = torch.Generator(device=device).manual_seed(0)
        first_in = shape.first_input
        self.layer_weights = [[self._random(first_in if (layer == 0 and i == 0) else i_dim, o_dim)
                               for i, (i_dim, o_dim) in enumerate(shape.projections)]
                              for layer in range(shape.layers)]
        self.lm_head = self._random(shape.hidden, shape.lm_head_rows)
        self.fc = self._random(shape.fc_input, shape.hidden) if shape.fc_input else None
        # the context each pass attends to: keys and values of C positions, every head of the rank
        self.keys = self._tensor(1, shape.heads, context, shape.qk_dim)
        self.values = self._tensor(1, shape.heads, context, shape.v_dim)

    def _tensor(self, *dims: int) -> torch.Tensor:
        return (torch.randn(dims, generator=self.generator, device=self.device) * 0.05).to(self.dtype)

    def _random(self, rows: int, cols: int) -> torch.Tensor:
        return self._tensor(rows, cols)

    def layers_call(self, tokens: int) -> Callable[[int], object]:
        """Every decoder layer over ``tokens`` tokens: each projection's GEMM on an input of its width, attention of
        the tokens over the context, the MLP's activation."""
        shape = self.shape
        inputs = {w.shape[0]: self._tensor(tokens, w.shape[0]) for layer in self.layer_weights for w in layer}
        query = self._tensor(1, shape.heads, tokens, shape.qk_dim)
        width = shape.projections[-1][0]

        def call(_: int) -> object:
            out = None
            for layer in self.layer_weights:
                for weight in layer:
                    out = inputs[weight.shape[0]] @ weight
                    if weight.shape[1] == 2 * width:  # the MLP's gate and up halves
                        out = F.silu(out[:, :width]) * out[:, width:]
                F.scaled_dot_product_attention(query, self.keys, self.values)
            return out

        return call

    def head_call(self, tokens: int) -> Callable[[int], object]:
        """The LM head over ``tokens`` rows and the greedy draft's argmax."""
        states = self._tensor(tokens, self.shape.hidden)
        return lambda _: (states @ self.lm_head).argmax(dim=-1)

    def fc_call(self, tokens: int) -> Callable[[int], object] | None:
        """EAGLE-3's fc over ``tokens`` rows of concatenated auxiliary hidden states (None without one)."""
        if self.fc is None:
            return None
        aux, fc = self._tensor(tokens, self.shape.fc_input), self.fc
        return lambda _: aux @ fc


def measure_drafter(shape: DrafterShape, device: torch.device, tokens: tuple[int, ...], reps: int, replays: int,
                    progress: Callable[[int, int], None]) -> dict[str, Any]:
    """The drafter curve of the calibration document: per token count, µs of the layers, the LM head and the fc."""
    passes = DrafterPasses(shape, device)
    points, modes = [], set()
    for done, count in enumerate(tokens):
        point: dict[str, Any] = {"tokens": count}
        for name, call in (("layers_us", passes.layers_call(count)), ("head_us", passes.head_call(count)),
                           ("fc_us", passes.fc_call(count))):
            if call is not None:
                point[name], mode = time_calls(call, device, reps, replays)
                modes.add(mode)
        points.append(point)
        progress(done + 1, len(tokens))
    return {"shape": {**asdict(shape), "projections": [list(p) for p in shape.projections]},
            "parameters_per_rank": shape.parameters(), "context_tokens": passes.context,
            "dtype": str(passes.dtype).removeprefix("torch."), "timing": sorted(modes), "points": points}
