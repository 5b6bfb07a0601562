"""Routing an engine recorded itself, written as a moetrace v1 trace (``moetrace import``).

vLLM returns the experts each token was routed to when it runs with ``enable_return_routed_experts``: per request
an array ``[tokens, layers, top_k]`` (``CompletionOutput.routed_experts`` offline; base64 ``.npy`` in each HTTP
completion choice's ``routed_experts``). Row i is the token at position ``prompt_start + i`` (the request's
``routed_experts_prompt_start``), up to the last token but one (the last sampled token never ran through the
model). Layers are all decoder layers: dense ones come back as rows of zeros.

SGLang returns the same with ``--enable-return-routed-experts`` and a request's ``return_routed_experts``: base64
of the raw int32 bytes in ``meta_info["routed_experts"]`` of a ``/generate`` response, rows ``[tokens, layers,
top_k]`` in C order over positions ``routed_experts_start_len`` .. prompt + output − 2
(``sglang/srt/state_capturer/routed_experts.py``, ``extract_routed_experts_from_meta_info``, SGLang 0.5.23).

Such rows are the tokens a request kept: prompt, anchors, accepted drafts. They hold no rejected draft, no router
weight, no acceptance, no step timing and no batching; the manifest's ``source`` says so (``ROUTED_EXPERTS_LACKS``), the
trace is a k = 0 trace of kept tokens (its growth per k is counterfactual), and its weights are NaN.
"""


from __future__ import annotations

import base64
import binascii
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moetrace.errors import UserError, refuse_existing
from moetrace.recording.record import ResolvedModel
from moetrace.trace.schema import (
    ROUTED_EXPERTS_LACKS,
    STEPS_SCHEMA,
    TOKEN_PHASES,
)
from moetrace.formats.imported_trace import config_moe_layers, imported_manifest, write_trace
from moetrace.trace.files import StepCapture



@dataclass(frozen=True)
class EngineRequest:
    """One request's routing as the engine returned it: ``routed`` [T, L, K] (any integer dtype), the rows of
    positions ``prompt_start`` .. ``prompt_start + T - 1`` of a sequence of ``length`` tokens (prompt and output);
    ``tokens``: their ids, where the source has them."""

    engine: str  # vllm or sglang
    request_id: str
    routed: npt.NDArray[Any]
    prompt_length: int
    prompt_start: int
    length: int
    tokens: list[int] | None
    where: str  # file (and line) it came from, for messages


def vllm_offline(arrays: Path, outputs: Path, prompt_start: int) -> list[EngineRequest]:
    """Requests from a ``.npz`` of vLLM's routed experts, one array per request id (``moetrace record`` keeps them
    as ``vllm-routed-experts.npz`` when the engine returns them; ``np.savez(path, **{o.request_id:
    o.outputs[0].routed_experts for o in outputs})`` does the same), and a JSONL of the same requests' token ids
    (one object per line: ``request_id``, ``prompt_token_ids``, ``output_token_ids``, as ``moetrace record`` writes
    ``outputs.jsonl``)."""
    try:
        with np.load(arrays, allow_pickle=False) as loaded:
            routed = {name: loaded[name] for name in loaded.files}
    except FileNotFoundError:
        raise UserError(f"{arrays}: no such file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise UserError(f"{arrays}: not a readable .npz of routed-experts arrays ({exc})") from None
    if not routed:
        raise UserError(f"{arrays}: holds no arrays")
    ids: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(read_lines(outputs), 1):
        try:
            record = json.loads(line)
            ids[str(record["request_id"])] = record
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{outputs}:{number}: not an object with a request_id") from None
    requests = []
    for request_id, array in routed.items():
        record = ids.get(request_id)
        if record is None:
            raise UserError(f"{outputs}: no line for request {request_id!r} of {arrays}")
        prompt, output = token_ids(record, "prompt_token_ids", f"{outputs}"), token_ids(
            record, "output_token_ids", f"{outputs}")
        requests.append(EngineRequest("vllm", request_id, array, len(prompt), prompt_start, len(prompt) + len(output),
                                      prompt + output, f"{arrays}[{request_id}]"))
    return requests


def http_responses(responses: Path, prompt_start: int, layers: int, top_k: int) -> list[EngineRequest]:
    """Requests from a JSONL of HTTP responses, one per line: vLLM completion responses (``choices``) or SGLang
    ``/generate`` responses (``meta_info``), told apart line by line."""
    requests = []
    for number, line in enumerate(read_lines(responses), 1):
        where = f"{responses}:{number}"
        try:
            response = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{where}: not JSON") from None
        if isinstance(response, dict) and isinstance(response.get("choices"), list):
            requests += vllm_response(response, prompt_start, where)
        elif isinstance(response, dict) and isinstance(response.get("meta_info"), dict):
            requests.append(sglang_response(response, prompt_start, layers, top_k, where, number))
        else:
            raise UserError(f"{where}: neither a vLLM completion response (choices) nor an SGLang /generate "
                            f"response (meta_info)")
    return requests


def vllm_response(response: dict[str, Any], prompt_start: int, where: str) -> list[EngineRequest]:
    """The requests of one vLLM completion response whose choices carry ``routed_experts`` (base64 ``.npy``),
    ``prompt_token_ids`` and ``token_ids`` (the request's ``return_token_ids``)."""
    requests = []
    for choice in response["choices"]:
        encoded = choice.get("routed_experts")
        if encoded is None:
            raise UserError(f"{where}: a choice without routed_experts (was the server started with "
                            f"--enable-return-routed-experts?)")
        try:
            array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
        except (binascii.Error, ValueError, OSError, EOFError) as exc:
            raise UserError(f"{where}: routed_experts is not a base64 .npy ({exc})") from None
        prompt = token_ids(choice if "prompt_token_ids" in choice else response, "prompt_token_ids", where,
                           hint="send return_token_ids: true")
        output = token_ids(choice, "token_ids", where, hint="send return_token_ids: true")
        requests.append(EngineRequest("vllm", f"{response.get('id')}-{choice.get('index', 0)}", array, len(prompt),
                                      prompt_start, len(prompt) + len(output), prompt + output, where))
    return requests


def sglang_response(response: dict[str, Any], prompt_start: int, layers: int, top_k: int, where: str,
                    number: int) -> EngineRequest:
    """One SGLang ``/generate`` response: ``meta_info`` with ``routed_experts`` (base64 of raw int32, C order
    [tokens, layers, top_k]), ``prompt_tokens`` and ``completion_tokens`` (token ids: the prompt's are not in
    the response, so none are kept)."""
    meta = response["meta_info"]
    encoded = meta.get("routed_experts")
    if not isinstance(encoded, str):
        raise UserError(f"{where}: no meta_info.routed_experts (was the server started with "
                        f"--enable-return-routed-experts and the request sent with return_routed_experts?)")
    prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        raise UserError(f"{where}: meta_info lacks prompt_tokens or completion_tokens")
    try:
        flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError) as exc:
        raise UserError(f"{where}: meta_info.routed_experts is not base64 of int32 ({exc})") from None
    if flat.size % (layers * top_k):
        raise UserError(f"{where}: {flat.size} expert ids are not whole rows of {layers} layers x top-{top_k} (the "
                        f"model's)")
    return EngineRequest("sglang", str(meta.get("id", number)), flat.reshape(-1, layers, top_k), prompt, prompt_start,
                         prompt + completion, None, where)


def read_lines(path: Path) -> list[str]:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: unreadable ({exc})") from None
    if not lines:
        raise UserError(f"{path}: empty")
    return lines


def token_ids(record: dict[str, Any], key: str, where: str, hint: str = "") -> list[int]:
    ids = record.get(key)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise UserError(f"{where}: no {key}" + (f" ({hint})" if hint else ""))
    return ids


def checked_rows(request: EngineRequest, num_experts: int, top_k: int) -> npt.NDArray[np.int64]:
    """``request.routed`` as int64 [T, L, K], checked: three dimensions, top-k wide, an integer dtype, one row per
    token the request ran (prompt from ``prompt_start`` and output but the last), ids below ``num_experts`` (or
    -1 padding)."""
    routed = request.routed
    if routed.ndim != 3 or routed.shape[2] != top_k:
        raise UserError(f"{request.where}: shape {list(routed.shape)}, not [tokens, layers, {top_k}] (the model's "
                        f"top-k)")
    if not np.issubdtype(routed.dtype, np.integer):
        raise UserError(f"{request.where}: dtype {routed.dtype}, not an integer type (uint8/uint16/int32)")
    if routed.shape[0] != request.length - 1 - request.prompt_start:
        raise UserError(f"{request.where}: {routed.shape[0]} rows for {request.length} tokens from position "
                        f"{request.prompt_start}: expected {request.length - 1 - request.prompt_start} "
                        f"(truncated, or another prompt start: --prompt-start)")
    rows = routed.astype(np.int64)
    if (rows >= num_experts).any():
        raise UserError(f"{request.where}: expert id {int(rows.max())} but the model has {num_experts} experts "
                        f"(physical ids of redundant experts? only logical ids can be imported)")
    if ((rows < 0) & (rows != -1)).any():
        raise UserError(f"{request.where}: negative expert ids other than -1 padding")
    padding = rows == -1
    if (padding.any(axis=2) & ~padding.all(axis=2)).any():
        raise UserError(f"{request.where}: -1 padding in part of a token's experts")
    return rows


def moe_layers_from(rows: list[npt.NDArray[np.int64]], expected: int, where: str) -> list[int]:
    """The layers that routed: in every other layer each row repeats one id (vLLM's dense layers come back as
    zeros). A layer mixing both, or a count other than the config's MoE layers, is an error."""
    layers = rows[0].shape[1]
    if any(r.shape[1] != layers for r in rows):
        raise UserError(f"{where}: requests disagree on the number of layers")
    moe = []
    for layer in range(layers):
        per_row = np.concatenate([r[:, layer, :] for r in rows])
        per_row = per_row[(per_row != -1).all(axis=1)]
        distinct = np.array([len(set(row.tolist())) == row.size for row in per_row], dtype=bool)
        if distinct.all() and distinct.size:
            moe.append(layer)
        elif distinct.any():
            raise UserError(f"{where}: layer {layer} has rows with repeated expert ids beside routed rows")
    if len(moe) != expected:
        raise UserError(f"{where}: {len(moe)} layers routed ({moe}), the model config says {expected} MoE layers")
    return moe


def step_captures(requests: list[EngineRequest], rows: list[npt.NDArray[np.int64]], moe_layers: list[int]
                  ) -> tuple[list[StepCapture], int]:
    """``requests`` as the steps the writer process writes: one step for a request's prompt rows, one per output
    row (a request alone in it, no timing and no router weights: the source has neither), rows of -1 padding left
    out; and how many padding rows were left out."""
    captures: list[StepCapture] = []
    padding = 0
    for index, (request, routed) in enumerate(zip(requests, rows)):
        kept = routed[:, moe_layers, :]  # [T, L, K]
        padded = (kept == -1).all(axis=2)
        if (padded != padded.all(axis=1, keepdims=True)).any():
            raise UserError(f"{request.where}: -1 padding in part of a token's MoE layers")
        padding += int(padded[:, 0].sum())
        positions = request.prompt_start + np.flatnonzero(~padded[:, 0])
        prompt = positions < request.prompt_length
        groups = ([positions[prompt]] if prompt.any() else []) + list(positions[~prompt].reshape(-1, 1))
        tokens = None if request.tokens is None else np.asarray(request.tokens, dtype=np.uint32)
        for number, group in enumerate(groups):
            count, step = len(group), len(captures)
            experts = kept[group - request.prompt_start]
            phase = TOKEN_PHASES.index("prefill" if group[0] < request.prompt_length else "decode")
            captures.append(StepCapture(
                step=step, request=np.full(count, index, np.uint32), position=group.astype(np.uint32),
                phase=np.full(count, phase, np.int8), draft_pos=np.zeros(count, np.uint8),
                token=None if tokens is None else tokens[group], accepted=np.full(count, -1, np.int8),
                experts=experts.astype(np.uint16), weights=np.full(experts.shape, np.nan, np.float32),
                cand_experts=None, cand_scores=None,
                steps_rows={name: np.array([value], dtype=STEPS_SCHEMA.field(name).type.to_pandas_dtype())
                            for name, value in (("step", step), ("request", index), ("num_tokens", count),
                                                ("num_drafts", 0), ("num_accepted", 0), ("batch_size", 1),
                                                ("t_start_ns", 0), ("t_end_ns", 0))},
                new_requests=(request.request_id,) if number == 0 else ()))
    return captures, padding


def write_imported_trace(requests: list[EngineRequest], model: ResolvedModel, source: dict[str, Any], out: Path,
                         force: bool) -> dict[str, Any]:
    """Check ``requests`` against ``model`` and write them as one trace at ``out`` (all or nothing: into a
    sibling directory renamed into place). Returns the manifest."""
    refuse_existing(out, force)
    config = json.loads((model.path / "config.json").read_text())
    top_k = int(model.top_k or 0)
    rows = [checked_rows(r, model.num_experts, top_k) for r in requests]
    moe_layers = moe_layers_from(rows, len(config_moe_layers(config)), str(source["files"][0]))
    captures, padding = step_captures(requests, rows, moe_layers)
    manifest = imported_manifest(model, config, moe_layers, out, all(r.tokens is not None for r in requests), {
        **source, "holds": "the tokens each request kept (prompt, anchors, accepted drafts)",
        "lacks": list(ROUTED_EXPERTS_LACKS), "padding_rows": padding})
    return write_trace(captures, manifest, moe_layers, top_k, out)

