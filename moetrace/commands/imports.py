"""``moetrace import``: routing an engine returned or dumped, written as a moetrace trace (``moetrace.formats``)."""

from __future__ import annotations

from pathlib import Path

import click

from moetrace.commands.common import console
from moetrace.errors import UserError


@click.command("import")
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
    from moetrace.formats.returned import http_responses, vllm_offline, write_imported_trace
    from moetrace.formats.sglang_recorder import sglang_recorder
    from moetrace.formats.imported_trace import model_layers
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
