"""The data-parallel learner (``learner.num_ranks``): two DeepSpeed ranks (processes, gloo on loopback)
take the same update as one rank on the same batch for ZeRO 0-3 (the batch split by token count, the
loss normalised by the global token counts), with a KL reference, proximal logprobs and PPO's DeepSpeed
critic, each rank forwarding only its rows in the no-grad passes; a 2-rank checkpoint resumes to the
uninterrupted next step (critic and reference included); only rank 0 materialises the export; and the
splitting helpers keep every collective paired."""
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
    out, port = tmp / "rank.pt", free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.learner.dp_ranks", str(r), "2", str(port), policy, str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    return policy, ranks[0], ranks


def one_rank_learner(policy, zero, kind="rl"):
    from tests.learner.dp_ranks import config
    from tests.learner.test_train_step import init_deepspeed

    init_deepspeed()
    from sonar.learner.worker import Learner

    cfg = config(zero, 1, kind)
    return cfg, Learner(cfg, policy)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def expected_no_grad_rows(kind: str, rank: int, world: int) -> int:
    """Rows a rank's no-grad forwards see in one step of dp_ranks' first batch: its shard (+ fillers) of the
    proximal logprobs' whole batch, and of the reference's (reward mode: the whole batch again; loss mode:
    every micro-batch of each mini-batch)."""
    from sonar.learner.batching import rank_packs
    from sonar.learner.train_step import mini_batch_rows
    from tests.learner.dp_ranks import batches

    b1, _ = batches()
    batch = collate([t for g in b1 for t in g], None, 0)
    lengths = batch.lengths.tolist()
    whole = sum(len(rows) for rows, _ in rank_packs(lengths, 40, (rank, world)))
    if kind != "rl-kl-loss":
        return 2 * whole
    minis = sum(len(rows) for mini in mini_batch_rows(batch.size, 2)
                for rows, _ in rank_packs([lengths[i] for i in mini], 40, (rank, world)))
    return whole + minis


@pytest.mark.parametrize("case", ["z0", "z1", "z2", "z3", "z3-kl-loss", "ppo-z0", "ppo-z3"])
@pytest.mark.slow  # two DeepSpeed ranks in spawned processes (the module fixture): not in `make test-fast`
def test_two_ranks_take_the_one_rank_update(two_ranks, case):
    """Policy (and PPO's DeepSpeed critic) after one step: 2 ranks == 1 rank, with the proximal, reference and
    V_old forwards split across the ranks (each forwards its own rows: counted)."""
    from tests.learner.dp_ranks import CASES, batches, count_no_grad_rows, critic_weights, weights

    policy, res, ranks = two_ranks
    zero, kind = CASES[case]
    cfg, a = one_rank_learner(policy, zero, kind)
    stage = cfg.stages[0]
    a.begin_stage(0, stage)
    b1, _ = batches()
    start = weights(a)
    rows = [0]
    hooks = [count_no_grad_rows(a.engine.module, rows),
             count_no_grad_rows(getattr(a.ref_module, "module", a.ref_module), rows)]
    m = a.train_groups(b1, [0] * len(b1), stage)
    for h in hooks:
        h.remove()
    got = res[case]
    assert max_diff(start, got["w1"]) > 1e-4  # it moved
    assert max_diff(weights(a), got["w1"]) < 1e-6
    # Adam's first step hardly depends on the gradient's scale: the norm pins the aggregation (a loss
    # averaged instead of summed over the ranks would halve it) and the loss is the whole batch's
    assert got["m1"]["learner/grad_norm"] == pytest.approx(m["learner/grad_norm"], rel=1e-5)
    assert got["m1"]["learner/loss"] == pytest.approx(m["learner/loss"], rel=1e-5, abs=1e-8)
    assert got["m1"]["learner/optimizer_steps"] == m["learner/optimizer_steps"] == 2.0
    # the no-grad forwards: 1 rank sees every row of each, each of 2 ranks its shard and fillers, no more
    assert rows[0] == expected_no_grad_rows(kind, 0, 1)
    for r in range(2):
        assert ranks[r][case]["no_grad_rows"] == expected_no_grad_rows(kind, r, 2) < rows[0]
    if kind == "ppo":
        for key in ("learner/critic/value_loss", "learner/critic/grad_norm", "learner/critic/value_mean"):
            assert got["m1"][key] == pytest.approx(m[key], rel=1e-5, abs=1e-8), key
        c = critic_weights(a)
        assert max_diff(c, got["c1"]) < 1e-6 and max_diff(c, {k: torch.zeros_like(v) for k, v in c.items()}) > 0
    # the second step: the policy has moved away from the reference, so the KL term is not 0
    _, b2 = batches()
    a.stage_step += 1
    m = a.train_groups(b2, [0] * len(b2), stage)
    assert max_diff(weights(a), got["w2"]) < 1e-6
    assert got["m2"]["learner/grad_norm"] == pytest.approx(m["learner/grad_norm"], rel=1e-5)
    if kind != "rl-kl-loss":  # the reward-mode KL of the whole batch, from the split reference forward
        assert m["learner/kl_reward_penalty"] > 0
        assert got["m2"]["learner/kl_reward_penalty"] == pytest.approx(m["learner/kl_reward_penalty"], rel=1e-4)


@pytest.mark.slow  # two DeepSpeed ranks in spawned processes (the module fixture): not in `make test-fast`
def test_only_rank_0_materialises_the_export(two_ranks):
    """``_param_state`` (what exports and checkpoints write): rank 0 holds every parameter in the training
    dtype, equal to the gathered weights; rank 1 joined ZeRO-3's gathers and holds nothing."""
    _, res, ranks = two_ranks
    for case in ("z0", "z3"):
        export = ranks[0][case]["export"]
        assert ranks[1][case]["export"] is None
        w1 = res[case]["w1"]
        assert set(export) == set(w1)
        assert all(dtype == torch.float32 and torch.equal(t, w1[k]) for k, (dtype, t) in export.items())


@pytest.mark.parametrize("case", ["z0", "z2", "z3"])
@pytest.mark.slow  # two DeepSpeed ranks in spawned processes (the module fixture): not in `make test-fast`
def test_the_push_checksum_and_specs_of_two_ranks_need_no_whole_model_gather(two_ranks, case):
    """Under ZeRO-3 the push gathers one bucket at a time (rank 1 joins each gather in rank 0's order, so
    the two processes do not deadlock), the checksum one parameter at a time, and the specs come from
    ``ds_shape`` with no gather; all equal what the gathered weights give."""
    from sonar.cluster.transport.weights import checksum

    _, res, ranks = two_ranks
    w1 = res[case]["w1"]
    push = ranks[0][case]["push"]
    assert ranks[1][case]["push"] == {}
    assert push["bytes"] == sum(t.numel() * t.element_size() for t in w1.values()) and push["buckets"] >= 1
    want = checksum(w1.items())
    for r in (0, 1):
        assert ranks[r][case]["checksum"] == pytest.approx(want, rel=1e-12)
        assert ranks[r][case]["specs"] == [(n, tuple(t.shape)) for n, t in w1.items()]


@pytest.mark.parametrize("case", ["z0", "z1", "z2", "z3", "z3-kl-loss", "ppo-z0", "ppo-z3"])
@pytest.mark.slow  # two DeepSpeed ranks in spawned processes (the module fixture): not in `make test-fast`
def test_two_rank_checkpoint_resumes_the_uninterrupted_step(two_ranks, case):
    from sonar.learner.critic import CRITIC_DIR

    _, res, _ = two_ranks
    got = res[case]
    assert max_diff(got["w1"], got["w2"]) > 1e-4
    assert max_diff(got["w2"], got["w2_resumed"]) == 0.0
    assert got["m2"]["learner/grad_norm"] == got["m2_resumed"]["learner/grad_norm"]
    if got["c2"] is not None:  # the critic resumes through DeepSpeed's checkpoint too
        assert max_diff(got["c2"], got["c2_resumed"]) == 0.0 and max_diff(got["c1"], got["c2"]) > 0
        assert (Path(got["ckpt"]) / CRITIC_DIR).is_dir()
    ckpt = Path(got["ckpt"])
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "hf" / "config.json").is_file()
    assert (ckpt / "reference.pt").is_file() and (ckpt / "rng.pt").is_file() and (ckpt / "rng-rank1.pt").is_file()
    if case.startswith("z") and case != "z0":  # each rank wrote its own ZeRO partition
        assert len(list((ckpt / "ds" / "engine").glob("*zero_pp_rank_1_*optim_states.pt"))) == 1


@pytest.mark.slow  # two DeepSpeed ranks in spawned processes (the module fixture): not in `make test-fast`
def test_two_rank_zero0_checkpoint_resumes_on_one_rank(two_ranks):
    """ZeRO 0: DeepSpeed's checkpoint is whole, so one rank resumes it and takes the same next step."""
    from tests.learner.dp_ranks import batches, weights

    policy, res, _ = two_ranks
    got = res["z0"]
    cfg, a = one_rank_learner(policy, 0)
    stage = cfg.stages[0]
    assert a.load_checkpoint(got["ckpt"])["num_ranks"] == 2
    assert max_diff(weights(a), got["w1"]) == 0.0
    a.begin_stage(0, stage, start_step=1)
    _, b2 = batches()
    m = a.train_groups(b2, [0] * len(b2), stage)
    assert max_diff(weights(a), got["w2"]) < 1e-6  # the same second step as the uninterrupted 2 ranks
    assert m["learner/grad_norm"] == pytest.approx(got["m2"]["learner/grad_norm"], rel=1e-5)


@pytest.mark.slow  # two DeepSpeed ranks in spawned processes (the module fixture): not in `make test-fast`
def test_two_rank_zero2_checkpoint_on_one_rank_is_refused_naming_the_fix(two_ranks):
    from sonar.learner.checkpoint import CheckpointError

    policy, res, _ = two_ranks
    _, a = one_rank_learner(policy, 2)
    with pytest.raises(CheckpointError, match="learner.num_ranks=2"):
        a.load_checkpoint(res["z2"]["ckpt"])
