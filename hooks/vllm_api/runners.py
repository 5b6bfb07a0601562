"""The recorder's view of vLLM's two model runners: which calls it wraps (``HookPoint``) and where a step's input
batch lives (``StepInputs``).

# T tokens in a step, R requests in the step
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from moetrace.hooks.planned import PlannedStep
from moetrace.hooks.vllm_api.resolve import (GRAPH_MANAGER_V2_FIELDS, INPUT_BATCH_FIELDS, INPUT_BATCH_V2_FIELDS,
                                             PLANNING_V2_FIELDS, RUNNER_FIELDS, RUNNER_V2_FIELDS,
                                             WARMUP_REQUEST_PREFIXES, require_fields)

log = logging.getLogger("moetrace")


class GraphKeys(Protocol):
    """What a runner view asks of the resolved worker API (``WorkerApi``): which CUDA graph a forward runs in."""

    @property
    def cudagraph_none(self) -> Any: ...

    def graph_key(self) -> Hashable | None: ...


# Which CUDA graph a forward replays (None: none) and every DP rank's tokens in it (None without DP).
ForwardPlan = tuple[Hashable | None, list[int] | None]


@dataclass(frozen=True)
class HookPoint:
    """One call the recorder wraps: ``owner.name``, in the role it plays in a step (``step``: called once a step,
    before its forward, with the scheduler's output; ``sample``, ``sample_tokens``, ``drafting``,
    ``capture_model``; ``plan``: returns a step's input batch, laid out before its forward (``planning``); or ``graph``:
    a call that says which CUDA graph the forward replays, ``plan`` of its result and arguments, read as it returns,
    or, with ``plan_at_launch`` (a plan of the result and arguments alone, which vLLM leaves as they are), once the
    forward is launched: before the launch, under sync scheduling, the GPU idles, so there the hook only keeps the
    result).

    Where the runner allows, the calls wrapped return before the forward runs or begin after it: a wrapper around
    the forward would lie beneath its every Python call, and CPython allocates the frames of a thread's calls in
    chunks of 16 KiB that it maps and unmaps as the call depth crosses their boundary (3.11+): a few frames more
    beneath a PIECEWISE forward, whose per-layer calls go up and down hundreds of times, made the calls of every
    layer cross one (a page fault, mmap and munmap each time; +0.7 to +1.1 ms per forward on an H200 host)."""

    role: str
    owner: Any
    name: str
    plan: Callable[..., ForwardPlan] | None = None
    plan_at_launch: bool = False
    timed_only: bool = False  # hooked only while a timed step is under way (it times a phase, and nothing else)
    planning: bool = False  # role ``plan``, hooked only where a budget or a replay plans each forward's tokens


class StepInputs(NamedTuple):
    """What a step's rows need from the runner, read right after its forward: host arrays (copied, the runner
    reuses them), positions and token ids where the runner keeps them (device or host)."""

    req_ids: Sequence[str]  # [R] in the input batch's order
    query_start: npt.NDArray[np.int64]  # [R + 1]
    num_prompt_tokens: npt.NDArray[np.int64]  # [R]
    drafts: npt.NDArray[np.int64]  # [R]
    positions: torch.Tensor  # [>= T]: this step's T first (the runner's persistent buffer where it keeps one)
    input_ids: torch.Tensor  # [>= T], likewise


class RunnerV1:
    """Model Runner V1: ``execute_model`` prepares the step and runs the target forward (in vLLM's forward context,
    set with the CUDA graph that ``_determine_batch_execution_and_padding`` chose), ``sample_tokens`` the rejection
    sampler (``_sample``) and the drafter (``propose_draft_token_ids``); the input batch lives in the runner's
    persistent buffers."""

    name = "v1"

    def __init__(self, api: GraphKeys, runner: Any) -> None:
        require_fields(runner, RUNNER_FIELDS, "model runner")
        require_fields(runner.input_batch, INPUT_BATCH_FIELDS, "input batch")
        require_fields(runner.query_start_loc, ("np",), "model runner.query_start_loc")
        require_fields(runner.input_ids, ("gpu",), "model runner.input_ids")
        self.api, self.runner = api, runner

    def hook_points(self) -> list[HookPoint]:
        """None beneath the forward: a step begins in ``_update_states`` and its CUDA graph is chosen in
        ``_determine_batch_execution_and_padding`` (both before the forward, and only for a step's forward or a
        dummy run), the forward is launched by the time ``sample_tokens`` is called."""
        runner = self.runner
        return [HookPoint("step", runner, "_update_states"), HookPoint("sample", runner, "_sample"),
                HookPoint("sample_tokens", runner, "sample_tokens"),
                HookPoint("drafting", runner, "propose_draft_token_ids", timed_only=True),
                HookPoint("graph", runner, "_determine_batch_execution_and_padding", self.forward_plan,
                          plan_at_launch=True)]

    @staticmethod
    def plan_points() -> list[HookPoint]:
        """None: V1 plans a forward's tokens in its ``graph`` hook, which returns before the forward too."""
        return []

    def forward_plan(self, result: tuple[Any, ...], *args: Any, **kwargs: Any) -> ForwardPlan:
        """From ``_determine_batch_execution_and_padding``'s (CUDA-graph mode, batch descriptor, microbatching, DP
        tokens [DP] or None, stats): the key the forward's graph was captured under (``WorkerApi.graph_key``)."""
        mode, descriptor, _, across_dp = result[:4]
        key = None if mode == self.api.cudagraph_none else (mode.name, descriptor)
        return key, None if across_dp is None else [int(n) for n in across_dp.tolist()]

    def sampled_on_host(self) -> bool:
        """Whether ``sample_tokens`` hands back each request's sampled tokens as host lists (sync scheduling);
        with async scheduling they stay on the device."""
        return not bool(getattr(self.runner, "use_async_scheduling", False))

    def planned_step(self, scheduler_output: Any, num_tokens: int | None) -> PlannedStep | None:
        """Once ``_determine_batch_execution_and_padding`` returns (the step's inputs prepared, its forward not yet
        launched): the step's tokens, in the input batch's order; None where the forward about to run is not the
        step's (a dummy run of ``num_tokens`` tokens)."""
        if scheduler_output is None or num_tokens != scheduler_output.total_num_scheduled_tokens:
            return None
        input_batch = self.runner.input_batch
        num_reqs = int(input_batch.num_reqs)
        spec = scheduler_output.scheduled_spec_decode_tokens
        req_ids = list(input_batch.req_ids[:num_reqs])
        return PlannedStep(self.runner.query_start_loc.np[: num_reqs + 1].astype(np.int64),
                           np.array([len(spec.get(r, ())) for r in req_ids], dtype=np.int64), req_ids)

    def positions(self) -> torch.Tensor:
        """The runner's device positions [>= T_max], at a fixed address: each forward's tokens' are its first T."""
        positions: torch.Tensor = self.runner.positions
        return positions

    @staticmethod
    def is_warmup(scheduler_output: Any) -> bool:
        """V1 warms up through dummy runs, never through ``execute_model``."""
        return False

    def step_inputs(self) -> StepInputs:
        runner = self.runner
        input_batch = runner.input_batch
        num_reqs = int(input_batch.num_reqs)
        query_start = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        state = runner.execute_model_state
        spec = state.spec_decode_metadata if state is not None else None
        return StepInputs(
            req_ids=input_batch.req_ids[:num_reqs],
            query_start=query_start,
            num_prompt_tokens=input_batch.num_prompt_tokens[:num_reqs].astype(np.int64),  # a copy: the runner reuses it
            drafts=(np.asarray(spec.num_draft_tokens, dtype=np.int64) if spec is not None
                    else np.zeros(num_reqs, np.int64)),
            positions=runner.positions,  # the same tensors every step: what the recorder packs can be kept
            input_ids=runner.input_ids.gpu,
        )

    @staticmethod
    def kept_on_device(sampled: Any) -> torch.Tensor:
        """Tokens each request kept (accepted drafts + 1), counted on the device from ``_sample``'s output."""
        kept: torch.Tensor = (sampled.sampled_token_ids != -1).sum(dim=1, dtype=torch.int32)
        return kept

    @staticmethod
    def kept_on_host(output: Any) -> list[int] | None:
        """Tokens each request kept this step (accepted drafts + 1, 0 when nothing was sampled), in the input batch's
        order, from the host lists of ``sample_tokens``' output; None when it holds none (async scheduling)."""
        sampled = getattr(output, "sampled_token_ids", None)
        return list(map(len, sampled)) if isinstance(sampled, list) else None

    def name_full_graphs(self, name_captured: Callable[[Hashable], None]) -> None:
        """V1 captures every graph inside a forward context that names it: nothing to do."""


class RunnerV2:
    """Model Runner V2: ``execute_model`` leaves the step's ``InputBatch`` (its own request order, decodes first)
    in ``execute_model_state``; its ``cudagraph_manager`` replays FULL graphs with no forward context
    (``run_fullgraph(desc)``) and PIECEWISE ones inside it (``run_pw_graph``); ``sample`` returns the tokens each
    request kept on the device; the speculator's ``propose`` drafts. It always schedules asynchronously. A step
    begins in ``execute_model`` itself, and a PIECEWISE graph's name is read in the forward context around
    ``run_pw_graph``: on V2 two of the recorder's frames lie beneath those forwards (see ``HookPoint``)."""

    name = "v2"

    def __init__(self, api: GraphKeys, runner: Any) -> None:
        require_fields(runner, RUNNER_V2_FIELDS, "model runner (V2)")
        require_fields(runner.req_states, ("prompt_len",), "model runner (V2).req_states")
        self.api, self.runner = api, runner
        self._batch_checked = False  # the per-step InputBatch's fields, checked at the first step

    def hook_points(self) -> list[HookPoint]:
        runner = self.runner
        points = [HookPoint("step", runner, "execute_model"), HookPoint("sample", runner, "sample"),
                  HookPoint("sample_tokens", runner, "sample_tokens"),
                  HookPoint("capture_model", runner, "capture_model")]
        if runner.speculator is not None:
            points.append(HookPoint("drafting", runner.speculator, "propose", timed_only=True))
        manager = runner.cudagraph_manager  # built with the KV cache, after load: hooked when graphs are captured
        if manager is not None:
            require_fields(manager, GRAPH_MANAGER_V2_FIELDS, "CUDA graph manager (V2)")
            points += [
                HookPoint("graph", manager, "run_fullgraph", lambda _, desc, *args, **kwargs: (("FULL", desc), None)),
                HookPoint("graph", manager, "run_pw_graph", lambda *args, **kwargs: (self.api.graph_key(), None))]
        return points

    def plan_points(self) -> list[HookPoint]:
        """Where a budget or a replay plans a forward's tokens: as ``prepare_inputs`` returns the step's input
        batch (dummy runs, CUDA-graph captures among them, lay theirs out elsewhere and run unplanned)."""
        require_fields(self.runner, PLANNING_V2_FIELDS, "model runner (V2)")
        return [HookPoint("plan", self.runner, "prepare_inputs", planning=True)]

    @staticmethod
    def planned_step(input_batch: Any) -> PlannedStep | None:
        """The step's input batch as ``prepare_inputs`` returned it, in its own request order (decodes first); None
        for a kernel warm-up's (requests of V2's own: counted, they would shift which trace request a replay gives the
        first request served)."""
        num_reqs = int(input_batch.num_reqs)
        req_ids = list(input_batch.req_ids[:num_reqs])
        if req_ids and _is_warmup_request(req_ids[0]):
            return None
        drafts = input_batch.num_draft_tokens_per_req
        return PlannedStep(input_batch.query_start_loc_np[: num_reqs + 1].astype(np.int64),
                           np.zeros(num_reqs, np.int64) if drafts is None else drafts[:num_reqs].astype(np.int64),
                           req_ids)

    def positions(self) -> torch.Tensor:
        """The runner's device positions [>= T_max], at a fixed address: each forward's tokens' are its first T."""
        positions: torch.Tensor = self.runner.input_buffers.positions
        return positions

    def sampled_on_host(self) -> bool:
        return False

    @staticmethod
    def is_warmup(scheduler_output: Any) -> bool:
        """Whether the step is V2's kernel warm-up (its steps hold only requests of its own)."""
        return _is_warmup_request(next(iter(scheduler_output.num_scheduled_tokens), ""))

    def step_inputs(self) -> StepInputs:
        input_batch = self.runner.execute_model_state.input_batch
        if not self._batch_checked:
            require_fields(input_batch, INPUT_BATCH_V2_FIELDS, "input batch (V2)")
            self._batch_checked = True
        num_reqs, num_tokens = int(input_batch.num_reqs), int(input_batch.num_tokens)
        slots = input_batch.idx_mapping_np[:num_reqs]  # index in the input batch -> the request's row in req_states
        drafts = input_batch.num_draft_tokens_per_req
        return StepInputs(
            req_ids=list(input_batch.req_ids[:num_reqs]),
            query_start=input_batch.query_start_loc_np[: num_reqs + 1].astype(np.int64),
            num_prompt_tokens=self.runner.req_states.prompt_len.np[slots].astype(np.int64),
            drafts=np.zeros(num_reqs, np.int64) if drafts is None else drafts[:num_reqs].astype(np.int64),
            positions=input_batch.positions[:num_tokens],
            input_ids=input_batch.input_ids[:num_tokens],
        )

    @staticmethod
    def kept_on_device(sampled: Any) -> torch.Tensor:
        """``sample`` returns (sampler output, tokens kept [R], tokens rejected [R]); kept is 0 for a prefill chunk
        that samples nothing."""
        kept: torch.Tensor = sampled[1]
        return kept

    @staticmethod
    def kept_on_host(output: Any) -> list[int] | None:
        return None

    def name_full_graphs(self, name_captured: Callable[[Hashable], None]) -> None:
        """V2 captures a FULL graph inside a forward context whose mode says NONE, so routing kept during that
        capture has no name (key None) until vLLM files the graph under its descriptor: make that filing name it
        ``("FULL", desc)``, the key ``run_fullgraph(desc)`` reports at replay."""
        manager = self.runner.cudagraph_manager
        if manager is not None and not isinstance(manager.graphs, GraphsNamingCaptures):
            manager.graphs = GraphsNamingCaptures(manager.graphs, name_captured)


class GraphsNamingCaptures(dict[Any, Any]):
    """A V2 graph manager's ``graphs`` while recording: filing a FULL graph also names the routing kept during its
    capture."""

    def __init__(self, graphs: dict[Any, Any], name_captured: Callable[[Hashable], None]) -> None:
        super().__init__(graphs)
        self.name_captured = name_captured

    def __setitem__(self, desc: Any, graph: Any) -> None:
        super().__setitem__(desc, graph)
        self.name_captured(("FULL", desc))


def _is_warmup_request(req_id: Any) -> bool:
    """Whether ``req_id`` is one of V2's kernel warm-up requests (its steps hold only such requests)."""
    return isinstance(req_id, str) and req_id.startswith(WARMUP_REQUEST_PREFIXES)
