"""Turning command-line inputs (trace paths, --k, --shape, --ep, --placement, the calibration and profile files) into
checked analysis parameters."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl

from moetrace.analysis.calibration import check_calibration
from moetrace.analysis.placement import explicit_placement, linear_placement, round_robin_placement
from moetrace.analysis.profile import PROFILE_PRESETS, Profile, parse_profile
from moetrace.analysis.shape import SHAPE_PRESETS, ModelShape
from moetrace.analysis.uncertainty import HeldOutErrors, interval_errors
from moetrace.errors import UserError
from moetrace.trace.reader import Trace, open_traces, run_path


@dataclass(frozen=True)
class PredictionPreset:
    """A deployment to predict for when the user gives no calibration or profile: a calibration shipped with
    moetrace, a profile preset, a shape preset and a tensor-parallel size."""

    name: str
    calibration_file: str
    profile: str
    shape: str
    tp: int
    description: str

    @property
    def label(self) -> str:
        return f"{self.name} ({self.description})"

    def calibration(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((Path(__file__).parents[1] / "data" / self.calibration_file).read_text())
        return doc


def held_out_errors() -> HeldOutErrors:
    """The committed record of the prediction's misses at held-out concurrencies (``tools/prediction_errors.py``
    writes it from the speedup validations' results), as the intervals take them: the blind
    cells, or all while they are too few (``interval_errors``; its ``basis`` says which)."""
    document = json.loads((Path(__file__).parents[1] / "data" / "prediction-errors.json").read_text())
    return interval_errors(document["cells"])


DEFAULT_PREDICTION = PredictionPreset(
    name="h200-kimi-k2-tp8",
    calibration_file="calibration-h200.json",
    profile="kimi-k2-tp8",
    shape="kimi-k2",
    tp=8,
    description="as Kimi-K2 with int4 experts on 8 H200s, TP=8: expert and all-reduce curves measured on 2 H200s "
                "(all-reduce extrapolated to 8), step shares of a measured Kimi-K2.5 decode step",
)


def read_calibration(path: Path | None) -> dict[str, Any] | None:
    """The calibration at ``path`` (``moetrace calibrate``'s JSON), checked; None without one."""
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        check_calibration(doc)
    except OSError as exc:
        raise UserError(f"{path}: cannot read calibration ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise UserError(f"{path}: not a moetrace calibration ({exc})") from None
    return doc


def read_profile(text: str | None) -> Profile | None:
    """``--profile``: a preset, a JSON file, or the breakdown written out; None without one."""
    if text is None:
        return None
    path = Path(text)
    if text not in PROFILE_PRESETS and path.suffix == ".json":
        try:
            text = path.read_text()
        except OSError as exc:
            raise UserError(f"--profile {path}: cannot read ({exc.strerror})") from None
    try:
        return parse_profile(text)
    except ValueError as exc:
        raise UserError(f"--profile: {exc}") from None


@dataclass
class Run:
    """One TRACE argument: a trace, or a sweep of traces over k; ``primary`` is the one analysed at --k."""

    path: Path
    traces: list[Trace]
    primary: Trace
    routing_rows: dict[int, int]  # routing rows per k

    @property
    def label(self) -> str:
        return self.path.name or str(self.path)

    @property
    def warnings(self) -> list[str]:
        return [warning for trace in self.traces for warning in trace.warnings]


def open_run(path: Path, k: int) -> Run:
    """Open a trace or sweep (or the folder holding one: ``moetrace.trace.reader.run_path``); the primary trace is
    the one recorded at ``k``, else the one with the largest k."""
    path = run_path(path) if path.exists() else path
    traces = open_traces(path)
    rows = {trace.k: int(trace.routing().select(pl.len()).collect().item()) for trace in traces}
    for trace in traces:
        if rows[trace.k] == 0:
            raise UserError(f"{trace.path}: trace has no routing rows (no readable routing/*.parquet)")
    exact = [trace for trace in traces if trace.k == k]
    return Run(path=path, traces=traces, primary=exact[0] if exact else traces[-1], routing_rows=rows)


def model_shape(trace: Trace, preset: str | None) -> ModelShape:
    """The manifest's shape (``unpriced_format`` set where the cost model cannot count its experts' bytes), or a
    named preset (checked to route over the same experts as the trace)."""
    if preset is not None and preset not in SHAPE_PRESETS:
        raise UserError(f"--shape {preset}: unknown preset (known: {', '.join(sorted(SHAPE_PRESETS))})")
    if preset is None:
        return ModelShape.from_manifest(trace.manifest)
    shape = SHAPE_PRESETS[preset]
    model = trace.manifest.model
    if (shape.num_experts, shape.top_k) != (model.num_experts, model.top_k):
        raise UserError(
            f"--shape {preset}: {shape.num_experts} experts top-{shape.top_k}, but {trace.path} routes over "
            f"{model.num_experts} experts top-{model.top_k}"
        )
    return shape


def parallel_size(recorded: int, name: str, override: int | None) -> int:
    """``--tp`` / ``--ep`` as given, else as recorded; at least 1."""
    value = override if override is not None else recorded
    if value < 1:
        raise UserError(f"--{name} {value}: must be at least 1")
    return value


def expert_placement(trace: Trace, ep: int, placement_file: Path | None) -> npt.NDArray[np.int64]:
    """Rank of every expert: from ``placement_file`` (JSON ``{"expert_to_rank": [...]}`` or a bare list), from a
    list in the manifest, else linear over ``ep`` ranks."""
    num_experts = trace.manifest.model.num_experts
    source: Any = trace.manifest.parallel.expert_placement
    where = f"{trace.path} manifest"
    if placement_file is not None:
        where = str(placement_file)
        try:
            source = json.loads(placement_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{placement_file}: unreadable placement ({exc})") from None
    if isinstance(source, dict):
        source = source.get("expert_to_rank")
    if source in (None, "linear"):
        return linear_placement(num_experts, ep)
    if source == "round_robin":
        return round_robin_placement(num_experts, ep)
    if not isinstance(source, list) or not all(isinstance(rank, int) for rank in source):
        raise UserError(f"{where}: placement must be \"linear\", \"round_robin\" or a list of one rank per expert")
    try:
        return explicit_placement(source, num_experts)
    except ValueError as exc:
        raise UserError(f"{where}: {exc}") from None
