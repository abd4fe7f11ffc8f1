"""Multi-node, simulated on this machine: ``ray.cluster_utils.Cluster`` with three nodes, each with its own
address (127.0.0.1, 127.0.0.2, 127.0.0.3: Ray accepts a distinct ``node_ip_address`` per node, and every
127/8 address reaches this machine's loopback) and its own custom resource, and the roles pinned by
``cluster.role_resources``: retrieval on the head (the driver's node), the learner on node 2, the
rollout workers on node 3.

1. A short RL run finishes with the weights exchanged across nodes: the learner's broadcast rendezvous
   listens on its node's address (127.0.0.2, ``cluster.bind_host=auto`` on a 3-node cluster), the
   workers on 127.0.0.3 dial it, and after the final push every checksum equals the learner's.
2. The elastic pool on the same cluster (1..2 workers): a starved learner grows the pool, then a slow
   learner (the driver's ``on_step`` hook holds each step until the replay is full) shrinks it; the replay's accounting balances, nothing
   is lost and no prompt is trained twice. The pool size per step is printed (``rollout/pool/size``).
3. Files: the learner's ``run.dir`` check passes (one filesystem), and ``fetch_dir`` streams a directory
   from the learner's node through the object store byte for byte.
"""
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from tests.sizing import smoke_sizing

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(600)]

RL_YAML = """
stages:
  - name: grpo
    kind: rl
    steps: {steps}
    lr: 3.0e-4
"""


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray.cluster_utils import Cluster

    from sonar.cluster.driver.roles import start_local_node  # each node retried past Ray's fixed 30 s wait

    c = start_local_node(lambda: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_retrieval": 4}, "node_ip_address": "127.0.0.1", "include_dashboard": False}))
    start_local_node(lambda: c.add_node(num_cpus=2, resources={"node_learner": 1}, node_ip_address="127.0.0.2"))
    start_local_node(lambda: c.add_node(num_cpus=3, resources={"node_rollout": 3}, node_ip_address="127.0.0.3"))
    yield c
    c.shutdown()


def config(tmp_path, cluster, steps, *overrides):
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    rl = tmp_path / "rl.yaml"
    rl.write_text(RL_YAML.format(steps=steps))
    return load_config([smoke_sizing(tmp_path), rl], [
        f"run.root={tmp_path}", f"cluster.address={cluster.address}", "tracking.enabled=false",
        "eval.before=false", "eval.no_search=false", "world.num_heldout_eval=4",
        "cluster.role_resources.learner.node_learner=1", "cluster.role_resources.rollout.node_rollout=1",
        "cluster.role_resources.retrieval.node_retrieval=1", *overrides])


def ip_of(handle):
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()), timeout=60)


def metrics_rows(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]


def test_roles_on_three_nodes_train_and_exchange_weights(tmp_path, cluster):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks

    seen = {}

    def on_step(roles, run, stage_index, steps):
        import ray

        if not seen:
            store = ray.get(roles.learner.__ray_call__.remote(
                lambda s: (s._group._store.host, s._group._store.port)), timeout=60)
            seen.update(learner=ip_of(roles.learner), workers=[ip_of(w) for w in roles.workers],
                        retrieval=[ip_of(h) for h in roles.retrieval], store=store, files_node=roles.files_node)
        return False

    t0 = time.monotonic()
    summary = train(config(tmp_path, cluster, 3), Hooks(on_step=on_step))
    print(f"\nmulti-node run: {time.monotonic() - t0:.1f} s, placement {seen}")
    assert seen["learner"] == "127.0.0.2" and seen["workers"] == ["127.0.0.3", "127.0.0.3"]
    assert seen["retrieval"] == ["127.0.0.1"]
    assert seen["store"][0] == "127.0.0.2"        # the rendezvous is on the learner's own node address
    assert seen["files_node"] is None              # one filesystem: the driver sees the learner's run.dir
    w = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert (Path(summary["run_dir"]) / "model" / "config.json").is_file()
    assert w["replay"]["balanced"]


def test_elastic_pool_grows_when_starved_and_shrinks_when_the_learner_is_slow(tmp_path, cluster):
    from sonar.cluster.driver.chaos import accounting
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks
    from sonar.cluster.driver.run import world_of

    import ray

    sizes = []

    def on_step(roles, run, stage_index, steps):
        sizes.append(len(roles.workers))
        if max(sizes) == 2 and sizes[-1] == 2:
            # Grown: from now on the learner is slow, whatever the machine's load: its next step starts
            # only once the replay is full (a condition, polled, with a deadline that fails clearly).
            deadline = time.monotonic() + 300
            while ray.get(roles.replay.stats.remote())["depth_groups"] < cfg.replay.capacity_groups:
                assert time.monotonic() < deadline, "the replay did not fill within 300 s"
                time.sleep(0.05)
        return max(sizes) == 2 and sizes[-1] == 1  # shrunk again: done

    cfg = config(tmp_path, cluster, 40, "rollout.num_workers=1", "rollout.min_workers=1", "rollout.max_workers=2",
                 "rollout.pool_window_s=3", "rollout.pool_cooldown_s=3", "rollout.pool_grow_wait_share=0.2",
                 "rollout.pool_shrink_full_share=0.6")
    t0 = time.monotonic()
    summary = train(cfg, Hooks(on_step=on_step))
    run_dir = Path(summary["run_dir"])
    pool = [int(r["rollout/pool/size"]) for r in metrics_rows(run_dir) if "rollout/pool/size" in r]
    print(f"\nelastic run: {time.monotonic() - t0:.1f} s; pool size per RL step: {pool}")
    assert 2 in pool and pool[-1] == 1 and pool.index(2) < len(pool) - 1
    s = json.loads((run_dir / "summary.json").read_text())
    a = accounting(run_dir, s["replay"], len(world_of(cfg).train))
    print(f"accounting: {a}")
    assert a["lost"] == 0 and a["trained_twice"] == 0 and a["balanced"] and a["trained"] > 0


def test_the_run_dir_check_and_the_streamed_upload(tmp_path, cluster):
    import ray

    from sonar.cluster.driver.files import check_run_dir, fetch_dir
    from sonar.cluster.wire.config import load_config

    ray.init(address=cluster.address)
    try:
        node = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == "127.0.0.2")
        cfg = load_config([], [])
        assert check_run_dir(cfg, node, tmp_path / "run") is True
        src = tmp_path / "src"
        (src / "sub").mkdir(parents=True)
        (src / "a.bin").write_bytes(os.urandom(100_003))
        (src / "sub" / "empty").write_bytes(b"")
        fetch_dir(node, str(src), str(tmp_path / "dst"), chunk_bytes=4096)
        assert (tmp_path / "dst" / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
        assert (tmp_path / "dst" / "sub" / "empty").read_bytes() == b""
    finally:
        ray.shutdown()


def test_the_policy_must_be_readable_on_every_node_that_may_run_a_role(tmp_path, cluster):
    """Issue 21, item 4: checked before any role starts, on each node that could host the learner or a
    worker (here 127.0.0.2 and 127.0.0.3 by their labels), with this run's token; the error names the
    nodes and what to mount. (The nodes share this machine's disk, so a node-local copy is simulated by
    a stale token: the same path holding another run's policy.)"""
    import ray

    from sonar.cluster.driver.files import POLICY_ID_FILE, check_policy_visible

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    (policy / POLICY_ID_FILE).write_text("this-run")
    cfg = config(tmp_path, cluster, 1)
    ray.init(address=cluster.address)
    try:
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        checked = check_policy_visible(cfg, str(policy), "this-run")
        assert {ips[n]: roles for n, roles in checked.items()} == {"127.0.0.2": ["learner"], "127.0.0.3": ["rollout"]}
        with pytest.raises(RuntimeError, match=r"on 2 node\(s\): 127\.0\.0\.2 \(could run the learner\): policy "
                                               r"directory .*another run's copy.*Mount shared storage") as e:
            check_policy_visible(cfg, str(policy), "a-newer-run")
        assert "127.0.0.3 (could run the rollout)" in str(e.value) and "run.root" in str(e.value)
        gone = dataclasses.replace(cfg, stages=[dataclasses.replace(cfg.stages[0], data=str(tmp_path / "no.jsonl"))])
        with pytest.raises(RuntimeError, match=r"stages\[0\]\.data .*no\.jsonl: not readable"):
            check_policy_visible(gone, str(policy), "this-run")
    finally:
        ray.shutdown()
