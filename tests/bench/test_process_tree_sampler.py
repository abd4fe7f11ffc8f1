"""``bench.driver_harness.ProcessTreeSampler``: the memory sampler of the end-to-end and default-run
benchmarks keeps its own CPU within its budget (a share of one core), whatever one sample costs."""
from __future__ import annotations

import time

import pytest

from sonar.bench.driver_harness import ProcessTreeSampler


def _burn(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_an_expensive_sample_stretches_the_interval_to_the_budget():
    """Each sample burns 20 ms of the sampling thread's CPU; at a 10 % budget the next one may start no
    sooner than 0.2 s after its start (0.2 s > interval_s): a bound from below on the series' start times,
    which load only widens."""
    sampler = ProcessTreeSampler(interval_s=0.01, cpu_budget=0.1)
    sampler.processes = lambda: []  # what is sampled is not the point here
    real = sampler._sample

    def costly():
        _burn(0.02)
        return real()

    sampler._sample = costly
    with sampler:
        while sampler.samples < 4:  # the first in __enter__, three in the loop
            time.sleep(0.01)
    starts = [t for t, _, _ in sampler.series]
    gaps = [b - a for a, b in zip(starts[1:], starts[2:])]  # the loop's own gaps (the first follows __enter__'s)
    assert gaps and min(gaps) >= 0.2, gaps
    res = sampler.result()
    assert res["sampler_cpu_s"] >= 0.02 * sampler.samples and res["cpu_budget"] == 0.1
    assert res["mean_interval_s"] >= 0.2 * (len(starts) - 2) / (len(starts) - 1) - 1e-3  # (rounded to 1 ms)


def test_a_budget_outside_one_core_is_refused():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"cpu_budget {bad!r} must be in \(0, 1\]"):
            ProcessTreeSampler(cpu_budget=bad)
