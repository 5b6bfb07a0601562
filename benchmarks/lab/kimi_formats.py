"""Kimi's checkpoint formats recorded on a GPU: model folders, then each recording checked against vLLM itself.

    python benchmarks/lab/kimi_formats.py model-dirs DIR     # DIR/kimi-k2-tp8-int4, -fp8, DIR/kimi-k25-tiny
    python benchmarks/lab/kimi_formats.py check TRACE [--json FILE]

``model-dirs`` writes configs for dummy weights (``load_format=dummy``), without a tokenizer (``moetrace record``
feeds such a model its prompts' bytes):
- ``kimi-k2-tp8-int4``: the Kimi-K2 TP=8 slice (``kimi_slice.py``) with Kimi-K2.5's quantization_config
  (compressed-tensors, INT4 weights, symmetric, group 32, pack-quantized; attention, shared experts, the dense MLP
  and lm_head left in bf16), served by vLLM's Marlin MoE kernels;
- ``kimi-k2-tp8-fp8``: the slice with Kimi-K2's (FP8 e4m3, 128 x 128 weight blocks, dynamic activation scales);
- ``kimi-k25-tiny``: ``KimiK25ForConditionalGeneration`` around the embedded default model's DeepseekV3 config (a
  MoonViT of one layer; recorded text only, ``limit_mm_per_prompt`` 0).

``check`` compares a trace recorded with ``--engine-arg enable_return_routed_experts=true`` against what vLLM said:
- every token of vLLM's own routed-experts capture (the tokens a request kept: prompt, anchors, accepted
  drafts; ``vllm-routed-experts.npz``, row i = position i, one row per decoder layer) against the trace's rows of
  the same request, position and layer, as expert sets;
- the trace's drafts and accepted tokens against vLLM's spec-decode counters (the manifest's ``vllm_counters``);
- the manifest's expert format against the model's config, and the bytes the cost model prices per expert against
  the same bytes counted here from the config alone (weights, plus one scale per group).
Exits 1 when any of them differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.checked import finish  # noqa: E402
from lab.kimi_slice import KIMI_K2_FP8, KIMI_K25_INT4, kimi_k2_slice  # noqa: E402

# Bytes per expert counted from the config alone: (bits per weight, weights per scale, bits per scale)
PRICED = {"int4": (4, 32, 16), "fp8": (8, 128 * 128, 32)}


def model_dirs(out: Path) -> None:
    from moetrace.default_model import ensure_default_model

    for name, quant in (("int4", KIMI_K25_INT4), ("fp8", KIMI_K2_FP8)):
        folder = out / f"kimi-k2-tp8-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        config = {**kimi_k2_slice(8), "quantization_config": quant}
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    text = json.loads((ensure_default_model() / "config.json").read_text())
    text.pop("architectures", None)
    folder = out / "kimi-k25-tiny"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "torch_dtype": "bfloat16",
        "text_config": text, "tie_word_embeddings": False, "projection_hidden_size": 64,
        "media_placeholder_token_id": 300, "image_token_id": 300, "video_token_id": 301,
        "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "num_attention_heads": 2,
                          "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                          "merge_kernel_size": [2, 2]}}, indent=1))
    print(f"model folders in {out}")


def expert_rows_against_vllm(trace_dir: Path) -> dict[str, Any]:
    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    ids = {rid.rsplit("-", 1)[0]: index for index, rid in trace.request_ids().items()}
    captured = np.load(trace_dir / "vllm-routed-experts.npz")
    layers = trace.manifest.model.moe_layers
    frames = []
    for request_id in captured.files:
        block = captured[request_id]  # [tokens, decoder layers, top_k]
        for layer in layers:
            frames.append(pl.DataFrame({
                "request": pl.Series([ids[request_id]] * block.shape[0], dtype=pl.UInt32),
                "position": pl.Series(np.arange(block.shape[0]), dtype=pl.UInt32),
                "layer": pl.Series([layer] * block.shape[0], dtype=pl.UInt16),
                "vllm": pl.Series(np.sort(block[:, layer, :], axis=1).tolist(), dtype=pl.List(pl.Int64))}))
    vllm = pl.concat(frames)
    from moetrace.analysis.predicates import in_sequence

    kept = in_sequence() | (pl.col("phase").cast(pl.String) == "prefill")  # prompt tokens too, as vLLM's
    ours = (trace.routing().filter(kept).select(
        "request", "position", "layer", moetrace=pl.col("experts").arr.sort().cast(pl.List(pl.Int64))).collect())
    both = vllm.join(ours, on=["request", "position", "layer"], how="full", coalesce=True)
    matched = both.filter(pl.col("vllm").is_not_null() & pl.col("moetrace").is_not_null())
    # vLLM's rows end at the request's last position but one: an accepted draft past max_tokens (verified, counted
    # by vLLM as accepted, then cut from the output) is only in the trace
    ends = pl.DataFrame({"request": pl.Series([ids[r] for r in captured.files], dtype=pl.UInt32),
                         "end": [captured[r].shape[0] for r in captured.files]})
    past_end = (both.filter(pl.col("vllm").is_null()).join(ends, on="request")
                .filter(pl.col("position") >= pl.col("end")).height)
    return {"vllm_rows": vllm.height, "moetrace_rows": ours.height, "in_both": matched.height,
            "experts_equal": int((matched["vllm"] == matched["moetrace"]).sum()),
            "only_vllm": int(both["moetrace"].is_null().sum()), "only_moetrace": int(both["vllm"].is_null().sum()),
            "only_moetrace_past_the_end": past_end}


def counters_against_vllm(trace_dir: Path) -> dict[str, Any]:
    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    steps = trace.steps().filter(pl.col("num_drafts") > 0).select(
        pl.len().alias("num_drafts"), pl.col("num_drafts").sum().alias("num_draft_tokens"),
        pl.col("num_accepted").sum().alias("num_accepted_tokens")).collect().row(0, named=True)
    vllm = {key: int(value) for key, value in (trace.manifest.document.get("vllm_counters") or {}).items()}
    counts = trace.manifest.counts
    return {"moetrace": steps, "vllm": vllm, "equal": {k: int(v) for k, v in steps.items()} == vllm,
            "discarded_request_steps": counts.get("discarded_request_steps"),
            "discarded_tokens": counts.get("discarded_tokens")}


def format_against_config(trace_dir: Path) -> dict[str, Any]:
    from moetrace.analysis.shape import ModelShape
    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    model = trace.manifest.document["model"]
    quant = json.loads(Path(model["path"], "config.json").read_text()).get("quantization_config") or {}
    name = "int4" if quant.get("quant_method") == "compressed-tensors" else "fp8" if quant else None
    weights = 3 * int(model["hidden_size"]) * int(model["expert_width"])
    if name is None:
        expected = weights * {"bfloat16": 2, "float16": 2, "float32": 4}[model["dtype"]]
    else:
        bits, per_scale, scale_bits = PRICED[name]
        expected = weights * bits // 8 + weights // per_scale * scale_bits // 8
    priced = ModelShape.from_manifest(trace.manifest).expert_bytes
    return {"expert_format": model.get("expert_format"), "expert_weight_bits": model.get("expert_weight_bits"),
            "quant_group_size": model.get("quant_group_size"), "quant_scale_bits": model.get("quant_scale_bits"),
            "expert_bytes_priced": priced, "expert_bytes_from_config": expected, "equal": priced == expected,
            "architecture": model.get("architecture"), "moe_layers": model.get("moe_layers")}


def check(trace_dir: Path) -> dict[str, Any]:
    """Rows against vLLM's capture where it ran (draft_model on vLLM 0.34 refuses it: "AuxOutput Connector only
    supports generate runners"), counters and format always."""
    rows = expert_rows_against_vllm(trace_dir) if (trace_dir / "vllm-routed-experts.npz").exists() else None
    result = {"trace": str(trace_dir), "rows": rows, "counters": counters_against_vllm(trace_dir),
              "format": format_against_config(trace_dir)}
    result["ok"] = bool((rows is None or (rows["experts_equal"] == rows["vllm_rows"] == rows["in_both"]
                                          and rows["only_moetrace"] == rows["only_moetrace_past_the_end"]))
                        and result["counters"]["equal"] and result["format"]["equal"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dirs = commands.add_parser("model-dirs")
    dirs.add_argument("out", type=Path)
    checked = commands.add_parser("check")
    checked.add_argument("trace", type=Path)
    checked.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "model-dirs":
        model_dirs(args.out)
        return
    finish(check(args.trace), args.json)


if __name__ == "__main__":
    main()
