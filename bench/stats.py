"""Confidence intervals from seeds: Student's t (scipy's).

A benchmark run once per seed gives n independent numbers per setting (the seeds are the unit of
replication, never the steps of one run: those are autocorrelated). The 95 % interval of their mean is
``mean +- t(0.975, n - 1) * sd / sqrt(n)`` with ``sd`` the sample standard deviation (ddof 1). The t
distribution is ``scipy.stats.t`` (tests/bench/test_bench_stats.py pins it to the closed forms for 1 and 2
degrees of freedom and to the printed table).
"""
from __future__ import annotations

import math
from typing import Iterable

from scipy.stats import t as _student_t


def t_quantile(level: float, df: int) -> float:
    """The t with ``P(|T| <= t) = level`` (e.g. level 0.95 -> the 0.975 quantile)."""
    if not (0.0 < level < 1.0):
        raise ValueError(f"level={level} must be in (0, 1)")
    if df < 1 or int(df) != df:
        raise ValueError(f"df={df} must be an integer >= 1")
    return float(_student_t.ppf(0.5 + level / 2.0, int(df)))


def mean_ci(samples: Iterable[float], level: float = 0.95) -> dict:
    """``{mean, sd, n, half, lo, hi, level}``: the t-interval of the mean of independent samples (one per
    seed). With one sample the interval is unknown: ``sd``, ``half``, ``lo`` and ``hi`` are NaN."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError("mean_ci: no samples")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        nan = float("nan")
        return {"mean": mean, "sd": nan, "n": n, "half": nan, "lo": nan, "hi": nan, "level": level}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "n": n, "half": half, "lo": mean - half, "hi": mean + half, "level": level}


def within(x: float, ci: dict) -> bool | None:
    """Whether ``x`` lies in the interval ``ci`` (``mean_ci``'s); None when the interval is unknown (n = 1)."""
    if not (math.isfinite(ci["lo"]) and math.isfinite(ci["hi"])):
        return None
    return bool(ci["lo"] <= x <= ci["hi"])
