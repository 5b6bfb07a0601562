"""What a recording is asked to do: the options ``moetrace record`` passes to the plugin in ``MOETRACE_RECORD`` (as
JSON), or a user sets by hand under ``vllm serve`` (JSON, or a bare output directory). Plain Python: the CLI side
builds them without importing vLLM or torch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from moetrace.trace.manifest import Manifest

AT_CAP = ("drop-oldest", "stop")  # what always-on recording does at its disk cap (``moetrace.trace.partitions``)
BUDGET_SCOPES = ("step", "window")  # a budget limits a step's verifying tokens together, or each request's window


@dataclass(frozen=True)
class RecordingOptions:
    """One recording's options; every field but ``out`` has a default."""

    out: str  # the trace directory (under data parallelism, each rank's ``dp<r>/`` beneath it)
    run_id: str | None = None  # default: the directory's name and the start time
    model_name: str | None = None  # what the manifest calls the model (default: vLLM's model path)
    random_weights: bool = False  # dummy weights: the manifest says so, the report warns
    candidates: int = 0  # also keep each token's top-C experts by router score
    token_ids: bool = True  # keep each row's token id
    recompute_from_logits: bool = False  # routing recomputed from the router logits in every layer (a cross-check)
    time_phases_every: int | None = None  # time vLLM's calls on one step in N (default: the recorder's)
    rotate_seconds: float = 10.0  # start a new Parquet file at least this often: a killed run loses at most this
    steps: int | None = None  # under ``vllm serve``: record the first N engine steps, then close the trace
    seconds: float | None = None  # likewise for the first S seconds
    workload: dict[str, Any] = field(default_factory=dict)  # the prompts and sampling, copied into the manifest
    # limit the experts of verification steps: one budget for every MoE layer, or one per layer ({"3": 16, ...});
    # per step's verifying tokens, or per request window (``budget_scope``)
    budget: int | dict[str, int] | None = None
    budget_scope: str = "step"
    # route as the trace at this path routed (``hooks.replay``: a model with dummy weights, routed as a trained one)
    replay_routing: str | None = None
    # serve live metrics (``moetrace.writer.metrics``) at this port (data-parallel rank r: port + r)
    metrics_port: int | None = None
    # always on under ``vllm serve`` (``moetrace.trace.partitions``): a complete trace every this many seconds,
    # in <out>/date=YYYY-MM-DD/hour=HH/ (a shorter period: .../start=HHMMSS/), until shutdown
    partition_seconds: float | None = None
    # the most the partitions under ``out`` may hold; there, ``at_cap``: "drop-oldest" partitions, or "stop" recording
    disk_cap_bytes: int | None = None
    at_cap: str = "drop-oldest"
    # sampled under ``vllm serve`` (``moetrace.hooks.sampling``): a burst of this many request steps every
    # ``sample_every_seconds`` (from one burst's first step to the next's); the steps between run unrecorded
    sample_steps: int | None = None
    sample_every_seconds: float | None = None
    # or one request in this many (chosen by its vLLM id: ``moetrace.trace.files.sampled_request``) has its routing
    # rows recorded; every request's steps rows are
    sample_requests: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.out, str) or not self.out:
            raise ValueError("'out' must name the trace directory")
        for name in ("candidates", "time_phases_every", "steps", "sample_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name!r} must be a non-negative integer, got {value!r}")
        budgets = [self.budget] if isinstance(self.budget, int) else list((self.budget or {}).values())
        if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in budgets):
            raise ValueError(f"'budget' must be a positive integer or a map of layer to one, got {self.budget!r}")
        if self.budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"'budget_scope' must be one of {', '.join(BUDGET_SCOPES)}, got {self.budget_scope!r}")
        if self.metrics_port is not None and (not isinstance(self.metrics_port, int) or isinstance(
                self.metrics_port, bool) or not 1 <= self.metrics_port <= 65535):
            raise ValueError(f"'metrics_port' must be a port number (1-65535), got {self.metrics_port!r}")
        for name in ("rotate_seconds", "seconds", "partition_seconds", "sample_every_seconds"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name!r} must be a positive number, got {value!r}")
        if self.partition_seconds is not None:
            if self.partition_seconds < 1:
                raise ValueError(f"'partition_seconds' must be at least 1, got {self.partition_seconds!r}")
            if self.steps is not None or self.seconds is not None:
                raise ValueError("'partition_seconds' records until shutdown: drop 'steps' and 'seconds'")
        if self.disk_cap_bytes is not None and (not isinstance(self.disk_cap_bytes, int) or isinstance(
                self.disk_cap_bytes, bool) or self.disk_cap_bytes < 1 or self.partition_seconds is None):
            raise ValueError(f"'disk_cap_bytes' must be a positive integer beside 'partition_seconds', got "
                             f"{self.disk_cap_bytes!r}")
        if (self.sample_steps is None) != (self.sample_every_seconds is None) or self.sample_steps == 0:
            raise ValueError("a sampled recording takes both 'sample_steps' (at least 1) and 'sample_every_seconds'")
        if self.sample_steps is not None and (self.steps is not None or self.seconds is not None):
            raise ValueError("a sampled recording runs until shutdown: drop 'steps' and 'seconds'")
        if self.sample_requests is not None and (not isinstance(self.sample_requests, int)
                                                 or isinstance(self.sample_requests, bool) or self.sample_requests < 2):
            raise ValueError(f"'sample_requests' must be an integer of at least 2 (one request in N), got "
                             f"{self.sample_requests!r}")
        if self.sample_requests is not None and self.sample_steps is not None:
            raise ValueError("one sampling policy at a time: 'sample_steps' (bursts of steps) or 'sample_requests' "
                             "(one request in N)")
        if self.at_cap not in AT_CAP:
            raise ValueError(f"'at_cap' must be one of {', '.join(AT_CAP)}, got {self.at_cap!r}")

    @classmethod
    def from_text(cls, raw: str) -> RecordingOptions:
        """Options from ``MOETRACE_RECORD``: a JSON object, or a bare output directory. Unknown keys, a value of
        the wrong type or malformed JSON raise ``ValueError`` naming what is wrong."""
        if not raw.lstrip().startswith("{"):
            return cls(out=raw)
        given = json.loads(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "out" not in given:
            raise ValueError("'out' must name the trace directory")
        return cls(**given)

    def to_text(self) -> str:
        """The JSON that ``from_text`` reads back."""
        return json.dumps(dataclasses.asdict(self))

    def engine_changes(self, other: RecordingOptions) -> list[str]:
        """The options ``other`` changes that only a new engine could take (the hooks, CUDA graphs and any replay
        are built once per engine)."""
        fixed = ("candidates", "token_ids", "recompute_from_logits", "replay_routing", "budget_scope")
        return [name for name in fixed if getattr(other, name) != getattr(self, name)]


class UnsupportedRunner(RuntimeError):
    """The worker's engine is one moetrace cannot record from as the options ask."""


def replay_refusal(manifest: Manifest, num_experts: int, top_k: int) -> str | None:
    """Why a trace with ``manifest`` cannot route a model of ``num_experts`` experts and top-``top_k``
    (``replay_routing``), None where it can: checked by ``moetrace record`` before an engine starts, and by the
    worker, which ``vllm serve`` reaches directly."""
    if manifest.model.num_experts != num_experts:
        return f"its model has {manifest.model.num_experts} experts, this one {num_experts}"
    if manifest.capture.candidates < top_k:
        return (f"it keeps {manifest.capture.candidates} candidates per token; replaying needs at least the model's "
                f"top-{top_k} (record it with --candidates)")
    return None
