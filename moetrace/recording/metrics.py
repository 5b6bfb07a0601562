"""Live metrics of a recording (``metrics_port`` in ``MOETRACE_RECORD``), served on a Prometheus endpoint of its own
by the writer process, from the steps it writes: nothing runs in the engine for them.

The series count is bounded whatever the model: the MoE layers are cut into at most ``LAYER_GROUPS`` groups of
consecutive layers, and no series is per expert (``series_bound``). For Kimi-K2 (60 MoE layers, k = 4) that is 66
series per data-parallel rank (``_created`` series are off), against 61 layers x 384 experts per rank for
per-expert counters.

- ``moetrace_draft_tokens_total``, ``moetrace_accepted_tokens_total``: drafts verified and accepted (vLLM's
  ``spec_decode_num_draft_tokens`` and ``num_accepted_tokens`` over the recorded steps);
- ``moetrace_drafts_at_position_total`` and ``moetrace_accepted_at_position_total`` by ``position`` 1..k: acceptance
  by draft position is their ratio;
- ``moetrace_unique_experts_per_verify_step`` by ``layers``: per step that verified drafts, the unique experts its
  tokens read in a layer, averaged over the group's layers (a histogram);
- ``moetrace_expert_load_imbalance`` by ``layers``: over the last ``IMBALANCE_STEPS`` decode and verification steps,
  the busiest expert's picks over the mean expert's, averaged over the group's layers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from moetrace.trace.files import StepCapture
from moetrace.trace.schema import TOKEN_PHASES

LAYER_GROUPS = 4
IMBALANCE_STEPS = 64
UNIQUE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
PREFILL = TOKEN_PHASES.index("prefill")
PORT_WAIT_SECONDS = 5.0


def layer_groups(moe_layers: Sequence[int], groups: int = LAYER_GROUPS) -> list[tuple[str, npt.NDArray[np.int64]]]:
    """The recorded layers cut into at most ``groups`` runs of consecutive ones: each run's label (``"3-17"``) and
    its slots in the trace's layer order."""
    slots = np.array_split(np.arange(len(moe_layers)), min(groups, len(moe_layers)))
    return [(f"{moe_layers[part[0]]}-{moe_layers[part[-1]]}", part) for part in slots if len(part)]


def series_bound(groups: int, max_k: int) -> int:
    """Series the endpoint can hold: 2 counters, 2 per draft position, and per layer group a histogram (its buckets,
    +Inf, sum and count) and a gauge."""
    return 2 + 2 * max_k + groups * (len(UNIQUE_BUCKETS) + 3 + 1)


class LiveMetrics:
    """The metrics of one recording in ``registry``; ``observe`` takes each batch of steps as it is written."""

    def __init__(self, moe_layers: Sequence[int], num_experts: int, max_k: int, registry: CollectorRegistry) -> None:
        self.groups = layer_groups(moe_layers)
        self.num_experts = num_experts
        self.drafts = Counter("moetrace_draft_tokens", "Draft tokens verified in the recorded steps",
                              registry=registry)
        self.accepted = Counter("moetrace_accepted_tokens", "Draft tokens accepted in the recorded steps",
                                registry=registry)
        self.drafts_at = Counter("moetrace_drafts_at_position", "Drafts verified at each draft position",
                                 ["position"], registry=registry)
        self.accepted_at = Counter("moetrace_accepted_at_position", "Drafts accepted at each draft position",
                                   ["position"], registry=registry)
        self.unique = Histogram("moetrace_unique_experts_per_verify_step",
                                "Unique experts a verification step's tokens read in a layer, averaged over the "
                                "layer group", ["layers"], buckets=UNIQUE_BUCKETS, registry=registry)
        self.imbalance = Gauge("moetrace_expert_load_imbalance",
                               f"Busiest expert's picks over the mean expert's in the last {IMBALANCE_STEPS} decode "
                               "and verification steps, averaged over the layer group", ["layers"], registry=registry)
        for position in range(1, max_k + 1):  # every series exists from the start, at 0: the bound holds at once
            self.drafts_at.labels(position=str(position))
            self.accepted_at.labels(position=str(position))
        for label, _ in self.groups:
            self.unique.labels(layers=label)
            self.imbalance.labels(layers=label)
        self._loads = np.zeros((len(moe_layers), num_experts), dtype=np.int64)  # [L, E] picks since the last gauge
        self._load_steps = 0

    def observe(self, captures: Sequence[StepCapture]) -> None:
        for capture in captures:
            # T tokens, L layers, K top-k
            drafted = capture.accepted >= 0  # [T]
            self.drafts.inc(int(drafted.sum()))
            self.accepted.inc(int((capture.accepted == 1).sum()))
            for position in np.unique(capture.draft_pos[drafted]):
                at = drafted & (capture.draft_pos == position)
                self.drafts_at.labels(position=str(int(position))).inc(int(at.sum()))
                self.accepted_at.labels(position=str(int(position))).inc(int((capture.accepted[at] == 1).sum()))
            served = capture.phase != PREFILL  # [T] decode and verification tokens
            if not served.any():
                continue
            experts = capture.experts[served].astype(np.int64)  # [T', L, K]
            if drafted.any():
                unique = [len(np.unique(experts[:, layer])) for layer in range(experts.shape[1])]  # [L]
                for label, slots in self.groups:
                    self.unique.labels(layers=label).observe(float(np.mean([unique[s] for s in slots])))
            for layer in range(experts.shape[1]):
                np.add.at(self._loads[layer], experts[:, layer].ravel(), 1)
            self._load_steps += 1
            if self._load_steps == IMBALANCE_STEPS:
                self._set_imbalance()

    def _set_imbalance(self) -> None:
        mean = self._loads.sum(axis=1) / self.num_experts  # [L]
        ratio = np.where(mean > 0, self._loads.max(axis=1) / np.maximum(mean, 1e-12), 0.0)  # [L]
        for label, slots in self.groups:
            self.imbalance.labels(layers=label).set(float(ratio[slots].mean()))
        self._loads[:] = 0
        self._load_steps = 0


def serve_metrics(port: int, moe_layers: Sequence[int], num_experts: int, max_k: int) -> LiveMetrics:
    """``LiveMetrics`` in a registry of their own, served at ``http://0.0.0.0:<port>/metrics``."""
    # the writer process's own setting: no ``_created`` series beside each counter and histogram
    disable_created_metrics()  # type: ignore[no-untyped-call]
    registry = CollectorRegistry()
    metrics = LiveMetrics(moe_layers, num_experts, max_k, registry)
    deadline = time.monotonic() + PORT_WAIT_SECONDS
    while True:  # the last partition's writer process may hold the port for a moment after it closed its trace
        try:
            start_http_server(port, registry=registry)
            return metrics
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
