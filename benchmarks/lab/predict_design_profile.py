"""Prediction for a measured Kimi-K2.5 deployment (INT4 experts, 8 GPUs, TP=8; the ``kimi-k2-tp8`` profile: a 12.1 ms
decode step, all-reduce 51.5%, MoE 11.1%, attention 15.3%, other GEMMs 13.4%) from a calibration, beside the hand
estimate of 1.9–2.3x at k=3: uniform routing, a per-draft acceptance rate, that step profile.

    python benchmarks/lab/predict_design_profile.py [--calibration moetrace/data/calibration-h200.json]
        [--acceptance 0.7] [--max-k 6] [-o benchmarks/results/h200x2.md]

Prints (and writes with -o) markdown, its first line the command (``Command: `...` ``, what
``tools/results_index.py`` reads): the calibration's fitted curves and all-reduce points, then step time,
tokens per step and speedup per k for TP=8 and EP=8 (linear placement), each in three modes: the profile scaled by
simple models (no calibration), the profile anchored with calibrated growth, and the calibration alone.

Evidence it produced: benchmarks/results/h200x2.md (commit 8847554, from the 2x H200 calibration of 2026-12-03).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import polars as pl

from moetrace.analysis.acceptance import tokens_per_step
from moetrace.analysis.concurrency import union_means, uniform_unions
from moetrace.analysis.cost import predict
from moetrace.analysis.deployment import deployment_for
from moetrace.analysis.placement import linear_placement
from moetrace.analysis.profile import PROFILE_PRESETS
from moetrace.analysis.shape import SHAPE_PRESETS


def calibration_tables(doc: dict[str, Any]) -> list[str]:
    device = doc["device"]
    versions = doc["versions"]
    lines = [
        f"Measured on {device['count']}× {device['name']} (sm {device.get('capability')}), torch {versions['torch']},"
        f" CUDA {versions['cuda']}, NCCL {versions['nccl']}, {doc['created']}; device-to-device copy "
        f"{doc['copy_bandwidth_gbs']:.0f} GB/s. Command: `{doc['command']}`.",
        "",
        "| expert layer per rank | format | time per layer (µs) | marginal weight GB/s | E=8 / 9 / 32 (µs) |",
        "|---|---|---|---|---|",
    ]
    for curve in doc["experts"] + doc["int4_estimate"]:
        fit = curve.get("fit")
        if not fit:
            lines.append(f"| {curve['config']} | {curve['format']} | skipped: {curve.get('skipped')} | | |")
            continue
        times = []
        for experts in (8, 9, 32):
            rows = 8 * (1 if experts <= 9 else 4)
            if curve["ep"] > 1:  # EP: a rank's share of 1 and 4 tokens' rows
                experts, rows = {8: (1, 1), 9: (2, 2), 32: (4, 4)}[experts]
            times.append(fit["c0_us"] + fit["per_expert_us"] * experts + fit["per_row_us"] * rows)
        label = (f"{curve['config']} (width {curve['width']}, {curve.get('experts_per_rank', '')} experts)"
                 if not curve.get("estimated") else f"{curve['config']} (width {curve['width']})")
        fmt = curve["format"] + (" (estimated)" if curve.get("estimated") else "")
        lines.append(
            f"| {label} | {fmt} | {fit['c0_us']:.1f} + {fit['per_expert_us']:.2f}·E + {fit['per_row_us']:.3f}·rows"
            f" | {curve['marginal_weight_gbs']:.0f} | " + " / ".join(f"{t:.0f}" for t in times) + " |")
    lines += ["", "(EP columns are E = 1 / 2 / 4 experts on a rank.)", ""]
    for m in doc["allreduce"]["measured"]:
        if "fit" not in m:
            lines.append(f"All-reduce on {m['world_size']} GPUs skipped: {m.get('skipped')}")
            continue
        lines += [
            f"NCCL all-reduce, {m['world_size']} GPUs, bf16 messages (µs per call; eager = host-issued loop, queued "
            "= calls queued behind a GPU sleep, graph = replayed from a CUDA graph):",
            "",
            "| tokens × 7168 × 2 B | bytes | eager | queued | graph |",
            "|---|---|---|---|---|",
        ]
        for p in m["points"]:
            tokens = p["tokens"] if p["tokens"] is not None else "–"
            cells = [f"{p[k]:.1f}" if k in p else "–" for k in ("eager_us", "queued_us", "graph_us")]
            lines.append(f"| {tokens} | {p['bytes']:,} | " + " | ".join(cells) + " |")
        fitted = [p["tokens"] for p in m["points"] if p["tokens"] is not None]
        for method, fit in m["fits"].items():
            lines.append(f"\nFit ({method}, {min(fitted)}–{max(fitted)} tokens): {fit['latency_us']:.1f} µs + bytes / "
                         f"{fit['bus_bandwidth_gbs'] or 0:.0f} GB/s bus bandwidth (R² {fit['r2']:.2f}).")
        if m.get("large_message_bus_bandwidth_gbs"):
            lines.append(f"\nLarge-message bus bandwidth (64 MiB): {m['large_message_bus_bandwidth_gbs']:.0f} GB/s.")
        lines.append("")
    gpus = doc["allreduce"]["world_sizes_measured"]
    lines.append(f"GPUs measured for all-reduce: {gpus or 'none'} (of {doc['allreduce']['gpus_present']} present).")
    return lines


def prediction_tables(doc: dict[str, Any], acceptance: float, max_k: int) -> list[str]:
    shape = SHAPE_PRESETS["kimi-k2"]
    profile = PROFILE_PRESETS["kimi-k2-tp8"]
    ks = range(max_k + 1)
    tokens = pl.Series([tokens_per_step([acceptance ** i for i in range(1, k + 1)]) for k in ks])
    lines = []
    for name, tp, ep in (("TP=8", 8, 1), ("EP=8, linear placement", 1, 8)):
        unions = uniform_unions(shape.num_experts, shape.top_k, linear_placement(shape.num_experts, ep), ks, [1])
        per_k = union_means(unions).sort("k").with_columns(tokens=pl.col("k").cast(pl.Float64) + 1,
                                                          tokens_per_step=tokens)
        lines += [f"### {name}: uniform routing, acceptance {acceptance} per draft, INT4 experts", ""]
        for profile_used, calibration in ((profile, None), (profile, doc), (None, doc)):
            table, basis = predict(per_k, deployment_for(shape, tp, ep), profile_used, calibration)
            lines += [f"**{basis['mode']}** — all-reduce: {basis['allreduce']}", "",
                      "| k | tokens/step | experts/rank/layer | MoE ms | all-reduce ms | attention ms | other ms "
                      "| step ms | step × | speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
            for r in table.to_dicts():
                lines.append(
                    f"| {r['k']} | {r['tokens_per_step']:.3f} | {r['rank_experts']:.2f} | {r['moe_ms']:.2f} | "
                    f"{r['allreduce_ms']:.2f} | {r['attention_ms']:.2f} | {r['other_ms']:.2f} | {r['step_ms']:.2f} "
                    f"| {r['step_ratio']:.3f} | **{r['speedup']:.2f}** |" if r["k"] == 3 else
                    f"| {r['k']} | {r['tokens_per_step']:.3f} | {r['rank_experts']:.2f} | {r['moe_ms']:.2f} | "
                    f"{r['allreduce_ms']:.2f} | {r['attention_ms']:.2f} | {r['other_ms']:.2f} | {r['step_ms']:.2f} "
                    f"| {r['step_ratio']:.3f} | {r['speedup']:.2f} |")
            check = basis.get("calibrated_at_anchor")
            if check:
                lines.append(f"\nAt k=0 the calibration alone gives MoE {check['moe_ms']:.2f} ms (profile "
                             f"{check['profile_moe_ms']:.2f}) and all-reduce {check['allreduce_ms']:.2f} ms "
                             f"(profile {check['profile_allreduce_ms']:.2f}).")
            lines += [""] + [f"- {note}" for note in basis["notes"]] + [""]
    return lines


@click.command()
@click.option("--calibration", type=click.Path(path_type=Path, exists=True),
              default=Path("moetrace/data/calibration-h200.json"), show_default=True)
@click.option("--acceptance", default=0.7, show_default=True)
@click.option("--max-k", default=6, show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None)
def main(calibration: Path, acceptance: float, max_k: int, output: Path | None) -> None:
    doc = json.loads(calibration.read_text())
    command = "python " + " ".join(sys.argv)
    lines = [f"Command: `{command}` (from {calibration}; the calibration's own command below)", "",
             f"# Calibration and prediction: {calibration.name}", "",
             "Produced by:", "", "```bash", doc["command"].replace("/root/out/", "benchmarks/results/")
             + "   # on the GPU machine (PYTHONPATH=. , NCCL_NVLS_ENABLE=0)",
             command, "```", "", "## Calibration", ""]
    lines += calibration_tables(doc)
    lines += ["", "## Prediction for a measured Kimi-K2.5 deployment (profile: 12.1 ms; all-reduce 51.5%, MoE 11.1%, "
              "attention 15.3%, other GEMMs 13.4%)", ""]
    lines += prediction_tables(doc, acceptance, max_k)
    text = "\n".join(lines) + "\n"
    if output:
        output.write_text(text)
    click.echo(text)


if __name__ == "__main__":
    main()
