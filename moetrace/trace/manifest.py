"""The manifest: how it is written, and how readers see it.

Writing: every process that adds to a trace's ``manifest.json`` goes through ``start_manifest`` (the worker, as
recording starts), ``closed_manifest`` (the writer process, at close) or ``amend_manifest`` (the driver: vLLM's
counters, telemetry); each writes only the sections of ``MANIFEST_SECTIONS``, atomically.
Reading: typed sections (see docs/trace-format.md), checked once when a trace is opened; ``document`` keeps the JSON
as written, for output and for comparing runs key by key."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrace.trace.schema import MANIFEST_NAME, REQUIRED_MANIFEST_KEYS, SCHEMA_VERSION, SOURCE_LACKS

# Every top-level section a manifest may hold (docs/trace-format.md says what each holds and who writes it).
MANIFEST_SECTIONS = frozenset({
    # as recording starts (the worker) or an import begins
    "schema", "run_id", "complete", "start_time", "versions", "model", "parallel", "spec", "capture", "workload",
    "host", "source",
    # at close (the writer process)
    "end_time", "end", "error", "counts", "requests", "capture_mechanisms", "engine_thread_us_per_step", "phases",
    "partition",
    # after close (the process that drove the engine)
    "vllm_counters", "telemetry",
})


def _write(root: Path, document: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``document``'s sections and replace ``root``'s manifest with it, so that readers never see a half-written
    file."""
    unknown = sorted(set(document) - MANIFEST_SECTIONS)
    if unknown:
        raise ValueError(f"not a manifest section: {', '.join(unknown)}")
    if document.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"a manifest is written at schema {SCHEMA_VERSION}, not {document.get('schema')!r}")
    path = root / MANIFEST_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return dict(document)


def start_manifest(root: Path, **sections: Any) -> dict[str, Any]:
    """Write the manifest of a trace whose recording starts now (``complete: false`` until it closes)."""
    return _write(root, {"schema": SCHEMA_VERSION, "complete": False,
                         "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **sections})


def closed_manifest(root: Path, document: Mapping[str, Any], *, counts: Mapping[str, int], requests: list[str],
                    error: str | None, **sections: Any) -> dict[str, Any]:
    """Write ``document`` as a closed trace's manifest: complete unless ``error`` says why recording stopped."""
    closed = {**document, **sections, "counts": dict(counts), "requests": requests, "complete": error is None,
              "end_time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if error is not None:
        closed["error"] = error
    return _write(root, closed)


def amend_manifest(root: Path, **sections: Any) -> dict[str, Any]:
    """Set ``sections`` in the manifest already at ``root`` (vLLM's counters, telemetry, or why a writer that died
    could not close it)."""
    return _write(root, {**json.loads((root / MANIFEST_NAME).read_text()), **sections})


@dataclass(frozen=True)
class ModelInfo:
    """What was recorded: the routed experts and layers, and the rest of ``model`` as written (``fields``)."""

    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    hidden_size: int
    num_layers: int | None
    name: str | None
    random_weights: bool
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class SpecInfo:
    method: str | None  # the drafter (ngram, mtp, …); None without speculation
    k: int
    # per draft position, the unconditional acceptance vLLM's synthetic rejection sampling was set to (None: the
    # drafter's own, decided by the target model): a synthetic trace's acceptance is no drafter's
    synthetic_rates: tuple[float, ...] | None = None
    # the engine chose how many of the drafter's k drafts each request-step verified (``spec.adaptive_verification``:
    # vLLM's ``enable_adaptive_verification``, DSpark's confidence-scheduled verification): a request-step's
    # ``num_drafts`` is the schedule's choice, not the drafter's, and ``k`` the most it could choose
    adaptive: bool = False


def synthetic_rates(spec: Mapping[str, Any]) -> tuple[float, ...] | None:
    """The manifest's ``spec.acceptance.rates`` where it says ``set_by: synthetic``; None otherwise."""
    acceptance = spec.get("acceptance") or {}
    if acceptance.get("set_by") != "synthetic":
        return None
    return tuple(float(rate) for rate in acceptance["rates"])


@dataclass(frozen=True)
class ParallelInfo:
    tp: int
    ep: int
    dp: int
    dp_rank: int
    dp_ranks: tuple[int, ...]  # a merged data-parallel recording: every rank's; else this one's
    expert_placement: Any  # "linear", or the rank of every expert as vLLM placed them


@dataclass(frozen=True)
class BudgetInfo:
    """The expert budget a recording enforced in verification: per MoE layer, over a step's verifying tokens
    (``scope`` step) or each request's window (``window``)."""

    scope: str
    per_layer: Mapping[int, int]


@dataclass(frozen=True)
class CaptureInfo:
    candidates: int  # top-C experts kept per token beside the routed ones (0: none)
    token_ids: bool
    async_scheduling: bool | None  # None where the recorder did not say (an imported trace)
    budget: BudgetInfo | None  # None: the router's own routing
    on_gpu: bool  # the rows came off a GPU (``host_copy`` other than ``host``)
    # routing rows of one request in this many (``sampled.one_request_in``; steps rows of every request): 1 = all
    one_request_in: int = 1


@dataclass(frozen=True)
class HostInfo:
    """The machine that recorded: its CPU model and the GPUs NVML listed (none off NVIDIA)."""

    cpu: str | None
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class SourceInfo:
    """Where an imported trace's rows came from, and what that source could not know."""

    engine: str
    format: str
    holds: str
    lacks: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    schema: str
    run_id: str | None
    complete: bool
    error: str | None
    model: ModelInfo
    spec: SpecInfo
    parallel: ParallelInfo
    capture: CaptureInfo
    counts: Mapping[str, int]
    requests: tuple[str, ...]
    phases: Mapping[str, Any]  # per timed call and batch: calls, host and device medians
    source: SourceInfo | None
    host: HostInfo
    batch_size: int | None  # the requests ``moetrace record --batch-size`` allowed at once (None: not recorded)
    document: Mapping[str, Any]

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> Manifest:
        """The typed manifest of a parsed ``manifest.json``; ``ValueError`` with one line naming what is wrong (an
        unknown schema version, a missing required key, a value of the wrong type)."""
        if document.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"unknown schema version {document.get('schema')!r} "
                             f"(this moetrace reads {SCHEMA_VERSION})")
        for dotted in REQUIRED_MANIFEST_KEYS:
            node: Any = document
            for part in dotted.split("."):
                if not isinstance(node, Mapping) or part not in node:
                    raise ValueError(f"manifest lacks {dotted!r}")
                node = node[part]
        model, spec = document["model"], document["spec"]
        parallel, capture = document["parallel"], document.get("capture") or {}
        source = document.get("source")
        host, workload = document.get("host") or {}, document.get("workload") or {}
        try:
            dp_rank = int(parallel.get("dp_rank") or 0)
            return cls(
                schema=str(document["schema"]), run_id=document.get("run_id"),
                complete=bool(document["complete"]), error=document.get("error"),
                model=ModelInfo(
                    num_experts=int(model["num_experts"]), top_k=int(model["top_k"]),
                    moe_layers=tuple(int(layer) for layer in model["moe_layers"]),
                    hidden_size=int(model["hidden_size"]),
                    num_layers=None if model.get("num_layers") is None else int(model["num_layers"]),
                    name=model.get("name"), random_weights=bool(model.get("random_weights", False)), fields=model),
                spec=SpecInfo(method=spec["method"], k=int(spec["k"]), synthetic_rates=synthetic_rates(spec),
                             adaptive=bool(spec.get("adaptive_verification", False))),
                parallel=ParallelInfo(
                    tp=int(parallel["tp"] or 1), ep=int(parallel["ep"] or 1), dp=int(parallel.get("dp") or 1),
                    dp_rank=dp_rank, dp_ranks=tuple(int(r) for r in parallel.get("dp_ranks") or [dp_rank]),
                    expert_placement=parallel.get("expert_placement", "linear")),
                capture=CaptureInfo(candidates=int(capture.get("candidates") or 0),
                                    token_ids=bool(capture.get("token_ids", True)),
                                    async_scheduling=capture.get("async_scheduling"),
                                    budget=None if capture.get("budget") is None else BudgetInfo(
                                        scope=str(capture["budget"]["scope"]),
                                        per_layer={int(layer): int(size)
                                                   for layer, size in capture["budget"]["per_layer"].items()}),
                                    on_gpu=capture.get("host_copy") not in (None, "host"),
                                    one_request_in=int((capture.get("sampled") or {}).get("one_request_in", 1))),
                counts={str(key): int(value or 0) for key, value in (document.get("counts") or {}).items()},
                requests=tuple(str(r) for r in document.get("requests") or []),
                phases=document.get("phases") or {},
                source=None if source is None else SourceInfo(
                    engine=str(source["engine"]), format=str(source["format"]), holds=str(source["holds"]),
                    lacks=tuple(str(what) for what in source["lacks"])),
                host=HostInfo(cpu=host.get("cpu"), gpus=tuple(str(gpu) for gpu in host.get("gpus") or [])),
                batch_size=None if workload.get("batch_size") is None else int(workload["batch_size"]),
                document=document,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"manifest has a malformed value ({type(exc).__name__}: {exc})") from None

    @property
    def acceptance_set_by(self) -> str:
        """Who decided which drafts were kept: ``synthetic`` (vLLM's synthetic rejection sampling, at set rates) or
        ``drafter`` (the target model verifying the drafter's tokens)."""
        return "drafter" if self.spec.synthetic_rates is None else "synthetic"

    def lacks(self, what: str) -> bool:
        """Whether the trace's source could not know ``what`` (one of ``SOURCE_LACKS``: an imported trace)."""
        if what not in SOURCE_LACKS:
            raise ValueError(f"unknown source field {what!r}")
        return self.source is not None and what in self.source.lacks
