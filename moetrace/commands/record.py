"""``moetrace record``: the command over ``moetrace.recording.record``, with a progress bar per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from moetrace.commands.common import console, err_console
from moetrace.hooks.options import BUDGET_SCOPES


@click.command()
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
              help="Apply the budget to a step's verifying tokens together, or to each request's verify window.")
@click.option("--replay-routing", type=click.Path(path_type=Path), metavar="TRACE",
              help="Route every token as a token of this trace was (recorded with --candidates): a model with "
                   "dummy weights, whose routers pick alike for every token, routed as a trained one.")
@click.option("--out", default=Path("traces"), show_default=True, type=click.Path(path_type=Path),
              help="Where run directories are written.")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="Extra vLLM engine argument (repeatable; VALUE parsed as JSON when it can be).")
@click.option("--spec-arg", "spec_args", multiple=True, metavar="KEY=VALUE",
              help="Extra speculative_config entry (repeatable).")
@click.option("--synthetic-acceptance", metavar="RATES|PROFILE",
              help="Keep drafts at these rates instead of the target model's verdict (vLLM's synthetic rejection "
                   "sampling; GPU only): per draft position, the share of windows that accept at least i drafts, "
                   "such as 0.8,0.52,0.31, or a profile: kimi-k2-eagle3-chat, chat-ngram-low, default-ngram, ... (an "
                   "unknown name lists them all). "
                   "Each k takes the first k rates; the drafter and verification still run at k.")
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
           engine_args: tuple[str, ...], spec_args: tuple[str, ...], synthetic_acceptance: str | None, compiled: bool,
           recompute_from_logits: bool, time_phases_every: int | None, rotate_seconds: float, force: bool,
           verbose: bool) -> None:
    """Record expert routing from vLLM while it generates with speculative decoding.

    MODEL is a checkpoint directory (or a name in the local Hugging Face cache); without it, the embedded tiny
    Kimi-K2-shaped model (trained on Python's standard library) is unpacked once and used.
    """
    from moetrace.recording.record import (
        RecordRequest,
        parse_budgets,
        parse_key_values,
        parse_ks,
        parse_synthetic_acceptance,
        record as run_record,
    )

    request = RecordRequest(
        model=model, ks=parse_ks(ks), method=method, drafter=drafter, prompts_file=prompts_file,
        num_prompts=num_prompts, max_tokens=max_tokens, batch_size=batch_size, tp=tp, candidates=candidates,
        token_ids=not no_token_ids, budgets=parse_budgets(budget_arg), budget_scope=budget_scope, out=out,
        engine_args=parse_key_values(engine_args, "--engine-arg"),
        spec_args=parse_key_values(spec_args, "--spec-arg"),
        synthetic_acceptance=parse_synthetic_acceptance(synthetic_acceptance), eager=not compiled,
        recompute_from_logits=recompute_from_logits, time_phases_every=time_phases_every,
        rotate_seconds=rotate_seconds, replay_routing=replay_routing, force=force, verbose=verbose,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    bar = Progress(*columns, console=err_console, transient=False)
    tasks: dict[str, Any] = {}

    def show(run: str, status: str, done: int, total: int) -> None:
        if not tasks:  # shown from the first run on: a request refused before it leaves no empty bar behind
            bar.start()
        if run not in tasks:
            tasks[run] = bar.add_task(f"{run} {status}", total=total)
        bar.update(tasks[run], description=f"{run} {status}", completed=done, total=total)

    def warn(text: str) -> None:
        bar.console.print(Text(f"warning: {text}", style="yellow"), highlight=False, soft_wrap=True)

    try:
        run_dir, runs = run_record(request, show, warn)
    finally:
        if tasks:
            bar.stop()
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
