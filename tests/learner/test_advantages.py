"""Advantages: closed forms, python-loop references, no NaN on constant groups.

The upstream formulas (OpenRLHF's experience maker and replay-buffer normalisation, which R1-Searcher
trains with; TRL / veRL for GRPO) are restated in plain python below and pinned by hand-computed cases."""
import math
import statistics

import pytest
import torch

from sonar.learner.algo.advantages import (compute_advantages, dynamic_sampling_mask,
                                          group_advantages, reinforce_pp_advantages, whiten, zero_signal_groups)

torch.set_num_threads(1)


# ------------------------------------------------------------------ references (plain python)

def ref_group_adv(rewards, groups, std_normalize, eps=1e-6):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        a = r - mean
        if std_normalize and len(members) > 1:
            a = a / (statistics.stdev(members) + eps)  # unbiased (n - 1), torch.std's default
        if max(members) == min(members):
            a = 0.0
        out.append(a)
    return out


def ref_reinforce_pp(rewards, mask, kl, kl_coef, groups=None, estimator="reinforce_pp"):
    """OpenRLHF: shape the outcome (reinforce_baseline: - group mean; group_norm: (r - mean) / (std + 1e-9),
    torch.std unbiased), per-token returns with the KL penalty, then (not for group_norm) whiten over the
    batch's trained tokens: (G - mean) * rsqrt(max(var, 1e-8)) with the population variance."""
    B, L = len(mask), len(mask[0])
    rew = list(rewards)
    if estimator != "reinforce_pp":
        rew = []
        for r, g in zip(rewards, groups):
            members = [x for x, h in zip(rewards, groups) if h == g]
            a = r - sum(members) / len(members)
            if estimator == "group_norm" and max(members) != min(members):
                a = a / (statistics.stdev(members) + 1e-9)
            rew.append(0.0 if max(members) == min(members) else a)
    returns = [[0.0] * L for _ in range(B)]
    for b in range(B):
        trained = [t for t in range(L) if mask[b][t] > 0]
        if not trained:
            continue
        last = trained[-1]
        g = 0.0
        for t in reversed(range(L)):
            if mask[b][t] > 0:
                r_t = -kl_coef * (kl[b][t] if kl is not None else 0.0)
                if t == last:
                    r_t += rew[b]
                g += r_t
                returns[b][t] = g
    if estimator == "group_norm":
        return returns
    vals = [returns[b][t] for b in range(B) for t in range(L) if mask[b][t] > 0]
    if not vals or max(vals) == min(vals):
        return [[0.0] * L for _ in range(B)]
    mean = sum(vals) / len(vals)
    rstd = 1 / math.sqrt(max(statistics.pvariance(vals), 1e-8))
    return [[(returns[b][t] - mean) * rstd if mask[b][t] > 0 else 0.0 for t in range(L)] for b in range(B)]


def random_mask(gen, B, L, p=0.6):
    m = (torch.rand(B, L, generator=gen) < p).float()
    m[0] = 0.0  # an empty row
    if B > 1:
        m[1, :] = 0.0
        m[1, 1:3] = 1.0
        m[1, 5:L] = 1.0  # two model turns with a retrieval gap
    return m


# ------------------------------------------------------------------ group advantages

def test_closed_form_1001():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]
    adv_std = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), True)
    # GRPO divides by the UNBIASED std (TRL, veRL: torch.std): sqrt(((1/4) * 4) / 3) = sqrt(1/3), not 0.5
    torch.testing.assert_close(adv_std, torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (math.sqrt(1 / 3) + 1e-6))
    assert adv_std[0].item() == pytest.approx(0.8660239, abs=1e-6)  # (the population std would give 0.9999980)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(adv_std, (r - r.mean()) / (r.std() + 1e-6))  # TRL's formula, torch.std unbiased


def test_all_equal_group_exact_zeros_not_nan():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 1.0, 0.0, 5.0])
    groups = torch.tensor([3, 3, 3, 9, 9, 1, 1, 42])  # constant, constant, mixed, singleton
    for std in (False, True):
        adv = group_advantages(rewards, groups, std_normalize=std)
        assert not torch.isnan(adv).any()
        assert adv[:5].tolist() == [0.0] * 5 and adv[7].item() == 0.0
        assert adv[5].item() > 0 > adv[6].item()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("std", [False, True])
def test_group_advantages_vs_loop(seed, std):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=gen))
    labels = torch.randint(0, 7, (n,), generator=gen) * 13 - 20  # non-contiguous, negative, unsorted
    rewards = torch.randint(0, 3, (n,), generator=gen).float() * 0.5 + torch.rand(n, generator=gen) * (seed % 2)
    adv = group_advantages(rewards, labels, std_normalize=std)
    ref = ref_group_adv(rewards.double().tolist(), labels.tolist(), std)
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_dr_grpo_is_centring_only():
    """Dr.GRPO through the learner's dispatch: r - group mean, no std division (one trained token per row)."""
    r = torch.tensor([3.0, 1.0, 0.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    adv = compute_advantages("dr_grpo", r, g, torch.ones(5, 1))
    torch.testing.assert_close(adv[:, 0], torch.tensor([5 / 3, -1 / 3, -4 / 3, 0.0, 0.0]))


def test_dynamic_sampling_mask_and_count():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert dynamic_sampling_mask(r, g).tolist() == [False, False, True, True, False, False, False]
    assert zero_signal_groups(r, g) == 3
    assert dynamic_sampling_mask(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


# ------------------------------------------------------------------ REINFORCE++

def test_reinforce_pp_closed_form_no_kl():
    # two rows, outcome 1 and 0, the first with a retrieval gap: returns are the outcome on every
    # trained token; global normalisation over 5 tokens (3 ones, 2 zeros).
    mask = torch.tensor([[0, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
    mean, var = 0.6, 0.24  # population variance of [1, 1, 1, 0, 0]
    hi, lo = (1 - mean) / math.sqrt(var), (0 - mean) / math.sqrt(var)
    expect = torch.tensor([[0, hi, 0, 0, hi, hi], [lo, lo, 0, 0, 0, 0]], dtype=torch.float32)
    torch.testing.assert_close(adv, expect)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline", "group_norm"])
def test_reinforce_pp_vs_loop(seed, kl_coef, estimator):
    gen = torch.Generator().manual_seed(100 + seed)
    B, L = 2 + seed, 7 + 3 * seed
    mask = random_mask(gen, B, L)
    rewards = torch.randint(0, 3, (B,), generator=gen).float() * 0.5
    kl = torch.rand(B, L, generator=gen)
    groups = torch.arange(B) // 2
    adv = reinforce_pp_advantages(rewards, mask, kl, kl_coef, group_index=groups, estimator=estimator)
    ref = ref_reinforce_pp(rewards.tolist(), mask.tolist(), kl.double().tolist(), kl_coef,
                           groups=groups.tolist(), estimator=estimator)
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float32), rtol=1e-4, atol=1e-5)
    assert (adv[mask == 0] == 0).all()


def test_reinforce_pp_baseline_closed_form():
    """OpenRLHF reinforce_baseline, hand-computed: rewards [1, 0, 1, 1] in groups [a, a, b, b], one trained
    token each -> outcomes [0.5, -0.5, 0, 0] -> mean 0, population variance 1/8 -> [sqrt 2, -sqrt 2, 0, 0].
    Without the baseline (reinforce): returns [1, 0, 1, 1], mean 0.75, variance 3/16 -> [1/sqrt 3, -sqrt 3, ..]."""
    mask = torch.tensor([[0, 1.0], [0, 1.0], [1.0, 0], [1.0, 0]])
    r, g = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([7, 7, 3, 3])
    adv = reinforce_pp_advantages(r, mask, group_index=g, estimator="reinforce_pp_baseline")
    s2 = math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[0, s2], [0, -s2], [0.0, 0], [0.0, 0]]))
    adv = reinforce_pp_advantages(r, mask, group_index=g, estimator="reinforce_pp")
    hi, lo = 0.25 / math.sqrt(3 / 16), -0.75 / math.sqrt(3 / 16)
    torch.testing.assert_close(adv, torch.tensor([[0, hi], [0, lo], [hi, 0], [hi, 0]]))


def test_group_norm_closed_form_with_kl():
    """OpenRLHF group_norm, hand-computed: rewards [1, 0, 0, 1] in one group -> (r - 0.5) / (sqrt(1/3) + 1e-9)
    = +-0.8660254; then per-token returns with the KL reward -kl_coef * kl_t (0.5 x [0.2, 0.4] on row 0's two
    trained tokens), and NO batch whitening: row 0 = [0.8660254 - 0.1 - 0.2, 0.8660254 - 0.2]."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]])
    kl = torch.zeros(4, 3)
    kl[0, :2] = torch.tensor([0.2, 0.4])
    kl[1, 1] = 9.0  # on an untrained token: ignored
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), mask, kl, 0.5,
                                  group_index=torch.zeros(4, dtype=torch.long), estimator="group_norm")
    a = 0.5 / (math.sqrt(1 / 3) + 1e-9)
    assert a == pytest.approx(0.8660254, abs=1e-7)
    torch.testing.assert_close(adv, torch.tensor([[a - 0.3, a - 0.2, 0], [-a, 0, 0], [0, -a, 0], [0, 0, a]]))


def test_whiten_floors_the_variance_like_openrlhf():
    """rsqrt(max(var, 1e-8)): a variance below the floor is not blown up to unit scale."""
    x = torch.tensor([[0.0, 1e-5, 0.0, 1e-5]], dtype=torch.float64)  # population variance 2.5e-11 < 1e-8
    out = whiten(x, torch.ones_like(x))
    torch.testing.assert_close(out, (x - 5e-6) / math.sqrt(1e-8))
    assert out.abs().max().item() == pytest.approx(0.05)


def test_reinforce_pp_constant_returns_zero_not_nan():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1.0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 1.0]), mask)
    assert adv.tolist() == [[0.0] * 3] * 2
    empty = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.zeros(2, 4))
    assert empty.tolist() == [[0.0] * 4] * 2


# ------------------------------------------------------------------ dispatcher

def test_compute_advantages_broadcasts_over_mask():
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1.0]])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = torch.zeros(4, dtype=torch.long)
    centred = torch.tensor([0.5, -0.5, -0.5, 0.5])[:, None] * mask
    assert torch.equal(compute_advantages("dr_grpo", rewards, groups, mask), centred)
    for name in ("grpo", "ppo"):  # default: divide by the unbiased std sqrt(1/3)
        assert torch.equal(compute_advantages(name, rewards, groups, mask),
                           group_advantages(rewards, groups, True)[:, None] * mask), name
        torch.testing.assert_close(compute_advantages(name, rewards, groups, mask),
                                   centred / (math.sqrt(1 / 3) + 1e-6))
        assert torch.equal(compute_advantages(name, rewards, groups, mask, False), centred), name
    for name in ("reinforce_pp", "reinforce_pp_baseline", "group_norm"):
        torch.testing.assert_close(compute_advantages(name, rewards, groups, mask),
                                   reinforce_pp_advantages(rewards, mask, group_index=groups, estimator=name))


def test_compute_advantages_kl_in_reward_mode():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0.0]])
    kl = torch.tensor([[0.5, 0.5, 100.0], [1.0, 100.0, 100.0]])  # 100s sit on untrained tokens
    adv = compute_advantages("dr_grpo", torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask, kl=kl, kl_coef=0.1)
    # effective rewards 1 - 0.1 = 0.9 and 1 - 0.1 = 0.9 -> equal -> zero
    assert adv.abs().max().item() < 1e-6
    adv = compute_advantages("grpo", torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask, False,
                             kl=kl * torch.tensor([[1.0], [3.0]]), kl_coef=0.1)
    torch.testing.assert_close(adv, torch.tensor([[0.1, 0.1, 0.0], [-0.1, 0.0, 0.0]]))
    # with the std: effective rewards [0.9, 0.7], unbiased std 0.1 * sqrt(2)
    adv = compute_advantages("grpo", torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask,
                             kl=kl * torch.tensor([[1.0], [3.0]]), kl_coef=0.1)
    a = 0.1 / (0.1 * math.sqrt(2) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[a, a, 0.0], [-a, 0.0, 0.0]]))


def test_compute_advantages_errors():
    m = torch.ones(2, 3)
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="dr_grpo"):
        compute_advantages("dr_grpo", r, g, m, std_normalize=True)
    for name in ("reinforce_pp", "reinforce_pp_baseline", "group_norm"):
        with pytest.raises(ValueError, match=f"{name}.*std_normalize=True"):
            compute_advantages(name, r, g, m, std_normalize=True)
    with pytest.raises(ValueError, match="needs group_index"):
        reinforce_pp_advantages(r, m, estimator="group_norm")
    with pytest.raises(ValueError, match="algo.name"):
        compute_advantages("a2c", r, g, m)
    with pytest.raises(ValueError):
        compute_advantages("grpo", torch.tensor([1.0]), g, m)
