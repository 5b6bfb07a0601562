"""``moetrace calibrate``: a thin click command over ``moetrace.calibrate.run.calibrate`` with a progress bar."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape, shape_from_config
from moetrace.calibrate.settings import ATTENTION_CONTEXTS
from moetrace.trace.model_config import config_value
from moetrace.recording.drafters import DEFAULT_EAGLE3_HEAD
from moetrace.errors import UserError, refuse_existing


def default_output(device: str, quick: bool) -> Path:
    """calibration-<gpu name>x<count>.json (from NVML, no torch), calibration-cpu.json; ``-quick`` for smoke runs."""
    name = "cpu"
    if device == "cuda":
        from moetrace.hooks.host import gpu_inventory

        gpus = gpu_inventory()["gpus"]
        if gpus:
            name = re.sub(r"[^a-z0-9]+", "-", gpus[0].lower()).strip("-") + f"x{len(gpus)}"
        else:
            name = "cuda"
    return Path(f"calibration-{name}{'-quick' if quick else ''}.json")


def model_config(model: str) -> dict[str, Any]:
    """A model directory's config.json, or the embedded default model's."""
    if model == "default":
        from moetrace.default_model import CONFIG

        return dict(CONFIG)
    config_path = Path(model).expanduser() / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"--model {model}: cannot read {config_path} "
                        f"({getattr(exc, 'strerror', None) or exc})") from None
    if not isinstance(config, dict):
        raise UserError(f"--model {model}: {config_path} is not a JSON object")
    return config


def model_shape(config: dict[str, Any], model: str) -> ModelShape:
    """The expert shape a model's config describes."""
    try:
        return shape_from_config(config)
    except ValueError as exc:
        raise UserError(f"--model {model}: {exc}") from None


def attention_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The MLA shape a model's config names (heads, latent and rope widths) and the contexts it holds; no attention
    timing where it names no latent (not MLA: the calibration times MLA only)."""
    rank = config_value(config, "kv_lora_rank")
    if not rank:
        return {"attention": False}
    longest = int(config_value(config, "max_position_embeddings") or ATTENTION_CONTEXTS[-1])
    return {"attention_heads": int(config_value(config, "num_attention_heads") or 1), "kv_lora_rank": int(rank),
            "rope_dim": int(config_value(config, "qk_rope_head_dim") or 0),
            "attention_contexts": tuple(c for c in ATTENTION_CONTEXTS if c < longest) + (longest,)}


@click.command()
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="Where to measure; cpu is a smoke test of the whole path, not a figure to predict with.")
@click.option("--quick", is_flag=True, help="Small shapes, a small grid and few repetitions: a run of seconds.")
@click.option("--shape", "shape_preset", type=click.Choice(sorted(SHAPE_PRESETS)), default="kimi-k2",
              show_default=True, help="Model whose per-rank expert shapes are measured.")
@click.option("--model", default=None,
              help="Measure this model's expert shape instead: a model directory (its config.json), or 'default' for "
                   "the embedded model. Overrides --shape.")
@click.option("--tp", default=8, show_default=True, help="Tensor-parallel size whose expert slice is measured.")
@click.option("--ep", default=8, show_default=True, help="Expert-parallel size whose experts per rank are measured.")
@click.option("--formats", default="bf16,fp8", show_default=True, help="Weight formats to measure (bf16, fp8).")
@click.option("--max-gpus", type=int, default=None, help="Use at most this many GPUs for the all-reduce.")
@click.option("--no-allreduce", is_flag=True, help="Skip the all-reduce measurement.")
@click.option("--vllm-kernel", is_flag=True,
              help="Also time vLLM's own fused-MoE kernel (fused_experts, bf16, TP shapes) over the same grid; the "
                   "report then reads expert time from its table. Needs vLLM on a CUDA GPU.")
@click.option("--drafter", default=None,
              help="Also time this model drafter's forward passes at its shape on one rank of --tp: an EAGLE-3 head or "
                   "draft model's checkpoint folder (its config.json; weights are not read), or 'default' for the "
                   "EAGLE-3 head shipped for the embedded model.")
@click.option("--no-attention", is_flag=True, help="Skip timing attention (MLA decode) against context length.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Calibration file [default: calibration-<gpu>x<count>.json].")
@click.option("--force", is_flag=True, help="Overwrite an existing calibration file.")
def calibrate(device: str, quick: bool, shape_preset: str, model: str | None, tp: int, ep: int, formats: str,
              max_gpus: int | None, no_allreduce: bool, vllm_kernel: bool, drafter: str | None, no_attention: bool,
              output: Path | None, force: bool) -> None:
    """Measure, on the GPUs present, MoE expert time against unique experts and rows (bf16 and fp8 grouped GEMMs
    at the model's per-rank TP and EP shapes, with the weight bandwidth that INT4 is estimated from), NCCL
    all-reduce time against message size for 2, 4, 8... GPUs, attention (MLA decode) against requests, query
    tokens and context length and, with --drafter, a model drafter's passes against tokens; write the curves as a
    calibration JSON for `moetrace report --calibration`."""
    from moetrace.calibrate.run import calibrate as run_calibrate, digest_lines, write_json
    from moetrace.calibrate.settings import Settings

    path = output or default_output(device, quick)
    refuse_existing(path, force)
    config = None if model is None else model_config(model)
    shape = SHAPE_PRESETS[shape_preset] if config is None else model_shape(config, str(model))
    common: dict[str, Any] = {
        "formats": tuple(f.strip() for f in formats.split(",") if f.strip()),
        "allreduce": not no_allreduce,
        "max_gpus": max_gpus,
        "vllm_kernel": vllm_kernel,
        "drafter": None if drafter is None else str(DEFAULT_EAGLE3_HEAD if drafter == "default" else drafter),
        "command": " ".join(["moetrace", *sys.argv[1:]]),
        "attention": not no_attention,
    }
    if quick:
        settings = Settings.quick_settings(device, **common)
    else:
        mla = {} if config is None or no_attention else attention_settings(config)
        settings = Settings(device=device, hidden=shape.hidden_size, expert_width=shape.expert_width,
                            num_experts=shape.num_experts, top_k=shape.top_k, tp=tp, ep=ep, **{**common, **mla})
    err_console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err_console, transient=False) as bar:
            tasks: dict[str, Any] = {}

            def show(label: str, done: int, total: int) -> None:
                if label not in tasks:
                    tasks[label] = bar.add_task(label, total=total)
                bar.update(tasks[label], completed=done, total=total)

            doc = run_calibrate(settings, show)
    except ValueError as exc:
        raise UserError(f"calibrate: {exc}") from None
    except RuntimeError as exc:
        raise UserError(f"calibrate: {str(exc).splitlines()[0]}") from None
    try:
        write_json(doc, path)
    except OSError as exc:
        raise UserError(f"{path}: cannot write calibration ({exc.strerror})") from None
    console = Console()
    for line in digest_lines(doc):
        console.print(Text(line), highlight=False)
    for note in doc["notes"]:
        console.print(Text(f"note: {note}", style="yellow"), highlight=False)
    console.print(Text(f"calibration: {path}"), highlight=False)
