"""SGLang's expert distribution recorder dumps, imported (``moetrace import FILE.pt``).

The recorder (``--expert-distribution-recorder-mode``; ``/start_expert_distribution_record``, ``/stop_...``,
``/dump_expert_distribution_record``) saves with ``torch.save`` into
``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` (default ``/tmp``: ``sglang/srt/environ.py`` L1337; ``_dump_to_file``,
``sglang/srt/eplb/expert_distribution.py`` L1038-1044; line numbers of SGLang 0.5.23, whose keys an older revision
of the file writes alike):

- ``per_token`` and ``per_pass`` (``_DetailAccumulator.dump``, L938-947): one file per rank,
  ``expert_distribution_recorder_{time.time()}_{rank}.pt``, a dict ``records`` (a list, one dict per forward pass
  recorded) and ``last_physical_to_logical_map``: the map at the dump (it "may change during recording", L942),
  ``ExpertLocationMetadata.physical_to_logical_map`` [decoder layers, physical experts], int64 as
  ``init_trivial`` builds it (``expert_location.py`` L64, L121-130: logical ``arange % experts``, redundant slots
  appended), saved on its device (hence ``map_location="cpu"``). A record (``_DetailAccumulator.append``,
  L925-932): ``forward_pass_id`` (the model runner's counter, ``model_runner.py`` L1824), ``rank`` (the EP rank),
  ``gatherer_key`` (``"primary"``) and what the pass's gatherer collected. per_token (``_DetailSinglePassGatherer``,
  L460-544): ``input_ids`` and ``positions`` (lists, one per token of the pass), ``extend_seq_lens`` (tokens per
  request of an extend pass; None in decode), ``forward_mode`` (``ForwardMode``'s int: EXTEND 1, DECODE 2, MIXED 3,
  IDLE 4, TARGET_VERIFY 5), ``topk_ids_of_layer`` (int32 [decoder layers, tokens, 8]: PHYSICAL ids after the
  logical-to-physical dispatch, -1 where nothing was written: dense layers, padded tokens, columns past a top-k
  below 8; L471-480, L498-501, L524-525), ``misc_objects`` and ``global_physical_count`` (int32 [layers, physical
  experts]). per_pass records hold only ``global_physical_count`` (``_SelectExpertsSinglePassGatherer``, L614-626).
- ``stat`` (``_StatAccumulator.dump``, L982-1010): rank 0 alone writes ``expert_distribution_recorder_{time}.pt``,
  a dict ``rank``, ``logical_count`` (int32 [buffered passes, layers, logical experts]: a circular buffer of
  ``expert_distribution_recorder_buffer_size`` passes, 1000 by default, zeros until filled, summed over ranks by an
  all-reduce) and ``average_utilization_rate_over_window`` (float or None).

A per_token dump imports as a k = 0 trace: every pass that routed a token is a step, in the file's order; each
token group of it (a request's prefill chunk by ``extend_seq_lens``, each decode token) is a request of its own,
with the pass's positions and token ids: the dump has no request ids, so no request spans passes and the
counterfactual growth per request has no window past k = 0 (the growth per whole step is measured). Physical
ids become logical through the dump's map (wrong for passes before an EPLB rebalance during the recording);
passes that routed nothing (a dense drafter's, an idle one) and tokens routed in no layer (padding) are left out
and counted; a verification pass (TARGET_VERIFY: which drafts were accepted is not in it) or a pass of another mode
that routed is refused. stat and per_pass dumps hold counts, not which experts a token picked, and are refused:
SGLang reads a stat dump itself as ``--init-expert-location``.
"""


from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moetrace.trace.model_config import config_value
from moetrace.errors import UserError, refuse_existing
from moetrace.recording.record import ResolvedModel
from moetrace.trace.schema import (
    SGLANG_RECORDER_LACKS,
    STEPS_SCHEMA,
    TOKEN_PHASES,
)
from moetrace.formats.imported_trace import config_moe_layers, imported_manifest, write_trace
from moetrace.trace.files import StepCapture



# SGLang's ForwardMode numbers in a per_token record's ``forward_mode`` (an IntEnum of auto() values,
# model_executor/forward_batch_info.py L198-222 in 0.5.23; the first five are numbered alike in the older revisions
# read, the later members (DRAFT_EXTEND, DRAFT_EXTEND_V2, PREBUILT, SPLIT_PREFILL, ...) differ between releases)
SGLANG_EXTEND, SGLANG_DECODE, SGLANG_MIXED, SGLANG_TARGET_VERIFY = 1, 2, 3, 5
SGLANG_RECORD_KEYS = ("forward_pass_id", "rank", "input_ids", "positions", "extend_seq_lens", "forward_mode",
                      "topk_ids_of_layer")
SGLANG_STAT_KEYS = {"rank", "logical_count", "average_utilization_rate_over_window"}
PER_TOKEN = "--expert-distribution-recorder-mode per_token"


@dataclass(frozen=True)
class RecorderPass:
    """One forward pass of a per_token dump, checked: ``ids`` [layers, T, top_k] physical ids (-1: not routed),
    the pass's token ids and positions, and the token count of each request it ran, in order."""

    forward_pass_id: int
    mode: int
    ids: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    groups: list[int]
    where: str


def load_torch_file(path: Path) -> Any:
    """``torch.load`` without running pickled code (``weights_only``), every tensor on the CPU (SGLang saves its
    physical_to_logical_map where it lives: on the GPU)."""
    try:
        import torch
    except ImportError:
        raise UserError(f"{path}: reading SGLang's .pt dumps needs torch (pip install torch)") from None
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a foreign or cut file raises RuntimeError, EOFError, KeyError, ...
        if "weights only load failed" in str(exc).lower():
            raise UserError(f"{path}: holds Python objects that torch.load(weights_only=True) will not unpickle: "
                            f"not an SGLang expert distribution dump") from None
        detail = (str(exc).strip().splitlines() or [""])[0][:120]
        raise UserError(f"{path}: not a readable torch.save file (truncated, or not a .pt: "
                        f"{type(exc).__name__}{': ' + detail if detail else ''})") from None


def integer_tensor(value: Any, where: str) -> npt.NDArray[np.int64]:
    """A tensor of any integer dtype (int16, int32, int64, ...) as int64."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise UserError(f"{where}: a {type(value).__name__}, not a tensor")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise UserError(f"{where}: dtype {str(value.dtype).removeprefix('torch.')}, not an integer type "
                        f"(int16/int32/int64)")
    return np.asarray(value.detach().cpu().to(torch.int64).numpy())


def integer_list(value: Any, where: str) -> npt.NDArray[np.int64]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise UserError(f"{where}: not a list of integers")
    return np.asarray(value, dtype=np.int64).reshape(-1)


def sglang_recorder_mode(dump: Any, path: Path) -> str:
    """``per_token``, ``per_pass`` or ``stat``, from the keys SGLang's recorder dumps (module doc)."""
    if not isinstance(dump, dict):
        raise UserError(f"{path}: not an SGLang expert distribution dump (a {type(dump).__name__}, not a dict)")
    keys = set(dump)
    if keys == {"records", "last_physical_to_logical_map"}:
        records = dump["records"]
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise UserError(f"{path}: records is not a list of dicts")
        if not records:
            raise UserError(f"{path}: holds no forward passes (was /start_expert_distribution_record sent before "
                            f"the requests?)")
        if all("topk_ids_of_layer" in r for r in records):
            return "per_token"
        if all("global_physical_count" in r and "topk_ids_of_layer" not in r for r in records):
            return "per_pass"
        raise UserError(f"{path}: records hold neither topk_ids_of_layer (per_token) nor global_physical_count "
                        f"(per_pass) alone")
    if "logical_count" in keys and keys <= SGLANG_STAT_KEYS:
        return "stat"
    raise UserError(f"{path}: not an SGLang expert distribution dump (keys {sorted(map(str, keys))}; SGLang writes "
                    f"records and last_physical_to_logical_map (per_token, per_pass) or logical_count (stat))")


def recorder_pass(record: dict[str, Any], index: int, path: Path, layers: int, physical: int,
                  top_k: int) -> RecorderPass | None:
    """One per_token record checked against the model and the map's physical experts; None for a pass that
    routed nothing (every id -1: a dense drafter's or an idle pass)."""
    missing = [key for key in SGLANG_RECORD_KEYS if key not in record]
    if missing:
        raise UserError(f"{path}: record {index} lacks {', '.join(missing)} (not a per_token record)")
    if not all(isinstance(record[key], int) for key in ("forward_pass_id", "forward_mode")):
        raise UserError(f"{path}: record {index}: forward_pass_id and forward_mode are not integers")
    where = f"{path}: forward pass {record['forward_pass_id']} (record {index})"
    ids = integer_tensor(record["topk_ids_of_layer"], f"{where}: topk_ids_of_layer")
    if ids.ndim != 3 or ids.shape[0] != layers:
        raise UserError(f"{where}: topk_ids_of_layer has shape {list(ids.shape)}, not [{layers} layers (the "
                        f"model's), tokens, top-k] (another model's dump? --model)")
    if ids.shape[2] < top_k:
        raise UserError(f"{where}: {ids.shape[2]} expert ids per token, the model's top-k is {top_k}")
    tokens = integer_list(record["input_ids"], f"{where}: input_ids")
    positions = integer_list(record["positions"], f"{where}: positions")
    if not len(tokens) == len(positions) == ids.shape[1]:
        raise UserError(f"{where}: {len(tokens)} input_ids and {len(positions)} positions for {ids.shape[1]} "
                        f"tokens of topk_ids_of_layer")
    if ((tokens < 0) | (tokens >= 2**32)).any() or (positions < 0).any() or (positions >= 2**32).any():
        raise UserError(f"{where}: input_ids or positions outside 0 .. 2^32-1")
    if (ids < -1).any():
        raise UserError(f"{where}: negative expert ids other than -1 padding")
    if (ids[:, :, top_k:] != -1).any():
        raise UserError(f"{where}: expert ids past the model's top-{top_k} (another model's dump? --model)")
    ids = ids[:, :, :top_k]
    if (ids >= physical).any():
        raise UserError(f"{where}: physical expert id {int(ids.max())} but last_physical_to_logical_map has "
                        f"{physical} physical experts (fused shared experts? start SGLang with "
                        f"--disable-shared-experts-fusion)")
    routed = ids != -1
    if not routed.any():
        return None
    if (routed.any(axis=2) & ~routed.all(axis=2)).any():
        raise UserError(f"{where}: -1 padding in part of a token's experts")
    mode = record["forward_mode"]
    if mode == SGLANG_TARGET_VERIFY:
        raise UserError(f"{where}: a speculative verification pass (TARGET_VERIFY): the dump does not say which "
                        f"drafts were accepted (import that run's /generate responses with return_routed_experts)")
    if mode not in (SGLANG_EXTEND, SGLANG_DECODE, SGLANG_MIXED):
        raise UserError(f"{where}: forward mode {mode!r} routed tokens; only the target model's EXTEND (1), DECODE "
                        f"(2) and MIXED (3) passes can be imported (a MoE drafter's pass?)")
    if mode == SGLANG_DECODE:
        groups = [1] * ids.shape[1]
    else:
        groups = integer_list(record["extend_seq_lens"], f"{where}: extend_seq_lens").tolist()
        if any(length < 0 for length in groups) or sum(groups) != ids.shape[1]:
            raise UserError(f"{where}: extend_seq_lens {groups} do not add up to its {ids.shape[1]} tokens")
    return RecorderPass(int(record["forward_pass_id"]), int(mode), ids, tokens, positions, groups, where)


def recorder_capture(p: RecorderPass, mapping: npt.NDArray[np.int64], moe_layers: list[int], step: int,
                     first_request: int) -> tuple[StepCapture, int]:
    """One pass as one step: each token group it ran (a request's prefill chunk, a decode token) a request of its
    own, its physical ids mapped to logical ones; tokens routed in no layer (padding) left out, and counted."""
    layer_index = np.asarray(moe_layers)
    routed = p.ids[layer_index, :, 0] != -1  # [M, T]
    kept = routed.all(axis=0)
    if (routed.any(axis=0) & ~kept).any():
        raise UserError(f"{p.where}: tokens routed in some MoE layers and not in others")
    group = np.repeat(np.arange(len(p.groups)), p.groups)[kept]  # each kept token's group in the pass
    groups, local = np.unique(group, return_inverse=True)  # the groups that kept a token; a token's among them
    requests, count = len(groups), len(group)
    request = (first_request + local).astype(np.uint32)
    # MIXED (--enable-mixed-chunk) runs prefill chunks and one-token decodes alike: a one-token group is a decode
    decode = (np.asarray(p.groups)[groups][local] == 1) if p.mode == SGLANG_MIXED else np.full(
        count, p.mode == SGLANG_DECODE)
    ids = p.ids[layer_index][:, kept, :]  # [M, T', K]
    logical = mapping[layer_index[:, None, None], ids].transpose(1, 0, 2)  # [T', M, K]
    per_request = np.bincount(local, minlength=requests)
    steps_type = {name: STEPS_SCHEMA.field(name).type.to_pandas_dtype() for name in STEPS_SCHEMA.names}
    capture = StepCapture(
        step=step, request=request, position=p.positions[kept].astype(np.uint32),
        phase=np.where(decode, TOKEN_PHASES.index("decode"), TOKEN_PHASES.index("prefill")).astype(np.int8),
        draft_pos=np.zeros(count, np.uint8), token=p.tokens[kept].astype(np.uint32),
        accepted=np.full(count, -1, np.int8), experts=logical.astype(np.uint16),
        weights=np.full(logical.shape, np.nan, np.float32), cand_experts=None, cand_scores=None,
        steps_rows={name: np.asarray(value, dtype=steps_type[name]) for name, value in (
            ("step", np.full(requests, step)), ("request", first_request + np.arange(requests)),
            ("num_tokens", per_request), ("num_drafts", np.zeros(requests)), ("num_accepted", np.zeros(requests)),
            ("batch_size", np.full(requests, requests)), ("t_start_ns", np.zeros(requests)),
            ("t_end_ns", np.zeros(requests)))},
        new_requests=tuple(f"pass{p.forward_pass_id}-{g}" for g in groups.tolist()))
    return capture, int((~kept).sum())


def stat_load(path: Path) -> tuple[npt.NDArray[np.int64], list[int]]:
    """An SGLang stat dump's expert load: ``logical_count`` summed over its buffered passes, [decoder layers,
    experts], and the layers that counted any pick (its MoE layers; dense ones count none)."""
    dump = load_torch_file(path)
    mode = sglang_recorder_mode(dump, path)
    if mode != "stat":
        raise UserError(f"{path}: an SGLang {mode} dump, not a stat one: import it (moetrace import {path}) and "
                        f"export from the trace")
    counts = integer_tensor(dump["logical_count"], f"{path}: logical_count")
    if counts.ndim == 3:  # [buffered passes, layers, experts]: the passes' counts summed
        counts = counts.sum(axis=0)
    if counts.ndim != 2 or (counts < 0).any():
        raise UserError(f"{path}: logical_count is not [passes, layers, experts] counts (shape {list(counts.shape)})")
    moe_layers = [int(layer) for layer in np.flatnonzero(counts.sum(axis=1))]
    if not moe_layers:
        raise UserError(f"{path}: logical_count holds no pick yet (the recorder dumped before any pass was counted)")
    return counts, moe_layers


def sglang_recorder(path: Path, model: ResolvedModel, out: Path, force: bool) -> dict[str, Any]:
    """Check an SGLang expert distribution dump against ``model`` and write its forward passes as one trace at
    ``out`` (a per_token dump; a stat or per_pass dump holds counts, not routing, and is refused). Returns the
    manifest."""
    refuse_existing(out, force)
    dump = load_torch_file(path)
    mode = sglang_recorder_mode(dump, path)
    if mode == "stat":
        shape = list(getattr(dump["logical_count"], "shape", []))
        raise UserError(f"{path}: an SGLang stat dump holds expert counts (logical_count {shape}), not the experts "
                        f"any token picked: no trace can be made of it (moetrace export {path} --eplb --ep N places "
                        f"its counts; SGLang reads it as is: --init-expert-location {path}); for a trace, record "
                        f"with {PER_TOKEN}")
    if mode == "per_pass":
        raise UserError(f"{path}: an SGLang per_pass dump holds expert counts per forward pass "
                        f"(global_physical_count), not the experts any token picked: no trace can be made of it; "
                        f"record with {PER_TOKEN}")
    config = json.loads((model.path / "config.json").read_text())
    layers, top_k = int(config_value(config, "num_hidden_layers") or 0), int(model.top_k or 0)
    experts = model.num_experts
    mapping = integer_tensor(dump["last_physical_to_logical_map"], f"{path}: last_physical_to_logical_map")
    if mapping.ndim != 2 or mapping.shape[0] != layers:
        raise UserError(f"{path}: last_physical_to_logical_map has shape {list(mapping.shape)}, not [{layers} "
                        f"layers (the model's), physical experts] (another model's dump? --model)")
    if ((mapping < 0) | (mapping >= experts)).any():
        bad = int(mapping[(mapping < 0) | (mapping >= experts)][0])
        raise UserError(f"{path}: last_physical_to_logical_map names logical expert {bad} but the model has "
                        f"{experts} experts (another model's dump? --model)")
    records: list[dict[str, Any]] = dump["records"]
    ranks = sorted({repr(r["rank"]) for r in records if "rank" in r})
    if len(ranks) > 1:
        raise UserError(f"{path}: records of ranks {', '.join(ranks)}; SGLang writes one file per rank")
    passes = [recorder_pass(r, i, path, layers, mapping.shape[1], top_k) for i, r in enumerate(records)]
    routed = [p for p in passes if p is not None]
    if not routed:
        raise UserError(f"{path}: no forward pass in it routed a token (every topk_ids_of_layer is -1)")
    seen: set[int] = set()
    for p in routed:
        if p.forward_pass_id in seen:
            raise UserError(f"{p.where}: an earlier pass of this forward_pass_id routed tokens too (a second model "
                            f"runner, such as a MoE drafter's, recorded into the same dump)")
        seen.add(p.forward_pass_id)
    routed_layers = sorted({int(layer) for p in routed for layer in np.flatnonzero((p.ids != -1).any(axis=(1, 2)))})
    moe_layers = config_moe_layers(config)
    if routed_layers != moe_layers:
        raise UserError(f"{path}: layers {routed_layers} routed, the model's MoE layers are {moe_layers} (another "
                        f"model's dump? --model)")
    captures, padding, requests = [], 0, 0
    for step, p in enumerate(routed):
        capture, dropped = recorder_capture(p, mapping, moe_layers, step, requests)
        captures.append(capture)
        padding, requests = padding + dropped, requests + len(capture.new_requests)
    manifest = imported_manifest(model, config, moe_layers, out, True, {
        "engine": "sglang", "format": "expert distribution recorder, per_token", "files": [str(path)],
        "rank": records[0].get("rank"), "forward_passes": len(routed),
        "forward_pass_ids": [routed[0].forward_pass_id, routed[-1].forward_pass_id],
        "passes_without_routing": len(passes) - len(routed),
        "holds": "every token each recorded forward pass routed (prefill chunks, decode tokens) in that pass's "
                 "batch; a request per token group of a pass",
        "lacks": list(SGLANG_RECORDER_LACKS), "padding_rows": padding,
        "expert_ids": "physical ids mapped through the dump's last_physical_to_logical_map"})
    return write_trace(captures, manifest, moe_layers, top_k, out)
