"""What moetrace found, in an engine's own format. ``moetrace export REPORT.json --vllm-spec-schedule`` turns the
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
LAST_CONTEXT = 2**31 - 1  # the last context range runs to here: any context the model takes
BY_CONTEXT_PROPOSAL = ("5-item entries [batch from, batch to, context from, context to, k]: vLLM's open proposal "
                       "(RFC #48627, PR #48944), which no vLLM release reads yet")


def range_ends(values: Sequence[int], last: int = LAST_BATCH) -> list[int]:
    """The last value each recommended concurrency (or context length) covers: up to the geometric midpoint with the
    next one (compared on a log scale: 8 is as far from 1 as 64 from 8), the last to ``last``."""
    ends = [max(low, min(math.isqrt(low * high), high - 1)) for low, high in zip(values, values[1:])]
    return ends + [max(last, values[-1])]


def batch_ranges(k_at: Mapping[int, int | None]) -> list[list[int]]:
    """``[start, end, k]`` ranges from batch size 1 for the k recommended at each concurrency (``range_ends``),
    neighbouring ranges of the same k merged; a concurrency with none (None) leaves its range out."""
    batches = sorted(k_at)
    ranges: list[list[int]] = []
    start = 1
    for batch, end in zip(batches, range_ends(batches)):
        k = k_at[batch]
        if k is not None and ranges and ranges[-1][2] == k and ranges[-1][1] == start - 1:
            ranges[-1][1] = end
        elif k is not None:
            ranges.append([start, end, k])
        start = end + 1
    return ranges


def vllm_spec_schedule(decision: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's speculative config keys for one drafter's decision (a ``decision`` entry of the report's payload): the
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
    schedule = batch_ranges({int(row["batch"]): int(row["k"]) for row in rows})
    largest = max(k for _, _, k in schedule)
    if largest == 0:
        raise ValueError("no concurrency pays for speculation (k = 0 at every one): nothing to schedule")
    return {"method": decision["drafter"], "num_speculative_tokens": largest,
            "num_speculative_tokens_per_batch_size": schedule}


def vllm_spec_schedule_by_context(decision: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """vLLM's speculative config keys in the proposed 5-item form (``BY_CONTEXT_PROPOSAL``) for one drafter's
    decision per (concurrency, context) (``moetrace report --context``): each context covers the context lengths up
    to the geometric midpoint with the next (the last to ``LAST_CONTEXT``), each concurrency its batch sizes as in
    ``vllm_spec_schedule``; neighbouring batch ranges of one context with the same k merged. A cell with no
    recommendation (a KV cache that would not fit) is left out: the second value says which and why. Raises
    ``ValueError`` where the decision has no contexts or no cell pays."""
    found = decision.get("by_context")
    if not found or not found.get("per_batch"):
        raise ValueError("the decision has no contexts: report it with --context L,L,...")
    cells = {(int(row["context"]), int(row["batch"])): row for row in found["per_batch"]}
    contexts, batches = sorted({c for c, _ in cells}), sorted({b for _, b in cells})
    schedule: list[list[int]] = []
    left_out = [f"{batch} request(s) at {context:,} tokens: {cell.get('status')}"
                for (context, batch), cell in sorted(cells.items()) if cell.get("k") is None]
    context_start = 1
    for context, context_end in zip(contexts, range_ends(contexts, LAST_CONTEXT)):
        k_at = {batch: None if cells[(context, batch)].get("k") is None else int(cells[(context, batch)]["k"])
                for batch in batches}
        schedule += [[start, end, context_start, context_end, k] for start, end, k in batch_ranges(k_at)]
        context_start = context_end + 1
    largest = max((entry[4] for entry in schedule), default=0)
    if largest == 0:
        raise ValueError("no concurrency pays for speculation at any context: nothing to schedule")
    return ({"method": decision["drafter"], "num_speculative_tokens": largest,
             "num_speculative_tokens_per_batch_size": schedule}, left_out)


def decision_at_context(decision: Mapping[str, Any], context: int) -> dict[str, Any]:
    """``decision`` with the rows decided at ``context`` (``moetrace report --context``) as its per_batch table;
    ``ValueError`` where that context was not reported."""
    found = (decision.get("by_context") or {}).get("per_batch") or []
    rows = [row for row in found if int(row["context"]) == context]
    if not rows:
        reported = sorted({int(row["context"]) for row in found})
        raise ValueError(f"no decision at context {context:,} (reported at: "
                         f"{', '.join(f'{c:,}' for c in reported) or 'none: report it with --context'})")
    return {**decision, "per_batch": rows}


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
