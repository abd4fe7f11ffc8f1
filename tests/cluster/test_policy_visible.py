"""Which nodes the policy-visibility check probes, and its message (pure; the real probe runs on a
simulated 3-node cluster in tests/cluster/test_multinode.py)."""
from __future__ import annotations

from sonar.cluster.driver.files import role_nodes, visibility_problems
from sonar.cluster.wire.config import load_config


def _node(nid, alive=True, **res):
    return {"NodeID": nid, "Alive": alive, "Resources": {"CPU": 8.0, **res}}


def test_gpu_roles_are_probed_on_gpu_nodes_only(tmp_path):
    cfg = load_config(["gpu"], ["cluster.role_resources.learner.big=1"], notes=[])
    nodes = [_node("head", CPU=0.0), _node("gpu-a", GPU=8.0, big=1.0), _node("gpu-b", GPU=8.0),
             _node("cpu", retrieval_node=1000.0), _node("dead", alive=False, GPU=8.0, big=1.0)]
    assert role_nodes(cfg, nodes) == {"gpu-a": ["learner", "rollout"], "gpu-b": ["rollout"]}


def test_cpu_roles_may_run_anywhere_alive():
    cfg = load_config([], [])
    assert role_nodes(cfg, [_node("a"), _node("b", alive=False)]) == {"a": ["learner", "rollout"]}


def test_the_message_names_each_node_with_problems_only_in_address_order():
    # Node ids sort opposite to the addresses: Ray's ids are random, the message must not be.
    lines = visibility_problems({"n9": ("10.0.0.2", ["learner"], ["policy directory /runs/x/policy: no config.json"]),
                                 "n1": ("10.0.0.1", ["rollout"], []),
                                 "n0": ("10.0.0.3", ["learner", "rollout"], ["a: not readable", "b: not readable"])})
    assert lines == ["10.0.0.2 (could run the learner): policy directory /runs/x/policy: no config.json",
                     "10.0.0.3 (could run the learner and rollout): a: not readable; b: not readable"]
