"""vLLM general plugin: when ``MOETRACE_RECORD`` is set, every worker records its target-model routing.

vLLM loads general plugins in every process before the model is built. ``register`` wraps ``Worker.load_model``
so that the routers are wrapped right after load: before the profile run, the Dynamo trace and CUDA-graph
capture, so the capture is part of whatever gets compiled. ``RecordingWorkerExtension`` (passed to vLLM as
``worker_extension_cls``) lets the driver ask each worker for its status and close the trace.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from moetrace.hooks.options import RecordingOptions

log = logging.getLogger("moetrace")

ENV_VAR = "MOETRACE_RECORD"
WORKER_EXTENSION = "moetrace.hooks.plugin.RecordingWorkerExtension"
_MARK = "_moetrace_wrapped"


def recording_options() -> RecordingOptions | None:
    """The options in ``MOETRACE_RECORD`` (``RecordingOptions.from_text``: JSON, or a bare output directory; by
    hand under ``vllm serve``, ``{"out": DIR, "steps": N}`` or ``{"out": DIR, "seconds": S}`` records the first N
    engine steps, or S seconds, then closes the trace while the server keeps serving); None when unset, or with a
    warning when malformed: vLLM is loading, and must not stop for it."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return None
    try:
        return RecordingOptions.from_text(raw)
    except (ValueError, TypeError) as exc:
        log.warning("moetrace: not recording: %s is not valid (%s)", ENV_VAR, exc)
        return None


def register() -> None:
    """Entry point of ``vllm.general_plugins``; does nothing unless recording is switched on. Idempotent."""
    if recording_options() is None:
        return
    from moetrace.hooks.vllm_api import VllmApiError, worker_class

    try:
        Worker = worker_class()
    except VllmApiError as exc:
        log.warning("moetrace: not recording: %s", exc)
        return
    if getattr(Worker.load_model, _MARK, False):
        return
    original_load, original_shutdown = Worker.load_model, Worker.shutdown

    def load_model_and_record(self: Any, *args: Any, **kwargs: Any) -> None:
        original_load(self, *args, **kwargs)
        # Read again here, not kept from registration: a worker forked from a process that registered for an
        # earlier engine (one driver process, one engine per k) inherits this wrapper, and must record where the
        # environment says now.
        options = recording_options()
        if options is not None:
            install(self, options)

    def close_and_shut_down(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A clean shutdown (`vllm serve` stopped with Ctrl-C, an LLM shut down) reaches every worker here; its
        # process then ends through os._exit, which runs no atexit handler.
        close_quietly(self)
        return original_shutdown(self, *args, **kwargs)

    setattr(load_model_and_record, _MARK, True)
    Worker.load_model = load_model_and_record
    Worker.shutdown = close_and_shut_down


def install(worker: Any, options: RecordingOptions) -> None:
    """Start recording in this worker; any failure is reported through ``moetrace_status``, never raised."""
    from moetrace.hooks.recorder import Recorder
    from moetrace.hooks.vllm_api import worker_api

    worker._moetrace_recorder = None
    worker._moetrace_error = None
    try:
        api = worker_api()
        if api.tp_rank() != 0:
            return  # routing is replicated across TP ranks: rank 0 records
        if api.pp_size() > 1:
            raise RuntimeError("pipeline parallelism is not supported yet")
        recorder = Recorder(api, worker.model_runner, worker.vllm_config, worker_options(worker, options))
    except Exception as exc:
        worker._moetrace_error = f"{exc}"
        log.warning("moetrace: not recording: %s", exc)
        return
    worker._moetrace_recorder = recorder
    # A worker living in the driver's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0) ends with the interpreter.
    atexit.register(close_quietly, worker)


def worker_options(worker: Any, options: RecordingOptions) -> RecordingOptions:
    """``options`` as this worker records them: a recording started by hand under `vllm serve` gets its run id from
    its directory and start time; every DP rank records its own requests, into its own directory."""
    run_id = options.run_id or f"{Path(options.out).name}-{time.strftime('%Y%m%dT%H%M%S')}"
    options = dataclasses.replace(options, run_id=run_id)
    parallel = worker.vllm_config.parallel_config
    if int(parallel.data_parallel_size) > 1:
        options = dataclasses.replace(options, out=str(Path(options.out) / f"dp{int(parallel.data_parallel_rank)}"))
    return options


def close_quietly(worker: Any) -> dict[str, Any] | None:
    recorder = getattr(worker, "_moetrace_recorder", None)
    if recorder is None:
        return None
    worker._moetrace_recorder = None
    try:
        return closed_trace_facts(recorder.close())
    except Exception as exc:
        log.warning("moetrace: closing the trace failed: %s", exc)
        return None


def closed_trace_facts(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the driver hears of a closed trace: plain JSON, as vLLM's RPC carries."""
    return {"complete": bool(manifest["complete"]), "counts": dict(manifest.get("counts") or {}),
            "error": manifest.get("error"), "engine_thread_us_per_step": manifest.get("engine_thread_us_per_step"),
            "phases": manifest.get("phases"), "capture_mechanisms": manifest.get("capture_mechanisms"),
            "host_copy": (manifest.get("capture") or {}).get("host_copy")}


class RecordingWorkerExtension:
    """Methods added to every vLLM worker, called from the driver with ``LLM.collective_rpc``."""

    def moetrace_status(self) -> dict[str, Any]:
        recorder = getattr(self, "_moetrace_recorder", None)
        return {
            "recording": recorder is not None,
            "error": getattr(self, "_moetrace_error", None),
            "writer_error": recorder.writer.failed if recorder is not None else None,
            # requests the recorder holds an index for: the running ones (finished ones are dropped)
            "live_requests": len(recorder.requests.index) if recorder is not None else 0,
        }

    def moetrace_close(self) -> dict[str, Any] | None:
        return close_quietly(self)

    def moetrace_next_trace(self, options: str) -> dict[str, Any] | None:
        """Close the trace under way and record into the one ``options`` (``RecordingOptions`` JSON) names, with
        its budget, in this engine (``Recorder.next_trace``); the closed trace's facts (``closed_trace_facts``),
        None where this worker records nothing. Raises ``ValueError`` for options only a new engine could take."""
        recorder = getattr(self, "_moetrace_recorder", None)
        if recorder is None:
            return None
        return closed_trace_facts(recorder.next_trace(worker_options(self, RecordingOptions.from_text(options))))

    def moetrace_pause(self) -> bool:
        """Unwrap routers and runner (recording off, engine as without moetrace) until ``moetrace_resume``."""
        recorder = getattr(self, "_moetrace_recorder", None)
        if recorder is not None:
            recorder.uninstall()
        return recorder is not None

    def moetrace_resume(self) -> bool:
        recorder = getattr(self, "_moetrace_recorder", None)
        if recorder is not None:
            recorder.install()
        return recorder is not None
