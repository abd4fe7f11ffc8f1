"""Several updates per rollout batch: the "old" logprobs are fixed once per batch, so from the second
update on the PPO ratio moves and the clip acts; with one update it never does. The update loop equals a
plain loop reference (old logprobs before any step, one SGD step per mini-batch), every off-policy
correction composes with it, DeepSpeed still equals plain PyTorch, and the REINFORCE++ variants get the
batch's group index."""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from sonar.cluster.wire.config import AlgoConfig, LearnerConfig, ReplayConfig
from sonar.learner.algo.advantages import compute_advantages, reinforce_pp_advantages
from sonar.learner.algo.losses import LossInputs, policy_loss, token_logprobs
from sonar.learner.batching import collate
from sonar.learner.train_step import TorchStepper, batch_advantages, mini_batch_rows, rl_step
from tests.learner.test_train_step import ADAM_EPS, groups, init_deepspeed, tiny_model, traj

torch.set_num_threads(1)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def train(algo, seed=0, lr=1.0, budget=10_000, model_seed=0):
    """One rl_step with plain SGD (no grad clip) from a fixed model; returns (metrics, parameters)."""
    model = tiny_model(model_seed)
    stepper = TorchStepper(model, torch.optim.SGD(model.parameters(), lr=lr), 0.0)
    m = rl_step(stepper, groups(seed), [0, 0, 0], algo, LearnerConfig(micro_batch_tokens=budget), ReplayConfig(),
                1.0, 0)
    return m, params(model)


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


# ------------------------------------------------------------------ the clip acts only once the ratio moves

def test_one_update_ratio_is_one_and_clip_high_changes_nothing():
    wide, tight = AlgoConfig(clip_high=0.28), AlgoConfig(clip_high=0.0, clip_low=0.0)
    m_wide, p_wide = train(wide)
    m_tight, p_tight = train(tight)
    assert m_wide["learner/optimizer_steps"] == 1
    assert m_wide["learner/ratio_max"] == 1.0 and m_wide["learner/clip_fraction"] == 0.0
    assert m_tight["learner/clip_fraction"] == 0.0
    assert same(p_wide, p_tight)  # bit-identical: the clip cannot act at ratio 1


@pytest.mark.parametrize("shape", [dict(mini_batches=2), dict(ppo_epochs=2)])
def test_second_update_moves_the_ratio_and_clip_high_changes_the_weights(shape):
    wide = AlgoConfig(clip_high=0.28, **shape)
    tight = AlgoConfig(clip_high=0.01, **shape)
    m_wide, p_wide = train(wide)
    m_tight, p_tight = train(tight)
    assert m_wide["learner/optimizer_steps"] == 2
    assert m_wide["learner/ratio_max"] > 1.01  # the second update sees a policy the first one moved
    assert m_tight["learner/clip_fraction"] > 0.0
    assert not same(p_wide, p_tight)
    # and the first of the two updates alone is the one-update step: clip_high cannot change it
    _, p1_wide = train(dataclasses.replace(wide, ppo_epochs=1, mini_batches=1))
    _, p1_tight = train(dataclasses.replace(tight, ppo_epochs=1, mini_batches=1))
    assert same(p1_wide, p1_tight)


# ------------------------------------------------------------------ loop reference

def reference_updates(model, grps, algo: AlgoConfig, lr: float):
    """Plain loop: advantages and old logprobs of the whole batch before any step; then for every epoch and
    every contiguous mini-batch, the policy loss on the full padded rows against those old logprobs and
    one SGD step."""
    trajs = [t for g in grps for t in g]
    batch = collate(trajs, None, 0)
    adv = compute_advantages(algo.name, batch.rewards, batch.group_index, batch.loss_mask).float()

    def logprobs(rows):
        out = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows], use_cache=False)
        return token_logprobs(out.logits.float(), batch.input_ids[rows])

    everything = list(range(len(trajs)))
    with torch.no_grad():
        old = logprobs(everything)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    k = min(algo.mini_batches, len(trajs))
    chunks = [list(c) for c in np.array_split(np.arange(len(trajs)), k)]
    for _ in range(algo.ppo_epochs):
        for rows in chunks:
            lp = logprobs(rows)
            out = policy_loss(LossInputs(logprobs=lp, behaviour_logprobs=batch.behaviour_logprobs[rows],
                                         advantages=adv[rows], mask=batch.loss_mask[rows],
                                         proximal_logprobs=old[rows]), algo)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    return params(model)


@pytest.mark.parametrize("off", ["none", "tis", "decoupled", "vtrace"])
@pytest.mark.parametrize("epochs, minis, budget", [(1, 3, 10_000), (2, 2, 30)])
def test_update_loop_matches_loop_reference(off, epochs, minis, budget):
    """Off-policy corrections compose: tis/decoupled weight by the batch-start proximal policy over the
    behaviour one and clip against it; none clips against the behaviour logprobs; vtrace uses the
    current ones. Token-packed micro-batches inside a mini-batch do not change the update."""
    algo = AlgoConfig(ppo_epochs=epochs, mini_batches=minis, off_policy=off, clip_high=0.05, clip_low=0.05,
                      tis_cap=1.5)
    model = tiny_model()
    ref_params = reference_updates(copy.deepcopy(model), groups(3), algo, lr=0.5)
    stepper = TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.5), 0.0)
    m = rl_step(stepper, groups(3), [0, 0, 0], algo, LearnerConfig(micro_batch_tokens=budget), ReplayConfig(), 1.0, 0)
    assert m["learner/optimizer_steps"] == epochs * minis
    if budget == 30:
        assert m["learner/micro_batches"] > epochs * minis  # micro-batches really split the mini-batches
    for p, q in zip(params(model), ref_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not same(params(model), params(tiny_model()))  # it trained


def test_proximal_is_fixed_at_batch_start():
    """tis with the proximal logprobs held fixed differs from a loop that recomputes them before every update
    (then every ratio would be 1 and the clip would never act)."""
    algo = AlgoConfig(ppo_epochs=2, clip_high=0.01, clip_low=0.01)
    _, fixed = train(algo)
    model = tiny_model()
    stepper = TorchStepper(model, torch.optim.SGD(model.parameters(), lr=1.0), 0.0)
    for _ in range(2):  # two single-update steps: proximal = current before each
        rl_step(stepper, groups(0), [0, 0, 0], dataclasses.replace(algo, ppo_epochs=1), LearnerConfig(),
                ReplayConfig(), 1.0, 0)
    assert not same(fixed, params(model))


def test_mini_batch_rows():
    assert mini_batch_rows(12, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert mini_batch_rows(5, 2) == [[0, 1, 2], [3, 4]]
    assert mini_batch_rows(2, 4) == [[0], [1]]  # never an empty mini-batch (dynamic sampling shrank the batch)
    assert mini_batch_rows(3, 1) == [[0, 1, 2]]


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_deepspeed_multi_update_matches_plain_pytorch(zero_stage):
    """Two epochs of two mini-batches: four AdamW steps through DeepSpeed equal four through plain PyTorch."""
    ds = init_deepspeed()
    from sonar.learner.deepspeed_config import deepspeed_config

    lcfg, lr = LearnerConfig(grad_clip=1.0, zero_stage=zero_stage, micro_batch_tokens=40), 1e-2
    algo = AlgoConfig(ppo_epochs=2, mini_batches=2)
    ref = tiny_model()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.99), eps=ADAM_EPS, weight_decay=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=ADAM_EPS, weight_decay=0.0)
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=deepspeed_config(lcfg, on_gpu=False))
    from sonar.learner.train_step import DeepSpeedStepper

    a = rl_step(TorchStepper(ref, opt_ref, lcfg.grad_clip), groups(), [0, 0, 0], algo, lcfg, ReplayConfig(), 1.0, 0)
    b = rl_step(DeepSpeedStepper(engine, zero_stage), groups(), [0, 0, 0], algo, lcfg, ReplayConfig(), 1.0, 0)
    assert a["learner/optimizer_steps"] == b["learner/optimizer_steps"] == 4
    assert a["learner/loss"] == pytest.approx(b["learner/loss"], rel=1e-4, abs=1e-6)
    import contextlib

    plist = list(engine.module.named_parameters())
    gather = ds.zero.GatheredParameters([q for _, q in plist]) if zero_stage == 3 else contextlib.nullcontext()
    with gather:
        for (n, p), (_, q) in zip(ref.named_parameters(), plist):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=n)


# ------------------------------------------------------------------ REINFORCE++ in training

def test_training_passes_the_group_index_to_the_baseline():
    grps = groups(7)
    grps[1] = [dataclasses.replace(t, reward=t.reward + 3.0) for t in grps[1]]  # group means differ: 0.5, 3.5, 0.5
    batch = collate([t for g in grps for t in g], None, 0)
    got = batch_advantages(batch, AlgoConfig(name="reinforce_pp_baseline"), None)
    want = reinforce_pp_advantages(batch.rewards, batch.loss_mask, group_index=batch.group_index,
                                   estimator="reinforce_pp_baseline")
    torch.testing.assert_close(got, want)
    no_baseline = reinforce_pp_advantages(batch.rewards, batch.loss_mask)
    assert (got - no_baseline).abs().max() > 0.5  # the baseline really subtracted per-group means
    gn = batch_advantages(batch, AlgoConfig(name="group_norm"), None)
    torch.testing.assert_close(gn, reinforce_pp_advantages(batch.rewards, batch.loss_mask, group_index=batch.group_index,
                                                           estimator="group_norm"))


@pytest.mark.parametrize("name, dropped", [("grpo", True), ("dr_grpo", True), ("reinforce_pp", False),
                                           ("reinforce_pp_baseline", False), ("group_norm", False)])
def test_dynamic_sampling_default_per_algorithm(name, dropped):
    rng = np.random.default_rng(0)
    same_reward = [traj(rng, "a", 1.0) for _ in range(4)]
    mixed = [traj(rng, "b", float(r)) for r in (1, 0, 0, 1)]
    model = tiny_model()
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.1), 0.0), [same_reward, mixed], [0, 0],
                AlgoConfig(name=name), LearnerConfig(), ReplayConfig(), 1.0, 0)
    assert m["learner/trajectories"] == (4 if dropped else 8)
    assert m.get("learner/groups_zero_signal", 0.0) == (1.0 if dropped else 0.0)
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.1), 0.0), [same_reward, mixed], [0, 0],
                AlgoConfig(name=name, dynamic_sampling=not dropped), LearnerConfig(), ReplayConfig(), 1.0, 0)
    assert m["learner/trajectories"] == (8 if dropped else 4)  # an explicit value wins
