"""GAE over MODEL tokens, whitening and the clipped value loss, pinned by closed forms, hand-computed
cases and a plain python loop."""
import math

import numpy as np
import pytest
import torch

from sonar.learner.algo.gae import (explained_variance, gae, masked_whiten, outcome_token_rewards,
                                    value_loss)


def loop_gae(r, v, m, gamma, lam):
    """Reference: per row, the MODEL positions in order form the episode (retrieved ones removed)."""
    B, L = len(r), len(r[0])
    adv = [[0.0] * L for _ in range(B)]
    for b in range(B):
        steps = [t for t in range(L) if m[b][t] > 0]
        a_next, v_next = 0.0, 0.0
        for t in reversed(steps):
            delta = r[b][t] + gamma * v_next - v[b][t]
            a_next = delta + gamma * lam * a_next
            v_next = v[b][t]
            adv[b][t] = a_next
    ret = [[(adv[b][t] + v[b][t]) if m[b][t] > 0 else 0.0 for t in range(L)] for b in range(B)]
    return adv, ret


def test_gamma_lambda_one_is_return_minus_value():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    v = torch.randn(2, 8, dtype=torch.float64)
    kl = torch.rand(2, 8, dtype=torch.float64)
    r = outcome_token_rewards(torch.tensor([1.0, -0.5]), mask, kl, kl_coef=0.1)
    adv, ret = gae(r, v, mask, 1.0, 1.0)
    G = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1])  # sum of rewards from t on
    m = mask > 0
    assert torch.allclose(adv[m], (G - v)[m], atol=1e-12)
    assert torch.allclose(ret[m], G[m], atol=1e-12)
    assert torch.all(adv[~m] == 0) and torch.all(ret[~m] == 0)


def test_three_tokens_by_hand():
    # one row, three MODEL tokens, reward 1 on the last; gamma=0.9, lam=0.8; V = (0.5, 0.2, 0.4)
    # delta_2 = 1 - 0.4 = 0.6;  A_2 = 0.6
    # delta_1 = 0 + 0.9*0.4 - 0.2 = 0.16;  A_1 = 0.16 + 0.72*0.6 = 0.592
    # delta_0 = 0 + 0.9*0.2 - 0.5 = -0.32;  A_0 = -0.32 + 0.72*0.592 = 0.10624
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64)
    r = outcome_token_rewards(torch.tensor([1.0]), mask)
    assert r.tolist() == [[0.0, 0.0, 1.0]]
    adv, ret = gae(r, v, mask, 0.9, 0.8)
    assert adv[0].tolist() == pytest.approx([0.10624, 0.592, 0.6], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0.60624, 0.792, 1.0], abs=1e-12)


def test_retrieved_span_is_bridged_not_stepped():
    # MODEL, RETRIEVAL x2, MODEL: the first token bootstraps from the value of the token after the
    # documents, discounted once: A_0 = gamma*V_3 - V_0 + gamma*lam*A_3, A_3 = 1 - V_3.
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.3, 9.0, -9.0, 0.6]], dtype=torch.float64)  # values on retrieved tokens must not matter
    r = outcome_token_rewards(torch.tensor([1.0]), mask)
    adv, _ = gae(r, v, mask, 0.9, 0.5)
    a3 = 1 - 0.6
    assert adv[0, 3].item() == pytest.approx(a3)
    assert adv[0, 0].item() == pytest.approx(0.9 * 0.6 - 0.3 + 0.45 * a3)
    assert adv[0, 1].item() == adv[0, 2].item() == 0.0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0), (0.5, 1.0)])
def test_vectorised_equals_loop_on_random_masks(seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    B, L = 5, 17
    mask = (torch.rand(B, L, generator=g) > 0.4).float()
    mask[0] = 0  # a row with no trained token
    v = torch.randn(B, L, generator=g, dtype=torch.float64)
    kl = torch.rand(B, L, generator=g, dtype=torch.float64)
    r = outcome_token_rewards(torch.randn(B, generator=g), mask, kl, kl_coef=0.05)
    adv, ret = gae(r, v, mask, gamma, lam)
    ref_adv, ref_ret = loop_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, lam)
    assert np.allclose(adv.numpy(), ref_adv, atol=1e-12)
    assert np.allclose(ret.numpy(), ref_ret, atol=1e-12)
    assert torch.all(adv[0] == 0)


def test_token_rewards_put_the_outcome_on_the_last_trained_token_and_kl_on_every_one():
    mask = torch.tensor([[0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    kl = torch.full((2, 6), 2.0)
    r = outcome_token_rewards(torch.tensor([1.0, 5.0]), mask, kl, kl_coef=0.001)
    assert r[0].tolist() == pytest.approx([0, -0.002, 0, -0.002, 1 - 0.002, 0])
    assert r[1].tolist() == [0.0] * 6  # no trained token: no step for the reward


def test_masked_whiten_is_verl_unbiased_whitening():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = masked_whiten(x, mask)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])  # mean 2.5, unbiased var 5/3
    expect = (vals - 2.5) / math.sqrt(5 / 3 + 1e-8)
    assert w[mask > 0].tolist() == pytest.approx(expect.tolist(), abs=1e-6)
    assert w[:, 2].tolist() == [0.0, 0.0]


def test_value_loss_unclipped_and_clipped_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    R = torch.tensor([[1.0, 0.0, 5.0]])
    v = torch.tensor([[0.1, 0.3, 7.0]], requires_grad=True)
    # within the clip (0.5): plain 0.5 * mean((V - R)^2) over the two trained tokens
    out = value_loss(v, old, R, mask, clip=0.5)
    assert out.loss.item() == pytest.approx(0.5 * ((0.1 - 1) ** 2 + 0.3 ** 2) / 2)
    assert out.metrics["value_clipfrac"] == 0.0
    # V = -0.9 with R = 0: unclipped 0.81, clipped (-0.2)^2 = 0.04 -> max is unclipped
    # V = 0.9 with R = 1: unclipped 0.01, clipped (0.2 - 1)^2 = 0.64 -> the clipped term wins
    v2 = torch.tensor([[0.9, -0.9, 0.0]], requires_grad=True)
    out2 = value_loss(v2, old, R, mask, clip=0.2)
    assert out2.loss.item() == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert out2.metrics["value_clipfrac"] == pytest.approx(0.5)
    out2.loss.backward()
    # the clipped token has no gradient (its winning term is constant in V); the other has (V - R) / n
    assert v2.grad.tolist()[0] == pytest.approx([0.0, 0.5 * 2 * (-0.9) / 2, 0.0])
    # no clip: plain squared error
    out3 = value_loss(v2.detach(), old, R, mask, clip=0.0)
    assert out3.loss.item() == pytest.approx(0.5 * (0.01 + 0.81) / 2)


def test_value_loss_micro_batches_sum_to_the_full_batch():
    g = torch.Generator().manual_seed(3)
    v, old, R = (torch.randn(6, 9, generator=g) for _ in range(3))
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    full = value_loss(v, old, R, mask, 0.2).loss
    n = float(mask.sum())
    parts = value_loss(v[:2], old[:2], R[:2], mask[:2], 0.2, tokens=n).loss + \
        value_loss(v[2:], old[2:], R[2:], mask[2:], 0.2, tokens=n).loss
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_explained_variance():
    mask = torch.ones(1, 4)
    R = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(R, R, mask) == pytest.approx(1.0, abs=1e-5)
    assert explained_variance(torch.zeros_like(R), R, mask) == pytest.approx(0.0, abs=1e-4)


def test_with_gamma_lambda_one_bridging_equals_rag_r1s_recursion_through_retrieved_tokens():
    """RAG-R1's veRL fork ran GAE through every response token (retrieved ones carry a value and no
    reward) and masked only the losses; at gamma = lam = 1 that gives the same advantages and returns
    on every trained token as bridging the spans (the README's claim for configs/rag_r1_tiny.yaml)."""
    g = torch.Generator().manual_seed(11)
    B, L = 4, 15
    mask = (torch.rand(B, L, generator=g) > 0.5).float()
    v = torch.randn(B, L, generator=g, dtype=torch.float64)
    r = outcome_token_rewards(torch.randn(B, generator=g), mask, torch.rand(B, L, generator=g), kl_coef=0.01)
    every = torch.ones_like(mask)  # the old recursion: every position is a step
    adv_old, ret_old = gae(r, v, every, 1.0, 1.0)
    adv, ret = gae(r, v, mask, 1.0, 1.0)
    m = mask > 0
    assert torch.allclose(adv[m], adv_old[m], atol=1e-12) and torch.allclose(ret[m], ret_old[m], atol=1e-12)
    adv_old, _ = gae(r, v, every, 0.9, 0.8)  # ... and not for gamma, lam < 1
    adv, _ = gae(r, v, mask, 0.9, 0.8)
    assert not torch.allclose(adv[m], adv_old[m])
