"""Kimi-K2's per-GPU slice as a model config, for the GPU benchmarks (dummy weights: ``load_format=dummy``)."""

from __future__ import annotations

from typing import Any

# Kimi-K2.5's own quantization_config (moonshotai/Kimi-K2.5, as Kimi-K2-Thinking's)
KIMI_K25_INT4 = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
# Kimi-K2's (moonshotai/Kimi-K2-Instruct)
KIMI_K2_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
QUANTIZATION = {"bf16": None, "int4": KIMI_K25_INT4, "fp8": KIMI_K2_FP8}


def kimi_k2_slice(tp: int) -> dict[str, Any]:
    """Kimi-K2's config with every per-GPU dimension divided by ``tp`` (what one rank of a TP=``tp`` deployment
    holds when this model runs on one GPU: hidden 7168, MLA with 64/``tp`` heads, 384 routed experts of width
    2048/``tp`` plus one shared expert, top-8, sigmoid + selection bias, bf16), and 17 of its 61 layers (16 MoE
    layers after one dense layer)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "vocab_size": 163840 // tp, "hidden_size": 7168, "intermediate_size": 18432 // tp,
        "moe_intermediate_size": 2048 // tp, "num_hidden_layers": 17, "num_attention_heads": 64 // tp,
        "num_key_value_heads": 64 // tp, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 50000.0,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
    }


def kimi_k2_eagle3_head(tp: int = 1) -> dict[str, Any]:
    """The shape of the public Kimi-K2 EAGLE-3 heads (one MLA decoder layer on hidden 7168, the target's MLA
    dimensions and dense width, the full 163,840-token vocabulary, three auxiliary layers) with every per-GPU
    dimension divided by ``tp`` as ``kimi_k2_slice`` divides the target's: at ``tp`` 1 for ``moetrace calibrate
    --drafter`` (which splits it by its own TP), at 8 as the drafter of the TP=8 slice. Its auxiliary layers are 1,
    8 and 14 of the slice's 17 (the public heads read 1, 29 and 57 of 61). Dummy weights."""
    target = kimi_k2_slice(tp)
    attention = {key: value for key, value in target.items()
                 if key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                            "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
                            "rope_theta")}
    return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "torch_dtype": "bfloat16",
            "hidden_size": 7168, "num_hidden_layers": 1, "vocab_size": target["vocab_size"],
            "draft_vocab_size": target["vocab_size"], "target_hidden_size": 7168,
            "eagle_aux_hidden_state_layer_ids": [1, 8, 14], "hidden_act": "silu", **attention,
            # Kimi-K2's own rope (YaRN): vLLM 0.26 gives a DeepSeek head without one a scaled rope and no factor
            "max_position_embeddings": 131072,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}


# vLLM's MXFP4 checkpoint form (``quant_method`` "mxfp4": E2M1 values, one E8M0 scale per 32), as K3's experts
KIMI_K3_MXFP4 = {"quant_method": "mxfp4"}


def kimi_k3_slice(tp: int, quantization: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Kimi-K3-shaped per-GPU slice for vLLM 0.34's ``KimiLinearForCausalLM`` (K3's text model,
    ``vllm/models/kimi_k3/``), every per-GPU dimension divided by ``tp``: latent MoE of 896 routed experts, top-16 by
    grouped top-k, the experts computing in a latent width; hybrid attention, Kimi Delta Attention in three layers of
    four and MLA in the fourth (``linear_attn_config``, 1-based layer numbers as vLLM reads them); 16 layers after
    one dense one. K3's published widths were not at hand: hidden 7168, latent 2048, expert width 2048, MLA and KDA
    dimensions are Kimi-K2's and Kimi-Linear's, assumed. ``quantization``: e.g. ``KIMI_K3_MXFP4``. Dummy weights."""
    layers = 17
    full_attention = [n for n in range(1, layers + 1) if n % 4 == 0]
    config: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "bfloat16",
        "vocab_size": 163840 // tp, "hidden_size": 7168, "intermediate_size": 18432 // tp,
        "num_hidden_layers": layers, "num_attention_heads": 64 // tp, "num_key_value_heads": 64 // tp,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 1,
        "moe_intermediate_size": 2048 // tp, "routed_expert_hidden_size": 2048, "latent_moe_use_norm": False,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.827,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": False,
        "linear_attn_config": {"kda_layers": [n for n in range(1, layers + 1) if n not in full_attention],
                               "full_attn_layers": full_attention, "num_heads": 64 // tp, "head_dim": 128,
                               "short_conv_kernel_size": 4},
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 8464, "rope_theta": 50000.0,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
    }
    if quantization is not None:
        config["quantization_config"] = quantization
    return config
