"""``moetrace export``: the decision and the expert load in engines' own formats (``moetrace.formats.export``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from moetrace.commands.common import trace_load
from moetrace.errors import UserError, refuse_existing


@click.command()
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
@click.option("--drafter", "label", default=None, help="Which run's decision, by its label, when SOURCE has several.")
@click.option("--context", type=int, default=None,
              help="With --vllm-spec-schedule: the context (of `moetrace report --context`) whose decision becomes "
                   "the table vLLM takes today [default: the context the trace ran at].")
@click.option("--ep", type=int, default=None,
              help="Expert-parallel ranks: with --eplb, those vLLM places on; with --sglang-expert-location, writes "
                   "a physical_to_logical_map instead of logical_count.")
@click.option("--redundant", default=0, show_default=True, help="With --ep: extra expert slots per layer.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="File to write [default: SOURCE's name with .vllm-spec-schedule.json, "
                   ".sglang-expert-location.json or .eplb.json].")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def export(source: Path, vllm_spec: bool, sglang_location: bool, eplb: bool, label: str | None, context: int | None,
           ep: int | None, redundant: int, output: Path | None, force: bool) -> None:
    """Write what moetrace found in an engine's own format: with --vllm-spec-schedule, the recommended k per
    concurrency of SOURCE (the JSON of `moetrace report --json`) as the speculative-config keys vLLM reads
    (method, num_speculative_tokens, num_speculative_tokens_per_batch_size), and where SOURCE decided per context
    (`moetrace report --context`) the same in the 5-item form vLLM's open PR #48944 proposes, beside it; with
    --sglang-expert-location, the
    expert load of SOURCE (a trace in decode and verification, or the counts of an SGLang stat dump) as SGLang's
    --init-expert-location file; with --eplb, that load and the placement vLLM's default EPLB policy makes of it
    (physical_to_logical_map, logical_to_physical_map, logical_replica_count)."""
    if vllm_spec + sglang_location + eplb != 1:
        raise UserError("give one of --vllm-spec-schedule, --sglang-expert-location or --eplb")
    if vllm_spec:
        export_vllm_spec_schedule(source, label, context, output, force)
    elif sglang_location:
        export_sglang_expert_location(source, ep, redundant, output, force)
    else:
        export_eplb(source, ep, redundant, output, force)


def export_vllm_spec_schedule(report_json: Path, label: str | None, context: int | None,
                              output: Path | None, force: bool) -> None:
    from moetrace.analysis.decision import sweep_edge_lines
    from moetrace.formats.export import (BY_CONTEXT_PROPOSAL, decision_at_context, vllm_spec_schedule,
                                         vllm_spec_schedule_by_context)

    try:
        decisions = json.loads(report_json.read_text())["decision"]
    except FileNotFoundError:
        raise UserError(f"{report_json}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"{report_json}: not the JSON of `moetrace report --json` ({type(exc).__name__})") from None
    chosen = [d for d in decisions if label is None or d.get("label") == label]
    if len(chosen) != 1:
        labels = ", ".join(str(d.get("label")) for d in decisions) or "none"
        raise UserError(f"{report_json}: {'no' if not chosen else 'several'} decisions"
                        f"{f' labelled {label}' if label else ''}; give --drafter LABEL (labels: {labels})")
    decided = chosen[0]
    try:
        exported = decided if context is None else decision_at_context(decided, context)
        schedule = vllm_spec_schedule(exported)
        by_context = vllm_spec_schedule_by_context(decided) if decided.get("by_context") else None
    except ValueError as exc:
        raise UserError(f"{report_json}: {exc}") from None
    target = output or report_json.with_name(f"{report_json.stem}.vllm-spec-schedule.json")
    beside = target.with_name(f"{target.name.removesuffix('.json')}-by-context.json")
    for path in (target, *([beside] if by_context else [])):
        refuse_existing(path, force)
    target.write_text(json.dumps(schedule, indent=2) + "\n")
    at = "" if context is None else f" at context {context:,}"
    click.echo(f"{target}: {schedule['method']}{at} {schedule['num_speculative_tokens_per_batch_size']}")
    if by_context is not None:
        proposed, left_out = by_context
        beside.write_text(json.dumps(proposed, indent=2) + "\n")
        click.echo(f"{beside}: {proposed['num_speculative_tokens_per_batch_size']} ({BY_CONTEXT_PROPOSAL})")
        for cell in left_out:
            click.echo(f"  left out: {cell}")
    # vLLM reads the schedule's keys alone: a k at the sweep's edge is said here, not in the file
    edges = [*sweep_edge_lines(exported["per_batch"]),
             *(sweep_edge_lines(decided["by_context"]["per_batch"]) if by_context is not None else [])]
    for line in dict.fromkeys(edges):
        click.echo(f"  {line}")
    click.echo(f"next: vllm serve MODEL --speculative-config \"$(cat {target})\"")




def export_sglang_expert_location(trace_path: Path, ep: int | None, redundant: int, output: Path | None,
                                  force: bool) -> None:
    from moetrace.formats.export import sglang_physical_to_logical_map

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
