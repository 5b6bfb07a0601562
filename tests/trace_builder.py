"""Builds small moetrace/1 traces on disk for tests, with pyarrow directly (independent of the recorder)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from moetrace.trace.schema import FOOTER_SCHEMA_KEY, TOKEN_PHASES, SCHEMA_VERSION, STEPS_SCHEMA, routing_schema


@dataclass
class Tokens:
    """Per-token columns (length T) and routing [T, layers, top_k] (candidates [T, layers, C] optional)."""

    step: npt.NDArray[np.uint32]
    request: npt.NDArray[np.uint32]
    position: npt.NDArray[np.uint32]
    phase: list[str]
    draft_pos: npt.NDArray[np.uint8]
    accepted: list[bool | None]
    experts: npt.NDArray[np.uint16]
    weights: npt.NDArray[np.float32]
    cand_experts: npt.NDArray[np.uint16] | None = None
    cand_scores: npt.NDArray[np.float32] | None = None
    token: npt.NDArray[np.uint32] | None = None  # token ids (None: position % 256)


@dataclass
class Model:
    num_experts: int = 16
    top_k: int = 2
    layers: tuple[int, ...] = (1, 2)
    name: str = "tiny-test"
    random_weights: bool = False
    hidden_size: int = 64
    expert_width: int = 32
    expert_weight_bits: int = 16
    quant_group_size: int | None = None
    shared_experts: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def random_routing(
    rng: np.random.Generator, tokens: int, model: Model, candidates: int = 0
) -> tuple[
    npt.NDArray[np.uint16], npt.NDArray[np.float32], npt.NDArray[np.uint16] | None, npt.NDArray[np.float32] | None
]:
    """Uniformly random distinct top-k (or top-C candidates whose first top-k are the picks) per token and layer."""
    width = max(candidates, model.top_k)
    scores = rng.random((tokens, len(model.layers), model.num_experts), dtype=np.float32)
    order = np.argsort(-scores, axis=-1)[..., :width]
    top_scores = np.take_along_axis(scores, order, axis=-1)
    experts = order[..., : model.top_k].astype(np.uint16)
    weights = top_scores[..., : model.top_k].astype(np.float32)
    if not candidates:
        return experts, weights, None, None
    return experts, weights, order.astype(np.uint16), top_scores


def decode_tokens(rng: np.random.Generator, model: Model, requests: int, steps: int, candidates: int = 0) -> Tokens:
    """Plain decoding: every step, every request decodes one token."""
    step, request = np.meshgrid(np.arange(steps), np.arange(requests), indexing="ij")
    total = steps * requests
    experts, weights, cand_experts, cand_scores = random_routing(rng, total, model, candidates)
    return Tokens(
        step=step.ravel().astype(np.uint32),
        request=request.ravel().astype(np.uint32),
        position=(step.ravel() + 10).astype(np.uint32),
        phase=["decode"] * total,
        draft_pos=np.zeros(total, dtype=np.uint8),
        accepted=[None] * total,
        experts=experts,
        weights=weights,
        cand_experts=cand_experts,
        cand_scores=cand_scores,
    )


def verify_tokens(
    rng: np.random.Generator,
    model: Model,
    requests: int,
    steps: int,
    k: int,
    accept_prob: float,
    candidates: int = 0,
    prefill: int = 4,
    variable_drafts: bool = False,
) -> Tokens:
    """A prefill step, then speculative steps: each request verifies an anchor and k drafts (with
    ``variable_drafts``, 0..k drafts, and a step without drafts is plain decode), accepting a prefix (each draft
    with ``accept_prob`` while all before it were accepted); rejected positions are redone."""
    step_ids: list[int] = []
    request_ids: list[int] = []
    positions: list[int] = []
    phases: list[str] = []
    draft_pos: list[int] = []
    accepted: list[bool | None] = []
    for req in range(requests):
        for pos in range(prefill):
            step_ids.append(0), request_ids.append(req), positions.append(pos), phases.append("prefill")
            draft_pos.append(0), accepted.append(None)
    anchor = [prefill] * requests
    for step in range(1, steps + 1):
        for req in range(requests):
            drafts = int(rng.integers(0, k + 1)) if variable_drafts else k
            run = 0
            while run < drafts and rng.random() < accept_prob:
                run += 1
            for j in range(drafts + 1):
                step_ids.append(step), request_ids.append(req), positions.append(anchor[req] + j)
                phases.append("verify" if drafts else "decode"), draft_pos.append(j)
                accepted.append(None if j == 0 else j <= run)
            anchor[req] += run + 1
    experts, weights, cand_experts, cand_scores = random_routing(rng, len(step_ids), model, candidates)
    return Tokens(
        step=np.asarray(step_ids, dtype=np.uint32),
        request=np.asarray(request_ids, dtype=np.uint32),
        position=np.asarray(positions, dtype=np.uint32),
        phase=phases,
        draft_pos=np.asarray(draft_pos, dtype=np.uint8),
        accepted=accepted,
        experts=experts,
        weights=weights,
        cand_experts=cand_experts,
        cand_scores=cand_scores,
    )


def routing_table(tokens: Tokens, model: Model) -> pa.Table:
    layers = len(model.layers)

    def per_row(values: Any) -> Any:
        return np.repeat(np.asarray(values), layers)

    def fixed(values: npt.NDArray[Any], arrow_type: pa.DataType) -> pa.Array:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=arrow_type), values.shape[-1])

    phase_index = np.asarray([TOKEN_PHASES.index(p) for p in tokens.phase], dtype=np.int8)
    candidates = 0 if tokens.cand_experts is None else tokens.cand_experts.shape[-1]
    columns: dict[str, pa.Array] = {
        "step": pa.array(per_row(tokens.step)),
        "request": pa.array(per_row(tokens.request)),
        "position": pa.array(per_row(tokens.position)),
        "phase": pa.DictionaryArray.from_arrays(pa.array(per_row(phase_index)), pa.array(TOKEN_PHASES)),
        "draft_pos": pa.array(per_row(tokens.draft_pos)),
        "token": pa.array(per_row(tokens.position % 256 if tokens.token is None else tokens.token).astype(np.uint32)),
        "accepted": pa.array([a for a in tokens.accepted for _ in range(layers)], type=pa.bool_()),
        "layer": pa.array(np.tile(np.asarray(model.layers, dtype=np.uint16), len(tokens.step))),
        "experts": fixed(tokens.experts, pa.uint16()),
        "weights": fixed(tokens.weights.astype(np.float16), pa.float16()),
    }
    if tokens.cand_experts is not None and tokens.cand_scores is not None:
        columns["cand_experts"] = fixed(tokens.cand_experts, pa.uint16())
        columns["cand_scores"] = fixed(tokens.cand_scores, pa.float32())
    schema = routing_schema(model.top_k, candidates).with_metadata({FOOTER_SCHEMA_KEY: SCHEMA_VERSION.encode()})
    return pa.Table.from_pydict(columns, schema=schema)


def steps_table(tokens: Tokens) -> pa.Table:
    keys = sorted(set(zip(tokens.step.tolist(), tokens.request.tolist())))
    rows: dict[str, list[int]] = {name: [] for name in STEPS_SCHEMA.names}
    for step, request in keys:
        mine = (tokens.step == step) & (tokens.request == request)
        drafts = mine & (tokens.draft_pos > 0)
        rows["step"].append(step)
        rows["request"].append(request)
        rows["num_tokens"].append(int(mine.sum()))
        rows["num_drafts"].append(int(drafts.sum()))
        rows["num_accepted"].append(sum(bool(tokens.accepted[i]) for i in np.flatnonzero(drafts)))
        rows["batch_size"].append(len({r for s, r in keys if s == step}))
        rows["t_start_ns"].append(step * 1_000_000)
        rows["t_end_ns"].append(step * 1_000_000 + 500_000)
    return pa.Table.from_pydict(rows, schema=STEPS_SCHEMA.with_metadata({FOOTER_SCHEMA_KEY: SCHEMA_VERSION.encode()}))


def manifest(model: Model, k: int, candidates: int = 0, tp: int = 1, ep: int = 1) -> dict[str, Any]:
    return {
        "schema": SCHEMA_VERSION,
        "run_id": "test",
        "complete": True,
        "model": {
            "name": model.name,
            "random_weights": model.random_weights,
            "num_layers": max(model.layers) + 1,
            "moe_layers": list(model.layers),
            "num_experts": model.num_experts,
            "top_k": model.top_k,
            "shared_experts": model.shared_experts,
            "hidden_size": model.hidden_size,
            "expert_width": model.expert_width,
            "expert_weight_bits": model.expert_weight_bits,
            "quant_group_size": model.quant_group_size,
            **model.extra,
        },
        "parallel": {"tp": tp, "ep": ep, "pp": 1, "dp": 1, "expert_placement": "linear"},
        "spec": {"method": "ngram" if k else None, "k": k},
        "capture": {"candidates": candidates},
    }


def write_trace(
    root: Path, tokens: Tokens, model: Model, k: int, files: int = 2, tp: int = 1, ep: int = 1
) -> Path:
    """Write ``root/manifest.json`` and the routing/steps tables split into ``files`` Parquet files each."""
    candidates = 0 if tokens.cand_experts is None else tokens.cand_experts.shape[-1]
    (root / "routing").mkdir(parents=True, exist_ok=True)
    (root / "steps").mkdir(parents=True, exist_ok=True)
    for name, table in (("routing", routing_table(tokens, model)), ("steps", steps_table(tokens))):
        bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
        for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            pq.write_table(table.slice(start, end - start), root / name / f"part-{index:05d}.parquet")
    (root / "manifest.json").write_text(json.dumps(manifest(model, k, candidates, tp, ep), indent=2))
    return root


def routing_frame(tokens: Tokens, model: Model) -> pl.LazyFrame:
    """The routing table in memory, as the reader would give it (one data-parallel rank: 0)."""
    frame = pl.from_arrow(routing_table(tokens, model))
    assert isinstance(frame, pl.DataFrame)
    return frame.lazy().with_columns(dp_rank=pl.lit(0, pl.UInt16))


def steps_frame(tokens: Tokens) -> pl.LazyFrame:
    frame = pl.from_arrow(steps_table(tokens))
    assert isinstance(frame, pl.DataFrame)
    return frame.lazy().with_columns(dp_rank=pl.lit(0, pl.UInt16))


def small_k2_trace(root: Path) -> Path:
    """A small n-gram-like trace at k=2 (2 requests, 8 steps, 70% acceptance) in ``root``."""
    model = Model()
    tokens = verify_tokens(np.random.default_rng(3), model, requests=2, steps=8, k=2, accept_prob=0.7)
    return write_trace(root, tokens, model, k=2)


def well_sampled_sweep(root: Path, ks: tuple[int, ...] = (0, 3)) -> Path:
    """A sweep with enough decoding request-steps at every k for a recommendation (4 requests × 40 steps)."""
    model = Model(num_experts=64, top_k=2)
    for k in ks:
        tokens = (verify_tokens(np.random.default_rng(k), model, requests=4, steps=40, k=k, accept_prob=0.6,
                                variable_drafts=True) if k else decode_tokens(np.random.default_rng(k), model,
                                                                               requests=4, steps=40))
        write_trace(root / f"k{k}", tokens, model, k=k)
    return root
