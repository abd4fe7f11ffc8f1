"""``algo.recompute_old_logprobs`` (off_policy none): the PPO ratio's old policy is the learner's own
recomputation of the batch, not the engine's sampling logprobs, and the gap between the two is logged.

On the same weights the two paths train identically and the gap is 0. When the engine reports the
truncated sampler's logprobs (vLLM at top_p < 1: higher than the full distribution's by -log(nucleus
mass)), the sampling path's first update already sees a ratio exp(-shift) and clips, while the recompute
path trains exactly as on exact logprobs; the logged gap is k3 of the shift, exp(-s) + s - 1, a closed form."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import AlgoConfig, LearnerConfig, ReplayConfig
from sonar.cluster.wire.protocol import Segment, SegmentKind, Trajectory
from sonar.learner.algo.losses import token_logprobs
from sonar.learner.batching import collate
from sonar.learner.train_step import TorchStepper, rl_step
from tests.learner.test_train_step import groups, tiny_model

torch.set_num_threads(1)
ON_POLICY = AlgoConfig(off_policy="none", mini_batches=2, clip_low=0.2, clip_high=0.2)


def _with_behaviour(grps, model, shift: float = 0.0):
    """The groups with every MODEL token's sampling logprob set to ``model``'s exact one (+ ``shift``)."""
    out = []
    for g in grps:
        batch = collate(g, None, 0)
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                      use_cache=False).logits.float(), batch.input_ids)
        new_g = []
        for i, t in enumerate(g):
            full = np.concatenate([[0.0], lp[i, :len(t.token_ids()) - 1].numpy()]).astype(np.float32)
            segs, pos = [], 0
            for s in t.segments:
                n = len(s)
                segs.append(Segment(s.kind, s.token_ids, full[pos:pos + n] + shift, s.version)
                            if s.kind == SegmentKind.MODEL else s)
                pos += n
            new_g.append(dataclasses.replace(t, segments=segs))
        out.append(new_g)
    return out


def _train(algo, grps):
    model = tiny_model(0)
    stepper = TorchStepper(model, torch.optim.SGD(model.parameters(), lr=1.0), 0.0)
    m = rl_step(stepper, grps, [0] * len(grps), algo, LearnerConfig(micro_batch_tokens=10_000), ReplayConfig(), 1.0, 0)
    return m, [p.detach().clone() for p in model.parameters()]


def _close(a, b, tol=1e-6):
    return all(torch.allclose(p, q, atol=tol, rtol=0) for p, q in zip(a, b))


def test_on_the_same_weights_both_paths_train_alike_and_the_gap_is_zero():
    exact = _with_behaviour(groups(0), tiny_model(0))
    m_sampled, p_sampled = _train(ON_POLICY, exact)
    m_recomputed, p_recomputed = _train(dataclasses.replace(ON_POLICY, recompute_old_logprobs=True), exact)
    assert m_recomputed[K.LEARNER_SAMPLING_KL_MEAN] == pytest.approx(0.0, abs=1e-7)
    assert m_recomputed[K.LEARNER_SAMPLING_KL_MAX] == pytest.approx(0.0, abs=1e-6)
    assert K.LEARNER_SAMPLING_KL_MEAN not in m_sampled  # no recomputation ran: nothing to compare
    assert m_recomputed[K.LEARNER_OPTIMIZER_STEPS] == 2
    assert _close(p_sampled, p_recomputed)


def test_a_truncated_samplers_logprobs_move_only_the_sampling_path():
    model = tiny_model(0)
    shift = 0.3  # vLLM at top_p < 1: the renormalised nucleus' logprob, -log(mass) above the full one
    exact, shifted = _with_behaviour(groups(0), model), _with_behaviour(groups(0), model, shift)
    recompute = dataclasses.replace(ON_POLICY, recompute_old_logprobs=True)
    _, p_exact = _train(recompute, exact)
    m_rec, p_rec = _train(recompute, shifted)
    m_smp, p_smp = _train(ON_POLICY, shifted)
    assert _close(p_rec, p_exact)  # the learner's own old logprobs: the engine's report changes nothing
    assert not _close(p_smp, p_exact)  # against the engine's: ratio exp(-0.3) = 0.74 from the first update
    assert m_smp[K.LEARNER_LOSS_PART.format(part="clip_fraction")] > 0.0
    k3 = math.exp(-shift) + shift - 1.0  # KL(engine || learner) per token, every token shifted alike
    assert m_rec[K.LEARNER_SAMPLING_KL_MEAN] == pytest.approx(k3, rel=1e-4)
    assert m_rec[K.LEARNER_SAMPLING_KL_MAX] == pytest.approx(k3, rel=1e-4)
