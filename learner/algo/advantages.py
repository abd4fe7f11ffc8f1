"""Advantage estimators: GRPO, Dr.GRPO, the REINFORCE++ family, and the group-baseline "PPO" fallback.

Notation: N samples (= B sequences), T tokens per padded sequence. Token-level tensors are aligned
to *predicted* tokens: position t holds the quantity for token t+1 given tokens <= t, so they are
[B, T-1] (see ``learner.batching.collate``). ``mask`` is the float loss mask of that shape
(1 on MODEL tokens, 0 on prompt, retrieval and padding).

Upstream formulas (read from OpenRLHF ``openrlhf/trainer/ppo_utils/experience_maker.py`` and its
replay buffer's ``normalize``, the code R1-Searcher trains with; TRL / veRL for GRPO):

* ``grpo``: (r - group mean) / (group std + 1e-6) with the *unbiased* std (``torch.std``'s default,
  as TRL and veRL), broadcast over the sequence's trained tokens.
* ``dr_grpo``: r - group mean (no std; its length part is the ``seq_sum_norm`` aggregation).
* ``reinforce_pp`` (OpenRLHF ``reinforce``): per-token returns of the raw outcome, whitened over the
  batch's trained tokens: (G - mean) * rsqrt(max(var, 1e-8)), population variance.
* ``reinforce_pp_baseline`` (OpenRLHF ``reinforce_baseline``, R1-Searcher): the outcome minus its
  group mean, then the same returns and whitening.
* ``group_norm`` (OpenRLHF ``group_norm``, R1-Searcher's Llama stage 1): (r - group mean) /
  (unbiased group std + 1e-9), then the returns; no batch whitening.

What is simplified, and why:

* ``ppo`` without a value model is "the PPO-clip surrogate with the group-mean baseline": its
  advantages are GRPO's. With a critic, GAE replaces them (the seam is
  ``learner.train_step.batch_advantages``). The clipping lives in ``losses.policy_loss`` and is
  shared by all algorithms.
* Outcome reward only: one scalar per sequence. GRPO-family advantages are a per-sequence scalar
  broadcast over that sequence's trained tokens; the REINFORCE++ family builds per-token returns
  (the KL penalty makes them vary along the sequence).
* A group whose rewards are all equal (a singleton included) gets exact zeros for every group
  estimator, never NaN; upstream divides 0 by ``0 + eps`` (also 0) or, for a singleton, by a NaN
  std (upstream requires ``n_samples_per_prompt > 1``, and so does ``validate``).
* ``kl_mode="reward"``: the caller passes the per-token KL ``kl`` [B, T-1] computed *without
  gradient* from the current (or proximal) logprobs and the reference logprobs
  (``losses.kl_estimate``). The REINFORCE++ family subtracts ``kl_coef * kl_t`` at every token before
  the return sum, after the group shaping of the outcome (OpenRLHF ``compute_reward``). The group
  algorithms subtract ``kl_coef * sum_t kl_t * mask_t`` from the sequence reward before centring
  (the sequence-level equivalent of the same penalty).

The algorithms are the estimators registered in ``ALGOS`` at the end of this module, each carrying its
``AlgoSpec`` (``cluster/wire/algos.py``: needs groups, takes a critic, its defaults); a user's estimator
enters through the same door (``stages.N.algo.name=path/to/file.py:fn``).

Pure module: torch and the wire's plug-in registry only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sonar.cluster.wire.algos import BUILTIN_SPECS, algorithm
from sonar.cluster.wire.plugins import Registry

REINFORCE_PP_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "group_norm")
"""The REINFORCE++ family, by ``AlgoConfig.name`` (OpenRLHF: reinforce, reinforce_baseline, group_norm)."""
GRPO_EPS = 1e-6
"""GRPO's std epsilon (veRL's ``norm_adv_by_std_in_grpo`` epsilon)."""
GROUP_NORM_EPS = 1e-9
"""OpenRLHF ``group_norm``'s std epsilon."""
WHITEN_VAR_FLOOR = 1e-8
"""OpenRLHF's batch whitening multiplies by rsqrt(max(var, 1e-8))."""


def _dense_groups(group_index: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary long group labels [N] to dense ids 0..G-1 [N] (order-independent)."""
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be 1-D [N], got shape {tuple(group_index.shape)}")
    uniq, inverse = torch.unique(group_index, return_inverse=True)
    return inverse, int(uniq.numel())


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, *unbiased* group std, group-is-constant flag), all [N].

    The std divides by n - 1 (``torch.std``'s default, as TRL, veRL and OpenRLHF use); a singleton
    group's std is reported as 0 instead of NaN (it is constant, and callers zero constant groups).
    Computed in float64 so that the mean of a constant group is the constant to the last bit in
    practice; constant groups are in any case flagged and zeroed exactly by the callers.
    """
    ids, g = _dense_groups(group_index)
    r = rewards.detach().to(torch.float64)
    count = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, ids, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, ids, r) / count
    centred = r - mean[ids]
    sq = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, ids, centred * centred)
    var = sq / (count - 1).clamp(min=1)
    gmax = torch.full((g,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, ids, r, "amax")
    gmin = torch.full((g,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, ids, r, "amin")
    const = (gmax == gmin)[ids]
    return mean[ids], var.sqrt()[ids], const


def group_advantages(rewards: Tensor, group_index: Tensor, std_normalize: bool = False,
                     eps: float = GRPO_EPS) -> Tensor:
    """GRPO / Dr.GRPO sequence advantages: reward minus its group's mean (optionally over its std).

    Args:
        rewards: [N] float, one outcome reward per sample.
        group_index: [N] long, samples with equal labels form a group (labels need not be
            contiguous or sorted).
        std_normalize: GRPO divides by ``group_std + eps`` where group_std is the *unbiased* std
            (divide by n - 1, ``torch.std``'s default, as TRL and veRL). Dr.GRPO passes False: std
            normalisation up-weights near-constant groups (questions that are too easy or too hard),
            which the Dr.GRPO paper identifies as a bias.
        eps: added to the std.

    Returns:
        [N] advantages in the dtype of ``rewards``. A group whose rewards are all equal (including
        a singleton group) gets exact zeros, never NaN: it carries no learning signal.

    Closed forms: rewards [1, 0, 0, 1] in one group -> [0.5, -0.5, -0.5, 0.5] without std; with it
    the unbiased std is sqrt(1/3), so +-0.5 * sqrt(3) / (1 + eps * sqrt(3)) ~ +-0.8660.
    """
    if rewards.dim() != 1 or rewards.shape != group_index.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must both be [N]")
    if rewards.numel() == 0:
        return rewards.detach().clone()
    mean, std, const = _group_stats(rewards, group_index)
    adv = rewards.detach().to(torch.float64) - mean
    if std_normalize:
        adv = adv / (std + eps)
    adv = torch.where(const, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype)


def dynamic_sampling_mask(rewards: Tensor, group_index: Tensor) -> Tensor:
    """DAPO dynamic sampling: True [N] for samples whose group has non-identical rewards.

    A group with all-equal rewards (all right, all wrong, or a singleton) has zero advantage for
    every member under any group baseline, so it only dilutes the batch; the learner drops it and
    counts it (``zero_signal_groups``).
    """
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    _, _, const = _group_stats(rewards, group_index)
    return ~const


def zero_signal_groups(rewards: Tensor, group_index: Tensor) -> int:
    """Number of groups (not samples) whose rewards are all equal: the dropped-group count."""
    if rewards.numel() == 0:
        return 0
    ids, g = _dense_groups(group_index)
    keep = dynamic_sampling_mask(rewards, group_index)
    has_signal = torch.zeros(g, dtype=torch.bool, device=rewards.device).index_fill_(0, ids[keep], True)
    return int(g - int(has_signal.sum()))


def _last_true_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """For mask [B, L]: (index of the last position with mask > 0 [B] long, row-has-any [B] bool)."""
    b, L = mask.shape
    pos = torch.arange(L, device=mask.device).expand(b, L)
    last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).amax(dim=1) if L > 0 else \
        torch.full((b,), -1, dtype=torch.long, device=mask.device)
    return last.clamp(min=0), last >= 0


def whiten(x: Tensor, mask: Tensor, var_floor: float = WHITEN_VAR_FLOOR) -> Tensor:
    """OpenRLHF's batch whitening of token advantages: (x - mean) * rsqrt(max(var, var_floor)).

    mean and the *population* variance run over the positions with mask > 0 of the whole [B, L]
    tensor; the result is 0 where mask is 0. If every masked value is equal the result is exact
    zeros (upstream: 0 * 1e4 up to the rounding of the mean). float64 in, float64 out.
    """
    m = mask > 0
    if int(m.sum()) == 0:
        return torch.zeros_like(x)
    vals = x[m]
    if bool(vals.max() == vals.min()):
        return torch.zeros_like(x)
    mean = vals.mean()
    var = ((vals - mean) ** 2).mean()
    return torch.where(m, (x - mean) * var.clamp(min=var_floor).rsqrt(), torch.zeros_like(x))


def token_returns(outcome: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """REINFORCE++ per-token returns [B, T-1], float64, 0 where mask is 0.

    Per-token reward: ``r_t = -kl_coef * kl_t`` on every trained token, plus ``outcome[b]`` on the
    *last* trained token of the sequence (OpenRLHF ``compute_reward``). Return:
    ``G_t = sum_{s >= t} r_s * mask_s`` (gamma = 1, as upstream forces for the baseline variants; the
    sum runs over trained tokens only, so retrieval tokens in between neither add reward nor break
    the sum). A row with no trained token is all 0.
    """
    m = mask > 0
    tok = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if kl is not None and kl_coef != 0.0:
        if kl.shape != mask.shape:
            raise ValueError(f"kl {tuple(kl.shape)} must match mask {tuple(mask.shape)}")
        tok = torch.where(m, -kl_coef * kl.detach().to(torch.float64), tok)
    last, has_any = _last_true_index(mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    tok[rows[has_any], last[has_any]] += outcome.detach().to(torch.float64)[has_any]
    returns = torch.flip(torch.cumsum(torch.flip(tok, dims=[1]), dim=1), dims=[1])
    return torch.where(m, returns, torch.zeros_like(returns))


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0,
                            group_index: Tensor | None = None, estimator: str = "reinforce_pp") -> Tensor:
    """REINFORCE++ family token advantages (OpenRLHF ``reinforce`` / ``reinforce_baseline`` / ``group_norm``).

    1. Outcome shaping per ``estimator``: ``reinforce_pp`` keeps r; ``reinforce_pp_baseline``
       subtracts the group mean; ``group_norm`` takes (r - group mean) / (unbiased group std + 1e-9).
       A group with all-equal rewards gets outcome 0 under both group estimators.
    2. ``token_returns`` of the shaped outcome with the per-token KL penalty.
    3. ``reinforce_pp`` and ``reinforce_pp_baseline``: ``whiten`` over all trained tokens of the
       whole batch (not per group), which is what distinguishes REINFORCE++ from GRPO; ``group_norm``
       is not whitened (OpenRLHF skips its batch normalisation for group_norm).

    Args:
        rewards: [B] outcome rewards.
        mask: [B, T-1] float loss mask (aligned to predicted tokens).
        kl: [B, T-1] per-token KL to the reference (no gradient), or None (no penalty).
        kl_coef: penalty coefficient; 0 disables it.
        group_index: [B] long; required by the two group estimators.
        estimator: one of ``REINFORCE_PP_ESTIMATORS``.

    Returns:
        [B, T-1] advantages in the dtype of ``rewards``, 0 where mask is 0; exact zeros, not NaN, if
        every masked return is equal.

    Closed form (no KL): rewards [1, 0, 1, 1] in groups [a, a, b, b], one trained token each:
    baseline outcomes [0.5, -0.5, 0, 0], mean 0, population std sqrt(1/8) -> [sqrt 2, -sqrt 2, 0, 0].
    """
    if mask.dim() != 2 or rewards.shape != (mask.shape[0],):
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] for mask {tuple(mask.shape)} [B, T-1]")
    if estimator not in REINFORCE_PP_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not one of {list(REINFORCE_PP_ESTIMATORS)}")
    r = rewards.detach().to(torch.float64)
    if estimator != "reinforce_pp":
        if group_index is None:
            raise ValueError(f"estimator={estimator!r} needs group_index")
        mean, std, const = _group_stats(rewards, group_index)
        r = r - mean
        if estimator == "group_norm":
            r = r / (std + GROUP_NORM_EPS)
        r = torch.where(const, torch.zeros_like(r), r)
    returns = token_returns(r, mask, kl, kl_coef)
    adv = returns if estimator == "group_norm" else whiten(returns, mask)
    return adv.to(rewards.dtype)


def compute_advantages(name: str, rewards: Tensor, group_index: Tensor, mask: Tensor,
                       std_normalize: bool | None = None, *, kl: Tensor | None = None,
                       kl_coef: float = 0.0) -> Tensor:
    """Token-level advantages [B, T-1] by the estimator ``ALGOS`` holds for ``name`` (``AlgoConfig.name``:
    a built-in or a plug-in); 0 wherever ``mask`` is 0.

    Args:
        name: a built-in of ``ALGOS`` or a plug-in ``module:attr`` / ``file.py:attr``.
        rewards: [B] outcome rewards.
        group_index: [B] long group labels.
        mask: [B, T-1] float loss mask.
        std_normalize: resolved ``AlgoConfig.std_normalize`` (None: the algorithm's default, its
            ``AlgoSpec``); True is refused where the spec says why (dr_grpo, the REINFORCE++ family).
        kl: [B, T-1] detached per-token KL for ``kl_mode="reward"`` (None otherwise).
        kl_coef: its coefficient.
    """
    fn = ALGOS.get(name, "algo.name")
    spec = getattr(fn, "spec", None)
    if spec is None:
        raise ValueError(f"algo.name={name!r} carries no AlgoSpec: decorate it with @algorithm(AlgoSpec(...)) "
                         "(cluster/wire/algos.py)")
    if mask.dim() != 2 or rewards.shape != (mask.shape[0],) or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} / group_index {tuple(group_index.shape)} must be [B] "
                         f"for mask {tuple(mask.shape)} [B, T-1]")
    if std_normalize and spec.no_std:
        raise ValueError(f"algo.name={name!r} with algo.std_normalize=True: {spec.no_std}")
    if std_normalize is None:
        std_normalize = spec.std_normalize
    if kl is not None and kl.shape != mask.shape:
        raise ValueError(f"kl {tuple(kl.shape)} must match mask {tuple(mask.shape)}")
    adv = fn(rewards, group_index, mask, std_normalize=bool(std_normalize), kl=kl, kl_coef=kl_coef)
    if not isinstance(adv, Tensor) or adv.shape != mask.shape:
        raise ValueError(f"algo.name={name!r} returned {getattr(adv, 'shape', type(adv).__name__)}; expected a "
                         f"tensor shaped like the mask {tuple(mask.shape)} [B, T-1]")
    return torch.where(mask > 0, adv, torch.zeros((), dtype=adv.dtype, device=mask.device))


# ---------------------------------------------------------------- the registry (built-ins and plug-ins)
ALGOS = Registry("algorithm")
"""``algo.name`` -> estimator ``fn(rewards, group_index, mask, *, std_normalize, kl, kl_coef) -> [B, T-1]``
carrying its ``AlgoSpec`` (``cluster/wire/algos.py``). The built-ins below and a user's plug-in are served
by the same ``ALGOS.get``."""


def _builtin(name: str):
    """Register a built-in estimator under ``name`` with its spec from ``BUILTIN_SPECS``."""
    def deco(fn):
        return ALGOS.register(name)(algorithm(BUILTIN_SPECS[name])(fn))
    return deco


def sequence_advantages(rewards: Tensor, group_index: Tensor, mask: Tensor, *, std_normalize: bool,
                        kl: Tensor | None, kl_coef: float) -> Tensor:
    """A group-baseline sequence advantage (``group_advantages``) broadcast over the sequence's trained
    tokens; in KL reward mode the sequence's KL is summed and subtracted from its reward first."""
    r = rewards.detach()
    if kl is not None and kl_coef != 0.0:
        r = r - kl_coef * torch.where(mask > 0, kl.detach(), torch.zeros_like(kl)).sum(dim=1).to(r.dtype)
    seq = group_advantages(r, group_index, std_normalize=std_normalize)
    return torch.where(mask > 0, seq[:, None].expand(mask.shape), torch.zeros((), dtype=seq.dtype, device=mask.device))


@_builtin("grpo")
def grpo(rewards, group_index, mask, *, std_normalize, kl, kl_coef):
    """(r - group mean) / (unbiased group std + 1e-6), broadcast over the sequence."""
    return sequence_advantages(rewards, group_index, mask, std_normalize=std_normalize, kl=kl, kl_coef=kl_coef)


@_builtin("dr_grpo")
def dr_grpo(rewards, group_index, mask, *, std_normalize, kl, kl_coef):
    """r - group mean (its length part is the seq_sum_norm aggregation, its spec's default)."""
    return sequence_advantages(rewards, group_index, mask, std_normalize=False, kl=kl, kl_coef=kl_coef)


@_builtin("reinforce_pp")
def reinforce_pp(rewards, group_index, mask, *, std_normalize, kl, kl_coef):
    """OpenRLHF ``reinforce``: returns of the raw outcome, whitened over the batch."""
    return reinforce_pp_advantages(rewards, mask, kl, kl_coef, group_index=group_index, estimator="reinforce_pp")


@_builtin("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards, group_index, mask, *, std_normalize, kl, kl_coef):
    """OpenRLHF ``reinforce_baseline`` (R1-Searcher): the outcome less its group mean, then as reinforce_pp."""
    return reinforce_pp_advantages(rewards, mask, kl, kl_coef, group_index=group_index,
                                   estimator="reinforce_pp_baseline")


@_builtin("group_norm")
def group_norm(rewards, group_index, mask, *, std_normalize, kl, kl_coef):
    """OpenRLHF ``group_norm``: (r - group mean) / (unbiased group std + 1e-9), the returns, no whitening."""
    return reinforce_pp_advantages(rewards, mask, kl, kl_coef, group_index=group_index, estimator="group_norm")


@_builtin("ppo")
def ppo(rewards, group_index, mask, *, std_normalize, kl, kl_coef):
    """Without a value model, the PPO-clip surrogate with the group-mean baseline (GRPO's advantages); its
    spec takes a critic, and with one the learner replaces this by GAE (``train_step.batch_advantages``)."""
    return sequence_advantages(rewards, group_index, mask, std_normalize=std_normalize, kl=kl, kl_coef=kl_coef)
