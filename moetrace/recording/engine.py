"""One recording at one k: runs vLLM's offline engine with the moetrace plugin switched on.

Run as ``python -m moetrace.recording.engine SETTINGS.json`` in a child process per k (vLLM spawns its workers, so the
engine must be created under a ``__main__`` guard, and a fresh process per k keeps sweeps independent). Exit
code 2 with one line on stderr means the run could not record; the trace directory then says why.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from moetrace.hooks.plugin import ENV_VAR, WORKER_EXTENSION
from moetrace.trace.manifest import amend_manifest
from moetrace.trace.schema import ENGINE_ROUTED_EXPERTS_NAME

def speculative_config(method: str, k: int, drafter: str | None, spec_args: dict[str, Any]) -> dict[str, Any] | None:
    if k == 0:
        return None
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=5)
    if drafter is not None:
        config["model"] = drafter
    config.update(spec_args)
    return config


def progress_to_file(path: Path, total: int) -> Any:
    """A tqdm class for vLLM's ``use_tqdm`` that reports "done total" to ``path`` for the parent's progress bar."""
    from tqdm import tqdm

    class ProgressToFile(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = open(os.devnull, "w")
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown: bool | None = super().update(n)
            path.write_text(f"{self.n} {self.total}")
            return shown

    path.write_text(f"0 {total}")  # the engine is up: the parent switches from "starting" to "generating"
    return ProgressToFile


def build_llm(settings: dict[str, Any]) -> Any:
    """vLLM's offline engine for ``settings`` (see ``moetrace.recording.record.engine_settings``), recording switched
    on."""
    os.environ[ENV_VAR] = json.dumps(settings["recording"])
    from vllm import LLM

    from moetrace.default_model import runtime_dtype
    from moetrace.hooks.vllm_api import engine_arg_exists, on_cuda

    engine_args: dict[str, Any] = {
        "model": settings["model"],
        "skip_tokenizer_init": settings["token_prompts"] is not None,
        "enforce_eager": settings["eager"],
        "dtype": settings["dtype"] or runtime_dtype(on_cuda()),
        "max_model_len": settings["max_model_len"],
        "max_num_seqs": settings["batch_size"],
        "tensor_parallel_size": settings["tp"],
        "speculative_config": speculative_config(
            settings["method"], settings["k"], settings["drafter"], settings["spec_args"]
        ),
        "worker_extension_cls": WORKER_EXTENSION,
        "seed": 0,
        "disable_log_stats": False,  # vLLM's spec-decode counters, the cross-check for the recorded acceptance
    }
    if settings["k"] > 0 and engine_arg_exists("per_request_spec_decode_metrics"):
        engine_args["per_request_spec_decode_metrics"] = "detailed"  # and per request, where vLLM has it
    return LLM(**{**engine_args, **settings["engine_args"]})  # the user's --engine-arg wins


def engine_prompts(settings: dict[str, Any]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    if settings["token_prompts"] is not None:
        return [TokensPrompt(prompt_token_ids=ids) for ids in settings["token_prompts"]]
    return list(settings["prompts"])


def run(settings: dict[str, Any]) -> int:
    llm = build_llm(settings)
    try:
        return generate_and_record(llm, settings)
    finally:
        llm.llm_engine.engine_core.shutdown()


def generate_and_record(llm: Any, settings: dict[str, Any]) -> int:
    from vllm import SamplingParams

    out = Path(settings["out"])
    progress_bar = progress_to_file(Path(settings["progress_file"]), len(settings["prompts"]))
    statuses = llm.collective_rpc("moetrace_status")
    if not any(s["recording"] for s in statuses):
        reason = next((s["error"] for s in statuses if s["error"]), "the moetrace plugin did not load in the worker")
        print(f"moetrace: cannot record: {reason}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=settings["max_tokens"], temperature=0.0, ignore_eos=True)
    outputs = generate_from_one_queue(llm, engine_prompts(settings), params, progress_bar)
    closed = [c for c in llm.collective_rpc("moetrace_close") if c is not None]
    amend_manifest(out, vllm_counters=spec_decode_counters(llm))
    with open(out / "outputs.jsonl", "w") as sink:
        for output in outputs:
            completion = output.outputs[0]
            metrics = getattr(completion, "spec_decode_metrics", None)
            sink.write(
                json.dumps(
                    {
                        "request_id": output.request_id,
                        "prompt_token_ids": list(output.prompt_token_ids or []),
                        "output_token_ids": list(completion.token_ids),
                        "spec_decode": None
                        if metrics is None
                        else {
                            "per_step_accepted": list(metrics.per_step_accepted),
                            "per_step_drafted": list(metrics.per_step_drafted),
                        },
                    }
                )
                + "\n"
            )
    save_engine_routed_experts(outputs, out / ENGINE_ROUTED_EXPERTS_NAME)
    failed = next((c["error"] for c in closed if not c["complete"]), None if closed else "closing the trace failed")
    if failed is not None:
        print(f"moetrace: recording stopped, the trace is incomplete: {failed}", file=sys.stderr)
        return 2
    return 0


def generate_from_one_queue(llm: Any, prompts: list[Any], params: Any, progress_bar: Any) -> list[Any]:
    """``llm.generate`` with every request queued before the first step is scheduled (vLLM's own recipe: scheduling
    paused by ``sleep(level=0)`` while they are enqueued): the engine core otherwise starts stepping while requests
    still arrive, so which requests share a step would depend on timing. Under a step-scoped expert budget the
    requests of a step choose its experts together, and a run's routing and outputs would differ run to run."""
    llm.sleep(level=0)
    llm.enqueue(prompts, params, use_tqdm=False)
    llm.wake_up(tags=["scheduling"])
    return list(llm.wait_for_completion(use_tqdm=progress_bar))


def save_engine_routed_experts(outputs: list[Any], path: Path) -> None:
    """vLLM's own routed experts per request (``CompletionOutput.routed_experts``, ``[tokens, layers, top_k]``, where
    the engine ran with ``enable_return_routed_experts``), as one array per request id in ``path`` (``.npz``):
    what ``moetrace import`` reads, beside the trace that recorded the same run."""
    import numpy as np

    arrays = {o.request_id: o.outputs[0].routed_experts for o in outputs
              if getattr(o.outputs[0], "routed_experts", None) is not None}
    if arrays:
        np.savez_compressed(path, **arrays)


def spec_decode_counters(llm: Any) -> dict[str, float]:
    """vLLM's own speculative-decoding counters for this run (what ``/metrics`` shows under ``vllm serve``):
    ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, and ``num_accepted_tokens_at_<i>``: the drafts
    accepted at draft position i = 1..k (vLLM's ``num_accepted_tokens_per_pos``, counted from 0 there)."""
    prefix = "vllm:spec_decode_"
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(prefix):
            continue
        name = metric.name.removeprefix(prefix)
        if hasattr(metric, "value"):
            counters[name] = float(metric.value)
        elif name == "num_accepted_tokens_per_pos":  # a Vector: one counter per draft position
            counters |= {f"num_accepted_tokens_at_{i + 1}": float(v) for i, v in enumerate(metric.values)}
    return counters


def served_spec_decode_counters(metrics_text: str) -> dict[str, float]:
    """The same counters from a ``vllm serve`` ``/metrics`` page (Prometheus text), summed over the server's
    engines (one per data-parallel rank)."""
    counters: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        value = rest.rsplit(" ", 1)[-1]
        for counter in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if name == f"vllm:spec_decode_{counter}_total":
                counters[counter] = counters.get(counter, 0.0) + float(value)
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            position = int(rest.split('position="', 1)[1].split('"', 1)[0])
            key = f"num_accepted_tokens_at_{position + 1}"
            counters[key] = counters.get(key, 0.0) + float(value)
    return counters


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))
