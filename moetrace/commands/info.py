"""``moetrace info``: a trace's manifest and row counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.text import Text

from moetrace.commands.common import console, err_console

if TYPE_CHECKING:
    from moetrace.trace.reader import Trace


@click.command()
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifests and counts as JSON.")
def info(trace: Path, as_json: bool) -> None:
    """Print a trace's manifest and row counts (a trace directory or the parent of a k sweep)."""
    from moetrace.trace.reader import open_traces

    traces = open_traces(trace)
    described: list[dict[str, Any]] = []
    for t in traces:
        rows = t.routing().select("layer").collect().height
        steps = t.steps().select("step").collect().height
        described.append({"path": str(t.path), "complete": t.complete, "routing_rows_readable": rows,
                          "steps_rows_readable": steps, "partitions": partition_span(t), "warnings": t.warnings,
                          "manifest": t.manifest.document})
    if as_json:
        click.echo(json.dumps(described, indent=2))
        return
    for s, t in zip(described, traces):
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
        span = s["partitions"]
        if span is not None:
            still_open = f", still open: {', '.join(span['open'])}" if span["open"] else ""
            console.print(f"  partitions {span['count']} (always on), from {span['first_start']} to "
                          f"{span['last_end'] or 'now'}{still_open}", highlight=False, soft_wrap=True)
        counts = m.counts
        if counts:
            console.print("  counts " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), highlight=False)
        console.print(f"  readable now: {s['routing_rows_readable']:,} routing rows, "
                      f"{s['steps_rows_readable']:,} step rows",
                      highlight=False)
        for warning in t.warnings:
            err_console.print(Text("  warning: ", style="yellow") + Text(warning), highlight=False)


def partition_span(trace: Trace) -> dict[str, Any] | None:
    """An always-on recording's partitions: how many, when the first began and the last ended (None while it is
    open), and those not closed (the one being recorded, or one whose recording was killed); None for any other
    trace."""
    if not trace.parts:
        return None
    first, last = trace.parts[0][0].manifest.document, trace.parts[-1][0]
    still_open = [part.path for part, _, _ in trace.parts if not part.complete and not part.manifest.error]
    return {"count": len(trace.parts), "first_start": first.get("start_time"),
            "last_end": last.manifest.document.get("end_time"),
            "open": [path.relative_to(trace.path).as_posix() for path in still_open]}
