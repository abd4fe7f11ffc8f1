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


def tost_paired(diffs: Iterable[float], margin: float, alpha: float = 0.05) -> dict:
    """Two one-sided t-tests (Schuirmann's TOST) that the mean of paired differences (one per seed, e.g.
    async minus sync final held-out EM) lies inside ``(-margin, +margin)``.

    H0: ``mean <= -margin`` or ``mean >= +margin``; H1: ``|mean| < margin``. With ``se = sd / sqrt(n)``
    and ``df = n - 1``: ``p_lower = P(T >= (mean + margin) / se)``, ``p_upper = P(T <= (mean - margin) /
    se)``, ``p = max(p_lower, p_upper)``; equivalence is shown at level ``alpha`` when ``p < alpha``, which is
    the same as the ``1 - 2 alpha`` t-interval of the mean lying inside the margins (returned as ``lo``,
    ``hi``). With ``sd = 0`` the tests are decided by the mean alone (p 0 or 1). Fewer than 2 differences
    cannot show anything: ``equivalent`` is None.

    Returns ``{n, mean, sd, se, df, margin, alpha, t_lower, t_upper, p_lower, p_upper, p, lo, hi, level,
    equivalent}``."""
    xs = [float(x) for x in diffs]
    if not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin={margin} must be a finite number > 0")
    if not (0.0 < alpha < 0.5):
        raise ValueError(f"alpha={alpha} must be in (0, 0.5)")
    if any(not math.isfinite(x) for x in xs):
        raise ValueError(f"tost_paired: non-finite differences {xs}")
    n = len(xs)
    nan = float("nan")
    out = {"n": n, "margin": float(margin), "alpha": float(alpha), "level": 1.0 - 2.0 * alpha}
    if n < 2:
        return {**out, "mean": xs[0] if xs else nan, "sd": nan, "se": nan, "df": n - 1, "t_lower": nan,
                "t_upper": nan, "p_lower": nan, "p_upper": nan, "p": nan, "lo": nan, "hi": nan, "equivalent": None}
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    se, df = sd / math.sqrt(n), n - 1
    if se == 0.0:
        inside = -margin < mean < margin
        p = 0.0 if inside else 1.0
        return {**out, "mean": mean, "sd": sd, "se": se, "df": df, "t_lower": nan, "t_upper": nan,
                "p_lower": p if mean > -margin else 1.0, "p_upper": p if mean < margin else 1.0, "p": p,
                "lo": mean, "hi": mean, "equivalent": inside}
    t_lo, t_hi = (mean + margin) / se, (mean - margin) / se
    p_lo, p_hi = float(_student_t.sf(t_lo, df)), float(_student_t.cdf(t_hi, df))
    half = float(_student_t.ppf(1.0 - alpha, df)) * se
    p = max(p_lo, p_hi)
    return {**out, "mean": mean, "sd": sd, "se": se, "df": df, "t_lower": t_lo, "t_upper": t_hi, "p_lower": p_lo,
            "p_upper": p_hi, "p": p, "lo": mean - half, "hi": mean + half, "equivalent": bool(p < alpha)}
