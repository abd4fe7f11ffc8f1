"""The elastic rollout pool's controller (``cluster/driver/pool.py``), on a fake clock: no Ray.

Closed forms for the window's shares, the grow/shrink/hold decisions at and away from the bounds, the
cooldown, the autoscaler bundles, and a pipeline simulation in which a starved learner grows the pool
to max_workers and a slow one shrinks it to min_workers. The drain's accounting is pinned on the replay
core: a drained worker's in-flight prompts are put or requeued, nothing is lost or trained twice."""
import pytest

from sonar.cluster.driver.pool import Pool, PoolController, wanted_bundles
from sonar.cluster.wire.config import load_config, pool_bounds
from sonar.cluster.replay.queue import QueuedGroup, ReplayCore


def ctl(size=2, lo=1, hi=4, window=10.0, cooldown=0.0, now=0.0):
    return PoolController(lo, hi, size, window_s=window, grow_wait_share=0.3, shrink_full_share=0.8,
                          cooldown_s=cooldown, now=now)


def feed(c, t0, steps, dt, wait, full):
    t = t0
    for _ in range(steps):
        t += dt
        c.observe(t, wait, full)
    return t


def test_shares_are_wait_over_wall_time_and_full_steps_over_steps():
    c = ctl()
    c.observe(1.0, 0.5, True)     # 1 s step, 0.5 s waiting
    c.observe(4.0, 0.5, False)    # 3 s step, 0.5 s waiting
    assert c.shares() == pytest.approx((1.0 / 4.0, 0.5))


def test_the_window_forgets_old_steps():
    c = ctl(window=10.0)
    t = feed(c, 0.0, 5, 1.0, 1.0, True)       # starved, full (contradictory on purpose)
    feed(c, t, 20, 1.0, 0.0, False)           # then 20 s of neither
    assert c.shares() == (0.0, 0.0)


def test_a_starved_learner_grows_the_pool_after_one_window():
    c = ctl(window=10.0)
    t = feed(c, 0.0, 9, 1.0, 0.6, False)
    assert c.decide(t) == 0                   # 9 s < the 10 s window
    t = feed(c, t, 2, 1.0, 0.6, False)
    assert c.decide(t) == 1


def test_a_slow_learner_shrinks_the_pool():
    c = ctl(window=10.0)
    t = feed(c, 0.0, 12, 1.0, 0.0, True)
    assert c.decide(t) == -1


def test_a_balanced_pipeline_holds():
    c = ctl(window=10.0)
    t = feed(c, 0.0, 12, 1.0, 0.1, False)     # 10 % waiting, never full
    assert c.decide(t) == 0
    t = feed(c, t, 12, 1.0, 0.0, False)
    assert c.decide(t) == 0


@pytest.mark.parametrize("size, wait, full", [(4, 0.9, False), (1, 0.0, True)])
def test_no_move_past_the_bounds(size, wait, full):
    c = ctl(size=size, lo=1, hi=4)
    t = feed(c, 0.0, 20, 1.0, wait, full)
    assert c.decide(t) == 0


def test_growing_wins_when_the_learner_waits_and_the_queue_was_full():
    c = ctl()
    t = feed(c, 0.0, 12, 1.0, 0.9, True)
    assert c.decide(t) == 1


def test_after_a_resize_the_cooldown_and_a_fresh_window_must_pass():
    c = ctl(window=5.0, cooldown=20.0)
    t = feed(c, 0.0, 25, 1.0, 0.9, False)
    assert c.decide(t) == 1
    c.resized(3, t)
    t2 = feed(c, t, 10, 1.0, 0.9, False)
    assert c.decide(t2) == 0                  # 10 s < 20 s cooldown
    t2 = feed(c, t2, 11, 1.0, 0.9, False)
    assert c.decide(t2) == 1 and c.size == 3


def test_controller_refuses_a_size_outside_its_bounds():
    with pytest.raises(ValueError, match="min_workers=2 <= size=1"):
        PoolController(2, 4, 1, window_s=1, grow_wait_share=0.5, shrink_full_share=0.5, cooldown_s=0, now=0)


def test_bounds_default_to_num_workers_a_fixed_pool():
    cfg = load_config([], ["rollout.num_workers=3"])
    assert pool_bounds(cfg) == (3, 3)
    assert pool_bounds(load_config([], ["rollout.min_workers=1", "rollout.max_workers=5"])) == (1, 5)


def test_the_autoscaler_is_asked_for_every_roles_bundle():
    cfg = load_config([], ["learner.num_gpus=1", "learner.num_cpus=2", "rollout.num_cpus_per_worker=1",
                           "rollout.num_gpus_per_worker=1", "retrieval.replicas=2",
                           "cluster.role_resources.retrieval.cpu_node=1", "cluster.role_resources.learner.big=1"])
    assert wanted_bundles(cfg, 3) == [{"CPU": 2.0, "GPU": 1.0, "big": 1.0}] + [{"CPU": 1.0, "GPU": 1.0}] * 3 + \
        [{"CPU": 1.0, "cpu_node": 1.0}] * 2
    two_ranks = load_config([], ["learner.num_cpus=2", "learner.num_ranks=2", "retrieval.num_cpus_per_replica=0"])
    assert wanted_bundles(two_ranks, 1) == [{"CPU": 2.0}] * 2 + [{"CPU": 1.0}]  # a bundle per rank; 0-CPU replica left out


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class SimPool(Pool):
    """The pool with its Ray side replaced by a size change (the decisions are the production ones)."""

    def _grow(self, roles):
        roles.workers.append(object())
        self._resized(roles)

    def _shrink(self, roles):
        roles.workers.pop()
        self._resized(roles)


class Roles:
    def __init__(self, n):
        self.workers = [object() for _ in range(n)]


@pytest.mark.parametrize("learner_s, expected", [(4.0, 1), (0.25, 4)])
def test_pipeline_simulation_slow_learner_shrinks_starved_learner_grows(learner_s, expected):
    """Each worker makes one group per second; the learner needs 4 groups per step and ``learner_s``
    seconds to train them. A slow learner (4 s a step, 1 group/s needed) leaves the queue full: the pool
    shrinks to 1; a fast one (0.25 s a step) waits: the pool grows to 4. Pool size over time is kept."""
    cfg = load_config([], ["rollout.num_workers=2", "rollout.min_workers=1", "rollout.max_workers=4",
                           "rollout.pool_window_s=10", "rollout.pool_cooldown_s=10", "replay.capacity_groups=8",
                           "learner.groups_per_step=4"])
    clock, roles = FakeClock(), Roles(2)
    pool = SimPool(cfg, 2, clock=clock)
    queue, made = 0.0, 0.0
    for _ in range(400):
        n = len(roles.workers)
        need = 4 - min(queue, 4)            # groups the learner still waits for
        wait = need / n
        clock.t += wait
        queue = max(0.0, queue + wait * n - 4)
        clock.t += learner_s                # training; the workers keep producing (up to capacity)
        queue = min(8.0, queue + learner_s * n)
        made += 1
        pool.step(roles, wait, int(queue))
    assert len(roles.workers) == expected
    sizes = [s for _, s in pool.history]
    assert sizes[0] == 2 and sizes[-1] == expected and all(1 <= s <= 4 for s in sizes)
    assert sorted(sizes, reverse=expected == 1) == sizes      # monotone: no flapping


def test_a_drained_workers_prompts_are_put_or_requeued_never_lost_or_trained_twice():
    """The drain as ``pool.regroup`` does it, on the replay core: worker 1 holds three claims; one group
    finishes and is put, one finishes after the queue closed (``put`` requeues its claim), one never
    starts; ``release_worker`` requeues what is left. Then worker 0 trains the whole epoch: every prompt
    exactly once and the balance holds."""
    core = ReplayCore(capacity_groups=100, max_policy_lag=10, stale_policy="drop", num_prompts=12, seed=0)
    a, b, c = core.claim(1, 3)
    core.add(QueuedGroup(b"x", 0, 4, a, 1))          # finished in flight: put
    core.requeue_claim(1, b)                          # finished after close: put refused, claim requeued
    assert core.release_worker(1) == 1                # c: still claimed when the worker is removed
    trained = [g.prompt_index for g in list(core.groups)]
    core.take(10, 0)
    while len(trained) < 12:
        (i,) = core.claim(0, 1)
        core.add(QueuedGroup(b"x", 0, 4, i, 0))
        core.take(1, 0)
        trained.append(i)
    assert sorted(trained) == list(range(12))         # each prompt of the epoch once
    bal = core.balance()
    assert bal["balanced"] and bal["produced"] == bal["consumed"] == 48 and not core.claims.get(1)
