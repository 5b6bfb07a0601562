"""The whole calibration: plan, measure, fit, write JSON. Needs torch alone (no click, rich or polars), so it runs
as ``python -m moetrace.calibrate.run --out calib.json`` on a GPU machine where moetrace is not installed
(``PYTHONPATH`` at the repository root is enough); ``moetrace calibrate`` calls the same ``calibrate`` function
with a rich progress bar."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.calibrate import SCHEMA
from moetrace.calibrate.fit import fit_allreduce, fit_expert_time
from moetrace.calibrate.settings import (
    ExpertConfig,
    Progress,
    Settings,
    allreduce_sizes,
    allreduce_world_sizes,
    expert_configs,
)

if TYPE_CHECKING:
    from moetrace.calibrate.drafter import DrafterShape
    from moetrace.calibrate.experts import ExpertPool

def _versions(torch: Any) -> dict[str, Any]:
    try:
        from importlib.metadata import version

        moetrace_version = version("moetrace")
    except Exception:  # run from a source tree that is not installed (the GPU machine)
        moetrace_version = "source tree"
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl = None
    return {"moetrace": moetrace_version, "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "python": platform.python_version()}


def _device_facts(torch: Any, device: Any) -> dict[str, Any]:
    if device.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine(), "count": 1,
                "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    count = torch.cuda.device_count()
    return {"type": "cuda", "name": props.name, "count": count,
            "names": [torch.cuda.get_device_name(i) for i in range(count)],
            "capability": f"{props.major}.{props.minor}", "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count}


def _int4_estimate(curves: list[dict[str, Any]], s: Settings) -> list[dict[str, Any]]:
    """INT4 (group-quantised, bf16 scales) expert time per config, estimated from the narrowest measured format's
    marginal weight bandwidth: per-expert time = INT4 bytes per expert / that bandwidth; c0 and per-row as measured."""
    from moetrace.calibrate.experts import weight_bytes_per_expert

    out = []
    for name in dict.fromkeys(c["config"] for c in curves):
        usable = [c for c in curves if c["config"] == name and c.get("fit") and c["fit"]["per_expert_us"] > 0
                  and not c.get("table")]
        if not usable:
            continue
        basis = min(usable, key=lambda c: c["weight_bits"])
        bandwidth = basis["marginal_weight_gbs"]
        int4_bytes = weight_bytes_per_expert(s.hidden, basis["width"], 4, s.int4_group_size)
        fit = basis["fit"]
        out.append({
            "config": name, "tp": basis["tp"], "ep": basis["ep"], "width": basis["width"], "format": "int4",
            "weight_bits": 4, "estimated": True, "basis_format": basis["format"],
            "weight_bytes_per_expert": int4_bytes, "marginal_weight_gbs": bandwidth,
            "fit": {"model": fit["model"], "c0_us": fit["c0_us"], "per_expert_us": int4_bytes / (bandwidth * 1e3),
                    "per_row_us": fit["per_row_us"]},
            "note": f"estimated: INT4 weights (group {s.int4_group_size}, bf16 scales) streamed at the marginal "
                    f"weight bandwidth measured for {basis['format']}; c0 and per-row cost as {basis['format']}",
        })
    return out


def _expert_curve(pool: ExpertPool, config: ExpertConfig, kernel: str, curve: dict[str, Any], s: Settings,
                  progress: Progress, notes: list[str]) -> dict[str, Any]:
    """One expert curve of ``pool`` over ``config``'s grid with ``kernel``: "grouped-mm" (fitted as a line) or
    "vllm" (vLLM's fused_experts, kept as a table of its points); a kernel that cannot run is skipped with why."""
    from moetrace.calibrate.experts import fit_weight_bandwidth, measure_curve, vllm_kernel_context

    vllm = kernel == "vllm"
    label = f"experts {config.name} {curve['format']}" + (" vLLM fused_experts" if vllm else "")
    total = len(config.grid)
    progress(label, 0, total)

    def skip(reason: str) -> dict[str, Any]:
        curve["skipped"] = reason[:300]
        notes.append(f"{label}: {curve['skipped']}")
        progress(label, total, total)
        return curve

    reason = pool.fused_moe_check(s.top_k) if vllm else pool.check()
    if reason is not None:
        return skip(f"{'vLLM fused_experts' if vllm else pool.kernel} cannot run on {pool.device.type}: {reason}")
    curve["kernel"] = "vLLM fused_experts (Triton)" if vllm else pool.kernel
    curve["rows_padded_to"] = 1 if vllm else pool.row_multiple
    done = [0]

    def tick() -> None:
        done[0] += 1
        progress(label, done[0], total)

    try:
        if vllm:
            with vllm_kernel_context():
                points = measure_curve(pool, config.grid, s.reps, s.replays, tick, fused_moe_top_k=s.top_k)
            curve["table"] = True  # its time at a given U grows with the tokens: read as a table, not the line
        else:
            points = measure_curve(pool, config.grid, s.reps, s.replays, tick)
    except Exception as exc:  # one curve failing (kernel, memory) must not lose the others
        return skip(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    curve["points"] = points
    curve["timing"] = sorted({p["timing"] for p in points})
    curve["fit"] = fit_expert_time(points)
    curve.update(fit_weight_bandwidth(curve["fit"], curve["weight_bytes_per_expert"], points))
    return curve


def calibrate(s: Settings, progress: Progress) -> dict[str, Any]:
    """Measure everything ``s`` asks for and return the calibration document (schema ``moetrace-calibration/1``)."""
    s.check()
    drafter = _drafter(s)
    import torch

    from moetrace.calibrate.experts import copy_bandwidth_gbs

    if s.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible (use --device cpu for a smoke run)")
    device = torch.device("cuda", 0) if s.device == "cuda" else torch.device("cpu")
    notes: list[str] = []
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": s.command,
        "quick": s.quick,
        "device": _device_facts(torch, device),
        "versions": _versions(torch),
        "host": {"hostname": platform.node(), "cpus": os.cpu_count()},
        "settings": {k: v for k, v in asdict(s).items() if k != "command"},
        "shape": {"hidden_size": s.hidden, "expert_width": s.expert_width, "num_experts": s.num_experts,
                  "top_k": s.top_k},
    }
    progress("copy bandwidth", 0, 1)
    doc["copy_bandwidth_gbs"] = copy_bandwidth_gbs(device, (1 << 20) if s.quick else (2 << 30))
    progress("copy bandwidth", 1, 1)
    curves = _expert_curves(s, device, progress, notes)
    doc["experts"] = curves
    doc["int4_estimate"] = _int4_estimate([c for c in curves if "fit" in c], s)
    doc["allreduce"] = _allreduce(s, device, progress, notes)
    if drafter is not None:
        doc["drafter"] = _drafter_curve(s, drafter, device, progress)
    if s.attention:
        doc["attention"] = _attention_curve(s, device, progress, notes)
    doc["notes"] = notes
    return doc


def _expert_curves(s: Settings, device: Any, progress: Progress, notes: list[str]) -> list[dict[str, Any]]:
    """Each expert configuration's curve per weight format (``_expert_curve``); one that fails is kept as skipped,
    with why, and the others are measured."""
    import torch

    from moetrace.calibrate.experts import ExpertPool, weight_bytes_per_expert

    curves: list[dict[str, Any]] = []
    for config in expert_configs(s):
        for fmt in s.formats:
            bits = 8 if fmt == "fp8" else 16
            base: dict[str, Any] = {
                "config": config.name, "tp": config.tp, "ep": config.ep, "width": config.width,
                "experts_per_rank": config.pool, "format": fmt, "weight_bits": bits,
                "weight_bytes_per_expert": weight_bytes_per_expert(s.hidden, config.width, bits),
                "estimated": False,
            }
            # vLLM's kernel routes whole tokens top-k: the TP configs' grid (rows = top_k·tokens), bf16
            kernels = ["grouped-mm"] + (["vllm"] if s.vllm_kernel and fmt == "bf16" and config.ep == 1 else [])
            pool = None
            try:
                pool = ExpertPool(s.hidden, config.width, config.pool, fmt, device)
                for kernel in kernels:
                    curves.append(_expert_curve(pool, config, kernel, dict(base), s, progress, notes))
            except Exception as exc:  # the pool itself failing (memory) must not lose the other configs
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                curves.append({**base, "skipped": reason})
                notes.append(f"experts {config.name} {fmt}: {reason}")
            finally:
                del pool
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return curves


def _allreduce(s: Settings, device: Any, progress: Progress, notes: list[str]) -> dict[str, Any]:
    """The all-reduce's curve per world size (NCCL across GPUs; gloo across 2 CPU processes as a smoke test), each
    fitted per timing method; a world size that fails is kept as skipped, with why."""
    import torch

    from moetrace.calibrate.allreduce import measure_allreduce

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if s.max_gpus is not None:
        gpus = min(gpus, s.max_gpus)
    sizes = allreduce_sizes(s)
    allreduce: dict[str, Any] = {"gpus_present": torch.cuda.device_count() if device.type == "cuda" else 0,
                                 "measured": [], "skipped": None}
    if not s.allreduce:
        allreduce["skipped"] = "not asked for (--no-allreduce)"
    elif device.type == "cuda" and gpus < 2:
        allreduce["skipped"] = f"{gpus} GPU present: an all-reduce needs at least 2"
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        worlds = allreduce_world_sizes(gpus) if device.type == "cuda" else [2]
        if backend == "gloo":
            notes.append("all-reduce measured with gloo across 2 CPU processes: a smoke test, not a GPU figure")
        for world in worlds:
            label = f"all-reduce {world} {'GPUs' if backend == 'nccl' else 'processes'} ({backend})"
            done = [0]

            def tick_ar(label: str = label, done: list[int] = done) -> None:
                done[0] += 1
                progress(label, done[0], len(sizes))

            progress(label, 0, len(sizes))
            try:
                result = measure_allreduce(world, backend, [b for _, b in sizes], s.allreduce_iters,
                                           s.allreduce_replays, tick_ar, graph_sizes=len(s.allreduce_tokens))
            except Exception as exc:  # a failed group must not lose the expert curves
                allreduce["measured"].append({"world_size": world, "backend": backend, "skipped": str(exc)[:300]})
                notes.append(f"{label}: {exc}")
                continue
            allreduce["measured"].append(_fitted_allreduce(result, sizes, world, label, notes))
    allreduce["world_sizes_measured"] = [m["world_size"] for m in allreduce["measured"] if "fit" in m]
    return allreduce


def _fitted_allreduce(result: dict[str, Any], sizes: list[tuple[int | None, int]], world: int, label: str,
                      notes: list[str]) -> dict[str, Any]:
    """One world size's measurement with its points' token counts, a fit per timing method that covers every
    decode size, the GPU-side one as ``fit`` (CUDA graph, else calls queued ahead of the GPU, else the host-issued
    loop), and the bus bandwidth of its largest message."""
    for point, (tokens, _) in zip(result["points"], sizes):
        point["tokens"] = tokens
    decode = [p for p in result["points"] if p["tokens"] is not None]
    result["fits"] = {
        method: fit_allreduce([{"bytes": p["bytes"], "time_us": p[f"{method}_us"]} for p in decode], world)
        for method in ("eager", "queued", "graph")
        if decode and all(f"{method}_us" in p for p in decode)
    }
    preferred = next(m for m in ("graph", "queued", "eager") if m in result["fits"])
    result["fit"] = {**result["fits"][preferred], "timing": preferred}
    if result.get("graph_note"):
        notes.append(f"{label}: {result['graph_note']}")
    large = [p for p in result["points"] if p["tokens"] is None]
    if large:
        biggest = max(large, key=lambda p: p["bytes"])
        result["large_message_bus_bandwidth_gbs"] = (2 * (world - 1) / world * biggest["bytes"]
                                                     / (biggest["time_us"] * 1e3))
    return result


def _drafter_curve(s: Settings, drafter: tuple[str, DrafterShape], device: Any, progress: Progress) -> dict[str, Any]:
    """The drafter checkpoint's forward passes timed over ``s.drafter_tokens`` tokens."""
    from moetrace.calibrate.drafter import measure_drafter

    method, shape = drafter
    label = f"drafter {Path(str(s.drafter)).name} (tp{s.tp})"
    progress(label, 0, len(s.drafter_tokens))
    curve = measure_drafter(shape, device, s.drafter_tokens, s.reps, s.replays,
                            lambda done, total: progress(label, done, total))
    return {"method": method, "checkpoint": str(Path(str(s.drafter)).resolve()), "tp": s.tp, **curve}


def _attention_curve(s: Settings, device: Any, progress: Progress, notes: list[str]) -> dict[str, Any]:
    """MLA decode of one layer on one rank over ``s``'s (requests, query tokens, context) grid, the points whose
    latent cache fits 40% of the device's memory; kept as skipped, with why, where it fails."""
    import torch

    from moetrace.calibrate.attention import attention_grid, measure_attention

    cuda = device.type == "cuda"
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else 1 << 30
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    grid = attention_grid(s.attention_batches, s.attention_queries, s.attention_contexts, s.heads_per_rank,
                          s.kv_lora_rank, s.rope_dim, sms, 0.4 * memory)
    label = f"attention MLA ({s.heads_per_rank} heads a rank)"
    if not grid:
        notes.append(f"{label}: no point of the grid fits 40% of the device's memory")
        return {"skipped": "no point of the grid fits 40% of the device's memory"}
    progress(label, 0, len(grid))
    try:
        return measure_attention(s.heads_per_rank, s.kv_lora_rank, s.rope_dim, grid, device, s.reps,
                                 s.replays, lambda done, total: progress(label, done, total))
    except Exception as exc:  # a kernel or memory failure must not lose the other curves
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        notes.append(f"{label}: {reason}")
        progress(label, len(grid), len(grid))
        return {"skipped": reason}


def _drafter(s: Settings) -> tuple[str, DrafterShape] | None:
    """The drafter ``s`` names (its checkpoint folder): the method vLLM runs it with and its shape on one rank of
    TP ``s.tp``; ValueError in one line where it cannot be timed, before anything is measured."""
    from moetrace.calibrate.drafter import drafter_shape

    if s.drafter is None:
        return None
    folder = Path(s.drafter)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--drafter {folder}: not a drafter checkpoint, no readable config.json "
                         f"({type(exc).__name__})") from None
    shape = drafter_shape(config, s.tp)
    return ("eagle3" if shape.fc_input else "draft_model"), shape


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def digest_lines(doc: dict[str, Any]) -> list[str]:
    """A short plain-text digest of a calibration (what the device run prints last)."""
    lines = [f"device {doc['device'].get('name')} x{doc['device'].get('count')}, torch {doc['versions']['torch']}, "
             f"copy bandwidth {doc['copy_bandwidth_gbs']:.0f} GB/s"]
    for curve in doc["experts"] + doc["int4_estimate"]:
        head = (f"experts {curve['config']} {curve['format']:>4} width {curve['width']}"
                + (" vLLM fused_experts (table)" if curve.get("table") else ""))
        if "fit" not in curve:
            lines.append(f"{head}: skipped ({curve.get('skipped')})")
            continue
        fit = curve["fit"]
        lines.append(
            f"{head}: {fit['c0_us']:.1f} us + {fit['per_expert_us']:.2f} us/expert + {fit['per_row_us']:.3f} us/row"
            f"; marginal {curve['marginal_weight_gbs'] or 0:.0f} GB/s"
            + (f", peak {curve['peak_weight_gbs']:.0f} GB/s, R2 {fit['r2']:.3f}" if not curve["estimated"]
               else " (est.)"))
    if "drafter" in doc:
        drafter = doc["drafter"]
        points = {p["tokens"]: p for p in drafter["points"]}
        lines.append(f"drafter {drafter['method']} ({drafter['shape']['architecture']}, "
                     f"{drafter['parameters_per_rank'] / 1e6:.1f}M parameters per rank at tp{drafter['tp']}): "
                     + ", ".join(f"{t} token(s) {p['layers_us'] + p['head_us'] + p.get('fc_us', 0.0):.0f} us"
                                 for t, p in points.items() if t in (1, 8, 64, 512)))
    attention = doc.get("attention", {})
    if attention.get("points"):
        widest = max(attention["points"], key=lambda p: p["batch"] * p["context"])
        lines.append(f"attention MLA ({attention['heads_per_rank']} heads a rank, {attention['kernel']}): "
                     f"{len(attention['points'])} points, {widest['batch']} x {widest['context']:,} tokens "
                     f"x {widest['queries']} queries {widest['time_us']:.0f} us; fit misses at most "
                     f"{max(f['max_relative_miss'] for f in attention['fit']):.0%}")
    elif attention:
        lines.append(f"attention skipped: {attention['skipped']}")
    ar = doc["allreduce"]
    if ar.get("skipped"):
        lines.append(f"all-reduce skipped: {ar['skipped']}")
    for m in ar["measured"]:
        if "fit" not in m:
            lines.append(f"all-reduce {m['world_size']}: skipped ({m.get('skipped')})")
            continue
        f = m["fit"]
        for method, f in m["fits"].items():
            lines.append(f"all-reduce {m['world_size']} ({m['backend']}, {method}): {f['latency_us']:.1f} us + "
                         f"bytes/{f['bus_bandwidth_gbs'] or 0:.1f} GB/s (bus), R2 {f['r2']:.2f}")
        lines.append("  points (KiB: eager/queued/graph us) " + ", ".join(
            f"{p['bytes'] // 1024}:" + "/".join(f"{p[k]:.1f}" if k in p else "-"
                                               for k in ("eager_us", "queued_us", "graph_us"))
            for p in m["points"]))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moetrace.calibrate.run", description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--formats", default="bf16,fp8")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--max-gpus", type=int, default=None)
    parser.add_argument("--no-allreduce", action="store_true")
    parser.add_argument("--vllm-kernel", action="store_true")
    parser.add_argument("--no-attention", action="store_true")
    args = parser.parse_args(argv)
    command = "python -m moetrace.calibrate.run " + " ".join(sys.argv[1:] if argv is None else argv)
    common: dict[str, Any] = {"formats": tuple(args.formats.split(",")), "allreduce": not args.no_allreduce,
                              "max_gpus": args.max_gpus, "vllm_kernel": args.vllm_kernel,
                              "attention": not args.no_attention, "command": command}
    if args.quick:
        settings = Settings.quick_settings(args.device, **common)
    else:
        settings = Settings(device=args.device, tp=args.tp, ep=args.ep, **common)

    def show(label: str, done: int, total: int) -> None:
        if done == total or done % 5 == 0:
            print(f"[{done}/{total}] {label}", flush=True)

    doc = calibrate(settings, show)
    write_json(doc, args.out)
    print(f"wrote {args.out}", flush=True)
    for line in digest_lines(doc):
        print(line, flush=True)
    for note in doc["notes"]:
        print(f"note: {note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
