r"""Graph capture records the truth: eager against compiled (CUDA graphs) on a GPU vLLM, and both against a
float32 reference routing computed from the same router logits; with ``--graphs-only``, eager against CUDA graphs
without torch.compile (the same kernels: only the capture differs); with ``--v2``, Model Runner V1 against V2
(both compiled); with ``--tp 2``, a tensor-parallel run against a one-GPU run the same way; with ``--dp 2``, a
data-parallel ``vllm serve`` with expert parallelism the same way, and against the server's own counters and its
client's tokens.

    python tests/engine/gpu_vllm_capture.py --candidates 384 --json benchmarks/results/gpu-vllm-capture.json
    python tests/engine/gpu_vllm_capture.py --graphs-only --candidates 384 \
        --json benchmarks/results/gpu-vllm-graphs.json
    python tests/engine/gpu_vllm_capture.py --v2 --method mtp --json benchmarks/results/gpu-vllm-runner-v2.json
    python tests/engine/gpu_vllm_capture.py --tp 2 --json benchmarks/results/gpu-vllm-tp2.json   # 2 GPUs
    python tests/engine/gpu_vllm_capture.py --dp 2 --num-prompts 10 --json benchmarks/results/gpu-vllm-dp2-ep.json

Records the embedded default model twice (bf16 on the GPU, n-gram k=3, top-16 candidates), with
``moetrace record``: eager, and ``--compiled`` (vLLM's torch.compile with FULL_AND_PIECEWISE CUDA graphs); with
``--tp N``, compiled on one GPU and compiled at TP=N (rank 0 records; its all-reduces change the sums' rounding);
with ``--dp N``, compiled on one GPU and ``vllm serve --data-parallel-size N --enable-expert-parallel`` (compiled,
every DP rank records into ``dp<r>/``; the routers of an all-gather dispatch see every rank's tokens) with the same
prompts sent by an HTTP client at concurrency N × batch size. Compares the in-sequence rows up to where greedy
decoding diverges; every row whose expert set differs must be a near-tie (the swapped experts' selection scores
within 2 bf16 ulps of the K-th score, in both runs). Then checks every row of both runs against the top-8 of its
own float32 selection scores. Exits 1 on any unexplained row, when a trace's drafts or accepted tokens differ from
vLLM's counters (leaving out the windows that async scheduling verified after a request's last token, which vLLM
discards: ``windows_after_finish``), or (``--dp``) when prompt rows or fed tokens differ from what the client sent
and received. ``--keep-traces DIR`` keeps both runs' traces.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "oracles"))  # run as a script: the run comparison


# The compared runs: `moetrace record` options and Model Runner (V1 unless a run says V2).
RUNS: dict[str, tuple[list[str], str]] = {
    "eager": ([], "0"),
    "compiled": (["--compiled"], "0"),
    "graphs-only": (["--compiled", "--engine-arg", 'compilation_config={"mode": 0, "cudagraph_mode": "FULL"}'], "0"),
    "compiled-v2": (["--compiled"], "1"),
}


def record(out: Path, args: argparse.Namespace, extra: list[str], runner_v2: str = "0") -> Path:
    command = [sys.executable, "-m", "moetrace", "record", "--k", str(args.k), "--max-tokens", str(args.max_tokens),
               "--num-prompts", str(args.num_prompts), "--batch-size", str(args.batch_size),
               "--candidates", str(args.candidates), "--method", args.method, "--out", str(out)]
    # Run outside the source tree: `python -m` puts the working directory first on sys.path, and the source tree's
    # moetrace/ lacks the folders the installed package maps in (moetrace.analysis, moetrace.hooks).
    done = subprocess.run(command + extra, capture_output=True, text=True, cwd=out.parent,
                          env={**os.environ, "VLLM_USE_V2_MODEL_RUNNER": runner_v2})
    if done.returncode != 0:
        sys.exit(f"recording failed ({out.name}): {done.stderr.strip()[-2000:]}")
    (trace,) = [p for p in out.iterdir() if p.is_dir()]
    return trace


def serve_recording(out: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The same prompts through ``vllm serve`` at DP=``args.dp`` with expert parallelism, recorded by every DP rank.
    The client's tokens go to the trace's ``outputs.jsonl`` under the trace's request ids (matched on prompts);
    returns the trace and what the server counted and the client received."""
    from moetrace.default_model import encode_text, ensure_default_model
    from moetrace.recording.engine import served_spec_decode_counters, speculative_config
    from moetrace.recording.prompts import BUILTIN_PROMPTS

    prompts = [encode_text(BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]) for i in range(args.num_prompts)]
    if len({tuple(p) for p in prompts}) < len(prompts):
        sys.exit(f"--dp matches requests on their prompts: --num-prompts must be at most {len(BUILTIN_PROMPTS)}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{probe.getsockname()[1]}"
    longest = max(map(len, prompts)) + args.max_tokens + args.k + 16
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ensure_default_model()),
        "--served-model-name", "default", "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--max-model-len", str((longest + 255) // 256 * 256), "--max-num-seqs", str(args.batch_size),
        "--no-enable-prefix-caching", "--seed", "0", "--port", base.rsplit(":", 1)[1],
        "--speculative-config", json.dumps(speculative_config("ngram", args.k, None, {})),
        "--data-parallel-size", str(args.dp), "--enable-expert-parallel",
    ]
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0",
           "MOETRACE_RECORD": json.dumps({"out": str(out), "candidates": args.candidates})}
    with open(out.parent / "serve.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                  cwd=out.parent)  # outside the source tree, as in `record`
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"vllm serve did not come up: {(out.parent / 'serve.log').read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)

        def complete(prompt: list[int]) -> dict[str, Any]:
            body = {"model": "default", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            choice = json.loads(urllib.request.urlopen(request, timeout=600).read())["choices"][0]
            return {"prompt_token_ids": prompt, "output_token_ids": choice["token_ids"]}

        with ThreadPoolExecutor(args.dp * args.batch_size) as pool:
            outputs = list(pool.map(complete, prompts))
        counters = served_spec_decode_counters(urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode())
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)  # Ctrl-C: the recorders close their traces
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    return out, {"outputs": outputs, "counters": counters}


def match_client_outputs(trace_dir: Path, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the client's outputs as ``outputs.jsonl`` under the trace's request ids, matched on the prompt tokens
    the trace recorded, and check the trace against the client: every prompt row recorded once, and every
    in-sequence token the one the client received (up to the last, which is sampled and never fed; tokens past
    it were accepted drafts that vLLM cut at ``max_tokens``)."""
    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    first_layer = int(trace.manifest["model"]["moe_layers"][0])
    fed = (trace.routing()
           .filter((pl.col("layer") == first_layer) & (pl.col("accepted").is_null() | pl.col("accepted")))
           .sort("request", "position").group_by("request", maintain_order=True)
           .agg("position", "token", prompt=(pl.col("phase") == "prefill").sum()).collect())
    by_prompt = {tuple(o["prompt_token_ids"]): o for o in outputs}
    ids = trace.request_ids()
    lines, tokens_equal, prompts_equal = [], True, True
    for row in fed.iter_rows(named=True):
        output = by_prompt.pop(tuple(row["token"][: row["prompt"]]), None)
        if output is None:
            prompts_equal = False
            continue
        expected = output["prompt_token_ids"] + output["output_token_ids"]
        prompts_equal &= row["prompt"] == len(output["prompt_token_ids"])
        fed_count = len(row["token"])  # drafts the sampler accepted past max_tokens were fed, then cut
        tokens_equal &= (row["position"] == list(range(fed_count)) and len(expected) - 1 <= fed_count
                         and row["token"][: len(expected)] == expected[:fed_count])
        lines.append(json.dumps({"request_id": ids[row["request"]].rsplit("-", 1)[0], **output}) + "\n")
    (trace_dir / "outputs.jsonl").write_text("".join(lines))
    return {"requests_matched": len(lines), "requests_sent": len(outputs),
            "prompt_rows_equal_client": prompts_equal and not by_prompt, "fed_tokens_equal_client": tokens_equal}


def rows_equal_scheduled_tokens(trace_dir: Path) -> bool:
    """Every rank's routing rows are its scheduled tokens (the steps table) in every recorded layer."""
    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    layers = len(trace.manifest["model"]["moe_layers"])
    scheduled = int(trace.steps().select(pl.col("num_tokens").sum()).collect().item())
    rows = int(trace.routing().select(pl.len()).collect().item())
    return rows == scheduled * layers == int(trace.manifest["counts"]["tokens"]) * layers


def counters_equal(trace_dir: Path, counters: dict[str, float] | None = None) -> bool:
    """The trace's drafts and accepted tokens equal vLLM's own spec-decode counters for the run (the manifest's,
    unless given: a server's), leaving out the windows vLLM ran for requests already finished (async scheduling),
    which it does not count."""
    from run_comparison import windows_after_finish
    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    counters = trace.manifest["vllm_counters"] if counters is None else counters
    verified = (trace.steps().filter(pl.col("num_drafts") > 0).collect()
                .join(windows_after_finish(trace_dir), on=["step", "request"], how="anti"))
    return bool(verified.height == counters["num_drafts"]
                and verified["num_drafts"].sum() == counters["num_draft_tokens"]
                and verified["num_accepted"].sum() == counters["num_accepted_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--method", default="ngram", help="drafter of every run (Model Runner V2 in 0.26: mtp)")
    parser.add_argument("--graphs-only", action="store_true",
                        help="compare CUDA graphs without torch.compile (FULL) against eager")
    parser.add_argument("--v2", action="store_true", help="compare Model Runner V2 against V1, both compiled")
    parser.add_argument("--tp", type=int, default=1, help="compare compiled at this TP against compiled on one GPU")
    parser.add_argument("--dp", type=int, default=1,
                        help="compare vllm serve at this DP with expert parallelism against compiled on one GPU")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep-traces", type=Path, help="also copy both runs' traces into this folder")
    args = parser.parse_args()
    if (args.tp > 1) + (args.dp > 1) + args.graphs_only + args.v2 > 1:
        sys.exit("--tp, --dp, --graphs-only and --v2 are separate checks: give one of them")

    from run_comparison import compare_runs, reference_check, windows_after_finish
    from moetrace.hooks.vllm_api import vllm_version
    from moetrace.hooks.host import gpu_inventory
    from moetrace.trace.reader import open_trace

    with tempfile.TemporaryDirectory(prefix="moetrace-capture-") as scratch:
        # run A, the reference, then run B against it
        a_name, b_name = ("eager", "graphs-only" if args.graphs_only else "compiled")
        if args.tp > 1 or args.dp > 1 or args.v2:
            a_name = "compiled"
            b_name = f"tp{args.tp}" if args.tp > 1 else f"dp{args.dp}-ep" if args.dp > 1 else "compiled-v2"
        runs = {a_name: record(Path(scratch) / a_name, args, *RUNS[a_name])}
        served: dict[str, Any] = {}
        if args.dp > 1:
            (Path(scratch) / b_name).mkdir()
            runs[b_name], served = serve_recording(Path(scratch) / b_name / "trace", args)
            served["client"] = match_client_outputs(runs[b_name], served.pop("outputs"))
        elif args.tp > 1:
            runs[b_name] = record(Path(scratch) / b_name, args, ["--compiled", "--tp", str(args.tp)])
        else:
            runs[b_name] = record(Path(scratch) / b_name, args, *RUNS[b_name])
        manifests = {name: open_trace(d).manifest for name, d in runs.items()}  # DP ranks: merged
        result: dict[str, Any] = {
            "vllm_version": vllm_version(),
            "device": (gpu_inventory()["gpus"] or ["cpu"])[0],
            "runs": {"a": a_name, "b": b_name},
            **compare_runs(runs[a_name], runs[b_name]),
            "reference": {name: reference_check(d) for name, d in runs.items()},
            "capture_mechanisms": {name: m.get("capture_mechanisms") for name, m in manifests.items()},
            "tp": {name: m["parallel"]["tp"] for name, m in manifests.items()},
            "model_runner": {name: m["capture"]["model_runner"] for name, m in manifests.items()},
            "host_copy": {name: m["capture"].get("host_copy") for name, m in manifests.items()},
            "phases": {name: m.get("phases") for name, m in manifests.items()},
            "engine_thread_us_per_step": {name: m.get("engine_thread_us_per_step") for name, m in manifests.items()},
            "dtype": manifests[b_name]["model"]["dtype"],
            "complete": {name: m["complete"] for name, m in manifests.items()},
            "acceptance_equals_vllm_counters": {name: counters_equal(d, served.get("counters") if name == b_name
                                                                     else None) for name, d in runs.items()},
            "rows_equal_scheduled_tokens": {name: rows_equal_scheduled_tokens(d) for name, d in runs.items()},
            "windows_after_finish": {name: windows_after_finish(d).height for name, d in runs.items()},
            "command": "python tests/engine/gpu_vllm_capture.py " + " ".join(
                f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                for k, v in vars(args).items() if v is not None and v is not False and k != "keep_traces"),
        }
        if args.keep_traces is not None:
            for name, trace_dir in runs.items():
                shutil.copytree(trace_dir, args.keep_traces / name, dirs_exist_ok=True)
        if args.dp > 1:
            ranks = open_trace(runs[b_name]).ranks
            result["data_parallel"] = {
                **served,
                "dp_ranks": manifests[b_name]["parallel"]["dp_ranks"],
                "requests_per_rank": [len(rank.request_ids()) for rank in ranks],
                "parallel": [rank.manifest["parallel"] for rank in ranks],
                "capture_mechanisms": [rank.manifest.get("capture_mechanisms") for rank in ranks],
            }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    unexplained = result["rows_unexplained"] + sum(r["rows_reference_unexplained"]
                                                   for r in result["reference"].values())
    agreed = all(result["acceptance_equals_vllm_counters"].values()) and all(
        result["rows_equal_scheduled_tokens"].values())
    client = result.get("data_parallel", {}).get("client", {})
    agreed &= all(client.get(key, True) for key in ("prompt_rows_equal_client", "fed_tokens_equal_client"))
    sys.exit(1 if unexplained or not result["rows_compared"] or not agreed else 0)


if __name__ == "__main__":
    main()
