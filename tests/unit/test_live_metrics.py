"""Live metrics of a recording (``moetrace.writer.metrics``): every figure against a brute force over the steps,
in process and as the writer process serves them over HTTP, within the stated series bound."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections import Counter as Tally
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moetrace.writer.metrics import IMBALANCE_STEPS, LiveMetrics, MetricsState, layer_groups, series_bound
from moetrace.writer.process import TraceWriter
from conftest import free_port
from writer_steps import EXPERTS, LAYERS, manifest, submit_and_wait, verify_step


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition text, by name and labels (parsed by prometheus_client's own parser)."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def expected(captures: list[Any], groups: list[tuple[str, Any]]) -> dict[str, Any]:
    """Brute force: drafts and acceptances by position, and per group the sum over verification steps of the mean
    over its layers of the unique experts the step's tokens read."""
    drafts = sum(int(a >= 0) for c in captures for a in c.accepted)
    accepted = sum(int(a == 1) for c in captures for a in c.accepted)
    at, hit = Tally[int](), Tally[int]()
    for c in captures:
        for position, flag in zip(c.draft_pos, c.accepted):
            if flag >= 0:
                at[int(position)] += 1
                hit[int(position)] += int(flag == 1)
    unique_sum = {label: sum(np.mean([len({int(e) for t in range(len(c.request)) for e in c.experts[t, s]})
                                      for s in slots]) for c in captures) for label, slots in groups}
    return {"drafts": drafts, "accepted": accepted, "at": at, "hit": hit, "unique_sum": unique_sum}


def test_live_metrics_equal_a_brute_force_over_the_steps_and_stay_within_their_bound() -> None:
    registry = CollectorRegistry()
    groups = layer_groups([3, 4, 5, 6, 7, 8, 9, 10, 11])  # 9 layers: 4 groups of consecutive layers
    assert [label for label, _ in groups] == ["3-5", "6-7", "8-9", "10-11"]
    metrics = LiveMetrics([3, 4, 5, 6, 7, 8, 9, 10, 11], EXPERTS, 3, registry)
    rng = np.random.default_rng(7)
    captures = []
    for step in range(IMBALANCE_STEPS):
        c = verify_step(step, rng, requests=2, drafts=3, accepted=step % 4)
        # the builder routes 3 layers: widen to 9, the busiest expert 0 in every layer of every token's first slot
        c.experts = np.concatenate([c.experts] * 3, axis=1)
        c.experts[:, :, 0] = 0
        captures.append(c)
    metrics.observe(captures)
    got = samples(generate(registry))
    want = expected(captures, groups)
    assert got[("moetrace_draft_tokens_total", ())] == want["drafts"]
    assert got[("moetrace_accepted_tokens_total", ())] == want["accepted"]
    for position in (1, 2, 3):
        assert got[("moetrace_drafts_at_position_total", (("position", str(position)),))] == want["at"][position]
        assert got[("moetrace_accepted_at_position_total", (("position", str(position)),))] == want["hit"][position]
    for label, slots in groups:
        key = (("layers", label),)
        assert got[("moetrace_unique_experts_per_verify_step_count", key)] == IMBALANCE_STEPS
        assert got[("moetrace_unique_experts_per_verify_step_sum", key)] == pytest.approx(want["unique_sum"][label])
        # after IMBALANCE_STEPS steps: the busiest expert's picks (expert 0: every token's first slot) over the
        # mean expert's, counted pick by pick in each of the group's layers
        ratios = []
        for layer in slots:
            picks = Tally(int(e) for c in captures for t in range(len(c.request)) for e in c.experts[t, layer])
            ratios.append(max(picks.values()) / (sum(picks.values()) / EXPERTS))
        assert max(picks, key=lambda e: picks[e]) == 0
        assert got[("moetrace_expert_load_imbalance", key)] == pytest.approx(np.mean(ratios))
    # every series the bound counts, and no more (the endpoint leaves out the ``_created`` ones this registry has)
    assert len([name for name, _ in got if not name.endswith("_created")]) == series_bound(len(groups), 3)


def generate(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def served(port: int, drafts: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The endpoint's samples once it counts ``drafts`` draft tokens (the writer process updates its metrics after
    each write; a new writer process serves once the last one has let go of the port), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        try:
            got = samples(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        except urllib.error.URLError:
            got = {}
        if got.get(("moetrace_draft_tokens_total", ())) == drafts or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_the_writer_process_serves_live_metrics_of_the_steps_it_wrote(tmp_path: Any) -> None:
    port = free_port()
    writer = TraceWriter(tmp_path, manifest(k=2), LAYERS, 8, metrics_port=port)
    rng = np.random.default_rng(3)
    captures = [verify_step(step, rng, requests=3, drafts=2, accepted=step % 3) for step in range(5)]
    for capture in captures:
        submit_and_wait(writer, capture)
    want = expected(captures, layer_groups(LAYERS))
    got = served(port, want["drafts"])
    final = writer.close()
    assert got[("moetrace_draft_tokens_total", ())] == want["drafts"] == final["counts"]["drafts"]
    assert got[("moetrace_accepted_tokens_total", ())] == want["accepted"] == final["counts"]["accepted"]
    assert got[("moetrace_accepted_at_position_total", (("position", "2"),))] == want["hit"][2]
    assert not any(name.endswith("_created") for name, _ in got)
    assert len(got) <= series_bound(len(LAYERS), 2)


def test_live_metrics_run_on_across_a_partition_switch_counters_monotone_and_the_load_gauge_kept(
        tmp_path: Any) -> None:
    """Two partitions' writer processes in turn on one port, as an always-on recording switches: the second starts
    while the first closes. The endpoint counts every step of both, and the load gauge that the first partition's
    steps set is still there (before, each writer process's counters began at 0 and the gauge read 0)."""
    port = free_port()
    state = MetricsState.create(len(LAYERS), EXPERTS, 2)
    rng = np.random.default_rng(5)
    first = [verify_step(step, rng, requests=2, drafts=2, accepted=step % 3) for step in range(IMBALANCE_STEPS)]
    second = [verify_step(step, rng, requests=3, drafts=2, accepted=step % 2) for step in range(7)]
    old = TraceWriter(tmp_path / "p0", manifest(k=2), LAYERS, 8, metrics_port=port, metrics_state=state)
    for capture in first:
        old.submit(capture)
    old.forward_ready()
    before = served(port, expected(first, layer_groups(LAYERS))["drafts"])
    gauges = {key: value for key, value in before.items() if key[0] == "moetrace_expert_load_imbalance"}
    assert len(gauges) == len(LAYERS) and all(value > 1 for value in gauges.values())
    new = TraceWriter(tmp_path / "p1", manifest(k=2), LAYERS, 8, metrics_port=port, metrics_state=state,
                      launch_beside=True)
    old.close()
    for capture in second:
        submit_and_wait(new, capture)
    both = expected(first + second, layer_groups(LAYERS))
    after = served(port, both["drafts"])
    new.close()
    state.close()
    assert after[("moetrace_draft_tokens_total", ())] == both["drafts"] > before[("moetrace_draft_tokens_total", ())]
    assert after[("moetrace_accepted_tokens_total", ())] == both["accepted"]
    for position in (1, 2):
        key = (("position", str(position)),)
        assert after[("moetrace_drafts_at_position_total", key)] == both["at"][position]
        assert after[("moetrace_accepted_at_position_total", key)] == both["hit"][position]
    for label, _ in layer_groups(LAYERS):
        key = (("layers", label),)
        assert after[("moetrace_unique_experts_per_verify_step_count", key)] == IMBALANCE_STEPS + len(second)
        assert after[("moetrace_unique_experts_per_verify_step_sum", key)] == pytest.approx(both["unique_sum"][label])
        assert after[("moetrace_expert_load_imbalance", key)] == gauges[("moetrace_expert_load_imbalance", key)]
