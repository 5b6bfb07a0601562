"""What every import shares: the model's layers and manifest, and writing the trace all or nothing."""


from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


from moetrace.trace.model_config import config_value
from moetrace.errors import UserError
from moetrace.recording.record import ResolvedModel
from moetrace.trace.schema import (
    SCHEMA_VERSION,
)
from moetrace.trace.files import StepCapture, TraceFiles



def model_layers(model: ResolvedModel) -> int:
    """The decoder layers of ``model`` (its config's ``num_hidden_layers``): an engine returns a row for each."""
    return int(config_value(json.loads((model.path / "config.json").read_text()), "num_hidden_layers") or 0)


def model_manifest(model: ResolvedModel, config: dict[str, Any], moe_layers: list[int]) -> dict[str, Any]:
    """The manifest's ``model`` for an imported trace, from the model's config (the engine's dtype and quantisation
    are not in its routing: bf16 experts assumed)."""
    return {
        "name": model.name,
        "path": str(model.path),
        "architecture": (config.get("architectures") or ["?"])[0],
        "random_weights": False,  # not in the routing: the engine ran the weights it loaded
        "num_layers": int(config_value(config, "num_hidden_layers") or 0),
        "moe_layers": moe_layers,
        "num_experts": model.num_experts,
        "top_k": model.top_k,
        "shared_experts": int(config_value(config, "n_shared_experts") or 0),
        "hidden_size": int(config_value(config, "hidden_size") or 0),
        "expert_width": int(config_value(config, "moe_intermediate_size", "intermediate_size") or 0),
        "scoring_func": config_value(config, "scoring_func"),
        "dtype": "bfloat16",
        "expert_weight_bits": 16,
        "quant_group_size": None,
    }


def config_moe_layers(config: dict[str, Any]) -> list[int]:
    """The MoE layers a config declares: every decoder layer from ``first_k_dense_replace`` on."""
    return list(range(int(config_value(config, "first_k_dense_replace") or 0),
                      int(config_value(config, "num_hidden_layers") or 0)))


def imported_manifest(model: ResolvedModel, config: dict[str, Any], moe_layers: list[int], out: Path,
                      token_ids: bool, source: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a k = 0 trace imported from ``source`` (the manifest's ``source``)."""
    return {
        "schema": SCHEMA_VERSION,
        "run_id": out.name,
        "model": model_manifest(model, config, moe_layers),
        "parallel": {"tp": 1, "ep": 1, "pp": 1, "dp": 1, "expert_placement": "linear"},
        "spec": {"method": None, "k": 0},
        "capture": {"candidates": 0, "token_ids": token_ids},
        "source": source,
    }


def write_trace(captures: list[StepCapture], manifest: dict[str, Any], moe_layers: list[int], top_k: int,
                out: Path) -> dict[str, Any]:
    """Write ``captures`` as one trace at ``out`` (all or nothing: into a sibling directory renamed into place).
    Returns the closed manifest."""
    staging = out.with_name(f".{out.name}.importing")
    shutil.rmtree(staging, ignore_errors=True)
    try:  # written as the writer process writes a recording, then renamed into place
        files = TraceFiles(staging, manifest, moe_layers, top_k, candidates=0, rotate_rows=4_000_000,
                           rotate_seconds=float("inf"), row_group_rows=262_144, write_every_seconds=0.0)
        files.write(list(captures))
        manifest = files.close({}, None)
        if not manifest["complete"]:
            raise UserError(f"{out}: writing the trace failed: {manifest['error']}")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest

