"""The payload of a report, shaped from each TRACE's ``RunAnalysis``: what ``--json`` prints, and the one source the
terminal's tables and the dashboard render (``report_payload``); and the budget file ``moetrace budget`` writes
(``budget_file``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from moetrace.analysis.adaptive import schedule_verdict
from moetrace.analysis.budgets import smallest_budgets
from moetrace.analysis.context import recorded_context
from moetrace.analysis.growth import COUNTERFACTUAL, MEASURED, PER_BATCH, PER_REQUEST, best_window_estimate
from moetrace.analysis.shape import ModelShape
from moetrace.analysis.sources import least_direct_expr
from moetrace.report.analyse import RunAnalysis
from moetrace.report.contexts import from_steps_sentence
from moetrace.report.inputs import Run
from moetrace.report.measured import MIN_BASELINE_STEPS
from moetrace.report.options import Options
from moetrace.report.placements import held_out_verdict
from moetrace.report.windows import sample_note

RANDOM_WEIGHTS_NOTE = "routing of a random-weight model: says nothing about a trained model's routing"


def growth_overview(growth_table: pl.DataFrame) -> pl.DataFrame:
    """Per k, the mean over layers of each series: measured per request and per batch, counterfactual, the uniform
    bound, locality, and the per-rank view of the best per-request estimate (measured where recorded)."""
    series = (
        growth_table.group_by("k")
        .agg(
            *[
                pl.col("unique_experts").filter((pl.col("source") == source) & (pl.col("scope") == scope)).mean()
                .alias(name)
                for name, source, scope in (
                    ("measured_request", MEASURED, PER_REQUEST),
                    ("measured_batch", MEASURED, PER_BATCH),
                    ("counterfactual", COUNTERFACTUAL, PER_REQUEST),
                )
            ],
            pl.col("uniform_bound").drop_nulls().first(),
        )
    )
    best = (
        best_window_estimate(growth_table.lazy())
        .group_by("k")
        .agg(
            least_direct_expr("source").alias("source"),
            pl.col("unique_experts").mean().alias("best"),
            pl.col("busiest_rank_experts").mean(),
            pl.col("ranks_touched").mean(),
        )
        .collect()
    )
    return (
        series.join(best, on="k")
        .with_columns(locality=pl.col("best") / pl.col("uniform_bound"))
        .select(
            "k", "source", "measured_request", "measured_batch", "counterfactual", "uniform_bound", "locality",
            "busiest_rank_experts", "ranks_touched",
        )
        .sort("k")
    )


def acceptance_set_by(analysis: RunAnalysis) -> list[dict[str, Any]]:
    """Per recorded k > 0, who kept the drafts: ``synthetic`` (vLLM's synthetic rejection sampling, with the rates
    it was set to) or ``drafter`` (the target model's verdict on the drafter's tokens)."""
    return [{"k": trace.k, "set_by": trace.manifest.acceptance_set_by,
             "rates": list(trace.manifest.spec.synthetic_rates or [])}
            for trace in analysis.run.traces if trace.k > 0]


def synthetic_note(analysis: RunAnalysis) -> str | None:
    """The line a report whose acceptance was set, not drafted, carries beside its figures."""
    synthetic = [row for row in acceptance_set_by(analysis) if row["set_by"] == "synthetic"]
    if not synthetic:
        return None
    longest = max(synthetic, key=lambda row: row["k"])
    return (f"synthetic acceptance: at k = {', '.join(str(row['k']) for row in synthetic)} vLLM kept drafts at set "
            f"rates ({' / '.join(f'{rate:.2f}' for rate in longest['rates'])} by position), not by the target's "
            f"verdict: acceptance figures are those rates, no drafter's; speedups are what a drafter accepting so "
            f"would give")


def notes(analysis: RunAnalysis, k: int) -> list[str]:
    found = []
    if analysis.manifest.model.random_weights:
        found.append(RANDOM_WEIGHTS_NOTE)
    synthetic = synthetic_note(analysis)
    if synthetic is not None:
        found.append(synthetic)
    if analysis.run.primary.k < k and analysis.run.primary.lacks("request_identity"):
        found.append(f"its source does not say which tokens are one request: no windows of {k + 1} consecutive "
                     f"tokens, so no growth at k={k}; only the union of each step's batch is measured")
    elif analysis.run.primary.k < k:
        found.append(
            f"recorded at k={analysis.run.primary.k}: figures at k={k} are counterfactual "
            + ("(windows of accepted tokens, as many as each request-step's drafter proposed)"
               if analysis.run.primary.k > 0 else f"(windows of {k + 1} consecutive accepted tokens)")
        )
    if analysis.schedule_k is not None:
        found.append(f"k={analysis.schedule_k}: the engine chose each request-step's drafts (an adaptive schedule): "
                     "every fixed k is drawn from it as a run verifying all the drafts it proposes (estimated), the "
                     "schedule itself set beside that static table")
    one_in = analysis.manifest.capture.one_request_in
    if one_in > 1:
        found.append(f"routing of one request in {one_in} (steps and acceptance of all): a step's batch union is not "
                     "measured; what B requests read is estimated from the sampled requests' request-steps")
    source = analysis.manifest.source
    if source is not None:
        found.append(f"imported from {source.engine} ({source.format}): it holds {source.holds}; it has no "
                     + ", ".join(what.replace("_", " ") for what in source.lacks)
                     + (": no expert budgets" if analysis.run.primary.lacks("router_weights") else ""))
    if analysis.budget_source == COUNTERFACTUAL and len(analysis.budgets):
        found.append(f"budgets at k={max(k, 1)} use counterfactual windows of accepted tokens")
    sampled = sample_note(analysis.budget_share)
    if sampled is not None:
        found.append(sampled)
    if analysis.prediction_note is not None:
        found.append(analysis.prediction_note)
    if analysis.placement_note is not None:
        found.append(analysis.placement_note)
    if analysis.prediction_basis is not None and analysis.prediction_basis["allreduce_extrapolated"]:
        found.append(f"prediction: all-reduce time is {analysis.prediction_basis['allreduce']}")
    found += [f"k={k}: routing and steps disagree: {what}" for k, what in sorted(analysis.disagreements.items())]
    return found + analysis.checks


def prediction_section(analysis: RunAnalysis, k: int) -> dict[str, Any] | None:
    if analysis.prediction is None:
        return None
    at_k = analysis.prediction.filter(pl.col("k") == k).to_dicts()
    return {"basis": analysis.prediction_basis, "at_k": at_k[0] if at_k else None,
            "per_k": analysis.prediction.to_dicts(),
            "per_batch": analysis.speedups.to_dicts() if analysis.speedups is not None else [],
            "against_trace": analysis.against_trace.to_dicts() if analysis.against_trace is not None else []}


def budget_section(analysis: RunAnalysis, coverage: float) -> dict[str, Any]:
    chosen = analysis.budgets
    budgets = chosen["budget"]
    return {
        "k": max(analysis.k, 1),
        "source": analysis.budget_source,
        "coverage_target": coverage,
        "min_budget": int(budgets.min()) if len(budgets) else None,  # type: ignore[arg-type]
        "median_budget": float(budgets.median()) if len(budgets) else None,  # type: ignore[arg-type]
        "max_budget": int(budgets.max()) if len(budgets) else None,  # type: ignore[arg-type]
        # per verification window, over the model's MoE layers (mean per recorded layer × MoE layers)
        "bytes_saved_per_window": float(saved) * analysis.shape.moe_layers  # type: ignore[arg-type]
        if (saved := chosen["bytes_saved"].mean()) is not None
        else None,
        "per_layer": chosen.to_dicts(),
    }


def decision_section(analysis: RunAnalysis, options: Options) -> dict[str, Any] | None:
    """Per concurrency: the recommended k, its predicted speedup, what it rests on, and the expert budget per
    request window at that k (experts and bytes it saves, priced at the prediction's shape)."""
    if analysis.decision is None:
        return None
    basis = analysis.prediction_basis or {"preset": options.preset.label if options.preset else None,
                                          "calibration": None, "shape": "manifest"}
    rows = []
    for row in analysis.decision.to_dicts():
        budget = None
        if row["k"] is not None and row["k"] >= 1:
            chosen = smallest_budgets(analysis.budget_curves.filter(pl.col("k") == row["k"]).drop("k").lazy(),
                                      options.coverage)
            saved = float(chosen["experts_saved"].mean()) if len(chosen) else 0.0  # type: ignore[arg-type]
            budget = {
                "median": float(chosen["budget"].median()) if len(chosen) else None,  # type: ignore[arg-type]
                "experts_saved_per_layer": saved,
                "bytes_saved_per_window": saved * basis["expert_bytes"] * basis["moe_layers"],
                "shape": basis["shape"],
                "source": MEASURED if analysis.run.primary.k == row["k"] else COUNTERFACTUAL,
            }
        rows.append({**row, "budget": budget})
    return {
        "drafter": analysis.manifest.spec.method or "none",
        "label": analysis.run.label,
        "acceptance": (f"given {options.acceptance:g} per draft" if options.acceptance is not None
                       else "synthetic" if synthetic_note(analysis) is not None else "measured"),
        "based_on": basis["preset"] or " + ".join(
            part for part in (basis["calibration"], basis.get("profile")) if part),
        "coverage_target": options.coverage,
        "shape": basis["shape"] if basis["shape"] != "manifest" else f"{analysis.manifest.model.name} "
                                                                      "(as recorded)",
        "per_batch": rows,
        "policies": None if analysis.policies is None else {
            "rows": analysis.policies.rows.to_dicts(), "verdict": analysis.policies.verdict,
            "trace_k": analysis.policies.trace_k},
        "crossover": None if analysis.crossovers is None else {
            kind: None if found is None else {**found, "says": crossover_sentence(found)}
            for kind, found in analysis.crossovers.items()},
        "context": recorded_context(analysis.by_context.get("acceptance")),
        "by_context": None if analysis.context_decision is None else {  # --context (report.contexts)
            "recorded_context": analysis.context_decision.recorded_context,
            "attention_basis": analysis.context_decision.attention_basis,
            "per_batch": analysis.context_decision.rows.to_dicts(),
            "speedups": analysis.context_decision.speedups.to_dicts(),  # every k the decision chose from
            "from_steps": [{"context": context, **found, "says": from_steps_sentence(context, found)}
                           for context, found in analysis.context_decision.from_steps.items()],
            "crossover": [{"context": context, **found, "says": crossover_sentence(found)}
                          for context, found in analysis.context_decision.crossovers.items()]},
        "held_out_cells": basis.get("held_out_cells"),  # behind each speedup's interval (analysis.uncertainty)
        "held_out_coverage": basis.get("held_out_coverage"),
        "held_out_basis": basis.get("held_out_basis"),  # which cells, and how the intervals widen past recorded B
    }


def schedule_section(analysis: RunAnalysis) -> dict[str, Any] | None:
    """An adaptive schedule's trace (``analysis.adaptive``): per concurrency it ran at, what it did beside the static
    table predicted from it, and which pays more in words; None without one."""
    if analysis.schedule is None:
        return None
    rows = analysis.schedule.to_dicts()
    verdict = schedule_verdict(rows) or [f"not compared: the schedule ran {MIN_BASELINE_STEPS} or more pairs of "
                                         "consecutive decode steps at no concurrency: nothing to measure it at"]
    return {"trace_k": analysis.schedule_k, "rows": rows, "verdict": verdict}


def crossover_sentence(found: dict[str, Any]) -> str:
    """``analysis.decision.crossover``'s finding in words, as the terminal and the dashboard show it."""
    best = {row["batch"]: row for row in found["best"]}

    def at(batch: int) -> str:
        return f"k={best[batch]['k']} {best[batch]['speedup']:.2f}x at {batch}"

    kind, paying, none_pays = found["kind"], found["paying"], found["none_pays"]
    if found["status"] == "crosses":
        return (f"{kind}: no k pays above about {found['batch']:.0f} requests per step ({at(paying)}, "
                f"best {at(none_pays)}; interpolated)")
    if found["status"] == "pays throughout":
        return f"{kind}: a k pays at every B looked at, up to {paying} ({at(paying)})"
    if found["status"] == "never pays":
        return f"{kind}: no k pays at any B looked at, from {none_pays} (best {at(none_pays)})"
    return f"{found['kind']}: no speedup to find a crossover in"


def report_payload(analyses: list[RunAnalysis], options: Options) -> dict[str, Any]:
    """The payload: everything `--json`, the terminal and the dashboard show, as plain JSON-able data."""
    k = options.k
    runs = []
    for analysis in analyses:
        overview = growth_overview(analysis.growth)
        bytes_at_k = analysis.step_bytes.filter(pl.col("k") == k).to_dicts()
        runs.append(
            {
                "label": analysis.run.label,
                "path": str(analysis.run.path),
                "model": str(analysis.manifest.model.name),
                "random_weights": analysis.manifest.model.random_weights,
                "spec_method": analysis.manifest.spec.method,
                "recorded_k": [trace.k for trace in analysis.run.traces],
                "primary_k": analysis.run.primary.k,
                "source_at_k": analysis.source_at_k,
                "shape": options.shape_preset or f"{analysis.manifest.model.name} (as recorded)",
                "tp": analysis.tp,
                "ep": analysis.ep,
                "notes": notes(analysis, k),
                "placement": None if analysis.placements is None else {
                    "ep": analysis.ep, "rows": analysis.placements.to_dicts(),
                    "verdict": held_out_verdict(analysis.placements)},
                "growth_at_k": next(iter(overview.filter(pl.col("k") == k).to_dicts()), None),
                "growth_overview": overview.to_dicts(),
                "bytes_at_k": bytes_at_k[0] if bytes_at_k else None,
                "acceptance_per_k": analysis.acceptance_per_k.to_dicts(),
                "acceptance_set_by": acceptance_set_by(analysis),
                "step_reads": analysis.unions.to_dicts(),
                "checks": analysis.checks,
                "disagreements": {str(k): what for k, what in analysis.disagreements.items()},
                "acceptance_by_position": analysis.acceptance_by_position.to_dicts(),
                "by_context": {"k": analysis.run.primary.k, "share": analysis.by_context_share,
                               **{name: table.to_dicts() for name, table in analysis.by_context.items()}},
                "rejected_only": analysis.rejected_only.to_dicts(),
                "adaptive_schedule": schedule_section(analysis),
                "budget": budget_section(analysis, options.coverage),
                "prediction": prediction_section(analysis, k),
                "growth": analysis.growth.to_dicts(),
                "step_bytes": analysis.step_bytes.to_dicts(),
                **dashboard_data(analysis),
            }
        )
    decisions = [decision for decision in (decision_section(a, options) for a in analyses) if decision]
    # what the reader met (a file skipped as corrupt, a recording that did not close) comes first: every figure
    # below stands on the files it could read
    warnings = [f"{analysis.run.label}: {line}" for analysis in analyses
                for line in [*analysis.run.warnings,
                             *(f"k={k}: routing and steps disagree: {what}"
                               for k, what in sorted(analysis.disagreements.items())), *analysis.checks]]
    unrecommended: dict[tuple[str, str], list[str]] = {}  # one line per reason, naming every concurrency it holds at
    for decision in decisions:
        for row in decision["per_batch"]:
            if row["status"] != "ok":
                unrecommended.setdefault((decision["label"], row["status"]), []).append(str(row["batch"]))
    warnings += [f"{label}: no recommendation at {', '.join(batches)} request(s) per step: {status}"
                 for (label, status), batches in unrecommended.items()]
    return {"decision": decisions, "warnings": warnings, "k": k, "coverage_target": options.coverage, "runs": runs}


# What a budget keeps (routing weight), costs (tokens whose experts it leaves out re-route) and saves (expert bytes
# per window and layer): the budget curves' columns the dashboard's budget frontier plots
FRONTIER_COLUMNS = ("coverage", "rerouted_share", "bytes_saved")


def budget_frontier(curves: pl.LazyFrame) -> pl.DataFrame:
    """Per (k, budget), the budget curves' ``FRONTIER_COLUMNS`` averaged over layers, at every budget from 1 to the
    largest any layer's curve reaches. A layer's curve ends at the budget that keeps every expert its windows read,
    so past its end it is held at its last values (a larger budget keeps, costs and saves the same); averaging only
    the layers whose curves reach a budget would let the few layers that read the most experts stand for all."""
    columns = list(FRONTIER_COLUMNS)
    budgets = (curves.group_by("k").agg(pl.int_range(1, pl.col("budget").max() + 1, dtype=pl.Int64).alias("budget"))
               .explode("budget"))
    held = (
        budgets.join(curves.select("k", "layer").unique(), on="k")
        .join(curves.select("k", "layer", "budget", *columns), on=["k", "layer", "budget"], how="left")
        .sort("k", "layer", "budget")
        .with_columns(pl.col(columns).forward_fill().over("k", "layer"))
        .sort("k", "budget", "layer")
        .collect()
    )
    # summed by numpy in layer order: a float sum depends on its order, and Polars' parallel group-by changes it
    # with the thread count (the Ray report must equal the one-machine one to the last digit)
    groups = held.group_by("k", "budget", maintain_order=True).len()
    starts = np.concatenate([[0], np.cumsum(groups["len"].to_numpy())[:-1]]).astype(np.int64)
    if not held.height:
        return groups.drop("len").with_columns(pl.lit(None, pl.Float64).alias(column) for column in columns)
    counts = groups["len"].to_numpy()
    return groups.drop("len").with_columns(
        pl.Series(column, np.add.reduceat(held[column].cast(pl.Float64).to_numpy(), starts) / counts,
                  dtype=pl.Float64).fill_nan(None) for column in columns)


def dashboard_data(analysis: RunAnalysis) -> dict[str, Any]:
    """What the dashboard plots beyond the terminal's figures, as plain lists: the recorded MoE ``layers``, the
    ``expert_load`` matrix (picks per expert, one row per layer of ``layers``), the ``budget_curves`` per k and
    layer (what each budget keeps, costs and saves: ``FRONTIER_COLUMNS``, with the source of the windows: measured
    at the recorded k, else counterfactual) and, per k, their ``budget_frontier`` over all layers."""
    layers = sorted({int(layer) for layer in [*analysis.growth["layer"].to_list(), *analysis.load["layer"].to_list()]})
    row_of = {layer: row for row, layer in enumerate(layers)}
    load = [[0] * analysis.shape.num_experts for _ in layers]
    for layer, expert, picks in analysis.load.select("layer", "expert", "picks").iter_rows():
        load[row_of[int(layer)]][int(expert)] = int(picks)
    windows_source = (pl.when(pl.col("k") == analysis.run.primary.k).then(pl.lit(MEASURED))
                      .otherwise(pl.lit(COUNTERFACTUAL)).alias("source"))
    curves = (
        analysis.budget_curves.sort("k", "layer", "budget")
        .group_by("k", "layer", maintain_order=True)
        .agg("budget", *FRONTIER_COLUMNS)
        .with_columns(windows_source)
    )
    frontier = (budget_frontier(analysis.budget_curves.lazy())
                .group_by("k", maintain_order=True).agg("budget", *FRONTIER_COLUMNS).with_columns(windows_source))
    return {"layers": layers, "expert_load": load, "budget_curves": curves.to_dicts(),
            "budget_frontier": frontier.to_dicts()}


def budget_file(run: Run, k: int, coverage: float, shape: ModelShape, curves: pl.DataFrame,
                share: float) -> dict[str, Any]:
    """``moetrace budget``'s file: the smallest budget per layer whose experts keep ``coverage`` of the routing
    weight in the windows of ``k`` + 1 tokens of ``curves`` (the primary trace's budget curves at ``k``, computed
    from ``share`` of its windows), bytes priced at ``shape``'s where it can price them."""
    chosen = smallest_budgets(curves.lazy(), coverage)
    said = [note for note in (sample_note(share), shape.unpriced_note()) if note is not None]
    return {
        "schema": "moetrace-budget/1",
        "trace": str(run.primary.path),
        "k": k,
        "source": MEASURED if run.primary.k == k else COUNTERFACTUAL,
        "coverage_target": coverage,
        "expert_bytes": None if shape.unpriced_format is not None else shape.expert_bytes,
        "budgets": {str(row["layer"]): row["budget"] for row in chosen.to_dicts()},
        "per_layer": chosen.to_dicts(),
        "window_share": share,
        "warnings": run.warnings + said,
    }
