"""The report in the terminal, drawn from its payload alone (``payload.report_payload``): the decision first, then
rich tables of growth, bytes, acceptance and budgets, one set per TRACE argument, and a side-by-side comparison at
--k when several traces are given; and ``moetrace budget``'s table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from moetrace.analysis.decision import may_pay_more, sweep_edge_lines
from moetrace.report.cells import (
    MARK_LEGEND,
    SYNTHETIC_LEGEND,
    any_synthetic,
    byte_size,
    marked,
    number,
    titled_table,
    with_synthetic_mark,
)


def _growth(run: dict[str, Any], k: int) -> Table:
    table = titled_table(
        "Unique experts per layer vs k (mean over layers)",
        [("k", ""), ("req", "measured per request-step, drafts capped at k"), ("batch", "measured per step's batch"),
         ("cf", "counterfactual (a request-step's accepted tokens, as many as its drafter proposed)"),
         ("uniform", "uniform-routing bound of as many tokens"),
         ("local", "best / uniform"), ("rank", "busiest rank's experts"), ("ranks", "ranks touched per window")],
    )
    for row in run["growth_overview"]:
        table.add_row(
            str(row["k"]),
            number(row["measured_request"]),
            number(row["measured_batch"]),
            number(row["counterfactual"]),
            number(row["uniform_bound"]),
            number(row["locality"]),
            number(row["busiest_rank_experts"]),
            number(row["ranks_touched"]),
            style="bold" if row["k"] == k else None,
        )
    return table


def _step_bytes(run: dict[str, Any], k: int) -> Table:
    table = titled_table(
        f"Bytes per verification step, one request (shape: {run['shape']}, tp={run['tp']}, ep={run['ep']})",
        [("k", ""), ("source", ""), ("experts", "expert weights read"), ("rank", "busiest rank's expert weights"),
         ("AR/rank", "all-reduce bytes per rank"), ("EP", "EP dispatch + combine")],
    )
    for row in run["step_bytes"]:
        table.add_row(
            str(row["k"]),
            row["source"],
            byte_size(row["expert_weight_bytes"]),
            byte_size(row["busiest_rank_weight_bytes"]),
            byte_size(row["allreduce_bytes"]),
            byte_size(row["ep_bytes"]),
            style="bold" if row["k"] == k else None,
        )
    return table


def _acceptance(run: dict[str, Any]) -> Table:
    set_by = {row["k"]: row["set_by"] == "synthetic" for row in run["acceptance_set_by"]}
    table = titled_table("Acceptance per recorded k, and what it delivered on the recording machine", [
        ("k", ""), ("windows", "decoding request-steps"), ("drafts", "mean drafts per window with drafts"),
        ("read", "tokens a request-step read"), ("tok/step", "tokens gained per request-step"),
        ("step ms", "mean decode step, drafting included"),
        ("×", "measured speedup over k=0 (tokens per request per second)"),
        ("rate by position", "share of windows that accepted at least i drafts (i:rate; they sum to tok/step − 1)")])
    for row in run["acceptance_per_k"]:
        rates = [p for p in run["acceptance_by_position"] if p["k"] == row["k"]]
        table.add_row(
            str(row["k"]),
            str(row["windows"]),
            number(row["mean_drafts"]),
            number(row["tokens_read"]),
            with_synthetic_mark(number(row["tokens_per_step"]), set_by.get(row["k"], False)),
            number(row["step_ms"], 1),
            number(row["measured_speedup"]),
            with_synthetic_mark(" ".join(f"{p['draft_pos']}:{number(p['acceptance_rate'])}" for p in rates) or "–",
                                set_by.get(row["k"], False)),
        )
    return table


def _schedule(schedule: dict[str, Any]) -> Table:
    """What an adaptive schedule did per concurrency (each request-step at its own k), beside the static table."""
    table = titled_table(
        f"Adaptive schedule (the drafter drafts {schedule['trace_k']}, each request-step verifies its own k) against "
        "the static table", [
            ("B", "requests per step"), ("k used", "mean drafts verified"),
            ("drafts", "% of request-steps that verified 0/1/… drafts"), ("tok", "tokens gained per request-step"),
            ("uniq", "unique experts per layer its steps read (marked by source)"),
            ("step ms", "mean decode step, measured"), ("meas ×", "over the sweep's k=0 steps, measured"),
            ("pred ×", "the schedule's predicted speedup"),
            ("table", "static table's k (fixed k up to the drafter's) and its predicted speedup"),
            ("pays", "which pays more")])
    for row in schedule["rows"]:
        shares = "/".join(f"{100 * share:.0f}" for share in row["drafts_share"])
        table.add_row(str(row["batch"]), number(row["mean_drafts"]), shares,
                      number(row["tokens_per_step"]), marked(number(row["unique_experts"], 1), row["union_source"]),
                      number(row["step_ms"]), number(row["measured_speedup"]),
                      marked(number(row["predicted_speedup"]), row["speedup_source"]),
                      "–" if row["table_k"] is None else f"k={row['table_k']} {number(row['table_speedup'])}",
                      row["pays_more"] or "–")
    return table


def _by_context(by_context: dict[str, Any], synthetic: bool) -> Table:
    k = by_context["k"]
    sampled = "" if by_context["share"] >= 1.0 else f", a sample of {by_context['share']:.0%} of steps"
    table = titled_table(f"By context (tokens before a request-step's first token), recorded k={k}{sampled}", [
        ("context", ""), ("windows", "decoding request-steps"), ("mean ctx", "their mean context, tokens"),
        ("rate by position", "share of windows that accepted at least i drafts"),
        ("tok/step", "tokens gained per request-step"),
        ("1st reject", "mean position of the first rejected draft, where one was"),
        ("experts", "unique experts a verification window read, mean over MoE layers"),
        ("step ms", "mean decode step (verification and drafting), over every batch size")])
    for row in by_context["acceptance"]:
        bucket = row["bucket"]
        experts = [e for e in by_context["experts"] if e["bucket"] == bucket]
        windows = sum(e["windows"] for e in experts)
        steps = [t for t in by_context["step_time"] if t["bucket"] == bucket and t["step_ms"] is not None]
        counted = sum(t["steps"] for t in steps)
        table.add_row(
            row["context"], str(row["request_steps"]), number(row["mean_context"], 0),
            with_synthetic_mark(" ".join(f"{i}:{number(row[f'rate_{i}'])}" for i in range(1, k + 1)) or "–", synthetic),
            with_synthetic_mark(number(row["tokens_per_step"]), synthetic), number(row["first_rejected"]),
            number(sum(e["unique_experts"] * e["windows"] for e in experts) / windows if windows else None, 1),
            number(sum(t["step_ms"] * t["steps"] for t in steps) / counted if counted else None, 1))
    return table


def _step_reads(run: dict[str, Any], k: int) -> Table:
    """What one step reads per concurrency and k: the table the prediction and the decision take."""
    batches = sorted({row["batch"] for row in run["step_reads"]})
    table = titled_table("Unique experts per layer one step reads, by requests per step (columns) and k", [
        ("k", ""), *[(f"B={batch}", "") for batch in batches], ("tok", "tokens gained per request-step")])
    by_key = {(row["batch"], row["k"]): row for row in run["step_reads"]}
    for kk in sorted({row["k"] for row in run["step_reads"]}):
        first = by_key[(batches[0], kk)]
        table.add_row(str(kk), *[marked(number(by_key[(b, kk)]["unique_experts"], 1), by_key[(b, kk)]["union_source"])
                                 if (b, kk) in by_key else "–" for b in batches],
                      with_synthetic_mark(marked(number(first["tokens_per_step"]), first["acceptance_source"]),
                                          any_synthetic(run) and kk > 0),
                      style="bold" if kk == k else None)
    return table


def _prediction(prediction: dict[str, Any], k: int, synthetic: bool) -> Table:
    basis = prediction["basis"]
    title = (f"Predicted verify step at one request per step ({basis['mode']}; "
             f"tp={basis['tp']}, ep={basis['ep']}, {basis['weight_format']} experts, routing {basis['routing']})")
    # a component is a column only where some k has it (measured mode has no attention or other GEMMs; the
    # forward beyond MoE, scheduling and sampling are measured only there, the drafter there or from a calibrated
    # curve): 80 columns are tight
    parts = [(header, column, meaning) for header, column, meaning in (
        ("MoE", "moe_ms", "ms"), ("AR", "allreduce_ms", "all-reduce ms"), ("attn", "attention_ms", "attention ms"),
        ("other", "other_ms", "other GEMMs ms"), ("fwd+", "forward_beyond_moe_ms", "forward growth beyond MoE ms"),
        ("draft", "drafting_ms", "drafter ms: as measured, or its calibrated passes"),
        ("sched", "scheduling_ms", "async off ms"), ("rej", "sampling_ms", "rejection sampler ms over k=0's"),
        ("pre", "prefill_ms_per_token", "prefill ms per token a request gained, as measured at the nearest recorded k"))
        if column == "moe_ms" or any(row[column] for row in prediction["per_k"])]
    table = titled_table(title, [
        ("k", ""), ("tok", "tokens per step"), ("uniq", "unique experts per layer"), ("rank", "busiest rank's experts"),
        *[(header, meaning) for header, _, meaning in parts], ("step", "ms"), ("×", "step time vs k=0"),
        ("speedup", "")])
    for row in prediction["per_k"]:
        table.add_row(
            str(row["k"]),
            with_synthetic_mark(marked(number(row["tokens_per_step"]), row["acceptance_source"]),
                                synthetic and row["k"] > 0),
            marked(number(row["unique_experts"], 1), row["union_source"]),
            number(row["rank_experts"], 1),
            *[number(row[column]) for _, column, _ in parts],
            number(row["step_ms"]),
            number(row["step_ratio"]),
            number(row["speedup"]),
            style="bold" if row["k"] == k else None,
        )
    return table


def _against_trace(rows: list[dict[str, Any]]) -> Table:
    table = titled_table(
        "Predicted against measured on the machine that recorded (decode steps of the sweep's traces)", [
            ("B", "requests per step"), ("k", ""), ("tok", "tokens per step, measured"),
            ("pred ×", "predicted speedup"), ("meas ×", "measured speedup"), ("err", "error"),
            ("step", "measured ms"), ("miss", "ms per step the prediction leaves out"),
            ("grew", "ms the step grew against k=0, of which"), ("fwd", "in vLLM's forward"),
            ("samp", "in its sampling"), ("draft", "the drafter's")])
    for row in rows:
        table.add_row(str(row["batch"]), str(row["k"]), number(row["measured_tokens_per_step"]),
                      number(row["predicted_speedup"]), number(row["measured_speedup"]),
                      f"{100 * row['error']:+.0f}%", number(row["measured_step_ms"]), number(row["unexplained_ms"]),
                      number(row["step_growth_ms"]), *(number(row[name]) for name in
                                                        ("forward_growth_ms", "sampling_growth_ms", "drafting_ms")))
    return table


def _prediction_notes(prediction: dict[str, Any]) -> list[str]:
    basis = prediction["basis"]
    # an extrapolated all-reduce is already a note of the run's (printed above it, and in the dashboard)
    said = basis["allreduce"] and not basis["allreduce_extrapolated"]
    lines = [f"all-reduce: {basis['allreduce']}"] if said else []
    if basis.get("calibration"):
        lines.append(f"calibration: {basis['calibration']} ({basis.get('calibration_device')})")
    check = basis.get("calibrated_at_anchor")
    if check:
        ar, level = check["allreduce_ms"], check["moe_level_ratio"]
        lines.append(f"at the profile's step the calibration alone gives MoE {check['moe_ms']:.2f} ms (profile "
                     f"{check['profile_moe_ms']:.2f}"
                     + (f", {level:.1f}x" if level is not None else "") + ") and all-reduce "
                     + (f"{ar:.2f} ms" if ar is not None else "–") + f" (profile {check['profile_allreduce_ms']:.2f})")
    return lines + list(basis["notes"])


def _budget(budget: dict[str, Any]) -> Table:
    table = titled_table(
        f"Expert budget at k={budget['k']} for {budget['coverage_target']:.0%} routing-weight coverage "
        f"({budget['source']} windows; bytes at {budget.get('shape', 'the recorded shape')})",
        [("layer", ""), ("budget", "experts"), ("coverage", ""), ("re-routed", "tokens re-routed"),
         ("saved", "bytes saved per window")],
    )
    for row in budget["per_layer"]:
        table.add_row(
            str(row["layer"]),
            str(row["budget"]),
            f"{row['coverage']:.3f}",
            f"{row['rerouted_share']:.1%}",
            byte_size(row["bytes_saved"]),
        )
    return table


def _placement(placement: dict[str, Any]) -> Table:
    first = placement["rows"][0]
    table = titled_table(f"Placement at EP={placement['ep']}, held out: {first['windows']:,} windows in "
                         f"{first['steps']:,} odd steps, fitted on the even ones", [
                             ("placement", "which placement (moetrace: verification-aware, moetrace place)"),
                             ("ranks", "ranks a verification window dispatches to"),
                             ("busiest", "unique experts on the busiest rank per step, per layer"),
                             ("balance", "mean over max tokens per rank per step")])
    for row in placement["rows"]:
        table.add_row(row["placement"], number(row["ranks_touched"]), number(row["busiest_rank_experts"]),
                      number(row["balancedness"], 3))
    return table


def _comparison(payload: dict[str, Any]) -> Table:
    k = payload["k"]
    runs = payload["runs"]
    table = Table(title=f"Side by side at k={k}, one request per step", title_justify="left")
    table.add_column("", overflow="fold")
    for run in runs:
        table.add_column(Text(run["label"]), justify="right", overflow="fold")
    rows: list[tuple[str, Any]] = [
        ("model", lambda r: r["model"]),
        ("source", lambda r: r["source_at_k"]),
        ("unique experts/layer", lambda r: number((r["growth_at_k"] or {}).get("measured_request")
                                                 or (r["growth_at_k"] or {}).get("counterfactual"))),
        ("locality", lambda r: number((r["growth_at_k"] or {}).get("locality"))),
        ("expert weights/step", lambda r: byte_size((r["bytes_at_k"] or {}).get("expert_weight_bytes"))),
        ("tokens/step", lambda r: with_synthetic_mark(
            number(next((row["tokens_per_step"] for row in r["step_reads"] if row["k"] == k and row["batch"] == 1),
                        None)), any_synthetic(r) and k > 0)),
        ("median budget", lambda r: number(r["budget"]["median_budget"], 1)),
        ("predicted speedup", lambda r: number(((r.get("prediction") or {}).get("at_k") or {}).get("speedup"))),
    ]
    for name, value in rows:
        table.add_row(name, *[Text(str(value(run))) for run in runs])
    return table


def _recommended(row: dict[str, Any]) -> str:
    """A recommended k, marked "+" where a larger k may pay more (``analysis.decision.may_pay_more``)."""
    return f"{row['k']}{'+' if may_pay_more(row) else ''}"


def _decision(decision: dict[str, Any]) -> Table:
    table = titled_table(
        f"Recommended k for {decision['drafter']} ({decision['label']}); k=0: do not speculate",
        [("B", "requests per step"), ("k", "best k (+: a larger k may pay more)"),
         ("speedup", "predicted"), ("tok", "tokens per step per request"),
         ("uniq", "unique experts per layer per step (marked by source)"), ("unif", "uniform bound"),
         ("windows", "fewest decoding request-steps behind a k compared"), ("steps", "steps of B requests measured"),
         ("budget", f"median experts per layer for {decision['coverage_target']:.0%} coverage"),
         ("saved", f"expert bytes saved per request window, at {decision['shape']}")])
    for row in decision["per_batch"]:
        budget = row["budget"] or {}
        recommended = row["k"] is not None
        table.add_row(
            str(row["batch"]),
            _recommended(row) if recommended else "none",
            marked(number(row["speedup"]), row["speedup_source"]) if recommended else "–",
            with_synthetic_mark(marked(number(row["tokens_per_step"]), row["acceptance_source"]),
                                decision["acceptance"] == "synthetic" and bool(row["k"])),
            marked(number(row["unique_experts"], 0), row["union_source"]), number(row["uniform_bound"], 0),
            number(row["windows"]), number(row["steps"]), number(budget.get("median"), 0),
            byte_size(budget.get("bytes_saved_per_window")),
        )
    return table


def _decision_by_context(decision: dict[str, Any]) -> Table:
    found = decision["by_context"]
    rows = found["per_batch"]
    contexts = sorted({row["context"] for row in rows})
    table = titled_table(
        f"Recommended k by context for {decision['drafter']} ({decision['label']}), recorded at "
        f"{found['recorded_context']:,.0f} tokens",
        [("B", "requests per step"), *((f"{context:,}", "") for context in contexts[:-1]),
         (f"{contexts[-1]:,}", "columns: context length in tokens, the best k (+: a larger k may pay more) and its "
                               "predicted speedup there")])
    cells = {(row["batch"], row["context"]): row for row in rows}
    for batch in sorted({row["batch"] for row in rows}):
        table.add_row(str(batch), *(
            f"k={_recommended(cell)} {marked(number(cell['speedup']), cell['speedup_source'])}"
            if cell["k"] is not None else "none" for cell in (cells[(batch, context)] for context in contexts)))
    return table


def _policies(decision: dict[str, Any]) -> Table:
    policies = decision["policies"]
    table = titled_table(
        f"Policies for k replayed on the k={policies['trace_k']} trace of {decision['label']} (counterfactual*)",
        [("B", "requests per step"), ("policy", ""), ("k", "static or best fixed k"),
         ("mean k", "k per step, mean"), ("speedup", "over k=0, predicted steps"),
         ("vs table", "throughput over the static table's"), ("95%", "over resampled requests")])
    for row in policies["rows"]:
        table.add_row(str(row["batch"]), row["policy"], str(row["k"]) if row["k"] is not None else "–",
                      number(row["mean_k"]), number(row["speedup"]), f"{row['vs_table']:.3f}",
                      "–" if row["vs_table_low"] is None else f"{row['vs_table_low']:.3f}-{row['vs_table_high']:.3f}")
    return table


def print_decision(decisions: list[dict[str, Any]], console: Console) -> None:
    if not decisions:
        return
    for decision in decisions:
        console.print(_decision(decision))
        for row in decision["per_batch"]:
            if row["k"] is None:
                picks = f" (the figures would pick k={row['best_k']})" if row["best_k"] is not None else ""
                console.print(Text(f"  B={row['batch']}: no recommendation: {row['status']}{picks}", style="yellow"))
            elif row.get("within_error"):
                console.print(Text(
                    f"  B={row['batch']}: k={row['k']}'s {row['speedup']:.2f}x stands for {row['speedup_low']:.2f}-"
                    f"{row['speedup_high']:.2f}x measured, which k={','.join(map(str, row['within_error']))} "
                    "reach too: within the prediction's error"))
        for line in sweep_edge_lines(decision["per_batch"]):
            console.print(Text(f"  {line}"))
        for found in (decision["crossover"] or {}).values():
            if found is not None:
                console.print(Text(f"  crossover, {found['says']}"))
        if decision["context"] is not None:
            at = decision["context"]
            console.print(Text(f"  at the context the trace ran at: a mean {at['mean_tokens']:,.0f} tokens, mostly "
                               f"{at['bucket']} ({at['request_steps']:,} decoding request-steps)"
                               + ("" if decision.get("by_context") else "; other contexts: --context L,L,..."),
                               style="dim"))
        if decision.get("by_context") is not None:
            console.print(_decision_by_context(decision))
            console.print(Text("  context: tokens before a request's next token; "
                               f"{decision['by_context']['attention_basis']}", style="dim"))
            for found in decision["by_context"]["from_steps"]:
                console.print(Text(f"  {found['says']}", style="dim"))
            for row in decision["by_context"]["per_batch"]:
                if row["k"] is None:
                    console.print(Text(f"  B={row['batch']}, context {row['context']:,}: no recommendation: "
                                       f"{row['status']}", style="yellow"))
            for line in sweep_edge_lines(decision["by_context"]["per_batch"]):
                console.print(Text(f"  {line}"))
            for found in decision["by_context"]["crossover"]:
                console.print(Text(f"  crossover at context {found['context']:,}, {found['says']}"))
        if decision["policies"] and decision["policies"]["rows"]:
            console.print(_policies(decision))
            for line in decision["policies"]["verdict"]:
                console.print(Text(f"  {line}"))
    for based_on in dict.fromkeys(decision["based_on"] for decision in decisions):
        console.print(Text(f"  predicted {based_on}", style="dim"))
    for coverage, basis in dict.fromkeys((decision["held_out_coverage"], decision["held_out_basis"])
                                         for decision in decisions if decision.get("held_out_cells")):
        console.print(Text(f"  intervals: the measured speedup a prediction stands for, the central {coverage:.0%} "
                           f"of the errors of {basis} (docs/validation.md)", style="dim"))
    console.print(Text(f"  {MARK_LEGEND}", style="dim"))
    if any(decision["acceptance"] == "synthetic" for decision in decisions):
        console.print(Text(f"  {SYNTHETIC_LEGEND}", style="dim"))


def print_report(payload: dict[str, Any], console: Console) -> None:
    k = payload["k"]
    print_decision(payload["decision"], console)
    for run in payload["runs"]:
        heading = Text(f"{run['label']}: {run['model']}, {run['spec_method'] or 'plain decoding'}, "
                       f"recorded k={','.join(map(str, run['recorded_k']))}", style="bold")
        console.print(heading)
        for note in run["notes"]:
            console.print(Text(f"note: {note}", style="yellow"))
        console.print(_growth(run, k))
        console.print(_step_reads(run, k))
        console.print(_step_bytes(run, k))
        console.print(_acceptance(run))
        if run["adaptive_schedule"] is not None:
            if run["adaptive_schedule"]["rows"]:
                console.print(_schedule(run["adaptive_schedule"]))
            for line in run["adaptive_schedule"]["verdict"]:
                console.print(Text(f"  {line}"))
        if run["by_context"]["acceptance"]:
            console.print(_by_context(run["by_context"], any_synthetic(run)))
        if run.get("prediction"):
            console.print(_prediction(run["prediction"], k, any_synthetic(run)))
            for line in _prediction_notes(run["prediction"]):
                console.print(Text(f"  {line}", style="dim"))
            if run["prediction"]["against_trace"]:
                console.print(_against_trace(run["prediction"]["against_trace"]))
        if run["budget"]["per_layer"]:
            console.print(_budget(run["budget"]))
        if run.get("placement"):
            console.print(_placement(run["placement"]))
            console.print(Text(f"  {run['placement']['verdict']}", style="dim"))
    if len(payload["runs"]) > 1:
        console.print(_comparison(payload))


def print_budget_table(budget: dict[str, Any], console: Console) -> None:
    console.print(_budget(budget))
