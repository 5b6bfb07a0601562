"""What moetrace found, in an engine's own format. ``moetrace export SUMMARY --vllm-spec-schedule`` turns the
decision table of ``moetrace report --json`` into vLLM's dynamic speculative-decoding schedule
(``SpeculativeConfig.num_speculative_tokens_per_batch_size``, vLLM 0.32: inclusive batch-size ranges, each with
the number of speculative tokens to run at it). ``moetrace export TRACE --sglang-expert-location`` turns a trace's
expert load in decode and verification into SGLang's ``--init-expert-location`` file (``logical_count``, or with
``--ep`` a ``physical_to_logical_map``). Plain data in and out; no engine import."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from moetrace.analysis.placement import replicated_placement

LAST_BATCH = 65536  # the last range runs to here: vLLM reads its schedule up to its own max_num_seqs


def range_ends(batches: Sequence[int]) -> list[int]:
    """The last batch size each recommended concurrency covers: up to the geometric midpoint with the next one
    (concurrencies are compared on a log scale: 8 is as far from 1 as 64 from 8), the last to ``LAST_BATCH``."""
    ends = [max(low, min(math.isqrt(low * high), high - 1)) for low, high in zip(batches, batches[1:])]
    return ends + [max(LAST_BATCH, batches[-1])]


def vllm_spec_schedule(decision: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's speculative config keys for one drafter's decision (a ``decision`` entry of the summary JSON): the
    method, ``num_speculative_tokens`` (the largest k recommended: vLLM caps every range at it) and
    ``num_speculative_tokens_per_batch_size`` as ``[start, end, k]`` ranges from batch size 1, neighbouring ranges of
    the same k merged. Raises ``ValueError`` where a concurrency has no recommendation (too few windows, routing and
    steps in disagreement) or where no concurrency pays."""
    rows = sorted(decision.get("per_batch") or [], key=lambda row: int(row["batch"]))
    if not rows:
        raise ValueError("the decision table is empty")
    for row in rows:
        if row.get("status") != "ok" or row.get("k") is None:
            raise ValueError(f"no k is recommended at {row['batch']} request(s) per step: {row.get('status')}")
    batches = [int(row["batch"]) for row in rows]
    schedule: list[list[int]] = []
    start = 1
    for row, end in zip(rows, range_ends(batches)):
        k = int(row["k"])
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = end
        else:
            schedule.append([start, end, k])
        start = end + 1
    largest = max(k for _, _, k in schedule)
    if largest == 0:
        raise ValueError("no concurrency pays for speculation (k = 0 at every one): nothing to schedule")
    return {"method": decision["drafter"], "num_speculative_tokens": largest,
            "num_speculative_tokens_per_batch_size": schedule}


def sglang_logical_count(picks: Mapping[tuple[int, int], int], num_layers: int, num_experts: int
                         ) -> npt.NDArray[np.int64]:
    """``logical_count`` [num_layers, num_experts] as SGLang's ``--init-expert-location`` reads it (every decoder
    layer, dense ones all zero): the picks of each (layer, expert)."""
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    for (layer, expert), count in picks.items():
        counts[layer, expert] = count
    return counts


def sglang_physical_to_logical_map(logical_count: npt.NDArray[np.int64], moe_layers: Sequence[int], ep: int,
                                   redundant: int) -> npt.NDArray[np.int64]:
    """``physical_to_logical_map`` [num_layers, num_experts + redundant]: per MoE layer
    ``analysis.placement.replicated_placement`` of its picks; a dense layer's slots in logical order, its extra
    slots on the first experts (SGLang reads a row for every decoder layer)."""
    layers, experts = logical_count.shape
    slots = experts + redundant
    rows = np.tile(np.arange(slots, dtype=np.int64) % experts, (layers, 1))
    for layer in moe_layers:
        rows[layer] = replicated_placement(logical_count[layer].tolist(), ep, redundant)
    return rows
