"""Confidence intervals from seeds, without scipy: Student's t for an integer number of degrees of freedom.

A benchmark run once per seed gives n independent numbers per setting (the seeds are the unit of
replication, never the steps of one run: those are autocorrelated). The 95 % interval of their mean is
``mean +- t(0.975, n - 1) * sd / sqrt(n)`` with ``sd`` the sample standard deviation (ddof 1).

The t quantile comes from the closed form of the two-sided t distribution function for integer df
(Abramowitz & Stegun 26.7.3 / 26.7.4), with theta = atan(t / sqrt(df)):

- df odd:  A(t|df) = (2/pi) * (theta + sin(theta) * (cos(theta) + 2/3 cos^3(theta) + ...
  + [2*4*...*(df-3)] / [1*3*...*(df-2)] cos^(df-2)(theta)))    (df = 1: 2*theta/pi)
- df even: A(t|df) = sin(theta) * (1 + 1/2 cos^2(theta) + 1*3/(2*4) cos^4(theta) + ...
  + [1*3*...*(df-3)] / [2*4*...*(df-2)] cos^(df-2)(theta))

``A(t|df) = P(|T| <= t)``, increasing in t, inverted by bisection to 1e-12.
"""
from __future__ import annotations

import math
from typing import Iterable


def t_two_sided_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` (integer >= 1) degrees of freedom, t >= 0."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df={df} must be an integer >= 1")
    if t < 0:
        raise ValueError(f"t={t} must be >= 0")
    if math.isinf(t):
        return 1.0
    df = int(df)
    theta = math.atan(t / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2 == 1:
        if df == 1:
            return 2.0 * theta / math.pi
        term, total = c, c
        for k in range(3, df, 2):  # term_k = term_{k-2} * (k-1)/k * cos^2
            term *= (k - 1) / k * c * c
            total += term
        return 2.0 / math.pi * (theta + s * total)
    term, total = 1.0, 1.0
    for k in range(2, df, 2):  # term_k = term_{k-2} * (k-1)/k * cos^2
        term *= (k - 1) / k * c * c
        total += term
    return s * total


def t_quantile(level: float, df: int) -> float:
    """The t with ``P(|T| <= t) = level`` (e.g. level 0.95 -> the 0.975 quantile)."""
    if not (0.0 < level < 1.0):
        raise ValueError(f"level={level} must be in (0, 1)")
    lo, hi = 0.0, 1.0
    while t_two_sided_cdf(hi, df) < level:
        hi *= 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if t_two_sided_cdf(mid, df) < level:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


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
