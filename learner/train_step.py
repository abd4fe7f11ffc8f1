"""One optimizer step over a batch of trajectories; no Ray.

The step talks to a ``Stepper``: an object with ``module``, ``backward(loss, boundary)`` and
``step() -> grad_norm``. ``DeepSpeedStepper`` wraps a DeepSpeed engine (the learner actor);
``TorchStepper`` wraps a plain model + optimizer and is the reference the DeepSpeed path is tested
against. Micro-batches are packed by token budget and every micro-batch loss is normalised by the
*global* batch counts (``AggDenominators``), so the micro-batch gradients sum to the full-batch
gradient whatever the packing.

Notation: B sequences, T tokens; token tensors are [B, T-1], aligned to predicted tokens.
"""
from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import torch

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import AlgoConfig, LearnerConfig, ReplayConfig
from sonar.cluster.wire.protocol import Trajectory
from sonar.learner.algo.advantages import compute_advantages, dynamic_sampling_mask
from sonar.learner.algo.losses import LossInputs, entropy_from_logits, kl_estimate, policy_loss, sft_loss, token_logprobs
from sonar.learner.algo.staleness import apply_staleness, importance_weight_histogram, lag_histogram
from sonar.learner.batching import Batch, collate, pack_micro_batches


IS_EDGES = (0.5, 0.8, 0.95, 1.05, 1.25, 2.0)
"""Bin edges of the logged learner/behaviour importance-weight histogram."""


class Stepper(Protocol):
    """Calling the stepper runs the forward pass: through the DeepSpeed engine, not its bare module,
    because the engine's forward advances ZeRO-3's micro-step counter (without it, micro-batch
    gradients overwrite instead of accumulating)."""

    module: torch.nn.Module

    def __call__(self, **inputs): ...

    def backward(self, loss: torch.Tensor, boundary: bool) -> None: ...

    def step(self) -> float: ...


class TorchStepper:
    """Plain PyTorch: gradients add up over micro-batches; clip; optimizer step; zero grads."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float):
        self.module, self.optimizer, self.grad_clip = module, optimizer, grad_clip

    def __call__(self, **inputs):
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


class DeepSpeedStepper:
    """DeepSpeed runs with gradient_accumulation_steps=1; Sonar marks the accumulation boundary
    itself because the number of token-packed micro-batches varies from step to step."""

    def __init__(self, engine, zero_stage: int):
        self.engine, self.zero_stage = engine, zero_stage
        self.module = engine.module

    def __call__(self, **inputs):
        return self.engine(**inputs)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)

    def step(self) -> float:
        norm = None
        if self.zero_stage == 0:  # DeepSpeed reports no global norm without ZeRO; measure it first
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        self.engine.step()
        if norm is None:
            g = self.engine.get_global_grad_norm()
            norm = float(g) if g is not None else float("nan")
        return norm


def forward_logprobs(model, mb: Batch, temperature: float,
                     with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, t-1] logprobs of the realised next tokens at the sampling temperature (and entropy).
    ``model``: a Stepper (trained forward) or a plain module (reference policy)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits.float()
    lp = token_logprobs(logits, mb.input_ids, temperature)
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = entropy_from_logits(logits, temperature)
    return lp, ent


def _micro_batches(batch: Batch, token_budget: int, device) -> list[Batch]:
    return [batch.select(idx).to(device) for idx in pack_micro_batches(batch.lengths.tolist(), token_budget)]


def _weighted(metrics: list[tuple[dict, float]]) -> dict[str, float]:
    """Token-weighted means over micro-batches; ``*_max`` keys take the max, ``num_tokens`` the sum."""
    total = sum(w for _, w in metrics) or 1.0
    keys = {k for m, _ in metrics for k in m}
    out = {}
    for k in keys:
        vals = [m[k] for m, _ in metrics if k in m]
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k == "num_tokens":
            out[k] = sum(vals)
        else:
            out[k] = sum(m.get(k, 0.0) * w for m, w in metrics) / total
    return out


def sft_step(stepper: Stepper, trajs: list[Trajectory], lcfg: LearnerConfig, pad_id: int,
             device="cpu") -> dict[str, float]:
    """Token-mean NLL over MODEL tokens only (prompt and retrieved tokens carry no loss)."""
    t0 = time.perf_counter()
    batch = collate(trajs, None, pad_id)
    denom = batch.denominators()
    mbs = _micro_batches(batch, lcfg.micro_batch_tokens, device)
    stepper.module.train()
    loss_total = 0.0
    for i, mb in enumerate(mbs):
        lp, _ = forward_logprobs(stepper, mb, 1.0)
        out = sft_loss(lp, mb.loss_mask, denom)
        stepper.backward(out.loss, boundary=i == len(mbs) - 1)
        loss_total += float(out.loss.detach())
    gn = stepper.step()
    dt = time.perf_counter() - t0
    tokens = int(batch.lengths.sum())
    return {K.LEARNER_LOSS: loss_total, K.LEARNER_GRAD_NORM: gn, K.LEARNER_TOKENS_PER_S: tokens / dt,
            K.LEARNER_STEP_TIME: dt, K.LEARNER_MICRO_BATCHES: len(mbs), K.LEARNER_TRAINED_TOKENS: denom.tokens}


def rl_step(stepper: Stepper, groups: list[list[Trajectory]], lags: list[int], algo: AlgoConfig,
            lcfg: LearnerConfig, rcfg: ReplayConfig, temperature: float, pad_id: int, device="cpu",
            ref_module: torch.nn.Module | None = None,
            difficulty: tuple[float, float] = (0.0, 1.0)) -> dict[str, float]:
    """One policy-gradient step on whole groups. Groups outside the ``difficulty`` success-rate range
    and (with ``algo.dynamic_sampling``) groups with all-equal rewards are dropped and counted; if
    nothing carries signal the optimizer does not step."""
    t0 = time.perf_counter()
    n_groups = len(groups)
    groups = apply_staleness(groups, lags, rcfg)
    kept = [g for g in groups if difficulty[0] <= success_rate(g) <= difficulty[1]]
    n_filtered, groups = len(groups) - len(kept), kept
    trajs = [t for g in groups for t in g]
    m: dict[str, float] = {K.LEARNER_GROUPS: n_groups, K.LEARNER_GROUPS_DIFFICULTY_FILTERED: n_filtered,
                           K.LEARNER_GROUPS_STALE_DROPPED: n_groups - len(groups) - n_filtered}
    if lags:
        m[K.LEARNER_POLICY_LAG_MAX] = float(max(lags))
        m[K.LEARNER_POLICY_LAG_MEAN] = float(np.mean(lags))
        for k, v in lag_histogram(lags, rcfg.max_policy_lag + 2).items():
            m[K.LEARNER_POLICY_LAG_HIST.format(bin=k)] = float(v)
    if trajs:
        rewards = torch.tensor([t.reward for t in trajs])
        m[K.LEARNER_REWARD_MEAN] = float(rewards.mean())
        m[K.LEARNER_DATA_STAGE_MIN] = float(min(t.stage for t in trajs))  # = the current stage after a switch
        m[K.LEARNER_DATA_STAGE_MAX] = float(max(t.stage for t in trajs))
    if trajs and algo.dynamic_sampling:
        gidx = torch.tensor(_group_index(trajs))
        keep = dynamic_sampling_mask(rewards, gidx)
        m[K.LEARNER_GROUPS_ZERO_SIGNAL] = float(len(set(gidx.tolist())) - len(set(gidx[keep].tolist())))
        trajs = [t for t, k in zip(trajs, keep.tolist()) if k]
    if not trajs:
        m.update({K.LEARNER_SKIPPED_STEP: 1.0, K.LEARNER_STEP_TIME: time.perf_counter() - t0})
        return m
    batch = collate(trajs, None, pad_id)
    kl = None
    if ref_module is not None and algo.kl_coef > 0 and algo.kl_mode == "reward":
        # KL as a reward penalty: per-token KL(current || ref) of the batch, before the step.
        with torch.no_grad():
            full = batch.to(device)
            cur, _ = forward_logprobs(stepper.module, full, temperature)
            ref, _ = forward_logprobs(ref_module, full, temperature)
            kl = (kl_estimate(cur, ref, algo.kl_estimator) * full.loss_mask).cpu()
            m[K.LEARNER_KL_REWARD_PENALTY] = float(algo.kl_coef * kl.sum() / max(1.0, float(full.loss_mask.sum())))
    batch.advantages = compute_advantages(algo.name, batch.rewards, batch.group_index, batch.loss_mask,
                                          algo.std_normalize, kl=kl,
                                          kl_coef=algo.kl_coef if kl is not None else 0.0).float()
    denom = batch.denominators()
    mbs = _micro_batches(batch, lcfg.micro_batch_tokens, device)
    use_ref = ref_module is not None and algo.kl_coef > 0 and algo.kl_mode == "loss"
    stepper.module.train()
    parts: list[tuple[dict, float]] = []
    is_hist: dict[str, int] = {}
    loss_total = 0.0
    for i, mb in enumerate(mbs):
        lp, ent = forward_logprobs(stepper, mb, temperature, with_entropy=True)
        ref = None
        if use_ref:
            with torch.no_grad():
                ref, _ = forward_logprobs(ref_module, mb, temperature)
        out = policy_loss(LossInputs(logprobs=lp, behaviour_logprobs=mb.behaviour_logprobs,
                                     advantages=mb.advantages, mask=mb.loss_mask, ref_logprobs=ref,
                                     sample_weight=mb.sample_weight, entropy=ent, denominators=denom), algo)
        stepper.backward(out.loss, boundary=i == len(mbs) - 1)
        loss_total += float(out.loss.detach())
        parts.append((out.metrics, float(mb.loss_mask.sum())))
        # learner/behaviour ratio per trained token: how off-policy the batch really is
        ratio = torch.exp(torch.where(mb.loss_mask > 0, lp.detach() - mb.behaviour_logprobs, torch.zeros_like(lp)))
        for k, v in importance_weight_histogram(ratio, IS_EDGES, mb.loss_mask).items():
            is_hist[k] = is_hist.get(k, 0) + v
    gn = stepper.step()
    m.update({K.LEARNER_IS_WEIGHT_HIST.format(bin=k): float(v) for k, v in is_hist.items()})
    dt = time.perf_counter() - t0
    m.update({K.LEARNER_LOSS_PART.format(part=k): v for k, v in _weighted(parts).items()})
    m.update({K.LEARNER_LOSS: loss_total, K.LEARNER_GRAD_NORM: gn, K.LEARNER_STEP_TIME: dt,
              K.LEARNER_TOKENS_PER_S: float(batch.lengths.sum()) / dt, K.LEARNER_MICRO_BATCHES: len(mbs),
              K.LEARNER_TRAJECTORIES: float(len(trajs)), K.LEARNER_TRAINED_TOKENS: denom.tokens})
    return m


def success_rate(group: list[Trajectory]) -> float:
    """Mean answer success of a group: the EM part where the reward has one, else reward > 0."""
    return float(np.mean([t.reward_parts.get("em", float(t.reward > 0)) for t in group])) if group else 0.0


def _group_index(trajs: list[Trajectory]) -> list[int]:
    seen: dict[str, int] = {}
    return [seen.setdefault(t.group_id, len(seen)) for t in trajs]
