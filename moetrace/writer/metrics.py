"""Live metrics of a recording (``metrics_port`` in ``MOETRACE_RECORD``), served on a Prometheus endpoint of its own
by the writer process, from the steps it writes: nothing runs in the engine for them.

They live as long as the server, not as one writer process: an always-on recording starts a writer process per
partition, so the values are kept in memory that the engine process creates once (``MetricsState``) and hands to
each partition's writer process. Counters stay monotone across partition switches and the load gauges keep the
steps counted towards their next reading, as Prometheus expects of one process (a counter that fell at each switch
would read as a restart).

The series count is bounded whatever the model: the MoE layers are cut into at most ``LAYER_GROUPS`` groups of
consecutive layers, and no series is per expert (``series_bound``). For Kimi-K2 (60 MoE layers, k = 4) that is 66
series per data-parallel rank (no ``_created`` series), against 61 layers x 384 experts per rank for per-expert
counters.

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

import contextlib
import fcntl
import mmap
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from moetrace.trace.files import StepCapture
from moetrace.trace.schema import TOKEN_PHASES

LAYER_GROUPS = 4
IMBALANCE_STEPS = 64
UNIQUE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
PREFILL = TOKEN_PHASES.index("prefill")


def layer_groups(moe_layers: Sequence[int], groups: int = LAYER_GROUPS) -> list[tuple[str, npt.NDArray[np.int64]]]:
    """The recorded layers cut into at most ``groups`` runs of consecutive ones: each run's label (``"3-17"``) and
    its slots in the trace's layer order."""
    slots = np.array_split(np.arange(len(moe_layers)), min(groups, len(moe_layers)))
    return [(f"{moe_layers[part[0]]}-{moe_layers[part[-1]]}", part) for part in slots if len(part)]


def series_bound(groups: int, max_k: int) -> int:
    """Series the endpoint can hold: 2 counters, 2 per draft position, and per layer group a histogram (its buckets,
    +Inf, sum and count) and a gauge."""
    return 2 + 2 * max_k + groups * (len(UNIQUE_BUCKETS) + 3 + 1)


class MetricsState:
    """The values behind a recording's live metrics, in memory (a memfd) that outlives each writer process: the
    engine process ``create``s it once, each partition's writer process maps the same memory (``MetricsState(fd,
    ...)``) and changes it under ``locked``. Values are float64 (counts stay exact below 2^53).

    # L recorded MoE layers, E experts, G layer groups, k draft positions, U histogram buckets (+Inf included)
    """

    def __init__(self, fd: int, num_layers: int, num_experts: int, max_k: int) -> None:
        groups = min(LAYER_GROUPS, num_layers)
        shapes = {
            "tokens": (2,),                                          # drafts, accepted
            "at_position": (2, max_k),                               # [2, k] drafts, accepted at positions 1..k
            "unique_buckets": (groups, len(UNIQUE_BUCKETS) + 1),     # [G, U] observations per bucket, not cumulative
            "unique_sum": (groups,),                                 # [G]
            "imbalance": (groups,),                                  # [G] the gauges
            "load_steps": (1,),                                      # steps counted towards the next imbalance reading
            "loads": (num_layers, num_experts),                      # [L, E] picks in those steps
        }
        self.fd = fd
        self.memory = mmap.mmap(fd, self.nbytes(num_layers, num_experts, max_k))
        self.arrays: dict[str, npt.NDArray[np.float64]] = {}
        offset = 0
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            self.arrays[name] = np.frombuffer(self.memory, np.float64, size, offset * 8).reshape(shape)
            offset += size
        self._thread_lock = threading.Lock()  # the HTTP server's thread reads while the writer's loop observes

    @staticmethod
    def nbytes(num_layers: int, num_experts: int, max_k: int) -> int:
        groups = min(LAYER_GROUPS, num_layers)
        return 8 * (2 + 2 * max_k + groups * (len(UNIQUE_BUCKETS) + 1 + 2) + 1 + num_layers * num_experts)

    @classmethod
    def create(cls, num_layers: int, num_experts: int, max_k: int) -> MetricsState:
        """Zeroed state in a new memfd (inherited by the writer processes started with it in ``pass_fds``)."""
        fd = os.memfd_create("moetrace-metrics")
        try:
            os.ftruncate(fd, cls.nbytes(num_layers, num_experts, max_k))
            return cls(fd, num_layers, num_experts, max_k)
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, npt.NDArray[np.float64]]]:
        """The arrays, held against other processes (a POSIX record lock: an old partition's writer process may
        still write its last steps while the next one writes its first) and other threads."""
        with self._thread_lock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield self.arrays
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.arrays.clear()
        self.memory.close()
        os.close(self.fd)


class LiveMetrics:
    """The metrics of one recording, kept in ``state`` and exposed in ``registry``; ``observe`` takes the steps of
    each write as they are written."""

    def __init__(self, moe_layers: Sequence[int], num_experts: int, max_k: int, registry: CollectorRegistry,
                 state: MetricsState | None = None) -> None:
        self.groups = layer_groups(moe_layers)
        self.num_experts, self.max_k = num_experts, max_k
        self.state = state or MetricsState.create(len(moe_layers), num_experts, max_k)
        registry.register(self)  # a collector: anything with collect()

    def observe(self, captures: Sequence[StepCapture]) -> None:
        with self.state.locked() as values:
            for capture in captures:
                self._observe(capture, values)

    def _observe(self, capture: StepCapture, values: dict[str, npt.NDArray[np.float64]]) -> None:
        # T tokens, L layers, K top-k
        drafted = capture.accepted >= 0  # [T]
        values["tokens"] += (drafted.sum(), (capture.accepted == 1).sum())
        for position in np.unique(capture.draft_pos[drafted]):
            at = drafted & (capture.draft_pos == position)
            values["at_position"][:, int(position) - 1] += (at.sum(), (capture.accepted[at] == 1).sum())
        served = capture.phase != PREFILL  # [T] decode and verification tokens
        if not served.any():
            return
        experts = capture.experts[served].astype(np.int64)  # [T', L, K]
        if drafted.any():
            unique = np.array([len(np.unique(experts[:, layer])) for layer in range(experts.shape[1])])  # [L]
            for group, (_, slots) in enumerate(self.groups):
                mean = float(unique[slots].mean())
                values["unique_buckets"][group, np.searchsorted(UNIQUE_BUCKETS, mean)] += 1  # le: first bucket >=
                values["unique_sum"][group] += mean
        for layer in range(experts.shape[1]):
            np.add.at(values["loads"][layer], experts[:, layer].ravel(), 1)
        values["load_steps"] += 1
        if values["load_steps"][0] == IMBALANCE_STEPS:
            loads = values["loads"]
            mean = loads.sum(axis=1) / self.num_experts  # [L]
            ratio = np.where(mean > 0, loads.max(axis=1) / np.maximum(mean, 1e-12), 0.0)  # [L]
            for group, (_, slots) in enumerate(self.groups):
                values["imbalance"][group] = ratio[slots].mean()
            loads[:] = 0
            values["load_steps"][:] = 0

    def collect(self) -> Iterator[Metric]:
        with self.state.locked() as values:
            held = {name: array.copy() for name, array in values.items()}
        yield CounterMetricFamily("moetrace_draft_tokens", "Draft tokens verified in the recorded steps",
                                  value=held["tokens"][0])
        yield CounterMetricFamily("moetrace_accepted_tokens", "Draft tokens accepted in the recorded steps",
                                  value=held["tokens"][1])
        positions = (("moetrace_drafts_at_position", "Drafts verified at each draft position"),
                     ("moetrace_accepted_at_position", "Drafts accepted at each draft position"))
        for row, (name, text) in enumerate(positions):
            family = CounterMetricFamily(name, text, labels=["position"])
            for position in range(1, self.max_k + 1):
                family.add_metric([str(position)], held["at_position"][row, position - 1])
            yield family
        unique = HistogramMetricFamily(
            "moetrace_unique_experts_per_verify_step",
            "Unique experts a verification step's tokens read in a layer, averaged over the layer group",
            labels=["layers"])
        imbalance = GaugeMetricFamily(
            "moetrace_expert_load_imbalance",
            f"Busiest expert's picks over the mean expert's in the last {IMBALANCE_STEPS} decode and verification "
            "steps, averaged over the layer group", labels=["layers"])
        bounds = [floatToGoString(bound) for bound in (*UNIQUE_BUCKETS, float("inf"))]  # type: ignore[no-untyped-call]
        for group, (label, _) in enumerate(self.groups):
            cumulative = np.cumsum(held["unique_buckets"][group])
            unique.add_metric([label], list(zip(bounds, cumulative.tolist())), held["unique_sum"][group])
            imbalance.add_metric([label], held["imbalance"][group])
        yield unique
        yield imbalance


class PortSharingServer(ThreadingWSGIServer):
    """The endpoint's HTTP server, bound with ``SO_REUSEPORT``: the next partition's writer process serves beside
    the one still closing its trace (both read the same ``MetricsState``), so a scrape at a switch never meets a
    closed port. (Linux shares a port only between sockets of one user that all ask for it.)"""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape in the writer process's log."""


def serve_metrics(port: int, moe_layers: Sequence[int], num_experts: int, max_k: int,
                  state: MetricsState | None = None) -> LiveMetrics:
    """``LiveMetrics`` over ``state`` (an always-on recording's, kept across its partitions; None: new) in a
    registry of their own, served at ``http://0.0.0.0:<port>/metrics`` (``OSError`` where another program holds the
    port)."""
    registry = CollectorRegistry()
    metrics = LiveMetrics(moe_layers, num_experts, max_k, registry, state)
    server = make_server("0.0.0.0", port, make_wsgi_app(registry), PortSharingServer, handler_class=QuietHandler)
    threading.Thread(target=server.serve_forever, name="moetrace-metrics", daemon=True).start()
    return metrics
