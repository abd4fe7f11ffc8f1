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


def _fork_critic(prompts, responses, V, V_new, scores, gamma, lam, clip):
    """RAG-R1's veRL fork on the same rollouts, restated from the released code (inclusionAI/AWorld-RL@4aeef7b
    RAG-R1/verl: workers/critic/dp_critic.py:93-100 and 136 (values of the response grid shifted by one,
    masked by attention_mask[:, -R-1:-1]), 178-188 (the value loss under that mask), trainer/ppo/ray_trainer.py:
    126-137 (GAE, its eos_mask = attention_mask[:, -R:]), trainer/ppo/core_algos.py:93-107 (the recursion,
    next value 0 after the grid) and 234-238 (the clipped loss, a masked mean); Search-R1's fork is the same).
    The prompts are left-padded to the longest, the responses right-padded to the longest, R.
    ``V[b][j]`` / ``V_new[b][j]``: the old / current value of row b's state "tokens <= j" (its own positions).
    Returns ({(b, j): advantage}, {(b, j): return}, value loss), keyed by the position j of the token that
    follows the state, as Sonar's columns."""
    B, R = len(prompts), max(len(r) for r in responses)
    values = torch.zeros(B, R, dtype=torch.float64)
    vpreds = torch.zeros(B, R, dtype=torch.float64)
    eos_shifted = torch.zeros(B, R, dtype=torch.float64)   # attention_mask[:, -R-1:-1]
    response_mask = torch.zeros(B, R, dtype=torch.float64)  # attention_mask[:, -R:]
    rewards = torch.zeros(B, R, dtype=torch.float64)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        P, n = len(p), len(r)
        for i in range(R):
            # grid column i reads the state before response token i: the row's own position P - 1 + i,
            # attended while that position is a real token (i <= n)
            if i <= n:
                eos_shifted[b, i] = 1.0
                values[b, i], vpreds[b, i] = V[b][P - 1 + i], V_new[b][P - 1 + i]
            response_mask[b, i] = float(i < n)
        rewards[b, n - 1] = scores[b]
    values, vpreds = values * eos_shifted, vpreds
    last, adv_rev = 0.0, []
    for t in reversed(range(R)):
        nxt = values[:, t + 1] if t < R - 1 else 0.0
        last = rewards[:, t] + gamma * nxt - values[:, t] + gamma * lam * last
        adv_rev.append(last)
    adv = torch.stack(adv_rev[::-1], dim=1)
    returns = adv + values
    m = response_mask > 0
    mean, var = adv[m].mean(), adv[m].var(unbiased=True)
    white = (adv - mean) * torch.rsqrt(var + 1e-8)
    clipped = values + (vpreds - values).clamp(-clip, clip)
    per = torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2)
    loss = 0.5 * float((per * eos_shifted).sum() / eos_shifted.sum())
    A, G = {}, {}
    for b, (p, r) in enumerate(zip(prompts, responses)):
        for i in range(len(r)):
            A[(b, len(p) - 1 + i)] = float(white[b, i])
            G[(b, len(p) - 1 + i)] = float(returns[b, i])
    return A, G, loss


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_response_tokens_critic_trains_the_terminal_state_as_rag_r1s_fork(policy, gamma, lam):
    """critic.tokens='response' (RAG-R1's preset) against the fork's own critic and GAE, restated above:
    the state after the last token of every response shorter than the batch's longest is a value the fork
    trains toward return 0 (it sits in the shifted value mask and not in the GAE/whitening mask), and it
    bootstraps the last token with weight gamma * (1 - lam). Sonar's advantages on the model's tokens,
    returns on the response and value loss equal the fork's, on rows of different prompt and response
    lengths; without the terminal states (the old rule) the value loss differs."""
    from sonar.learner.critic import terminal_rows, trains_terminal_value

    rng = np.random.default_rng(3)
    shapes = [(3, [2, 4, 1]), (6, [1, 2, 2]), (4, [3, 3, 3]), (5, [1, 4, 1])]  # prompt; model, retrieval, model
    trajs, prompts, responses = [], [], []
    for b, (P, (m1, d, m2)) in enumerate(shapes):
        prompt = np.concatenate([[10 + b], rng.integers(4, VOCAB, P - 1)])  # the first id names the row
        segs = [Segment(SegmentKind.PROMPT, prompt),
                Segment(SegmentKind.MODEL, rng.integers(4, VOCAB, m1), np.full(m1, -1.0, np.float32), 0),
                Segment(SegmentKind.RETRIEVAL, rng.integers(4, VOCAB, d)),
                Segment(SegmentKind.MODEL, rng.integers(4, VOCAB, m2), np.full(m2, -1.0, np.float32), 0)]
        trajs.append(Trajectory(f"t{b}", f"g{b}", f"q{b}", 0, segs, reward=float(b % 2) - 0.3,
                                finish_reason=FinishReason.ANSWERED))
        prompts.append(list(prompt))
        responses.append([0] * (m1 + d + m2))
    batch = collate(trajs, None, 0)
    T = batch.input_ids.shape[1]
    g = torch.Generator().manual_seed(5)
    V, V_new = torch.randn(len(trajs), T, generator=g), torch.randn(len(trajs), T, generator=g)
    cfg = CriticConfig(gamma=gamma, lam=lam, tokens="response", value_clip=0.5, whiten=True)
    critic = Critic(cfg, LearnerConfig(micro_batch_tokens=24), policy_dir=str(policy))
    assert trains_terminal_value(cfg) and not trains_terminal_value(CriticConfig())
    table = {"now": V}

    def all_values(input_ids, attention_mask):  # the row's values by its first id, on the micro-batch's width
        rows = [int(i) - 10 for i in input_ids[:, 0]]
        return table["now"][rows, :input_ids.shape[1]].float() + 0.0 * critic.head.bias

    critic.all_values = all_values
    adv, old, ret = gae_advantages(critic, batch, None, 0.0)
    n = [len(r) for r in responses]
    assert terminal_rows(batch).tolist() == [k < max(n) for k in n]  # the longest responses have no slot
    A, G, fork_loss = _fork_critic(prompts, responses, V.double(), V_new.double(), batch.rewards.double(),
                                   gamma, lam, 0.5)
    for (b, j), a in A.items():
        if batch.loss_mask[b, j] > 0:
            assert float(adv[b, j]) == pytest.approx(a, abs=1e-5), (b, j)
        assert float(ret[b, j]) == pytest.approx(G[(b, j)], abs=1e-5), (b, j)
    table["now"] = V_new
    out = critic.update(batch, old, ret)
    assert out[K.LEARNER_CRITIC_VALUE_LOSS] == pytest.approx(fork_loss, rel=1e-5)
    # the old rule (no terminal state) is another loss
    batch.old_terminal_values = None
    assert critic.update(batch, old, ret)[K.LEARNER_CRITIC_VALUE_LOSS] != pytest.approx(fork_loss, rel=1e-3)
