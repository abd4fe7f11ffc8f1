"""PPO's critic: a value step lowers the value loss on a fixed batch (both modes), rl_step with ppo
trains policy and critic on singleton groups (one sample per prompt), the warmup trains only the
critic, and a learner with a ppo stage resumes policy and critic bit-exactly from a checkpoint."""
import numpy as np
import pytest
import torch

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import AlgoConfig, CriticConfig, LearnerConfig, ReplayConfig, load_config
from sonar.cluster.wire.protocol import FinishReason, Segment, SegmentKind, Trajectory
from sonar.learner.algo.gae import value_loss
from sonar.learner.batching import collate
from sonar.learner.critic import CRITIC_DIR, CRITIC_FILE, Critic, gae_advantages
from sonar.learner.train_step import TorchStepper, rl_step
from tests.learner.test_learner_sft import policy  # noqa: F401  (module fixture: a tiny policy directory)

VOCAB = 60


def rl_traj(rng, i, reward, version=0):
    n1, n2 = 2 + i % 3, 1 + i % 2
    segs = [Segment(SegmentKind.PROMPT, rng.integers(4, VOCAB, 5)),
            Segment(SegmentKind.MODEL, rng.integers(4, VOCAB, n1), (rng.normal(size=n1) - 3).astype(np.float32), version),
            Segment(SegmentKind.RETRIEVAL, rng.integers(4, VOCAB, 4)),
            Segment(SegmentKind.MODEL, rng.integers(4, VOCAB, n2), (rng.normal(size=n2) - 3).astype(np.float32), version)]
    return Trajectory(f"t{i}-{rng.integers(1e9)}", f"g{i}", f"q{i}", 0, segs, reward=reward,
                      finish_reason=FinishReason.ANSWERED)


def singleton_groups(seed=0, n=6, version=0):
    rng = np.random.default_rng(seed)
    return [[rl_traj(rng, i, float(i % 2), version)] for i in range(n)]


def loss_on(critic, batch, old, ret, clip):
    return value_loss(critic.predict(batch), old, ret, batch.loss_mask, clip).loss.item()


@pytest.mark.parametrize("mode", ["separate", "head"])
def test_a_critic_step_lowers_the_value_loss_on_a_fixed_batch(policy, mode):
    from sonar.cluster.wire.policy import load_policy

    torch.manual_seed(0)
    model, _ = load_policy(policy)
    cfg = CriticConfig(mode=mode, lr=1e-2, value_clip=0.0)
    critic = Critic(cfg, LearnerConfig(micro_batch_tokens=40), policy_dir=str(policy), policy_module=model)
    batch = collate([g[0] for g in singleton_groups()], None, 0)
    _, old, ret = gae_advantages(critic, batch, None, 0.0)
    assert torch.all(old == 0)  # the head starts at zero: V_old = 0, returns = the outcome
    m = batch.loss_mask > 0
    before = loss_on(critic, batch, old, ret, 0.0)
    assert before == pytest.approx(0.5 * float((ret[m] ** 2).mean()), rel=1e-6)
    trunk0 = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = [critic.update(batch, old, ret)]
    one = loss_on(critic, batch, old, ret, 0.0)
    assert one < before, (before, one)  # one step lowers it
    metrics += [critic.update(batch, old, ret) for _ in range(4)]
    after = loss_on(critic, batch, old, ret, 0.0)
    assert after < 0.7 * before, (before, one, after)
    assert metrics[0][K.LEARNER_CRITIC_VALUE_LOSS] == pytest.approx(before, rel=1e-5)
    # the policy's weights never move: a separate critic has its own trunk, a head reads it without grad
    assert all(torch.equal(trunk0[k], v) for k, v in model.state_dict().items())


def test_ppo_trains_policy_and_critic_on_groups_of_one_and_warmup_trains_only_the_critic(policy):
    from sonar.cluster.wire.policy import load_policy

    torch.manual_seed(0)
    model, _ = load_policy(policy)
    stepper = TorchStepper(model, torch.optim.AdamW(model.parameters(), lr=1e-3), grad_clip=1.0)
    critic = Critic(CriticConfig(), LearnerConfig(), policy_dir=str(policy))
    algo = AlgoConfig(name="ppo", off_policy="none")  # dynamic sampling resolves off: groups of one stay
    p0 = {k: v.clone() for k, v in model.state_dict().items()}
    h0 = critic.head.weight.clone()
    m = rl_step(stepper, singleton_groups(), [0] * 6, algo, LearnerConfig(), ReplayConfig(), 1.0, 0,
                critic=critic, train_policy=False)
    assert m[K.LEARNER_CRITIC_WARMUP] == 1.0 and m[K.LEARNER_TRAJECTORIES] == 6.0
    assert all(torch.equal(p0[k], v) for k, v in model.state_dict().items())  # warmup: policy untouched
    assert not torch.equal(h0, critic.head.weight)                             # ... the critic learned
    m = rl_step(stepper, singleton_groups(1), [0] * 6, algo, LearnerConfig(), ReplayConfig(), 1.0, 0,
                critic=critic)
    assert m[K.LEARNER_CRITIC_WARMUP] == 0.0 and m[K.LEARNER_TRAJECTORIES] == 6.0
    assert not m.get(K.LEARNER_SKIPPED_STEP)
    assert any(not torch.equal(p0[k], v) for k, v in model.state_dict().items())
    for key in (K.LEARNER_CRITIC_VALUE_LOSS, K.LEARNER_CRITIC_EXPLAINED_VAR, K.LEARNER_CRITIC_VALUE_MEAN,
                K.LEARNER_CRITIC_RETURN_MEAN, K.LEARNER_CRITIC_GRAD_NORM, K.LEARNER_CRITIC_VALUE_CLIPFRAC):
        assert np.isfinite(m[key]), key
    with pytest.raises(ValueError, match="critic"):
        rl_step(stepper, singleton_groups(), [0] * 6, algo, LearnerConfig(), ReplayConfig(), 1.0, 0)


def test_ppo_advantages_are_whitened_gae_of_the_critic(policy):
    critic = Critic(CriticConfig(gamma=1.0, lam=1.0), LearnerConfig(), policy_dir=str(policy))
    with torch.no_grad():
        critic.head.bias.fill_(0.25)  # V = 0.25 everywhere: A = R - 0.25 before whitening
    batch = collate([g[0] for g in singleton_groups()], None, 0)
    adv, old, ret = gae_advantages(critic, batch, None, 0.0)
    m = batch.loss_mask > 0
    assert torch.allclose(old[m], torch.full_like(old[m], 0.25))
    raw = (batch.rewards[:, None].expand_as(old) - 0.25)[m].double()
    expect = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    assert torch.allclose(adv[m].double(), expect, atol=1e-6)
    assert torch.all(adv[~m] == 0)


def test_rag_r1_critic_tokens_whiten_over_the_whole_response_documents_included(policy):
    """critic.tokens='response' (RAG-R1's veRL fork, ray_trainer.compute_advantage: eos_mask =
    attention_mask[:, -response_length:], masked_whiten over it): with V = 0.25 and gamma = lam = 1 every
    response token's raw advantage is R - 0.25 (retrieved tokens too), the whitening's mean and unbiased
    variance are over all of them, the returns are R on every response token, and the policy still
    reads the advantages of the model's tokens only."""
    critic = Critic(CriticConfig(gamma=1.0, lam=1.0, tokens="response"), LearnerConfig(), policy_dir=str(policy))
    with torch.no_grad():
        critic.head.bias.fill_(0.25)
    batch = collate([g[0] for g in singleton_groups()], None, 0)
    r = batch.response_mask > 0
    m = batch.loss_mask > 0
    assert (r & ~m).any() and not (m & ~r).any()  # documents are response tokens, never model tokens
    adv, old, ret = gae_advantages(critic, batch, None, 0.0)
    assert torch.allclose(old[r], torch.full_like(old[r], 0.25)) and torch.all(old[~r] == 0)
    raw = (batch.rewards[:, None].expand_as(old) - 0.25).double()
    mean, var = raw[r].mean(), raw[r].var(unbiased=True)
    expect = (raw - mean) / torch.sqrt(var + 1e-8)
    assert torch.allclose(adv[m].double(), expect[m], atol=1e-6)
    assert torch.all(adv[~m] == 0)
    assert torch.allclose(ret[r].double(), batch.rewards[:, None].expand_as(old).double()[r], atol=1e-6)
    # Sonar's default (model tokens) whitens with the model tokens' statistics: a different advantage
    model = Critic(CriticConfig(gamma=1.0, lam=1.0), LearnerConfig(), policy_dir=str(policy))
    with torch.no_grad():
        model.head.bias.fill_(0.25)
    adv_m, _, _ = gae_advantages(model, batch, None, 0.0)
    assert not torch.allclose(adv_m[m], adv[m], atol=1e-3)
    # the value loss covers the documents: its token count is the response's
    out = critic.update(batch, old, ret)
    assert np.isfinite(out[K.LEARNER_CRITIC_VALUE_LOSS])


def test_the_response_mask_marks_every_token_after_the_prompt():
    rng = np.random.default_rng(0)
    t = rl_traj(rng, 0, 1.0)  # PROMPT 5, MODEL 2, RETRIEVAL 4, MODEL 1
    assert t.response_mask().tolist() == [0] * 5 + [1] * 7
    b = collate([t], None, 0)
    assert b.response_mask[0].tolist() == [0] * 4 + [1] * 7  # column t: token t+1
    assert b.loss_mask[0].tolist() == [0] * 4 + [1, 1, 0, 0, 0, 0, 1]
    assert b.select([0]).response_mask.tolist() == b.response_mask.tolist()


def ppo_learner(policy, mode="separate"):
    from tests.learner.test_train_step import init_deepspeed

    init_deepspeed()
    from sonar.learner.worker import Learner

    cfg = load_config([], ["learner.warmup_steps=0", "rollout.group_size=1", "critic.warmup_steps=1",
                           f"critic.mode={mode}", "stages=[{kind: rl, steps: 8, lr: 0.001, algo: {name: ppo}}]"])
    return cfg, Learner(cfg, str(policy))


def state(lrn):
    out = {f"policy.{k}": v.clone() for k, v in lrn.named_tensors().items()}
    out.update({f"critic.{k}": v.clone() for k, v in lrn.critic.head.state_dict().items()})
    out.update({f"critic.trunk.{k}": v.clone() for k, v in lrn.critic.trunk.state_dict().items()})
    return out


@pytest.mark.parametrize("mode", ["separate", "head"])
def test_a_ppo_learner_resumes_policy_and_critic_exactly(policy, tmp_path, mode):
    """The learner's critic is a DeepSpeed engine: its parameters and optimizer resume through DeepSpeed's
    checkpoint (``critic/``), its step count through the manifest (``critic.pt``)."""
    cfg, a = ppo_learner(policy, mode)
    stage = cfg.stages[0]
    a.begin_stage(0, stage)
    first = a.train_groups(singleton_groups(0), [0] * 6, stage)
    a._finish_step(first, first.pop(K.LEARNER_LR))
    assert first[K.LEARNER_CRITIC_WARMUP] == 1.0  # critic.warmup_steps=1: step 0 trains only the critic
    a.save_checkpoint(str(tmp_path / "ckpt"), {})
    assert (tmp_path / "ckpt" / CRITIC_FILE).is_file() and (tmp_path / "ckpt" / CRITIC_DIR / "engine").is_dir()
    assert torch.load(tmp_path / "ckpt" / CRITIC_FILE, weights_only=False) == {"mode": mode, "steps": 1,
                                                                               "format": "deepspeed"}
    for s in (1, 2):
        m = a.train_groups(singleton_groups(s, version=a.version), [0] * 6, stage)
        assert m[K.LEARNER_CRITIC_WARMUP] == 0.0
        a._finish_step(m, m.pop(K.LEARNER_LR))
    expected = state(a)

    _, b = ppo_learner(policy, mode)
    assert any(not torch.equal(expected[k], v) for k, v in state(b).items())
    b.load_checkpoint(str(tmp_path / "ckpt"))
    b.begin_stage(0, stage, b.stage_step)
    for s in (1, 2):
        m = b.train_groups(singleton_groups(s, version=b.version), [0] * 6, stage)
        b._finish_step(m, m.pop(K.LEARNER_LR))
    got = state(b)
    diverged = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not diverged, f"a resumed ppo stage diverged in {diverged[:5]}"
    assert b.critic.steps == a.critic.steps == 3


def test_a_plain_critic_checkpoint_round_trips_and_a_deepspeed_one_is_refused_by_it(policy, tmp_path):
    """The plain-PyTorch critic (the tests' reference) keeps its whole state in ``critic.pt``; it refuses a
    DeepSpeed critic's checkpoint, naming what it found."""
    a = Critic(CriticConfig(lr=1e-2), LearnerConfig(micro_batch_tokens=40), policy_dir=str(policy))
    batch = collate([g[0] for g in singleton_groups()], None, 0)
    _, old, ret = gae_advantages(a, batch, None, 0.0)
    a.update(batch, old, ret)
    a.save(tmp_path)
    b = Critic(CriticConfig(lr=1e-2), LearnerConfig(micro_batch_tokens=40), policy_dir=str(policy))
    b.load(tmp_path)
    assert b.steps == 1 and torch.equal(a.predict(batch), b.predict(batch))
    torch.save({"mode": "separate", "steps": 3, "format": "deepspeed"}, tmp_path / CRITIC_FILE)
    with pytest.raises(ValueError, match="holds a deepspeed critic"):
        b.load(tmp_path)


@pytest.mark.parametrize("overrides, named", [
    (["critic.mode=shared"], "critic.mode='shared'"),
    (["critic.lr=0"], "critic.lr=0"),
    (["critic.gamma=1.5"], "critic.gamma=1.5"),
    (["critic.lam=-0.1"], "critic.lam=-0.1"),
    (["critic.value_clip=-1"], "critic.value_clip=-1"),
    (["critic.warmup_steps=-2"], "critic.warmup_steps=-2"),
    (["rollout.group_size=1", "stages.0.algo.name=ppo", "stages.0.algo.dynamic_sampling=true"],
     "rollout.group_size=1"),
])
def test_critic_config_errors_name_the_field_and_value(overrides, named):
    with pytest.raises(ValueError) as e:
        load_config([], overrides)
    assert named in str(e.value)


def test_ppo_runs_one_sample_per_prompt():
    cfg = load_config([], ["rollout.group_size=1", "stages.0.algo.name=ppo"])
    assert cfg.rollout.group_size == 1 and cfg.critic.mode == "separate"
