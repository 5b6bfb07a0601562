"""The recorder's timed calls (``hooks.timing``): a bounded, uniform sample per batch size."""

from __future__ import annotations

import numpy as np

from moetrace.hooks.timing import PhaseTiming, Reservoir


def test_below_its_size_a_reservoir_keeps_every_value_in_order() -> None:
    kept = Reservoir(size=8)
    for value in range(5):
        kept.add(float(value))
    assert kept.values == [0.0, 1.0, 2.0, 3.0, 4.0] and kept.count == 5


def test_past_its_size_a_reservoir_keeps_a_uniform_sample_and_counts_all() -> None:
    kept = Reservoir(size=1000)
    for value in range(100_000):
        kept.add(float(value))
    assert kept.count == 100_000 and len(kept.values) == 1000 and len(set(kept.values)) == 1000
    # a uniform sample of 0..99,999: each tenth of the range holds about a tenth (binomial sd 9.5), the median ~50,000
    tenths = np.bincount(np.array(kept.values, dtype=np.int64) // 10_000, minlength=10)
    assert tenths.min() >= 100 - 40 and tenths.max() <= 100 + 40
    assert abs(np.median(kept.values) - 50_000) < 4_000


def test_a_phases_medians_count_every_call_and_come_from_the_sample() -> None:
    timing = PhaseTiming(cuda=False)
    for call in range(10_000):  # batch 4: host time call ms; past 4,096 kept, the count stays exact
        timing.start()
        timing.end(4, (), call * 1_000_000)
    medians = timing.medians()["4"]
    assert medians["calls"] == 10_000 and medians["device_ms_median"] is None
    assert abs(medians["host_ms_median"] - 5_000) < 300  # the whole's median is 4,999.5 ms
    assert len(timing.host_ms[4].values) == 4096
