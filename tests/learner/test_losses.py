"""Losses: PPO-clip boundaries, off-policy corrections, KL, aggregation, V-trace vs RLlib."""
import dataclasses
import math

import pytest
import torch

from sonar.cluster.wire.config import AlgoConfig
from sonar.learner.algo.losses import (AggDenominators, LossInputs, aggregate, entropy_from_logits, kl_estimate,
                                 policy_loss, sft_loss, token_logprobs, vtrace_returns, vtrace_token_advantages)
from sonar.learner.batching import microbatch_loss_scale

torch.set_num_threads(1)
D = torch.float64


def cfg(**kw) -> AlgoConfig:
    return dataclasses.replace(AlgoConfig(), **kw)


def random_case(seed, B=4, L=9, dtype=D, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, L, generator=g) < 0.7).to(dtype)
    mask[0] = 0.0
    mask[1, 0] = 1.0
    mu = -torch.rand(B, L, generator=g, dtype=dtype) * 3
    lp = (mu + (torch.rand(B, L, generator=g, dtype=dtype) - 0.5) * 2 * spread).requires_grad_(True)
    prox = mu + (torch.rand(B, L, generator=g, dtype=dtype) - 0.5) * spread
    adv = torch.randn(B, generator=g, dtype=dtype)[:, None].expand(B, L) * mask
    adv = adv + torch.randn(B, L, generator=g, dtype=dtype) * 0.1 * mask  # token-level variation too
    ref = mu + torch.randn(B, L, generator=g, dtype=dtype) * 0.2
    sw = torch.rand(B, generator=g, dtype=dtype) + 0.5
    # garbage on untrained positions must not leak
    mu = torch.where(mask > 0, mu, torch.full_like(mu, 1e4))
    return dict(lp=lp, mu=mu, prox=prox, adv=adv, mask=mask, ref=ref, sw=sw)


# ------------------------------------------------------------------ python-loop reference

def ref_loss_and_grad(c, A: AlgoConfig, use_prox=True, use_sw=True, use_ref=True):
    """Scalar loops: loss value and analytic dL/dlogp, independent of the vectorised code."""
    lp, mu, prox, adv, mask, ref, sw = (c[k].detach().tolist() if torch.is_tensor(c[k]) else c[k]
                                        for k in ("lp", "mu", "prox", "adv", "mask", "ref", "sw"))
    B, L = len(lp), len(lp[0])
    lo, hi = 1 - A.clip_low, 1 + A.clip_high
    per, dper, kl, dkl = ([[0.0] * L for _ in range(B)] for _ in range(4))
    for b in range(B):
        for t in range(L):
            if mask[b][t] <= 0:
                continue
            a = adv[b][t]
            if A.off_policy == "none":
                old, w = mu[b][t], 1.0
            else:
                old = prox[b][t] if use_prox else lp[b][t]
                w = math.exp(old - mu[b][t])
                if A.off_policy == "tis":
                    w = min(w, A.tis_cap)
                elif w > A.tis_cap:
                    w = 0.0
            r = math.exp(lp[b][t] - old)
            clipped = (a > 0 and r > hi) or (a < 0 and r < lo)
            s = sw[b] if use_sw else 1.0
            per[b][t] = -a * min(max(r, lo), hi) * w * s if clipped else -a * r * w * s
            dper[b][t] = 0.0 if clipped else -a * r * w * s
            d = lp[b][t] - ref[b][t]
            if A.kl_estimator == "k1":
                kl[b][t], dkl[b][t] = d * s, 1.0 * s
            elif A.kl_estimator == "k2":
                kl[b][t], dkl[b][t] = 0.5 * d * d * s, d * s
            else:
                kl[b][t], dkl[b][t] = (math.exp(-d) + d - 1) * s, (1 - math.exp(-d)) * s
    # aggregation weights: loss = sum_bt coef_bt * x_bt
    coef = [[0.0] * L for _ in range(B)]
    ntok = sum(mask[b][t] > 0 for b in range(B) for t in range(L))
    nseq = sum(any(x > 0 for x in mask[b]) for b in range(B))
    for b in range(B):
        nb = sum(x > 0 for x in mask[b])
        for t in range(L):
            if mask[b][t] > 0:
                coef[b][t] = {"token_mean": 1 / max(ntok, 1), "seq_mean_token_mean": 1 / nb / max(nseq, 1),
                              "seq_sum_norm": 1 / (B * A.loss_norm_const)}[A.loss_agg]
    with_kl = A.kl_mode == "loss" and A.kl_coef != 0 and use_ref
    loss = sum(coef[b][t] * (per[b][t] + (A.kl_coef * kl[b][t] if with_kl else 0.0))
               for b in range(B) for t in range(L))
    grad = [[coef[b][t] * (dper[b][t] + (A.kl_coef * dkl[b][t] if with_kl else 0.0)) for t in range(L)]
            for b in range(B)]
    return loss, torch.tensor(grad, dtype=D)


def run(c, A, use_prox=True, use_sw=True, use_ref=True, denominators=None):
    lp = c["lp"]
    lp.grad = None
    out = policy_loss(LossInputs(logprobs=lp, behaviour_logprobs=c["mu"], advantages=c["adv"], mask=c["mask"],
                                 proximal_logprobs=c["prox"] if use_prox else None,
                                 ref_logprobs=c["ref"] if use_ref else None,
                                 sample_weight=c["sw"] if use_sw else None, denominators=denominators), A)
    out.loss.backward()
    return out, lp.grad.clone()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
@pytest.mark.parametrize("off", ["none", "tis", "decoupled"])
def test_ppo_loss_vs_loop(seed, agg, off):
    c = random_case(seed, B=3 + seed, L=5 + 4 * seed)
    for kl_est, kl_coef, use_prox in (("k3", 0.0, True), ("k1", 0.1, False), ("k2", 0.3, True), ("k3", 0.05, True)):
        A = cfg(loss_agg=agg, off_policy=off, kl_estimator=kl_est, kl_coef=kl_coef, loss_norm_const=7.0,
                clip_low=0.1, clip_high=0.15, tis_cap=1.2)
        out, grad = run(c, A, use_prox=use_prox)
        ref_loss, ref_grad = ref_loss_and_grad(c, A, use_prox=use_prox)
        assert math.isclose(out.loss.item(), ref_loss, rel_tol=1e-9, abs_tol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
        assert (grad[c["mask"] == 0] == 0).all()


# ------------------------------------------------------------------ closed forms

@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline", "group_norm", "ppo"])
@pytest.mark.parametrize("off", ["none", "tis", "decoupled", "vtrace"])
def test_ratio_one_is_plain_policy_gradient(name, off):
    torch.manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    lp = (-torch.rand(3, 6)).requires_grad_(True)
    mu = lp.detach().clone()
    adv = torch.tensor([[0, 2.0, 2.0, 0, 2.0, 0], [-1.5, -1.5, 0, 0, 0, 0], [0] * 6])
    out = policy_loss(LossInputs(lp, mu, adv, mask), cfg(name=name, off_policy=off, loss_agg="token_mean"))
    out.loss.backward()
    torch.testing.assert_close(lp.grad, -adv / mask.sum())
    assert out.metrics["clip_fraction"] == 0.0
    assert abs(out.metrics["approx_kl"]) < 1e-7
    assert out.metrics["is_weight_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("name, agg, denominator", [
    ("dr_grpo", None, 3 * 7.0),               # Dr.GRPO selects seq_sum_norm: B x loss_norm_const
    ("dr_grpo", "token_mean", 5.0),           # an explicit value is honoured
    ("grpo", None, 5.0),                      # the others default to token_mean over the 5 trained tokens
    ("reinforce_pp_baseline", None, 5.0),
])
def test_unset_loss_agg_is_the_algorithms_default(name, agg, denominator):
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    lp = (-torch.rand(3, 6, generator=torch.Generator().manual_seed(1))).requires_grad_(True)
    adv = torch.tensor([[0, 2.0, 2.0, 0, 2.0, 0], [-1.5, -1.5, 0, 0, 0, 0], [0] * 6])
    out = policy_loss(LossInputs(lp, lp.detach().clone(), adv, mask),
                      cfg(name=name, loss_agg=agg, loss_norm_const=7.0, off_policy="none"))
    out.loss.backward()
    torch.testing.assert_close(lp.grad, -adv / denominator)


def exact_bounds():
    """Log-ratios whose exp is exactly representable, and clip values that hit them exactly."""
    r_hi = torch.exp(torch.tensor(0.25, dtype=D))
    r_lo = torch.exp(torch.tensor(-0.3, dtype=D))
    # Sterbenz: r - 1 and 1 - r are exact, so 1 + clip_high == r_hi and 1 - clip_low == r_lo
    return 0.25, -0.3, float(r_hi) - 1.0, 1.0 - float(r_lo)


def test_clip_engages_exactly_outside_bounds():
    x_hi, x_lo, clip_high, clip_low = exact_bounds()
    tiny = 1e-9
    # (log ratio, advantage, clipped?)
    cases = [
        (x_hi, 1.0, False), (x_hi + tiny, 1.0, True), (x_hi - tiny, 1.0, False),
        (x_lo, -1.0, False), (x_lo - tiny, -1.0, True), (x_lo + tiny, -1.0, False),
        (x_hi + 0.5, -1.0, False),  # A < 0, ratio above: unclipped (pessimistic bound)
        (x_lo - 0.5, 1.0, False),   # A > 0, ratio below: unclipped
        (0.0, 1.0, False), (0.0, -1.0, False),
    ]
    mu = torch.zeros(1, len(cases), dtype=D)
    lp = torch.tensor([[c[0] for c in cases]], dtype=D, requires_grad=True)
    adv = torch.tensor([[c[1] for c in cases]], dtype=D)
    mask = torch.ones_like(mu)
    out = policy_loss(LossInputs(lp, mu, adv, mask), cfg(off_policy="none", clip_low=clip_low, clip_high=clip_high))
    out.loss.backward()
    n = len(cases)
    for i, (x, a, clipped) in enumerate(cases):
        g = lp.grad[0, i].item()
        if clipped:
            assert g == 0.0, (i, x, a)
        else:
            assert g == pytest.approx(-a * math.exp(x) / n, rel=1e-12), (i, x, a)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / n)


def test_clip_is_asymmetric():
    # default bounds [0.8, 1.28]: ratio 1.25 with A > 0 is inside (a symmetric 0.2 clip would cut it)
    A = cfg(off_policy="none", clip_low=0.2, clip_high=0.28)
    ratios = torch.tensor([[1.25, 1.30, 0.81, 0.79]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=D)
    lp = ratios.log().requires_grad_(True)
    out = policy_loss(LossInputs(lp, torch.zeros_like(ratios), adv, torch.ones_like(ratios)), A)
    out.loss.backward()
    assert [g != 0 for g in lp.grad[0].tolist()] == [True, False, True, False]
    # clipped tokens keep the clipped value in the loss: -A * bound
    expect = (-1.25 - 1.28 + 0.81 + 0.80) / 4
    assert out.loss.item() == pytest.approx(expect, rel=1e-12)


def test_dual_clip_caps_a_negative_advantages_loss_at_minus_a_times_c():
    """veRL's dual clip (clip_ratio_c = 3): for A < 0 the loss is min(max(-A r, -A clip(r)), -A c).
    Hand values with clip [0.8, 1.28], c = 3: r = 5, A = -1 -> 3 (constant: no gradient); r = 2, A = -1
    -> 2 (gradient -A r / n = 2/4); r = 5, A = +1 -> -1.28 (the ordinary clip; dual clip is for A < 0
    only); r = 0.5, A = -1 -> 0.8 (clipped below, no gradient)."""
    ratios = torch.tensor([[5.0, 2.0, 5.0, 0.5]], dtype=D)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=D)
    A = cfg(off_policy="none", clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    lp = ratios.log().requires_grad_(True)
    out = policy_loss(LossInputs(lp, torch.zeros_like(ratios), adv, torch.ones_like(ratios)), A)
    out.loss.backward()
    assert out.loss.item() == pytest.approx((3.0 + 2.0 - 1.28 + 0.8) / 4, rel=1e-12)
    assert lp.grad[0].tolist() == pytest.approx([0.0, 2.0 / 4, 0.0, 0.0], abs=1e-12)
    assert out.metrics["dual_clip_fraction"] == pytest.approx(1 / 4)
    # off (the default): the r = 5, A = -1 token keeps its unbounded -A r = 5 and its gradient
    lp2 = ratios.log().requires_grad_(True)
    plain = policy_loss(LossInputs(lp2, torch.zeros_like(ratios), adv, torch.ones_like(ratios)),
                        cfg(off_policy="none", clip_low=0.2, clip_high=0.28))
    plain.loss.backward()
    assert plain.loss.item() == pytest.approx((5.0 + 2.0 - 1.28 + 0.8) / 4, rel=1e-12)
    assert lp2.grad[0, 0].item() == pytest.approx(5.0 / 4, rel=1e-12) and "dual_clip_fraction" not in plain.metrics


def test_entropy_bonus_subtracts_c_times_the_token_mean_entropy_and_its_gradient_flows():
    """veRL's entropy_coeff (Search-R1 / RAG-R1: 0.001): loss = pg_loss - c * masked_mean(H). Hand case:
    two rows of logits over 2 tokens, one trained position each; H(p) = -p log p - (1-p) log(1-p) with
    dH/dz0 = -p(1-p) * (z0 - z1) for softmax([z0, z1]); at z = [0, 0] H = log 2 and the gradient is 0,
    at z = [log 3, 0] p = 3/4."""
    z = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]], dtype=D, requires_grad=True)  # [1, 2, 2]
    ent = entropy_from_logits(torch.cat([z, z[:, :1]], dim=1))[:, :2]  # [1, 2]; the extra step is dropped
    mask = torch.ones(1, 2, dtype=D)
    lp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    A = cfg(off_policy="none", entropy_coef=0.5)
    out = policy_loss(LossInputs(lp, torch.zeros_like(mask), torch.zeros_like(mask), mask, entropy=ent), A)
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    # (entropy_from_logits computes in float32, hence 1e-6)
    assert out.metrics["entropy_loss"] == pytest.approx((math.log(2) + h2) / 2, rel=1e-6)
    assert out.loss.item() == pytest.approx(-0.5 * (math.log(2) + h2) / 2, rel=1e-6)  # advantages 0: pg_loss 0
    out.loss.backward()
    # d(-0.5 * mean H)/dz0 of row 2 = -0.5 / 2 * dH/dz0 = 0.25 * p(1-p) * log 3; row 1 has gradient 0
    assert z.grad[0, 0].tolist() == pytest.approx([0.0, 0.0], abs=1e-7)
    assert z.grad[0, 1, 0].item() == pytest.approx(0.25 * 0.75 * 0.25 * math.log(3.0), rel=1e-6)
    with pytest.raises(ValueError, match="entropy_coef=0.5 needs LossInputs.entropy with its graph"):
        policy_loss(LossInputs(lp, torch.zeros_like(mask), torch.zeros_like(mask), mask, entropy=ent.detach()), A)
    off = policy_loss(LossInputs(lp, torch.zeros_like(mask), torch.zeros_like(mask), mask, entropy=ent.detach()),
                      cfg(off_policy="none"))
    assert off.loss.item() == 0.0 and "entropy_loss" not in off.metrics


def test_k3_is_clamped_at_10_like_verl_at_large_gaps():
    """veRL kl_penalty 'low_var_kl': kl = clamp(ref - logp, -20, 20); clamp(exp(kl) - kl - 1, -10, 10).
    At ref - logp = 11.9 the unclamped k3 is exp(11.9) - 12.9 = 147,253.7 with gradient
    d/dlogp = 1 - exp(11.9) = -147,265.6; clamped: 10, gradient 0. Small gaps are untouched."""
    lp = torch.tensor([-12.0, -1.0], dtype=D, requires_grad=True)
    ref = torch.tensor([-0.1, -1.5], dtype=D)
    raw = kl_estimate(lp, ref, "k3")
    assert raw[0].item() == pytest.approx(math.exp(11.9) - 12.9, rel=1e-12) and raw[0].item() == pytest.approx(147253.7, abs=0.1)
    (g,) = torch.autograd.grad(raw[0], lp)
    assert g[0].item() == pytest.approx(1.0 - math.exp(11.9), rel=1e-12)
    k = kl_estimate(lp, ref, "k3", clamp=10.0)
    assert k[0].item() == 10.0 and k[1].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-12)
    (g,) = torch.autograd.grad(k[0], lp)
    assert g[0].item() == 0.0
    # the loss uses algo.kl_clamp (default 10): the KL term of that token is kl_coef * 10, no gradient from it
    assert AlgoConfig().kl_clamp == 10.0
    lp2 = torch.tensor([[-12.0]], dtype=D, requires_grad=True)
    out = policy_loss(LossInputs(lp2, lp2.detach().clone(), torch.zeros(1, 1, dtype=D), torch.ones(1, 1, dtype=D),
                                 ref_logprobs=torch.tensor([[-0.1]], dtype=D)),
                      cfg(off_policy="none", kl_coef=0.5, kl_mode="loss", kl_estimator="k3"))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.5 * 10.0, rel=1e-12) and lp2.grad.abs().max().item() == 0.0
    unclamped = policy_loss(LossInputs(lp2, lp2.detach().clone(), torch.zeros(1, 1, dtype=D), torch.ones(1, 1, dtype=D),
                                       ref_logprobs=torch.tensor([[-0.1]], dtype=D)),
                            cfg(off_policy="none", kl_coef=0.5, kl_mode="loss", kl_estimator="k3", kl_clamp=None))
    assert unclamped.loss.item() == pytest.approx(0.5 * (math.exp(11.9) - 12.9), rel=1e-12)


def test_empty_mask_zero_loss_zero_grad():
    for agg in ("token_mean", "seq_mean_token_mean", "seq_sum_norm"):
        for off in ("none", "tis", "decoupled", "vtrace"):
            lp = (-torch.rand(2, 5)).requires_grad_(True)
            mu = torch.full((2, 5), -1e4)
            out = policy_loss(LossInputs(lp, mu, torch.randn(2, 5), torch.zeros(2, 5), ref_logprobs=torch.zeros(2, 5)),
                              cfg(loss_agg=agg, off_policy=off, kl_coef=0.1))
            out.loss.backward()
            assert out.loss.item() == 0.0 and not torch.isnan(out.loss)
            assert torch.equal(lp.grad, torch.zeros(2, 5))
    # aggregate on its own, and zero-column tensors
    x = torch.randn(3, 0, requires_grad=True)
    assert aggregate(x, torch.zeros(3, 0), "token_mean").item() == 0.0


def test_gradient_exactly_zero_off_mask_even_with_inf_behaviour():
    c = random_case(7)
    c["mu"] = torch.where(c["mask"] > 0, c["mu"], torch.full_like(c["mu"], -math.inf))
    for off in ("none", "tis", "decoupled", "vtrace"):
        out, grad = run(c, cfg(off_policy=off, kl_coef=0.1))
        assert torch.isfinite(out.loss)
        assert torch.isfinite(grad).all()
        assert (grad[c["mask"] == 0] == 0).all()
        assert (grad[c["mask"] > 0] != 0).any()


def test_tis_cap_and_prox_clip():
    mask = torch.ones(1, 4, dtype=D)
    mu = torch.tensor([[-3.0, -1.0, -1.0, -1.0]], dtype=D)
    prox = torch.tensor([[-1.0, -1.0, -1.1, -1.0]], dtype=D)  # w = e^2 (capped), 1, e^-0.1, 1
    lp = torch.tensor([[-1.0, -1.0, -1.1, -0.5]], dtype=D, requires_grad=True)  # last: ratio e^0.5 vs prox
    adv = torch.ones(1, 4, dtype=D)
    A = cfg(off_policy="tis", tis_cap=2.0)
    out = policy_loss(LossInputs(lp, mu, adv, mask, proximal_logprobs=prox), A)
    out.loss.backward()
    expect = torch.tensor([[-2.0, -1.0, -math.exp(-0.1), 0.0]], dtype=D) / 4
    torch.testing.assert_close(lp.grad, expect)
    assert out.metrics["is_weight_max"] == pytest.approx(2.0)
    assert out.metrics["clip_fraction"] == pytest.approx(0.25)
    # proximal None -> prox = current (ratio 1), weight min(pi/mu, cap)
    lp.grad = None
    out = policy_loss(LossInputs(lp, mu, adv, mask), A)
    out.loss.backward()
    w = torch.minimum(torch.exp(lp.detach() - mu), torch.tensor(2.0, dtype=D))
    torch.testing.assert_close(lp.grad, -w / 4)


def test_decoupled_with_prox_equal_behaviour_is_plain_ppo():
    for seed in range(3):
        c = random_case(seed, spread=0.8)
        c["prox"] = torch.where(c["mask"] > 0, c["mu"], torch.zeros_like(c["mu"]))
        out_d, g_d = run(c, cfg(off_policy="decoupled"))
        out_n, g_n = run(c, cfg(off_policy="none"))
        assert out_d.loss.item() == pytest.approx(out_n.loss.item(), rel=1e-12)
        torch.testing.assert_close(g_d, g_n, rtol=1e-12, atol=0)
        assert out_d.metrics["clip_fraction"] > 0


def test_decoupled_drops_tokens_over_cap():
    mask = torch.ones(1, 3, dtype=D)
    mu = torch.tensor([[-4.0, -1.0, -1.0]], dtype=D)  # w = e^3 > cap: dropped (tis would truncate)
    lp = torch.full((1, 3), -1.0, dtype=D, requires_grad=True)
    out = policy_loss(LossInputs(lp, mu, torch.ones(1, 3, dtype=D), mask), cfg(off_policy="decoupled", tis_cap=5.0))
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1 / 3, -1 / 3]], dtype=D))
    assert out.metrics["is_dropped_fraction"] == pytest.approx(1 / 3)


def test_sample_weight_and_kl_modes():
    c = random_case(3)
    A = cfg(off_policy="none", kl_coef=0.2, kl_estimator="k3")
    out_w, g_w = run(c, A, use_sw=True)
    c2 = dict(c, sw=torch.ones_like(c["sw"]))
    out_1, g_1 = run(c2, A, use_sw=True)
    # with token_mean, weighting sequence b scales its gradient rows by sw[b]
    torch.testing.assert_close(g_w, g_1 * c["sw"][:, None])
    # reward mode adds nothing to the loss; coef 0 skips KL even without a reference
    out_r, _ = run(c, cfg(off_policy="none", kl_coef=0.2, kl_mode="reward"), use_ref=False)
    out_0, _ = run(c, cfg(off_policy="none", kl_coef=0.0), use_ref=False)
    assert out_r.metrics["kl_loss"] == 0.0 and out_r.loss.item() == pytest.approx(out_0.loss.item())
    with pytest.raises(ValueError, match="ref_logprobs"):
        run(c, A, use_ref=False)


def test_kl_estimators_closed_form():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=D)
    ref = torch.tensor([-1.5, -2.0, -0.1], dtype=D)
    d = lp - ref
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), 0.5 * d ** 2)
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), torch.exp(ref - lp) - (ref - lp) - 1)
    assert (kl_estimate(lp, ref, "k3") >= 0).all() and kl_estimate(lp, lp, "k3").abs().max() == 0
    # k3 is unbiased for KL(p || q) under samples from p
    p = torch.tensor([0.7, 0.2, 0.1], dtype=D)
    q = torch.tensor([0.3, 0.3, 0.4], dtype=D)
    exact = (p * (p / q).log()).sum()
    est = (p * kl_estimate(p.log(), q.log(), "k3")).sum()
    torch.testing.assert_close(est, exact)
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k4")


# ------------------------------------------------------------------ aggregation

def ref_aggregate(x, m, mode, norm):
    B, L = len(x), len(x[0])
    if mode == "token_mean":
        n = sum(m[b][t] for b in range(B) for t in range(L))
        return sum(x[b][t] * m[b][t] for b in range(B) for t in range(L)) / max(n, 1)
    if mode == "seq_mean_token_mean":
        means = [sum(x[b][t] * m[b][t] for t in range(L)) / sum(m[b]) for b in range(B) if sum(m[b]) > 0]
        return sum(means) / max(len(means), 1)
    return sum(x[b][t] * m[b][t] for b in range(B) for t in range(L)) / (B * norm)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
def test_aggregate_vs_loop(seed, mode):
    g = torch.Generator().manual_seed(seed)
    B, L = 1 + seed * 2, 3 + seed * 5
    m = (torch.rand(B, L, generator=g) < 0.5).to(D)
    m[-1] = 0
    x = torch.randn(B, L, generator=g, dtype=D)
    x = torch.where(m > 0, x, torch.full_like(x, math.nan))  # NaN off-mask must not leak
    got = aggregate(x, m, mode, norm_const=3.0).item()
    assert got == pytest.approx(ref_aggregate(torch.nan_to_num(x).tolist(), m.tolist(), mode, 3.0), rel=1e-12)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
@pytest.mark.parametrize("off", ["none", "tis", "vtrace"])
def test_data_parallel_shards_give_global_loss_and_gradient(mode, off):
    c = random_case(11, B=6, L=10)
    A = cfg(loss_agg=mode, off_policy=off, kl_coef=0.1, loss_norm_const=5.0)
    full, g_full = run(c, A)
    world = 2
    shards = [[0, 3, 4], [1, 2, 5]]  # uneven token counts
    # global counts = sum of the shards' counts (an all_reduce(SUM) in a real run)
    denoms = [AggDenominators.from_mask(c["mask"][s]) for s in shards]
    glob = denoms[0] + denoms[1]
    assert glob == AggDenominators.from_mask(c["mask"])
    losses, grads = [], []
    for s in shards:
        lp = c["lp"].detach()[s].clone().requires_grad_(True)
        inp = LossInputs(lp, c["mu"][s], c["adv"][s], c["mask"][s], proximal_logprobs=c["prox"][s],
                         ref_logprobs=c["ref"][s], sample_weight=c["sw"][s], denominators=glob)
        out = policy_loss(inp, A)
        (out.loss * microbatch_loss_scale(dp_world_size=world)).backward()
        losses.append(out.loss.item() * world)
        g = torch.zeros_like(c["lp"])
        g[s] = lp.grad
        grads.append(g)
    # DP averages: mean over ranks of (scaled) losses and gradients == global
    assert sum(losses) / world == pytest.approx(full.loss.item(), rel=1e-12)
    torch.testing.assert_close(sum(grads) / world, g_full, rtol=1e-12, atol=1e-15)
    # without the global denominators (each shard normalised by its own count) it would differ
    if mode != "seq_sum_norm":  # equal rows per shard make seq_sum_norm shard-invariant anyway
        own = [policy_loss(LossInputs(c["lp"].detach()[s], c["mu"][s], c["adv"][s], c["mask"][s],
                                      proximal_logprobs=c["prox"][s], ref_logprobs=c["ref"][s],
                                      sample_weight=c["sw"][s]), A).loss.item() for s in shards]
        assert sum(own) / world != pytest.approx(full.loss.item(), rel=1e-6)


# ------------------------------------------------------------------ V-trace

def loop_vtrace(log_rhos, discounts, rewards, values, bootstrap, rho_bar, pg_rho_bar, c_bar):
    """IMPALA paper, direct sum form: v_s = V_s + sum_t (prod_{i<t} gamma_i c_i) delta_t."""
    B, T = len(log_rhos), len(log_rhos[0])
    vs = [[0.0] * T for _ in range(B)]
    pg = [[0.0] * T for _ in range(B)]
    for b in range(B):
        V = values[b] + [bootstrap[b]]
        rho = [math.exp(x) for x in log_rhos[b]]
        for s in range(T):
            acc, prod = 0.0, 1.0
            for t in range(s, T):
                delta = min(rho_bar, rho[t]) * (rewards[b][t] + discounts[b][t] * V[t + 1] - V[t])
                acc += prod * delta
                prod *= discounts[b][t] * min(c_bar, rho[t])
            vs[b][s] = V[s] + acc
        for s in range(T):
            v_next = vs[b][s + 1] if s + 1 < T else bootstrap[b]
            pg[b][s] = min(pg_rho_bar, rho[s]) * (rewards[b][s] + discounts[b][s] * v_next - V[s])
    return torch.tensor(vs, dtype=D), torch.tensor(pg, dtype=D)


def vtrace_inputs(seed, B, T):
    g = torch.Generator().manual_seed(seed)
    log_rhos = torch.randn(B, T, generator=g, dtype=D) * 0.7
    discounts = (torch.rand(B, T, generator=g) > 0.1).to(D) * 0.97
    rewards = torch.randn(B, T, generator=g, dtype=D)
    values = torch.randn(B, T, generator=g, dtype=D)
    bootstrap = torch.randn(B, generator=g, dtype=D)
    return log_rhos, discounts, rewards, values, bootstrap


@pytest.mark.parametrize("seed,B,T", [(0, 1, 1), (1, 3, 7), (2, 5, 16), (3, 2, 33)])
def test_vtrace_matches_rllib(seed, B, T):
    from ray.rllib.algorithms.impala.vtrace_torch import from_importance_weights
    from ray.rllib.algorithms.impala.torch.vtrace_torch_v2 import vtrace_torch

    log_rhos, discounts, rewards, values, bootstrap = vtrace_inputs(seed, B, T)
    for rho_bar, pg_bar in ((1.0, 1.0), (0.8, 1.3), (None, None)):
        ours = vtrace_returns(log_rhos, discounts, rewards, values, bootstrap, rho_bar, pg_bar, clip_c_threshold=1.0)
        # RLlib is TIME-major [T, B]
        tm = lambda x: x.transpose(0, 1).contiguous()  # noqa: E731
        theirs = from_importance_weights(tm(log_rhos), tm(discounts), tm(rewards), tm(values), bootstrap,
                                         clip_rho_threshold=rho_bar, clip_pg_rho_threshold=pg_bar)
        # from_importance_weights converts its inputs to float32
        torch.testing.assert_close(ours.vs.float(), tm(theirs.vs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.pg_advantages.float(), tm(theirs.pg_advantages), rtol=1e-5, atol=1e-5)
        vs2, pg2 = vtrace_torch(target_action_log_probs=tm(log_rhos), behaviour_action_log_probs=torch.zeros(T, B, dtype=D),
                                discounts=tm(discounts), rewards=tm(rewards), values=tm(values),
                                bootstrap_values=bootstrap, clip_rho_threshold=rho_bar, clip_pg_rho_threshold=pg_bar)
        torch.testing.assert_close(ours.vs, tm(vs2), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ours.pg_advantages, tm(pg2), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("c_bar", [0.5, 1.0, 2.0])
def test_vtrace_matches_paper_loop(c_bar):
    log_rhos, discounts, rewards, values, bootstrap = vtrace_inputs(5, 3, 9)
    ours = vtrace_returns(log_rhos, discounts, rewards, values, bootstrap, 1.1, 0.9, clip_c_threshold=c_bar)
    vs, pg = loop_vtrace(*(x.tolist() for x in (log_rhos, discounts, rewards, values, bootstrap)), 1.1, 0.9, c_bar)
    torch.testing.assert_close(ours.vs, vs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.pg_advantages, pg, rtol=1e-10, atol=1e-10)


def test_vtrace_token_advantages_on_policy_and_off_policy():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]], dtype=D)
    adv = torch.tensor([0.7, -0.4], dtype=D)[:, None] * mask
    mu = -torch.rand(2, 8, dtype=D)
    # on-policy: pg advantages == A
    out = vtrace_token_advantages(mu, mu, adv, mask, 1.0, 1.0)
    torch.testing.assert_close(out.pg_advantages, adv)
    torch.testing.assert_close(out.vs, adv)
    # off-policy, constant A per sequence: pg_s = rho_s * prod_{s<i<last} c_i * rho_last * A
    g = torch.Generator().manual_seed(0)
    lp = mu + torch.randn(2, 8, generator=g, dtype=D) * 0.5
    rho_bar, c_bar = 1.0, 0.9
    out = vtrace_token_advantages(lp, mu, adv, mask, rho_bar, c_bar)
    rho = torch.exp(lp - mu)
    for b in range(2):
        idx = [t for t in range(8) if mask[b, t] > 0]
        last = idx[-1]
        for s in idx:
            expect = min(rho_bar, rho[b, last].item()) * adv[b, s].item()
            for i in idx:
                if s < i < last:
                    expect *= min(c_bar, rho[b, i].item())
            if s < last:
                expect *= min(rho_bar, rho[b, s].item())
            assert out.pg_advantages[b, s].item() == pytest.approx(expect, rel=1e-10), (b, s)
    assert (out.pg_advantages[mask == 0] == 0).all()


def test_vtrace_policy_loss_gradient():
    c = random_case(4, spread=0.8)
    A = cfg(off_policy="vtrace", vtrace_rho_bar=1.0, vtrace_c_bar=1.0)
    out, grad = run(c, A, use_sw=False)
    vt = vtrace_token_advantages(c["lp"], c["mu"], c["adv"], c["mask"], 1.0, 1.0)
    torch.testing.assert_close(grad, -vt.pg_advantages / c["mask"].sum())
    assert 0 < out.metrics["clip_fraction"] < 1


# ------------------------------------------------------------------ SFT, logprobs, entropy

def test_sft_loss():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [1, 0, 0.0]])
    out = sft_loss(lp, mask)
    assert out.loss.item() == pytest.approx((2 + 3 + 4) / 3)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, -mask / 3)
    assert sft_loss(lp, torch.zeros(2, 3)).loss.item() == 0.0


def test_token_logprobs_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    for temp in (1.0, 0.7):
        lp = token_logprobs(logits, ids, temp)
        ref = torch.log_softmax(logits / temp, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(lp, ref)
        ent = entropy_from_logits(logits, temp)
        torch.testing.assert_close(ent, torch.distributions.Categorical(logits=logits[:, :-1] / temp).entropy())
    banned = logits.clone()
    banned[..., 0] = -math.inf
    banned.requires_grad_(True)
    ent = entropy_from_logits(banned)
    ent.sum().backward()
    assert torch.isfinite(ent).all() and torch.isfinite(banned.grad).all()
    with pytest.raises(ValueError):
        token_logprobs(logits, ids, 0.0)
