"""Policies that pick k step by step, replayed against recorded acceptance: checked by hand arithmetic."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from moetrace.analysis.policies import MIN_REPLAY_STEPS, compare_policies, lockstep, policies, policy_verdict, replay

STEP_MS = {0: 1.0, 1: 1.2, 2: 1.5}


def streams(*accepted: list[int]) -> list[np.ndarray]:
    return [np.array(a, dtype=np.int64) for a in accepted]


def steps_table(*accepted: list[int]) -> pl.LazyFrame:
    """A steps table of decoding request-steps at k = 2, request r accepting ``accepted[r]`` in its steps."""
    rows = [{"step": step, "request": request, "num_tokens": 3, "num_drafts": 2, "num_accepted": a}
            for request, per_step in enumerate(accepted) for step, a in enumerate(per_step)]
    return pl.DataFrame(rows).lazy()


def test_lockstep_keeps_every_slot_busy_and_stops_when_no_request_is_left_to_start() -> None:
    # two slots, three requests: the second slot's one-step request is replaced by the third after step 0
    matrix = lockstep(streams([2, 0, 1], [1], [0, 2]), 2)
    assert matrix.tolist() == [[2, 1], [0, 0], [1, 2]]
    assert lockstep(streams([1]), 2).shape == (0, 2)  # fewer requests than slots: nothing to replay


def test_fixed_k_and_the_acceptance_ema_by_hand() -> None:
    accepted = lockstep(streams([2, 0], [1]), 1)  # steps accepting 2, 0, 1 of 2 drafts
    named = policies(STEP_MS, 2, 1)
    # k=1 gains 2 + 1 + 2 tokens in 3 steps of 1.2 ms; k=2 gains 3 + 1 + 2 in 3 of 1.5 ms
    assert replay(accepted, STEP_MS, 2, named["fixed k=1"]) == (pytest.approx(5 / 3.6), 1.0)
    assert replay(accepted, STEP_MS, 2, named["fixed k=2"])[0] == pytest.approx(6 / 4.5)
    # the EMA starts at 0.5 per position (1 accepted draft a step, so k = 2); after a step accepting both it is
    # 0.6 + 0.6 (k = 2), after one accepting none 0.48 + 0.48 (k = 2 again, 0.96 rounding to 1)
    assert replay(accepted, STEP_MS, 2, named["acceptance EMA"]) == (pytest.approx(6 / 4.5), 2.0)


def test_utility_probes_the_largest_k_then_runs_the_k_of_largest_expected_tokens_per_step_time() -> None:
    # every step accepts nothing: after the probe at k=2 the averages fall to 0.4 per position, so k=1 is worth
    # (1 + 0.4) / 1.2 = 1.17 and k=2 (1 + 0.8) / 1.5 = 1.2 at first, then less than k = 0's 1 as they fall
    accepted = lockstep(streams([0] * 10), 1)
    rate, mean_k = replay(accepted, STEP_MS, 2, policies(STEP_MS, 2, 0)["utility"])
    ks = []
    seen = [0.5, 0.5]
    for step in range(10):
        k = 2 if step == 0 else int(np.argmax([1.0, (1 + seen[0]) / 1.2, (1 + seen[0] + seen[1]) / 1.5]))
        ks.append(k)
        seen = [value - 0.2 * value if i < k else value for i, value in enumerate(seen)]
    assert mean_k == pytest.approx(sum(ks) / 10) and ks[-1] == 0
    assert rate == pytest.approx(10 / sum(STEP_MS[k] for k in ks))


def test_the_comparison_names_the_best_fixed_k_and_says_when_nothing_beats_the_table_beyond_the_noise() -> None:
    table = steps_table(*([[2, 2, 1, 0] * 4] * 40))
    compared = compare_policies(table, 2, {1: STEP_MS, 4: STEP_MS}, {1: 0, 4: 2})
    one = {row["policy"]: row for row in compared.filter(pl.col("batch") == 1).to_dicts()}
    # 40 requests of 16 steps: 640 steps through one slot, 160 through four
    assert set(compared.filter(pl.col("batch") == 1)["steps"]) == {640}
    assert set(compared.filter(pl.col("batch") == 4)["steps"]) == {160}
    # every request accepts 2, 2, 1, 0 (four times): k=2 gains 3 + 3 + 2 + 1 = 9 tokens per 6 ms, k=1 7 per 4.8,
    # k=0 4 per 4
    assert one["best fixed"]["k"] == 2 and one["best fixed"]["speedup"] == pytest.approx(9 / 6)
    assert one["static table"]["k"] == 0 and one["static table"]["speedup"] == pytest.approx(1.0)
    assert one["best fixed"]["vs_table"] == pytest.approx(1.5) and one["best fixed"]["vs_table_low"] > 1.0
    verdict = policy_verdict(compared, [1, 4, 32], 40)
    assert verdict[0] == "B=1: best fixed beats the static table by +50.0% (95% 1.500-1.500x)"
    # at 4 the table already runs k=2, the best: nothing beats it
    assert verdict[1].startswith("B=4: no policy beats the static table beyond the noise")
    assert verdict[2] == "B=32: not replayed: the trace holds 40 request(s), fewer than 32 slots"


def test_a_replay_that_keeps_the_slots_busy_for_few_steps_is_shown_but_not_judged() -> None:
    # 10 requests of 4 steps through 8 slots: all 8 end together after step 4 and only 2 are left to start
    table = steps_table(*([[2, 2, 1, 0]] * 10))
    compared = compare_policies(table, 2, {8: STEP_MS}, {8: 0})
    assert set(compared["steps"]) == {4} and compared["vs_table_low"].null_count() == len(compared)
    best = compared.filter(pl.col("policy") == "best fixed").row(0, named=True)
    assert best["k"] == 2 and best["vs_table"] == pytest.approx(1.5)  # the replay itself still runs
    assert policy_verdict(compared, [8], 10) == [
        f"B=8: not judged: 4 replayed steps with all 8 slots busy, fewer than {MIN_REPLAY_STEPS}"]


def test_a_gain_below_two_percent_is_not_called_a_win_however_tight_its_interval() -> None:
    rows = pl.DataFrame({"batch": [1, 1], "policy": ["static table", "utility"], "steps": [500, 500], "k": [4, None],
                         "speedup": [2.0, 2.03], "mean_k": [4.0, 3.9], "vs_table": [1.0, 1.015],
                         "vs_table_low": [1.0, 1.014], "vs_table_high": [1.0, 1.016]})
    assert policy_verdict(rows, [1], 8)[0].startswith("B=1: no policy beats the static table beyond the noise")
