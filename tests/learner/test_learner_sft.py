"""The learner actor's SFT path, in process (no Ray): it loads the policy from the run's directory,
trains on the demonstrations it is given, takes the learning rate from the stage alone, and a
checkpoint taken mid-stage resumes to bit-identical weights (optimizer, LR schedule, data order)."""
import numpy as np
import pytest
import torch

from sonar.cluster.wire.config import load_config
from sonar.cluster.wire.protocol import FinishReason, Segment, SegmentKind, Trajectory, encode_group
from sonar.learner.deepspeed_config import lr_at


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from sonar.actors.model import materialise_policy
    from sonar.actors.world import build_world
    from sonar.cluster.wire.config import ModelConfig, WorldConfig

    small = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=64)
    return materialise_policy(small, build_world(WorldConfig(num_entities=40)), tmp_path_factory.mktemp("p") / "policy")


def demos(n=10, vocab=60, seed=0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        segs = [Segment(SegmentKind.PROMPT, rng.integers(4, vocab, 5)),
                Segment(SegmentKind.MODEL, rng.integers(4, vocab, 3), np.zeros(3, np.float32), -1),
                Segment(SegmentKind.RETRIEVAL, rng.integers(4, vocab, 4)),
                Segment(SegmentKind.MODEL, rng.integers(4, vocab, 2 + i % 3), np.zeros(2 + i % 3, np.float32), -1)]
        out.append(encode_group([Trajectory(f"d{i}", f"d{i}", f"q{i}", -1, segs, reward=1.0,
                                            finish_reason=FinishReason.ANSWERED)]))
    return out


def learner(policy):
    from tests.learner.test_train_step import init_deepspeed

    init_deepspeed()
    from sonar.learner.worker import Learner

    cfg = load_config([], ["learner.warmup_steps=3", "stages=[{kind: sft, steps: 8, lr: 0.01, batch_size: 4}]"])
    return cfg, Learner(cfg, str(policy))


def weights(lrn) -> dict:
    return {k: v.clone() for k, v in lrn.named_tensors().items()}


def test_sft_needs_demonstrations(policy):
    cfg, a = learner(policy)
    with pytest.raises(ValueError, match="without demonstrations"):
        a.begin_stage(0, cfg.stages[0])


def test_trains_on_given_demos_with_the_stage_lr_and_resumes_exactly(policy, tmp_path):
    cfg, a = learner(policy)
    stage = cfg.stages[0]
    assert a.pad_id == a.tokenizer.pad_token_id == 0  # from the policy's tokenizer
    start = weights(a)
    assert a.begin_stage(0, stage, 0, demos())["demonstrations"] == 10
    lrs = [a.sft_step(stage)["learner/lr"] for _ in range(3)]
    assert lrs == [lr_at(s, 0.01, 3, "constant", 8) for s in range(3)] == [0.01 / 3, 0.02 / 3, 0.01]
    assert any(not torch.equal(start[k], v) for k, v in weights(a).items())  # it learned
    a.save_checkpoint(str(tmp_path / "ckpt"), {})
    for _ in range(3):  # crosses the epoch boundary (10 demos, 4 per step)
        a.sft_step(stage)
    expected = weights(a)

    _, b = learner(policy)
    assert any(not torch.equal(expected[k], v) for k, v in weights(b).items())
    b.load_checkpoint(str(tmp_path / "ckpt"))
    b.begin_stage(0, stage, 3, demos())  # the driver rebuilds the same demonstrations
    for _ in range(3):
        b.sft_step(stage)
    got = weights(b)
    assert all(torch.equal(expected[k], got[k]) for k in expected), "a resumed SFT stage diverged"
