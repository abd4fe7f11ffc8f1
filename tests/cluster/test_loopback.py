"""Loopback stays loopback: every store and group Sonar creates listens on the address it was given.

torch 2.13's master ``TCPStore(host, port, is_master=True)`` listens on every interface (``*:port``,
IPv6 any) whatever ``host`` says, and gloo's default device listens wherever the hostname resolves.
Sonar binds the store's socket itself (``weights.master_store``), gives gloo a device on the address
that reaches the master (``weights.gloo_options``) and builds the learner's DeepSpeed group on such a
store (``learner.worker._init_process_group_on_loopback``). The tests list the listening TCP sockets
of the processes that hold them (``psutil``; Ray's own sockets in the actor processes are on loopback
too, since Ray is started on 127.0.0.1) and find none on another interface.
"""
import ipaddress
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from sonar.cluster.transport.weights import (BroadcastGroup, is_loopback, local_address_towards, master_store,
                                        open_store)

ROOT = Path(__file__).resolve().parents[2]


def listening(pid: int | None = None) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of the process (IPv4 and IPv6)."""
    conns = psutil.Process(pid or os.getpid()).net_connections(kind="tcp")
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1 (Ray's gRPC servers)
    return addr.is_loopback


def test_loopback_helpers():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("192.0.2.7") and not is_loopback("0.0.0.0")
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert loopback("::ffff:127.0.0.1") and not loopback("::") and not loopback("0.0.0.0")


def test_torch_master_store_listens_everywhere_sonars_on_the_address_given():
    """Why ``master_store`` exists (torch's own store, pinned for torch 2.13), and that it works: a
    client on 127.0.0.1 reaches it and its port listens on 127.0.0.1 only."""
    plain = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    assert [ip for ip, port in listening() if port == plain.port] == ["::"]  # every interface
    del plain
    ours = open_store("127.0.0.1", 2)
    client = dist.TCPStore("127.0.0.1", ours.port, 2, is_master=False)
    client.set("k", "v")
    assert ours.get("k") == b"v"
    assert [ip for ip, port in listening() if port == ours.port] == ["127.0.0.1"]
    port = ours.port
    del ours, client  # the store owns the socket it was handed and closes it
    assert port not in [p for _, p in listening()]


def test_broadcast_group_store_and_gloo_pairs_stay_on_loopback():
    """Rank 0 binds the store itself (no pre-bound store) and rank 1 dials it; both ranks live in this
    process, so every listening socket of the group (the store, gloo's pair listeners) is ours."""
    before = set(listening())
    port = master_store("127.0.0.1", 0, 1).port  # a free port, released when the store goes
    groups: dict[int, BroadcastGroup] = {}

    def join(rank):
        groups[rank] = BroadcastGroup("127.0.0.1", port, rank, 2, "gloo", prefix="loopback-test", timeout_s=60)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    x = torch.arange(4.0)
    y = torch.zeros(4)
    t = threading.Thread(target=groups[1].broadcast, args=(y,))
    t.start()
    groups[0].broadcast(x)
    t.join()
    assert torch.equal(x, y)
    new = set(listening()) - before
    assert (("127.0.0.1", port) in new) and len(new) >= 2, new  # the store and at least one gloo listener
    assert [s for s in new if not loopback(s[0])] == []
    for g in groups.values():
        g.close()


LEARNER_SCRIPT = r"""
import os, sys, threading, json
os.environ["OMP_NUM_THREADS"] = "1"
import psutil
from sonar.actors.model import materialise_policy
from sonar.actors.world import build_world
from sonar.cluster.wire.config import ModelConfig, WorldConfig, load_config
from sonar.cluster.transport.weights import BroadcastGroup, open_store, plan_buckets
from sonar.learner.worker import Learner

small = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=64)
policy = materialise_policy(small, build_world(WorldConfig(num_entities=40)), sys.argv[1])
cfg = load_config([], ["stages=[{kind: sft, steps: 2, lr: 0.01, batch_size: 4}]"])
learner = Learner(cfg, str(policy))  # DeepSpeed's group, as the learner actor builds it
store = learner._bcast_store = open_store("127.0.0.1", 2)  # what broadcast_endpoint binds
buckets = plan_buckets(learner.param_specs())
got = {}
def worker():  # rank 1 of the weight-broadcast group, as a rollout worker joins it
    g = BroadcastGroup("127.0.0.1", store.port, 1, 2, "gloo", prefix="t")
    got["recv"] = len(g.recv_weights(buckets))
t = threading.Thread(target=worker)
t.start()
learner.setup_broadcast("127.0.0.1", store.port, 2, "gloo", "t")
learner.broadcast()
t.join()
conns = psutil.Process().net_connections(kind="tcp")
print(json.dumps({"listen": [[c.laddr.ip, c.laddr.port] for c in conns if c.status == psutil.CONN_LISTEN],
                  "master_port": int(os.environ["MASTER_PORT"]), "bcast_port": store.port, "recv": got["recv"]}))
"""


@pytest.mark.slow  # spawns processes (ranks / a CLI): `make test` runs it, `make test-fast` does not
def test_learner_deepspeed_group_and_broadcast_store_listen_on_loopback_only(tmp_path):
    """The real learner (DeepSpeed initialised through ``Learner.__init__``) and its broadcast group
    with a receiving rank, in a fresh process: its DeepSpeed store, its broadcast store and every gloo
    listener are on 127.0.0.1, and nothing listens on another interface."""
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    out = subprocess.run([sys.executable, "-c", LEARNER_SCRIPT, str(tmp_path / "policy")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    socks = [tuple(s) for s in res["listen"]]
    assert res["recv"] > 0
    assert ("127.0.0.1", res["master_port"]) in socks and ("127.0.0.1", res["bcast_port"]) in socks
    assert [s for s in socks if not loopback(s[0])] == [], socks


@pytest.mark.slow
@pytest.mark.ray
def test_a_local_runs_roles_listen_on_loopback_only(tmp_path):
    """The roles of a local run (``start_roles``: Ray on 127.0.0.1, the learner actor with DeepSpeed,
    a rollout worker, the broadcast group connected and the weights pushed): no listening socket of the
    learner's or the worker's process is on another interface (Ray's own included)."""
    import ray

    from sonar.cluster.driver.roles import start_roles, stop_roles
    from sonar.cluster.driver.run import start_run
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    cfg = load_config([CONFIG_DIR / "smoke.yaml"],
                      [f"run.root={tmp_path}", "tracking.enabled=false", "rollout.num_workers=1"])
    roles = start_roles(cfg, start_run(cfg))
    try:
        pids = {name: ray.get(a.__ray_call__.remote(lambda self: os.getpid()))
                for name, a in (("learner", roles.learner), ("worker", roles.workers[0]))}
        socks = {name: listening(pid) for name, pid in pids.items()}
    finally:
        stop_roles(roles)
    assert len(socks["learner"]) >= 3, socks  # Ray's, DeepSpeed's store, the broadcast's store and gloo's
    assert {name: [s for s in ss if not loopback(s[0])] for name, ss in socks.items()} == \
        {"learner": [], "worker": []}, socks
