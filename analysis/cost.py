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
from dataclasses import dataclass
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
from moetrace.analysis.measured_steps import MeasuredSteps, forward_beyond_moe, prefill_per_k
from moetrace.analysis.profile import Profile
from moetrace.analysis.sources import Source

LEVEL_WARNING = 2.0  # calibrated MoE over the profile's at the anchor: past this factor either way, a warning


# ---------------------------------------------------------------- prediction


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


def step_source(batch: int, measured: MeasuredSteps) -> str:
    """Where a step at ``batch`` requests comes from: measured at a recorded concurrency; estimated between recorded
    ones; extrapolated past the largest (``MeasuredSteps.estimated_from``)."""
    if not measured.estimated_from:
        return Source.MEASURED.value
    return str((Source.EXTRAPOLATED if batch > max(measured.estimated_from) else Source.ESTIMATED).value)


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
    notes: list[str] = []
    priced = _priced(rows, deployment, profile, calibration, anchor, measured, notes)
    ks = [int(r["k"]) for r in rows]
    if measured is not None:
        parts = _measured_parts(priced, deployment, measured, ks, notes)
    elif profile is not None:
        parts = _profile_parts(priced, profile, calibration, notes)
    else:
        parts = _calibration_parts(priced, deployment, notes)
    extra = _beside_the_forward(deployment, measured, drafter, ks, notes)
    table = _table(rows, deployment, priced, parts, extra, measured, calibration)
    return table, _basis(deployment, priced, parts.mode, profile, calibration, notes)


@dataclass(frozen=True)
class _Priced:
    """Per k (the step's tokens), what one rank's MoE layer and one all-reduce call cost (``expert_us``,
    ``allreduce_us``: by the calibration; without one, the experts a rank reads), and the same at the profile's
    anchor step of ``anchor_tokens`` tokens."""

    tokens: list[float]
    work: list[tuple[float, float]]  # per k: (experts, rows) one rank's MoE layer moves
    rank_experts: list[float]  # routed and shared experts one rank reads
    expert_us: list[float]
    allreduce_us: list[float]
    anchor_tokens: float
    anchor_expert_us: float
    anchor_allreduce_us: float
    fit: dict[str, Any] | None
    weight_format: str | None
    allreduce: AllReduceModel | None


def _priced(rows: list[dict[str, Any]], deployment: Deployment, profile: Profile | None,
            calibration: Mapping[str, Any] | None, anchor: tuple[float, float] | None,
            measured: MeasuredSteps | None, notes: list[str]) -> _Priced:
    """The MoE layer and all-reduce call at each k's step and at the anchor (``predict``), noting what they rest on."""
    shape = deployment.shape
    fmt_used: str | None = None
    fit: dict[str, Any] | None = None
    expert_us: list[float] = []
    ar_model: AllReduceModel | None = None
    tokens_list = [float(r["tokens"]) for r in rows]
    work = [deployment.rank_work(r["unique_experts"], r["busiest_rank_experts"], t) for r, t in zip(rows, tokens_list)]
    rank_experts = [e + deployment.shared_per_rank for e, _ in work]
    anchor_tokens = float(profile.tokens) if profile is not None else 1.0
    if anchor is None:
        at = next((r for r in rows if float(r["tokens"]) == anchor_tokens), rows[0])
        anchor = (float(at["unique_experts"]), float(at["busiest_rank_experts"]))
    if anchor_tokens == 1.0:  # one token reads exactly top-k experts
        anchor = (float(shape.top_k), min(anchor[1], float(shape.top_k)))
    anchor_work = deployment.rank_work(anchor[0], min(anchor[1], anchor[0]), anchor_tokens)
    if calibration is not None:
        check_calibration(calibration)
        # one expert's bytes on one rank (EP: whole experts); None where the format's bytes cannot be counted
        per_rank = None if shape.unpriced_format else shape.expert_bytes / (1 if deployment.ep > 1 else deployment.tp)
        try:
            fit, fmt_used, fit_notes = expert_fit(calibration, deployment.expert_config(), deployment.weight_format,
                                                  deployment.rank_shape(), per_rank)
        except ValueError as exc:
            if measured is None or per_rank is None or "copy_bandwidth_gbs" not in calibration:
                raise
            # with a measured k=0 step only the growth is priced: from bytes read, when no curve fits the shape
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
        ar_model = _profile_allreduce(deployment, profile)
    return _Priced(
        tokens=tokens_list, work=work, rank_experts=rank_experts, expert_us=expert_us,
        allreduce_us=[ar_model.time_us(deployment.message_bytes(t)) if ar_model else 0.0 for t in tokens_list],
        anchor_tokens=anchor_tokens, anchor_expert_us=anchor_expert_us,
        anchor_allreduce_us=ar_model.time_us(deployment.message_bytes(anchor_tokens)) if ar_model else 0.0,
        fit=fit, weight_format=fmt_used, allreduce=ar_model)


def _profile_allreduce(deployment: Deployment, profile: Profile) -> AllReduceModel:
    """The all-reduce as the profile times it: its time per call is latency plus its bytes; more tokens add only
    their bytes' time, at an assumed bus bandwidth."""
    per_call = profile.step_ms * profile.allreduce * 1e3 / max(deployment.allreduces, 1)
    ring = ring_factor(deployment.world_size)
    base_bytes = deployment.message_bytes(profile.tokens)
    return ring_model(deployment.world_size,
                      per_call - ring * base_bytes / (DEFAULT_BUS_BANDWIDTH_GBS * 1e3),
                      DEFAULT_BUS_BANDWIDTH_GBS,
                      f"profile: {per_call:.1f} us per call at {profile.tokens} token(s); extra bytes at "
                      f"{DEFAULT_BUS_BANDWIDTH_GBS:.0f} GB/s bus bandwidth (assumed)", extrapolated=False)


@dataclass(frozen=True)
class _Parts:
    """A step's parts per k, in ms, as one of the three modes prices them (``beyond``: the forward's measured growth
    past the calibrated MoE, by k; none outside the measured mode)."""

    mode: str
    moe: list[float]
    allreduce: list[float]
    attention: list[float]
    other: list[float]
    rest: list[float]
    beyond: dict[int, float]


def _measured_parts(priced: _Priced, deployment: Deployment, measured: MeasuredSteps, ks: list[int],
                    notes: list[str]) -> _Parts:
    """The sweep's own k=0 step at this concurrency, MoE and all-reduce growing with k as calibrated, and the
    forward by what it grew beyond that in the traces."""
    shape, n_ar = deployment.shape, deployment.allreduces
    moe = [shape.moe_layers * e / 1e3 for e in priced.expert_us]
    ar = [n_ar * a / 1e3 for a in priced.allreduce_us]
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
    beyond = {k: 0.0 for k in ks}
    beyond.update(forward_beyond_moe(measured.forward_growth_ms, calibrated_growth, ks)
                  if measured.forward_beyond_ms is None else measured.forward_beyond_ms)
    notes.append(_measured_note(measured))
    zeros = [0.0 for _ in ks]
    return _Parts("measured k=0 step, calibrated growth", moe, ar, zeros, zeros,
                  [flat if k == 0 else rest_k for k in ks], beyond)


def _measured_note(measured: MeasuredSteps) -> str:
    """What a prediction from the sweep's measured steps holds, and what it leaves out."""
    return ("k=0 step measured in the sweep's k=0 trace at each concurrency (decode step start to start, "
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
            + ("; the speedup is of the recorded workload's throughput: the prefills beyond the decode steps, per "
               "token a request gained, as each recorded k's trace measured them (a k not recorded: the nearest "
               "recorded k > 0)" if any(measured.prefill_ms_per_token.values()) else
               "; the traces held no prefill step: the speedup is the decode steps'")
            + "; bookkeeping is not in the prediction")


def _profile_parts(priced: _Priced, profile: Profile, calibration: Mapping[str, Any] | None,
                   notes: list[str]) -> _Parts:
    """The profile's step, each part scaled from its anchor to each k's step: MoE and all-reduce as priced,
    attention and other GEMMs by the profile's growth per token, the rest flat."""
    p_ms, anchor_tokens = profile.step_ms, priced.anchor_tokens
    moe = [p_ms * profile.moe * e / priced.anchor_expert_us for e in priced.expert_us]
    ar = [p_ms * profile.allreduce * (a / priced.anchor_allreduce_us if priced.anchor_allreduce_us > 0 else 1.0)
          for a in priced.allreduce_us]
    attention = [p_ms * profile.attention * (1 + profile.attention_growth_per_token * (t - anchor_tokens))
                 for t in priced.tokens]
    other = [p_ms * profile.other_gemm * (1 + profile.other_growth_per_token * (t - anchor_tokens))
             for t in priced.tokens]
    notes.append(f"profile: {profile.source}; attention +{profile.attention_growth_per_token:.0%} and other "
                 f"GEMMs +{profile.other_growth_per_token:.0%} per extra token (assumed), the rest "
                 f"({profile.rest:.1%}) flat")
    mode = "profile anchored, calibrated growth" if calibration is not None else "profile, modelled growth"
    return _Parts(mode, moe, ar, attention, other, [p_ms * profile.rest for _ in priced.tokens], {})


def _calibration_parts(priced: _Priced, deployment: Deployment, notes: list[str]) -> _Parts:
    """MoE and all-reduce alone, as calibrated: a lower bound."""
    moe = [deployment.shape.moe_layers * e / 1e3 for e in priced.expert_us]
    ar = [deployment.allreduces * a / 1e3 for a in priced.allreduce_us]
    zeros = [0.0 for _ in priced.tokens]
    notes.append("no profile: attention, other GEMMs and the rest are left out, so step times cover MoE and "
                 "all-reduce only and the speedups are a lower bound")
    return _Parts("calibration only", moe, ar, zeros, zeros, zeros, {})


@dataclass(frozen=True)
class _Beside:
    """Per k, in ms, what a step adds beside the forward: drafting, async scheduling off, rejection sampling; and
    the prefill time per token gained (``drafter_priced``: the drafter from the calibration's curve)."""

    drafting: list[float]
    scheduling: list[float]
    sampling: list[float]
    prefill: list[float]
    drafter_priced: bool


def _beside_the_forward(deployment: Deployment, measured: MeasuredSteps | None, drafter: Mapping[str, Any] | None,
                        ks: list[int], notes: list[str]) -> _Beside:
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
    prefill_at = prefill_per_k(measured.prefill_ms_per_token if measured else {}, ks)
    return _Beside(drafting, at_k(measured.scheduling_ms if measured else None),
                   at_k(measured.sampling_ms if measured else None), [prefill_at[k] for k in ks], priced_drafter)


def _table(rows: list[dict[str, Any]], deployment: Deployment, priced: _Priced, parts: _Parts, extra: _Beside,
           measured: MeasuredSteps | None, calibration: Mapping[str, Any] | None) -> pl.DataFrame:
    """``predict``'s table: each k's step, its parts and the speedup."""
    ks = [int(r["k"]) for r in rows]
    forward = [parts.beyond.get(k, 0.0) for k in ks]
    steps = [sum(step) for step in zip(parts.moe, parts.allreduce, parts.attention, parts.other, parts.rest, forward,
                                       extra.drafting, extra.scheduling, extra.sampling)]
    unmeasured: list[float | None] = [None] * len(rows)
    prefill = extra.prefill
    return pl.DataFrame({
        "k": ks,
        "tokens": priced.tokens,
        "unique_experts": [float(r["unique_experts"]) for r in rows],
        "rank_experts": priced.rank_experts,
        "tokens_per_step": [float(r["tokens_per_step"]) for r in rows],
        "expert_weight_bytes": [deployment.expert_weight_bytes(float(r["unique_experts"])) for r in rows],
        "moe_ms": parts.moe,
        "allreduce_ms": parts.allreduce,
        "attention_ms": parts.attention,
        "other_ms": parts.other,
        "rest_ms": parts.rest,
        # None: not measured
        "forward_beyond_moe_ms": forward if measured and (measured.forward_growth_ms or measured.forward_beyond_ms)
        else unmeasured,
        "drafting_ms": extra.drafting if extra.drafter_priced or (measured and measured.drafting_ms is not None)
        else unmeasured,
        "scheduling_ms": extra.scheduling if measured and measured.scheduling_ms is not None else unmeasured,
        "sampling_ms": extra.sampling if measured and measured.sampling_ms is not None else unmeasured,
        "step_ms": steps,
        # where the k=0 step comes from: the sweep's own steps at this concurrency, estimated from other recorded
        # concurrencies (extrapolated past the largest: the k=0 step's rest and the prefill held or continued
        # along the last two), or (null) a profile or calibration
        "step_source": pl.Series([None if measured is None else step_source(deployment.batch, measured)] * len(rows),
                                 dtype=pl.String),
        "step_ratio": [s / steps[0] for s in steps],
        "prefill_ms_per_token": prefill,
        "speedup": [end_to_end_speedup(steps[0], float(rows[0]["tokens_per_step"]), prefill[0], s,
                                       float(r["tokens_per_step"]), p) for r, s, p in zip(rows, steps, prefill)],
        "expert_layer_us": priced.expert_us if calibration is not None else unmeasured,
        "allreduce_call_us": priced.allreduce_us,
    })


def _basis(deployment: Deployment, priced: _Priced, mode: str, profile: Profile | None,
           calibration: Mapping[str, Any] | None, notes: list[str]) -> dict[str, Any]:
    """``predict``'s basis: the mode, the deployment and the curves it priced with, and its notes (with a warning
    where the calibration's MoE level at the profile's anchor is far from the profile's)."""
    ar_model, n_ar = priced.allreduce, deployment.allreduces
    basis: dict[str, Any] = {
        "mode": mode,
        "batch": deployment.batch,
        "tp": deployment.tp,
        "ep": deployment.ep,
        "world_size": deployment.world_size,
        "expert_config": deployment.expert_config(),
        "weight_format": priced.weight_format or deployment.weight_format,
        "allreduces_per_step": n_ar,
        "allreduce": ar_model.basis if ar_model else None,
        "allreduce_extrapolated": bool(ar_model and ar_model.extrapolated),
        # (rows priced, rows measured) where the MoE of a k was read past the calibration table's largest step
        "moe_past_table": moe_past_table(priced.fit, [m for _, m in priced.work]),
        "notes": notes,
    }
    if profile is not None and calibration is not None:
        calibrated_moe = deployment.shape.moe_layers * priced.anchor_expert_us / 1e3
        level = calibrated_moe / (profile.step_ms * profile.moe) if profile.moe > 0 else None
        basis["calibrated_at_anchor"] = {
            "tokens": priced.anchor_tokens,
            "moe_ms": calibrated_moe,
            "allreduce_ms": n_ar * priced.anchor_allreduce_us / 1e3 if ar_model else None,
            "profile_moe_ms": profile.step_ms * profile.moe,
            "profile_allreduce_ms": profile.step_ms * profile.allreduce,
            "moe_level_ratio": level,
        }
        if level is not None and not 1 / LEVEL_WARNING <= level <= LEVEL_WARNING:
            notes.append(f"the calibration prices the profile's MoE at {calibrated_moe:.2f} ms per step against the "
                         f"profile's {profile.step_ms * profile.moe:.2f} ms ({level:.1f}x): its growth with k is "
                         f"taken from a curve that far from this deployment's level")
    return basis
