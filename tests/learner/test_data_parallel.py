"""The data-parallel learner (``learner.num_ranks``): two DeepSpeed ranks (processes, gloo on loopback)
take the same update as one rank on the same batch for ZeRO 0-3 (the batch split by token count, the
loss normalised by the global token counts); a 2-rank checkpoint resumes to the uninterrupted next step;
and the splitting helpers keep every collective paired."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonar.learner.batching import collate, shard_rows

ROOT = Path(__file__).resolve().parents[2]


def test_shard_rows_balances_tokens_deterministically():
    # longest first to the least-loaded rank: 9->0, 7->1, 5->1 (7 < 9), 4->0 (12 vs 13)... closed form
    assert shard_rows([4, 9, 5, 7, 1], 2) == [[0, 1], [2, 3, 4]]
    assert shard_rows([4, 9, 5, 7, 1], 1) == [[0, 1, 2, 3, 4]]
    assert shard_rows([3], 2) == [[0], []]
    lengths = [int(x) for x in torch.randint(1, 50, (37,), generator=torch.Generator().manual_seed(0))]
    shards = shard_rows(lengths, 3)
    assert sorted(i for s in shards for i in s) == list(range(37))  # every row once
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)  # LPT bound


def test_rank_micro_batches_pair_up_and_scale_by_world():
    from sonar.learner.train_step import _rank_micro_batches
    from tests.learner.test_train_step import groups

    batch = collate([t for g in groups(seed=3) for t in g], None, 0)
    one, s1 = _rank_micro_batches(batch, 40, "cpu", (0, 1))
    assert s1 == [1.0] * len(one)
    per_rank = [_rank_micro_batches(batch, 40, "cpu", (r, 2)) for r in range(2)]
    assert len(per_rank[0][0]) == len(per_rank[1][0])  # same number of forward/backward passes
    real = [(mb, s) for mbs, sc in per_rank for mb, s in zip(mbs, sc) if s]
    assert all(s == 2.0 for _, s in real)  # DeepSpeed averages over 2 ranks
    assert sorted(i for mb, _ in real for i in mb.traj_ids) == sorted(batch.traj_ids)  # every row once
    assert sum(float(mb.loss_mask.sum()) for mb, _ in real) == float(batch.loss_mask.sum())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Run tests/learner/dp_ranks.py as ranks 0 and 1 of one gloo group (one process each)."""
    from sonar.actors.model import materialise_policy
    from sonar.actors.world import build_world
    from sonar.cluster.wire.config import ModelConfig, WorldConfig
    from sonar.learner.worker import free_port

    tmp = tmp_path_factory.mktemp("dp")
    small = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=64)
    policy = str(materialise_policy(small, build_world(WorldConfig(num_entities=40)), tmp / "policy"))
    out, port = tmp / "rank0.pt", free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.learner.dp_ranks", str(r), "2", str(port), policy, str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    return policy, torch.load(out, weights_only=False)


def one_rank_learner(policy, zero):
    from tests.learner.dp_ranks import config
    from tests.learner.test_train_step import init_deepspeed

    init_deepspeed()
    from sonar.learner.worker import Learner

    cfg = config(zero, 1)
    return cfg, Learner(cfg, policy)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_ranks_take_the_one_rank_update(two_ranks, zero):
    from tests.learner.dp_ranks import batches, weights

    policy, res = two_ranks
    cfg, a = one_rank_learner(policy, zero)
    stage = cfg.stages[0]
    a.begin_stage(0, stage)
    b1, _ = batches()
    start = weights(a)
    m = a.train_groups(b1, [0] * len(b1), stage)
    got = res[zero]
    assert max_diff(start, got["w1"]) > 1e-4  # it moved
    assert max_diff(weights(a), got["w1"]) < 1e-6
    # Adam's first step hardly depends on the gradient's scale: the norm pins the aggregation (a loss
    # averaged instead of summed over the ranks would halve it) and the loss is the whole batch's
    assert got["m1"]["learner/grad_norm"] == pytest.approx(m["learner/grad_norm"], rel=1e-5)
    assert got["m1"]["learner/loss"] == pytest.approx(m["learner/loss"], rel=1e-5, abs=1e-8)
    assert got["m1"]["learner/optimizer_steps"] == m["learner/optimizer_steps"] == 2.0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_rank_checkpoint_resumes_the_uninterrupted_step(two_ranks, zero):
    _, res = two_ranks
    got = res[zero]
    assert max_diff(got["w1"], got["w2"]) > 1e-4
    assert max_diff(got["w2"], got["w2_resumed"]) == 0.0
    assert got["m2"]["learner/grad_norm"] == got["m2_resumed"]["learner/grad_norm"]
    ckpt = Path(got["ckpt"])
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "hf" / "config.json").is_file()
    if zero > 0:  # each rank wrote its own ZeRO partition
        assert len(list((ckpt / "ds" / "engine").glob("*zero_pp_rank_1_*optim_states.pt"))) == 1


def test_two_rank_zero0_checkpoint_resumes_on_one_rank(two_ranks):
    """ZeRO 0: DeepSpeed's checkpoint is whole, so one rank resumes it and takes the same next step."""
    from tests.learner.dp_ranks import batches, weights

    policy, res = two_ranks
    got = res[0]
    cfg, a = one_rank_learner(policy, 0)
    stage = cfg.stages[0]
    assert a.load_checkpoint(got["ckpt"])["num_ranks"] == 2
    assert max_diff(weights(a), got["w1"]) == 0.0
    a.begin_stage(0, stage, start_step=1)
    _, b2 = batches()
    m = a.train_groups(b2, [0] * len(b2), stage)
    assert max_diff(weights(a), got["w2"]) < 1e-6  # the same second step as the uninterrupted 2 ranks
    assert m["learner/grad_norm"] == pytest.approx(got["m2"]["learner/grad_norm"], rel=1e-5)


def test_two_rank_zero2_checkpoint_on_one_rank_is_refused_naming_the_fix(two_ranks):
    from sonar.learner.checkpoint import CheckpointError

    policy, res = two_ranks
    _, a = one_rank_learner(policy, 2)
    with pytest.raises(CheckpointError, match="learner.num_ranks=2"):
        a.load_checkpoint(res[2]["ckpt"])
