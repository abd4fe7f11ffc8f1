"""A stage with a KL term resumed mid-stage keeps the stage's KL reference (the policy at the stage's
start), not the resumed weights: the checkpoint carries it, and the resumed run equals the uninterrupted
one bit for bit. A checkpoint without it is refused, naming the file."""
from __future__ import annotations

import pytest
import torch

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import load_config
from sonar.learner.worker import REFERENCE_FILE
from tests.learner.test_critic import singleton_groups, state
from tests.learner.test_learner_sft import policy  # noqa: F401  (module fixture: a tiny policy directory)


def kl_learner(policy):
    from tests.learner.test_train_step import init_deepspeed

    init_deepspeed()
    from sonar.learner.worker import Learner

    cfg = load_config([], ["learner.warmup_steps=0", "rollout.group_size=1", "critic.warmup_steps=0",
                           "stages=[{kind: rl, steps: 8, lr: 0.003, algo: {name: ppo, kl_coef: 0.5, "
                           "kl_mode: reward, kl_estimator: k1}}]"])
    return cfg, Learner(cfg, str(policy))


def _steps(lrn, stage, seeds):
    for s in seeds:
        m = lrn.train_groups(singleton_groups(s, version=lrn.version), [0] * 6, stage)
        lrn._finish_step(m, m.pop(K.LEARNER_LR))


def test_a_resumed_kl_stage_keeps_the_stage_start_reference(policy, tmp_path):  # noqa: F811
    cfg, a = kl_learner(policy)
    stage = cfg.stages[0]
    a.begin_stage(0, stage)
    start = {k: v.clone() for k, v in a.ref_module.state_dict().items()}
    _steps(a, stage, (0,))
    a.save_checkpoint(str(tmp_path / "ckpt"), {})
    assert (tmp_path / "ckpt" / REFERENCE_FILE).is_file()
    _steps(a, stage, (1, 2))
    expected = state(a)

    _, b = kl_learner(policy)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    b.begin_stage(0, stage, b.stage_step)
    ref = b.ref_module.state_dict()
    assert all(torch.equal(ref[k], start[k]) for k in start)          # the stage's start, not step 1's
    assert any(not torch.equal(v, ref[k]) for k, v in b.named_tensors().items() if k in ref)
    _steps(b, stage, (1, 2))
    got = state(b)
    diverged = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not diverged, f"a resumed KL stage diverged in {diverged[:5]}"


def test_a_checkpoint_without_the_reference_is_refused(policy, tmp_path):  # noqa: F811
    cfg, a = kl_learner(policy)
    stage = cfg.stages[0]
    a.begin_stage(0, stage)
    _steps(a, stage, (0,))
    a.save_checkpoint(str(tmp_path / "ckpt"), {})
    (tmp_path / "ckpt" / REFERENCE_FILE).unlink()
    _, b = kl_learner(policy)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=REFERENCE_FILE):
        b.begin_stage(0, stage, b.stage_step)
