"""PPO with a critic: token rewards, GAE over MODEL tokens, batch whitening, the clipped value loss.

Notation: B sequences, T tokens per padded sequence. Every tensor here is [B, T-1], aligned to
*predicted* tokens like the rest of the learner (``learner.batching``): column t is the step "emit
token t+1 given tokens <= t". ``values[b, t]`` is the critic's V(s_t) read at position t (the state
before token t+1 is chosen, as veRL reads ``values[:, -response_length - 1:-1]``); ``mask`` is the
loss mask (1 on MODEL tokens; 0 on prompt, RETRIEVAL and padding).

What this follows (veRL ``core_algos.compute_gae_advantage_return`` + ``masked_whiten``, OpenRLHF
``get_advantages_and_returns``; read, not copied):

* Outcome reward: the scalar reward sits on the *last trained token* of the sequence; with
  ``kl_mode=reward`` every trained token also gets ``-kl_coef * kl_t`` (veRL ``apply_kl_penalty``,
  OpenRLHF ``compute_reward``).
* GAE: ``delta_t = r_t + gamma * V(next) - V_t``, ``A_t = delta_t + gamma * lam * A(next)``,
  ``returns = A + V``, computed without gradient.
* Only MODEL tokens are steps. A retrieved span (mask 0) is *bridged*: "next" is the next MODEL
  token after the span, so the last token of a search query bootstraps from the value of the
  first token the policy writes after reading the documents, discounted by ``gamma`` once (not
  once per retrieved token). This is veRL's current rule ("skip values and TD-error on observation
  tokens"); the Search-R1 fork RAG-R1 trains with ran the recursion through every response token,
  retrieved ones included, and masked only the losses. With gamma = lam = 1 (RAG-R1's setting) the
  two agree on every MODEL token: both telescope to ``A_t = G_t - V_t`` with ``G_t`` the sum of the
  rewards from t on. They differ only for gamma or lam < 1, where the old rule discounted across
  tokens the policy did not choose.
* Whitening: ``(A - mean) / sqrt(var + 1e-8)`` with the mean and the *unbiased* variance over the
  masked tokens of the whole batch (veRL ``masked_whiten``); Sonar also zeroes masked positions.
* Value loss: ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)`` per trained
  token, aggregated as a token mean (veRL ``compute_value_loss``).

Pure module: torch only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"tensors must all be [B, T-1]: {shapes}")


def outcome_token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None,
                          kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards [B, T-1] float64: ``rewards[b]`` on the last position with mask > 0 of row b,
    minus ``kl_coef * kl`` on every position with mask > 0; 0 elsewhere. A row with no trained token
    is all 0 (its reward has no step to sit on).

    Args:
        rewards: [B] outcome rewards.
        mask: [B, T-1] loss mask.
        kl: [B, T-1] per-token KL to the reference, computed without gradient (or None).
        kl_coef: its coefficient (``algo.kl_coef`` with ``algo.kl_mode=reward``).
    """
    if mask.dim() != 2 or rewards.shape != (mask.shape[0],):
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] for mask {tuple(mask.shape)} [B, T-1]")
    m = mask > 0
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if kl is not None and kl_coef != 0.0:
        _check_same_shape(kl=kl, mask=mask)
        out = torch.where(m, -kl_coef * kl.detach().to(torch.float64), out)
    L = mask.shape[1]
    pos = torch.arange(L, device=mask.device).expand(mask.shape)
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=1) if L else \
        torch.full((mask.shape[0],), -1, dtype=torch.long, device=mask.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] += rewards.detach().to(torch.float64)[rows]
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the MODEL tokens of each row (retrieved spans bridged).

    Args:
        token_rewards: [B, T-1] per-token rewards (``outcome_token_rewards``).
        values: [B, T-1] V_old, the critic's values before the update (no gradient is taken).
        mask: [B, T-1] loss mask; positions with mask 0 are not steps.
        gamma: discount in [0, 1]; lam: GAE lambda in [0, 1].

    Returns:
        (advantages, returns), both [B, T-1] float64, 0 where mask is 0 (not whitened). The value
        after the last trained token is 0 (the episode ends with the answer).

    Closed forms: gamma = lam = 1 gives ``A_t = sum_{s >= t} r_s - V_t``; lam = 0 gives the one-step
    TD error ``r_t + gamma * V(next) - V_t``.
    """
    _check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    r = token_rewards.detach().to(torch.float64)
    v = values.detach().to(torch.float64)
    m = (mask > 0).to(torch.float64)
    B, L = m.shape
    next_v = torch.zeros(B, dtype=torch.float64, device=m.device)
    next_a = torch.zeros(B, dtype=torch.float64, device=m.device)
    adv = torch.zeros((B, L), dtype=torch.float64, device=m.device)
    for t in range(L - 1, -1, -1):
        a_t = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        mt = m[:, t]
        # a masked position leaves "next" unchanged: the recursion bridges retrieved spans
        next_a = mt * a_t + (1 - mt) * next_a
        next_v = mt * v[:, t] + (1 - mt) * next_v
        adv[:, t] = mt * a_t
    returns = (adv + v) * m
    return adv, returns


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the positions with mask > 0 of the whole batch, with the
    unbiased (n - 1) variance, as veRL's ``masked_whiten``; 0 where mask is 0. Fewer than two masked
    positions: the centred values, unscaled (veRL raises there)."""
    _check_same_shape(x=x, mask=mask)
    m = mask > 0
    n = int(m.sum())
    if n == 0:
        return torch.zeros_like(x)
    vals = x[m]
    mean = vals.mean()
    centred = torch.where(m, x - mean, torch.zeros_like(x))
    if n < 2:
        return centred
    var = ((vals - mean) ** 2).sum() / (n - 1)
    return centred * torch.rsqrt(var + eps)


class ValueLoss(NamedTuple):
    loss: Tensor
    """Scalar: 0.5 * token-sum of the clipped squared error / ``tokens`` (differentiable)."""
    metrics: dict[str, float]
    """value_loss, value_clipfrac (share of tokens where the clipped term was the larger), value_mean."""


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float,
               tokens: float | None = None) -> ValueLoss:
    """PPO's clipped value loss (veRL ``compute_value_loss``, OpenRLHF ``ValueLoss``).

    Args:
        values: [B, T-1] current predictions (requires grad).
        old_values: [B, T-1] V_old, the predictions the advantages were computed from.
        returns: [B, T-1] GAE returns (targets).
        mask: [B, T-1] loss mask.
        clip: epsilon_v (> 0); ``clip <= 0`` disables clipping (plain 0.5 * squared error).
        tokens: the denominator; None: this mask's own count. Micro-batches pass the full batch's
            token count so their losses sum to the full-batch loss.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = mask > 0
    v = values.to(torch.float32)
    R = returns.detach().to(v.dtype)
    vo = old_values.detach().to(v.dtype)
    unclipped = (v - R) ** 2
    if clip > 0:
        clipped = (vo + (v - vo).clamp(-clip, clip) - R) ** 2
        per_tok = torch.maximum(unclipped, clipped)
        clipfrac = torch.where(m, (clipped > unclipped).to(v.dtype), torch.zeros_like(v))
    else:
        per_tok = unclipped
        clipfrac = torch.zeros_like(v)
    per_tok = torch.where(m, per_tok, torch.zeros_like(per_tok))
    denom = max(float(m.sum()) if tokens is None else float(tokens), 1.0)
    loss = 0.5 * per_tok.sum() / denom
    n = max(float(m.sum()), 1.0)
    metrics = {"value_loss": float(loss.detach()), "value_clipfrac": float(clipfrac.sum()) / n,
               "value_mean": float(torch.where(m, v.detach(), torch.zeros_like(v)).sum()) / n}
    return ValueLoss(loss, metrics)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` over masked tokens (veRL's ``critic/vf_explained_var``, which adds
    1e-5 to the denominator); nan with fewer than two tokens."""
    _check_same_shape(values=values, returns=returns, mask=mask)
    m = mask > 0
    if int(m.sum()) < 2:
        return float("nan")
    R = returns.detach().to(torch.float64)[m]
    V = values.detach().to(torch.float64)[m]
    return float(1.0 - torch.var(R - V) / (torch.var(R) + 1e-5))
