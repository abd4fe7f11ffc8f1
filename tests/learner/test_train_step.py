"""The learner's step: DeepSpeed on CPU equals a plain-PyTorch reference step, gradients reach only
MODEL tokens, and token-packed micro-batches give the full-batch update."""
import contextlib
import copy
import os
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sonar.cluster.wire.config import AlgoConfig, LearnerConfig, ReplayConfig
from sonar.cluster.wire.protocol import Segment, SegmentKind, Trajectory
from sonar.learner.train_step import DeepSpeedStepper, TorchStepper, rl_step, sft_step

VOCAB = 40


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float()


def traj(rng, group, reward, version=0, lens=(4, 3, 5, 2)):
    p, m1, r, m2 = lens
    segs = [Segment(SegmentKind.PROMPT, rng.integers(3, VOCAB, p)),
            Segment(SegmentKind.MODEL, rng.integers(3, VOCAB, m1), rng.normal(size=m1) - 3, version),
            Segment(SegmentKind.RETRIEVAL, rng.integers(3, VOCAB, r)),
            Segment(SegmentKind.MODEL, rng.integers(3, VOCAB, m2), rng.normal(size=m2) - 3, version)]
    return Trajectory(f"{group}-{reward}-{rng.integers(1e9)}", group, group, 0, segs, reward=reward)


def groups(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(3):
        out.append([traj(rng, f"g{g}", float(r), lens=(4, 2 + int(rng.integers(4)), 5, 1 + int(rng.integers(3))))
                    for r in (1, 0, 0, 1)])
    return out


def init_deepspeed():
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from sonar.learner.worker import _import_deepspeed_without_shm_jit, free_port

    os.environ["MASTER_PORT"] = str(free_port())
    ds = _import_deepspeed_without_shm_jit()
    if not torch.distributed.is_initialized():
        ds.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return ds


def keep_grads_before_step(stepper, full_grad):
    """Make ``stepper.step()`` first copy every parameter's accumulated gradient (``full_grad(p)``)
    into the returned list: the gradients the optimizer is about to apply."""
    grads: list[torch.Tensor] = []
    step = stepper.step

    def step_keeping_grads():
        grads.extend(full_grad(p).detach().clone() for p in stepper.module.parameters())
        return step()

    stepper.step = step_keeping_grads
    return stepper, grads


# Tolerances of the ZeRO comparison. ZeRO-3 wraps every submodule's inputs and outputs in identity
# autograd nodes (DeepSpeed's parameter-fetch hooks); they regroup the float32 sums of the gradients of
# tensors with three or more consumers (the residual stream: the add, and the norm's pow and mul), so
# its gradients differ from plain PyTorch's in the last bits (measured <= 2e-7 of each tensor's
# largest gradient, even with one micro-batch; plain PyTorch with the same identity nodes is bitwise
# equal to ZeRO-3, ZeRO 0-2 are bitwise equal to plain PyTorch, and both are as close to a float64
# gradient). AdamW's first step is lr * g / (|g| + eps), whose slope in g is up to lr / eps: with the
# default eps=1e-8, an element whose |g| is ~1e-7 turned that rounding into a 1.4e-6 parameter
# difference (o_proj, transformers 5.19), over the old atol. eps=1e-4 bounds the slope at lr / eps =
# 100, so 1e-9 of gradient rounding moves a parameter by <= 1e-7, under atol=1e-6 wherever the
# rounding lands. A wiring bug (a micro-batch lost or overwritten, a wrong normaliser, no step) moves
# gradients by O(1) of their size and parameters by O(lr): far outside both tolerances.
GRAD_ATOL_OF_MAX = 1e-5
"""Gradient tolerance, as a fraction of the tensor's largest reference gradient."""
ADAM_EPS = 1e-4


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_deepspeed_step_matches_plain_pytorch(zero_stage):
    """Same accumulated gradients before the optimizer step, same parameters after it."""
    ds = init_deepspeed()
    from deepspeed.utils import safe_get_full_grad
    from sonar.learner.deepspeed_config import deepspeed_config

    lcfg, lr = LearnerConfig(grad_clip=1.0, zero_stage=zero_stage, micro_batch_tokens=40), 1e-2
    algo, rcfg = AlgoConfig(), ReplayConfig()
    ref = tiny_model()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.99), eps=ADAM_EPS, weight_decay=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=ADAM_EPS, weight_decay=0.0)
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=deepspeed_config(lcfg, on_gpu=False))
    ref_stepper, ref_grads = keep_grads_before_step(TorchStepper(ref, opt_ref, lcfg.grad_clip), lambda p: p.grad)
    ds_stepper, ds_grads = keep_grads_before_step(DeepSpeedStepper(engine, zero_stage), safe_get_full_grad)
    a = rl_step(ref_stepper, groups(), [0, 0, 0], algo, lcfg, rcfg, 1.0, 0)
    b = rl_step(ds_stepper, groups(), [0, 0, 0], algo, lcfg, rcfg, 1.0, 0)
    assert a["learner/micro_batches"] > 1  # the token budget really splits the batch
    assert a["learner/loss"] == pytest.approx(b["learner/loss"], rel=1e-5, abs=1e-7)
    assert a["learner/grad_norm"] == pytest.approx(b["learner/grad_norm"], rel=1e-4)
    for (n, _), g, h in zip(ref.named_parameters(), ref_grads, ds_grads, strict=True):
        torch.testing.assert_close(h, g, rtol=0.0, atol=GRAD_ATOL_OF_MAX * float(g.abs().max()), msg=f"grad {n}")
    params = list(engine.module.named_parameters())
    gather = ds.zero.GatheredParameters([q for _, q in params]) if zero_stage == 3 else contextlib.nullcontext()
    with gather:  # ZeRO-3 partitions parameters: gather them to compare
        for (n, p), (_, q) in zip(ref.named_parameters(), params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_micro_batch_packing_does_not_change_the_update():
    results = []
    for budget in (10_000, 30):
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        m = rl_step(TorchStepper(model, opt, 0.0), groups(1), [0, 0, 0], AlgoConfig(),
                    LearnerConfig(micro_batch_tokens=budget), ReplayConfig(), 1.0, 0)
        results.append((m["learner/micro_batches"], [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == 1 and results[1][0] > 2
    for p, q in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_entropy_bonus_moves_the_update_the_same_with_and_without_chunked_logits():
    """algo.entropy_coef > 0 (Search-R1 / RAG-R1: 0.001) adds -c * H to the loss with H's gradient: the
    update differs from c = 0, and the chunked head (learner.logits_chunk_tokens) gives the same update
    as the full logits."""
    def update(coef, chunk):
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rl_step(TorchStepper(model, opt, 0.0), groups(1), [0, 0, 0], AlgoConfig(entropy_coef=coef),
                LearnerConfig(logits_chunk_tokens=chunk), ReplayConfig(), 1.0, 0)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    plain, bonus, bonus_chunked = update(0.0, 0), update(0.5, 0), update(0.5, 8)
    assert (bonus - plain).abs().max() > 1e-4
    torch.testing.assert_close(bonus, bonus_chunked, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_gradient_reaches_only_model_tokens(kind):
    """The gradient on the logits is exactly 0 at every position whose target is a PROMPT,
    RETRIEVAL or padding token, and non-zero at MODEL targets."""
    from sonar.learner.batching import collate

    model = tiny_model()
    captured = {}

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    model.lm_head.register_forward_hook(keep_logits)
    g = groups(4)[0]
    stepper = TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0)
    # one micro-batch, unchunked: one captured logits tensor (chunked == unchunked: test_chunked_logprobs.py)
    lcfg = LearnerConfig(micro_batch_tokens=10_000, logits_chunk_tokens=0)
    if kind == "rl":
        rl_step(stepper, [g], [0], AlgoConfig(), lcfg, ReplayConfig(), 1.0, 0)
    else:
        sft_step(stepper, g, lcfg, 0)
    grad = captured["logits"].grad.abs().sum(-1)[:, :-1]  # [B, T-1]: position t predicts token t+1
    batch = collate(g, None, 0)
    order = sorted(range(len(g)), key=lambda i: (-int(batch.lengths[i]), i))  # packing order
    mask = batch.loss_mask[order][:, : grad.shape[1]]
    assert torch.all(grad[mask == 0] == 0)
    assert torch.all(grad[mask == 1] > 0)


def test_sft_without_model_tokens_gives_zero_loss():
    model = tiny_model()
    rng = np.random.default_rng(3)
    t = traj(rng, "g", 1.0)
    only_prompt = Trajectory("x", "g", "g", 0, [t.segments[0], t.segments[2]], reward=1.0)
    m = sft_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0), [only_prompt],
                 LearnerConfig(), 0)
    assert m["learner/trained_tokens"] == 0 and m["learner/loss"] == 0.0


def test_all_equal_groups_skip_the_step_and_are_counted():
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    rng = np.random.default_rng(0)
    g = [[traj(rng, "a", 1.0) for _ in range(4)], [traj(rng, "b", 0.0) for _ in range(4)]]
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=1.0), 0.0), g, [0, 0], AlgoConfig(),
                LearnerConfig(), ReplayConfig(), 1.0, 0)
    assert m["learner/groups_zero_signal"] == 2 and m["learner/skipped_step"] == 1.0
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)


def test_stale_groups_dropped_or_downweighted():
    model = tiny_model()
    g = groups(2)
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0), g, [0, 5, 0], AlgoConfig(),
                LearnerConfig(), ReplayConfig(max_policy_lag=2), 1.0, 0)
    assert m["learner/groups_stale_dropped"] == 1 and m["learner/policy_lag/max"] == 5
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0), g, [0, 5, 0], AlgoConfig(),
                LearnerConfig(), ReplayConfig(max_policy_lag=2, stale_policy="downweight"), 1.0, 0)
    assert m["learner/groups_stale_dropped"] == 0


def test_difficulty_range_filters_groups_by_success_rate():
    rng = np.random.default_rng(5)

    def group(name, ems):
        out = []
        for e in ems:
            t = traj(rng, name, float(e))
            t.reward_parts = {"em": float(e)}
            out.append(t)
        return out

    easy, medium, hard = group("easy", [1, 1, 1, 0]), group("medium", [1, 0, 0, 1]), group("hard", [0, 0, 0, 1])
    model = tiny_model()
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0), [easy, medium, hard],
                [0, 0, 0], AlgoConfig(), LearnerConfig(), ReplayConfig(), 1.0, 0, difficulty=(0.0, 0.5))
    assert m["learner/groups_difficulty_filtered"] == 1  # the 75 % group is too easy
    assert m["learner/trajectories"] == 8


def test_importance_weight_histogram_counts_every_trained_token():
    model = tiny_model()
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0), groups(6), [0, 0, 0],
                AlgoConfig(dynamic_sampling=False), LearnerConfig(micro_batch_tokens=30), ReplayConfig(), 1.0, 0)
    hist = {k: v for k, v in m.items() if k.startswith("learner/is_weight/hist/")}
    assert len(hist) == 7 and sum(hist.values()) == m["learner/trained_tokens"]


def test_off_policy_metrics_per_policy_lag():
    """Per lag: the importance-weight histogram (its bins sum to the overall one), the share of tokens
    beyond tis_cap (a group sampled at logprob -50 is wholly beyond it, one at logprob 0 never: the
    learner's logprob is <= 0) and the sampling KL (token-weighted, the lags' means make the overall)."""
    g = groups(3)
    for t in g[2]:
        for seg in t.segments:
            if seg.kind == SegmentKind.MODEL:
                seg.logprobs = np.full(len(seg.token_ids), -50.0, np.float32)
    for grp in g[:2]:
        for t in grp:
            for seg in t.segments:
                if seg.kind == SegmentKind.MODEL:
                    seg.logprobs = np.zeros(len(seg.token_ids), np.float32)
    model = tiny_model()
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0), g, [0, 0, 1],
                AlgoConfig(dynamic_sampling=False, off_policy="none", recompute_old_logprobs=True),
                LearnerConfig(micro_batch_tokens=30), ReplayConfig(), 1.0, 0)
    assert m["learner/is_weight/beyond_cap/lag/1"] == 1.0 and m["learner/is_weight/beyond_cap/lag/0"] == 0.0
    tokens = {lag: sum(v for k, v in m.items() if k.startswith(f"learner/is_weight/lag/{lag}/hist/")) for lag in (0, 1)}
    assert tokens[0] + tokens[1] == m["learner/trained_tokens"] and tokens[1] > 0
    assert m["learner/is_weight/beyond_cap"] == pytest.approx(tokens[1] / (tokens[0] + tokens[1]))
    overall = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("learner/is_weight/hist/")}
    for b, v in overall.items():
        assert v == sum(m.get(f"learner/is_weight/lag/{lag}/hist/{b}", 0) for lag in (0, 1))
    kl = m["learner/sampling_kl/lag/0"] * tokens[0] + m["learner/sampling_kl/lag/1"] * tokens[1]
    assert m["learner/sampling_kl/lag/1"] > m["learner/sampling_kl/lag/0"] >= 0
    assert kl / (tokens[0] + tokens[1]) == pytest.approx(m["learner/sampling_kl/mean"], rel=1e-5)


def test_sequence_keep_is_the_geometric_mean_weight_inside_the_bounds():
    from sonar.learner.algo.losses import sequence_keep

    mu = torch.zeros(4, 3)
    prox = torch.tensor([[0.0, 0.0, 0.0],            # weight 1: kept
                         [2.0, -2.0, 0.9],           # mean 0.3: exp 1.35, kept (a product would be 2.46: kept too)
                         [1.0, 1.0, 9.0],            # mean of the two trained (1.0): e = 2.72 > 2: masked
                         [-1.0, -1.0, -1.0]])        # exp(-1) = 0.37 < 0.5: masked
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    assert sequence_keep(prox, mu, mask, 0.5, 2.0).tolist() == [True, True, False, False]
    assert sequence_keep(prox, mu, torch.zeros(4, 3), 0.5, 2.0).tolist() == [True] * 4  # nothing trained: kept
    long = torch.full((1, 200), 0.01)  # a small mismatch on many tokens: the product (e^2) would reject it
    assert sequence_keep(long, torch.zeros(1, 200), torch.ones(1, 200), 0.5, 2.0).tolist() == [True]


def test_seq_mask_leaves_rejected_sequences_out_of_the_loss_and_its_denominators():
    from sonar.cluster.wire.config import proximal_forward_runs

    g = groups(4)
    for t in g[2]:  # sampled at logprob -50: the learner's own is far higher, the weight far beyond 2
        for seg in t.segments:
            if seg.kind == SegmentKind.MODEL:
                seg.logprobs = np.full(len(seg.token_ids), -50.0, np.float32)
    # Wide bounds: the other groups' random sampling logprobs stay inside; exp(46) does not.
    algo = AlgoConfig(dynamic_sampling=False, off_policy="seq_mask", seq_mask_low=1e-3, seq_mask_high=1e3)
    assert proximal_forward_runs(algo)
    model = tiny_model()
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0), g, [0, 0, 0], algo,
                LearnerConfig(), ReplayConfig(), 1.0, 0)
    kept = [t for grp in g[:2] for t in grp]
    model_tokens = sum(len(s.token_ids) for t in kept for s in t.segments if s.kind == SegmentKind.MODEL)
    assert m["learner/is_weight/seq_masked"] == pytest.approx(4 / 12)
    assert m["learner/trained_tokens"] == model_tokens  # the masked group's tokens count nowhere


def test_proximal_forward_runs_when_the_algorithm_needs_it():
    from sonar.cluster.wire.config import proximal_forward_runs

    assert not proximal_forward_runs(AlgoConfig(off_policy="tis"))  # one update: prox == current logprobs
    assert proximal_forward_runs(AlgoConfig(off_policy="tis", mini_batches=2))
    assert proximal_forward_runs(AlgoConfig(off_policy="decoupled", ppo_epochs=2))
    assert not proximal_forward_runs(AlgoConfig(off_policy="vtrace", ppo_epochs=2))
    assert proximal_forward_runs(AlgoConfig(off_policy="none", recompute_old_logprobs=True))
    assert not proximal_forward_runs(AlgoConfig(off_policy="none"))
    with pytest.raises(ValueError, match="resolved"):
        proximal_forward_runs(AlgoConfig(off_policy="auto"))


@pytest.mark.slow
def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports_afterwards():
    """The learner's DeepSpeed import skips the autotuner's ``import mlflow`` (2-3 s of every learner's
    start-up); MLflow is importable again once DeepSpeed is in (a fresh process: nothing loaded before).
    On this CPU machine DeepSpeed prints no accelerator-detection warning, and its log lines carry
    Sonar's date format."""
    import subprocess

    code = ("import sys\n"
            "from sonar.learner.deepspeed_config import import_deepspeed_without_shm_jit as f\n"
            "ds = f()\n"
            "from deepspeed.autotuning import autotuner\n"
            "assert 'mlflow' not in sys.modules and autotuner.has_mlflow is False, 'mlflow was imported'\n"
            "import mlflow\n"
            "assert sys.modules['mlflow'] is mlflow and mlflow.__version__\n"
            "import logging\n"
            "from sonar.cluster.wire.logs import LOG_DATEFMT\n"
            "assert all(h.formatter.datefmt == LOG_DATEFMT for h in logging.getLogger('DeepSpeed').handlers)\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    # a CPU machine: no accelerator-detection WARNING in DeepSpeed's own date format
    assert "Setting accelerator to CPU" not in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
