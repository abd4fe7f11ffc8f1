"""Policy-gradient losses: PPO-clip surrogate, off-policy corrections, KL, aggregation, SFT.

Notation: B sequences, T tokens per padded sequence, V vocabulary. Token-level tensors are aligned
to *predicted* tokens: position t holds the logprob of token t+1 given tokens <= t, so the
learner's tensors are [B, T-1] (``token_logprobs`` produces them from [B, T, V] logits, and
``learner.batching.collate`` shifts the loss mask and the sampling logprobs the same way).

Three policies appear:
  * behaviour  mu      -- the rollout engine's sampling logprobs (``Segment.logprobs``), possibly
                          several learner versions old and computed by a different kernel;
  * proximal   pi_prox -- the learner's own recomputation with the weights it holds when it
                          *consumes* the batch (before its first optimizer step), held fixed over
                          every epoch and mini-batch of the batch (``AlgoConfig.ppo_epochs`` /
                          ``mini_batches``), so the PPO ratio moves from the second update on. With
                          one update per batch (the default) it is simply ``logprobs.detach()``;
  * current    pi      -- ``logprobs`` (requires grad).

``AlgoConfig.off_policy`` chooses how mu != pi is handled (see ``policy_loss``). Every algorithm
(grpo, dr_grpo, the REINFORCE++ variants, ppo) uses the same PPO-clip surrogate; they differ only in
their advantages (``advantages.py``) and their default aggregation (``config.algo_loss_agg``).

Masking: every token quantity is formed with ``torch.where(mask > 0, x, 0)`` *before* any exp, so
padding and untrained tokens (prompt, retrieval) cannot inject inf/NaN, and the gradient reaching
the ``logprobs`` leaf at mask=0 positions is exactly 0.

Pure module: torch and the config dataclass only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from sonar.cluster.wire.config import AlgoConfig, algo_loss_agg
from sonar.learner.algo.chunked import scaled_entropy, scaled_logprobs  # the per-token formulas, shared

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")
OFF_POLICY = ("none", "tis", "decoupled", "vtrace", "seq_mask")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_MODES = ("loss", "reward")
LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before exp (exp(20) ~ 5e8): a guard against inf, not a trust region."""


# ------------------------------------------------------------------ aggregation

@dataclass(frozen=True)
class AggDenominators:
    """Normalisers of ``aggregate``, taken from the *global* batch.

    When a batch is split into micro-batches (gradient accumulation) or data-parallel shards,
    each piece must divide by the global counts, not its own: then the pieces' losses *sum* to the
    full-batch loss and their gradients sum to the full-batch gradient (per-piece token_mean would
    give short micro-batches' tokens more weight). Compute once over the full batch with
    ``from_mask`` and pass the same object to every piece (every learner rank holds the whole batch,
    so each computes the global counts itself: ``train_step``, nothing is all-reduced). See ``learner.batching.microbatch_loss_scale`` for the
    factor engines that *average* over micro-batches / ranks need.
    """

    tokens: float
    """Sum of the mask over the batch (token_mean's denominator)."""
    seqs: float
    """Sequences with at least one trained token (seq_mean_token_mean's denominator)."""
    rows: float
    """All sequences, empty ones included (the B of seq_sum_norm)."""

    @classmethod
    def from_mask(cls, mask: Tensor) -> "AggDenominators":
        """mask [B, T-1] -> the three counts of that batch."""
        if mask.dim() != 2:
            raise ValueError(f"mask must be [B, T-1], got {tuple(mask.shape)}")
        m = mask.detach()
        return cls(tokens=float(torch.where(m > 0, m, torch.zeros_like(m)).sum()),
                   seqs=float((m > 0).any(dim=1).sum()), rows=float(m.shape[0]))

    def __add__(self, other: "AggDenominators") -> "AggDenominators":
        return AggDenominators(self.tokens + other.tokens, self.seqs + other.seqs, self.rows + other.rows)


def aggregate(per_token: Tensor, mask: Tensor, mode: str, norm_const: float = 1.0,
              denominators: AggDenominators | None = None) -> Tensor:
    """Reduce per-token losses [B, T-1] to a scalar over the positions where mask > 0.

    Modes (x = per-token loss, m = mask, n_b = sum_t m_bt):
      * ``token_mean``: sum(x*m) / sum(m). Every trained token weighs the same, so a long sequence
        contributes n_b times the gradient of a one-token sequence (DAPO's choice: long wrong
        answers are penalised per token, no length bias in the per-token gradient).
      * ``seq_mean_token_mean``: mean over sequences with n_b > 0 of (sum_t x*m / n_b) (original
        GRPO). Each sequence weighs the same, so a token of a long sequence gets 1/n_b of the
        gradient: long incorrect answers are penalised less per token -> drift towards length.
      * ``seq_sum_norm``: sum(x*m) / (B * norm_const) with a constant (Dr.GRPO, norm_const = the
        generation budget). The per-token gradient is constant, independent of the lengths in the
        batch *and* of the batch's token count (token_mean's effective step size varies with it).

    ``denominators`` None: the counts come from ``mask`` itself (full-batch semantics). For
    micro-batches / DP shards pass the global ``AggDenominators`` (see its docstring).

    An all-zero mask gives exactly 0 (never NaN), still connected to the graph, with zero gradient.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"algo.loss_agg={mode!r} is not one of {list(AGG_MODES)}")
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must both be [B, T-1]")
    d = denominators if denominators is not None else AggDenominators.from_mask(mask)
    m = mask > 0
    x = torch.where(m, per_token * mask.to(per_token.dtype), torch.zeros((), dtype=per_token.dtype,
                                                                       device=per_token.device))
    if mode == "token_mean":
        return x.sum() / max(d.tokens, 1.0)
    if mode == "seq_mean_token_mean":
        n_b = torch.where(m, mask, torch.zeros_like(mask)).sum(dim=1).clamp(min=1.0).to(x.dtype)
        return (x.sum(dim=1) / n_b).sum() / max(d.seqs, 1.0)
    if norm_const <= 0:
        raise ValueError(f"algo.loss_norm_const={norm_const} must be > 0 for loss_agg='seq_sum_norm'")
    return x.sum() / (max(d.rows, 1.0) * norm_const)


def _masked_mean(x: Tensor, m: Tensor) -> float:
    n = int(m.sum())
    return float(torch.where(m, x, torch.zeros_like(x)).sum() / n) if n else 0.0


def _masked_max(x: Tensor, m: Tensor) -> float:
    return float(x[m].max()) if bool(m.any()) else 0.0


# ------------------------------------------------------------------ KL

def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", clamp: float | None = None) -> Tensor:
    """Per-token KL(pi || pi_ref) estimators (Schulman's k1/k2/k3) from sampled-token logprobs.

    With d = logprobs - ref_logprobs (= log pi/pi_ref at the sampled token):
      * k1 = d                          unbiased, high variance, can be negative; as a *loss* its
                                        gradient is a constant push-down of logp (use in reward mode);
      * k2 = 0.5 * d^2                  biased, low variance, >= 0;
      * k3 = exp(-d) + d - 1            unbiased for KL(pi||ref), >= 0, low variance (GRPO's choice).
    The exponent of k3 is clamped at +-20; ``clamp``: k3 itself is clamped to [-clamp, clamp]
    (``algo.kl_clamp``, veRL's 10: beyond it no gradient). Shapes: any, same for both inputs; returns
    that shape.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"algo.kl_estimator={estimator!r} is not one of {list(KL_ESTIMATORS)}")
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    neg = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.exp(neg) - neg - 1.0
    return k3 if clamp is None else k3.clamp(-clamp, clamp)


# ------------------------------------------------------------------ V-trace

class VTraceReturns(NamedTuple):
    vs: Tensor
    """[B, T] V-trace value targets."""
    pg_advantages: Tensor
    """[B, T] clipped_pg_rho_t * (r_t + gamma_t * vs_{t+1} - V_t): the policy-gradient advantage."""


@torch.no_grad()
def _vtrace_core(clipped_rhos: Tensor, cs: Tensor, pg_rhos: Tensor, discounts: Tensor, rewards: Tensor,
                 values: Tensor, bootstrap_value: Tensor) -> VTraceReturns:
    """Backward recursion v_s - V_s = delta_s + gamma_s c_s (v_{s+1} - V_{s+1}); batch-major [B, T]."""
    values_tp1 = torch.cat([values[:, 1:], bootstrap_value[:, None]], dim=1)
    deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)
    acc = torch.zeros_like(bootstrap_value)
    vs_minus_v = torch.empty_like(deltas)
    for t in range(deltas.shape[1] - 1, -1, -1):
        acc = deltas[:, t] + discounts[:, t] * cs[:, t] * acc
        vs_minus_v[:, t] = acc
    vs = vs_minus_v + values
    vs_tp1 = torch.cat([vs[:, 1:], bootstrap_value[:, None]], dim=1)
    pg_adv = pg_rhos * (rewards + discounts * vs_tp1 - values)
    return VTraceReturns(vs.detach(), pg_adv.detach())


def vtrace_returns(log_rhos: Tensor, discounts: Tensor, rewards: Tensor, values: Tensor, bootstrap_value: Tensor,
                   clip_rho_threshold: float | None = 1.0, clip_pg_rho_threshold: float | None = 1.0,
                   clip_c_threshold: float | None = 1.0) -> VTraceReturns:
    """IMPALA V-trace targets, BATCH-major: every input [B, T] except bootstrap_value [B].

    Same maths as RLlib's ``ray.rllib.algorithms.impala.vtrace_torch.from_importance_weights``
    (which is TIME-major [T, B]; transpose to compare) and the IMPALA paper (Espeholt et al. 2018):
        rho_t = min(rho_bar, exp(log_rho_t)),  c_t = min(c_bar, exp(log_rho_t)),
        delta_t = rho_t (r_t + gamma_t V_{t+1} - V_t),
        v_s = V_s + delta_s + gamma_s c_s (v_{s+1} - V_{s+1}),
        pg_adv_s = min(rho_pg_bar, exp(log_rho_s)) (r_s + gamma_s v_{s+1} - V_s),
    with V_T = v_T = bootstrap_value. RLlib hard-codes c_bar = 1 (``clip_c_threshold`` here);
    a threshold of None means no clipping. Outputs carry no gradient.

    Training calls :func:`vtrace_token_advantages`, not this; this general form runs the same
    ``_vtrace_core`` with values and a bootstrap, which is what RLlib's reference takes, so the tests
    check the core that training uses against RLlib through it.
    """
    if not (log_rhos.shape == discounts.shape == rewards.shape == values.shape) or log_rhos.dim() != 2 \
            or bootstrap_value.shape != log_rhos.shape[:1]:
        raise ValueError(f"vtrace_returns: need [B, T] inputs and bootstrap [B]; got log_rhos {tuple(log_rhos.shape)}, "
                         f"discounts {tuple(discounts.shape)}, rewards {tuple(rewards.shape)}, "
                         f"values {tuple(values.shape)}, bootstrap {tuple(bootstrap_value.shape)}")
    rhos = torch.exp(log_rhos.detach())
    clipped = rhos.clamp(max=clip_rho_threshold) if clip_rho_threshold is not None else rhos
    cs = rhos.clamp(max=clip_c_threshold) if clip_c_threshold is not None else rhos
    pg_rhos = rhos.clamp(max=clip_pg_rho_threshold) if clip_pg_rho_threshold is not None else rhos
    return _vtrace_core(clipped, cs, pg_rhos, discounts.detach(), rewards.detach(), values.detach(),
                        bootstrap_value.detach())


def _next_masked_value(x: Tensor, m: Tensor) -> Tensor:
    """For each position t: x at the first masked position s > t (0 if none). [B, L] -> [B, L]."""
    b, L = x.shape
    pos = torch.arange(L, device=x.device).expand(b, L)
    idx = torch.where(m, pos, torch.full_like(pos, L))
    first_from = torch.flip(torch.cummin(torch.flip(idx, dims=[1]), dim=1).values, dims=[1])  # min s >= t
    first_after = torch.cat([first_from[:, 1:], torch.full((b, 1), L, dtype=pos.dtype, device=x.device)], dim=1)
    padded = torch.cat([torch.where(m, x, torch.zeros_like(x)), torch.zeros((b, 1), dtype=x.dtype, device=x.device)],
                       dim=1)
    return padded.gather(1, first_after)


def vtrace_token_advantages(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                            rho_bar: float = 1.0, c_bar: float = 1.0) -> VTraceReturns:
    """V-trace-corrected token advantages for outcome-reward LLM sequences; all [B, T-1].

    ``advantages`` are read as the *on-policy* returns-to-go of each trained token with the
    baseline already subtracted (GRPO: R - group_mean broadcast; REINFORCE++: its token returns).
    They are decomposed into per-token rewards r_t = A_t - A_{next trained token} so that with
    rho = c = 1 the recursion returns A exactly. Values are 0 (the baseline is inside A; with a
    constant group baseline b, V = b on R and V = 0 on R - b give identical targets). Untrained
    positions (prompt, retrieval, padding) are transparent: c = 1, reward 0, so the trace passes
    through the documents injected between two model turns.

    rho_t = min(rho_bar, pi/mu), c_t = min(c_bar, pi/mu) with pi = logprobs (detached). Returns
    ``VTraceReturns(vs, pg_advantages)``, both detached and 0 at mask=0.
    """
    m = mask > 0
    log_rho = torch.where(m, logprobs.detach() - behaviour_logprobs.detach(), torch.zeros_like(logprobs))
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    a = torch.where(m, advantages.detach().to(rho.dtype), torch.zeros_like(rho))
    rewards = torch.where(m, a - _next_masked_value(a, m), torch.zeros_like(a))
    zeros = torch.zeros_like(rho)
    clipped = torch.where(m, rho.clamp(max=rho_bar), zeros)
    cs = torch.where(m, rho.clamp(max=c_bar), torch.ones_like(rho))
    out = _vtrace_core(clipped, cs, clipped, torch.ones_like(rho), rewards, zeros,
                       torch.zeros(rho.shape[0], dtype=rho.dtype, device=rho.device))
    return VTraceReturns(torch.where(m, out.vs, zeros), torch.where(m, out.pg_advantages, zeros))


# ------------------------------------------------------------------ policy loss

@dataclass
class LossInputs:
    """Inputs of ``policy_loss``; all token tensors [B, T-1], aligned to predicted tokens."""

    logprobs: Tensor
    """Current policy logprobs of the sampled tokens (requires grad), at the sampling temperature."""
    behaviour_logprobs: Tensor
    """Rollout sampling logprobs (mu); 0 where mask is 0."""
    advantages: Tensor
    """Token advantages from ``advantages.compute_advantages`` (no gradient)."""
    mask: Tensor
    """Float loss mask: 1 on MODEL tokens, 0 on prompt / retrieval / padding."""
    proximal_logprobs: Tensor | None = None
    """Learner recomputation at batch start, fixed over the batch's updates (tis / decoupled). None:
    ``logprobs.detach()`` (exact when the batch takes one update)."""
    ref_logprobs: Tensor | None = None
    """Reference-policy logprobs; needed when kl_mode='loss' and kl_coef != 0."""
    sample_weight: Tensor | None = None
    """[B] staleness weight multiplying every per-token loss of its sequence. None: 1."""
    entropy: Tensor | None = None
    """Optional per-token entropy [B, T-1]: reported (masked mean) in the metrics, and with
    ``algo.entropy_coef`` > 0 subtracted from the loss (it must then carry its graph)."""
    denominators: AggDenominators | None = None
    """Global aggregation counts for micro-batches / DP shards; None: from ``mask``."""

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if len(shape) != 2:
            raise ValueError(f"logprobs must be [B, T-1], got {tuple(shape)}")
        for name in ("behaviour_logprobs", "advantages", "mask", "proximal_logprobs", "ref_logprobs", "entropy"):
            v = getattr(self, name)
            if v is not None and v.shape != shape:
                raise ValueError(f"LossInputs.{name} has shape {tuple(v.shape)}, logprobs has {tuple(shape)}")
        if self.sample_weight is not None and self.sample_weight.shape != shape[:1]:
            raise ValueError(f"LossInputs.sample_weight has shape {tuple(self.sample_weight.shape)}, need [{shape[0]}]")


@dataclass
class LossOutput:
    loss: Tensor
    """Scalar to call ``backward`` on."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Plain floats; token means are over this call's masked tokens (weight by ``num_tokens``)."""


def _check_algo(cfg: AlgoConfig) -> None:
    for key, value, allowed in (("off_policy", cfg.off_policy, OFF_POLICY), ("loss_agg", algo_loss_agg(cfg), AGG_MODES),
                                ("kl_estimator", cfg.kl_estimator, KL_ESTIMATORS), ("kl_mode", cfg.kl_mode, KL_MODES)):
        if value not in allowed:
            raise ValueError(f"algo.{key}={value!r} is not one of {list(allowed)}")


def sequence_keep(proximal: Tensor, behaviour: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """[B] bool: the sequences ``seq_mask`` keeps. A sequence's geometric-mean importance weight is
    exp(mean over its trained tokens of (proximal - behaviour)); it is kept when that lies in [low, high].
    The geometric mean, not the product: a product over hundreds of tokens rejects every long sequence for
    a small per-token mismatch (Liu, Li et al. 2025). A sequence without trained tokens is kept (it adds
    nothing)."""
    m = (mask > 0).to(proximal.dtype)
    n = m.sum(dim=1)
    log_w = ((proximal - behaviour).to(proximal.dtype) * m).sum(dim=1) / n.clamp(min=1.0)
    g = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return ((g >= low) & (g <= high)) | (n == 0)


def policy_loss(inp: LossInputs, cfg: AlgoConfig) -> LossOutput:
    """The policy-gradient loss of every Sonar algorithm, with the chosen off-policy correction.

    Per trained token t (A = advantage, lo = 1 - clip_low, hi = 1 + clip_high):

      * PPO-clip surrogate against an "old" policy: r = exp(logp - old_logp),
        loss_t = -min(r A, clip(r, lo, hi) A). Implemented as an explicit branch so that the clip
        is active exactly when (A > 0 and r > hi) or (A < 0 and r < lo): there the token gets no
        gradient; at r == hi or r == lo it still gets the full one. At r == 1 the gradient is the
        plain policy gradient -A * dlogp (divided by the aggregation's denominator).
      * ``off_policy``:
          - ``none``: old = behaviour (mu), or with ``recompute_old_logprobs`` the proximal (the learner's
            recomputation before the first update, else ``logprobs.detach()``); no weight. Correct only if mu is what the learner
            would compute (same version, same kernel).
          - ``tis`` (truncated importance sampling, Yao et al. 2025 / veRL ``tis_imp_ratio_cap``):
            old = proximal (given, else ``logprobs.detach()``) and every token loss is multiplied by
            the detached weight w = min(exp(prox - mu), tis_cap). The PPO clip bounds the update
            relative to the learner's own policy; w corrects the rollout/learner mismatch
            (staleness and kernel differences), truncated to bound variance. With prox = None,
            r == 1 and the gradient is -w A dlogp.
          - ``decoupled`` (AReaL's decoupled PPO): same clip against the proximal policy, weight
            w = exp(prox - mu) *uncapped*, except that tokens with w > tis_cap are dropped
            (weight 0), as AReaL's ``behav_imp_weight_cap`` does (tis truncates, decoupled drops).
            With prox == mu this is exactly ``none``.
          - ``seq_mask``: as tis, on the sequences ``sequence_keep`` kept (the caller removes the others
            from the mask, and so from the denominators, before any update).
          - ``vtrace``: no PPO clip. pg_adv from ``vtrace_token_advantages`` (rho_bar =
            ``vtrace_rho_bar``, c_bar = ``vtrace_c_bar``, pi = current logprobs detached) and
            loss_t = -pg_adv_t * logp_t. On-policy with rho_bar, c_bar >= 1 this is the plain
            policy gradient with A.
      * ``sample_weight[b]`` multiplies every token loss (policy and KL) of sequence b.
      * KL (``kl_mode='loss'`` and ``kl_coef != 0``): loss += kl_coef * aggregate(kl_estimate(logp,
        ref)). ``kl_mode='reward'`` is applied in the advantages, so nothing is added here.
      * Aggregation: ``aggregate(.., algo_loss_agg(cfg), cfg.loss_norm_const, inp.denominators)`` (an unset
        ``loss_agg`` is the algorithm's default: seq_sum_norm for dr_grpo, token_mean otherwise).

    Metrics (floats, over this call's masked tokens): loss, pg_loss, kl_loss, clip_fraction
    (tokens where the PPO clip is active, or for vtrace where rho > rho_bar), approx_kl (k3 of the
    ratio's old policy vs current), mismatch_kl (k3 of mu vs prox; tis/decoupled), is_weight_mean
    / is_weight_max (the weights actually applied, before any cap for vtrace's rho), is_dropped_fraction
    (decoupled), entropy (if given), num_tokens.
    """
    _check_algo(cfg)
    m = inp.mask > 0
    lp = inp.logprobs
    zeros = torch.zeros_like(lp)
    mu = torch.where(m, inp.behaviour_logprobs.detach().to(lp.dtype), zeros)
    adv = torch.where(m, inp.advantages.detach().to(lp.dtype), zeros)
    lp_m = torch.where(m, lp, zeros)  # gradient 0 on untrained positions, no garbage in exp
    metrics: dict[str, float] = {}

    if cfg.off_policy == "vtrace":
        vt = vtrace_token_advantages(lp_m, mu, adv, inp.mask, cfg.vtrace_rho_bar, cfg.vtrace_c_bar)
        per_token = -vt.pg_advantages * lp_m
        with torch.no_grad():
            rho = torch.exp(torch.where(m, lp_m - mu, zeros).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            metrics["clip_fraction"] = _masked_mean((rho > cfg.vtrace_rho_bar).to(lp.dtype), m)
            metrics["is_weight_mean"] = _masked_mean(rho, m)
            metrics["is_weight_max"] = _masked_max(rho, m)
            metrics["approx_kl"] = _masked_mean(kl_estimate(lp_m, mu, "k3"), m)
    else:
        weight: Tensor | None = None
        if cfg.off_policy == "none" and not cfg.recompute_old_logprobs:
            old = mu
        elif cfg.off_policy == "none":  # the learner's own old logprobs (given, else the current ones): no weight
            prox = inp.proximal_logprobs.detach().to(lp.dtype) if inp.proximal_logprobs is not None else lp.detach()
            old = torch.where(m, prox, zeros)
        else:
            prox = inp.proximal_logprobs.detach().to(lp.dtype) if inp.proximal_logprobs is not None else lp.detach()
            old = torch.where(m, prox, zeros)
            w = torch.exp(torch.where(m, old - mu, zeros).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            if cfg.off_policy in ("tis", "seq_mask"):  # seq_mask's rejected sequences left the mask already
                weight = w.clamp(max=cfg.tis_cap)
            else:
                keep = w <= cfg.tis_cap
                weight = torch.where(keep, w, zeros)
                metrics["is_dropped_fraction"] = _masked_mean((~keep).to(lp.dtype), m)
            metrics["mismatch_kl"] = _masked_mean(kl_estimate(old, mu, "k3"), m)
        ratio = torch.exp(torch.where(m, lp_m - old, zeros).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
        with torch.no_grad():
            clipped = m & (((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo)))
        per_token = torch.where(clipped, -adv * ratio.detach().clamp(lo, hi), -adv * ratio)
        if cfg.dual_clip is not None:
            # Dual clip: min(max(-A r, -A clip(r)), -A c) for A < 0, i.e. a constant -A c (no gradient)
            # wherever r > c; A >= 0 and r <= c are untouched.
            with torch.no_grad():
                dual = m & (adv < 0) & (ratio > cfg.dual_clip)
                metrics["dual_clip_fraction"] = _masked_mean(dual.to(lp.dtype), m)
            per_token = torch.where(dual, -adv * cfg.dual_clip, per_token)
        if weight is not None:
            per_token = per_token * weight
        with torch.no_grad():
            metrics["clip_fraction"] = _masked_mean(clipped.to(lp.dtype), m)
            metrics["approx_kl"] = _masked_mean(kl_estimate(lp_m.detach(), old, "k3"), m)
            applied = weight if weight is not None else torch.ones_like(lp)
            metrics["is_weight_mean"] = _masked_mean(applied, m)
            metrics["is_weight_max"] = _masked_max(applied, m)
            metrics["ratio_max"] = _masked_max(ratio.detach(), m)

    sw = None
    if inp.sample_weight is not None:
        sw = inp.sample_weight.detach().to(lp.dtype)[:, None]
        per_token = per_token * sw
    agg = algo_loss_agg(cfg)
    pg_loss = aggregate(per_token, inp.mask, agg, cfg.loss_norm_const, inp.denominators)
    loss = pg_loss
    kl_loss_value = 0.0
    if cfg.kl_mode == "loss" and cfg.kl_coef != 0.0:
        if inp.ref_logprobs is None:
            raise ValueError(f"algo.kl_mode='loss' with algo.kl_coef={cfg.kl_coef} needs LossInputs.ref_logprobs")
        ref = torch.where(m, inp.ref_logprobs.detach().to(lp.dtype), zeros)
        kl_tok = kl_estimate(lp_m, ref, cfg.kl_estimator, cfg.kl_clamp)
        if sw is not None:
            kl_tok = kl_tok * sw
        kl_loss = aggregate(kl_tok, inp.mask, agg, cfg.loss_norm_const, inp.denominators)
        loss = loss + cfg.kl_coef * kl_loss
        kl_loss_value = float(kl_loss.detach())
    if cfg.entropy_coef:
        # veRL's entropy bonus (Search-R1 / RAG-R1 entropy_coeff 0.001): loss - c * H, H aggregated as the
        # policy loss is, so the bonus weighs every trained token as the policy gradient does.
        if inp.entropy is None or not inp.entropy.requires_grad:
            raise ValueError(f"algo.entropy_coef={cfg.entropy_coef} needs LossInputs.entropy with its graph "
                             f"(forward_logprobs(..., entropy_grad=True))")
        ent = torch.where(m, inp.entropy.to(lp.dtype), zeros)
        if sw is not None:
            ent = ent * sw
        entropy_bonus = aggregate(ent, inp.mask, agg, cfg.loss_norm_const, inp.denominators)
        loss = loss - cfg.entropy_coef * entropy_bonus
        metrics["entropy_loss"] = float(entropy_bonus.detach())
    metrics["pg_loss"] = float(pg_loss.detach())
    metrics["kl_loss"] = kl_loss_value
    metrics["loss"] = float(loss.detach())
    metrics["num_tokens"] = float(m.sum())
    if inp.entropy is not None:
        metrics["entropy"] = _masked_mean(inp.entropy.detach(), m)
    return LossOutput(loss=loss, metrics=metrics)


# ------------------------------------------------------------------ SFT and logprobs

def sft_loss(logprobs: Tensor, mask: Tensor, denominators: AggDenominators | None = None) -> LossOutput:
    """Token-mean negative log-likelihood over mask > 0. logprobs, mask: [B, T-1] -> scalar.

    Demonstrations mask their retrieved documents (and prompt) exactly like RL trajectories, so
    the model is never trained to produce retrieved text. ``denominators`` as in ``aggregate``.
    """
    nll = aggregate(-logprobs, mask, "token_mean", denominators=denominators)
    n = float((mask > 0).sum())
    return LossOutput(loss=nll, metrics={"nll": float(nll.detach()), "num_tokens": n})


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Logprob of every next token: logits [B, T, V], input_ids [B, T] -> [B, T-1] float32.

    out[b, t] = log_softmax(logits[b, t] / temperature)[input_ids[b, t+1]]. Dividing by the
    *sampling* temperature makes these comparable with the rollout's behaviour logprobs (which are
    taken from raw logits at that temperature, with no top-k/top-p processing). Computed in
    float32 as gather - logsumexp (no [B, T, V] log_softmax kept). temperature must be > 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: logprobs need a temperature > 0 (greedy has none)")
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [B, T, V] and input_ids {tuple(input_ids.shape)} [B, T]")
    z = logits[:, :-1].float()
    if temperature != 1.0:
        z = z / temperature
    return scaled_logprobs(z, input_ids[:, 1:])


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the next-token distribution: logits [B, T, V] -> [B, T-1] (aligned like logprobs).

    H = -sum_v p_v log p_v at ``temperature``; -inf logits (banned tokens) contribute 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    z = logits[:, :-1].float()
    if temperature != 1.0:
        z = z / temperature
    return scaled_entropy(z)

