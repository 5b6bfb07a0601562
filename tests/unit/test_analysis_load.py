"""Expert load per layer, against a count in plain Python."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import moetrace.analysis.load as load
from moetrace.analysis.window_rows import decode_and_verify
from trace_builder import Model, routing_frame, verify_tokens

MODEL = Model(num_experts=16, top_k=2, layers=(1, 3))


@pytest.mark.parametrize("chunk_rows", [7, 4_000_000])
def test_expert_load_counts_every_decode_and_verify_pick(chunk_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load, "CHUNK_ROWS", chunk_rows)
    tokens = verify_tokens(np.random.default_rng(3), MODEL, requests=3, steps=10, k=2, accept_prob=0.5)
    routing = routing_frame(tokens, MODEL)
    expected: Counter[tuple[int, int]] = Counter()
    for row in routing.collect().iter_rows(named=True):
        if row["phase"] != "prefill":
            expected.update((row["layer"], expert) for expert in row["experts"])
    table = load.expert_load(decode_and_verify(routing), MODEL.num_experts)
    assert {(r["layer"], r["expert"]): r["picks"] for r in table.to_dicts()} == dict(expected)
