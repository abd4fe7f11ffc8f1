"""A rollout worker that dies is restarted (cluster.max_worker_restarts) or fails the run loudly,
naming the worker; its claimed prompts are requeued, never lost."""
import pytest
import ray

from tests.waiting import wait_actor_dead

# Each test starts every role (retrieval, learner, two workers: Ray processes that import torch) and
# restarts one. Idle that takes about 2 minutes; on 2 busy cores shared with other runs (load average
# near 18) one test took 8-10 minutes, past the suite's 600 s hang guard. The guard stays a hang guard.
pytestmark = [pytest.mark.slow, pytest.mark.ray]  # slow: the 1,800 s hang guard (tests/conftest.py)


@pytest.fixture()
def roles_for(tmp_path, shared_ray):
    made = []

    def make(restarts: int):
        from sonar.cluster.wire.config import CONFIG_DIR, load_config
        from sonar.cluster.driver.roles import start_roles
        from sonar.cluster.driver.run import start_run

        cfg = load_config([CONFIG_DIR / "smoke.yaml"],
                          [f"run.root={tmp_path}", f"cluster.max_worker_restarts={restarts}", "tracking.enabled=false",
                           "cluster.health_timeout_s=30"])
        run = start_run(cfg)
        roles = start_roles(cfg, run)
        made.append(roles)
        return cfg, run, roles

    yield make
    from sonar.cluster.driver.roles import stop_roles

    for r in made:
        stop_roles(r)


def _start_rl(cfg, roles):
    stage = cfg.stages[1]
    ray.get(roles.learner.begin_stage.remote(1, stage))
    roles.pool.begin_stage(1, stage)
    return stage


def test_dead_worker_without_restarts_fails_the_run_naming_it(roles_for):
    from sonar.cluster.driver.rollout_pool import WorkerFailed

    cfg, run, roles = roles_for(0)
    _start_rl(cfg, roles)
    ray.kill(roles.workers[1], no_restart=True)
    wait_actor_dead(roles.workers[1])  # ray.kill returns before the actor is dead: a health call could still succeed
    with pytest.raises(WorkerFailed, match=r"rollout worker 1 failed .*max_worker_restarts=0"):
        roles.pool.health()
    roles.pool.workers.pop(1)  # gone for good: the stage ends without it
    roles.pool.end_stage()
