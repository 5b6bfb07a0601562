"""Does the calibrated attention curve predict how a served step grows with context? On a GPU, decided before it ran
(issue 58, item 2):

    python benchmarks/lab/attention_by_context.py model-dir DIR        # DIR/kimi-k2-tp8-long
    python benchmarks/lab/attention_by_context.py prompts FILE --tokens N --count C
    moetrace calibrate --model DIR/kimi-k2-tp8-long --tp 1 --ep 1 --formats '' --no-allreduce -o CAL   # 8 heads
    moetrace record DIR/kimi-k2-tp8-long --k 0,2 --prompts SHORT ... ; the same with --prompts LONG
    python benchmarks/lab/attention_by_context.py check --short RUN --long RUN --calibration CAL [--json FILE]

``model-dir`` writes the Kimi-K2 TP=8 slice (``kimi_slice.py``, bf16, dummy weights, no tokenizer: a prompt's bytes
are its tokens) with room for 32K tokens of context. ``prompts`` writes C distinct prompts of N bytes each.
``check`` takes the engine steps of each recording where every request decoded and the batch was full, and compares
how much longer such a step ran at the long prompts than at the short ones (per k) with what the report adds to
that step when it moves it between the two contexts: the slice's layers times the calibration's MLA curve at
B requests x (k + 1) queries (``analysis.context.at_contexts``), and, beside it, the KV bytes at the copy bandwidth
(the pricing without a curve). Held out, decided before the run: the curve's growth within 25% of the measured
growth at k = 0 and k = 2; the ratio of k = 2's growth to k = 0's, measured and predicted, both printed.

A step's time is from its start to the next step's start (``period_ms``, as ``--profile measured`` takes it). The
first H100 run compared start-to-end times instead (``duration_growth_ms``, still printed): at k = 0 vLLM schedules
the next step while the device computes this one (async scheduling), so a step's recorded bounds hold the host's
work alone and did not grow with context at all (-0.02 ms), while at k = 2 (n-gram: async scheduling off) they
grew by what the device did (+0.79 ms against the curve's +0.87).
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from pathlib import Path
from typing import Any

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.checked import finish  # noqa: E402
from lab.kimi_slice import kimi_k2_slice  # noqa: E402

LONGEST = 32768


def model_dir(out: Path) -> Path:
    folder = out / "kimi-k2-tp8-long"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**kimi_k2_slice(8), "max_position_embeddings": LONGEST}, indent=1))
    return folder


def prompts(path: Path, tokens: int, count: int) -> None:
    """``count`` prompts of ``tokens`` printable bytes, each its own (a counter and a rotated alphabet), so the
    prefix cache shares none of them."""
    letters = string.ascii_letters + string.digits + " "
    with path.open("w") as out:
        for index in range(count):
            rotated = letters[index % len(letters):] + letters[: index % len(letters)]
            text = f"{index:04d} " + (rotated * (tokens // len(rotated) + 1))
            out.write(json.dumps({"prompt": text[:tokens]}) + "\n")


def full_decode_steps(trace_dir: Path) -> dict[str, Any]:
    """The engine steps of a trace where every request decoded and the batch was the largest seen: how many, their
    mean time from start to the next step's start (``period_ms``, ``analysis.acceptance.decode_step_periods``: the
    device's time where vLLM schedules the next step while this one computes, as it does at k = 0) and from start to
    end (``step_ms``: the host's bounds), the batch and their requests' mean context (tokens before the step's first
    token)."""
    from moetrace.analysis.acceptance import decode_step_periods
    from moetrace.analysis.context import request_step_contexts
    from moetrace.analysis.predicates import decoding
    from moetrace.trace.reader import open_trace

    trace = open_trace(trace_dir)
    steps = trace.steps()
    contexts = request_step_contexts(trace.routing(), trace.manifest.model.moe_layers[0])
    per_step = steps.join(contexts, on=["dp_rank", "step", "request"]).group_by("dp_rank", "step").agg(
        all_decoding=decoding().all(), batch=pl.len(), context=pl.col("context").mean(),
        queries=pl.col("num_drafts").mean() + 1,  # an n-gram request that found no match verifies its anchor alone
        ms=((pl.col("t_end_ns").first() - pl.col("t_start_ns").first()) / 1e6)).collect()
    batch = int(per_step["batch"].max())
    full = per_step.filter(pl.col("all_decoding") & (pl.col("batch") == batch))
    (periods,) = decode_step_periods(steps, full.lazy()).filter(pl.col("batch") == batch).to_dicts()
    return {"trace": str(trace_dir), "k": trace.k, "batch": batch, "steps": full.height,
            "async_scheduling": trace.manifest.capture.async_scheduling,
            "period_ms": periods["period_ms"], "step_pairs": periods["decode_steps"],
            "step_ms": float(full["ms"].mean()), "step_ms_median": float(full["ms"].median()),
            "context": float(full["context"].mean()), "queries": float(full["queries"].mean()),
            "num_layers": trace.manifest.model.num_layers,
            "kv_bytes_per_token": trace.manifest.model.fields.get("kv_bytes_per_token")}


def traces(run: Path) -> dict[int, Path]:
    """A recording's trace per k (``RUN/k<k>`` or RUN/*/k<k>)."""
    from moetrace.trace.reader import open_trace

    return {open_trace(manifest.parent).k: manifest.parent for manifest in sorted(run.glob("**/manifest.json"))}


def check(short: Path, long: Path, calibration_path: Path) -> dict[str, Any]:
    from moetrace.analysis.calibration import attention_curve
    from moetrace.analysis.context import kv_read_ms

    calibration = json.loads(calibration_path.read_text())
    curve = attention_curve(calibration)
    assert curve is not None, f"{calibration_path} has no attention curve"
    rows = []
    short_traces, long_traces = traces(short), traces(long)
    for k in sorted(set(short_traces) & set(long_traces)):
        at_short, at_long = full_decode_steps(short_traces[k]), full_decode_steps(long_traces[k])
        batch, layers = at_short["batch"], at_short["num_layers"]
        if at_long["batch"] != batch or not at_short["steps"] or not at_long["steps"]:
            raise SystemExit(f"k={k}: full-batch steps {at_short['steps']} at {at_short['batch']} requests (short), "
                             f"{at_long['steps']} at {at_long['batch']} (long): nothing to compare")
        measured = at_long["period_ms"] - at_short["period_ms"]
        # each run at its own mean queries a request (k + 1 where every request drafted k)
        predicted = layers * (curve.layer_us(batch, at_long["queries"], at_long["context"])
                              - curve.layer_us(batch, at_short["queries"], at_short["context"])) / 1e3
        kv_bytes = kv_read_ms(batch, at_long["context"] - at_short["context"], int(at_short["kv_bytes_per_token"]),
                              float(calibration["copy_bandwidth_gbs"]))
        rows.append({"k": k, "batch": batch, "short": at_short, "long": at_long, "measured_growth_ms": measured,
                     "duration_growth_ms": at_long["step_ms"] - at_short["step_ms"],
                     "curve_growth_ms": predicted, "kv_bytes_growth_ms": kv_bytes,
                     "curve_over_measured": predicted / measured if measured else None,
                     "kv_bytes_over_measured": kv_bytes / measured if measured else None,
                     "within_25_percent": abs(predicted - measured) <= 0.25 * abs(measured)})
    by_k = {row["k"]: row for row in rows}
    ratios = None
    if 0 in by_k and 2 in by_k:
        ratios = {"measured_k2_over_k0": by_k[2]["measured_growth_ms"] / by_k[0]["measured_growth_ms"],
                  "curve_k2_over_k0": by_k[2]["curve_growth_ms"] / by_k[0]["curve_growth_ms"]}
    return {"calibration": str(calibration_path), "kernel": curve.kernel, "rows": rows, "k2_over_k0": ratios,
            "ok": bool(rows) and all(row["within_25_percent"] for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("model-dir").add_argument("out", type=Path)
    written = commands.add_parser("prompts")
    written.add_argument("path", type=Path)
    written.add_argument("--tokens", type=int, required=True)
    written.add_argument("--count", type=int, required=True)
    checked = commands.add_parser("check")
    checked.add_argument("--short", type=Path, required=True)
    checked.add_argument("--long", type=Path, required=True)
    checked.add_argument("--calibration", type=Path, required=True)
    checked.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "model-dir":
        print(model_dir(args.out))
        return
    if args.command == "prompts":
        prompts(args.path, args.tokens, args.count)
        return
    finish(check(args.short, args.long, args.calibration), args.json)


if __name__ == "__main__":
    main()
