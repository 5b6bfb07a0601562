# Sourced on the GPU host before anything that imports torch 2.14 or vLLM 0.34. The path, first to last: the project
# installed with its dist-info (setup.sh), vLLM 0.34 and its dependencies (receive.sh: vsite), torch 2.14 and
# its NCCL (receive.sh: site), then the host's own packages. torch's tree before the host's, so `import torch` takes it,
# and its NCCL first among the nvidia/*/lib folders torch preloads (it searches sys.path in order).
export GPU_KIT_HOME=${GPU_KIT_HOME:-$HOME/.cache/gpu-kit-034}
export PYTHONPATH=$GPU_KIT_HOME/project:$GPU_KIT_HOME/vsite:$GPU_KIT_HOME/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The samplers (v1/sample/ops/topk_topp_sampler.flashinfer_sampler_supported, called by Model Runner V2's Sampler)
# import vllm.v1.attention.backends.flashinfer, which imports flashinfer at module level, unless this is 0; flashinfer
# is not in the kit (vLLM's other flashinfer uses are behind has_flashinfer()).
export VLLM_USE_FLASHINFER_SAMPLER=0
# DeepGEMM is removed from the slim wheel (its JIT needs nvcc, which the host lacks): FP8 GEMMs and MoE take CUTLASS
# block-FP8 / Triton instead of looking for it.
export VLLM_USE_DEEP_GEMM=0 VLLM_MOE_USE_DEEP_GEMM=0
# Keep NVLink multicast off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
