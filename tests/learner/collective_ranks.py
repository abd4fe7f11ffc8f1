"""One rank of tests/learner/test_gpu_path.py's collective checks, run as a process:
``python -m tests.learner.collective_ranks RANK WORLD PORT BACKEND OUT``. It joins a default process group
of WORLD ranks with the backend string BACKEND on loopback and writes what it saw to ``OUT.RANK``:

* ``cuda:gloo`` (a group whose only backend serves CUDA tensors, as an NCCL group is): every learner
  collective (``learner.collectives``) called with ``device="cpu"`` and ``device="meta"``, and the error
  each raised (None if none). A meta tensor is dispatched without a backend, so the group refuses it for
  nothing; what fails for it is reading the (absent) value back.
* ``gloo``: the same collectives' values, and the data-parallel no-grad forwards (``batch_logprobs`` and a
  critic's ``predict`` with ``dp=(rank, WORLD)``) with the rows each rank's forwards saw."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the message is the result)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def collectives(device, dp):
    """name -> a call of that learner collective on ``device``."""
    import torch

    from sonar.learner import collectives as c

    return {
        "dp_sum": lambda: c.dp_sum(1.0 + dp[0], dp, device),
        "sum_disjoint_rows_": lambda: c.sum_disjoint_rows_(torch.zeros(2, 3, device=device), dp),
        "broadcast_object": lambda: c.broadcast_object({"groups": [1, 2]} if dp[0] == 0 else None, 0, dp, device),
        "barrier": lambda: c.barrier(dp, device),
    }


def run(rank: int, world: int, port: int, backend: str, out: str) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from sonar.cluster.transport.weights import loopback_interface

    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    dp = (rank, world)
    res: dict = {}
    if backend == "cuda:gloo":
        for device in ("cpu", "meta"):
            for name, fn in collectives(device, dp).items():
                if name == "barrier" and device == "meta":
                    continue  # a barrier takes no tensor: its device is the CUDA one it is given on a GPU
                res[(name, device)] = _error(fn)
    else:
        calls = collectives("cpu", dp)
        res["dp_sum"] = calls["dp_sum"]()
        t = torch.zeros(world, 3)
        t[rank] = rank + 1.0
        from sonar.learner.collectives import sum_disjoint_rows_

        res["rows"] = sum_disjoint_rows_(t, dp).clone()
        res["object"] = calls["broadcast_object"]()
        calls["barrier"]()
        res.update(_no_grad_forwards(dp))
    dist.destroy_process_group()
    torch.save(res, f"{out}.{rank}")
    return res


def _no_grad_forwards(dp):
    """The proximal/reference forward (``batch_logprobs``) and the critic's V_old (``predict``) split across
    the ranks, with the rows this rank's forwards saw (plain modules, so no collective but the gather)."""
    import torch

    from sonar.cluster.wire.config import CriticConfig, LearnerConfig
    from sonar.learner.batching import collate
    from sonar.learner.critic import Critic
    from sonar.learner.train_step import batch_logprobs
    from tests.learner.test_train_step import groups, tiny_model

    model = tiny_model(0)
    batch = collate([t for g in groups(seed=3) for t in g], None, 0)
    rows = [0]
    model.register_forward_pre_hook(lambda _m, _a, kw: rows.__setitem__(0, rows[0] + kw["input_ids"].shape[0]),
                                    with_kwargs=True)
    lp = batch_logprobs(model, batch, 0.7, 40, "cpu", 5, dp)
    value_rows = [0]  # a head critic runs the policy's trunk alone
    model.model.register_forward_pre_hook(
        lambda _m, _a, kw: value_rows.__setitem__(0, value_rows[0] + kw["input_ids"].shape[0]), with_kwargs=True)
    critic = Critic(CriticConfig(mode="head"), LearnerConfig(micro_batch_tokens=40), policy_module=model)
    with torch.no_grad():
        critic.head.weight.normal_(generator=torch.Generator().manual_seed(1))
    values = critic.predict(batch, dp)
    return {"logprobs": lp, "logprob_rows": rows[0], "values": values, "value_rows": value_rows[0]}


if __name__ == "__main__":
    r, w, p, b, o = sys.argv[1:6]
    run(int(r), int(w), int(p), b, o)
