"""Checkpoints as Kimi ships them: Kimi-K2.5's multimodal wrapper records its language model's MoE layers, and a
model folder without a tokenizer (a config for dummy weights) records on its prompts' bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
from vllm_fixtures import run_cli

from moetrace.default_model import encode_text, ensure_default_model
from moetrace.recording.prompts import BUILTIN_PROMPTS
from moetrace.trace.reader import open_trace


def kimi_k25_folder(folder: Path) -> dict[str, Any]:
    """``KimiK25ForConditionalGeneration`` around the embedded default model's DeepseekV3 config (a MoonViT of one
    layer, never built: text only), no tokenizer; returns the text config."""
    text = json.loads((ensure_default_model() / "config.json").read_text())
    text.pop("architectures", None)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
        "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "num_attention_heads": 2,
                          "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                          "merge_kernel_size": [2, 2]},
        "projection_hidden_size": 64, "image_token_id": 300, "video_token_id": 301, "tie_word_embeddings": False}))
    return text


def test_a_kimi_k25_checkpoint_records_its_language_models_moe_layers_on_byte_prompts(tmp_path: Path) -> None:
    text = kimi_k25_folder(tmp_path / "kimi-k25")
    done = run_cli("record", str(tmp_path / "kimi-k25"), "--k", "2", "--max-tokens", "12", "--num-prompts", "2",
                   "--batch-size", "2", "--out", str(tmp_path / "out"), "--engine-arg", "load_format=dummy",
                   "--engine-arg", 'limit_mm_per_prompt={"image": 0, "video": 0}')
    assert done.returncode == 0, done.stderr[-3000:]
    trace = open_trace(tmp_path / "out" / "kimi-k25-ngram-k2")
    dense = int(text["first_k_dense_replace"])
    moe_layers = list(range(dense, int(text["num_hidden_layers"])))
    assert list(trace.manifest.model.moe_layers) == moe_layers and trace.manifest.model.num_experts == 384
    assert trace.manifest.document["model"]["architecture"] == "KimiK25ForConditionalGeneration"
    routing = trace.routing().collect()
    assert sorted(routing["layer"].unique().to_list()) == moe_layers
    scheduled = int(trace.steps().select(pl.col("num_tokens").sum()).collect().item())
    assert routing.height == scheduled * len(moe_layers) > 0, "every scheduled token, in every MoE layer"
    # No tokenizer: each request's prompt went in as its UTF-8 bytes after BOS, as the embedded default's does
    prompts = (routing.filter((pl.col("layer") == moe_layers[0]) & (pl.col("phase").cast(pl.String) == "prefill"))
               .sort("position").group_by("request", maintain_order=True).agg("token"))
    assert sorted(prompts["token"].to_list()) == sorted(encode_text(p) for p in BUILTIN_PROMPTS[:2])
