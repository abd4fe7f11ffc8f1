"""A retrieval replica dead for good (killed with ``no_restart=True``: Ray will not bring it back, as when
``cluster.max_replica_restarts`` is used up) is replaced by the driver through its own loop: a new actor
in its slot, its handle in every worker's clients, counted in ``retrieval/replicas_replaced``; the run
finishes (it failed with ``ReplicaFailed``: the only replica was gone). The kill lands after an RL step
(``Hooks.on_step``): no sleeps."""
import json
from pathlib import Path

import pytest

from tests.waiting import wait_actor_dead

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # slow: the 1,800 s hang guard (tests/conftest.py)


def _cfg(tmp_path, *extra):
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    return load_config([CONFIG_DIR / "smoke.yaml"],
                       [f"run.root={tmp_path}", f"run.run_dir={tmp_path / 'run'}", "tracking.enabled=false",
                        "eval.before=false", "eval.no_search=false", "world.num_heldout_eval=4",
                        "stages.0.steps=10", "stages.1.steps=6", "stages.2.steps=1", *extra])


class KillReplicaForGood:
    """After RL step 2 of stage 1: ``ray.kill(no_restart=True)`` on replica 0's handle. After step 6:
    what replica 0 is now, what the workers' clients hold, and the new replica's request count."""

    def __init__(self):
        self.killed, self.after = None, {}

    def __call__(self, roles, run, stage_index, steps):
        import ray

        if stage_index != 1:
            return False
        if steps == 2 and self.killed is None:
            self.killed = roles.retrieval[0]._actor_id.hex()
            ray.kill(roles.retrieval[0], no_restart=True)
            wait_actor_dead(roles.retrieval[0], 120)  # so step 3's health ping is the one that finds it dead
        if steps == 6 and self.killed is not None:
            held = [ray.get(w.__ray_call__.remote(
                lambda self: [[h._actor_id.hex() for h in r.handles] for r in (self.retriever, self.eval_retriever)]),
                timeout=120) for w in roles.workers]
            self.after = {"replica": roles.retrieval[0]._actor_id.hex(),
                          "health": ray.get(roles.retrieval[0].health.remote(), timeout=120),
                          "requests": ray.get(roles.retrieval[0].stats.remote(), timeout=120)["requests"],
                          "held": held}
        return False


def test_a_replica_dead_for_good_is_replaced_and_the_workers_search_through_the_new_one(tmp_path, shared_ray):
    import ray

    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks
    from sonar.cluster.wire import metrics as K

    hook = KillReplicaForGood()
    summary = train(_cfg(tmp_path, "cluster.max_replica_restarts=0", "cluster.max_replica_replacements=1"),
                    Hooks(on_step=hook))
    after = hook.after
    assert hook.killed and after, "the hook did not run at RL steps 2 and 6"
    new = after["replica"]
    assert new != hook.killed and after["health"]["ok"]
    # every worker's rollout and evaluation clients hold the new replica, and searched through it
    assert after["held"] == [[[new], [new]]] * len(after["held"]), after["held"]
    assert after["requests"] > 0
    assert summary["faults"]["replica_replacements"] == 1
    rows = [json.loads(l) for l in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    replaced = [r[K.RETRIEVAL_REPLICAS_REPLACED] for r in rows if K.RETRIEVAL_REPLICAS_REPLACED in r]
    # stage 1: steps 1-2 before the kill read 0, steps 3-6 after it 1; stage 2's one step 1
    assert replaced == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], replaced
    assert all(r[K.RETRIEVAL_REPLICAS_HEALTHY] == 1.0 for r in rows if K.RETRIEVAL_REPLICAS_HEALTHY in r)
    assert summary["replay"]["balanced"] and summary["em_after_search"] is not None  # evaluated through it
    assert not ray.is_initialized()
