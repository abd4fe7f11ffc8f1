"""``RolloutPool.health`` asks every rollout worker at once and judges every answer against one deadline:
a healthy worker's counters reach the metrics (its rollouts' own metrics come through the replay,
tests/cluster/test_replay.py); a silent or dead one is replaced (``_replace``), with the reason."""
import threading

import pytest

from tests.ray_job import ray_for_module
from tests.waiting import wait_actor_dead

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local(shared_ray):
    """A job on the session's cluster (tests/ray_job.py): these fakes ask for no CPUs."""
    with ray_for_module(__name__, shared_ray) as ray:
        yield ray


class Gate:
    """An async actor: ``arrive()`` returns once ``n`` calls have arrived."""

    def __init__(self, n: int):
        self.n, self.arrived, self.all_in = n, 0, None

    async def arrive(self) -> int:
        import asyncio

        if self.all_in is None:
            self.all_in = asyncio.Event()
        self.arrived += 1
        if self.arrived >= self.n:
            self.all_in.set()
        await self.all_in.wait()
        return self.arrived


class FakeWorker:
    """``health()`` answers only after every live worker's health call has reached the gate, so
    health calls made one after another would leave the first one waiting for the deadline. A
    ``silent`` worker reaches the gate and then never answers."""

    def __init__(self, worker_id: int, gate, busy_s: float, silent: bool = False):
        self.worker_id, self.gate, self.busy_s, self.silent = worker_id, gate, busy_s, silent

    def health(self) -> dict:
        import ray

        ray.get(self.gate.arrive.remote())
        if self.silent:
            threading.Event().wait()
        return {"worker_id": self.worker_id, "alive": True, "error": None, "idle_s": 0.0, "version": 0,
                "stats": {"busy_s": self.busy_s}}


def _check(ray, workers, timeout_s, monkeypatch):
    """The pool's health check over ``workers`` with the replacement recorded instead of run: (metrics, restarts)."""
    from sonar.cluster.driver.rollout_pool import RolloutPool
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    cfg = load_config([CONFIG_DIR / "smoke.yaml"], ["cluster.mode=async", f"cluster.health_timeout_s={timeout_s}"])
    restarted = []
    pool = RolloutPool(cfg, workers=workers)
    monkeypatch.setattr(pool, "_replace", lambda i, err: restarted.append((i, err)))
    try:
        return pool.health(), restarted
    finally:
        for w in workers:
            ray.kill(w, no_restart=True)


def test_health_is_asked_of_all_workers_at_once(ray_local, monkeypatch):
    """Workers 0 and 2 answer only once both health calls are in flight; worker 1 is dead. The
    deadline is generous because it is never reached when the calls run at once (asked one after
    another, worker 0 would wait all of it and be restarted)."""
    import ray

    from sonar.cluster.wire import metrics as K

    gate = ray.remote(Gate).options(max_concurrency=16).remote(2)
    actor = ray.remote(FakeWorker).options(num_cpus=0)
    workers = [actor.remote(0, gate, 1.0), actor.remote(1, gate, 10.0), actor.remote(2, gate, 2.0)]
    ray.kill(workers[1], no_restart=True)
    wait_actor_dead(workers[1])
    try:
        m, restarted = _check(ray, workers, 120.0, monkeypatch)
    finally:
        ray.kill(gate, no_restart=True)
    assert [i for i, _ in restarted] == [1], restarted
    assert restarted[0][1].startswith("health: ActorDiedError")
    # Workers 0 and 2 answered: their counters, and only theirs, reach the metrics.
    assert m == {K.ROLLOUT_BUSY_S: 3.0}


def test_a_silent_worker_is_restarted_after_the_deadline(ray_local, monkeypatch):
    import ray

    gate = ray.remote(Gate).options(max_concurrency=16).remote(1)
    workers = [ray.remote(FakeWorker).options(num_cpus=0).remote(0, gate, 1.0, silent=True)]
    try:
        m, restarted = _check(ray, workers, 2.0, monkeypatch)
    finally:
        ray.kill(gate, no_restart=True)
    assert restarted == [(0, "health: no answer within 2 s")]
    assert m == {}
