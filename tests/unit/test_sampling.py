"""Sampled recording's bursts (``moetrace.hooks.sampling``) against a hand-driven clock."""

from __future__ import annotations

from moetrace.hooks.sampling import StepBursts


def test_a_burst_of_n_steps_every_m_seconds_admits_exactly_those_steps() -> None:
    bursts = StepBursts(steps=3, every_seconds=10.0)
    # a request step every 2 s from t = 0: bursts begin at 0, 10 and 20 (10 s after each burst's first step),
    # each admitting that step and the next two
    admitted = [t for t in range(0, 30, 2) if bursts.admits(float(t))]
    assert admitted == [0, 2, 4, 10, 12, 14, 20, 22, 24]
    assert bursts.bursts == 3


def test_after_a_pause_longer_than_the_period_the_next_step_opens_a_burst_at_once() -> None:
    bursts = StepBursts(steps=2, every_seconds=5.0)
    assert [bursts.admits(t) for t in (0.0, 0.1, 0.2)] == [True, True, False]
    # no request step for 60 s (an idle server): the next one begins a burst, which is 2 steps long again
    assert [bursts.admits(t) for t in (60.0, 60.1, 60.2, 64.9, 65.0)] == [True, True, False, False, True]
