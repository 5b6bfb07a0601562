"""What a sweep's own traces measured per step at one concurrency (``--profile measured``), as the cost model
(``analysis.cost.predict``) takes it: the k=0 step, and per k what the forward grew, drafting, sampling and
prefill took; a k not recorded takes the nearest recorded k's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

def per_k_from_nearest(measured: Mapping[int, float], ks: Sequence[int], scale_with_k: bool) -> dict[int, float]:
    """A time per step (ms) at every k > 0 of ``ks``: measured where recorded; elsewhere from the nearest recorded k,
    scaled by k when ``scale_with_k``, else held."""
    if not measured:
        raise ValueError("nothing measured")
    out = {}
    for k in (k for k in ks if k > 0):
        nearest = min(measured, key=lambda recorded: (abs(recorded - k), recorded))
        out[k] = measured[k] if k in measured else measured[nearest] * (k / nearest if scale_with_k else 1.0)
    return out


@dataclass(frozen=True)
class MeasuredSteps:
    """What a sweep's own traces measured at one concurrency, ms per step (``--profile measured``).

    ``baseline_ms``: the k=0 decode step (start to start). Per recorded k > 0 (a k not recorded takes the nearest
    recorded k's): ``forward_growth_ms``, how much longer vLLM's forward ran than at k=0 (MoE, attention and dense
    layers over more tokens, CUDA-graph padding); ``sampling_ms``, the rejection sampler's time over k=0's
    sampling; ``drafting_ms``, the drafter's own time (already given at every k). ``scheduling_ms``: what async
    scheduling off adds to every k > 0 step (a k=0 step recorded that way, less ``baseline_ms``).
    ``prefill_ms_per_token``: per recorded k (k=0 included), what a request of this concurrency waits for
    prefills per token it gains, from what that trace's prefills took beyond its decode steps over the whole trace
    (``analysis.acceptance.decode_step_periods``); a k > 0 not recorded takes the nearest recorded k > 0's. Measured
    per k, not held from k=0: async scheduling (on at k=0 for n-gram, off under it) changes what a prefill costs
    beside the decode steps. The speedup is then of the recorded workload's throughput, prefill included
    (``end_to_end_speedup``).

    At a concurrency the sweep did not record (``estimated_from``: the recorded concurrencies it is drawn from,
    ``analysis.decision.across_batches``), ``baseline_ms`` is the k=0 trace's decode step there where it passed
    through that concurrency enough steps (the k=0 step alone: the k > 0 steps are still built from ``rest_ms``),
    else None and the step is built from ``rest_ms``, the k=0 step less its calibrated MoE and all-reduce,
    estimated; ``forward_beyond_ms``, the forward's growth beyond the calibrated MoE per k, and the other terms are
    estimated the same way."""

    baseline_ms: float | None
    forward_growth_ms: Mapping[int, float] = field(default_factory=dict)
    sampling_ms: Mapping[int, float] | None = None
    drafting_ms: Mapping[int, float] | None = None
    scheduling_ms: float | None = None
    prefill_ms_per_token: Mapping[int, float] = field(default_factory=dict)
    rest_ms: float | None = None
    forward_beyond_ms: Mapping[int, float] | None = None
    estimated_from: tuple[int, ...] = ()


def prefill_per_k(measured: Mapping[int, float], ks: Sequence[int]) -> dict[int, float]:
    """Prefill ms per token gained at every k of ``ks``: k = 0's as recorded (0 when not), each k > 0 its own or the
    nearest recorded k > 0's, k = 0's where no k > 0 recorded one."""
    speculated = {k: ms for k, ms in measured.items() if k > 0}
    out = {0: float(measured.get(0, 0.0))}
    if speculated:
        return out | per_k_from_nearest(speculated, ks, scale_with_k=False)
    return out | {k: out[0] for k in ks if k > 0}


def forward_beyond_moe(forward_growth_ms: Mapping[int, float], moe_growth_ms: Mapping[int, float],
                       ks: Sequence[int]) -> dict[int, float]:
    """Per k > 0 of ``ks``: how much more the forward grew than the calibrated MoE and all-reduce growth
    (``moe_growth_ms``, per k) where a trace measured it, held from the nearest measured k elsewhere (negative where
    the calibration prices more growth than the forward showed); empty when none was measured."""
    beyond = {k: grew - moe_growth_ms[k] for k, grew in forward_growth_ms.items() if k > 0 and k in moe_growth_ms}
    return per_k_from_nearest(beyond, ks, scale_with_k=False) if beyond else {}
