"""One learner step over a rollout batch of trajectories (one or more optimizer steps); no Ray.

The step talks to a ``Stepper``: an object with ``module``, ``backward(loss, boundary)`` and
``step() -> grad_norm``. ``DeepSpeedStepper`` wraps a DeepSpeed engine (the learner actor);
``TorchStepper`` wraps a plain model + optimizer and is the reference the DeepSpeed path is tested
against. Micro-batches are packed by token budget and every micro-batch loss is normalised by the
*global* counts of its optimizer step's (mini-)batch (``AggDenominators``), so the micro-batch
gradients sum to the (mini-)batch gradient whatever the packing. A rollout batch takes
``algo.ppo_epochs x algo.mini_batches`` optimizer steps against "old" logprobs fixed at its start
(``rl_step``); the learner's policy version advances once per rollout batch (``learner.worker``).

Notation: B sequences, T tokens; token tensors are [B, T-1], aligned to predicted tokens.
"""
from __future__ import annotations

import inspect
import time

import numpy as np
import torch

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.algos import spec_of
from sonar.cluster.wire.config import (AlgoConfig, LearnerConfig, ReplayConfig, algo_dynamic_sampling,
                                       algo_std_normalize, proximal_forward_runs)
from sonar.cluster.wire.policy import base_model
from sonar.cluster.wire.protocol import Trajectory
from sonar.learner.algo.advantages import compute_advantages, dynamic_sampling_mask, zero_signal_groups
from sonar.learner.algo.chunked import chunked_logprobs
from sonar.learner.algo.losses import (LossInputs, entropy_from_logits, kl_estimate, policy_loss, sequence_keep, sft_loss,
                                      token_logprobs)
from sonar.learner.algo.staleness import apply_staleness, importance_weight_histogram, lag_histogram
from sonar.learner.batching import Batch, collate, microbatch_loss_scale, rank_packs
from sonar.learner.collectives import dp_sum, sum_disjoint_rows_
from sonar.learner.critic import gae_advantages, trunk_of
from sonar.learner.steppers import DeepSpeedStepper, Stepper, TorchStepper  # noqa: F401  (re-exported)


IS_EDGES = (0.5, 0.8, 0.95, 1.05, 1.25, 2.0)
"""Bin edges of the logged learner/behaviour importance-weight histogram."""


def _output_head(model):
    """The output-embedding module of a Stepper's or plain module's causal LM when its forward can skip
    the logits (``logits_to_keep``, Hugging Face Llama/Qwen and most decoders), else None."""
    module = base_model(getattr(model, "module", model))  # under a peft wrapper: the causal LM's own forward
    get = getattr(module, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None or "logits_to_keep" not in inspect.signature(module.forward).parameters:
        return None
    return head


def _last_hidden_state(model, trunk: torch.nn.Module, mb: Batch) -> torch.Tensor:
    """[b, t, H] final (post-norm) hidden states of ``mb``: the causal LM is called (through ``model``, so a
    DeepSpeed engine's forward runs) with no logits kept, and its trunk's output is read by a forward hook.

    Not ``output_hidden_states=True``: that makes the model collect every layer's output (L+1 tensors of
    [b, t, H]) and return them, so a no-grad forward holds all of them until it returns (12.7 GiB for a 7B
    at 32k tokens) where one suffices; with a gradient the tuple only adds references. The tensor read here
    is the one the LM head would have been applied to (``hidden_states[-1]`` of the old path, bit for bit)."""
    box: list[torch.Tensor] = []

    def keep(_module, _args, out):
        box.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    keep_none = torch.empty(0, dtype=torch.long, device=mb.input_ids.device)
    hook = trunk.register_forward_hook(keep)
    try:
        model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, logits_to_keep=keep_none)
    finally:
        hook.remove()
    if len(box) != 1:
        raise RuntimeError(f"the trunk {type(trunk).__name__} ran {len(box)} times in one forward (expected once)")
    return box[0]


def forward_logprobs(model, mb: Batch, temperature: float, with_entropy: bool = False,
                     chunk_tokens: int = 0, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, t-1] logprobs of the realised next tokens at the sampling temperature (and entropy).
    ``model``: a Stepper (trained forward), a DeepSpeed engine or a plain module (reference policy).

    ``chunk_tokens`` > 0 (``learner.logits_chunk_tokens``): the forward returns no logits (an empty
    ``logits_to_keep``), only the trunk's last hidden state is kept (``_last_hidden_state``), and the
    output head runs on it chunk by chunk (``algo.chunked``), so a micro-batch's full-vocabulary logits
    never exist at once. A model whose forward cannot skip its logits (or whose trunk ``critic.trunk_of``
    does not find) falls back to the unchunked path."""
    head = _output_head(model) if chunk_tokens > 0 else None
    trunk = trunk_of(getattr(model, "module", model), required=False) if head is not None else None
    if head is not None and trunk is not None:
        hidden = _last_hidden_state(model, trunk, mb)
        return chunked_logprobs(hidden, head, mb.input_ids, temperature, chunk_tokens, with_entropy=with_entropy,
                                entropy_grad=entropy_grad)
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits.float()
    lp = token_logprobs(logits, mb.input_ids, temperature)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_from_logits(logits, temperature)
    return lp, ent


def _rank_micro_batches(batch: Batch, token_budget: int, device,
                        dp: tuple[int, int] = (0, 1)) -> tuple[list[Batch], list[float]]:
    """This data-parallel rank's micro-batches of ``batch`` and the factor each loss is multiplied by.

    ``dp = (rank, world_size)``. One rank: every micro-batch, factor 1. More: ``batching.rank_packs`` (rows
    split by token count, fillers so that every rank runs the same number of forward/backward passes and
    ZeRO's collectives pair up); a filler's factor is 0. The losses are normalised by the *global*
    denominators, so the ranks' gradients sum to the batch gradient; DeepSpeed averages them over the
    ranks, hence the factor ``world_size``."""
    packs = rank_packs(batch.lengths.tolist(), token_budget, dp)
    scale = microbatch_loss_scale(dp_world_size=dp[1])  # DeepSpeed runs with gradient_accumulation_steps=1
    return [batch.select(rows).to(device) for rows, _ in packs], [scale if real else 0.0 for _, real in packs]


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
             device="cpu", dp: tuple[int, int] = (0, 1)) -> dict[str, float]:
    """Token-mean NLL over MODEL tokens only (prompt and retrieved tokens carry no loss).
    ``dp = (rank, world_size)``: every rank passes the whole batch and trains its share
    (``_rank_micro_batches``); the logged loss is the whole batch's."""
    t0 = time.perf_counter()
    batch = collate(trajs, None, pad_id)
    denom = batch.denominators()
    mbs, scales = _rank_micro_batches(batch, lcfg.micro_batch_tokens, device, dp)
    stepper.module.train()
    loss_total = 0.0
    for i, mb in enumerate(mbs):
        lp, _ = forward_logprobs(stepper, mb, 1.0, chunk_tokens=lcfg.logits_chunk_tokens)
        out = sft_loss(lp, mb.loss_mask, denom)
        stepper.backward(out.loss * scales[i] if dp[1] > 1 else out.loss, boundary=i == len(mbs) - 1)
        loss_total += float(out.loss.detach()) if scales[i] else 0.0
    loss_total = dp_sum(loss_total, dp, device)
    gn = stepper.step()
    dt = time.perf_counter() - t0
    tokens = int(batch.lengths.sum())
    return {K.LEARNER_LOSS: loss_total, K.LEARNER_GRAD_NORM: gn, K.LEARNER_TOKENS_PER_S: tokens / dt,
            K.LEARNER_STEP_TIME: dt, K.LEARNER_MICRO_BATCHES: len(mbs), K.LEARNER_TRAINED_TOKENS: denom.tokens}


def rl_step(stepper: Stepper, groups: list[list[Trajectory]], lags: list[int], algo: AlgoConfig,
            lcfg: LearnerConfig, rcfg: ReplayConfig, temperature: float, pad_id: int, device="cpu",
            ref_module: torch.nn.Module | None = None,
            difficulty: tuple[float, float] = (0.0, 1.0), critic=None,
            train_policy: bool = True, dp: tuple[int, int] = (0, 1)) -> dict[str, float]:
    """One learner step on a rollout batch of whole groups. Groups outside the ``difficulty`` success-rate
    range and (with the resolved ``algo.dynamic_sampling``) groups with all-equal rewards are dropped and
    counted; if nothing carries signal the optimizer does not step.

    Then, once per batch and before any update: the proximal ("old") logprobs (when the batch takes more
    than one update and ``off_policy`` is tis/decoupled), the reward-mode KL, and the advantages
    (``batch_advantages``, the seam). The update loop runs ``algo.ppo_epochs`` passes over
    ``algo.mini_batches`` mini-batches (``mini_batch_rows``); each mini-batch is one optimizer step, its
    loss normalised by its own counts and packed into token-budget micro-batches. ``off_policy='none'``
    clips against the behaviour logprobs, tis/decoupled against the proximal ones (weighting by
    proximal/behaviour), vtrace against the current ones, as ``losses.policy_loss`` says.

    ``algo.name='ppo'`` needs ``critic`` (``learner.critic.Critic``): the advantages are GAE over the
    critic's V_old (``critic.gae_advantages``), and the critic takes one value-loss step per mini-batch,
    before the policy's. ``train_policy=False`` (the critic's warmup) runs only the critic's steps.

    ``dp = (rank, world_size)``: data parallel. Every rank passes the same groups and computes the same
    filtering and advantages on the whole batch. The no-grad forwards of the whole batch (proximal and
    reference logprobs, the critic's V_old) are split across the ranks, each forwarding its shard of rows,
    and the per-token results summed on the device into the whole batch on every rank (``batch_logprobs``:
    the reward-mode KL and the advantages need every row). The update's micro-batches are split across the
    ranks by token count (``_rank_micro_batches``; the critic's too), the loss normalised by the whole
    mini-batch's denominators. The logged loss is the whole batch's; loss parts and the importance-weight
    histogram are this rank's share."""
    t0 = time.perf_counter()
    n_groups = len(groups)
    lag_of = {g[0].group_id: int(lag) for g, lag in zip(groups, lags) if g}  # per-lag off-policy metrics
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
    if trajs and algo_dynamic_sampling(algo):
        gidx = torch.tensor(_group_index(trajs))
        keep = dynamic_sampling_mask(rewards, gidx)
        m[K.LEARNER_GROUPS_ZERO_SIGNAL] = float(zero_signal_groups(rewards, gidx))
        trajs = [t for t, k in zip(trajs, keep.tolist()) if k]
    if not trajs:
        m.update({K.LEARNER_SKIPPED_STEP: 1.0, K.LEARNER_STEP_TIME: time.perf_counter() - t0,
                  K.LEARNER_OPTIMIZER_STEPS: 0.0})
        return m
    batch = collate(trajs, None, pad_id)
    minis = mini_batch_rows(batch.size, algo.mini_batches)
    kl_reward = ref_module is not None and algo.kl_coef > 0 and algo.kl_mode == "reward"
    # The "old" policy of the PPO ratio: the learner's own logprobs before the first update, fixed for
    # every epoch and mini-batch. With one update they equal the current logprobs, so none is computed
    # (policy_loss then takes logprobs.detach()); with more, the ratio moves from the second update on.
    # recompute_old_logprobs (off_policy none): the old policy is that recomputation too, and it always runs,
    # so the engine-vs-learner gap is logged every step (veRL's compute_log_prob). seq_mask always: its
    # sequences are kept or left out before the first update.
    need_prox = proximal_forward_runs(algo)
    cur = None
    if need_prox or kl_reward:
        cur = batch_logprobs(stepper.module, batch, temperature, lcfg.micro_batch_tokens, device,
                             lcfg.logits_chunk_tokens, dp)
        if need_prox:
            batch.proximal_logprobs = cur
        # KL(engine || learner) from the engine's own samples: k3 with d = mu - learner (kl_estimate's order)
        gap = kl_estimate(batch.behaviour_logprobs, cur, "k3") * batch.loss_mask
        m[K.LEARNER_SAMPLING_KL_MEAN] = float(gap.sum() / max(1.0, float(batch.loss_mask.sum())))
        m[K.LEARNER_SAMPLING_KL_MAX] = float(gap.max()) if gap.numel() else 0.0
        for lag, v in per_lag_mean(gap, batch.loss_mask, [lag_of.get(g, 0) for g in batch.group_ids]).items():
            m[K.LEARNER_SAMPLING_KL_LAG.format(lag=lag)] = v
        if algo.off_policy == "seq_mask":
            # Rejected sequences leave the loss mask before any update, so they count in no denominator.
            keep = sequence_keep(cur, batch.behaviour_logprobs, batch.loss_mask, algo.seq_mask_low, algo.seq_mask_high)
            m[K.LEARNER_IS_SEQ_MASKED] = float((~keep).sum()) / max(1, len(keep))
            batch.loss_mask = batch.loss_mask * keep[:, None].to(batch.loss_mask.dtype)
    kl = None
    if kl_reward:
        # KL as a reward penalty: per-token KL(current || ref) of the batch, before the first update.
        ref = batch_logprobs(ref_module, batch, temperature, lcfg.micro_batch_tokens, device, lcfg.logits_chunk_tokens,
                             dp)
        kl = kl_estimate(cur, ref, algo.kl_estimator, algo.kl_clamp) * batch.loss_mask
        m[K.LEARNER_KL_REWARD_PENALTY] = float(algo.kl_coef * kl.sum() / max(1.0, float(batch.loss_mask.sum())))
    batch.advantages = batch_advantages(batch, algo, kl, critic, dp)
    if spec_of(algo.name).critic:
        m[K.LEARNER_CRITIC_WARMUP] = float(not train_policy)
    use_ref = ref_module is not None and algo.kl_coef > 0 and algo.kl_mode == "loss"
    stepper.module.train()
    parts: list[tuple[dict, float]] = []
    critic_parts: list[dict] = []
    is_hist: dict[str, int] = {}
    lag_hist: dict[int, dict[str, int]] = {}  # per policy lag: the same histogram
    beyond: dict[int, list[float]] = {}  # per policy lag: [tokens beyond tis_cap, trained tokens]
    losses, norms, n_micro = [], [], 0
    for epoch in range(algo.ppo_epochs):
        for rows in minis:
            mini = batch if len(minis) == 1 else batch.select(rows)
            if critic is not None:  # ppo: one value-loss step per mini-batch, on V_old and returns fixed for the batch
                critic_parts.append(critic.update(mini, mini.old_values, mini.returns, dp))
            if not train_policy:
                continue
            denom = mini.denominators()
            mbs, scales = _rank_micro_batches(mini, lcfg.micro_batch_tokens, device, dp)
            loss_total = 0.0
            for i, mb in enumerate(mbs):
                lp, ent = forward_logprobs(stepper, mb, temperature, with_entropy=True,
                                           chunk_tokens=lcfg.logits_chunk_tokens, entropy_grad=algo.entropy_coef > 0)
                ref = None
                if use_ref:
                    with torch.no_grad():
                        ref, _ = forward_logprobs(ref_module, mb, temperature, chunk_tokens=lcfg.logits_chunk_tokens)
                out = policy_loss(LossInputs(logprobs=lp, behaviour_logprobs=mb.behaviour_logprobs,
                                             advantages=mb.advantages, mask=mb.loss_mask,
                                             proximal_logprobs=mb.proximal_logprobs, ref_logprobs=ref,
                                             sample_weight=mb.sample_weight, entropy=ent, denominators=denom), algo)
                stepper.backward(out.loss * scales[i] if dp[1] > 1 else out.loss, boundary=i == len(mbs) - 1)
                if not scales[i]:
                    continue  # a dummy micro-batch (data parallel): it only keeps the collectives paired
                loss_total += float(out.loss.detach())
                parts.append((out.metrics, float(mb.loss_mask.sum())))
                if epoch == 0:  # learner/behaviour ratio per trained token at batch start: how off-policy it is
                    prox = mb.proximal_logprobs if mb.proximal_logprobs is not None else lp.detach()
                    ratio = torch.exp(torch.where(mb.loss_mask > 0, prox - mb.behaviour_logprobs, torch.zeros_like(lp)))
                    for k, v in importance_weight_histogram(ratio, IS_EDGES, mb.loss_mask).items():
                        is_hist[k] = is_hist.get(k, 0) + v
                    row_lags = torch.tensor([lag_of.get(g, 0) for g in mb.group_ids], device=ratio.device)
                    for lag in row_lags.unique().tolist():
                        rows = row_lags == lag
                        mask = mb.loss_mask[rows]
                        h = lag_hist.setdefault(lag, {})
                        for k, v in importance_weight_histogram(ratio[rows], IS_EDGES, mask).items():
                            h[k] = h.get(k, 0) + v
                        b = beyond.setdefault(lag, [0.0, 0.0])
                        b[0] += float(((ratio[rows] > algo.tis_cap) & (mask > 0)).sum())
                        b[1] += float((mask > 0).sum())
            norms.append(stepper.step())
            losses.append(dp_sum(loss_total, dp, device))
            n_micro += len(mbs)
    if critic_parts:
        m.update({k: float(np.mean([c[k] for c in critic_parts])) for k in critic_parts[0]})
    dt = time.perf_counter() - t0
    m.update({K.LEARNER_STEP_TIME: dt, K.LEARNER_TRAJECTORIES: float(len(trajs)),
              K.LEARNER_OPTIMIZER_STEPS: float(len(norms))})
    if not train_policy:
        return m
    m.update({K.LEARNER_IS_WEIGHT_HIST.format(bin=k): float(v) for k, v in is_hist.items()})
    for lag, h in lag_hist.items():
        m.update({K.LEARNER_IS_WEIGHT_LAG_HIST.format(lag=lag, bin=k): float(v) for k, v in h.items()})
        m[K.LEARNER_IS_BEYOND_CAP_LAG.format(lag=lag)] = beyond[lag][0] / max(1.0, beyond[lag][1])
    if beyond:
        m[K.LEARNER_IS_BEYOND_CAP] = sum(b[0] for b in beyond.values()) / max(1.0, sum(b[1] for b in beyond.values()))
    m.update({K.LEARNER_LOSS_PART.format(part=k): v for k, v in _weighted(parts).items()})
    m.update({K.LEARNER_LOSS: float(np.mean(losses)), K.LEARNER_GRAD_NORM: float(np.mean(norms)),
              K.LEARNER_TOKENS_PER_S: float(batch.lengths.sum()) / dt, K.LEARNER_MICRO_BATCHES: n_micro,
              K.LEARNER_TRAINED_TOKENS: batch.denominators().tokens})
    return m


def per_lag_mean(values: torch.Tensor, mask: torch.Tensor, row_lags: list[int]) -> dict[int, float]:
    """Mean of ``values`` [B, T] over the tokens with ``mask`` > 0, per policy lag of the rows
    (``row_lags``: [B]); a lag whose rows train no token is left out."""
    lags = torch.tensor(row_lags, dtype=torch.long, device=values.device)
    out = {}
    for lag in lags.unique().tolist():
        rows = lags == lag
        n = float((mask[rows] > 0).sum())
        if n > 0:
            out[int(lag)] = float((values[rows] * (mask[rows] > 0)).sum() / n)
    return out


def mini_batch_rows(n: int, mini_batches: int) -> list[list[int]]:
    """Rows 0..n-1 split in batch order into min(mini_batches, n) contiguous, near-equal mini-batches
    (sizes differ by at most one; whole groups stay together when the sizes allow). OpenRLHF shuffles
    its replay buffer instead; batch order keeps the step deterministic without a generator."""
    k = max(1, min(mini_batches, n))
    return [a.tolist() for a in np.array_split(np.arange(n), k)]


def batch_logprobs(module: torch.nn.Module, batch: Batch, temperature: float, token_budget: int,
                   device, chunk_tokens: int = 0, dp: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """[B, T-1] float32 logprobs of the whole batch under ``module`` (no gradient, micro-batched), on CPU,
    0 where loss_mask is 0: the proximal policy at batch start, or the reference policy.

    ``dp = (rank, world_size)``: each rank forwards only its shard of the rows (``batching.rank_packs``; the
    fillers keep ZeRO-3's gathers paired and are not written), into a [B, T-1] tensor on ``device`` that is
    0 outside its rows; one all-reduce of it (``collectives.sum_disjoint_rows_``) gives every rank every
    row. A row's logprobs do not depend on which rank computes them (the rows are packed differently than
    on one rank, so they agree with one rank's up to the rounding of a different padded width)."""
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=device)
    with torch.no_grad():
        for idx, real in rank_packs(batch.lengths.tolist(), token_budget, dp):
            mb = batch.select(idx).to(device)
            lp, _ = forward_logprobs(module, mb, temperature, chunk_tokens=chunk_tokens)
            if real:
                out[torch.as_tensor(idx, device=device)[:, None],
                    torch.arange(lp.shape[1], device=device)[None, :]] = lp.float()
    out = sum_disjoint_rows_(out, dp).cpu()
    return torch.where(batch.loss_mask > 0, out, torch.zeros_like(out))


def batch_advantages(batch: Batch, algo: AlgoConfig, kl: torch.Tensor | None, critic=None,
                     dp: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The advantage seam: per-token advantages [B, T-1] (float32, 0 where loss_mask is 0) of the whole
    batch, computed once before the first update and held fixed over every epoch and mini-batch.

    An algorithm whose spec takes a critic (``AlgoSpec.critic``: ppo) needs ``critic``
    (``learner.critic.Critic``): GAE over the critic's V_old (``critic.gae_advantages``); V_old and the
    returns are kept on the batch (``Batch.old_values`` / ``Batch.returns``) for the critic's value-loss step
    on every mini-batch (V_old split across the ``dp`` ranks like ``batch_logprobs``). The others: their
    registered estimator (``advantages.compute_advantages``: group baselines, the REINFORCE++ family, a
    plug-in)."""
    if spec_of(algo.name).critic:
        if critic is None:
            raise ValueError(f"algo.name={algo.name!r} trains with a critic: rl_step needs critic= (learner/critic.py)")
        adv, batch.old_values, batch.returns = gae_advantages(critic, batch, kl, algo.kl_coef, dp)
        return adv.float()
    return compute_advantages(algo.name, batch.rewards, batch.group_index, batch.loss_mask,
                              algo_std_normalize(algo), kl=kl,
                              kl_coef=algo.kl_coef if kl is not None else 0.0).float()


def success_rate(group: list[Trajectory]) -> float:
    """Mean answer success of a group: the EM part where the reward has one, else reward > 0."""
    return float(np.mean([t.reward_parts.get("em", float(t.reward > 0)) for t in group])) if group else 0.0


def _group_index(trajs: list[Trajectory]) -> list[int]:
    seen: dict[str, int] = {}
    return [seen.setdefault(t.group_id, len(seen)) for t in trajs]
