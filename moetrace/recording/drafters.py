"""Drafter checkpoints for ``moetrace record --method eagle3 | draft_model``: which one runs (``--drafter``, or the
EAGLE-3 head shipped for the embedded default model), checked against the target before any engine starts, and
what the manifest says of it (path, architecture, parameter count, hash)."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

from moetrace.errors import UserError
from moetrace.trace.drafters import CHECKPOINT_METHODS

# An EAGLE-3 head for the embedded default model, trained by scripts/train_eagle3.py on the default model's own
# auxiliary hidden states over the corpus the model was trained on (MLA attention: on the CPU a head's attention
# shares the target's KV cache group, and only the MLA backend serves the target).
DEFAULT_EAGLE3_HEAD = Path(__file__).parents[1] / "data" / "eagle3-head"

def resolve_drafter(method: str, drafter: str | None, target: Path, embedded_target: bool) -> str | None:
    """The drafter checkpoint ``method`` runs against the model at ``target``: ``drafter`` as given, after
    ``check_drafter``; on the embedded default model (``embedded_target``), its shipped EAGLE-3 head for eagle3 and
    its one-layer cut for draft_model; None for methods that need none."""
    if drafter is None:
        if method == "eagle3" and embedded_target:
            return str(DEFAULT_EAGLE3_HEAD)
        if method == "draft_model" and embedded_target:
            from moetrace.default_model import ensure_default_draft_model

            return str(ensure_default_draft_model())
        if method in CHECKPOINT_METHODS:
            raise UserError(f"--method {method} needs --drafter PATH (drafters come with the embedded default model "
                            f"only)")
        return None
    if method not in CHECKPOINT_METHODS:
        raise UserError(f"--drafter {drafter}: --method {method} drafts without a checkpoint (--drafter goes with "
                        f"{' or '.join(CHECKPOINT_METHODS)})")
    path = Path(drafter).expanduser()
    if not path.is_dir():
        raise UserError(f"drafter not found: {drafter}")
    check_drafter(method, path, read_config(target / "config.json", "the target model"))
    return str(path)


def check_drafter_batch(method: str, drafter: str | None, batch_size: int) -> None:
    """UserError in one line where vLLM cannot draft at ``batch_size`` requests per step: vLLM 0.32's planner of
    MLA context chunks (``plan_mla_context_chunks``) asserts when a draft model's step holds a request with no
    context yet before one with context, which an MLA draft model meets from two requests on."""
    from moetrace.hooks.vllm_api import vllm_version

    if method != "draft_model" or drafter is None or batch_size < 2 or not vllm_version().startswith("0.32."):
        return
    if read_config(Path(drafter) / "config.json", "the drafter").get("kv_lora_rank"):
        raise UserError(f"--method draft_model with an MLA draft model runs at --batch-size 1 on vLLM 0.32 (its MLA "
                        f"context-chunk planner fails once a draft step mixes a new request with running ones), not "
                        f"{batch_size}")


def read_config(path: Path, what: str) -> dict[str, Any]:
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: {what} has no readable config.json ({exc.__class__.__name__})") from None
    return config


def is_eagle3(config: dict[str, Any]) -> bool:
    architecture = " ".join(config.get("architectures") or [])
    return "eagle3" in architecture.lower() or "eagle_aux_hidden_state_layer_ids" in config


def check_drafter(method: str, path: Path, target: dict[str, Any]) -> None:
    """``UserError`` in one line where the checkpoint at ``path`` cannot draft for ``target`` (its config):
    not the kind ``method`` runs, another vocabulary, or (EAGLE-3) a hidden size that is not the target's, whose
    auxiliary layers it reads."""
    config = read_config(path / "config.json", "the drafter (not an EAGLE-3 or draft-model checkpoint)")
    architecture = ", ".join(config.get("architectures") or ["none named"])
    if method == "eagle3" and not is_eagle3(config):
        raise UserError(f"--drafter {path}: {architecture} is not an EAGLE-3 head (--method eagle3)")
    if method == "draft_model" and (is_eagle3(config) or "eagle" in architecture.lower()):
        raise UserError(f"--drafter {path}: {architecture} is an EAGLE head, not a draft model: use --method eagle3")
    if config.get("vocab_size") != target.get("vocab_size"):
        raise UserError(f"--drafter {path}: vocabulary of {config.get('vocab_size')} tokens, the target's has "
                        f"{target.get('vocab_size')}")
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if method == "eagle3" and hidden != target.get("hidden_size"):
        raise UserError(f"--drafter {path}: reads hidden states of size {hidden}, the target's auxiliary layers "
                        f"have {target.get('hidden_size')}")


def safetensors_parameters(path: Path) -> int:
    """Parameters in one safetensors file, from its header (8-byte length, then JSON of dtypes and shapes)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def drafter_checkpoint(path: str) -> dict[str, Any]:
    """What the manifest says of a drafter checkpoint: its path, architecture, parameter count and the sha256 of
    its weight files (in name order)."""
    folder = Path(path)
    config = read_config(folder / "config.json", "the drafter")
    weights = sorted(folder.glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in weights:
        digest.update(file.read_bytes())
    return {"path": str(folder.resolve()), "architecture": ", ".join(config.get("architectures") or []),
            "parameters": sum(safetensors_parameters(file) for file in weights), "sha256": digest.hexdigest()}
