"""Per-worker recorder: binds the routing buffers to the target model and turns each engine step into rows.

# T tokens in the step, R requests in the batch, L recorded MoE layers, K top-k, d_i drafts of request i

Model Runner V1 (the CPU runner, and the GPU runner when ``VLLM_USE_V2_MODEL_RUNNER=0``) is supported: its
``execute_model`` runs the target forward, ``_sample`` runs the rejection sampler, and the drafter runs after
both. Model Runner V2 is refused with a clear message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from moetrace.hooks.capture import (
    RoutingCapture,
    router_info,
    target_moe_runners,
    unwrap_router,
    vllm_graph_key,
    wrap_router,
)
from moetrace.hooks.manifest import worker_manifest
from moetrace.schema import PHASES
from moetrace.writer import StepCapture, TraceWriter

log = logging.getLogger("moetrace")

PREFILL, DECODE, VERIFY = (np.int8(PHASES.index(p)) for p in ("prefill", "decode", "verify"))
NOT_A_DRAFT = -1


class UnsupportedRunner(RuntimeError):
    """The worker's model runner is one moetrace cannot record from."""


class Recorder:
    """Records one worker's target-model routing into one trace directory."""

    def __init__(self, runner: Any, vllm_config: Any, settings: dict[str, Any]) -> None:
        if type(runner).__module__.startswith("vllm.v1.worker.gpu.") or not hasattr(runner, "input_batch"):
            raise UnsupportedRunner(
                "moetrace records from vLLM's Model Runner V1 only; set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self.runner = runner
        self.runners = target_moe_runners(runner.model)
        if not self.runners:
            raise UnsupportedRunner("the target model has no MoE layers to record")
        monolithic = [r.layer_name for r in self.runners if getattr(r, "is_monolithic", False)]
        if monolithic:
            raise UnsupportedRunner(f"monolithic MoE kernels never call the router: {monolithic[0]}")
        infos = [router_info(r) for r in self.runners]
        self.top_k = infos[0].top_k
        self.candidates = int(settings.get("candidates", 0))
        self.token_ids = bool(settings.get("token_ids", True))
        device = next(runner.model.parameters()).device
        self.capture = RoutingCapture(
            int(runner.max_num_tokens), len(infos), self.top_k, self.candidates, device, graph_key=vllm_graph_key
        )
        self._replayed: Hashable | None = None  # the CUDA graph the last forward replayed, None if none
        manifest = worker_manifest(vllm_config, infos, settings)
        self.writer = TraceWriter(
            Path(settings["out"]),
            manifest,
            [i.layer for i in infos],
            self.top_k,
            self.candidates,
            rotate_seconds=float(settings.get("rotate_seconds", 10.0)),
        )
        self.request_index: dict[str, int] = {}
        self.step = 0
        self._pending: dict[str, Any] | None = None
        self._original_execute = runner.execute_model
        self._original_sample = runner._sample
        self._original_model_forward = runner._model_forward
        self.install()

    def install(self) -> None:
        """Wrap the routers and the runner's step methods; installing twice changes nothing."""
        for slot, moe in enumerate(self.runners):
            wrap_router(moe.router, slot, self.capture)
        self.runner.execute_model = self.execute_model
        self.runner._sample = self.sample
        self.runner._model_forward = self.model_forward

    def uninstall(self) -> None:
        """Restore the runner and routers as they were; the writer stays open until ``close``."""
        for moe in self.runners:
            unwrap_router(moe.router)
        for name in ("execute_model", "_sample", "_model_forward"):
            vars(self.runner).pop(name, None)
        self._pending = None

    def close(self) -> dict[str, Any]:
        self.uninstall()
        return self.writer.close({"requests": list(self.request_index)})

    # -- engine-thread hooks: never raise into the engine ------------------------------------------------------

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        t_start = time.time_ns()
        self.capture.begin_step()
        self._replayed = None
        result = self._original_execute(scheduler_output, *args, **kwargs)
        self._pending = None
        if self.writer.failed is None and scheduler_output.total_num_scheduled_tokens:
            try:
                self._pending = self._layout(t_start)
            except Exception as exc:
                self._stop(exc)
        return result

    def model_forward(self, *args: Any, **kwargs: Any) -> Any:
        """Note which CUDA graph (if any) the forward replays; vLLM's forward context says so only inside."""
        self._replayed = vllm_graph_key()
        return self._original_model_forward(*args, **kwargs)

    def sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        sampler_output = self._original_sample(logits, spec_decode_metadata)
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                valid = (sampler_output.sampled_token_ids != -1).sum(dim=1).cpu().numpy()
                self.writer.submit(self._capture(pending, valid, time.time_ns()))
            except Exception as exc:
                self._stop(exc)
        return sampler_output

    def _stop(self, exc: BaseException) -> None:
        log.warning("moetrace: recording stopped, the engine keeps serving (%s: %s)", type(exc).__name__, exc)
        self.writer.failed = f"{type(exc).__name__}: {exc}"

    # -- batch layout ---------------------------------------------------------------------------------------

    def _layout(self, t_start: int) -> dict[str, Any]:
        """Copy what this step's rows need before the runner's views are reused by the next step."""
        runner = self.runner
        state = runner.execute_model_state
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        query_start = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        num_tokens = int(query_start[-1])
        spec = state.spec_decode_metadata if state is not None else None
        drafts = np.asarray(spec.num_draft_tokens, dtype=np.int64) if spec is not None else np.zeros(num_reqs, np.int64)
        return {
            "t_start": t_start,
            "req_ids": list(batch.req_ids[:num_reqs]),
            "query_start": query_start,
            "num_prompt_tokens": np.asarray(batch.num_prompt_tokens[:num_reqs], dtype=np.int64),
            "drafts": drafts,
            "positions": runner.positions[:num_tokens].to("cpu", copy=True).numpy(),
            "tokens": runner.input_ids.gpu[:num_tokens].to("cpu", copy=True).numpy() if self.token_ids else None,
            "routing": self.capture.collect(num_tokens, self._replayed),
        }

    def _capture(self, p: dict[str, Any], valid_sampled: npt.NDArray[np.int64], t_end: int) -> StepCapture:
        query_start, drafts = p["query_start"], p["drafts"]
        num_reqs = len(p["req_ids"])
        num_tokens = int(query_start[-1])
        per_req_tokens = np.diff(query_start)
        accepted = np.where(drafts > 0, np.clip(valid_sampled[:num_reqs] - 1, 0, drafts), 0)
        requests = np.array(
            [self.request_index.setdefault(rid, len(self.request_index)) for rid in p["req_ids"]], dtype=np.uint32
        )
        token_req = np.repeat(np.arange(num_reqs), per_req_tokens)
        # Offset of each token from the end of its request's span: the last d_i + 1 tokens are the window.
        from_end = query_start[1:][token_req] - 1 - np.arange(num_tokens)
        window_drafts = drafts[token_req]
        in_window = from_end <= window_drafts
        draft_pos = np.where(in_window & (window_drafts > 0), window_drafts - from_end, 0)
        positions = p["positions"].astype(np.int64)
        phase = np.where(
            positions < p["num_prompt_tokens"][token_req], PREFILL, np.where(window_drafts > 0, VERIFY, DECODE)
        ).astype(np.int8)
        is_draft = draft_pos > 0
        token_accepted = np.where(is_draft, (draft_pos <= accepted[token_req]).astype(np.int8), NOT_A_DRAFT)
        routing = {name: t.numpy() for name, t in p["routing"].wait().items()}
        return StepCapture(
            step=self._next_step(),
            request=requests[token_req],
            position=positions.astype(np.uint32),
            phase=phase,
            draft_pos=draft_pos.astype(np.uint8),
            token=p["tokens"].astype(np.uint32) if p["tokens"] is not None else None,
            accepted=token_accepted.astype(np.int8),
            experts=routing["ids"].astype(np.uint16),
            weights=routing["weights"],
            cand_experts=routing["cand_ids"].astype(np.uint16) if "cand_ids" in routing else None,
            cand_scores=routing.get("cand_scores"),
            steps_rows={
                "step": np.full(num_reqs, self.step - 1, dtype=np.uint32),
                "request": requests,
                "num_tokens": per_req_tokens.astype(np.uint32),
                "num_drafts": drafts.astype(np.uint32),
                "num_accepted": accepted.astype(np.uint32),
                "batch_size": np.full(num_reqs, num_reqs, dtype=np.uint32),
                "t_start_ns": np.full(num_reqs, p["t_start"], dtype=np.int64),
                "t_end_ns": np.full(num_reqs, t_end, dtype=np.int64),
            },
        )

    def _next_step(self) -> int:
        self.step += 1
        return self.step - 1
