"""Batching: collate alignment, gradient only on MODEL tokens, micro-batch packing and equivalence."""
import dataclasses

import numpy as np
import pytest
import torch

from sonar.cluster.wire.config import AlgoConfig
from sonar.cluster.wire.protocol import Segment, SegmentKind, Trajectory
from sonar.learner.algo.advantages import compute_advantages
from sonar.learner.algo.losses import LossInputs, policy_loss, token_logprobs
from sonar.learner.batching import Batch, collate, microbatch_loss_scale, pack_micro_batches

torch.set_num_threads(1)
P, M, R = SegmentKind.PROMPT, SegmentKind.MODEL, SegmentKind.RETRIEVAL


def seg(kind, ids, version=3, lp=None):
    ids = np.asarray(ids, dtype=np.int32)
    if kind == M:
        lp = np.asarray(lp if lp is not None else -0.1 * (np.arange(len(ids)) + 1), dtype=np.float32)
        return Segment(kind, ids, lp, version)
    return Segment(kind, ids)


def traj(tid, gid, segments, reward=0.0, weight=1.0):
    return Trajectory(traj_id=tid, group_id=gid, prompt_id="p", actor_id=0, segments=segments, reward=reward,
                      weight=weight)


def hand_built():
    # tokens: P P P | M M | R R R | M M
    return traj("a", "g0", [seg(P, [11, 12, 13]), seg(M, [21, 22], 4, [-0.5, -0.6]), seg(R, [31, 32, 33]),
                            seg(M, [41, 42], 5, [-0.7, -0.8])], reward=1.0, weight=0.5)


def test_collate_alignment_hand_built():
    t = hand_built()
    short = traj("b", "g1", [seg(P, [1, 2]), seg(M, [3], 6, [-0.9])], reward=0.0)
    third = traj("c", "g0", [seg(P, [7]), seg(M, [8, 9], 2)], reward=1.0)
    b = collate([t, short, third], advantages_per_traj=[0.5, -1.0, 2.0], pad_id=99)
    assert b.input_ids.shape == (3, 10) and b.loss_mask.shape == (3, 9)
    assert b.input_ids[0].tolist() == [11, 12, 13, 21, 22, 31, 32, 33, 41, 42]
    assert b.input_ids[1].tolist() == [1, 2, 3] + [99] * 7
    assert b.attention_mask[1].tolist() == [1, 1, 1] + [0] * 7
    # column t <-> token t+1: trained iff token t+1 is MODEL
    assert b.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert b.loss_mask[1].tolist() == [0, 1] + [0] * 7
    assert b.loss_mask[2].tolist() == [1, 1] + [0] * 7
    torch.testing.assert_close(b.behaviour_logprobs[0], torch.tensor([0, 0, -0.5, -0.6, 0, 0, 0, -0.7, -0.8]))
    assert b.behaviour_logprobs[1].tolist()[:2] == [0.0, pytest.approx(-0.9)]
    assert b.versions[0].tolist() == [-1, -1, 4, 4, -1, -1, -1, 5, 5]
    assert b.min_versions.tolist() == [4, 6, 2]
    assert b.group_index.tolist() == [0, 1, 0]
    assert b.rewards.tolist() == [1.0, 0.0, 1.0] and b.sample_weight.tolist() == [0.5, 1.0, 1.0]
    assert b.lengths.tolist() == [10, 3, 3]
    assert b.advantages[0].tolist() == [0, 0, 0.5, 0.5, 0, 0, 0, 0.5, 0.5]
    assert b.advantages[1].tolist() == [0, -1.0] + [0] * 7
    # consistency with the protocol's own views
    assert b.loss_mask[0].tolist() == t.loss_mask()[1:].tolist()
    sub = b.select([1, 2])
    assert sub.input_ids.shape == (2, 3) and sub.loss_mask.shape == (2, 2) and sub.traj_ids == ["b", "c"]
    assert sub.advantages.tolist() == [[0, -1.0], [2.0, 2.0]]
    with pytest.raises(ValueError):
        collate([], None, 0)


def test_gradient_only_on_model_tokens_through_logits():
    """Prompt, retrieval and padding tokens get exactly zero gradient, at the logits and the logprobs."""
    torch.manual_seed(0)
    trajs = [hand_built(), traj("b", "g0", [seg(P, [1, 2]), seg(M, [3, 4], 4), seg(R, [5]), seg(M, [6], 5)], reward=0.0)]
    b = collate(trajs, None, pad_id=0)
    V = 50
    logits = torch.randn(2, b.input_ids.shape[1], V, requires_grad=True)
    adv = compute_advantages("grpo", b.rewards, b.group_index, b.loss_mask)
    for off in ("none", "tis", "decoupled", "vtrace"):
        logits.grad = None
        lp = token_logprobs(logits, b.input_ids, temperature=0.8)
        lp.retain_grad()
        A = dataclasses.replace(AlgoConfig(), off_policy=off, kl_coef=0.1)
        out = policy_loss(LossInputs(lp, b.behaviour_logprobs, adv, b.loss_mask,
                                     ref_logprobs=lp.detach() - 0.1, sample_weight=b.sample_weight), A)
        out.loss.backward()
        off_mask = b.loss_mask == 0
        assert (lp.grad[off_mask] == 0).all() and (lp.grad[~off_mask] != 0).all()
        # logits row t predicts token t+1: rows whose next token is untrained get no gradient, and the
        # last position (predicts nothing) never does
        pred_rows_grad = logits.grad[:, :-1].abs().sum(-1)
        assert (pred_rows_grad[off_mask] == 0).all() and (pred_rows_grad[~off_mask] > 0).all()
        assert (logits.grad[:, -1] == 0).all()


def test_learner_logprobs_match_behaviour_when_same_temperature():
    """Behaviour logprobs from the same logits at the same temperature give ratio 1 (no clip, no KL)."""
    torch.manual_seed(1)
    t = hand_built()
    ids = torch.from_numpy(t.token_ids().astype(np.int64))[None]
    logits = torch.randn(1, ids.shape[1], 60)
    lp = token_logprobs(logits, ids, 0.7)[0]
    # write those logprobs into the MODEL segments (token k sits at column k-1)
    t.segments[1].logprobs = lp[2:4].numpy().copy()
    t.segments[3].logprobs = lp[7:9].numpy().copy()
    b = collate([t], [1.0])
    out = policy_loss(LossInputs(token_logprobs(logits, b.input_ids, 0.7).requires_grad_(True), b.behaviour_logprobs,
                                 b.advantages, b.loss_mask), dataclasses.replace(AlgoConfig(), off_policy="none"))
    assert out.metrics["approx_kl"] < 1e-10 and out.metrics["clip_fraction"] == 0.0
    assert out.metrics["ratio_max"] == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------ micro-batches

def test_pack_micro_batches_budget_and_determinism():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=37).tolist() + [200]
    budget = 128
    mbs = pack_micro_batches(lengths, budget)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    for mb in mbs:
        cost = max(lengths[i] for i in mb) * len(mb)
        assert cost <= budget or len(mb) == 1
    assert [37] in mbs  # oversize alone
    assert mbs == pack_micro_batches(lengths, budget)
    flat = [lengths[i] for mb in mbs for i in mb]
    assert flat == sorted(flat, reverse=True)
    assert pack_micro_batches([], 10) == []
    assert pack_micro_batches([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        pack_micro_batches([1], 0)


def random_trajs(seed, n=9):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        segs = [seg(P, rng.integers(1, 30, rng.integers(2, 6)))]
        for turn in range(rng.integers(1, 4)):
            if turn:
                segs.append(seg(R, rng.integers(1, 30, rng.integers(1, 8))))
            k = int(rng.integers(1, 7))
            segs.append(seg(M, rng.integers(1, 30, k), int(rng.integers(0, 3)), -rng.random(k) * 2))
        out.append(traj(f"t{i}", f"g{i // 3}", segs, reward=float(rng.integers(0, 2)), weight=float(rng.random() + 0.5)))
    return out


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
@pytest.mark.parametrize("off", ["none", "tis", "vtrace"])
def test_micro_batches_sum_to_full_batch_gradient(agg, off):
    trajs = random_trajs(3)
    b = collate(trajs, None, pad_id=0)
    adv = compute_advantages("grpo", b.rewards, b.group_index, b.loss_mask, True)
    A = dataclasses.replace(AlgoConfig(), loss_agg=agg, off_policy=off, kl_coef=0.05, loss_norm_const=20.0)
    g = torch.Generator().manual_seed(0)
    base = (b.behaviour_logprobs + 0.3 * torch.randn(b.loss_mask.shape, generator=g, dtype=torch.float64).float())
    ref = base.detach() - 0.2
    base = base.double()

    def inputs(lp, rows, batch, denominators=None):
        L = batch.loss_mask.shape[1]
        return LossInputs(lp, batch.behaviour_logprobs.double(), adv[rows, :L].double(), batch.loss_mask.double(),
                          ref_logprobs=ref[rows, :L].double(), sample_weight=batch.sample_weight.double(),
                          denominators=denominators)

    leaf = base.clone().requires_grad_(True)
    full = policy_loss(inputs(leaf, list(range(b.size)), b), A)
    full.loss.backward()
    g_full = leaf.grad.clone()

    leaf.grad = None
    total = 0.0
    mbs = pack_micro_batches(trajs, token_budget=40)
    assert len(mbs) > 2
    denoms = b.denominators()
    for mb in mbs:
        sub = b.select(mb)
        L = sub.loss_mask.shape[1]
        out = policy_loss(inputs(leaf[mb, :L], mb, sub, denoms), A)
        (out.loss * microbatch_loss_scale(1, 1)).backward()
        total += out.loss.item()
    assert total == pytest.approx(full.loss.item(), rel=1e-10)
    torch.testing.assert_close(leaf.grad, g_full, rtol=1e-10, atol=1e-13)
    assert (leaf.grad[b.loss_mask == 0] == 0).all()


def test_microbatch_loss_scale():
    assert microbatch_loss_scale() == 1.0
    assert microbatch_loss_scale(dp_world_size=4, grad_accum_steps=3) == 12.0
    with pytest.raises(ValueError):
        microbatch_loss_scale(0)


def test_batch_to_and_types():
    b = collate([hand_built()], None)
    assert isinstance(b, Batch)
    assert b.input_ids.dtype == torch.long and b.loss_mask.dtype == torch.float32
    assert b.behaviour_logprobs.dtype == torch.float32 and b.group_index.dtype == torch.long
    assert b.to("cpu").input_ids.data_ptr() == b.input_ids.data_ptr()
    assert b.advantages is None
