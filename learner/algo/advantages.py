"""Advantage estimators: GRPO, Dr.GRPO, REINFORCE++ (and the group-baseline "PPO" Sonar runs).

Notation: N samples (= B sequences), T tokens per padded sequence. Token-level tensors are aligned
to *predicted* tokens: position t holds the quantity for token t+1 given tokens <= t, so they are
[B, T-1] (see ``learner.batching.collate``). ``mask`` is the float loss mask of that shape
(1 on MODEL tokens, 0 on prompt, retrieval and padding).

What is simplified, and why:

* Sonar has no value model (search agents are trained critic-free, as in R1-Searcher / Search-R1
  GRPO runs). ``ppo`` therefore means "the PPO-clip surrogate with the group-mean baseline": its
  advantages are GRPO's (std normalisation per ``AlgoConfig.std_normalize``). The clipping lives
  in ``losses.policy_loss`` and is shared by all algorithms.
* Outcome reward only: one scalar per sequence. GRPO-family advantages are a per-sequence scalar
  broadcast over that sequence's trained tokens; REINFORCE++ builds per-token returns (the KL
  penalty makes them vary along the sequence).
* ``kl_mode="reward"``: the caller passes the per-token KL ``kl`` [B, T-1] computed *without
  gradient* from the sampling (or proximal) logprobs and the reference logprobs
  (``losses.kl_estimate``). REINFORCE++ subtracts ``kl_coef * kl_t`` at every token before the
  return sum (OpenRLHF). The group algorithms subtract ``kl_coef * sum_t kl_t * mask_t`` from the
  sequence reward before centring (the sequence-level equivalent of the same penalty).

Pure module: torch only.
"""
from __future__ import annotations

import torch
from torch import Tensor

ALGORITHMS = ("grpo", "dr_grpo", "reinforce_pp", "ppo")


def _dense_groups(group_index: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary long group labels [N] to dense ids 0..G-1 [N] (order-independent)."""
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be 1-D [N], got shape {tuple(group_index.shape)}")
    uniq, inverse = torch.unique(group_index, return_inverse=True)
    return inverse, int(uniq.numel())


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, group std with unbiased=False, group-is-constant flag), all [N].

    Computed in float64 so that the mean of a constant group is the constant to the last bit
    in practice; constant groups are in any case flagged and zeroed exactly by the callers.
    """
    ids, g = _dense_groups(group_index)
    r = rewards.detach().to(torch.float64)
    count = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, ids, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, ids, r) / count
    centred = r - mean[ids]
    var = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, ids, centred * centred) / count
    gmax = torch.full((g,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, ids, r, "amax")
    gmin = torch.full((g,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, ids, r, "amin")
    const = (gmax == gmin)[ids]
    return mean[ids], var.sqrt()[ids], const


def group_advantages(rewards: Tensor, group_index: Tensor, std_normalize: bool = False,
                     eps: float = 1e-6) -> Tensor:
    """GRPO / Dr.GRPO sequence advantages: reward minus its group's mean.

    Args:
        rewards: [N] float, one outcome reward per sample.
        group_index: [N] long, samples with equal labels form a group (labels need not be
            contiguous or sorted).
        std_normalize: GRPO divides by ``group_std + eps`` where group_std is the *population*
            std (``unbiased=False``: divide by n, not n-1), so a group of two is well defined.
            Dr.GRPO passes False: std normalisation up-weights near-constant groups (questions
            that are too easy or too hard), which the Dr.GRPO paper identifies as a bias.
        eps: added to the std.

    Returns:
        [N] advantages in the dtype of ``rewards``. A group whose rewards are all equal (including
        a singleton group) gets exact zeros, never NaN: it carries no learning signal.

    Closed form: rewards [1, 0, 0, 1] in one group -> [0.5, -0.5, -0.5, 0.5] without std.
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


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr.GRPO ("GRPO done right"): group-centred rewards, no std and no length normalisation.

    The length part lives in the loss aggregation: Dr.GRPO pairs with
    ``AlgoConfig.loss_agg="seq_sum_norm"``, i.e. sum of token losses / (B * loss_norm_const) with a
    *constant* (e.g. the generation budget), instead of dividing each sequence by its own length,
    which would shrink the per-token gradient of long wrong answers (and so favour long ones).
    """
    return group_advantages(rewards, group_index, std_normalize=False)


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


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0,
                            eps: float = 1e-8, group_index: Tensor | None = None) -> Tensor:
    """REINFORCE++ token advantages (OpenRLHF ``reinforce`` / ``reinforce_baseline``, R1-Searcher).

    Per-token reward: ``r_t = -kl_coef * kl_t`` on every trained token, plus the outcome reward on
    the *last* trained token of the sequence. Return: ``G_t = sum_{s >= t} r_s * mask_s``
    (gamma = 1, the sum runs over trained tokens only, so retrieval tokens in between neither add
    reward nor break the sum). Then GLOBAL batch normalisation: ``(G - mean) / (std + eps)`` with
    mean and population std over all masked tokens of the whole batch (not per group), which is
    what distinguishes REINFORCE++ from GRPO.

    Args:
        rewards: [B] outcome rewards.
        mask: [B, T-1] float loss mask (aligned to predicted tokens).
        kl: [B, T-1] per-token KL to the reference (no gradient), or None (no penalty).
        kl_coef: penalty coefficient; 0 disables it.
        eps: added to the global std.
        group_index: [B] long or None. Given: the "REINFORCE++-baseline" variant, the outcome
            reward is first centred by its group mean (OpenRLHF ``reinforce_baseline``).

    Returns:
        [B, T-1] advantages, 0 where mask is 0. If every masked return is equal (e.g. all rewards
        equal and no KL) the result is exact zeros, not NaN. A row with no trained token is all 0.
    """
    if mask.dim() != 2 or rewards.shape != (mask.shape[0],):
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] for mask {tuple(mask.shape)} [B, T-1]")
    m = (mask > 0)
    r_seq = rewards.detach().to(torch.float64)
    if group_index is not None:
        mean, _, _ = _group_stats(rewards, group_index)
        r_seq = r_seq - mean
    tok = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if kl is not None and kl_coef != 0.0:
        if kl.shape != mask.shape:
            raise ValueError(f"kl {tuple(kl.shape)} must match mask {tuple(mask.shape)}")
        tok = torch.where(m, -kl_coef * kl.detach().to(torch.float64), tok)
    last, has_any = _last_true_index(mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    tok[rows[has_any], last[has_any]] += r_seq[has_any]
    returns = torch.flip(torch.cumsum(torch.flip(tok, dims=[1]), dim=1), dims=[1])
    returns = torch.where(m, returns, torch.zeros_like(returns))
    n = m.sum()
    if int(n) == 0:
        return torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    vals = returns[m]
    if bool(vals.max() == vals.min()):
        return torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    mean = vals.mean()
    std = vals.std(unbiased=False)
    adv = torch.where(m, (returns - mean) / (std + eps), torch.zeros_like(returns))
    return adv.to(rewards.dtype)


def compute_advantages(name: str, rewards: Tensor, group_index: Tensor, mask: Tensor,
                       std_normalize: bool = False, *, kl: Tensor | None = None, kl_coef: float = 0.0,
                       reinforce_baseline: bool = False, eps: float = 1e-6) -> Tensor:
    """Token-level advantages [B, T-1] for ``AlgoConfig.name``; 0 wherever ``mask`` is 0.

    Args:
        name: grpo | dr_grpo | reinforce_pp | ppo.
        rewards: [B] outcome rewards.
        group_index: [B] long group labels.
        mask: [B, T-1] float loss mask.
        std_normalize: grpo / ppo only (``AlgoConfig.std_normalize``); dr_grpo rejects True.
        kl: [B, T-1] detached per-token KL for ``kl_mode="reward"`` (None otherwise).
        kl_coef: its coefficient.
        reinforce_baseline: reinforce_pp only: centre the outcome by the group mean first.
        eps: std epsilon (for reinforce_pp the global-std epsilon).

    grpo / dr_grpo / ppo: the sequence advantage from ``group_advantages`` broadcast over that
    sequence's trained tokens (KL in reward mode is summed over the sequence and subtracted from
    its reward first). reinforce_pp: ``reinforce_pp_advantages``.
    """
    if name not in ALGORITHMS:
        raise ValueError(f"algo.name={name!r} is not one of {list(ALGORITHMS)}")
    if mask.dim() != 2 or rewards.shape != (mask.shape[0],) or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} / group_index {tuple(group_index.shape)} must be [B] "
                         f"for mask {tuple(mask.shape)} [B, T-1]")
    if name == "reinforce_pp":
        return reinforce_pp_advantages(rewards, mask, kl, kl_coef, eps=eps,
                                       group_index=group_index if reinforce_baseline else None)
    if name == "dr_grpo" and std_normalize:
        raise ValueError("algo.name='dr_grpo' with algo.std_normalize=True: Dr.GRPO has no std normalisation")
    r = rewards.detach()
    if kl is not None and kl_coef != 0.0:
        if kl.shape != mask.shape:
            raise ValueError(f"kl {tuple(kl.shape)} must match mask {tuple(mask.shape)}")
        r = r - kl_coef * torch.where(mask > 0, kl.detach(), torch.zeros_like(kl)).sum(dim=1).to(r.dtype)
    seq = group_advantages(r, group_index, std_normalize=std_normalize and name != "dr_grpo", eps=eps)
    return torch.where(mask > 0, seq[:, None].expand(mask.shape),
                       torch.zeros((), dtype=seq.dtype, device=mask.device))
