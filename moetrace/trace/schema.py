"""The v1 trace contract: table schemas, file layout and the version string.

Recording (``moetrace.hooks``) and analysis (``moetrace.analysis``) meet only through the files described here,
so this module depends on pyarrow alone.
"""

from __future__ import annotations

import pyarrow as pa

from moetrace.errors import UserError

SCHEMA_VERSION = "moetrace/1"
MANIFEST_NAME = "manifest.json"
ENGINE_ROUTED_EXPERTS_NAME = "vllm-routed-experts.npz"  # vLLM's own arrays, when the engine returned them
ROUTING_DIR = "routing"
STEPS_DIR = "steps"
TELEMETRY_DIR = "telemetry"
INPROGRESS_SUFFIX = ".inprogress"  # a table file being written: renamed without it once closed

# Key under which every Parquet footer carries the schema version (and the run id), so one file read alone
# still says what it is.
FOOTER_SCHEMA_KEY = b"moetrace.trace.schema"
FOOTER_RUN_KEY = b"moetrace.run_id"

TOKEN_PHASES = ("prefill", "decode", "verify")  # routing ``phase``: what the token's step did for its request
# manifest ``phases``: the vLLM calls a recorded step is timed in. forward: from the step's start in execute_model
# to sampling (input preparation and the forward's launch; on the device, the forward's kernels); sampling:
# _sample (the rejection sampler under speculation); drafting: propose_draft_token_ids
TIMED_CALLS = ("forward", "sampling", "drafting")
MAX_K = 16


def check_k(k: int, option: str = "--k") -> int:
    """``k`` where it is a draft length moetrace handles (0..MAX_K), else one line naming ``option``."""
    if not 0 <= k <= MAX_K:
        raise UserError(f"{option} {k}: must be between 0 and {MAX_K}")
    return k


# manifest ``source.lacks``: what the source of an imported trace (``moetrace import``) could not know, so the report
# leaves out what rests on it. Returned routing (vLLM's and SGLang's routed experts) holds the tokens each request
# kept; SGLang's expert distribution recorder (``per_token`` dumps) holds every token a forward pass routed and the
# pass's token groups, but not which token groups of different passes are one request
SOURCE_LACKS = ("rejected_drafts", "router_weights", "acceptance", "step_timing", "batching", "request_identity")
ROUTED_EXPERTS_LACKS = ("rejected_drafts", "router_weights", "acceptance", "step_timing", "batching")
SGLANG_RECORDER_LACKS = ("request_identity", "router_weights", "step_timing")

def routing_schema(top_k: int, candidates: int = 0, weight_type: pa.DataType = pa.float16()) -> pa.Schema:
    """Schema of ``routing/*.parquet``: one row per (step, token, MoE layer)."""
    fields = [
        pa.field("step", pa.uint32(), nullable=False),
        pa.field("request", pa.uint32(), nullable=False),
        pa.field("position", pa.uint32(), nullable=False),
        pa.field("phase", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("draft_pos", pa.uint8(), nullable=False),
        pa.field("token", pa.uint32(), nullable=True),
        pa.field("accepted", pa.bool_(), nullable=True),
        pa.field("layer", pa.uint16(), nullable=False),
        pa.field("experts", pa.list_(pa.uint16(), top_k), nullable=False),
        pa.field("weights", pa.list_(weight_type, top_k), nullable=False),
    ]
    if candidates:
        fields += [
            pa.field("cand_experts", pa.list_(pa.uint16(), candidates), nullable=False),
            pa.field("cand_scores", pa.list_(pa.float32(), candidates), nullable=False),
        ]
    return pa.schema(fields)


STEPS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.uint32(), nullable=False),
        pa.field("request", pa.uint32(), nullable=False),
        pa.field("num_tokens", pa.uint32(), nullable=False),
        pa.field("num_drafts", pa.uint32(), nullable=False),
        pa.field("num_accepted", pa.uint32(), nullable=False),
        pa.field("batch_size", pa.uint32(), nullable=False),
        pa.field("t_start_ns", pa.int64(), nullable=False),
        pa.field("t_end_ns", pa.int64(), nullable=False),
    ]
)

TELEMETRY_SCHEMA = pa.schema(
    [
        pa.field("t_ns", pa.int64(), nullable=False),
        pa.field("gpu", pa.uint16(), nullable=False),
        pa.field("util_gpu_pct", pa.uint8(), nullable=True),
        pa.field("util_mem_pct", pa.uint8(), nullable=True),
        pa.field("power_mw", pa.uint32(), nullable=True),
        pa.field("mem_used_bytes", pa.uint64(), nullable=True),
        pa.field("pcie_tx_kbps", pa.uint32(), nullable=True),
        pa.field("pcie_rx_kbps", pa.uint32(), nullable=True),
        pa.field("nvlink_tx_kib", pa.uint64(), nullable=True),
        pa.field("nvlink_rx_kib", pa.uint64(), nullable=True),
    ]
)

# Keys the manifest must have (dotted paths), as the trace contract (docs/trace-format.md) promises to other tools.
REQUIRED_MANIFEST_KEYS = (
    "schema",
    "complete",
    "model.num_experts",
    "model.top_k",
    "model.moe_layers",
    "model.hidden_size",
    "spec.method",
    "spec.k",
    "parallel.tp",
    "parallel.ep",
)
