"""The manifest as readers see it: typed sections over ``manifest.json`` (see docs/trace-format.md), checked once
when a trace is opened. ``document`` keeps the JSON as written, for output and for comparing runs key by key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moetrace.trace.schema import REQUIRED_MANIFEST_KEYS, SCHEMA_VERSION, SOURCE_LACKS


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


@dataclass(frozen=True)
class ParallelInfo:
    tp: int
    ep: int
    dp: int
    dp_rank: int
    dp_ranks: tuple[int, ...]  # a merged data-parallel recording: every rank's; else this one's
    expert_placement: Any  # "linear", or the rank of every expert as vLLM placed them


@dataclass(frozen=True)
class CaptureInfo:
    candidates: int  # top-C experts kept per token beside the routed ones (0: none)
    token_ids: bool
    async_scheduling: bool | None  # None where the recorder did not say (an imported trace)


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
                spec=SpecInfo(method=spec["method"], k=int(spec["k"])),
                parallel=ParallelInfo(
                    tp=int(parallel["tp"] or 1), ep=int(parallel["ep"] or 1), dp=int(parallel.get("dp") or 1),
                    dp_rank=dp_rank, dp_ranks=tuple(int(r) for r in parallel.get("dp_ranks") or [dp_rank]),
                    expert_placement=parallel.get("expert_placement", "linear")),
                capture=CaptureInfo(candidates=int(capture.get("candidates") or 0),
                                    token_ids=bool(capture.get("token_ids", True)),
                                    async_scheduling=capture.get("async_scheduling")),
                counts={str(key): int(value or 0) for key, value in (document.get("counts") or {}).items()},
                requests=tuple(str(r) for r in document.get("requests") or []),
                phases=document.get("phases") or {},
                source=None if source is None else SourceInfo(
                    engine=str(source["engine"]), format=str(source["format"]), holds=str(source["holds"]),
                    lacks=tuple(str(what) for what in source["lacks"])),
                document=document,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"manifest has a malformed value ({type(exc).__name__}: {exc})") from None

    def lacks(self, what: str) -> bool:
        """Whether the trace's source could not know ``what`` (one of ``SOURCE_LACKS``: an imported trace)."""
        if what not in SOURCE_LACKS:
            raise ValueError(f"unknown source field {what!r}")
        return self.source is not None and what in self.source.lacks
