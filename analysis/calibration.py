"""A calibration file (``moetrace calibrate``) read for the cost model: the expert layer's time against experts and
rows per rank, and one all-reduce's time against message bytes on N GPUs (measured, or extrapolated with the ring
model). Pure functions on plain data; no torch here."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moetrace.analysis.deployment import ring_factor
from moetrace.calibrate import SCHEMA as CALIBRATION_SCHEMA  # plain Python: no torch on the analysis side

DEFAULT_BUS_BANDWIDTH_GBS = 100.0  # profile-only all-reduce growth: conservative for small NCCL messages


def check_calibration(doc: Mapping[str, Any]) -> None:
    if doc.get("schema") != CALIBRATION_SCHEMA:
        raise ValueError(f"schema {doc.get('schema')!r}, expected {CALIBRATION_SCHEMA!r}")
    for key in ("experts", "int4_estimate", "allreduce", "device"):
        if key not in doc:
            raise ValueError(f"missing {key!r}")
    if not isinstance((doc.get("attention") or {}).get("fit", []), list):
        raise ValueError("its attention was fitted by an earlier moetrace, one plane per query count: calibrate again")


def expert_fit(doc: Mapping[str, Any], config: str, fmt: str,
               rank_shape: tuple[int, int, int] | None = None,
               bytes_per_expert: float | None = None) -> tuple[dict[str, Any], str, list[str]]:
    """The fitted expert curve of ``config`` (e.g. "tp8", "ep8") in ``fmt`` (bf16, fp8, int4, mxfp4, nvfp4); where
    the calibration timed no kernel of ``fmt`` (vLLM has none for it on that GPU, or it was not asked for), that
    format's ``bytes_per_expert`` (per rank) streamed at the bandwidth measured for the narrowest format timed
    (``from_bytes``, marked estimated), else that narrowest format's curve as it is; returns the fit, the format
    used, and notes. Without a curve of that config, one measured at the same per-rank work serves (``rank_shape``:
    hidden size, expert width and experts per rank: Kimi-K2's tp8 curve is a model of its per-GPU shape's tp1)."""
    curves = [c for c in list(doc["experts"]) + list(doc["int4_estimate"]) if c.get("fit")]
    mine = [c for c in curves if c["config"] == config]
    notes = []
    if not mine and rank_shape is not None and doc.get("shape", {}).get("hidden_size") == rank_shape[0]:
        same_work = [c for c in curves if (c.get("width"), c.get("experts_per_rank")) == rank_shape[1:]]
        if same_work:
            mine = [c for c in same_work if c["config"] == same_work[0]["config"]]
            notes.append(f"no expert curve for {config}: {mine[0]['config']}'s serves, measured at the same per-rank "
                         f"work ({rank_shape[0]}×{rank_shape[1]} experts, {rank_shape[2]} per rank)")
    if not mine:
        have = sorted({c["config"] for c in curves})
        raise ValueError(f"no expert curve for {config} (has: {', '.join(have) or 'none'})")
    mine.sort(key=lambda c: not c.get("table"))  # the engine's own kernel (vLLM's, a table) before a grouped GEMM
    chosen = next((c for c in mine if c["format"] == fmt), None)
    if chosen is None and bytes_per_expert is not None:
        streamed = [c for c in mine if c.get("marginal_weight_gbs") and not c.get("estimated")]
        if streamed:
            return from_bytes(min(streamed, key=lambda c: (c["weight_bits"], bool(c.get("table")))), config, fmt,
                              bytes_per_expert, notes)
    if chosen is None:
        chosen = min(mine, key=lambda c: c["weight_bits"])
        notes.append(f"calibration has no {fmt} expert curve for {config}: using {chosen['format']}")
    if chosen.get("estimated"):
        notes.append(f"{config} {chosen['format']} expert time is estimated, not measured: {chosen.get('note', '')}")
    fit = dict(chosen["fit"])
    if chosen.get("table"):
        fit["table"] = [(float(p["experts"]), float(p["rows"]), float(p["time_us"])) for p in chosen["points"]]
        notes.append(f"{config} expert time read from the table of {chosen['kernel']} ({len(fit['table'])} points)")
    return fit, str(chosen["format"]), notes


def from_bytes(basis: Mapping[str, Any], config: str, fmt: str, bytes_per_expert: float,
               notes: list[str]) -> tuple[dict[str, Any], str, list[str]]:
    """An expert curve of ``fmt``, which the calibration did not time: ``bytes_per_expert`` streamed at the
    marginal weight bandwidth measured for ``basis`` (a timed curve of ``config``), its fixed and per-row cost as
    ``basis``'s (their grid's line fit, never its table: the table is that kernel's, not this format's)."""
    gbs = float(basis["marginal_weight_gbs"])
    fit = {key: value for key, value in basis["fit"].items() if key in ("model", "c0_us", "per_row_us")}
    fit["per_expert_us"] = bytes_per_expert / (gbs * 1e3)
    notes.append(f"{config} {fmt} expert time is estimated from its bytes, not measured: the calibration timed no "
                 f"{fmt} kernel, so {bytes_per_expert / 1e3:.1f} kB per expert per rank stream at the {gbs:.0f} GB/s "
                 f"measured for {basis['format']} ({basis.get('kernel') or 'its kernel'}), fixed and per-row cost "
                 f"as {basis['format']}'s")
    return fit, f"{fmt} (estimated from bytes)", notes


def bandwidth_fit(doc: Mapping[str, Any], bytes_per_expert: float) -> dict[str, Any]:
    """An expert curve from the calibration's device copy bandwidth alone: each expert's weights read once, no
    fixed cost (a lower bound on how expert time grows with the experts read)."""
    return {"c0_us": 0.0, "per_expert_us": bytes_per_expert / (float(doc["copy_bandwidth_gbs"]) * 1e3),
            "per_row_us": 0.0}


def expert_time_us(fit: Mapping[str, Any], experts: float, rows: float) -> float:
    """One expert layer's µs over ``experts`` unique experts and ``rows`` routed rows per rank: the measured table
    where the curve kept one, else the fitted line."""
    if "table" in fit:
        return table_time_us(fit["table"], experts, rows)
    return float(fit["c0_us"]) + float(fit["per_expert_us"]) * experts + float(fit["per_row_us"]) * rows


def moe_layer_us(fit: Mapping[str, Any], experts: float, rows: float, shared_experts: float, top_k: int) -> float:
    """One MoE layer's µs on one rank: the routed experts' kernel over ``experts`` experts and ``rows`` rows, plus
    ``shared_experts`` shared experts, which vLLM runs as a dense MLP beside the kernel: each reads its weights once
    whatever the tokens, priced as one expert of the kernel's one-token point (time at top-k experts and rows ÷
    top-k). Not as rows of the kernel: where vLLM launches one block per routed row (a few tokens), each row there
    re-reads its expert's weights."""
    return expert_time_us(fit, experts, rows) + shared_experts * expert_time_us(fit, top_k, top_k) / top_k


def table_time_us(table: Sequence[tuple[float, float, float]], experts: float, rows: float) -> float:
    """µs at (experts, rows) from measured (experts, rows, µs) points: piecewise linear in experts within each
    measured rows level, then linear in rows between the two levels around ``rows`` (the first level held below
    it, the last two extended above)."""
    levels: dict[float, list[tuple[float, float]]] = {}
    for point_experts, point_rows, time_us in table:
        levels.setdefault(point_rows, []).append((point_experts, time_us))
    rows_levels = sorted(levels)
    if rows <= rows_levels[0] or len(rows_levels) == 1:
        return _interpolate(sorted(levels[rows_levels[0]]), experts, extend=True)
    upper = min(bisect.bisect_left(rows_levels, rows), len(rows_levels) - 1)
    lower_rows, upper_rows = rows_levels[upper - 1], rows_levels[upper]
    lower_us = _interpolate(sorted(levels[lower_rows]), experts, extend=True)
    upper_us = _interpolate(sorted(levels[upper_rows]), experts, extend=True)
    return lower_us + (upper_us - lower_us) * (rows - lower_rows) / (upper_rows - lower_rows)


def _interpolate(points: Sequence[tuple[float, float]], x: float, extend: bool = False) -> float:
    """Piecewise linear through sorted (x, y) points inside them; with ``extend``, the end segments carried on
    outside them (one point: its y)."""
    xs = [p[0] for p in points]
    if len(points) == 1:
        return points[0][1]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[i][1]
    if extend:
        i = min(max(i, 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class AllReduceModel:
    """Time of one all-reduce across ``world_size`` GPUs against message bytes."""

    world_size: int
    points: tuple[tuple[float, float], ...]  # measured (bytes, µs), sorted; empty for a pure ring model
    latency_us: float
    bus_bandwidth_gbs: float
    extrapolated: bool
    basis: str
    byte_scale: float = 1.0  # points measured on fewer GPUs are read at the same bytes sent per GPU

    def time_us(self, nbytes: float) -> float:
        if self.world_size < 2:
            return 0.0
        scaled = nbytes * self.byte_scale
        if self.points and self.points[0][0] <= scaled <= self.points[-1][0]:
            return _interpolate(self.points, scaled)
        return self.latency_us + ring_factor(self.world_size) * nbytes / (self.bus_bandwidth_gbs * 1e3)


def ring_model(world_size: int, latency_us: float, bus_bandwidth_gbs: float, basis: str,
               extrapolated: bool = True) -> AllReduceModel:
    return AllReduceModel(world_size, (), latency_us, bus_bandwidth_gbs, extrapolated, basis)


def monotone_points(points: Sequence[Mapping[str, Any]]) -> tuple[tuple[float, float], ...]:
    """Measured (bytes, µs) of the decode sizes, sorted, each time raised to the largest at fewer bytes: a larger
    message is never faster, and dips of a few percent between sizes are noise or a protocol switch."""
    decode = sorted((float(p["bytes"]), float(p["time_us"])) for p in points if p.get("tokens") is not None)
    out: list[tuple[float, float]] = []
    for nbytes, time_us in decode:
        out.append((nbytes, max(time_us, out[-1][1]) if out else time_us))
    return tuple(out)


def allreduce_model(doc: Mapping[str, Any], world_size: int) -> AllReduceModel | None:
    """The measured curve for ``world_size`` GPUs; else the ring model fitted on the most GPUs measured (labelled
    an extrapolation); None when the calibration measured no all-reduce."""
    measured = [m for m in doc["allreduce"].get("measured", []) if m.get("fit")]
    if not measured:
        return None
    exact = [m for m in measured if m["world_size"] == world_size]
    if exact:
        m = exact[0]
        return AllReduceModel(world_size, monotone_points(m["points"]), float(m["fit"]["latency_us"]),
                              float(m["fit"]["bus_bandwidth_gbs"] or DEFAULT_BUS_BANDWIDTH_GBS), False,
                              f"measured on {world_size} GPUs ({m['backend']}, {m['fit'].get('timing', 'eager')})")
    base = max(measured, key=lambda m: m["world_size"])
    fit = base["fit"]
    bandwidth = float(fit["bus_bandwidth_gbs"] or DEFAULT_BUS_BANDWIDTH_GBS)
    m = int(base["world_size"])
    ring_n, ring_m = ring_factor(world_size), ring_factor(m)
    return AllReduceModel(
        world_size, monotone_points(base["points"]), float(fit["latency_us"]), bandwidth, True,
        f"EXTRAPOLATED from {m} GPUs: ring model, the {m}-GPU curve read at the same bytes per GPU "
        f"(2(N−1)/N × message: ×{ring_n / ring_m:.2f}), so the latency is {m}-GPU latency (a lower bound: NCCL's "
        f"ring latency grows with its 2(N−1) steps); past the measured sizes {fit['latency_us']:.1f} us + "
        f"2(N−1)/N·bytes / {bandwidth:.0f} GB/s",
        byte_scale=ring_n / ring_m)


@dataclass(frozen=True)
class AttentionCurve:
    """One MLA layer's decode on one rank (``moetrace calibrate``'s ``attention``): µs for B requests × Q query tokens
    over L tokens of context, a line over L per timed (Q, B)."""

    lines: tuple[tuple[int, int, float, float], ...]  # (queries, batch, c0_us, per_context_token_us), sorted
    kv_bytes_per_token_layer: int  # the latent one token caches in one layer: the model's it prices
    max_context: int  # the longest context timed
    max_cached_tokens: int  # the most B·L timed
    max_batch: int  # the most requests timed
    heads_per_rank: int
    kernel: str

    def layer_us(self, batch: float, queries: float, context: float) -> float:
        """µs of one layer: each timed (Q, B)'s line at L, piecewise linear in B between the timed batches and in Q
        between the timed query counts, the end segments carried on past them."""
        per_queries = []
        for q in sorted({line[0] for line in self.lines}):
            at_batches = [(float(b), c0 + per_token * context) for lq, b, c0, per_token in self.lines if lq == q]
            per_queries.append((float(q), _interpolate(at_batches, batch, extend=True)))
        return _interpolate(per_queries, queries, extend=True)

    def extrapolated(self, batch: float, queries: float, context: float) -> bool:
        """Whether (B, Q, L) lies past what was timed: a longer context, more cached tokens, requests or queries."""
        return (context > self.max_context or batch * context > self.max_cached_tokens or batch > self.max_batch
                or queries > max(line[0] for line in self.lines))


def attention_curve(doc: Mapping[str, Any]) -> AttentionCurve | None:
    """The calibration's attention curve; None where it timed none (older calibrations, the shipped preset)."""
    section = doc.get("attention") or {}
    if not section.get("fit"):
        return None
    lines = tuple(sorted((int(f["queries"]), int(f["batch"]), float(f["c0_us"]), float(f["per_context_token_us"]))
                         for f in section["fit"]))
    fitted = {(q, b) for q, b, _, _ in lines}  # what was timed counts where a line came of it
    points = [p for p in section["points"] if (int(p["queries"]), int(p["batch"])) in fitted]
    return AttentionCurve(
        lines=lines,
        kv_bytes_per_token_layer=int(section["kv_bytes_per_token_layer"]),
        max_context=max(int(p["context"]) for p in points),
        max_cached_tokens=max(int(p["batch"]) * int(p["context"]) for p in points),
        max_batch=max(int(p["batch"]) for p in points), heads_per_rank=int(section.get("heads_per_rank") or 0),
        kernel=str(section["kernel"]))


def drafter_step_ms(curve: Mapping[str, Any], k: int, batch: int) -> float:
    """ms one speculative step spends in the calibrated model drafter (``moetrace calibrate --drafter``) at ``k``
    drafts per request and ``batch`` requests, passes as vLLM's EAGLE-style proposer runs them: the layers (and
    EAGLE-3's fc) over every token the step verified, batch·(k+1), the LM head on each request's last token, then
    k−1 passes of ``batch`` tokens through the layers and the head. Each part piecewise linear in tokens between
    the calibrated counts, along the end segments past them. 0 at k = 0 (no drafter runs)."""
    if k == 0:
        return 0.0
    points = sorted(curve["points"], key=lambda p: p["tokens"])

    def at(part: str, tokens: float) -> float:
        return _interpolate([(float(p["tokens"]), float(p.get(part, 0.0))) for p in points], tokens, extend=True)

    verified = batch * (k + 1)
    first = at("fc_us", verified) + at("layers_us", verified) + at("head_us", batch)
    return (first + (k - 1) * (at("layers_us", batch) + at("head_us", batch))) / 1e3
