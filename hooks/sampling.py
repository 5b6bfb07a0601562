"""Sampled recording under ``vllm serve``, one policy of ``MOETRACE_RECORD`` at a time: ``sample_steps`` and
``sample_every_seconds``, a burst of N request steps every M seconds (the steps between bursts run unrecorded); or
``sample_requests``, one request in N (the requests whose vLLM id ``moetrace.trace.files.sampled_request`` keeps have
their routing rows written; every request keeps its steps rows, so steps, counts and acceptance stay whole).
"""

from __future__ import annotations

from typing import Any

from moetrace.hooks.options import RecordingOptions


def sampled_manifest(options: RecordingOptions) -> dict[str, Any] | None:
    """The manifest's ``capture.sampled``: what the policy kept (None: everything)."""
    if options.sample_steps is not None:
        return {"steps": options.sample_steps, "every_seconds": options.sample_every_seconds}
    if options.sample_requests is not None:
        return {"one_request_in": options.sample_requests}
    return None


class StepBursts:
    """Admits ``steps`` request steps (a burst), then none until ``every_seconds`` have passed since that burst's first
    step, then the next burst's. The clock is the caller's (seconds, monotonic)."""

    def __init__(self, steps: int, every_seconds: float) -> None:
        self.steps, self.every_seconds = steps, every_seconds
        self.taken = 0  # steps admitted in the burst under way
        self.began = 0.0  # when it began
        self.bursts = 0  # bursts begun

    def admits(self, now: float) -> bool:
        """Whether the request step that begins at ``now`` is recorded (called once per request step)."""
        if self.taken >= self.steps:
            if now - self.began < self.every_seconds:
                return False
            self.taken = 0
        if self.taken == 0:
            self.began, self.bursts = now, self.bursts + 1
        self.taken += 1
        return True
