"""Staleness policy: how old a trajectory may be, and what happens to older ones.

A trajectory sampled by policy version v (``Trajectory.min_version()``: the oldest MODEL segment,
since a multi-turn trajectory can straddle a weight swap) is consumed by a learner at version
``current``; its *policy lag* is ``current - v`` (computed by the replay, ``replay.policy_lag``). ``ReplayConfig.max_policy_lag`` bounds it:
beyond the bound the trajectory is dropped (and counted) or kept with a geometric weight
``stale_downweight ** (lag - max_policy_lag)`` that multiplies its per-token losses
(``LossInputs.sample_weight``). The importance weights of ``losses.policy_loss`` correct the
*bias* of mildly stale data; this bound caps the *variance* by refusing very stale data.

Histogram helpers return ``dict[str, int]`` with MLflow-safe keys (MLflow metric names allow only
alphanumerics, ``_ - . / : `` and space, so no brackets or ``+``).

Pure module: stdlib, numpy, torch and the wire types only.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

import numpy as np
import torch

from sonar.cluster.wire.config import ReplayConfig
from sonar.cluster.wire.protocol import Trajectory

STALE_POLICIES = ("drop", "downweight")


def staleness_decision(lag: int, max_lag: int, policy: str, downweight: float) -> tuple[bool, float]:
    """(keep, weight) for one trajectory.

    lag <= max_lag: (True, 1.0). Beyond: ``drop`` -> (False, 0.0); ``downweight`` ->
    (True, downweight ** (lag - max_lag)), e.g. bound 2, gamma 0.5: lag 3 -> 0.5, lag 4 -> 0.25.
    """
    if policy not in STALE_POLICIES:
        raise ValueError(f"replay.stale_policy={policy!r} is not one of {list(STALE_POLICIES)}")
    if lag < 0 or max_lag < 0:
        raise ValueError(f"lag={lag} and replay.max_policy_lag={max_lag} must be >= 0")
    if policy == "downweight" and not (0.0 < downweight <= 1.0):
        raise ValueError(f"replay.stale_downweight={downweight} must be in (0, 1] for stale_policy='downweight'")
    if lag <= max_lag:
        return True, 1.0
    if policy == "drop":
        return False, 0.0
    return True, float(downweight ** (lag - max_lag))


def apply_staleness(groups: list[list[Trajectory]], lags: Sequence[int], cfg: ReplayConfig) -> list[list[Trajectory]]:
    """Each group's ``staleness_decision`` (lags from the replay, ``replay.policy_lag``): groups past the
    bound are dropped (``drop``) or kept with every trajectory's ``weight`` set (``downweight``).
    Returns new trajectories; the inputs are not modified."""
    if len(groups) != len(lags):
        raise ValueError(f"{len(groups)} groups but {len(lags)} lags")
    kept = []
    for g, lag in zip(groups, lags):
        keep, w = staleness_decision(int(lag), cfg.max_policy_lag, cfg.stale_policy, cfg.stale_downweight)
        if keep:
            kept.append([replace(t, weight=w) for t in g])
    return kept


def lag_histogram(lags: Iterable[int], max_bins: int) -> dict[str, int]:
    """Counts per lag: keys "0" .. str(max_bins - 1), then "ge{max_bins}" for the overflow.

    Every key is present (zeros included) so the metric series are continuous.
    """
    if max_bins < 1:
        raise ValueError(f"max_bins={max_bins} must be >= 1")
    out = {str(i): 0 for i in range(max_bins)}
    over = f"ge{max_bins}"
    out[over] = 0
    for lag in lags:
        lag = int(lag)
        if lag < 0:
            raise ValueError(f"negative lag {lag}")
        out[str(lag) if lag < max_bins else over] += 1
    return out


def _fmt(x: float) -> str:
    return f"{x:g}"


def importance_weight_histogram(weights: torch.Tensor | np.ndarray | Sequence[float], edges: Sequence[float],
                                mask: torch.Tensor | np.ndarray | None = None) -> dict[str, int]:
    """Counts of importance weights in bins delimited by increasing ``edges`` e_0 < ... < e_k.

    Keys: "lt{e_0}", "{e_i}-{e_i+1}" for e_i <= w < e_i+1, "ge{e_k}" (e.g. edges [0.5, 1, 2] ->
    lt0.5, 0.5-1, 1-2, ge2). ``mask`` (same shape as weights): only entries with mask > 0 count,
    e.g. the trained tokens of a [B, T-1] weight tensor. Non-finite weights count in the last bin
    (inf) or are skipped (NaN would hide a bug: it raises).
    """
    e = [float(x) for x in edges]
    if not e or any(b <= a for a, b in zip(e, e[1:])):
        raise ValueError(f"edges={e} must be non-empty and strictly increasing")
    w = torch.as_tensor(np.asarray(weights.detach().cpu() if isinstance(weights, torch.Tensor) else weights,
                                   dtype=np.float64))
    if mask is not None:
        mk = torch.as_tensor(np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask))
        if mk.shape != w.shape:
            raise ValueError(f"mask {tuple(mk.shape)} must match weights {tuple(w.shape)}")
        w = w[mk > 0]
    w = w.reshape(-1)
    if bool(torch.isnan(w).any()):
        raise ValueError("importance weights contain NaN")
    idx = torch.bucketize(w, torch.tensor(e, dtype=torch.float64), right=True)  # 0: < e0, k+1: >= e_k
    counts = torch.bincount(idx, minlength=len(e) + 1).tolist()
    keys = [f"lt{_fmt(e[0])}"] + [f"{_fmt(a)}-{_fmt(b)}" for a, b in zip(e, e[1:])] + [f"ge{_fmt(e[-1])}"]
    return {k: int(c) for k, c in zip(keys, counts)}
