"""Which k to run at each concurrency: predicted speedup per (batch, k) from the batch-union cost model, and the k
that maximises it (0, "do not speculate", when no k beats plain decoding).

At concurrency B a verification step reads the union of B requests' windows (``analysis.concurrency``) and moves
B × the tokens a request-step reads (anchor + drafts proposed) through every all-reduce; each request still gains
its own accepted drafts, so the speedup is tokens per step per request over the step-time ratio to k = 0 at the
same B.
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import polars as pl

from moetrace.analysis.cost import predict
from moetrace.analysis.measured_steps import MeasuredSteps
from moetrace.analysis.deployment import Deployment
from moetrace.analysis.profile import Profile
from moetrace.analysis.sources import Source, least_direct
from moetrace.trace.schema import TIMED_CALLS

DEFAULT_BATCHES = (1, 8, 32, 128)


MIN_WINDOWS = 30
"""A recommendation rests on at least this many decoding request-steps (windows) at every k it compares, k = 0
included: fewer, and the table says so instead of recommending."""


def across_batches(measured: Mapping[int, float], batch: int, extend: bool = True) -> float:
    """A per-step term measured at some concurrencies (``measured``: concurrency → value), at ``batch``: as measured
    there; else linear in the concurrency between the recorded ones around it; past them, along the line through the
    two nearest, its slope not below 0 (a step of more requests is not cheaper), or held at the nearest where not
    ``extend``. With one recorded concurrency: held."""
    if batch in measured:
        return measured[batch]
    points = sorted(measured.items())
    below = [point for point in points if point[0] < batch]
    above = [point for point in points if point[0] > batch]
    if below and above:
        (b0, v0), (b1, v1) = below[-1], above[0]
        return v0 + (v1 - v0) * (batch - b0) / (b1 - b0)
    if len(points) == 1 or not extend:
        return (above[0] if above else below[-1])[1]
    (b0, v0), (b1, v1) = points[:2] if above else points[-2:]
    slope = max((v1 - v0) / (b1 - b0), 0.0)
    return v0 + slope * (batch - b0) if above else v1 + slope * (batch - b1)


def estimated_steps(batch: int, recorded: Mapping[int, pl.DataFrame],
                    baseline_ms: float | None = None) -> MeasuredSteps:
    """What the sweep's steps would measure at ``batch``, a concurrency it did not record, from the predictions at
    the concurrencies it did (``recorded``: concurrency → ``analysis.cost.predict``'s table there): the k=0 step as
    ``baseline_ms`` where the k=0 trace measured it there (steps it passed through), else less its calibrated MoE
    and all-reduce (``rest_ms``), and per k the forward's growth beyond the calibrated MoE, the
    drafter, the rejection sampler, async scheduling off and the prefill per token gained, each ``across_batches``.
    Prefill is held past the recorded concurrencies, not extended: per token a request gains it is a prefill's
    stall of every request (growing with the concurrency) per request's tokens, and more requests end, and are
    prefilled, together in one step as the concurrency grows. MoE and all-reduce are then calibrated at ``batch``'s
    own unions."""
    def term(column: str, k: int, extend: bool = True) -> float | None:
        values = {b: table.filter(pl.col("k") == k)[column].item() for b, table in recorded.items()}
        known = {b: float(v) for b, v in values.items() if v is not None}
        return across_batches(known, batch, extend) if known else None

    ks = sorted(int(k) for k in next(iter(recorded.values()))["k"].to_list())

    def per_k(column: str, extend: bool = True, with_k0: bool = False) -> dict[int, float] | None:
        found = {k: term(column, k, extend) for k in ks if k > 0 or with_k0}
        known = {k: v for k, v in found.items() if v is not None}
        return known or None

    scheduling = term("scheduling_ms", max(ks)) if max(ks) > 0 else None
    return MeasuredSteps(baseline_ms, sampling_ms=per_k("sampling_ms"), drafting_ms=per_k("drafting_ms"),
                         scheduling_ms=scheduling,
                         prefill_ms_per_token=per_k("prefill_ms_per_token", extend=False, with_k0=True) or {},
                         rest_ms=term("rest_ms", 0), forward_beyond_ms=per_k("forward_beyond_moe_ms"),
                         estimated_from=tuple(sorted(recorded)))


def speedup_per_batch(inputs: pl.DataFrame, deployment: Deployment, profile: Profile | None,
                      calibration: Mapping[str, Any] | None, anchor: tuple[float, float],
                      measured: Mapping[int, MeasuredSteps] | None = None,
                      drafter: Mapping[str, Any] | None = None,
                      passed: Mapping[int, float] | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Per (batch, k): the prediction table of ``analysis.cost.predict`` with the inputs' other columns beside it.
    ``inputs``: batch, k, tokens (what the step moves), unique_experts, busiest_rank_experts (per layer, one step of
    ``batch`` requests), tokens_per_step (per request) and their sources and sample sizes. ``measured``: per
    concurrency the sweep recorded, what its own steps measured there (``analysis.measured_steps.MeasuredSteps``); a
    batch it did not record is predicted from ``estimated_steps`` (``step_source`` estimated), its k=0 step from
    ``passed`` (concurrency → the k=0 trace's decode step there, ms) where the sweep passed through it. ``drafter``:
    the calibration's curve of the model drafter, priced where nothing is measured."""
    passed = passed or {}
    joined = inputs.sort("batch", "k")
    per_batch = {int(str(batch)): per_k for (batch,), per_k in joined.group_by("batch", maintain_order=True)}
    tables: dict[int, pl.DataFrame] = {}
    bases: dict[int, dict[str, Any]] = {}

    def run(size: int, steps: MeasuredSteps | None) -> None:
        tables[size], bases[size] = predict(per_batch[size], replace(deployment, batch=size), profile, calibration,
                                            anchor, steps, drafter)

    recorded = [size for size in per_batch if measured is not None and size in measured]
    for size in recorded:
        run(size, None if measured is None else measured[size])
    if measured is not None and not recorded:
        raise ValueError("no concurrency the sweep's k=0 trace recorded is among those predicted")
    estimated = [size for size in per_batch if size not in tables]
    for size in estimated:
        run(size, None if measured is None else estimated_steps(size, {b: tables[b] for b in recorded},
                                                                passed.get(size)))
    frames = []
    for size in sorted(tables):
        beside = per_batch[size].drop(*(name for name in tables[size].columns if name != "k"), strict=False)
        frames.append(tables[size].with_columns(batch=pl.lit(size, pl.Int32)).join(beside.drop("batch"), on="k"))
    basis = bases[recorded[0] if recorded else min(bases)]
    basis.pop("batch", None)
    past = {size: bases[size]["moe_past_table"] for size in sorted(bases) if bases[size].get("moe_past_table")}
    basis.pop("moe_past_table", None)
    if past:
        basis["notes"] = [*basis["notes"], (
            f"at {', '.join(map(str, past))} request(s) per step a step's MoE reads up to "
            f"{max(rows for rows, _ in past.values()):.0f} routed rows per rank, past the calibration table's "
            f"largest step ({next(iter(past.values()))[1]:.0f} rows): priced along its last two steps' trend, where "
            "vLLM may pick other kernel tiles (moetrace calibrate times steps of up to 256 tokens)")]
    if measured is not None and estimated:
        basis["notes"] = [*basis["notes"], (
            f"at {', '.join(map(str, estimated))} request(s) per step, which the sweep did not record, the step is "
            f"estimated (~) from the concurrencies it recorded ({', '.join(map(str, recorded))}): the k=0 step less "
            "its calibrated MoE and all-reduce, the forward's growth beyond them, the drafter, the rejection sampler "
            "and async scheduling off each linear in the concurrency between recorded ones and along the nearest two "
            "past them (held with one), prefill per token gained held past them; MoE and all-reduce are calibrated "
            "at each concurrency's own unions")]
        passed_through = [size for size in estimated if size in passed]
        if passed_through:
            basis["notes"].append(
                f"at {', '.join(map(str, passed_through))} request(s) per step the k=0 step is the k=0 trace's own "
                f"decode steps of that many requests, which it passed through (a round filling or draining, a "
                f"server's spread): {', '.join(f'{passed[size]:.3f} ms at {size}' for size in passed_through)}; "
                "the k>0 steps stay estimated as above, not grown from it (the estimate's k=0 error there is the "
                "calibrated MoE's at those few tokens, which its k>0 steps do not share)")
    return pl.concat(frames, how="vertical_relaxed").select("batch", pl.exclude("batch")), basis


DECISION_SCHEMA: dict[str, pl.DataType] = {
    "batch": pl.Int32(), "k": pl.Int32(), "best_k": pl.Int32(), "speedup": pl.Float64(),
    "speedup_source": pl.String(), "tokens_per_step": pl.Float64(), "step_ratio": pl.Float64(),
    "unique_experts": pl.Float64(), "uniform_bound": pl.Float64(), "union_source": pl.String(),
    "acceptance_source": pl.String(), "step_source": pl.String(), "larger_k_may_pay": pl.Boolean(),
    "k_at_sweep_edge": pl.Boolean(), "sweep_edge_note": pl.String(),
    "windows": pl.Int64(), "steps": pl.Int64(), "status": pl.String()}


def unpredicted(batches: Sequence[int], reason: str) -> pl.DataFrame:
    """Decision rows for concurrencies nothing predicts: k and every figure null, ``status`` the reason."""
    return pl.DataFrame([{"batch": batch, "status": reason} for batch in batches],
                        schema=DECISION_SCHEMA, orient="row")


def sweep_edge(k: int, compared: Sequence[int], recorded: Sequence[int], extrapolated: bool) -> str | None:
    """Where the recommended ``k`` > 0 is the largest of the k ``compared`` (acceptance not extrapolated), the line
    saying a larger k was never priced on acceptance of its own, and how to look there; None elsewhere. With
    ``extrapolated`` k predicted past it, ``k`` is the sweep's largest recorded k (``recorded``: the k it measured
    acceptance at), and only a recording of a larger k measures it; without, the report stopped at ``k``
    (``--max-k``, or every k priced on a given acceptance)."""
    if k == 0 or k < max(compared):
        return None
    if extrapolated:
        ks = ",".join(map(str, sorted({*recorded, k + 1, k + 2})))
        return (f"k = {k} is the largest k recorded (past it acceptance is only extrapolated); a larger k may pay "
                f"more: moetrace record MODEL --k {ks}, then report that sweep")
    return f"k = {k} is the largest k predicted; a larger k may pay more: report again with --max-k {k + 2}"


def may_pay_more(row: Mapping[str, Any]) -> bool:
    """Whether a larger k than a decision row's may pay more, the "+" beside its k: predicted to on extrapolated
    acceptance (``larger_k_may_pay``), or never compared, the k being the sweep's largest (``k_at_sweep_edge``)."""
    return bool(row.get("larger_k_may_pay") or row.get("k_at_sweep_edge"))


def sweep_edge_lines(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The notes of the decision ``rows`` (the report JSON's, per concurrency or per concurrency and context) whose
    k is at the sweep's edge (``k_at_sweep_edge``), one line per k, note and context, naming the concurrencies it
    holds at beside the k's "+" mark: what the terminal and the export say under their tables."""
    where: dict[tuple[int, str, int | None], list[str]] = {}
    for row in rows:
        if row.get("k_at_sweep_edge"):
            where.setdefault((row["k"], row["sweep_edge_note"], row.get("context")), []).append(str(row["batch"]))
    return [f"k={k}+ at B={','.join(batches)}{'' if context is None else f', context {context:,}'}: {note}"
            for (k, note, context), batches in where.items()]


def recommended_k(speedups: pl.DataFrame, batches: Sequence[int], disagreements: Mapping[int, str] | None = None,
                  unpriced: Mapping[int, str] | None = None) -> pl.DataFrame:
    """One row per concurrency of ``batches``: the k with the largest predicted speedup among the k whose
    acceptance is not extrapolated, k = 0 when none exceeds 1 (ties: the smaller k); ``larger_k_may_pay`` when an
    extrapolated k is predicted to do better (record larger k to know); ``k_at_sweep_edge`` when the k is the
    largest compared, which no larger k was measured against, with ``sweep_edge_note`` (``sweep_edge``) saying how
    to look further. ``windows``: the fewest decoding request-steps behind any k compared; ``steps``: measured steps
    behind the chosen k's union; ``speedup_source``: the least direct of its union, acceptance and step
    (``step_source``: null where a profile or calibration priced it). ``status`` is "ok", or why no k is
    recommended: fewer than ``MIN_WINDOWS`` windows at a k compared, the routing rows disagree with the steps table
    at a k compared (``disagreements``: k → what disagrees), the concurrency could not be priced (``unpriced``:
    batch → why), or nothing predicted it; then ``k`` and ``speedup`` are null and ``best_k`` says what the figures
    would have picked, where any did."""
    speedups = speedups.filter(pl.col("batch").is_in(list(batches)))
    compared = speedups.filter(pl.col("acceptance_source") != Source.EXTRAPOLATED.value)
    chosen = (
        compared.sort("batch", pl.col("speedup").neg(), "k")
        .group_by("batch", maintain_order=True)
        .first()
        .select("batch", pl.when(pl.col("speedup") > 1.0).then(pl.col("k")).otherwise(0).alias("best_k"))
    )
    beyond = speedups.filter(pl.col("acceptance_source") == Source.EXTRAPOLATED.value).group_by("batch").agg(
        beyond=pl.col("speedup").max(), extrapolated=pl.lit(True))
    sample = compared.group_by("batch").agg(
        windows=pl.col("request_steps").min(), ks=pl.col("k"),
        recorded=pl.col("k").filter(pl.col("acceptance_source") == Source.MEASURED.value))
    found = (
        chosen.join(speedups, left_on=["batch", "best_k"], right_on=["batch", "k"])
        .join(beyond, on="batch", how="left")
        .join(sample, on="batch")
        .with_columns(larger_k_may_pay=pl.col("beyond").fill_null(0.0) > pl.col("speedup"))
    )
    rows = []
    for row in found.sort("batch").to_dicts():
        problems = [f"routing and steps disagree at k={k}: {what}" for k, what in sorted((disagreements or {}).items())
                    if k in row["ks"]]
        if row["windows"] < MIN_WINDOWS:
            problems.insert(0, f"too few windows: {row['windows']} decoding request-steps at a k compared "
                               f"(a recommendation needs {MIN_WINDOWS})")
        ok = not problems
        step_source = row.get("step_source")
        sources = [row["union_source"], row["acceptance_source"], *([step_source] if step_source else [])]
        edge = sweep_edge(row["best_k"], row["ks"], row["recorded"], bool(row["extrapolated"])) if ok else None
        rows.append({**{name: row.get(name) for name in DECISION_SCHEMA}, "k": row["best_k"] if ok else None,
                     "speedup_source": least_direct(Source(value) for value in sources).value,
                     "speedup": row["speedup"] if ok else None, "status": "ok" if ok else "; ".join(problems),
                     "k_at_sweep_edge": edge is not None, "sweep_edge_note": edge})
    table = pl.DataFrame(rows, schema=DECISION_SCHEMA, orient="row")
    missing = [batch for batch in batches if batch not in set(table["batch"].to_list())]
    reasons = {batch: (unpriced or {}).get(batch, "nothing to predict it from: no routing windows at this "
                                                  "concurrency") for batch in missing}
    return pl.concat([table, *(unpredicted([batch], reason) for batch, reason in reasons.items())]).sort("batch")


def batches_from(values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(values)))
    if not out or out[0] < 1:
        raise ValueError("concurrency values must be at least 1")
    return out


PHASE_COLUMNS = tuple(f"{call}_ms" for call in TIMED_CALLS)  # vLLM's calls a recorded step is timed in


def growth_over_k0(measured: pl.DataFrame, reference: pl.DataFrame | None = None) -> pl.DataFrame:
    """``measured`` (k, batch, period_ms and the ``PHASE_COLUMNS`` per recorded trace and concurrency) with what each
    step grew against the k = 0 step at the same batch: baseline_ms (that step), step_growth_ms, forward_growth_ms
    and sampling_growth_ms (null where k = 0 or the phase was not recorded). The phases grow against
    ``reference`` (batch, forward_ms, sampling_ms: a k = 0 trace run as the k > 0 steps were, e.g. with async
    scheduling off, whose own price is counted apart), by default against ``measured``'s k = 0 rows."""
    baseline = measured.filter(pl.col("k") == 0).select(
        "batch", baseline_ms=pl.col("period_ms"), baseline_tokens_per_step=pl.col("tokens_per_step"),
        baseline_prefill_ms_per_token=pl.col("prefill_ms_per_token"))
    phases = measured.filter(pl.col("k") == 0) if reference is None else reference
    phases = phases.select("batch", forward_k0=pl.col("forward_ms"), sampling_k0=pl.col("sampling_ms"))
    return (measured.join(baseline, on="batch", how="left").join(phases, on="batch", how="left")
            .with_columns(step_growth_ms=pl.col("period_ms") - pl.col("baseline_ms"),
                          forward_growth_ms=pl.col("forward_ms") - pl.col("forward_k0"),
                          sampling_growth_ms=pl.col("sampling_ms") - pl.col("sampling_k0"))
            .drop("forward_k0", "sampling_k0"))


def against_trace(speedups: pl.DataFrame, measured: pl.DataFrame,
                  reference: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per (batch, k > 0) that the sweep recorded: the predicted step and speedup beside those its traces measured
    on the machine that recorded them, what the prediction leaves out per step (measured − predicted step), and
    where the recorded step grew against k = 0 (``growth_over_k0``): in vLLM's forward, in its sampling (the
    rejection sampler), and the drafter's own time. ``measured``: k, batch, period_ms, tokens_per_step,
    prefill_ms_per_token (``analysis.acceptance.decode_step_periods`` of each trace, k = 0 included: the speedup is
    over it, at the same batch, each trace's own prefill time per token included as ``analysis.cost.
    end_to_end_speedup`` includes it), and the ``PHASE_COLUMNS`` (null where not timed); ``reference``: as
    ``growth_over_k0`` takes it."""
    per_token = pl.col("period_ms") / pl.col("tokens_per_step") + pl.col("prefill_ms_per_token")
    baseline_per_token = (pl.col("baseline_ms") / pl.col("baseline_tokens_per_step")
                          + pl.col("baseline_prefill_ms_per_token"))
    at_k = (growth_over_k0(measured, reference).filter((pl.col("k") > 0) & pl.col("baseline_ms").is_not_null())
            .with_columns(measured_speedup=baseline_per_token / per_token))
    return (
        speedups.select("batch", "k", predicted_step_ms="step_ms", predicted_tokens_per_step="tokens_per_step",
                        predicted_speedup="speedup")
        .join(at_k.select("batch", "k", "measured_speedup", "step_growth_ms", "forward_growth_ms",
                          "sampling_growth_ms", "drafting_ms", measured_step_ms="period_ms",
                          measured_tokens_per_step="tokens_per_step"), on=["batch", "k"])
        .with_columns(error=(pl.col("predicted_speedup") - pl.col("measured_speedup")) / pl.col("measured_speedup"),
                      unexplained_ms=pl.col("measured_step_ms") - pl.col("predicted_step_ms"))
        .sort("batch", "k")
    )


def crossover(speedups: pl.DataFrame, batches: Sequence[int], kind: str) -> dict[str, Any]:
    """The concurrency above which no k pays, from ``speedups`` (batch, k, speedup: predicted, or measured where the
    trace ran; k whose acceptance is extrapolated left out where ``acceptance_source`` says so) at ``batches``:
    where the best k > 0 last beats k = 0 (``paying``) and the next concurrency, at which none does
    (``none_pays``), the crossover is interpolated in log concurrency between their best speedups (``batch``).
    ``kind``: "predicted" or "measured", what the speedups are. ``status``: "crosses", "pays throughout" (up to the
    largest concurrency looked at) or "never pays" (from the smallest); ``best``: per concurrency, the best k > 0
    and its speedup."""
    compared = speedups.filter((pl.col("k") > 0) & pl.col("batch").is_in(list(batches)))
    if "acceptance_source" in compared.columns:
        compared = compared.filter(pl.col("acceptance_source") != Source.EXTRAPOLATED.value)
    best = (compared.drop_nulls("speedup").sort("batch", pl.col("speedup").neg(), "k")
            .group_by("batch", maintain_order=True).first().select("batch", "k", "speedup").sort("batch").to_dicts())
    out: dict[str, Any] = {"kind": kind, "batch": None, "paying": None, "none_pays": None, "best": best,
                           "looked_at": [row["batch"] for row in best]}
    if not best:
        return {**out, "status": "nothing predicted"}
    pays = [row for row in best if row["speedup"] > 1.0]
    if not pays:
        return {**out, "status": "never pays", "none_pays": best[0]["batch"]}
    last = pays[-1]
    above = [row for row in best if row["batch"] > last["batch"]]
    if not above:
        return {**out, "status": "pays throughout", "paying": last["batch"]}
    low, high = last, above[0]
    share = (low["speedup"] - 1.0) / (low["speedup"] - high["speedup"])
    at = math.exp(math.log(low["batch"]) + share * (math.log(high["batch"]) - math.log(low["batch"])))
    return {**out, "status": "crosses", "paying": low["batch"], "none_pays": high["batch"], "batch": at}
