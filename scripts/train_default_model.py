"""Trains moetrace's embedded default model on the Python standard library's source and packs its weights.

    python scripts/train_default_model.py --out moetrace/data/kimi-k2-tiny.safetensors          # on a GPU: minutes
    python scripts/train_default_model.py --corpus stdlib.tar.xz --steps 20 --out /tmp/w.safetensors  # smoke run

The model is the DeepseekV3 layout of ``moetrace.default_model.CONFIG`` (Kimi-K2's routing shape: 384 experts,
top-8, sigmoid scores plus a selection bias, one shared expert, first layer dense, MLA) and its MTP layer, written
here in plain PyTorch with the checkpoint's own tensor names. Training differs from inference in one place only:
every expert runs on every token and the routing weights (zero off the top-8) select, which is exact and fast at
this size. The selection bias is trained as DeepSeek-V3 does (aux-loss-free): after each step it moves by a fixed
amount towards under-loaded experts. The MTP layer learns the token after next, as vLLM's MTP drafter uses it.

Corpus: every ``.py`` file of a CPython standard library (no tests, no site-packages) except the held-out
modules, whose text the built-in prompts draw on. Packed weights: linear weights as int8 with one float32 scale
per output row (float16), the rest float32; the metadata holds the corpus identity, the seed, the command and the
losses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moetrace.default_model import BOS_ID, CONFIG, HELD_OUT_MODULES  # noqa: E402

# T tokens, H hidden, E experts, K top-k, I expert width, N heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + CONFIG["rms_norm_eps"])).to(x.dtype) * weight


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight)


def linear(inputs: int, outputs: int) -> nn.Linear:
    layer = nn.Linear(inputs, outputs, bias=False)
    nn.init.normal_(layer.weight, std=CONFIG["initializer_range"])
    return layer


def rope_tables(length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, R/2]: YaRN at factor 1 is plain RoPE (DeepseekScalingRotaryEmbedding, mscale 1)."""
    rope = CONFIG["qk_rope_head_dim"]
    theta = CONFIG["rope_parameters"]["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, rope, 2, device=device, dtype=torch.float32) / rope)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style (DeepSeek's is_neox_style=False): pairs (2i, 2i+1) rotate by frequency i. x [..., S, R]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class MLA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        hidden, heads = CONFIG["hidden_size"], CONFIG["num_attention_heads"]
        self.nope, self.rope, self.v = CONFIG["qk_nope_head_dim"], CONFIG["qk_rope_head_dim"], CONFIG["v_head_dim"]
        self.heads, self.rank = heads, CONFIG["kv_lora_rank"]
        self.q_proj = linear(hidden, heads * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = linear(hidden, self.rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = linear(self.rank, heads * (self.nope + self.v))
        self.o_proj = linear(heads * self.v, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape  # x [B, S, H]
        q = self.q_proj(x).view(batch, length, self.heads, -1).transpose(1, 2)  # [B, N, S, nope+rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(batch, length, self.heads, -1).transpose(1, 2)
        k_nope, value = kv.split([self.nope, self.v], dim=-1)
        k_pe = rotate_interleaved(k_pe, cos, sin).unsqueeze(1).expand(-1, self.heads, -1, -1)
        query = torch.cat([q_nope, rotate_interleaved(q_pe, cos, sin)], dim=-1)
        key = torch.cat([k_nope, k_pe], dim=-1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                             scale=(self.nope + self.rope) ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DenseMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        hidden = CONFIG["hidden_size"]
        self.gate_proj, self.up_proj, self.down_proj = (linear(hidden, width), linear(hidden, width),
                                                        linear(width, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        hidden, experts, width = CONFIG["hidden_size"], CONFIG["n_routed_experts"], CONFIG["moe_intermediate_size"]
        std = CONFIG["initializer_range"]
        self.gate = nn.Linear(hidden, experts, bias=False)
        nn.init.normal_(self.gate.weight, std=std)
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))
        self.gate_proj = nn.Parameter(torch.randn(experts, width, hidden) * std)  # [E, I, H]
        self.up_proj = nn.Parameter(torch.randn(experts, width, hidden) * std)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, width) * std)  # [E, H, I]
        self.shared_experts = DenseMLP(width * CONFIG["n_shared_experts"])
        self.load = torch.zeros(experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's noaux_tc with one group: top-K of sigmoid + bias, weights are the sigmoid scores renormalised,
        times the routed scaling factor. x [T, H] -> ids [T, K], weights [T, K]."""
        scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))
        ids = torch.topk(scores + self.e_score_correction_bias, CONFIG["num_experts_per_tok"], dim=-1).indices
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * CONFIG["routed_scaling_factor"]
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, H]
        ids, weights = self.route(flat)
        self.load = torch.bincount(ids.flatten(), minlength=CONFIG["n_routed_experts"]).detach()
        dense_weights = torch.zeros(flat.shape[0], CONFIG["n_routed_experts"], device=x.device,
                                    dtype=torch.float32).scatter(1, ids, weights)  # [T, E], zero off the top-K
        gate = torch.einsum("th,eih->tei", flat, self.gate_proj.to(flat.dtype))
        up = torch.einsum("th,eih->tei", flat, self.up_proj.to(flat.dtype))
        hidden = F.silu(gate) * up * dense_weights.to(flat.dtype).unsqueeze(-1)
        routed = torch.einsum("tei,ehi->th", hidden, self.down_proj.to(flat.dtype))
        return (routed + self.shared_experts(flat)).reshape(shape)

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """Aux-loss-free balancing: move each expert's selection bias towards the mean load."""
        load = self.load.float()
        self.e_score_correction_bias += rate * torch.sign(load.mean() - load)


class DecoderLayer(nn.Module):
    def __init__(self, dense: bool) -> None:
        super().__init__()
        hidden = CONFIG["hidden_size"]
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden), RMSNorm(hidden)
        self.self_attn = MLA()
        self.mlp: nn.Module = DenseMLP(CONFIG["intermediate_size"]) if dense else MoE()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """DeepSeek's MTP layer as vLLM runs it: from the target's final (normed) hidden state at position i and the
    embedding of token i+1 (zeroed at position 0), predict token i+2."""

    def __init__(self) -> None:
        super().__init__()
        hidden = CONFIG["hidden_size"]
        self.enorm, self.hnorm = RMSNorm(hidden), RMSNorm(hidden)
        self.eh_proj = linear(2 * hidden, hidden)
        self.block = DecoderLayer(dense=False)
        self.head_norm = RMSNorm(hidden)

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        embeds = embeds.clone()
        embeds[:, 0] = 0
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        return self.head_norm(self.block(x, cos, sin))


class TinyKimi(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        hidden, vocab = CONFIG["hidden_size"], CONFIG["vocab_size"]
        self.embed_tokens = nn.Embedding(vocab, hidden)
        nn.init.normal_(self.embed_tokens.weight, std=CONFIG["initializer_range"])
        dense = CONFIG["first_k_dense_replace"]
        self.layers = nn.ModuleList(DecoderLayer(dense=i < dense) for i in range(CONFIG["num_hidden_layers"]))
        self.norm = RMSNorm(hidden)
        self.lm_head = linear(hidden, vocab)
        self.mtp = MTPLayer()

    def moe_layers(self) -> list[MoE]:
        blocks = [*self.layers, self.mtp.block]
        return [block.mlp for block in blocks if isinstance(block.mlp, MoE)]

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S] -> next-token logits [B, S, V], MTP logits for the token after next [B, S-1, V]."""
        cos, sin = rope_tables(tokens.shape[1], tokens.device)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        final = self.norm(x)
        mtp = self.mtp(self.embed_tokens(tokens[:, 1:]), final[:, :-1], cos[:-1], sin[:-1])
        return self.lm_head(final), self.lm_head(mtp)


def checkpoint_tensors(model: TinyKimi) -> dict[str, torch.Tensor]:
    """The model's tensors under DeepseekV3 checkpoint names (experts stacked: ``...experts.gate_proj`` [E, I, H]
    stands for ``...experts.<e>.gate_proj.weight``); the MTP layer is layer L."""
    mtp_layer = CONFIG["num_hidden_layers"]
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("mtp."):
            rest = name.removeprefix("mtp.")
            rest = rest.removeprefix("block.").replace("head_norm.", "shared_head.norm.")
            name = f"model.layers.{mtp_layer}.{rest}"
        elif name != "lm_head.weight":
            name = "model." + name
        for stacked in ("gate_proj", "up_proj", "down_proj"):
            if name.endswith(f"mlp.{stacked}"):
                name = name.replace(f"mlp.{stacked}", f"mlp.experts.{stacked}")
        name = name.replace("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias")
        tensors[name] = tensor.detach().float().cpu()
    tensors[f"model.layers.{mtp_layer}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return tensors


def quantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Linear weights (2-D and stacked 3-D, except the router) to int8 with one scale per output row."""
    packed: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.dim() < 2 or name.endswith("mlp.gate.weight"):
            packed[name] = tensor.contiguous()
            continue
        scale = (tensor.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6) / 127.0).half()
        packed[name] = torch.round(tensor / scale.float()).clamp(-127, 127).to(torch.int8).contiguous()
        packed[name + ".scale"] = scale.squeeze(-1).contiguous()
    return packed


# ---- corpus -------------------------------------------------------------------------------------------------


def corpus_files(root: Path) -> list[tuple[str, bytes]]:
    """(relative path, bytes) of the standard library's own source, sorted, without tests and held-out modules."""
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        parts = relative.split("/")
        if parts[0] in ("site-packages", "dist-packages", "test", "idlelib", "lib2to3") or "tests" in parts:
            continue
        if any(relative == held or relative.startswith(held.rstrip("/") + "/") for held in HELD_OUT_MODULES):
            continue
        files.append((relative, path.read_bytes()))
    return files


def load_corpus(source: str | None) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
    """The running Python's standard library, or a directory / .tar.xz of one (for a machine with another
    Python). Returns the files and the corpus identity (origin, file count, bytes, sha256)."""
    origin = Path(source).name if source else f"stdlib of Python {sys.version.split()[0]}"
    if source and source.endswith((".tar.xz", ".tar.gz", ".tar")):
        root = Path(tempfile.mkdtemp(prefix="moetrace-corpus-"))
        with tarfile.open(source) as archive:
            archive.extractall(root, filter="data")
    else:
        root = Path(source or sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)
    digest = hashlib.sha256()
    for relative, data in files:
        digest.update(relative.encode() + b"\0" + data + b"\0")
    identity = {"origin": origin, "files": len(files), "bytes": sum(len(d) for _, d in files),
                "sha256": digest.hexdigest(), "held_out": list(HELD_OUT_MODULES)}
    return files, identity


def split_stream(files: list[tuple[str, bytes]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One byte stream per split, each file preceded by BOS; every 50th file validates."""
    def stream(chosen: list[bytes]) -> torch.Tensor:
        joined = bytearray()
        for data in chosen:
            joined += b"\0" + data  # placeholder byte for BOS (the stdlib's source holds no NUL bytes)
        ids = torch.frombuffer(joined, dtype=torch.uint8).to(torch.long)
        ids[ids == 0] = BOS_ID
        return ids
    train = [data for i, (_, data) in enumerate(files) if i % 50 != 0]
    valid = [data for i, (_, data) in enumerate(files) if i % 50 == 0]
    return stream(train), stream(valid)


def batches(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    while True:
        starts = torch.randint(0, stream.numel() - length, (batch,), generator=generator)
        yield torch.stack([stream[s:s + length] for s in starts.tolist()])


# ---- training -----------------------------------------------------------------------------------------------


@dataclass
class Settings:
    steps: int
    batch: int
    length: int
    lr: float
    mtp_weight: float
    bias_rate: float
    seed: int
    max_minutes: float


def losses(model: TinyKimi, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, mtp_logits = model(tokens)
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
    mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 2:].reshape(-1))
    return main, mtp


@torch.no_grad()
def evaluate(model: TinyKimi, stream: torch.Tensor, settings: Settings, device: torch.device) -> dict[str, float]:
    model.eval()
    generator = torch.Generator().manual_seed(settings.seed + 1)
    sums = [0.0, 0.0]
    rounds = 8
    for _, tokens in zip(range(rounds), batches(stream, settings.batch, settings.length, generator)):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main, mtp = losses(model, tokens.to(device))
        sums[0] += main.item()
        sums[1] += mtp.item()
    model.train()
    return {"valid_bits_per_byte": sums[0] / rounds / math.log(2),
            "valid_mtp_bits_per_byte": sums[1] / rounds / math.log(2)}


def train(settings: Settings, train_stream: torch.Tensor, valid_stream: torch.Tensor,
          device: torch.device) -> tuple[TinyKimi, list[dict[str, float]]]:
    torch.manual_seed(settings.seed)
    model = TinyKimi().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, settings.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(step, settings.steps) / settings.steps)))
    generator = torch.Generator().manual_seed(settings.seed)
    history: list[dict[str, float]] = []
    started = time.monotonic()
    for step, tokens in zip(range(settings.steps), batches(train_stream, settings.batch, settings.length, generator)):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main, mtp = losses(model, tokens.to(device, non_blocking=True))
        (main + settings.mtp_weight * mtp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        for moe in model.moe_layers():
            moe.balance(settings.bias_rate)
        out_of_time = time.monotonic() - started > settings.max_minutes * 60
        if step % 100 == 0 or step == settings.steps - 1 or out_of_time:
            point = {"step": step, "seconds": round(time.monotonic() - started, 1),
                     "train_bits_per_byte": main.item() / math.log(2),
                     "train_mtp_bits_per_byte": mtp.item() / math.log(2)}
            if step % 500 == 0 or step == settings.steps - 1 or out_of_time:
                point.update(evaluate(model, valid_stream, settings, device))
            history.append(point)
            print(json.dumps(point), flush=True)
        if out_of_time:  # the history's last step says where it stopped
            break
    return model, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="packed weights (.safetensors)")
    parser.add_argument("--corpus", help="a standard library directory or .tar.xz (default: this Python's)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mtp-weight", type=float, default=0.3)
    parser.add_argument("--bias-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--max-minutes", type=float, default=30.0, help="stop early (and say so) after this long")
    args = parser.parse_args()
    from safetensors.torch import save_file

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = Settings(args.steps, args.batch, args.length, args.lr, args.mtp_weight, args.bias_rate, args.seed,
                        args.max_minutes)
    files, corpus = load_corpus(args.corpus)
    train_stream, valid_stream = split_stream(files)
    print(json.dumps({"corpus": corpus, "train_bytes": train_stream.numel(), "device": str(device)}), flush=True)
    model, history = train(settings, train_stream, valid_stream, device)
    packed = quantize(checkpoint_tensors(model))
    metadata = {"corpus": corpus, "settings": vars(settings), "history": history,
                "command": "python scripts/train_default_model.py " + " ".join(sys.argv[1:]),
                "torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(packed, args.out, metadata={"moetrace_training": json.dumps(metadata)})
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
