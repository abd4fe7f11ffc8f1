"""One rank of the data-parallel learner tests (tests/learner/test_data_parallel.py), run as a process:
``python -m tests.learner.dp_ranks RANK WORLD PORT POLICY OUT``. For each case (``CASES``: ZeRO 0-3 with a
reward-mode KL term, ZeRO-3 with a loss-mode one, PPO with its DeepSpeed critic under ZeRO 0 and 3) it
builds the real ``Learner`` as rank RANK of WORLD, takes one RL step on the shared batch (counting the rows
its no-grad forwards see), checkpoints, takes a second step (uninterrupted), then builds a fresh learner,
resumes the checkpoint and takes the second step again. Every rank writes what it saw to ``OUT.RANK``
(torch.save); the parameters are gathered, so every rank holds them."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

CASES = {
    "z0": (0, "rl"), "z1": (1, "rl"), "z2": (2, "rl"), "z3": (3, "rl"),
    "z3-kl-loss": (3, "rl-kl-loss"), "ppo-z0": (0, "ppo"), "ppo-z3": (3, "ppo"),
}
"""case -> (learner.zero_stage, kind). Every RL case takes 2 mini-batches (proximal logprobs: tis) and a KL
term (reward mode: the reference's whole-batch forward; loss mode: its per-micro-batch forward)."""
ZERO_STAGES = (0, 1, 2, 3)

_ALGO = {"rl": "{mini_batches: 2, kl_coef: 0.05, kl_mode: reward}",
         "rl-kl-loss": "{mini_batches: 2, kl_coef: 0.05, kl_mode: loss}",
         "ppo": "{name: ppo, mini_batches: 2, kl_coef: 0.05, kl_mode: reward}"}


def config(zero: int, num_ranks: int, kind: str = "rl"):
    from sonar.cluster.wire.config import load_config

    return load_config([], [f"learner.zero_stage={zero}", f"learner.num_ranks={num_ranks}", "learner.warmup_steps=0",
                            "learner.micro_batch_tokens=40", "learner.weight_decay=0.01", "critic.warmup_steps=0",
                            f"stages=[{{kind: rl, steps: 4, lr: 0.001, algo: {_ALGO[kind]}}}]"])


def batches():
    """Two RL batches (whole groups), the same in every process."""
    from tests.learner.test_train_step import groups

    return groups(seed=1), groups(seed=2)


def weights(learner) -> dict:
    return {k: v.clone() for k, v in learner.named_tensors().items()}


def critic_weights(learner) -> dict:
    """The critic's full parameters (gathered under ZeRO-3: every rank calls this)."""
    import contextlib

    import deepspeed

    params = list(learner.critic.model.named_parameters())
    gather = (deepspeed.zero.GatheredParameters([p for _, p in params]) if learner.cfg.learner.zero_stage == 3
              else contextlib.nullcontext())
    with gather:
        return {n: p.detach().clone() for n, p in params}


def count_no_grad_rows(module, box: list):
    """A forward pre-hook on ``module`` adding the rows of every no-grad forward to ``box[0]``."""
    import torch

    def hook(_m, args, kwargs):
        if not torch.is_grad_enabled():
            x = kwargs.get("input_ids", args[0] if args else None)
            box[0] += int(x.shape[0])

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def push_alone(learner, rank: int) -> dict:
    """``Learner.broadcast`` into a weight-broadcast group of rank 0 alone (no receiver needed: what is
    tested is that the learner ranks' gathers pair up and every bucket is sent). {} on other ranks."""
    if rank == 0:
        from sonar.cluster.transport.weights import BroadcastGroup, plan_buckets
        from sonar.learner.worker import free_port

        learner._buckets = plan_buckets(learner.param_specs())
        learner._group = BroadcastGroup("127.0.0.1", free_port(), 0, 1, "gloo", prefix="alone", timeout_s=60)
    out = learner.broadcast()
    if rank == 0:
        learner._group.close()
    return out


def run(rank: int, world: int, port: int, policy: str, out: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from sonar.learner.worker import Learner

    b1, b2 = batches()
    results = {}
    for case, (z, kind) in CASES.items():
        cfg = config(z, world, kind)
        stage = cfg.stages[0]
        a = Learner(cfg, policy, rank=rank, world_size=world, master_port=port)
        a.begin_stage(0, stage)
        rows = [0]
        hooks = [count_no_grad_rows(a.engine.module, rows),
                 count_no_grad_rows(getattr(a.ref_module, "module", a.ref_module), rows)]
        m1 = a.train_groups(b1, [0] * len(b1), stage)
        for h in hooks:
            h.remove()
        w1 = weights(a)
        c1 = critic_weights(a) if a.critic is not None else None
        push = push_alone(a, rank)  # ZeRO-3: gathered bucket by bucket, every rank in rank 0's order
        checksum = a.checksum()["checksum"]  # ZeRO-3: one parameter gathered at a time
        specs = [(sp.name, sp.shape) for sp in a.param_specs()]  # ZeRO-3: ds_shape, nothing gathered
        export = a._param_state(a.engine.module)  # rank 0: CPU copies; others: None (they only join gathers)
        ckpt = os.path.join(os.path.dirname(out), f"ckpt-{case}")
        a.save_checkpoint(ckpt, {})
        a.stage_step += 1
        m2 = a.train_groups(b2, [0] * len(b2), stage)
        w2 = weights(a)
        c2 = critic_weights(a) if a.critic is not None else None
        del a
        b = Learner(cfg, policy, rank=rank, world_size=world, master_port=port)
        b.load_checkpoint(ckpt)
        b.begin_stage(0, stage, start_step=1)
        m2r = b.train_groups(b2, [0] * len(b2), stage)
        results[case] = {"w1": w1, "m1": m1, "w2": w2, "m2": m2, "w2_resumed": weights(b), "m2_resumed": m2r,
                         "c1": c1, "c2": c2, "c2_resumed": critic_weights(b) if b.critic is not None else None,
                         "ckpt": ckpt, "no_grad_rows": rows[0], "push": push, "checksum": checksum, "specs": specs,
                         "export": None if export is None else {k: (v.dtype, v.clone()) for k, v in export.items()}}
        del b
    torch.save(results, f"{out}.{rank}")
    return results


if __name__ == "__main__":
    r, w, p, pol, o = sys.argv[1:6]
    run(int(r), int(w), int(p), pol, o)
