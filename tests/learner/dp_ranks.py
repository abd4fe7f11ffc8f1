"""One rank of the data-parallel learner tests (tests/learner/test_data_parallel.py), run as a process:
``python -m tests.learner.dp_ranks RANK WORLD PORT POLICY OUT``. For each ZeRO stage it builds the real
``Learner`` as rank RANK of WORLD, takes one RL step on the shared batch, checkpoints, takes a second step
(uninterrupted), then builds a fresh learner, resumes the checkpoint and takes the second step again.
Rank 0 writes the parameters and metrics of each to OUT (torch.save)."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

ZERO_STAGES = (0, 1, 2, 3)


def config(zero: int, num_ranks: int):
    from sonar.cluster.wire.config import load_config

    return load_config([], [f"learner.zero_stage={zero}", f"learner.num_ranks={num_ranks}", "learner.warmup_steps=0",
                            "learner.micro_batch_tokens=40", "learner.weight_decay=0.01",
                            "stages=[{kind: rl, steps: 4, lr: 0.001, algo: {mini_batches: 2}}]"])


def batches():
    """Two RL batches (whole groups), the same in every process."""
    from tests.learner.test_train_step import groups

    return groups(seed=1), groups(seed=2)


def weights(learner) -> dict:
    return {k: v.clone() for k, v in learner.named_tensors().items()}


def run(rank: int, world: int, port: int, policy: str, out: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from sonar.learner.worker import Learner

    b1, b2 = batches()
    results = {}
    for z in ZERO_STAGES:
        cfg = config(z, world)
        stage = cfg.stages[0]
        a = Learner(cfg, policy, rank=rank, world_size=world, master_port=port)
        a.begin_stage(0, stage)
        m1 = a.train_groups(b1, [0] * len(b1), stage)
        w1 = weights(a)
        ckpt = os.path.join(os.path.dirname(out), f"ckpt-z{z}")
        a.save_checkpoint(ckpt, {})
        a.stage_step += 1
        m2 = a.train_groups(b2, [0] * len(b2), stage)
        w2 = weights(a)
        del a
        b = Learner(cfg, policy, rank=rank, world_size=world, master_port=port)
        b.load_checkpoint(ckpt)
        b.begin_stage(0, stage, start_step=1)
        m2r = b.train_groups(b2, [0] * len(b2), stage)
        results[z] = {"w1": w1, "m1": m1, "w2": w2, "m2": m2, "w2_resumed": weights(b), "m2_resumed": m2r,
                      "ckpt": ckpt}
    if rank == 0:
        torch.save(results, out)
    return results


if __name__ == "__main__":
    r, w, p, pol, o = sys.argv[1:6]
    run(int(r), int(w), int(p), pol, o)
