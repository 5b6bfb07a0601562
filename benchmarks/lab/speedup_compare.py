"""``bench_speedup_validation.py compare``: predicted against measured speedup from a measure directory, in steps.
Each measurements file is a ``Run``; per drafter, ``predict`` runs ``moetrace report`` on its sweep as a user does,
``cell_rows`` sets each (concurrency, k) predicted beside measured, ``k0_rows`` the k = 0 step, ``decision_rows`` the
recommended k beside the measured best; ``show_*`` print them."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedup_load import LOAD
from speedup_predicted import in_span, moved_with, predicted_rows, recommended, report_json
from speedup_traces import (
    TIMED_RECORDED_TOLERANCE,
    acceptance_against_counters,
    held_out_sweep,
    longest_output,
    measured_best,
    ratio_ci95,
    recorded_rounds,
    recorded_spans,
    timed_over_recorded,
    span_prefill_shares,
)


@dataclass
class Run:
    """One measure directory's measurements file, as ``compare`` predicts it: its engines (those that measured), the
    k = 0 baseline and the sync one, and the traces that predict (``source``: this run's, or with ``--moved-from``
    another's moved to this run's ``context``)."""

    runs: Path
    doc: dict[str, Any]
    engines: list[dict[str, Any]]
    baseline: dict[str, Any]
    sync: dict[str, Any] | None
    calibration: Path
    source: Path
    source_engines: list[dict[str, Any]]
    context: int | None
    spans: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return str(self.doc["model"])

    @property
    def timed(self) -> list[int]:
        return [int(c) for c in self.doc["timed"]]

    @property
    def recorded(self) -> list[int]:
        return [int(c) for c in self.doc["recorded"]]

    @property
    def source_baseline(self) -> dict[str, Any]:
        return next(e for e in self.source_engines if e["k"] == 0 and e["method"] != "sync")

    @property
    def source_sync(self) -> dict[str, Any] | None:
        return next((e for e in self.source_engines if e["method"] == "sync"), None)

    def wall(self, engine: dict[str, Any]) -> dict[int, tuple[float, float]]:
        """The engine's recorded rounds' own spans (``recorded_spans``), read once per trace."""
        if engine["trace"] not in self.spans:
            self.spans[engine["trace"]] = recorded_spans(
                self.runs / engine["trace"], self.doc["max_tokens"], tuple(self.doc["lengths"]),
                recorded_rounds(engine), self.recorded)
        return self.spans[engine["trace"]]


def open_run(runs: Path, path: Path, moved_from: Path | None) -> Run | None:
    """The measurements file at ``path`` as a ``Run``, or None (and why, printed) where it holds nothing to predict."""
    doc = json.loads(path.read_text())
    model = doc["model"]
    engines = [e for e in doc["engines"] if "tok_s" in e]
    if doc.get("hooks_ab"):  # no prediction to check: paused against recording rounds of the same engine
        for engine in engines:
            print(f"{model} {engine['method']} k={engine['k']}, hooks paused / on, median tok/s: " + ", ".join(
                f"B={c} {statistics.median(v):.0f} / {statistics.median(engine['hooks_on_tok_s'][c]):.0f}"
                for c, v in engine["tok_s"].items()))
        return None
    calibration = runs / f"calibration-{model}.json"
    baseline = next((e for e in engines if e["k"] == 0 and e["method"] != "sync"), None)
    if doc.get("load") != LOAD:
        print(f"{model}: measured before the {LOAD} load: skipped")
        return None
    if baseline is None or not calibration.exists():
        print(f"{model}: no k=0 engine or no {calibration.name}: skipped")
        return None
    source, source_engines, context = runs, engines, None
    if moved_from is not None:
        context = doc.get("prompt_tokens")
        if context is None or not (moved_from / path.name).exists():
            print(f"{model}: no --prompt-tokens to move to, or no {path.name} in {moved_from}: skipped")
            return None
        source = moved_from
        source_engines = [e for e in json.loads((source / path.name).read_text())["engines"] if "tok_s" in e]
    return Run(runs, doc, engines, baseline, next((e for e in engines if e["method"] == "sync"), None), calibration,
               source, source_engines, context)


def model_facts(run: Run) -> dict[str, Any]:
    """What the comparison says of the run as a whole: where and how it measured, and k = 0 with async off."""
    doc, sync, baseline = run.doc, run.sync, run.baseline
    return {
        "device": doc["device"], "vllm_version": doc["vllm_version"], "tp": doc.get("tp", 1),
        "command": doc["command"], "calibration": run.calibration.name, "load": doc["load"], "timed": run.timed,
        "recorded": run.recorded, "max_num_seqs": doc["max_num_seqs"], "requests": doc["requests"],
        "failed_engines": [f"{e['method']} k={e['k']}: {e['error']}" for e in doc["engines"] if "error" in e],
        "async_off_k0": None if sync is None else {
            c: ratio_ci95(sync["tok_s"][c], baseline["tok_s"][c])[0] for c in sync["tok_s"]},
        "timed_over_recorded": timed_over_recorded(run.engines),
        "predicted_from": None if run.context is None else f"{run.source} moved by --context {run.context}",
    }


@dataclass
class Predicted:
    """One drafter's prediction by the report from the run's sweep: its rows and check by (concurrency, k), its
    decision by concurrency, the rows from the run's own traces where moved (``own``), the timed span's prefill
    share per k and concurrency, and the k = 0 trace with async scheduling off it used (None: not drafted so)."""

    sweep: Path
    k0_sync: Path | None
    drafted_sync: bool
    basis: str | None
    rows: dict[tuple[int, int], Any]
    checked: dict[tuple[int, int], Any]
    chosen: dict[int, dict[str, Any]]
    own: dict[tuple[int, int], Any]
    span_shares: dict[int, dict[int, float]]


def asynchronous(source: Path, engine: dict[str, Any]) -> bool:
    """Whether vLLM ran the engine with async scheduling (vLLM 0.26 drafts n-gram with it off, MTP and EAGLE-3
    with it on: the manifests say)."""
    manifest = json.loads((source / engine["trace"] / "manifest.json").read_text())
    return bool(manifest["capture"].get("async_scheduling", True))


def predict(run: Run, method: str, scratch: Path) -> Predicted:
    """``moetrace report`` on the sweep of ``method`` (the shared k = 0 baseline joined to it), as a user runs it."""
    source, source_engines = run.source, run.source_engines
    sweep = (source / next(e["trace"] for e in source_engines if e["method"] == method)).parent
    if not (sweep / "k0").exists():  # k = 0 runs no drafter: the shared baseline joins each sweep
        (sweep / "k0").symlink_to(Path("..") / Path(run.source_baseline["trace"]))
    drafted_sync = not asynchronous(source, next(e for e in source_engines if e["method"] == method and e["k"] > 0))
    source_sync = run.source_sync
    k0_sync = (source / source_sync["trace"]
               if source_sync is not None and drafted_sync and asynchronous(source, run.source_baseline) else None)
    report = report_json(sweep, run.calibration, scratch, k0_sync, run.timed, run.context)
    basis = (report["runs"][0]["prediction"]["basis"]["mode"]
             if report is not None and report["runs"][0]["prediction"] is not None else None)
    rows, checked = predicted_rows(report, run.context)
    own: dict[tuple[int, int], Any] = {}
    if run.context is not None:  # what the move keeps as recorded, as this run's own traces measured it
        own_sweep = (run.runs / next(e["trace"] for e in run.engines if e["method"] == method)).parent
        if not (own_sweep / "k0").exists():
            (own_sweep / "k0").symlink_to(Path("..") / Path(run.baseline["trace"]))
        own_sync = run.runs / run.sync["trace"] if run.sync is not None and drafted_sync else None
        own, _ = predicted_rows(report_json(own_sweep, run.calibration, scratch, own_sync, run.timed))
    # the span a timed round measures holds fewer prefills per token than the whole rounds a trace pools its
    # prefill over (``span_prefill_share``): each prediction also in that span
    longest = longest_output(source / run.source_baseline["trace"])
    span_engines = [run.source_baseline, *(e for e in source_engines if e["method"] == method and e["k"] > 0)]
    shares = {e["k"]: span_prefill_shares(source / e["trace"], longest, sorted({*run.timed, *run.recorded}),
                                            run.doc["max_tokens"], tuple(run.doc["lengths"]))
              for e in span_engines}
    return Predicted(sweep, k0_sync, drafted_sync, basis, rows, checked, recommended(report, run.context), own,
                     shares)


def span_check(run: Run, method: str, predicted: Predicted) -> dict[str, Any]:
    """Per k and recorded concurrency: the timed span's prefill share as simulated beside the recorded rounds'."""
    engines = [run.source_baseline, *(e for e in run.source_engines if e["method"] == method and e["k"] > 0)]
    return {str(e["k"]): {str(c): {"simulated": predicted.span_shares[e["k"]][c], "recorded": share}
                          for c, (_, share) in run.wall(e).items()} for e in engines}


def cell_rows(run: Run, method: str, predicted: Predicted, scratch: Path) -> list[dict[str, Any]]:
    """Per drafted engine of ``method`` and timed concurrency: the predicted speedup beside the measured one, with
    the report's check against the recorded steps and the terms that explain a miss."""
    rows: list[dict[str, Any]] = []
    shares, by_key = predicted.span_shares, predicted.rows
    for engine in (e for e in run.engines if e["method"] == method and e["k"] > 0):
        held_out, _ = predicted_rows(report_json(held_out_sweep(predicted.sweep, engine["k"], scratch),
                                                 run.calibration, scratch, predicted.k0_sync, run.timed, run.context),
                                     run.context)
        for concurrency in run.timed:
            key, at_recorded = (concurrency, engine["k"]), concurrency in run.recorded
            measured, interval = ratio_ci95(engine["tok_s"][str(concurrency)], run.baseline["tok_s"][str(concurrency)])
            row, trace, row0 = by_key.get(key), predicted.checked.get(key, {}), by_key.get((concurrency, 0))
            span_speedup = (in_span(row, row0, shares[engine["k"]][concurrency], shares[0][concurrency])
                            if row and row0 and engine["k"] in shares else None)
            own, own0 = predicted.own.get(key), predicted.own.get((concurrency, 0))
            rows.append({
                "model": run.model, "drafter": method, "concurrency": concurrency, "k": engine["k"],
                # who kept the drafts: vLLM's synthetic rejection sampling at set rates, or the drafter
                "acceptance": "synthetic" if run.doc.get("synthetic_acceptance") else "drafter",
                # predicted at a concurrency no trace recorded: from the recorded ones alone
                "held_out_concurrency": not at_recorded,
                "predicted_speedup": row["speedup"] if row else None,
                "measured_speedup": measured, "measured_ci95": interval,
                "error": (row["speedup"] - measured) / measured if row else None,
                # predicted with the prefill scaled to the timed span (its "window_" keys: as the committed
                # results files name them)
                "window_predicted_speedup": span_speedup,
                "window_error": (span_speedup - measured) / measured if span_speedup else None,
                # predicted with this k's own timing of vLLM's calls left out (held_out_sweep)
                "held_out_predicted_speedup": held_out[key]["speedup"] if key in held_out else None,
                "held_out_error": (held_out[key]["speedup"] - measured) / measured if key in held_out else None,
                "trace_measured_speedup": trace.get("measured_speedup"),
                "trace_wall_speedup": (run.wall(engine)[concurrency][0] / run.wall(run.baseline)[concurrency][0]
                                       if at_recorded else None),
                "trace_tokens_per_step": trace.get("measured_tokens_per_step"),
                "trace_step_ms": trace.get("measured_step_ms"),
                "predicted_step_ms": row["step_ms"] if row else None,
                "unexplained_ms_per_step": trace.get("unexplained_ms"),
                # where the recorded step grew against k = 0 (ms per step)
                "trace_step_growth_ms": trace.get("step_growth_ms"),
                "predicted_moe_growth_ms": (row["moe_ms"] + row["allreduce_ms"] - row0["moe_ms"]
                                            - row0["allreduce_ms"]) if row and row0 else None,
                "trace_forward_growth_ms": trace.get("forward_growth_ms"),
                "trace_sampling_growth_ms": trace.get("sampling_growth_ms"),
                "trace_drafting_ms": trace.get("drafting_ms"),
                "async_off_growth_ms": row.get("scheduling_ms") if row else None,  # --k0-sync's term
                # --moved-from: the moved steps with this run's own prefill, then also its acceptance
                **({"moved_with_own_prefill_speedup": moved_with(row, row0, own, own0, acceptance=False),
                    "moved_with_own_prefill_and_acceptance_speedup": moved_with(row, row0, own, own0,
                                                                                acceptance=True)}
                   if row and row0 and own and own0 else {}),
                "command": run.doc["command"],
            })
    return rows


def k0_rows(run: Run, predicted: Predicted) -> dict[str, dict[str, Any]]:
    """Per timed concurrency, the k = 0 step: the time per token the report predicts beside what the k = 0 engine
    ran, also with the prefill scaled to the timed span."""
    out: dict[str, dict[str, Any]] = {}
    for concurrency in run.timed:
        row0 = predicted.rows.get((concurrency, 0))
        ran = concurrency / statistics.median(run.baseline["tok_s"][str(concurrency)]) * 1e3
        share = predicted.span_shares[0][concurrency]
        prefill = (row0["prefill_ms_per_token"] or 0.0) if row0 else 0.0
        estimate = row0["step_ms"] + prefill if row0 else None
        in_its_span = row0["step_ms"] + share * prefill if row0 else None
        out[str(concurrency)] = {
            "predicted": estimate, "measured": ran, "step_source": row0["step_source"] if row0 else None,
            "error": (estimate - ran) / ran if estimate is not None else None,
            "window_prefill_share": share, "window_predicted": in_its_span,  # keys: the timed span's
            "window_error": (in_its_span - ran) / ran if in_its_span is not None else None}
    return out


def decision_rows(run: Run, method: str, predicted: Predicted) -> list[dict[str, Any]]:
    """Per timed concurrency, the measured best k beside the one the report recommends."""
    drafted = [e for e in run.engines if e["method"] == method and e["k"] > 0]
    decisions = []
    for concurrency in run.timed:
        base = run.baseline["tok_s"][str(concurrency)]
        speedups = {0: ratio_ci95(base, base),
                    **{e["k"]: ratio_ci95(e["tok_s"][str(concurrency)], base) for e in drafted}}
        best = measured_best(speedups)
        decision = predicted.chosen.get(concurrency)
        pick = decision["k"] if decision else None
        pick_measured = speedups[pick][0] if pick in speedups else None
        low, high = speedups[best][1]
        decisions.append({
            "model": run.model, "drafter": method, "concurrency": concurrency,
            "held_out_concurrency": concurrency not in run.recorded,
            "predicted": any(b == concurrency for b, _ in predicted.rows) or decision is not None,
            "measured_best_k": best, "measured_best_speedup": speedups[best][0],
            "measured_best_ci95": speedups[best][1],
            "recommended_k": pick, "recommended_status": decision["status"] if decision else None,
            # the recommended k is the largest the traces let the report price: a larger may pay more
            "recommended_at_sweep_edge": bool(decision.get("k_at_sweep_edge")) if decision else None,
            "recommended_predicted_speedup": decision.get("speedup") if decision else None,
            "recommended_measured_speedup": pick_measured,
            "recommended_within_best_ci95": low <= pick_measured <= high if pick_measured is not None else None,
        })
    return decisions


def compare(args: argparse.Namespace) -> None:
    """Predicted and measured speedup per (model, drafter, timed concurrency, k): throughput with the hooks paused,
    the report's own check against the recorded decode steps (with the per-step time the prediction leaves out)
    where the concurrency was recorded, and per concurrency the measured best k beside the report's recommended k."""
    rows: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for path in sorted(args.runs.glob("*-measurements.json")):
            run = open_run(args.runs, path, args.moved_from)
            if run is None:
                continue
            facts = models[run.model] = model_facts(run)
            for method in dict.fromkeys(e["method"] for e in run.engines if e["k"] > 0 and e["method"] != "sync"):
                predicted = predict(run, method, Path(scratch))
                if predicted.basis is not None:
                    facts.setdefault("prediction_basis", {})[method] = predicted.basis
                if run.context is None:  # the simulation against the recorded rounds' own spans
                    facts.setdefault("window_prefill_share", {})[method] = span_check(run, method, predicted)
                for engine in (e for e in run.engines if e["method"] == method and e["k"] > 0):
                    facts.setdefault("acceptance", {}).setdefault(method, {})[str(engine["k"])] = (
                        acceptance_against_counters(run.runs / engine["trace"], run.doc.get("synthetic_acceptance")))
                rows += cell_rows(run, method, predicted, Path(scratch))
                if predicted.drafted_sync and predicted.k0_sync is None:
                    facts.setdefault("missing", []).append(
                        f"{method}: drafted with async scheduling off, but no k=0 trace ran that way (--sync-baseline):"
                        f" its predictions leave out what that switch costs a step")
                facts["k0_ms_per_token"] = k0_rows(run, predicted)
                decisions += decision_rows(run, method, predicted)
    show_table(rows)
    show_facts(models)
    show_decisions(rows, decisions)
    if args.json is not None:
        args.json.write_text(json.dumps({"models": models, "rows": rows, "decisions": decisions,
                                         **largest_errors(rows)}, indent=2) + "\n")


def show_facts(models: dict[str, Any]) -> None:
    """What each run says beside its cells: the move, k = 0 with async off, noisy timings, failed engines, the
    timed span's prefill share and the k = 0 step predicted against ran."""
    for model, facts in models.items():
        if facts["predicted_from"]:
            print(f"{model}: predicted from {facts['predicted_from']} (every cell held out from its context)")
        if facts["async_off_k0"]:
            print(f"{model}: k=0 with async scheduling off / on: "
                  + ", ".join(f"B={c} {v:.3f}" for c, v in facts["async_off_k0"].items()))
        for engine, ratios in facts["timed_over_recorded"].items():
            for c, ratio in ratios.items():
                if abs(ratio - 1.0) > TIMED_RECORDED_TOLERANCE:
                    print(f"{model}: {engine} at {c}: timed rounds at {ratio:.2f}x the recorded rounds' throughput "
                          f"(hooks paused vs on): the timing there is noisier than the check it serves; more rounds")
        for failed in facts["failed_engines"]:
            print(f"{model}: engine failed: {failed}")
        for missing in facts.get("missing", []):
            print(f"{model}: {missing}")
        for method, per_k in facts.get("window_prefill_share", {}).items():
            print(f"{model} {method}: prefills per token in the timed span over a whole round's, simulated / in the "
                  "recorded rounds: " + "; ".join(f"k={k} " + ", ".join(
                      f"B={c} {v['simulated']:.3f} / {v['recorded']:.3f}" for c, v in at.items())
                      for k, at in per_k.items()))
        print(f"{model}: k=0 ms per token, predicted / in the timed span / ran (errors): " + ", ".join(
            f"B={c} " + (f"{v['predicted']:.3f} / {v['window_predicted']:.3f} / {v['measured']:.3f} "
                         f"({100 * v['error']:+.1f}%, {100 * v['window_error']:+.1f}%)"
                         if v["predicted"] is not None else f"- / - / {v['measured']:.3f}")
            for c, v in facts.get("k0_ms_per_token", {}).items()))


def show_decisions(rows: list[dict[str, Any]], decisions: list[dict[str, Any]]) -> None:
    """The moved cells' terms, each concurrency's measured best k beside the recommended one, and the largest
    errors."""
    for r in rows:
        if "moved_with_own_prefill_speedup" in r:
            print(f"{r['model']} {r['drafter']} B={r['concurrency']} k={r['k']}: moved {r['predicted_speedup']:.2f}, "
                  f"with this run's own prefill {r['moved_with_own_prefill_speedup']:.2f}, and its acceptance "
                  f"{r['moved_with_own_prefill_and_acceptance_speedup']:.2f}; measured {r['measured_speedup']:.2f}")
    for d in decisions:
        where = f"{d['model']} {d['drafter']} B={d['concurrency']}{' (held out)' if d['held_out_concurrency'] else ''}"
        best = (f"measured best k={d['measured_best_k']} ({d['measured_best_speedup']:.2f}, "
                f"95% {d['measured_best_ci95'][0]:.2f}-{d['measured_best_ci95'][1]:.2f})")
        if not d["predicted"]:
            print(f"{where}: {best}; no prediction")
        elif d["recommended_k"] is None:
            print(f"{where}: {best}; report recommends none: {d['recommended_status']}")
        else:
            measured, predicted = d["recommended_measured_speedup"], d["recommended_predicted_speedup"]
            verdict = ("not measured" if measured is None else f"measured {measured:.2f}, "
                       + ("within" if d["recommended_within_best_ci95"] else "outside") + " the best's interval")
            print(f"{where}: {best}; report recommends k={d['recommended_k']}"
                  + ("+ (the largest k it priced)" if d.get("recommended_at_sweep_edge") else "")
                  + (f" (predicted {predicted:.2f})" if predicted is not None else "") + f": {verdict}")
    errors = largest_errors(rows)
    recorded, held, unrecorded = (errors["largest_error"], errors["largest_held_out_error"],
                                  errors["largest_held_out_concurrency_error"])
    if recorded is not None or unrecorded is not None:
        print("largest |predicted − measured| / measured: "
              + (f"{100 * recorded:.1f}% at recorded concurrencies" if recorded is not None
                 else "none at recorded concurrencies")
              + (f"; with each k's own timing held out: {100 * held:.1f}%" if held is not None else "")
              + (f"; {100 * unrecorded:.1f}% at held-out concurrencies" if unrecorded is not None else
                 "; no prediction at held-out concurrencies"))


def largest_errors(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The largest |error| at recorded concurrencies, with each k's own timing held out, and at held-out ones."""
    def largest(column: str, held_out_concurrency: bool) -> float | None:
        errors = [abs(r[column]) for r in rows
                  if r[column] is not None and r["held_out_concurrency"] == held_out_concurrency]
        return max(errors) if errors else None

    return {"largest_error": largest("error", False),  # at recorded concurrencies
            "largest_held_out_error": largest("held_out_error", False),  # k's own timing held out
            "largest_held_out_concurrency_error": largest("error", True)}


def show_table(rows: list[dict[str, Any]]) -> None:
    """The comparison rows as a table (``*`` after B: a held-out concurrency, predicted without its trace)."""

    def show(value: float | None, width: int, digits: int = 2) -> str:
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    print(f"{'model':<12} {'drafter':<6} {'B':>4} {'k':>2} {'predicted':>9} {'measured':>8} {'95% interval':>13} "
          f"{'error':>6} {'span':>6} {'error':>6} {'held out':>8} {'error':>6} {'wall ×':>6} {'trace ×':>7} "
          f"{'step ms':>7} {'missing ms':>10} "
          f"{'grew':>6} {'fwd':>6} {'moe':>6} "
          f"{'sample':>6} {'draft':>6} {'async':>6}")
    for r in rows:
        error = 100 * r["error"] if r["error"] is not None else None
        held_error = 100 * r["held_out_error"] if r["held_out_error"] is not None else None
        span_error = 100 * r["window_error"] if r["window_error"] is not None else None
        batch = f"{r['concurrency']}{'*' if r['held_out_concurrency'] else ''}"
        print(f"{r['model']:<12} {r['drafter']:<6} {batch:>4} {r['k']:>2} "
              f"{show(r['predicted_speedup'], 9)} {show(r['measured_speedup'], 8)} "
              f"{r['measured_ci95'][0]:>6.2f}-{r['measured_ci95'][1]:<6.2f} {show(error, 5, 0)}% "
              f"{show(r['window_predicted_speedup'], 6)} {show(span_error, 5, 0)}% "
              f"{show(r['held_out_predicted_speedup'], 8)} {show(held_error, 5, 0)}% "
              f"{show(r['trace_wall_speedup'], 6)} "
              f"{show(r['trace_measured_speedup'], 7)} {show(r['trace_step_ms'], 7)} "
              f"{show(r['unexplained_ms_per_step'], 10)} {show(r['trace_step_growth_ms'], 6)} "
              f"{show(r['trace_forward_growth_ms'], 6)} {show(r['predicted_moe_growth_ms'], 6)} "
              f"{show(r['trace_sampling_growth_ms'], 6)} "
              f"{show(r['trace_drafting_ms'], 6)} {show(r['async_off_growth_ms'], 6)}")
