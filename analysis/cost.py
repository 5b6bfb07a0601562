"""Cost model: predicted verify-step time, tokens per step and speedup per k, from routing growth, acceptance and a
calibration (``moetrace calibrate``, read by ``analysis.calibration``) and/or a measured step profile. Pure
functions on plain data; Polars out. No torch here.

step(k) = attention(k) + other GEMMs(k) + rest + MoE(k) + all-reduce(k), where for a step of T tokens (B requests
× the tokens a request-step reads at k: measured where the sweep recorded k, else k+1):

- MoE(k): per MoE layer, the routed experts' kernel at the unique experts one rank computes (TP: every unique
  expert of the window, at width/tp; EP: the busiest rank's experts at full width) and the rows routed to it, plus
  the shared experts (TP: all of them at width/tp; EP: 1/ep of each), a dense MLP read once per step
  (``analysis.calibration.moe_layer_us``); calibrated: the kernel's measured table or ``c0 + per_expert·E +
  per_row·rows``; without a calibration, proportional to the experts read (weight-read bound).
- all-reduce(k): ``num_layers × allreduces_per_layer`` all-reduces of T × hidden × 2 bytes; calibrated: the
  measured curve for that many GPUs (interpolated, made non-decreasing in bytes), else the ring model
  ``latency + 2(N−1)/N·bytes/bus bandwidth``
  on the most GPUs measured: their measured curve read at the same bytes sent per GPU (scaled by the ratio of
  2(N−1)/N), the fitted line past the measured sizes (an extrapolation, labelled so); without a calibration: the
  profile's per-call time plus the extra bytes at a conservative bus bandwidth.
- attention, other GEMMs: the profile's share × (1 + growth per extra token × k); the rest of the profile: flat.

With a profile, every component is anchored to it at k=0 (the calibration then only says how MoE and all-reduce
grow with k); with a calibration alone, MoE and all-reduce are absolute and the rest is left out (a lower bound on
the speedup, since the left-out parts grow less than MoE). Tokens per step = 1 + Σ_{i≤k} P(draft i accepted)
(``analysis.acceptance``); speedup(k) = tokens per step / (step(k) / step(0)).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from moetrace.analysis.calibration import (
    DEFAULT_BUS_BANDWIDTH_GBS,
    AllReduceModel,
    allreduce_model,
    bandwidth_fit,
    check_calibration,
    drafter_step_ms,
    expert_fit,
    moe_layer_us,
    ring_model,
)
from moetrace.analysis.deployment import Deployment, ring_factor
from moetrace.analysis.profile import Profile
from moetrace.analysis.sources import Source

LEVEL_WARNING = 2.0  # calibrated MoE over the profile's at the anchor: past this factor either way, a warning


# ---------------------------------------------------------------- drafting

MODEL_DRAFTERS = ("mtp", "eagle", "eagle3", "draft_model")  # drafters that run a model forward per draft


def per_k_from_nearest(measured: Mapping[int, float], ks: Sequence[int], scale_with_k: bool) -> dict[int, float]:
    """A time per step (ms) at every k > 0 of ``ks``: measured where recorded; elsewhere from the nearest recorded k,
    scaled by k when ``scale_with_k``, else held."""
    if not measured:
        raise ValueError("nothing measured")
    out = {}
    for k in (k for k in ks if k > 0):
        nearest = min(measured, key=lambda recorded: (abs(recorded - k), recorded))
        out[k] = measured[k] if k in measured else measured[nearest] * (k / nearest if scale_with_k else 1.0)
    return out


# ---------------------------------------------------------------- prediction


@dataclass(frozen=True)
class MeasuredSteps:
    """What a sweep's own traces measured at one concurrency, ms per step (``--profile measured``).

    ``baseline_ms``: the k=0 decode step (start to start). Per recorded k > 0 (a k not recorded takes the nearest
    recorded k's): ``forward_growth_ms``, how much longer vLLM's forward ran than at k=0 (MoE, attention and dense
    layers over more tokens, CUDA-graph padding); ``sampling_ms``, the rejection sampler's time over k=0's
    sampling; ``drafting_ms``, the drafter's own time (already given at every k). ``scheduling_ms``: what async
    scheduling off adds to every k > 0 step (a k=0 step recorded that way, less ``baseline_ms``).
    ``prefill_ms_per_token``: per recorded k (k=0 included), what that trace's steps that held a prefill took
    beyond a decode step, per token a request gained at this concurrency
    (``analysis.acceptance.decode_step_periods``);
    a k > 0 not recorded takes the nearest recorded k > 0's. Measured per k, not held from k=0: requests that
    start together end together at k=0 and their prompts are prefilled in one step, while under speculation they
    end at scattered steps and are admitted one step each. The speedup is then of the recorded workload's
    throughput, prefill included (``end_to_end_speedup``).

    At a concurrency the sweep did not record (``estimated_from``: the recorded concurrencies it is drawn from,
    ``analysis.decision.across_batches``), ``baseline_ms`` is the k=0 trace's decode step there where it passed
    through that concurrency enough steps (the k=0 step alone: the k > 0 steps are still built from ``rest_ms``),
    else None and the step is built from ``rest_ms``, the k=0 step less its calibrated MoE and all-reduce,
    estimated; ``forward_beyond_ms``, the forward's growth beyond the calibrated MoE per k, and the other terms are
    estimated the same way."""

    baseline_ms: float | None
    forward_growth_ms: Mapping[int, float] = field(default_factory=dict)
    sampling_ms: Mapping[int, float] | None = None
    drafting_ms: Mapping[int, float] | None = None
    scheduling_ms: float | None = None
    prefill_ms_per_token: Mapping[int, float] = field(default_factory=dict)
    rest_ms: float | None = None
    forward_beyond_ms: Mapping[int, float] | None = None
    estimated_from: tuple[int, ...] = ()


def end_to_end_speedup(step0_ms: float, tokens0: float, prefill0_ms_per_token: float,
                       step_ms: float, tokens: float, prefill_ms_per_token: float) -> float:
    """Tokens per second at k over k = 0 for a request that also waits outside decode steps, for each token it gets,
    the prefill steps' time (``prefill0_ms_per_token`` at k = 0, ``prefill_ms_per_token`` at k):
    (step0/tokens0 + p0) / (step/tokens + p). With no prefill this is the decode steps' speedup, tokens per step
    over the step-time ratio."""
    return (step0_ms / tokens0 + prefill0_ms_per_token) / (step_ms / tokens + prefill_ms_per_token)


def moe_past_table(fit: Mapping[str, Any] | None, rows: Sequence[float]) -> tuple[float, float] | None:
    """(most rows priced, most rows the table measured) where a step's routed rows per rank lie past the largest
    step of the calibration's kernel table (read there along its last two steps' trend), else None."""
    if fit is None or "table" not in fit or not rows:
        return None
    measured = max(point[1] for point in fit["table"])
    return (max(rows), measured) if max(rows) > measured else None


def prefill_per_k(measured: Mapping[int, float], ks: Sequence[int]) -> dict[int, float]:
    """Prefill ms per token gained at every k of ``ks``: k = 0's as recorded (0 when not), each k > 0 its own or the
    nearest recorded k > 0's, k = 0's where no k > 0 recorded one."""
    speculated = {k: ms for k, ms in measured.items() if k > 0}
    out = {0: float(measured.get(0, 0.0))}
    if speculated:
        return out | per_k_from_nearest(speculated, ks, scale_with_k=False)
    return out | {k: out[0] for k in ks if k > 0}


def forward_beyond_moe(forward_growth_ms: Mapping[int, float], moe_growth_ms: Mapping[int, float],
                       ks: Sequence[int]) -> dict[int, float]:
    """Per k > 0 of ``ks``: how much more the forward grew than the calibrated MoE and all-reduce growth
    (``moe_growth_ms``, per k) where a trace measured it, held from the nearest measured k elsewhere (negative where
    the calibration prices more growth than the forward showed); empty when none was measured."""
    beyond = {k: grew - moe_growth_ms[k] for k, grew in forward_growth_ms.items() if k > 0 and k in moe_growth_ms}
    return per_k_from_nearest(beyond, ks, scale_with_k=False) if beyond else {}


def predict(per_k: pl.DataFrame, deployment: Deployment, profile: Profile | None,
            calibration: Mapping[str, Any] | None,
            anchor: tuple[float, float] | None = None,
            measured: MeasuredSteps | None = None,
            drafter: Mapping[str, Any] | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Predicted step per k at ``deployment.batch`` requests per step. ``per_k`` has k, tokens (what the step moves),
    unique_experts, busiest_rank_experts (per layer, what one step of ``batch`` requests reads) and tokens_per_step
    (gained per request). A profile is one request's step of ``profile.tokens`` tokens (a window of tokens − 1
    drafts): components are scaled from that step to each step's tokens; its MoE from ``anchor``, the unique
    experts and the busiest rank's experts per layer such a step reads (default: the row of per_k that moves that
    many tokens, right when batch is 1; a one-token step reads top-k experts, at most top-k on a rank).
    ``measured`` (the sweep's own steps at this batch) replaces the profile: the k=0 step is measured; MoE and
    all-reduce grow as calibrated, plus what the forward measured beyond that at the nearest recorded k; the drafter,
    the rejection sampler and async scheduling off add what they measured. Without ``measured``, ``drafter`` (the
    calibration's curve of the model drafter the trace ran) prices the drafter's passes
    (``analysis.calibration.drafter_step_ms``).
    Returns the table and a description of the basis (mode, notes, checks)."""
    if profile is None and calibration is None:
        raise ValueError("a prediction needs a calibration, a profile, or both")
    if measured is not None and (calibration is None or profile is not None):
        raise ValueError("a measured k=0 step goes with a calibration (how MoE and all-reduce grow) and no profile")
    rows = per_k.sort("k").to_dicts()
    if not rows or rows[0]["k"] != 0:
        raise ValueError("per-k input must start at k=0")
    shape, n_ar = deployment.shape, deployment.allreduces
    notes: list[str] = []
    fmt_used: str | None = None
    fit: dict[str, Any] | None = None
    expert_us: list[float] = []
    allreduce_us: list[float] = []
    ar_model: AllReduceModel | None = None
    tokens_list = [float(r["tokens"]) for r in rows]
    work = [deployment.rank_work(r["unique_experts"], r["busiest_rank_experts"], t) for r, t in zip(rows, tokens_list)]
    rank_experts = [e + deployment.shared_per_rank for e, _ in work]  # routed and shared experts one rank reads
    anchor_tokens = float(profile.tokens) if profile is not None else 1.0
    if anchor is None:
        at = next((r for r in rows if float(r["tokens"]) == anchor_tokens), rows[0])
        anchor = (float(at["unique_experts"]), float(at["busiest_rank_experts"]))
    if anchor_tokens == 1.0:  # one token reads exactly top-k experts
        anchor = (float(shape.top_k), min(anchor[1], float(shape.top_k)))
    anchor_work = deployment.rank_work(anchor[0], min(anchor[1], anchor[0]), anchor_tokens)
    if calibration is not None:
        check_calibration(calibration)
        try:
            fit, fmt_used, fit_notes = expert_fit(calibration, deployment.expert_config(), deployment.weight_format,
                                                  deployment.rank_shape())
        except ValueError as exc:
            if measured is None or "copy_bandwidth_gbs" not in calibration:
                raise
            # with a measured k=0 step only the growth is priced: from bytes read, when no curve fits the shape
            per_rank = shape.expert_bytes / (1 if deployment.ep > 1 else deployment.tp)  # EP: whole experts
            fit, fmt_used = bandwidth_fit(calibration, per_rank), deployment.weight_format
            fit_notes = [f"{exc}: expert time grows as its weights read at the calibration's copy bandwidth "
                         f"({float(calibration['copy_bandwidth_gbs']):.0f} GB/s, {per_rank / 1e3:.1f} kB per expert "
                         f"per rank): a lower bound"]
        notes += fit_notes
        cal_hidden = calibration.get("shape", {}).get("hidden_size")
        if cal_hidden is not None and int(cal_hidden) != shape.hidden_size:
            notes.append(f"calibration measured hidden {cal_hidden}, the model has {shape.hidden_size}")
        shared = deployment.shared_per_rank
        expert_us = [moe_layer_us(fit, e, m, shared, shape.top_k) for e, m in work]
        anchor_expert_us = moe_layer_us(fit, *anchor_work, shared, shape.top_k)
        if deployment.world_size > 1:
            ar_model = allreduce_model(calibration, deployment.world_size)
            if ar_model is None:
                notes.append("calibration has no all-reduce curve: all-reduce left out"
                             if profile is None else "calibration has no all-reduce curve: profile model used")
    if not expert_us:  # no calibration: weight-read bound, proportional to experts read per rank
        expert_us = rank_experts
        anchor_expert_us = anchor_work[0] + deployment.shared_per_rank
    if ar_model is None and profile is not None and deployment.world_size > 1:
        per_call = profile.step_ms * profile.allreduce * 1e3 / max(n_ar, 1)
        ring = ring_factor(deployment.world_size)
        base_bytes = deployment.message_bytes(profile.tokens)
        # the profile's time per call is latency plus its bytes; more tokens add only their bytes' time
        ar_model = ring_model(deployment.world_size,
                              per_call - ring * base_bytes / (DEFAULT_BUS_BANDWIDTH_GBS * 1e3),
                              DEFAULT_BUS_BANDWIDTH_GBS,
                              f"profile: {per_call:.1f} us per call at {profile.tokens} token(s); extra bytes at "
                              f"{DEFAULT_BUS_BANDWIDTH_GBS:.0f} GB/s bus bandwidth (assumed)", extrapolated=False)
    allreduce_us = [ar_model.time_us(deployment.message_bytes(t)) if ar_model else 0.0 for t in tokens_list]
    anchor_allreduce_us = ar_model.time_us(deployment.message_bytes(anchor_tokens)) if ar_model else 0.0

    ks = [int(r["k"]) for r in rows]
    beyond = {k: 0.0 for k in ks}
    if measured is not None:
        mode = "measured k=0 step, calibrated growth"
        moe = [shape.moe_layers * e / 1e3 for e in expert_us]
        ar = [n_ar * a / 1e3 for a in allreduce_us]
        # the step is the measured k=0 step plus growth: where the calibration's level is above it, only its growth
        # counts (what is left of the step, below, is then negative)
        if measured.baseline_ms is None:  # a concurrency not recorded: the estimated rest of the k=0 step
            flat = float(measured.rest_ms or 0.0)
        else:
            flat = measured.baseline_ms - moe[0] - ar[0]
        # where the k=0 trace only passed through this concurrency, its step replaces the estimate at k=0 alone: the
        # estimate's k=0 error there is the calibrated MoE's at these few tokens (vLLM's small-M kernel set-up), so
        # growth from the measured step would carry it into every k > 0 step
        rest_k = float(measured.rest_ms) if measured.estimated_from and measured.rest_ms is not None else flat
        if flat < 0 and measured.baseline_ms is not None:
            notes.append(f"the calibration's MoE and all-reduce ({moe[0] + ar[0]:.3f} ms) exceed the measured k=0 "
                         f"step ({measured.baseline_ms:.3f} ms) at {deployment.batch} request(s): only their growth "
                         f"with k is used")
        calibrated_growth = {k: m + a - moe[0] - ar[0] for k, m, a in zip(ks, moe, ar)}
        beyond.update(forward_beyond_moe(measured.forward_growth_ms, calibrated_growth, ks)
                      if measured.forward_beyond_ms is None else measured.forward_beyond_ms)
        attention = other = [0.0 for _ in rows]
        rest = [flat if k == 0 else rest_k for k in ks]
        notes.append("k=0 step measured in the sweep's k=0 trace at each concurrency (decode step start to start, "
                     "host scheduling included); MoE and all-reduce grow with k as calibrated, "
                     + ("and the forward by what it grew beyond that in the sweep's traces (attention and dense "
                        "layers over more tokens, CUDA-graph padding), from the nearest recorded k"
                        if measured.forward_growth_ms or measured.forward_beyond_ms else
                        "the rest of the forward held flat: no recorded k > 0 trace timed vLLM's forward, so its "
                        "growth beyond the calibrated MoE (attention and dense layers over more tokens) is left out "
                        "and the speedups run high (record one k > 0 beside k = 0)")
                     + ("; the drafter's own time per step as the sweep's traces measured it (the longer of its host "
                        "time and its device time; under async scheduling, a model drafter's device time), scaled "
                        "with k from the nearest recorded k for a model drafter, held for n-gram"
                        if measured.drafting_ms is not None else
                        "; the drafter's own time is not in it (the traces did not measure it)")
                     + (f"; k>0 steps run with async scheduling off as vLLM runs this drafter: "
                        f"{measured.scheduling_ms:+.3f} ms per step, measured at k=0 (--k0-sync)"
                        if measured.scheduling_ms is not None else "")
                     + ("; the rejection sampler's time over k=0's as the sweep's traces measured it, held from the "
                        "nearest recorded k" if measured.sampling_ms is not None else
                        "; rejection sampling is not in it")
                     + ("; the speedup is of the recorded workload's throughput: the steps that held a prefill, per "
                        "token a request gained, as each recorded k measured them (a k not recorded: the nearest "
                        "recorded k > 0)" if any(measured.prefill_ms_per_token.values()) else
                        "; the traces held no prefill step at this concurrency: the speedup is the decode steps'")
                     + "; bookkeeping is not in the prediction")
    elif profile is not None:
        mode = "profile anchored, calibrated growth" if calibration is not None else "profile, modelled growth"
        p_ms = profile.step_ms
        moe = [p_ms * profile.moe * e / anchor_expert_us for e in expert_us]
        ar = [p_ms * profile.allreduce * (a / anchor_allreduce_us if anchor_allreduce_us > 0 else 1.0)
              for a in allreduce_us]
        attention = [p_ms * profile.attention * (1 + profile.attention_growth_per_token * (t - anchor_tokens))
                     for t in tokens_list]
        other = [p_ms * profile.other_gemm * (1 + profile.other_growth_per_token * (t - anchor_tokens))
                 for t in tokens_list]
        rest = [p_ms * profile.rest for _ in rows]
        notes.append(f"profile: {profile.source}; attention +{profile.attention_growth_per_token:.0%} and other "
                     f"GEMMs +{profile.other_growth_per_token:.0%} per extra token (assumed), the rest "
                     f"({profile.rest:.1%}) flat")
    else:
        mode = "calibration only"
        moe = [shape.moe_layers * e / 1e3 for e in expert_us]
        ar = [n_ar * a / 1e3 for a in allreduce_us]
        attention = other = rest = [0.0 for _ in rows]
        notes.append("no profile: attention, other GEMMs and the rest are left out, so step times cover MoE and "
                     "all-reduce only and the speedups are a lower bound")
    def at_k(values: Mapping[int, float] | float | None) -> list[float]:
        """A measured per-step time on every k > 0 (0 at k = 0 and where not measured)."""
        if isinstance(values, (int, float)):
            return [float(values) if k > 0 else 0.0 for k in ks]
        return [float(values.get(k, 0.0)) if values and k > 0 else 0.0 for k in ks]

    drafting = at_k(measured.drafting_ms if measured else None)
    priced_drafter = measured is None and drafter is not None
    if priced_drafter:
        assert drafter is not None
        drafting = [drafter_step_ms(drafter, k, deployment.batch) for k in ks]
        notes.append(f"the drafter's passes priced from the calibration's {drafter['method']} curve "
                     f"({drafter['shape']['architecture']}, tp{drafter['tp']}, {drafter['parameters_per_rank']:,} "
                     f"parameters per rank): the layers over B·(k+1) tokens, then k−1 passes of B; device time, "
                     f"not the proposer's host work")
    scheduling = at_k(measured.scheduling_ms if measured else None)
    sampling = at_k(measured.sampling_ms if measured else None)
    forward = [beyond[k] for k in ks]
    prefill_at = prefill_per_k(measured.prefill_ms_per_token if measured else {}, ks)
    prefill = [prefill_at[k] for k in ks]
    steps = [sum(parts) for parts in zip(moe, ar, attention, other, rest, forward, drafting, scheduling, sampling)]
    table = pl.DataFrame({
        "k": [int(r["k"]) for r in rows],
        "tokens": tokens_list,
        "unique_experts": [float(r["unique_experts"]) for r in rows],
        "rank_experts": rank_experts,
        "tokens_per_step": [float(r["tokens_per_step"]) for r in rows],
        "expert_weight_bytes": [deployment.expert_weight_bytes(float(r["unique_experts"])) for r in rows],
        "moe_ms": moe,
        "allreduce_ms": ar,
        "attention_ms": attention,
        "other_ms": other,
        "rest_ms": rest,
        # None: not measured
        "forward_beyond_moe_ms": forward if measured and (measured.forward_growth_ms or measured.forward_beyond_ms)
        else [None] * len(rows),
        "drafting_ms": drafting if priced_drafter or (measured and measured.drafting_ms is not None)
        else [None] * len(rows),
        "scheduling_ms": scheduling if measured and measured.scheduling_ms is not None else [None] * len(rows),
        "sampling_ms": sampling if measured and measured.sampling_ms is not None else [None] * len(rows),
        "step_ms": steps,
        # where the k=0 step comes from: the sweep's own steps at this concurrency, estimated from other recorded
        # concurrencies, or (null) a profile or calibration
        "step_source": pl.Series([None if measured is None else Source.ESTIMATED.value
                                  if measured.estimated_from else Source.MEASURED.value] * len(rows),
                                 dtype=pl.String),
        "step_ratio": [s / steps[0] for s in steps],
        "prefill_ms_per_token": prefill,
        "speedup": [end_to_end_speedup(steps[0], float(rows[0]["tokens_per_step"]), prefill[0], s,
                                       float(r["tokens_per_step"]), p) for r, s, p in zip(rows, steps, prefill)],
        "expert_layer_us": expert_us if calibration is not None else [None] * len(rows),
        "allreduce_call_us": allreduce_us,
    })
    basis: dict[str, Any] = {
        "mode": mode,
        "batch": deployment.batch,
        "tp": deployment.tp,
        "ep": deployment.ep,
        "world_size": deployment.world_size,
        "expert_config": deployment.expert_config(),
        "weight_format": fmt_used or deployment.weight_format,
        "allreduces_per_step": n_ar,
        "allreduce": ar_model.basis if ar_model else None,
        "allreduce_extrapolated": bool(ar_model and ar_model.extrapolated),
        # (rows priced, rows measured) where the MoE of a k was read past the calibration table's largest step
        "moe_past_table": moe_past_table(fit, [m for _, m in work]),
        "notes": notes,
    }
    if profile is not None and calibration is not None:
        calibrated_moe = shape.moe_layers * anchor_expert_us / 1e3
        level = calibrated_moe / (profile.step_ms * profile.moe) if profile.moe > 0 else None
        basis["calibrated_at_anchor"] = {
            "tokens": anchor_tokens,
            "moe_ms": calibrated_moe,
            "allreduce_ms": n_ar * anchor_allreduce_us / 1e3 if ar_model else None,
            "profile_moe_ms": profile.step_ms * profile.moe,
            "profile_allreduce_ms": profile.step_ms * profile.allreduce,
            "moe_level_ratio": level,
        }
        if level is not None and not 1 / LEVEL_WARNING <= level <= LEVEL_WARNING:
            notes.append(f"the calibration prices the profile's MoE at {calibrated_moe:.2f} ms per step against the "
                         f"profile's {profile.step_ms * profile.moe:.2f} ms ({level:.1f}x): its growth with k is "
                         f"taken from a curve that far from this deployment's level")
    return table, basis


# ---------------------------------------------------------------- context


def kv_read_ms(batch: int, context: float, kv_bytes_per_token: int, bandwidth_gbs: float) -> float:
    """One step's read of its ``batch`` requests' KV caches of ``context`` tokens on one rank, at ``bandwidth_gbs``."""
    return batch * context * kv_bytes_per_token / (bandwidth_gbs * 1e6)


def at_contexts(speedups: pl.DataFrame, contexts: Sequence[int], recorded_context: float, kv_bytes_per_token: int,
                bandwidth_gbs: float) -> pl.DataFrame:
    """``speedups`` (per batch and k: step_ms, tokens_per_step, prefill_ms_per_token, ...) moved from the context
    the traces ran at, ``recorded_context`` tokens, to each of ``contexts``, with a context column. A verify step
    reads each request's KV cache once for all its k + 1 queries, so every k's step of B requests grows alike, by
    ``kv_read_ms`` of B × (L − L₀) tokens (attention_kv_ms): at long context the MoE's growth with k weighs less and
    speculation pays more. Estimated (``step_source``): the KV bytes the model's config names, read at the
    calibration's copy bandwidth; the attention's compute over k + 1 queries stays as the step priced it. A step
    that would shrink to nothing (a context far below the recorded one) gets no speedup."""
    frames = []
    for context in contexts:
        frames.append(speedups.with_columns(
            context=pl.lit(context, pl.Int64),
            attention_kv_ms=pl.col("batch").cast(pl.Float64) * kv_read_ms(1, context - recorded_context,
                                                                           kv_bytes_per_token, bandwidth_gbs)))
    moved = pl.concat(frames).with_columns(step_ms=pl.col("step_ms") + pl.col("attention_kv_ms"))
    rows = moved.select("batch", "context", "k", "step_ms", "tokens_per_step", "prefill_ms_per_token").to_dicts()
    k0 = {(row["batch"], row["context"]): row for row in rows if row["k"] == 0}

    def speedup(row: dict[str, Any]) -> float | None:
        base = k0[(row["batch"], row["context"])]
        if min(row["step_ms"], base["step_ms"]) <= 0:
            return None
        return end_to_end_speedup(base["step_ms"], base["tokens_per_step"], base["prefill_ms_per_token"],
                                  row["step_ms"], row["tokens_per_step"], row["prefill_ms_per_token"])

    return moved.with_columns(
        step_ratio=pl.Series([row["step_ms"] / k0[(row["batch"], row["context"])]["step_ms"] for row in rows]),
        speedup=pl.Series([speedup(row) for row in rows], dtype=pl.Float64),
        step_source=pl.lit(Source.ESTIMATED.value),
    )
