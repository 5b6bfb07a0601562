"""Trains an EAGLE-3 draft head for moetrace's embedded default model and writes a checkpoint vLLM's eagle3 loader
takes: the head shipped as ``moetrace/data/eagle3-head`` (``moetrace record --method eagle3`` on the default
model needs no ``--drafter``).

    python scripts/train_eagle3.py --out moetrace/data/eagle3-head --steps 1200 --max-minutes 9   # the shipped head
    python scripts/train_eagle3.py --out /tmp/head --steps 20                                      # smoke run

The target is the shipped default model (``moetrace/data/kimi-k2-tiny.safetensors``), run in plain PyTorch by the
training script's own ``TinyKimi`` (the tests check it computes what transformers' DeepseekV3 computes on the same
weights), over the corpus it was trained on (the Python standard library's source, held-out modules left out).

The head is vLLM's ``Eagle3DeepseekV2ForCausalLM`` (``vllm/model_executor/models/deepseek_eagle3.py``): one
DeepSeek decoder layer (MLA with the target's head dims, dense MLP) at the target's hidden size. Not the Llama head
(``Eagle3LlamaForCausalLM``): on the CPU its attention gets CPU_ATTN (kernel block sizes MultipleOf(32)) beside the
target's CPU_MLA ([16]) in one KV cache group, and vLLM refuses with "No common block size for 16 (CPU_MLA: [16];
CPU_ATTN: [MultipleOf(32)])". On the CPU build ``moetrace record`` gives the draft's MLA layer CPU_MLA through the
speculative config, as it does for ``--method mtp``.

* vLLM records the target's residual stream at the *input* of the layers named by the draft config's
  ``eagle_aux_hidden_state_layer_ids`` (``hidden_states + residual`` before layer i; i = num_hidden_layers is the
  final pre-norm output) and concatenates them: ``fc`` maps 3 x hidden to hidden. Without the ids vLLM would take
  DeepseekV2's default ``(2, L // 2, L - 3)`` = ``(2, 2, 1)`` for L = 4 layers: two distinct layers, 2 x hidden
  wide, which no 3 x hidden ``fc`` takes, so the ids are always written.
* Draft position t sees ``fc(aux_t)`` and the embedding of token t+1 (the target's embedding, shared by vLLM when the
  checkpoint has no ``embed_tokens``), at rotary position t, and predicts token t+2; the next draft step feeds the
  layer's pre-norm output back (not through ``fc``) with the drafted token at position t+1.
* The draft vocabulary is the target's (320): vLLM then needs no ``d2t``/``t2d`` map (``draft_id_to_target_id`` is
  None when ``draft_vocab_size`` equals the target's vocabulary size). The head has its own ``lm_head`` (started
  from the target's).

Training is EAGLE-3's training-time test over ``--ttt-steps`` steps (1 or 2): step 1 from the target's features,
step 2 from the head's own step-1 output (its attention sees step-1 keys up to t and its own key at t+1, as the KV
cache holds them when vLLM drafts), each step's label the target's next-token distribution (soft cross-entropy).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
import train_default_model as TRAIN  # noqa: E402  (the target's PyTorch model: TinyKimi, its rotary tables)
from moetrace.default_model import CONFIG, WEIGHTS_FILE, WEIGHTS_SHA256, read_packed_weights  # noqa: E402


# ---- the target -------------------------------------------------------------------------------------------------


def load_target() -> tuple[nn.Module, dict[str, Any]]:
    """TinyKimi with the shipped weights (dequantized as ``unpack_checkpoint`` does, experts kept stacked)."""
    packed, training = read_packed_weights(WEIGHTS_FILE, WEIGHTS_SHA256)
    model = TRAIN.TinyKimi()
    # checkpoint_tensors names the state dict's entries in order (plus one shared-head copy at the end)
    names = list(TRAIN.checkpoint_tensors(model))
    state = model.state_dict()
    restored = {}
    for key, name in zip(state, names):
        value = packed[name].float()
        scale = packed.get(name + ".scale")
        if scale is not None:
            value = value * scale.float().unsqueeze(-1)
        assert value.shape == state[key].shape, (key, name, value.shape, state[key].shape)
        restored[key] = value
    model.load_state_dict(restored)
    model.eval().requires_grad_(False)
    return model, training


@torch.no_grad()
def target_features(model: nn.Module, tokens: torch.Tensor,
                    aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, S] -> aux hidden states concatenated [B, S, len(aux) * H] (the residual stream at the input of
    each named layer, as vLLM's DeepseekV2Model collects them), target logits [B, S, V]."""
    cos, sin = TRAIN.rope_tables(tokens.shape[1], tokens.device)
    x = model.embed_tokens(tokens)
    captured: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(model.layers):
        if index in aux_layers:
            captured[index] = x
        x = layer(x, cos, sin)
    captured[len(model.layers)] = x
    return torch.cat([captured[i] for i in aux_layers], dim=-1), model.lm_head(model.norm(x))


# ---- the head ---------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MidLayer(nn.Module):
    """vLLM's ``DeepseekV2Eagle3DecoderLayer`` (layer 0): MLA (q through a low-rank ``q_a_proj``, the target's head
    dims) over [input_layernorm(embeds), hidden_norm(hidden)] (2 x hidden wide), then a dense MLP."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.heads, self.rank = cfg["num_attention_heads"], cfg["kv_lora_rank"]
        self.nope, self.rope, self.v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.input_layernorm, self.hidden_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        attn = self.self_attn = nn.Module()
        attn.q_a_proj = nn.Linear(2 * hidden, cfg["q_lora_rank"], bias=False)
        attn.q_a_layernorm = RMSNorm(cfg["q_lora_rank"], eps)
        attn.q_b_proj = nn.Linear(cfg["q_lora_rank"], self.heads * (self.nope + self.rope), bias=False)
        attn.kv_a_proj_with_mqa = nn.Linear(2 * hidden, self.rank + self.rope, bias=False)
        attn.kv_a_layernorm = RMSNorm(self.rank, eps)
        attn.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v), bias=False)
        attn.o_proj = nn.Linear(self.heads * self.v, hidden, bias=False)
        self.mlp = nn.Module()
        width = cfg["intermediate_size"]
        self.mlp.gate_proj = nn.Linear(hidden, width, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, width, bias=False)
        self.mlp.down_proj = nn.Linear(width, hidden, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> query, key [B, N, S, nope+rope], value [B, N, S, v]; DeepSeek's interleaved rotary, the target's."""
        batch, length, _ = hidden.shape
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn = self.self_attn
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(batch, length, self.heads, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        compressed, k_pe = attn.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(compressed)).view(batch, length, self.heads, -1).transpose(1, 2)
        k_nope, value = kv.split([self.nope, self.v], dim=-1)
        k_pe = TRAIN.rotate_interleaved(k_pe, cos, sin).unsqueeze(1).expand(-1, self.heads, -1, -1)
        query = torch.cat([q_nope, TRAIN.rotate_interleaved(q_pe, cos, sin)], dim=-1)
        return query, torch.cat([k_nope, k_pe], dim=-1), value

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=(self.nope + self.rope) ** -0.5)

    def finish(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attention output [B, N, S, v] + the residual (the un-normed hidden input) -> pre-norm output."""
        batch, _, length, _ = attended.shape
        residual = hidden + self.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
        x = self.post_attention_layernorm(residual)
        return residual + self.mlp.down_proj(F.silu(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))


class Eagle3Head(nn.Module):
    def __init__(self, cfg: dict[str, Any], embed: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg["eagle_aux_hidden_state_layer_ids"]) * cfg["target_hidden_size"],
                            cfg["hidden_size"], bias=False)
        nn.init.normal_(self.fc.weight, std=0.02)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["draft_vocab_size"], bias=False)
        self.lm_head.weight.data.copy_(lm_head.weight.data)
        self.embed = embed  # the target's, frozen (vLLM shares it: the checkpoint carries no embed_tokens)

    def rope(self, length: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = TRAIN.rope_tables(offset + length, device)  # the target's rotary (same rope config)
        return cos[offset:], sin[offset:]

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(prenorm))

    def forward(self, aux: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """aux [B, S, 3H] target features at positions 0..S-1, tokens [B, S]. Step 1 at position t takes token t+1
        and predicts token t+2 (outputs over t = 0..S-3); step 2 at position t+1 takes the head's step-1 output and
        token t+2 and predicts token t+3 (t = 0..S-4). Returns each step's logits [B, S-1-step, V]."""
        length = tokens.shape[1] - 2
        hidden = self.fc(aux[:, :length])
        embeds = self.embed(tokens[:, 1:1 + length])
        cos, sin = self.rope(length, 0, aux.device)
        q1, k1, v1 = self.midlayer.qkv(embeds, hidden, cos, sin)
        out1 = self.midlayer.finish(self.midlayer.attend(q1, k1, v1, None), hidden)
        outputs = [self.logits(out1)]
        if steps >= 2:
            n = length - 1  # step 2 at positions 1..length-1, from step-1 outputs at 0..length-2
            hidden2 = out1[:, :n]
            embeds2 = self.embed(tokens[:, 2:2 + n])
            cos2, sin2 = self.rope(n, 1, aux.device)
            q2, k2, v2 = self.midlayer.qkv(embeds2, hidden2, cos2, sin2)
            # query i (position i+1) sees step-1 keys 0..i and its own step-2 key: the draft KV cache at drafting
            keys, values = torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2)
            rows = torch.arange(n, device=aux.device).unsqueeze(1)
            cols = torch.arange(length + n, device=aux.device).unsqueeze(0)
            mask = (cols <= rows) | (cols == length + rows)
            attended = self.midlayer.attend(q2, keys, values, mask)
            outputs.append(self.logits(self.midlayer.finish(attended, hidden2)))
        return outputs

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """EAGLE-3's checkpoint names: fc, midlayer.*, norm, lm_head (no embed_tokens, no d2t/t2d)."""
        return {name: tensor.detach().float().contiguous() for name, tensor in self.state_dict().items()
                if not name.startswith("embed.")}


def head_config(aux_layers: tuple[int, ...], q_lora_rank: int, intermediate: int) -> dict[str, Any]:
    """The target's DeepseekV3 config, one dense layer, as vLLM's Eagle3DeepseekV2ForCausalLM reads it: MLA with
    the target's head dims (the CPU MLA backend takes head size kv_lora_rank + rope = 576 only), YaRN at factor 1
    (DeepSeek's rotary class, whose CPU path is PyTorch-native), a q_lora_rank (the eagle3 loader maps
    ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``, which exists only with one)."""
    drop = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "topk_method",
            "scoring_func", "norm_topk_prob", "routed_scaling_factor", "moe_intermediate_size", "moe_layer_freq",
            "first_k_dense_replace", "num_nextn_predict_layers")
    config = {key: value for key, value in CONFIG.items() if key not in drop}
    config.update({
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],  # vLLM registry: deepseek_eagle3
        # deepseek_v2, not v3: vLLM turns any draft config of model_type deepseek_v3 into DeepSeekMTPModel
        "model_type": "deepseek_v2",
        "num_hidden_layers": 1,
        "intermediate_size": intermediate,
        "q_lora_rank": q_lora_rank,
        "target_hidden_size": CONFIG["hidden_size"],
        "draft_vocab_size": CONFIG["vocab_size"],  # the target's: no d2t/t2d
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True},
    })
    return config


# ---- training ---------------------------------------------------------------------------------------------------


def step_losses(head: Eagle3Head, target_logits: torch.Tensor, outputs: list[torch.Tensor]) -> tuple[
        list[torch.Tensor], list[float]]:
    """Soft cross-entropy against the target's next-token distribution, and top-1 agreement, per step. Step s's
    output at t predicts token t+1+s: the target's logits at t+s."""
    losses, agree = [], []
    for step, logits in enumerate(outputs, start=1):
        labels = target_logits[:, step:step + logits.shape[1]]
        losses.append(-(F.softmax(labels, -1) * F.log_softmax(logits, -1)).sum(-1).mean())
        agree.append((logits.argmax(-1) == labels.argmax(-1)).float().mean().item())
    return losses, agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder (config.json, model.safetensors)")
    parser.add_argument("--corpus", help="a standard library directory or .tar.xz (default: this Python's)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ttt-steps", type=int, default=2, choices=(1, 2))
    parser.add_argument("--step2-weight", type=float, default=0.7)
    parser.add_argument("--aux-layers", default="1,2,4",
                        help="target layers whose input residual stream feeds the head (4 = the final output)")
    parser.add_argument("--q-lora-rank", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-minutes", type=float, default=10.0)
    args = parser.parse_args()
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    aux_layers = tuple(int(i) for i in args.aux_layers.split(","))
    if len(aux_layers) != 3 or not all(0 <= i <= CONFIG["num_hidden_layers"] for i in aux_layers):
        parser.error(f"--aux-layers: three ids in 0..{CONFIG['num_hidden_layers']}")
    target, target_training = load_target()
    files, corpus = TRAIN.load_corpus(args.corpus)
    if corpus["sha256"] != target_training.get("corpus", {}).get("sha256"):
        print(f"note: corpus differs from the target's ({target_training.get('corpus', {}).get('origin')})")
    train_stream, valid_stream = TRAIN.split_stream(files)
    cfg = head_config(aux_layers, args.q_lora_rank, args.intermediate)
    head = Eagle3Head(cfg, target.embed_tokens, target.lm_head)
    trainable = [p for n, p in head.named_parameters() if not n.startswith("embed.")]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    generator = torch.Generator().manual_seed(args.seed)
    history: list[dict[str, Any]] = []
    started = time.monotonic()

    def evaluate() -> dict[str, float]:
        head.eval()
        gen = torch.Generator().manual_seed(args.seed + 1)
        agree_sum = [0.0, 0.0]
        rounds = 4
        with torch.no_grad():
            for _, tokens in zip(range(rounds), TRAIN.batches(valid_stream, args.batch, args.length, gen)):
                aux, logits = target_features(target, tokens, aux_layers)
                _, agree = step_losses(head, logits, head(aux, tokens, 2))
                agree_sum = [a + b for a, b in zip(agree_sum, agree)]
        head.train()
        return {"valid_top1_step1": agree_sum[0] / rounds, "valid_top1_step2": agree_sum[1] / rounds}

    print(json.dumps({"corpus": corpus, "aux_layers": aux_layers, "before": evaluate()}), flush=True)
    for step, tokens in zip(range(args.steps), TRAIN.batches(train_stream, args.batch, args.length, generator)):
        aux, target_logits = target_features(target, tokens, aux_layers)
        losses, agree = step_losses(head, target_logits, head(aux, tokens, args.ttt_steps))
        loss = losses[0] + (args.step2_weight * losses[1] if len(losses) > 1 else 0.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        out_of_time = time.monotonic() - started > args.max_minutes * 60
        if step % 25 == 0 or step == args.steps - 1 or out_of_time:
            point: dict[str, Any] = {"step": step, "seconds": round(time.monotonic() - started, 1),
                                     "loss": [round(x.item(), 4) for x in losses],
                                     "top1": [round(a, 3) for a in agree]}
            if step % 100 == 0 or step == args.steps - 1 or out_of_time:
                point.update(evaluate())
            history.append(point)
            print(json.dumps(point), flush=True)
        if out_of_time:
            break

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = head.checkpoint()
    metadata = {"target": "kimi-k2-tiny", "target_weights_sha256": WEIGHTS_SHA256, "corpus": corpus,
                "settings": {k: str(v) for k, v in vars(args).items()}, "history": history,
                "command": "python scripts/train_eagle3.py " + " ".join(sys.argv[1:]), "torch": torch.__version__}
    save_file(tensors, args.out / "model.safetensors", metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    (args.out / "moetrace.json").write_text(json.dumps(metadata, indent=2))
    size = (args.out / "model.safetensors").stat().st_size
    print(f"wrote {args.out} ({sum(t.numel() for t in tensors.values())} parameters, {size / 2**20:.2f} MiB) "
          f"in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
