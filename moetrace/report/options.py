"""What ``moetrace report`` was asked, parsed and checked once by the command (``commands.report``): the one object
the report layer takes, from the traces it opens to where its dashboard goes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrace.analysis.profile import Profile
from moetrace.report.inputs import PredictionPreset


@dataclass(frozen=True)
class Options:
    traces: tuple[Path, ...]  # the TRACE arguments: traces, sweeps, or one budget sweep's folder
    k: int
    max_k: int
    coverage: float
    shape_preset: str | None
    tp: int | None
    ep: int | None
    placement_file: Path | None
    calibration: dict[str, Any] | None  # a moetrace-calibration/1 document
    calibration_path: Path | None
    profile: Profile | None
    acceptance: float | None  # per-draft acceptance rate given instead of the measured one
    routing: str  # "measured", or "uniform": unique experts of uniformly random routing
    batches: tuple[int, ...]  # concurrencies the decision is made for
    contexts: tuple[int, ...]  # --context: context lengths to decide at beside the recorded one
    preset: PredictionPreset | None  # the shipped deployment assumption, used without calibration/profile
    measured_baseline: bool  # --profile measured: the sweep's own k=0 step times instead of a profile
    k0_sync: Path | None  # --k0-sync: a k=0 trace recorded with async scheduling off
    ray: str | None  # --ray: an always-on recording's partitions summarised on this Ray cluster
    min_agreement: float  # a budget sweep: the least greedy agreement a budget must keep to be recommended
    dashboard: Path  # where the dashboard is written
    as_json: bool  # --json: the payload on stdout instead of the terminal's tables

    @property
    def predicts(self) -> bool:
        return self.calibration is not None or self.profile is not None
