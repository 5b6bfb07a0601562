"""Faults inside a real vLLM engine (CPU) stop the recording with the reason and never the generation; and where the
recorder's hooks sit in that engine's calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import writer_processes

pytestmark = pytest.mark.vllm

ENGINE_WITH_A_FAULT = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
from moetrace.default_model import encode_text
from moetrace.recording.engine import build_llm, engine_prompts
from moetrace.recording.prompts import BUILTIN_PROMPTS
from moetrace.recording.record import RecordRequest, engine_settings, resolve_model

def renamed_inside_the_forward(worker):
    # What a vLLM release that renamed something the router wrapper reads looks like, from the forward's side.
    def keep(slot, kept):
        raise AttributeError("'ForwardContext' object has no attribute 'batch_descriptor'")
    worker._moetrace_recorder.capture.keep = keep

def schedule_renamed(worker):
    # What a release that renamed a SchedulerOutput field looks like, read as the forward is launched (outside it).
    def is_warmup(scheduler_output):
        raise AttributeError("'SchedulerOutput' object has no attribute 'total_num_scheduled_tokens'")
    worker._moetrace_recorder.model_runner.is_warmup = is_warmup

def router_no_longer_called(worker):
    # What a release that stops calling _compute_routing looks like: the wrapped method is never reached.
    from moetrace.hooks.capture import unwrap_router
    for moe in worker._moetrace_recorder.runners:
        unwrap_router(moe.router)

def frames_beneath_the_forward(worker):
    # Not a fault: a probe on entry to the model's forward (at class level, beneath any hook) that notes every frame
    # of moetrace's on the thread's stack there.
    import sys
    model_class = type(worker.model_runner.model)
    forward = model_class.forward
    seen = type(worker.model_runner)._probe_seen = SimpleNamespace(forwards=0, frames=set())
    def probed(self, *args, **kwargs):
        seen.forwards += 1
        frame = sys._getframe(1)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("moetrace"):
                seen.frames.add(f"{module}.{frame.f_code.co_qualname}")
            frame = frame.f_back
        return forward(self, *args, **kwargs)
    model_class.forward = probed

def frames_beneath_the_forward_seen(worker):
    seen = type(worker.model_runner)._probe_seen
    return {"forwards": seen.forwards, "frames": sorted(seen.frames)}

def calls_while_the_gpu_idles(worker):
    # Not a fault: a profiler on the engine thread that notes every call of moetrace's between vLLM's sync after
    # sampling (the return of _bookkeeping_sync) and the next forward's launch (the call of _model_forward), where
    # under sync scheduling a GPU idles, and every call of moetrace's elsewhere.
    import sys
    seen = type(worker.model_runner)._probe_seen = {"idle": set(), "busy": set(), "idling": False}
    def profile(frame, event, arg):
        if event == "return" and frame.f_code.co_name == "_bookkeeping_sync":
            seen["idling"] = True
        elif event == "call" and frame.f_code.co_name == "_model_forward":
            seen["idling"] = False
        elif event == "call" and frame.f_globals.get("__name__", "").startswith("moetrace"):
            seen["idle" if seen["idling"] else "busy"].add(frame.f_code.co_qualname)
    sys.setprofile(profile)

def calls_while_the_gpu_idles_seen(worker):
    import sys
    sys.setprofile(None)
    seen = type(worker.model_runner)._probe_seen
    return {"idle": sorted(seen["idle"]), "busy": sorted(seen["busy"])}

if __name__ == "__main__":
    out, fault = Path(sys.argv[1]), sys.argv[2]
    # no step timed, as 63 in 64 on a GPU: what runs on an untimed step is what most steps run
    untimed = 1 << 40 if fault in ("calls_while_the_gpu_idles", "schedule_renamed") else None
    request = RecordRequest(model=None, ks=[2], batch_size=4, max_tokens=16, out=out, time_phases_every=untimed)
    settings = engine_settings(request, resolve_model(None), 2, out / "trace", list(BUILTIN_PROMPTS)[:4],
                               out / "progress")
    llm = build_llm(settings)
    try:
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        llm.generate(engine_prompts(settings)[:2], params, use_tqdm=False)  # recorded normally first
        llm.collective_rpc(globals()[fault])
        outputs = llm.generate(engine_prompts(settings), params, use_tqdm=False)
        seen = llm.collective_rpc(globals()[fault + "_seen"]) if fault + "_seen" in globals() else None
        closed = llm.collective_rpc("moetrace_close")
    finally:
        llm.llm_engine.engine_core.shutdown()
    print(json.dumps({"generated": [len(o.outputs[0].token_ids) for o in outputs], "closed": closed, "seen": seen}))
"""


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("renamed_inside_the_forward", "batch_descriptor"), ("router_no_longer_called", "no router ran in this forward"),
     ("schedule_renamed", "total_num_scheduled_tokens")],
)
def test_a_fault_inside_the_forward_stops_recording_with_the_reason_and_generation_completes(
    fault: str, reason: str, tmp_path: Path
) -> None:
    result, done = run_engine_with(fault, tmp_path)
    (closed,) = result["closed"]
    assert closed["complete"] is False and reason in closed["error"]
    manifest = json.loads((tmp_path / "trace" / "manifest.json").read_text())
    assert reason in manifest["error"] and manifest["counts"]["steps"] > 0, "steps before the fault are kept"
    assert "moetrace: recording stopped" in done.stderr


def run_engine_with(fault: str, tmp_path: Path) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """The engine script with ``fault`` applied after its first requests; its result, once it generated every
    request in full."""
    script = tmp_path / "engine_with_a_fault.py"
    script.write_text(ENGINE_WITH_A_FAULT)
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path), fault], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["generated"] == [16, 16, 16, 16], "every request was generated in full"
    return result, done


def test_no_frame_of_the_recorder_lies_beneath_the_forward_while_it_records(tmp_path: Path) -> None:
    """CPython maps a thread's call frames in chunks: frames added beneath a forward shift its per-layer calls onto
    a chunk boundary, a page fault and an mmap per layer (see ``HookPoint``). On Model Runner V1 the recorder's
    hooks return before the forward and begin after it."""
    result, _ = run_engine_with("frames_beneath_the_forward", tmp_path)
    (seen,) = result["seen"]
    assert seen["forwards"] > 0 and seen["frames"] == []
    (closed,) = result["closed"]
    assert closed["complete"] is True and closed["counts"]["steps"] > 0, "and it recorded those forwards"


def test_between_vllms_sync_and_the_next_launch_the_recorder_only_notes_the_step_and_queues_the_last(
    tmp_path: Path,
) -> None:
    """Under sync scheduling the GPU idles from vLLM's sync after sampling until the next forward is launched: every
    µs the recorder spends there slows every step. There it only notes the step (and each new request's prompt +
    max_tokens), counts the tokens each request kept and queues the finished step; which CUDA graph the forward
    replays is read, and the step laid out, packed and handed over, once the forward is launched. The drafter,
    called there too, is hooked only for the steps whose phases are timed (none here)."""
    result, _ = run_engine_with("calls_while_the_gpu_idles", tmp_path)
    (seen,) = result["seen"]
    assert set(seen["idle"]) <= {"Recorder.step_begins", "Recorder.forward_planned_at_launch",
                                 "RoutingCapture.begin_step", "RunnerV1.kept_on_host", "TraceWriter.failed",
                                 "TraceWriter.submit", "EngineRecord.set_submitted", "Guard.__enter__",
                                 "Guard.__exit__", "RequestBook.scheduled", "sequence_limits"}, seen["idle"]
    for after_the_launch in ("RunnerV1.forward_plan", "Recorder.forward_launched", "Recorder._layout",
                             "TraceWriter.forward_ready", "Recorder._is_recorded"):
        assert after_the_launch in seen["busy"] and after_the_launch not in seen["idle"]
    (closed,) = result["closed"]
    assert closed["complete"] is True and closed["counts"]["steps"] > 0


def test_record_exits_non_zero_with_the_reason_when_its_writer_process_is_killed(tmp_path: Path) -> None:
    """A user's `moetrace record` whose writer process dies mid-run: generation finishes, the command fails in one
    line with the reason, and `info` shows the manifest's error."""
    import signal
    import time

    out = tmp_path / "out"
    record = subprocess.Popen([sys.executable, "-m", "moetrace", "record", "--k", "2", "--max-tokens", "400",
                               "--batch-size", "2", "--num-prompts", "2", "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    writer_pid = None
    deadline = time.monotonic() + 300
    while writer_pid is None and time.monotonic() < deadline and record.poll() is None:
        for pid in writer_processes():
            try:
                files = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
            except OSError:
                continue
            if any(name.startswith(str(out)) for name in files):  # this recording's: its output goes to engine.log
                writer_pid = pid
        time.sleep(0.2)
    assert writer_pid is not None, "no writer process appeared"
    time.sleep(2.0)  # a few steps written first
    os.kill(writer_pid, signal.SIGKILL)
    output, _ = record.communicate(timeout=600)
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert record.returncode == 1 and len(lines) == 1, output
    assert "recording stopped" in lines[0] and "Traceback" not in output
    info = subprocess.run([sys.executable, "-m", "moetrace", "info", str(out / "kimi-k2-tiny-ngram-k2")],
                          capture_output=True, text=True)
    shown = " ".join(info.stdout.split())  # Rich wraps at the terminal width
    assert "INCOMPLETE (recording stopped: RuntimeError: the writer process ended unexpectedly)" in shown, shown


TWO_ENGINES_FROM_ONE_DRIVER = """
import json, os, sys
from pathlib import Path
from moetrace.recording.engine import run
from moetrace.hooks.plugin import ENV_VAR, register
from moetrace.recording.prompts import BUILTIN_PROMPTS
from moetrace.recording.record import RecordRequest, engine_settings, resolve_model

if __name__ == "__main__":
    earlier, now = Path(sys.argv[1]), Path(sys.argv[2])
    # The driver registered the plugin for an earlier engine (as vLLM does in the driver on a GPU): the Worker
    # class in this process is wrapped, and a worker forked from it inherits the wrapper. Here the next engine's
    # worker lives in this very process (no engine process, uni executor): the same inherited wrapper.
    os.environ[ENV_VAR] = json.dumps({"out": str(earlier)})
    register()
    request = RecordRequest(model=None, ks=[1], batch_size=2, max_tokens=8, out=now.parent,
                            engine_args={"distributed_executor_backend": "uni"})  # the worker in the engine process
    settings = engine_settings(request, resolve_model(None), 1, now, list(BUILTIN_PROMPTS)[:2], now.parent / "p")
    sys.exit(run(settings))
"""


def test_an_engine_started_after_the_driver_registered_for_another_records_where_its_own_settings_say(
    tmp_path: Path,
) -> None:
    """One driver process, one engine per k (as the speedup benchmark runs): each engine's trace lands in its own
    directory, not in the one the driver's first registration named."""
    script = tmp_path / "two_engines.py"
    script.write_text(TWO_ENGINES_FROM_ONE_DRIVER)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "earlier"), str(tmp_path / "now")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "now" / "manifest.json").read_text())
    assert manifest["spec"]["k"] == 1 and manifest["counts"]["steps"] > 0
    assert not (tmp_path / "earlier").exists()


MANY_SHORT_REQUESTS = """
import json, sys
from pathlib import Path
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from moetrace.recording.engine import build_llm
from moetrace.recording.prompts import BUILTIN_PROMPTS
from moetrace.recording.record import RecordRequest, engine_settings, resolve_model

if __name__ == "__main__":
    out, count = Path(sys.argv[1]), int(sys.argv[2])
    request = RecordRequest(model=None, ks=[0], batch_size=16, max_tokens=2, out=out)
    settings = engine_settings(request, resolve_model(None), 0, out / "trace", list(BUILTIN_PROMPTS)[:1],
                               out / "progress")
    llm = build_llm(settings)
    try:
        prompts = [TokensPrompt(prompt_token_ids=[32 + i % 90, 32 + i // 90 % 90, 32 + i // 8100, 10])
                   for i in range(count)]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        (status,) = llm.collective_rpc("moetrace_status")
        closed = llm.collective_rpc("moetrace_close")
    finally:
        llm.llm_engine.engine_core.shutdown()
    print(json.dumps({"ids": [o.request_id for o in outputs], "status": status, "closed": len(closed)}))
"""


def test_over_thousands_of_requests_the_recorder_holds_only_the_running_ones(tmp_path: Path) -> None:
    """A server that runs for days: the engine side keeps an index for the requests still running only (finished
    ones are dropped as vLLM reports them), while the trace still names every request, in the order first seen."""
    script = tmp_path / "many_requests.py"
    script.write_text(MANY_SHORT_REQUESTS)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "3000"], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"]["recording"] and result["status"]["writer_error"] is None
    assert result["status"]["live_requests"] <= 16, result["status"]  # the batch size, not the 3000 served
    manifest = json.loads((tmp_path / "trace" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["requests"]) == 3000
    # vLLM's engine ids are the caller's with a suffix of its own ("0" -> "0-9a42c363")
    assert sorted(r.split("-")[0] for r in manifest["requests"]) == sorted(result["ids"])
    assert len(set(manifest["requests"])) == 3000
