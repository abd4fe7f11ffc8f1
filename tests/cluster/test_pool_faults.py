"""A rollout worker killed while the weight-broadcast group forms, or mid-push, in the driver's own run
(``loop.train`` with ``Hooks.on_pool``): the pool's events are the synchronisation (``"group_open"``:
the learner's endpoint is open and no rank has joined; ``"push_sent"``: the learner's send is submitted
and no worker's receive yet), and the kill is ``ray.kill`` on the handle the pool holds, awaited until
Ray reports the actor dead. No sleeps.

The run restarts the worker and finishes with every worker holding the learner's weights (checksums
equal after the final push) and the accounting balanced (nothing lost, no prompt trained twice), or,
with no restart left, fails at once naming the worker and the call. Before the pool (b405bc9) a death
while the group formed failed the run whatever ``cluster.max_worker_restarts`` said."""
import json
from pathlib import Path

import pytest

from tests.waiting import wait_actor_dead

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # slow: the 1,800 s hang guard (tests/conftest.py)

STEP_TIMEOUT_S = 600
"""``cluster.step_timeout_s`` of these runs (the default): it bounds an actor's start, and no passing run
waits it out (a killed worker's calls fail at once). It was 90 s: in a loaded run (two busy loops beside
``make test``, load average 8-12) the learner and two workers took longer than that to start and all
three runs failed; on 2 busy cores without the suite they took about 45 s."""

BROADCAST_TIMEOUT_S = 600
"""``cluster.broadcast_timeout_s``: the default's value (``step_timeout_s``). No test here waits it out: a
worker found dead while the group forms calls the formation off (the others leave the presence barrier at
once, ``weights.presence_barrier``), and a receiver that dies mid-push breaks the learner's send at once
(its sockets close). It was 15 s while the formation's ranks waited out the timeout (most of what the
restart tests waited), which a loaded machine's slow rendezvous could come near."""


def _cfg(tmp_path, *extra):
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    # smoke, made smaller: 4 SFT steps, 4 + 1 RL steps, 4 held-out questions, no MLflow.
    return load_config([CONFIG_DIR / "smoke.yaml"],
                       [f"run.root={tmp_path}", f"run.run_dir={tmp_path / 'run'}", "tracking.enabled=false",
                        "eval.before=false", "eval.no_search=false", "world.num_heldout_eval=4",
                        "stages.0.steps=4", "stages.1.steps=4", "stages.2.steps=1",
                        f"cluster.step_timeout_s={STEP_TIMEOUT_S}", f"cluster.broadcast_timeout_s={BROADCAST_TIMEOUT_S}", *extra])


class KillAt:
    """``Hooks.on_pool``: at the first ``event`` for which ``when(pool)`` holds, kill worker ``index`` by
    the handle the pool holds and return once Ray reports it dead. Keeps the pool (``pool``) and the
    handle (``killed``)."""

    def __init__(self, event: str, index: int, when=lambda pool: True):
        self.event, self.index, self.when = event, index, when
        self.killed, self.pool = [], None

    def __call__(self, event, pool):
        import ray

        if event == self.event and not self.killed and self.when(pool):
            self.pool = pool
            handle = pool.workers[self.index]
            ray.kill(handle, no_restart=True)
            wait_actor_dead(handle)
            self.killed.append(handle)


def _check_finished_run(summary: dict, kill: KillAt, index: int = 1) -> None:
    """Restarted once, the new worker in every later push: every worker's checksum equals the learner's
    after the final push; the replay balances with nothing claimed; every prompt trained at most once
    and every group handed out recorded as trained."""
    import ray

    assert len(kill.killed) == 1 and kill.pool.workers[index] is not kill.killed[0]
    assert summary["faults"]["worker_restarts"] == 1 and kill.pool.restarts == {0: 0, 1: 0, index: 1}
    w = summary["weights"]
    assert len(w["workers"]) == 2
    for x in w["workers"]:
        assert x["version"] == w["learner"]["version"]
        assert x["checksum"] == pytest.approx(w["learner"]["checksum"], rel=1e-9)
    assert summary["replay"]["balanced"] and summary["replay"]["outstanding_claims"] == 0
    recs = [json.loads(l) for l in (Path(summary["run_dir"]) / "trained_prompts.jsonl").read_text().splitlines()
            if l.strip()]
    seen = [p for r in recs for p in r["trained"] + r["dropped"]]
    assert len(seen) == len(set(seen)), "a prompt was trained twice"
    assert sum(len(r["trained"]) for r in recs) == summary["replay"]["consumed_groups"]
    assert not ray.is_initialized()


def test_a_worker_killed_while_the_group_forms_is_restarted_and_the_run_finishes(tmp_path, shared_ray):
    """The first formation (the roles just started): the learner's endpoint is open when worker 1 dies.
    The learner's and worker 0's rendezvous time out (``cluster.broadcast_timeout_s``), worker 1 is replaced,
    the group forms again with it, and the run trains and finishes."""
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks

    kill = KillAt("group_open", 1)
    summary = train(_cfg(tmp_path, "cluster.max_worker_restarts=1"), Hooks(on_pool=kill))
    assert kill.pool.generation >= 2  # the abandoned formation and the one that held
    _check_finished_run(summary, kill)


def test_a_worker_killed_while_the_group_forms_with_no_restart_left_fails_the_run_naming_it(tmp_path, shared_ray):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks
    from sonar.cluster.driver.rollout_pool import WorkerFailed

    kill = KillAt("group_open", 1)
    with pytest.raises(WorkerFailed, match=r"rollout worker 1 failed \(0 prompts requeued\) and "
                                           r"cluster\.max_worker_restarts=0 is used up:\njoin: ActorDiedError"):
        train(_cfg(tmp_path, "cluster.max_worker_restarts=0"), Hooks(on_pool=kill))
    assert len(kill.killed) == 1 and kill.pool.generation == 1


@pytest.mark.parametrize("index", [0, 1])
def test_a_worker_killed_mid_push_is_restarted_and_the_next_push_reaches_every_worker(tmp_path, shared_ray, index):
    """The first push while the RL stage's rollout loops run: the learner has started sending when worker
    ``index`` dies, at either rank position (worker 0's death strands worker 1, which waits in the gloo
    broadcast for bytes that will not come). The pool calls the push off: the learner and the other
    worker leave it at once instead of at ``cluster.broadcast_timeout_s`` (600 s). That push reports
    nothing (its step's row has no ``weights/sync_s``); the worker is replaced, the loops paused, the
    group formed again, the weights pushed, the loops resumed; every later push reaches every worker and
    the run finishes."""
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks
    from sonar.cluster.wire import metrics as K

    kill = KillAt("push_sent", index, when=lambda pool: pool.active is not None)
    summary = train(_cfg(tmp_path, "cluster.max_worker_restarts=1"), Hooks(on_pool=kill))
    assert kill.pool.push_call_offs == 1
    _check_finished_run(summary, kill, index)
    rows = [json.loads(l) for l in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rl = [r for r in rows if r.get("stage") in (1, 2) and K.LEARNER_VERSION in r]
    assert len(rl) == 5  # 4 + 1 RL steps, each pushed (learner.broadcast_every=1)
    assert [K.WEIGHTS_SYNC_S in r for r in rl] == [False, True, True, True, True]
