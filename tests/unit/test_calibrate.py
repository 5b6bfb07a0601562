"""`moetrace calibrate` on the CPU: the fits against hand-computed cases, the expert layer against a reference,
the measuring grid, a gloo all-reduce across 2 processes, and the command end to end. GPU paths are skipped where
no GPU exists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from moetrace.analysis.shape import shape_from_config
from moetrace.calibrate import SCHEMA
from moetrace.calibrate.allreduce import measure_allreduce
from moetrace.analysis.calibration import attention_curve
from moetrace.calibrate.attention import MlaDecode, fit_attention
from moetrace.calibrate.experts import (
    ExpertPool,
    group_offsets,
    measure_curve,
    time_calls,
    weight_bytes_per_expert,
)
from moetrace.calibrate.fit import fit_allreduce, fit_expert_time, least_squares
from moetrace.calibrate.settings import Settings, allreduce_world_sizes, expert_configs

CPU = torch.device("cpu")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than 2 CUDA GPUs here")


def test_least_squares_recovers_exact_coefficients() -> None:
    xs = [1.0, 2.0, 3.0, 5.0, 8.0]
    zs = [2.0, 1.0, 7.0, 3.0, 4.0]
    y = [4.0 + 2.5 * x - 0.5 * z for x, z in zip(xs, zs)]
    c = least_squares([[1.0] * 5, xs, zs], y)
    assert c == pytest.approx([4.0, 2.5, -0.5])
    with pytest.raises(ValueError):
        least_squares([[1.0], [2.0]], [1.0])


def test_fit_expert_time_and_quality() -> None:
    points = [{"experts": e, "rows": r, "time_us": 30.0 + 4.0 * e + 0.1 * r} for e, r in
              [(8, 8), (16, 16), (8, 64), (32, 64), (64, 512), (128, 512)]]
    fit = fit_expert_time(points)
    assert (fit["c0_us"], fit["per_expert_us"], fit["per_row_us"]) == pytest.approx((30.0, 4.0, 0.1))
    assert fit["r2"] == pytest.approx(1.0) and fit["max_rel_err"] == pytest.approx(0.0, abs=1e-9)


def test_fit_allreduce_bus_bandwidth_by_hand() -> None:
    # 10 µs + 1 µs per 100 kB: algorithm bandwidth 100 GB/s; bus bandwidth ×2(N−1)/N
    points = [{"bytes": b, "time_us": 10.0 + b / 1e5} for b in (14336, 57344, 917504)]
    two = fit_allreduce(points, 2)
    assert two["latency_us"] == pytest.approx(10.0)
    assert two["bus_bandwidth_gbs"] == pytest.approx(100.0)
    assert fit_allreduce(points, 8)["bus_bandwidth_gbs"] == pytest.approx(175.0)


def test_group_offsets_and_weight_bytes() -> None:
    offsets, total = group_offsets(10, 3, CPU)
    assert offsets.tolist() == [4, 7, 10] and total == 10
    offsets, total = group_offsets(10, 3, CPU, multiple=16)
    assert offsets.tolist() == [16, 32, 48] and total == 48
    with pytest.raises(ValueError):
        group_offsets(2, 3, CPU)
    # Kimi-K2 expert: 3·7168·2048 weights; INT4 with a bf16 scale per 32 weights
    assert weight_bytes_per_expert(7168, 2048, 16) == 3 * 7168 * 2048 * 2
    assert weight_bytes_per_expert(7168, 2048, 4, 32) == 3 * 7168 * 2048 // 2 + 3 * 7168 * 2048 // 32 * 2


def test_expert_layer_matches_a_reference_on_cpu() -> None:
    pool = ExpertPool(hidden=32, width=16, pool=6, fmt="bf16", device=CPU)
    assert pool.check() is None
    torch.manual_seed(7)
    call, rows = pool.layer_call(experts=3, rows=7)
    out = call(1)  # the second offset: experts 3, 4, 5, holding rows 0-2, 3-4 and 5-6
    assert isinstance(out, torch.Tensor) and out.shape == (rows, 32)
    torch.manual_seed(7)  # the same input the call drew
    x = torch.randn(rows, 32).to(torch.bfloat16).float()
    expected = []
    for expert, (first, end) in zip((3, 4, 5), ((0, 3), (3, 5), (5, 7))):
        h = x[first:end] @ pool.w13[expert].float().T  # [rows, 2·width]: gate, then up
        expected.append((torch.nn.functional.silu(h[:, :16]) * h[:, 16:]) @ pool.w2[expert].float().T)
    reference = torch.cat(expected)
    assert float((out.float() - reference).norm() / reference.norm()) < 0.02  # bf16 rounding of h and the result
    fp8 = ExpertPool(hidden=32, width=16, pool=2, fmt="fp8", device=CPU)
    reason = fp8.check()
    assert reason is None or "cpu" in reason.lower() or "Error" in reason  # CPU torch has no fp8 grouped GEMM
    points = measure_curve(pool, [(1, 1), (2, 4), (4, 8)], reps=2, replays=1, tick=lambda: None)
    assert [p["experts"] for p in points] == [1, 2, 4]
    assert all(p["time_us"] > 0 and p["timing"] == "host-clock" for p in points)


def test_measuring_grid_respects_routing_limits() -> None:
    s = Settings()
    tp, ep = expert_configs(s)
    assert (tp.name, tp.width, tp.pool) == ("tp8", 256, 384)
    assert (ep.name, ep.width, ep.pool) == ("ep8", 2048, 48)
    for experts, rows in tp.grid:  # T tokens pick top_k distinct experts each: top_k ≤ unique ≤ top_k·T
        assert s.top_k <= experts <= min(rows, s.num_experts) and rows % s.top_k == 0
    assert max(e for e, _ in tp.grid) == 384 and max(r for _, r in tp.grid) == 8 * 256  # k = 3 at 64 requests
    assert all(1 <= e <= min(r, 48) for e, r in ep.grid)
    assert allreduce_world_sizes(1) == [] and allreduce_world_sizes(2) == [2]
    assert allreduce_world_sizes(8) == [2, 4, 8] and allreduce_world_sizes(6) == [2, 4, 6]
    with pytest.raises(ValueError):
        Settings(tp=3).check()


def test_gloo_allreduce_two_processes() -> None:
    ticks: list[int] = []
    result = measure_allreduce(2, "gloo", [64, 4096], iters=2, replays=1, tick=lambda: ticks.append(1))
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    assert [p["bytes"] for p in result["points"]] == [64, 4096] and len(ticks) == 2
    assert all(p["time_us"] > 0 and p["timing"] == "host-clock" for p in result["points"])


def test_calibrate_command_writes_json_and_refuses_overwrite(tmp_path: Path) -> None:
    from moetrace.cli import main  # imported here: the GPU machine runs the GPU tests without polars/plotly

    out = tmp_path / "calib.json"
    args = ["calibrate", "--device", "cpu", "--quick", "--formats", "bf16", "--no-allreduce", "-o", str(out)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA and doc["quick"] is True and doc["device"]["type"] == "cpu"
    assert {"torch", "python", "moetrace"} <= set(doc["versions"])
    assert {c["config"] for c in doc["experts"]} == {"tp2", "ep2"}
    assert all("fit" in c for c in doc["experts"])
    # INT4 is estimated for each config whose measured curve rose with the experts (a 2-core CPU under load can
    # time a quick curve flat): its marginal weight bandwidth is what the estimate divides by
    rising = {c["config"] for c in doc["experts"] if c["fit"]["per_expert_us"] > 0 and not c.get("table")}
    assert {(e["config"], e["format"]) for e in doc["int4_estimate"]} == {(name, "int4") for name in rising}
    assert doc["allreduce"]["skipped"] and doc["allreduce"]["world_sizes_measured"] == []
    again = CliRunner().invoke(main, args, catch_exceptions=False)
    assert again.exit_code == 1 and "already exists" in again.output and "Traceback" not in again.output
    bad = CliRunner().invoke(main, ["calibrate", "--device", "cpu", "--quick", "--formats", "int3", "-o",
                                    str(tmp_path / "x.json")], catch_exceptions=False)
    assert bad.exit_code == 1 and "unknown weight format" in bad.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal")
def test_vllm_kernel_on_the_cpu_is_skipped_with_why_and_the_grouped_gemms_still_measured(tmp_path: Path) -> None:
    from moetrace.cli import main

    out = tmp_path / "calib.json"
    args = ["calibrate", "--device", "cpu", "--quick", "--formats", "bf16", "--no-allreduce", "--vllm-kernel",
            "-o", str(out)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    curves = json.loads(out.read_text())["experts"]
    # tp2 gets a vLLM curve next to its grouped GEMM; ep2 (whole experts per rank) does not
    assert [(c["config"], "fit" in c) for c in curves] == [("tp2", True), ("tp2", False), ("ep2", True)]
    assert curves[1]["skipped"] == "vLLM fused_experts cannot run on cpu: vLLM's fused_experts is a Triton kernel " \
                                   "for CUDA GPUs"
    assert "note: experts tp2 bf16 vLLM fused_experts: vLLM fused_experts cannot run on cpu" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_calibrate_without_gpu_says_so(tmp_path: Path) -> None:
    from moetrace.cli import main

    result = CliRunner().invoke(main, ["calibrate", "--quick", "-o", str(tmp_path / "c.json")],
                                catch_exceptions=False)
    assert result.exit_code == 1 and "no CUDA device" in result.output


@needs_gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_expert_layer(fmt: str) -> None:
    pool = ExpertPool(hidden=512, width=256, pool=16, fmt=fmt, device=torch.device("cuda", 0))
    reason = pool.check()
    if fmt == "fp8" and reason is not None and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip(f"fp8 grouped GEMM needs Hopper or newer: {reason}")
    assert reason is None
    points = measure_curve(pool, [(1, 1), (8, 8)], reps=4, replays=2, tick=lambda: None)
    assert all(p["time_us"] > 0 for p in points)


@needs_gpu
def test_vllm_fused_experts_matches_a_float32_expert_layer_and_times() -> None:
    pytest.importorskip("vllm.model_executor.layers.fused_moe")
    from moetrace.calibrate.experts import vllm_kernel_context

    pool = ExpertPool(hidden=512, width=256, pool=16, fmt="bf16", device=torch.device("cuda", 0))
    assert pool.fused_moe_check(top_k=4) is None
    with vllm_kernel_context():
        points = measure_curve(pool, [(4, 4), (8, 8)], reps=4, replays=2, tick=lambda: None, fused_moe_top_k=4)
    assert [p["rows_computed"] for p in points] == [4, 8] and all(p["time_us"] > 0 for p in points)


def test_the_mla_reference_is_attention_of_every_query_over_the_shared_latent_cache() -> None:
    """The absorbed MLA the calibration times on the CPU equals torch's scaled_dot_product_attention with the latent
    as keys and its first kv_lora_rank values as values, for 2 requests × 3 queries × 4 heads."""
    decode = MlaDecode(heads=4, latent=32, rope=16, device=CPU)
    query, cache = torch.randn(2, 12, 48), torch.randn(2, 100, 48)
    theirs = torch.nn.functional.scaled_dot_product_attention(query, cache, cache[..., :32], scale=decode.scale)
    assert torch.allclose(decode.reference(query, cache), theirs, atol=1e-5)


def test_the_attention_fit_recovers_each_query_and_request_counts_line_and_a_quick_calibration_times_it(
        tmp_path: Path) -> None:
    """Points drawn from 3 + 0.5·B + 0.001·B·L (Q = 1) and 5 + 1·B + 0.002·B·L (Q = 3) give back each (Q, B)'s line
    over L (c0 = 3 + 0.5·B, 0.001·B a token at Q = 1); `moetrace calibrate --quick` times every (B, Q, L) of its grid
    and names its kernel."""
    points = [{"batch": b, "queries": q, "context": c,
               "time_us": (3 + 0.5 * b + 0.001 * b * c) if q == 1 else (5 + b + 0.002 * b * c)}
              for b in (1, 4, 16) for q in (1, 3) for c in (512, 4096, 32768)]
    fits = {(f["queries"], f["batch"]): f for f in fit_attention(points)}
    assert sorted(fits) == [(q, b) for q in (1, 3) for b in (1, 4, 16)]
    assert [fits[(1, 4)][key] for key in ("c0_us", "per_context_token_us")] == pytest.approx([5, 0.004], rel=1e-6)
    assert fits[(3, 16)]["per_context_token_us"] == pytest.approx(0.032, rel=1e-6)
    assert max(f["max_relative_miss"] for f in fits.values()) < 1e-9
    # 16 requests at one context only (the longer ones out of memory): no line, read between 4 and 64 requests
    alone = [p for p in points if p["batch"] != 16 or p["context"] == 512] + [
        {**p, "batch": 64, "time_us": p["time_us"] * 4} for p in points if p["batch"] == 16]
    assert sorted({f["batch"] for f in fit_attention(alone)}) == [1, 4, 64]
    # without 64: 16 requests were timed (at one context) but got no line, so 16 is past what the curve holds
    short = [p for p in points if p["batch"] != 16 or p["context"] == 512]
    lines_of = {"points": short, "fit": fit_attention(short), "kernel": "by hand", "kv_bytes_per_token_layer": 1152}
    held = attention_curve({"attention": lines_of})
    assert held is not None and held.max_batch == 4 and held.extrapolated(16, 1, 512)
    # the report's curve: linear in requests between the timed ones (2 between 1 and 4), in queries between 1 and 3
    curve = attention_curve({"attention": {"points": points, "fit": list(fits.values()), "kernel": "by hand",
                                           "kv_bytes_per_token_layer": 1152}})
    assert curve is not None and curve.layer_us(2, 1, 4096) == pytest.approx(3 + 0.5 * 2 + 0.001 * 2 * 4096)
    assert curve.layer_us(2, 2, 4096) == pytest.approx((3 + 1 + 0.002 * 4096 + 5 + 2 + 0.004 * 4096) / 2)
    from moetrace.cli import main

    out = tmp_path / "c.json"
    args = ["calibrate", "--device", "cpu", "--quick", "--formats", "bf16", "--no-allreduce", "-o", str(out)]
    assert CliRunner().invoke(main, args, catch_exceptions=False).exit_code == 0
    attention = json.loads(out.read_text())["attention"]
    quick = Settings.quick_settings("cpu")
    assert sorted((p["batch"], p["queries"], p["context"]) for p in attention["points"]) == sorted(
        (b, q, c) for b in quick.attention_batches for q in quick.attention_queries for c in quick.attention_contexts)
    assert attention["kernel"].startswith("reference") and attention["kv_bytes_per_token_layer"] == (32 + 16) * 2
    assert all(p["time_us"] > 0 for p in attention["points"]) and sorted(
        (f["queries"], f["batch"]) for f in attention["fit"]) == sorted(
        (q, b) for q in quick.attention_queries for b in quick.attention_batches)


def test_an_attention_point_past_the_memory_left_is_skipped_with_why_and_the_others_timed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest point running out of GPU memory (raised where the CPU cannot run out) costs that point alone."""
    from moetrace.calibrate import attention

    real = attention.time_calls

    def out_of_memory_at_the_largest(call: Any, device: torch.device, reps: int, replays: int) -> tuple[float, str]:
        if call(0).shape[0] == 2 and call(0).shape[1] == 6:  # 2 requests × 3 queries × 2 heads
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(call, device, reps, replays)

    monkeypatch.setattr(attention, "time_calls", out_of_memory_at_the_largest)
    grid = [(1, 1, 64), (2, 3, 64)]
    section = attention.measure_attention(2, 32, 16, grid, CPU, reps=2, replays=2, progress=lambda done, total: None)
    assert [(p["batch"], p["queries"]) for p in section["points"]] == [(1, 1)]
    assert section["skipped_points"] == [{"batch": 2, "queries": 3, "context": 64, "why": "out of memory"}]


@needs_gpu
def test_vllms_mla_decode_kernels_match_the_reference_and_time_in_a_cuda_graph() -> None:
    """Every vLLM MLA decode kernel that runs here (FlashMLA on Hopper, the Triton decode) within 2e-2 of the
    reference at Kimi-K2's shape on one TP=8 rank, and timed from a captured graph."""
    pytest.importorskip("vllm.v1.attention.ops.triton_decode_attention")
    device = torch.device("cuda", 0)
    decode = MlaDecode(heads=8, latent=512, rope=64, device=device)
    kernels = decode.engine_kernels()
    assert kernels
    for name, make in kernels.items():
        assert decode.error(make) < 2e-2, name
        time_us, mode = time_calls(decode.paged_call(make, 4, 3, 4096), device, reps=4, replays=2)
        assert time_us > 0 and mode == "cuda-graph", name


@needs_two_gpus
def test_nccl_allreduce_two_gpus() -> None:
    result = measure_allreduce(2, "nccl", [14336, 917504], iters=5, replays=2, tick=lambda: None, graph_sizes=1)
    assert [p["bytes"] for p in result["points"]] == [14336, 917504]
    assert all(p["queued_us"] > 0 and p["eager_us"] > 0 for p in result["points"])


def test_shape_from_config_reads_deepseek_and_qwen_names() -> None:
    from moetrace.default_model import CONFIG

    default = shape_from_config(CONFIG)
    assert (default.num_experts, default.top_k, default.hidden_size, default.expert_width) == (384, 8, 64, 16)
    assert (default.num_layers, default.moe_layers, default.shared_experts) == (4, 3, 1)
    qwen = shape_from_config({"text_config": {"num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 2048,
                                              "moe_intermediate_size": 768, "num_hidden_layers": 48}})
    assert (qwen.num_experts, qwen.moe_layers, qwen.expert_width, qwen.shared_experts) == (128, 48, 768, 0)
    with pytest.raises(ValueError, match="not a MoE model"):
        shape_from_config({"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008})


def test_calibrate_measures_the_shape_of_a_model_directory(tmp_path: Path) -> None:
    from moetrace.cli import main

    model = tmp_path / "tiny-moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"n_routed_experts": 16, "num_experts_per_tok": 2,
                                                   "hidden_size": 32, "moe_intermediate_size": 8,
                                                   "num_hidden_layers": 2}))
    out = tmp_path / "c.json"
    result = CliRunner().invoke(main, ["calibrate", "--device", "cpu", "--model", str(model), "--tp", "2", "--ep", "1",
                                       "--formats", "bf16", "--no-allreduce", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["shape"] == {"hidden_size": 32, "expert_width": 8, "num_experts": 16, "top_k": 2}
    assert {(c["config"], c["width"]) for c in doc["experts"]} == {("tp2", 4)}
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"hidden_size": 32, "num_hidden_layers": 2}))
    for path, fragment in ((dense, "not a MoE model"), (tmp_path / "missing", "cannot read")):
        failed = CliRunner().invoke(main, ["calibrate", "--device", "cpu", "--model", str(path), "-o",
                                           str(tmp_path / "x.json")], catch_exceptions=False)
        assert failed.exit_code == 1 and fragment in failed.output and "Traceback" not in failed.output


def test_a_models_mla_shape_and_longest_context_are_what_its_attention_is_timed_at() -> None:
    """The embedded model's config (2 heads, latent 512 + rope 64, 4,096 positions) sets the attention grid; a model
    without an MLA latent times none."""
    from moetrace.commands.calibrate import attention_settings
    from moetrace.default_model import CONFIG

    assert attention_settings(dict(CONFIG)) == {"attention_heads": 2, "kv_lora_rank": 512, "rope_dim": 64,
                                                "attention_contexts": (512, 2048, 4096)}
    assert attention_settings({"num_attention_heads": 32, "max_position_embeddings": 8192}) == {"attention": False}


def _shipped_head_weights() -> dict[str, list[int]]:
    """The shipped EAGLE-3 head's tensor shapes, from its safetensors header (an oracle apart from its config)."""
    import struct

    from moetrace.recording.drafters import DEFAULT_EAGLE3_HEAD

    with open(DEFAULT_EAGLE3_HEAD / "model.safetensors", "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


def test_a_drafters_shape_reads_the_weights_its_checkpoint_holds() -> None:
    from moetrace.calibrate.drafter import drafter_shape
    from moetrace.recording.drafters import DEFAULT_EAGLE3_HEAD

    shape = drafter_shape(json.loads((DEFAULT_EAGLE3_HEAD / "config.json").read_text()), tp=1)
    weights = _shipped_head_weights()
    # what one pass reads: every matrix of the decoder layer ("midlayer") and the LM head (not the fc)
    read = sum(s[0] * s[1] for name, s in weights.items() if len(s) == 2 and name.split(".")[0] in ("midlayer",
                                                                                                   "lm_head"))
    assert shape.parameters() == read
    assert shape.fc_input == weights[next(n for n in weights if n.endswith("fc.weight"))][1]  # 3 aux layers × 64
    assert shape.first_input == 2 * 64 and shape.lm_head_rows == 320


def test_a_grouped_query_drafter_splits_over_tensor_parallel_ranks_by_hand() -> None:
    from moetrace.calibrate.drafter import drafter_shape

    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 512, "intermediate_size": 1024,
              "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
              "draft_vocab_size": 400}
    shape = drafter_shape(config, tp=2)
    # per rank: 4 heads and 1 KV head of 64 → qkv out (4 + 2·1)·64 = 384, o in 256; MLP 2·512 out, 512 in
    assert shape.projections == ((512, 384), (256, 512), (512, 1024), (512, 512))
    assert shape.first_input == 1024 and shape.lm_head_rows == 200 and shape.fc_input == 3 * 512
    assert shape.parameters() == 512 * 384 + 256 * 512 + 512 * 1024 + 512 * 512 + 512 * 384 + 512 * 200
    with pytest.raises(ValueError, match="does not split over tp=3"):
        drafter_shape(config, tp=3)
    with pytest.raises(ValueError, match="routed experts"):
        drafter_shape({**config, "n_routed_experts": 8, "first_k_dense_replace": 0}, tp=1)


def test_calibrate_times_the_shipped_eagle3_head_and_refuses_what_is_no_drafter(tmp_path: Path) -> None:
    from moetrace.cli import main

    out = tmp_path / "calib.json"
    args = ["calibrate", "--device", "cpu", "--quick", "--formats", "bf16", "--no-allreduce", "--drafter", "default",
            "-o", str(out)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    drafter = json.loads(out.read_text())["drafter"]
    assert drafter["method"] == "eagle3" and drafter["tp"] == 2 and drafter["timing"] == ["host-clock"]
    assert [p["tokens"] for p in drafter["points"]] == [1, 2, 4, 8]
    assert all(p["layers_us"] > 0 and p["head_us"] > 0 and p["fc_us"] > 0 for p in drafter["points"])
    assert "drafter eagle3 (Eagle3DeepseekV2ForCausalLM" in result.output
    (tmp_path / "moe").mkdir()
    from moetrace.default_model import CONFIG

    (tmp_path / "moe" / "config.json").write_text(json.dumps(CONFIG))
    for drafter_path, why in ((tmp_path / "nothing", "no readable config.json"), (tmp_path / "moe", "routed experts")):
        failed = CliRunner().invoke(main, [*args[:-4], "--drafter", str(drafter_path), "-o", str(tmp_path / "x.json")],
                                    catch_exceptions=False)
        assert failed.exit_code == 1 and why in failed.output and "Traceback" not in failed.output
        assert not (tmp_path / "x.json").exists()
