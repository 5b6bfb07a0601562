"""The ``moetrace`` command line: one click group, thin commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
import polars as pl
import pyarrow as pa
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from moetrace.calibrate.command import calibrate
from moetrace.commands.common import console, err_console, refuse_existing, trace_load
from moetrace.errors import UserError
from moetrace.hooks.options import BUDGET_SCOPES
from moetrace.trace.reader import unreadable_file
from moetrace.report.commands import budget, report


class Group(click.Group):
    """Turns ``UserError`` into one line on stderr and exit code 1, never a traceback; an error reading a trace's
    data becomes one line naming the file, unless ``--debug`` (or ``MOETRACE_DEBUG=1``) asks for the traceback."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["moetrace.args"] = list(args)  # to name a broken file if reading fails later
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UserError as exc:
            fail(str(exc))
        except (pl.exceptions.PolarsError, pa.ArrowException) as exc:  # data that the footers did not vouch for
            if ctx.params.get("debug"):
                raise
            paths = [Path(arg) for arg in ctx.meta.get("moetrace.args", []) if Path(arg).exists()]
            fail((unreadable_file(paths) or f"reading the trace failed: {str(exc).splitlines()[0]}")
                 + " (--debug shows the traceback)")


def fail(message: str) -> NoReturn:
    # Text, not markup: paths and model names may hold "[...]".
    err_console.print(Text("error: ", style="red") + Text(message), highlight=False, soft_wrap=True)
    sys.exit(1)


@click.group(cls=Group)
@click.version_option(package_name="moetrace")
@click.option("--debug", is_flag=True, envvar="MOETRACE_DEBUG",
              help="Show the traceback of an error reading a trace's data (also MOETRACE_DEBUG=1).")
def main(debug: bool) -> None:
    """Record and analyse MoE expert routing during speculative-decoding verification in vLLM."""


@main.command()
@click.argument("model", required=False)
@click.option("--k", "ks", default="3", show_default=True,
              help="Draft length, or a sweep such as 0,1,2,3,4 (0 = no speculation).")
@click.option("--method", default="ngram", show_default=True, help="Drafter: ngram, eagle3, mtp or draft_model.")
@click.option("--drafter", help="Path of the draft model (eagle3, draft_model).")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path),
              help="JSONL with a 'prompt' field, or plain text lines. "
                   "Default: built-in code, prose and structured text.")
@click.option("--num-prompts", type=int, help="Cycle the prompts to this many requests.")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens generated per request.")
@click.option("--batch-size", default=8, show_default=True, help="Concurrent requests (vLLM max_num_seqs).")
@click.option("--tp", default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--candidates", default=0, show_default=True,
              help="Also record the top-C router candidates and scores (C > top-k).")
@click.option("--no-token-ids", is_flag=True, help="Do not record input token ids.")
@click.option("--budget", "budget_arg", metavar="N|FILE|none[,...]",
              help="Limit each MoE layer's experts in verification steps to N, or to the per-layer budgets of a "
                   "budgets.json written by `moetrace budget` (the router's own choice is kept as candidates); "
                   "a list such as 12,16,none records one run per budget.")
@click.option("--budget-scope", type=click.Choice(BUDGET_SCOPES), default="step", show_default=True,
              help="Apply the budget to a step's verifying tokens together, or to each request's window.")
@click.option("--replay-routing", type=click.Path(path_type=Path), metavar="TRACE",
              help="Route every token as a token of this trace was (recorded with --candidates): a model with "
                   "dummy weights, whose routers pick alike for every token, routed as a trained one.")
@click.option("--out", default=Path("traces"), show_default=True, type=click.Path(path_type=Path),
              help="Where run directories are written.")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="Extra vLLM engine argument (repeatable; VALUE parsed as JSON when it can be).")
@click.option("--spec-arg", "spec_args", multiple=True, metavar="KEY=VALUE",
              help="Extra speculative_config entry (repeatable).")
@click.option("--compiled", is_flag=True,
              help="Let vLLM compile (and capture CUDA graphs on GPU) instead of running eager.")
@click.option("--recompute-from-logits", is_flag=True,
              help="Record every layer by recomputing its routing from the router logits "
                   "(the path taken where the MoE kernel fuses routing), to check that path.")
@click.option("--time-phases-every", type=int, metavar="N",
              help="Time the forward, sampling and drafting on one recorded step in N (the manifest's phases). "
                   "Default: every step on the CPU, one in 64 on a GPU, where each timer costs the step microseconds.")
@click.option("--rotate-seconds", default=10.0, show_default=True,
              help="Close the open Parquet file this often: the most a crash can lose.")
@click.option("--force", is_flag=True, help="Overwrite an existing run directory.")
@click.option("--verbose", is_flag=True, help="Keep vLLM's INFO logs in engine.log.")
def record(model: str | None, ks: str, method: str, drafter: str | None, prompts_file: Path | None,
           num_prompts: int | None, max_tokens: int, batch_size: int, tp: int, candidates: int, no_token_ids: bool,
           budget_arg: str | None, budget_scope: str, replay_routing: Path | None, out: Path,
           engine_args: tuple[str, ...], spec_args: tuple[str, ...], compiled: bool,
           recompute_from_logits: bool, time_phases_every: int | None, rotate_seconds: float, force: bool,
           verbose: bool) -> None:
    """Record expert routing from vLLM while it generates with speculative decoding.

    MODEL is a checkpoint directory (or a name in the local Hugging Face cache); without it, the embedded tiny
    Kimi-K2-shaped model (trained on Python's standard library) is unpacked once and used.
    """
    from moetrace.recording.record import RecordRequest, parse_budgets, parse_key_values, parse_ks, record as run_record

    request = RecordRequest(
        model=model, ks=parse_ks(ks), method=method, drafter=drafter, prompts_file=prompts_file,
        num_prompts=num_prompts, max_tokens=max_tokens, batch_size=batch_size, tp=tp, candidates=candidates,
        token_ids=not no_token_ids, budgets=parse_budgets(budget_arg), budget_scope=budget_scope, out=out,
        engine_args=parse_key_values(engine_args, "--engine-arg"),
        spec_args=parse_key_values(spec_args, "--spec-arg"), eager=not compiled,
        recompute_from_logits=recompute_from_logits, time_phases_every=time_phases_every,
        rotate_seconds=rotate_seconds, replay_routing=replay_routing, force=force, verbose=verbose,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=False) as bar:
        tasks: dict[str, Any] = {}

        def show(run: str, status: str, done: int, total: int) -> None:
            if run not in tasks:
                tasks[run] = bar.add_task(f"{run} {status}", total=total)
            bar.update(tasks[run], description=f"{run} {status}", completed=done, total=total)

        run_dir, runs = run_record(request, show)
    table = Table(title=f"recorded {run_dir}")
    for column in ("run", "steps", "tokens", "drafts", "accepted", "routing rows", "bytes", "wall s"):
        table.add_column(column, justify="right")
    for run in runs:
        c = run.manifest["counts"]
        table.add_row(run.label, str(c["steps"]), str(c["tokens"]), str(c["drafts"]), str(c["accepted"]),
                      str(c["routing_rows"]), f"{c['routing_bytes']:,}", f"{run.wall_s:.1f}")
    console.print(table)
    k_next = max(request.ks)
    click.echo(f"next: moetrace report {run_dir} --k {k_next}")


@main.command()
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifests and counts as JSON.")
def info(trace: Path, as_json: bool) -> None:
    """Print a trace's manifest and row counts (a trace directory or the parent of a k sweep)."""
    from moetrace.trace.reader import open_traces

    traces = open_traces(trace)
    summaries = []
    for t in traces:
        rows = t.routing().select("layer").collect().height
        steps = t.steps().select("step").collect().height
        summaries.append({"path": str(t.path), "complete": t.complete, "routing_rows_readable": rows,
                          "steps_rows_readable": steps, "warnings": t.warnings, "manifest": t.manifest.document})
    if as_json:
        click.echo(json.dumps(summaries, indent=2))
        return
    for s, t in zip(summaries, traces):
        m = t.manifest
        # Text, not markup, wherever a path, a name or an error message is printed: they may hold "[...]".
        end = m.document.get("end")
        if m.error:
            status = Text.assemble(("INCOMPLETE", "red"), f" (recording stopped: {m.error})")
        elif not t.complete:
            status = Text.assemble(("INCOMPLETE", "yellow"), " (recording was killed or is still running)")
        else:
            status = Text("complete") + (Text(f" ({end})") if end else Text(""))
        console.print(Text.assemble((str(t.path), "bold"), f"  {m.schema}  ", status), highlight=False)
        model = m.model
        console.print(
            Text(f"  model {model.name} ({model.fields.get('architecture')}): {len(model.moe_layers)} MoE layers, "
                 f"{model.num_experts} experts, top-{model.top_k}, hidden {model.hidden_size}")
            + (Text("  random weights", style="yellow") if model.random_weights else Text("")),
            highlight=False,
        )
        console.print(f"  spec {m.spec.method} k={m.spec.k}  tp={m.parallel.tp} ep={m.parallel.ep}", highlight=False)
        counts = m.counts
        if counts:
            console.print("  counts " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), highlight=False)
        console.print(f"  readable now: {s['routing_rows_readable']:,} routing rows, "
                      f"{s['steps_rows_readable']:,} step rows",
                      highlight=False)
        for warning in t.warnings:
            err_console.print(Text("  warning: ", style="yellow") + Text(warning), highlight=False)


@main.command("import")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--outputs", type=click.Path(path_type=Path),
              help="With a .npz: the JSONL of its requests' token ids [default: outputs.jsonl beside it].")
@click.option("--model", help="The model the engine ran: a folder with config.json or a cached Hugging Face id "
                              "[default: the embedded default model].")
@click.option("--prompt-start", default=0, show_default=True,
              help="The routed_experts_prompt_start the requests were sent with.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Trace directory to write [default: SOURCE's name with -trace].")
@click.option("--force", is_flag=True, help="Overwrite an existing trace directory.")
def import_routing(source: Path, outputs: Path | None, model: str | None, prompt_start: int, output: Path | None,
                   force: bool) -> None:
    """Write the routing an engine returned as a moetrace trace: SOURCE is a .npz of vLLM's arrays per request id
    (enable_return_routed_experts; with the JSONL of their token ids), or a .jsonl of HTTP responses: vLLM
    completions (sent with return_token_ids) or SGLang /generate responses (return_routed_experts). The trace
    holds the tokens each request kept: growth per k is counterfactual; it has no acceptance, router weights,
    timing or batching. Or SOURCE is a .pt dump of SGLang's expert distribution recorder in per_token mode: each
    forward pass a step, each token group of it a request of its own (the dump has no request ids), no router
    weights or timing; stat and per_pass dumps hold counts, not routing, and are refused."""
    from moetrace.imports.returned import http_responses, vllm_offline, write_imported_trace
    from moetrace.imports.sglang_recorder import sglang_recorder
    from moetrace.imports.trace import model_layers
    from moetrace.recording.record import resolve_model

    if prompt_start < 0:
        raise UserError(f"--prompt-start: {prompt_start} is negative")
    resolved = resolve_model(model)
    target = output or source.with_name(f"{source.stem}-trace")
    if source.suffix == ".pt":
        if outputs or prompt_start:
            raise UserError(f"{source}: --outputs and --prompt-start are for returned routing; a .pt dump has "
                            f"its token ids and positions")
        counts = sglang_recorder(source, resolved, target, force)["counts"]
        console.print(f"imported {counts['steps']:,} forward passes, {counts['tokens']:,} tokens into {target}",
                      highlight=False, soft_wrap=True)
        console.print(f"next: moetrace report {target}", highlight=False, soft_wrap=True)
        return
    if source.suffix == ".npz":
        outputs = outputs or source.with_name("outputs.jsonl")
        requests, files, form = vllm_offline(source, outputs, prompt_start), [source, outputs], "offline arrays"
    elif source.suffix == ".jsonl":
        requests = http_responses(source, prompt_start, model_layers(resolved), int(resolved.top_k or 0))
        files, form = [source], "HTTP responses"
    else:
        raise UserError(f"{source}: give a .npz of routed-experts arrays, a .jsonl of HTTP responses or a .pt of "
                        f"SGLang's expert distribution recorder")
    engine = " and ".join(sorted({r.engine for r in requests}))
    manifest = write_imported_trace(requests, resolved, {
        "engine": engine, "format": f"routed experts, {form}", "files": [str(f) for f in files],
        "prompt_start": prompt_start}, target, force)
    counts = manifest["counts"]
    console.print(f"imported {len(manifest['requests'])} requests, {counts['tokens']:,} tokens, "
                  f"{len(manifest['model']['moe_layers'])} MoE layers into {target}", highlight=False, soft_wrap=True)
    console.print(f"next: moetrace report {target}", highlight=False, soft_wrap=True)


@main.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--vllm-spec-schedule", "vllm_spec", is_flag=True,
              help="SOURCE is the JSON of `moetrace report --json`: vLLM's dynamic speculative-decoding schedule "
                   "(num_speculative_tokens_per_batch_size).")
@click.option("--sglang-expert-location", "sglang_location", is_flag=True,
              help="SOURCE is a trace (or an SGLang stat dump, .pt): SGLang's --init-expert-location file from its "
                   "decode and verification load.")
@click.option("--eplb", is_flag=True,
              help="SOURCE is a trace (or an SGLang stat dump, .pt): its decode and verification load per layer and "
                   "expert, and vLLM's default EPLB policy's placement from it (needs --ep).")
@click.option("--drafter", "label", default=None, help="Which run's decision, by its label, when SUMMARY has several.")
@click.option("--ep", type=int, default=None,
              help="Expert-parallel ranks: with --eplb, those vLLM places on; with --sglang-expert-location, writes "
                   "a physical_to_logical_map instead of logical_count.")
@click.option("--redundant", default=0, show_default=True, help="With --ep: extra expert slots per layer.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="File to write [default: SOURCE's name with .vllm-spec-schedule.json, "
                   ".sglang-expert-location.json or .eplb.json].")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def export(source: Path, vllm_spec: bool, sglang_location: bool, eplb: bool, label: str | None, ep: int | None,
           redundant: int, output: Path | None, force: bool) -> None:
    """Write what moetrace found in an engine's own format: with --vllm-spec-schedule, the recommended k per
    concurrency of SOURCE (the JSON of `moetrace report --json`) as the speculative-config keys vLLM reads
    (method, num_speculative_tokens, num_speculative_tokens_per_batch_size); with --sglang-expert-location, the
    expert load of SOURCE (a trace in decode and verification, or the counts of an SGLang stat dump) as SGLang's
    --init-expert-location file; with --eplb, that load and the placement vLLM's default EPLB policy makes of it
    (physical_to_logical_map, logical_to_physical_map, logical_replica_count)."""
    if vllm_spec + sglang_location + eplb != 1:
        raise UserError("give one of --vllm-spec-schedule, --sglang-expert-location or --eplb")
    if vllm_spec:
        export_vllm_spec_schedule(source, label, output, force)
    elif sglang_location:
        export_sglang_expert_location(source, ep, redundant, output, force)
    else:
        export_eplb(source, ep, redundant, output, force)


@main.command()
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--ep", type=int, required=True, help="Expert-parallel ranks to place the experts on.")
@click.option("--redundant", default=0, show_default=True,
              help="Extra expert slots per layer: replicas of the most picked experts.")
@click.option("--spread", default=1.0, show_default=True,
              help="Weight of a step's experts per rank (squared, a stand-in for the busiest rank) against ranks "
                   "touched per window; 0: ranks touched alone.")
@click.option("--max-load", default=1.1, show_default=True,
              help="Cap on a rank's token load, times the mean (or the balanced start's busiest rank if higher).")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="vLLM EPLB-style file to write [default: TRACE's name with .placement-ep<N>.json]; SGLang's "
                   "file goes beside it with .sglang-expert-location.json.")
@click.option("--force", is_flag=True, help="Overwrite existing files.")
def place(trace: Path, ep: int, redundant: int, spread: float, max_load: float, output: Path | None,
          force: bool) -> None:
    """Place experts on EP ranks for speculative verification: per MoE layer, the experts that appear together in
    a request's verification window (its k+1 tokens in one step) go to one rank, so a window dispatches to fewer
    ranks, while each step's experts stay spread and each rank's token load stays within --max-load.

    Fitted on the windows of even steps and scored on those of odd steps, beside vLLM's default EPLB policy fitted
    on the same windows' load and the default linear placement: ranks touched per window, unique experts on the
    busiest rank per step, balancedness (mean over max tokens per rank per step, as vLLM's EPLB logs it). Writes
    the placement scored there as vLLM EPLB maps (physical_to_logical_map, logical_to_physical_map,
    logical_replica_count) and as SGLang's --init-expert-location file (physical_to_logical_map)."""
    for bad, message in ((ep < 1, f"--ep {ep}: needs at least 1 rank"),
                         (redundant < 0, f"--redundant {redundant}: must be 0 or more"),
                         (spread < 0, f"--spread {spread}: must be 0 or more"),
                         (max_load < 1, f"--max-load {max_load}: must be 1 or more (times the mean rank load)")):
        if bad:
            raise UserError(message)
    target = output or trace.with_name(f"{trace.name}.placement-ep{ep}{f'-r{redundant}' if redundant else ''}.json")
    from moetrace.place import place_experts

    place_experts(trace, ep, redundant, spread, max_load, target, force)


def export_vllm_spec_schedule(summary: Path, label: str | None, output: Path | None, force: bool) -> None:
    from moetrace.export import vllm_spec_schedule

    try:
        decisions = json.loads(summary.read_text())["decision"]
    except FileNotFoundError:
        raise UserError(f"{summary}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"{summary}: not the JSON of `moetrace report --json` ({type(exc).__name__})") from None
    chosen = [d for d in decisions if label is None or d.get("label") == label]
    if len(chosen) != 1:
        labels = ", ".join(str(d.get("label")) for d in decisions) or "none"
        raise UserError(f"{summary}: {'no' if not chosen else 'several'} decisions"
                        f"{f' labelled {label}' if label else ''}; give --drafter LABEL (labels: {labels})")
    try:
        schedule = vllm_spec_schedule(chosen[0])
    except ValueError as exc:
        raise UserError(f"{summary}: {exc}") from None
    target = output or summary.with_name(f"{summary.stem}.vllm-spec-schedule.json")
    refuse_existing(target, force)
    target.write_text(json.dumps(schedule, indent=2) + "\n")
    click.echo(f"{target}: {schedule['method']} {schedule['num_speculative_tokens_per_batch_size']}")
    click.echo(f"next: vllm serve MODEL --speculative-config \"$(cat {target})\"")




def export_sglang_expert_location(trace_path: Path, ep: int | None, redundant: int, output: Path | None,
                                  force: bool) -> None:
    from moetrace.export import sglang_physical_to_logical_map

    if ep is None and redundant:
        raise UserError("--redundant places replicas: give --ep too")
    target = output or trace_path.with_name(f"{trace_path.name}.sglang-expert-location.json")
    refuse_existing(target, force)
    counts, moe_layers = trace_load(trace_path)
    layers, experts = counts.shape
    if ep is None:
        document: dict[str, Any] = {"logical_count": counts.tolist()}
        what = f"logical_count [{layers}, {experts}]"
    else:
        try:
            mapping = sglang_physical_to_logical_map(counts, moe_layers, ep, redundant)
        except ValueError as exc:
            raise UserError(f"--ep {ep} --redundant {redundant}: {exc}") from None
        document = {"physical_to_logical_map": mapping.tolist()}  # alone: SGLang passes every key on
        what = f"physical_to_logical_map [{layers}, {experts + redundant}] over {ep} ranks"
    target.write_text(json.dumps(document) + "\n")
    click.echo(f"{target}: {what}, from {int(counts.sum()):,} expert picks (decode and verification; a stat dump: "
               f"every counted pass)")
    click.echo(f"next: python -m sglang.launch_server --model-path MODEL --init-expert-location {target}"
               + (f" --ep-size {ep} --ep-num-redundant-experts {redundant}" if ep is not None else ""))


def export_eplb(trace_path: Path, ep: int | None, redundant: int, output: Path | None, force: bool) -> None:
    from moetrace.hooks.vllm_api import VllmApiError, eplb_placement, vllm_version

    if ep is None or ep < 1:
        raise UserError("--eplb places experts on ranks: give --ep N (N >= 1)")
    target = output or trace_path.with_name(f"{trace_path.name}.eplb.json")
    refuse_existing(target, force)
    counts, moe_layers = trace_load(trace_path)
    experts = counts.shape[1]
    if (experts + redundant) % ep:
        raise UserError(f"--ep {ep} --redundant {redundant}: {experts} experts + {redundant} redundant do not "
                        f"split evenly over {ep} ranks")
    load = counts[moe_layers]
    try:
        placement = eplb_placement(load, ep, redundant)
    except VllmApiError as exc:
        raise UserError(str(exc)) from None
    document = {"policy": f"vLLM {vllm_version()} DefaultEplbPolicy, one node, one expert group", "ep": ep,
                "redundant": redundant, "layers": moe_layers, "load": load.tolist(), **placement}
    target.write_text(json.dumps(document) + "\n")
    click.echo(f"{target}: vLLM's EPLB placement of {experts} experts (+{redundant}) over {ep} ranks in "
               f"{len(moe_layers)} MoE layers, from {int(load.sum()):,} expert picks (decode and verification; a stat "
               f"dump: every counted pass)")


main.add_command(report)
main.add_command(budget)
main.add_command(calibrate)
