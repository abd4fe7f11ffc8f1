"""``RolloutPool``'s one fault path (``cluster/driver/rollout_pool.py``) on fake actors: no torch, no engine.

The fakes keep the real transport's semantics that matter here: every rank of a formation (or a push)
waits at a rendezvous until all ``world_size`` ranks have arrived, or raises after the group's timeout
(``cluster.step_timeout_s``), so a dead rank leaves the others hanging exactly as a gloo group does. A
worker is killed with ``ray.kill`` on the handle the pool holds, at the pool's own event (``on_event``),
and the test waits until Ray reports it dead; the group's timeout then fires for the broken formation
as an event (``Rendezvous.expire``), not after a wall-clock wait, so a rank slowed by load is never taken
for a dead one and no test waits a timeout out: no sleeps.

Pinned: a worker killed while the group forms is replaced and the group formed again (generation 2,
every rank in it, the learner's version pushed); with no restart left the run fails at once, naming the
worker and the call, while the other ranks are still waiting; a worker killed mid-push is replaced, the
loops paused and resumed around the regroup, every worker at the learner's version; a call with
``retry`` is made again on the replacement after it holds the weights; the elastic pool's grow and
drain are regroups; the replaced worker's claims go back to the replay each time."""
import os
import threading

import pytest

from tests.ray_job import ray_for_module
from tests.waiting import wait_actor_dead, wait_until

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local(shared_ray):
    """A job on the session's cluster (tests/ray_job.py): these fakes ask for no CPUs."""
    with ray_for_module(__name__, shared_ray) as ray:
        yield ray


class Rendezvous:
    """An async actor: ``arrive(key, n, timeout_s)`` returns once ``n`` ranks arrived under ``key``, or
    raises ``TimeoutError`` after ``timeout_s`` (a group with a dead rank). ``waiting(key)``: ranks of
    ``key`` still waiting now. ``expire(generation)``: the group's timeout, fired as an event instead of
    waited for: every rank waiting at a rendezvous of that formation (``key[1]``), or arriving at one
    later, raises it at once (the formation a test has broken by killing a rank in it)."""

    def __init__(self):
        self.arrived, self.events, self.waiters, self.needed, self.expired = {}, {}, {}, {}, set()

    async def arrive(self, key, n: int, timeout_s: float) -> int:
        import asyncio

        ev = self.events.setdefault(key, asyncio.Event())
        self.needed[key] = n
        self.arrived[key] = self.arrived.get(key, 0) + 1
        if self.arrived[key] >= n:
            ev.set()
        self.waiters[key] = self.waiters.get(key, 0) + 1
        try:
            if key[1] not in self.expired:
                await asyncio.wait_for(ev.wait(), timeout_s)
            if self.arrived[key] < n:  # expired
                raise asyncio.TimeoutError
        except asyncio.TimeoutError:
            raise TimeoutError(f"rendezvous {key}: {self.arrived[key]} of {n} ranks within {timeout_s} s") from None
        finally:
            self.waiters[key] -= 1
        return self.arrived[key]

    async def expire(self, generation: int) -> None:
        self.expired.add(generation)
        for key, ev in self.events.items():
            if key[1] == generation and self.arrived[key] < self.needed[key]:
                ev.set()

    async def waiting(self, key) -> int:
        return self.waiters.get(key, 0)


class Member:
    """A fake rank: the learner (``name="learner"``) or a rollout worker."""

    def __init__(self, name: str, group, timeout_s: float):
        self.name, self.group, self.timeout_s = name, group, timeout_s
        self.version, self.generation, self.loop = 0, None, False

    def _arrive(self, key, n):
        import ray

        ray.get(self.group.arrive.remote(key, n, self.timeout_s))

    def ready(self) -> dict:
        return {"pid": os.getpid(), "name": self.name}

    def ping(self) -> dict:
        return {"version": self.version, "pid": os.getpid()}

    def bump(self) -> int:  # the learner trains a step
        self.version += 1
        return self.version

    def broadcast_ranks(self) -> int:
        return 1

    def open(self, world_size: int):
        return "127.0.0.1", 1

    def join(self, generation: int, rank: int, world_size: int) -> str:
        self._arrive(("join", generation), world_size)
        self.generation = generation
        return "layout-digest"

    def push(self, generation: int, world_size: int, version: int | None) -> dict:
        version = self.version if version is None else version
        self._arrive(("push", generation, version), world_size)
        self.version = version
        return {"seconds": 0.5, "bytes": 1000}

    def start(self, replay, index, stage) -> bool:
        self.loop = True
        return True

    def stop(self, timeout_s: float = 120.0) -> dict:
        self.loop = False
        return {}

    def health(self) -> dict:
        return {"alive": self.loop, "error": None, "idle_s": 0.0, "stats": {"trajectories": 0}}

    def evaluate(self, questions, search, stage) -> list:
        return [{"q": q, "by": self.name, "version": self.version} for q in questions]

    def state(self) -> dict:
        return {"name": self.name, "version": self.version, "generation": self.generation, "loop": self.loop}


class FakeTransport:
    """A ``WeightTransport`` over ``Member`` and ``Rendezvous``: the learner is rank 0. ``abort`` expires the
    formation at the rendezvous (its waiting ranks raise at once, as the real presence barrier's do) and
    records ``(generation, reason)`` in ``aborted``."""

    def __init__(self, learner, group):
        self.learner, self.group, self.ep, self.aborted = learner, group, None, []

    def abort(self, ep, reason):
        import ray

        self.aborted.append((ep.generation, reason))
        ray.get(self.group.expire.remote(ep.generation))

    def ranks(self, worker):
        return worker.broadcast_ranks.remote()

    def open(self, world_size):
        return self.learner.open.remote(world_size)

    def join_source(self, ep):
        self.ep = ep
        return self.learner.join.remote(ep.generation, 0, ep.world_size)

    def join(self, worker, ep, rank):
        return worker.join.remote(ep.generation, rank, ep.world_size)

    def send(self):
        return self.learner.push.remote(self.ep.generation, self.ep.world_size, None)

    def receive(self, worker, version):
        return worker.push.remote(self.ep.generation, self.ep.world_size, version)


class Replay:
    """The replay's calls the pool makes, recorded in order; worker i holds 3 claims until released."""

    def __init__(self):
        self.log = []
        self.pushed = []  # set_engine_version's versions (not in the log either)

    def set_engine_version(self, version: int) -> None:
        self.pushed.append(version)

    def engine_versions(self) -> list[int]:
        return list(self.pushed)

    def release_worker(self, i: int) -> int:
        self.log.append(("release_worker", i))
        return 3

    def set_workers(self, n: int) -> None:
        self.workers = n  # not in the log: the order tests read the calls that pause and resume the loops

    def close(self):
        self.log.append(("close",))

    def reopen(self):
        self.log.append(("reopen",))

    def drain(self):
        self.log.append(("drain",))

    def calls(self):
        return list(self.log)


class KillAt:
    """``on_event``: at the ``nth`` ``event`` (counting only when ``when(pool)``), kill worker ``index`` by
    the handle the pool holds, and return once Ray reports it dead. With ``expire`` (the default), the
    group's timeout then fires for the formation the kill broke (``Rendezvous.expire``; ``make_pool`` gives
    the group), so the other ranks give up as they would after it, without the test waiting it out."""

    def __init__(self, event: str, index: int, nth: int = 1, when=lambda pool: True, expire: bool = True):
        self.event, self.index, self.nth, self.when, self.expire = event, index, nth, when, expire
        self.seen, self.killed, self.group = 0, [], None

    def __call__(self, event, pool):
        import ray

        if event != self.event or not self.when(pool):
            return
        self.seen += 1
        if self.seen == self.nth:
            handle = pool.workers[self.index]
            ray.kill(handle, no_restart=True)
            wait_actor_dead(handle)
            self.killed.append(handle)
            if self.expire:
                ray.get(self.group.expire.remote(pool.generation))


GROUP_TIMEOUT_S = 600.0
"""The fake group's timeout, as the real group's (``cluster.step_timeout_s``): healthy ranks must all
arrive within it whatever the load; a formation a test breaks gives up at once (``Rendezvous.expire``),
so no test waits it out."""
SILENT_CALL_S = 5.0
"""A call's deadline in the silent-worker test: worker 0 must answer ``ready`` within it whatever the load
(it was 0.5 s); worker 1, waiting at a rendezvous that never completes, is silent at it."""


def make_pool(ray, n=2, restarts=1, timeout_s=GROUP_TIMEOUT_S, on_event=None, mode="async"):
    """``timeout_s``: the fake group's timeout (a rank alone at a rendezvous raises after it). The pool's
    own deadlines (``cluster.step_timeout_s``, ``cluster.health_timeout_s``: a new actor must start within
    them on a loaded machine) are longer, as the real group's timeout is ``cluster.step_timeout_s``."""
    from sonar.cluster.driver.rollout_pool import RolloutPool
    from sonar.cluster.wire.config import load_config

    cfg = load_config([], ["cluster.step_timeout_s=120", "cluster.health_timeout_s=120",
                           f"cluster.max_worker_restarts={restarts}", f"cluster.mode={mode}"])
    group = ray.remote(Rendezvous).options(num_cpus=0, max_concurrency=64).remote()
    if isinstance(on_event, KillAt):
        on_event.group = group
    member = ray.remote(Member).options(num_cpus=0, max_concurrency=8)
    learner = member.remote("learner", group, timeout_s)
    replay = ray.remote(Replay).options(num_cpus=0).remote()
    started = []

    def start(i):
        started.append(i)
        return member.remote(f"worker{i}#{started.count(i)}", group, timeout_s)

    pool = RolloutPool(cfg, learner=learner, replay=replay, transport=FakeTransport(learner, group), start=start,
                       on_event=on_event)
    pool.start(n)
    pool.ready()
    return pool, learner, replay, group, started


def states(ray, pool):
    return ray.get([w.state.remote() for w in pool.workers])


def teardown(ray, pool, *handles):
    pool.kill()
    for h in handles:
        ray.kill(h, no_restart=True)


def test_a_worker_killed_while_the_group_forms_is_replaced_and_the_group_formed_again(ray_local):
    """The kill lands after the learner opened its endpoint, before any rank joined: the pool, finding
    worker 1 dead, calls the formation off (the test expires nothing: the learner's and worker 0's
    rendezvous end by the pool's abort, not the group's 600 s timeout), worker 1 is replaced (its 3 claims
    requeued) and the second formation holds every rank, at the learner's version."""
    ray = ray_local
    kill = KillAt("group_open", 1, expire=False)
    pool, learner, replay, group, started = make_pool(ray, on_event=kill)
    try:
        pool.form_group()
        assert pool.transport.aborted == [(1, "rollout worker 1 died before the group formed (generation 1)")]
        assert len(kill.killed) == 1 and pool.workers[1] is not kill.killed[0]
        assert pool.restarts == {0: 0, 1: 1} and started == [0, 1, 1]
        assert pool.generation == 2
        assert ray.get(group.waiting.remote(("join", 1))) == 0  # the abandoned formation's ranks gave up
        assert [(s["name"], s["generation"], s["version"]) for s in states(ray, pool)] == \
            [("worker0#1", 2, 0), ("worker1#2", 2, 0)]
        assert ray.get(replay.calls.remote()) == [("release_worker", 1)]  # not running: no pause
    finally:
        teardown(ray, pool, learner, replay, group)


def test_with_no_restart_left_the_run_fails_at_once_naming_the_worker(ray_local):
    """``cluster.max_worker_restarts=0``: ``WorkerFailed`` names worker 1, the call and Ray's error, once the
    formation is called off (the run does not wait out the group's timeout, 600 s here, to report it, and
    the learner and worker 0 do not wait it out either)."""
    from sonar.cluster.driver.rollout_pool import WorkerFailed

    ray = ray_local
    pool, learner, replay, group, started = make_pool(ray, restarts=0, on_event=KillAt("group_open", 1, expire=False))
    try:
        with pytest.raises(WorkerFailed, match=r"rollout worker 1 failed \(3 prompts requeued\) and "
                                               r"cluster\.max_worker_restarts=0 is used up:\njoin: ActorDiedError"):
            pool.form_group()
        assert pool.transport.aborted == [(1, "rollout worker 1 died before the group formed (generation 1)")]
        wait_until(lambda: ray.get(group.waiting.remote(("join", 1))) == 0, what="the called-off formation's ranks")
        assert started == [0, 1] and pool.restarts == {0: 0, 1: 0}
    finally:
        teardown(ray, pool, learner, replay, group)


@pytest.mark.parametrize("dead", [0, 1])
def test_a_worker_killed_mid_push_is_replaced_and_the_next_push_reaches_every_worker(ray_local, dead):
    """In an async RL stage: the learner has sent version 1 when worker ``dead`` dies, at either rank
    position. The pool calls the push off (``WeightTransport.abort``): the learner and the surviving worker,
    waiting for ranks that will never arrive, give up at once, not at the group's 600 s timeout (the kill
    does not expire the group here; only the call-off can). The push comes back empty, the worker is
    replaced, and the regroup pauses the loops (replay closed, loops stopped), forms the group again and
    pushes version 1 to every worker, then starts every loop, the new worker's too. The next push (version
    2) reaches every worker."""
    from sonar.cluster.wire import metrics as K

    ray = ray_local
    kill = KillAt("push_sent", dead, when=lambda pool: pool.active is not None, expire=False)
    pool, learner, replay, group, started = make_pool(ray, on_event=kill)
    try:
        pool.form_group()
        pool.begin_stage(1, object())
        ray.get(learner.bump.remote())
        assert pool.push() == {}  # the broken push's figures are not reported
        assert pool.transport.aborted == [(1, f"rollout worker {dead} died during the push of version 1 (generation 1)")]
        assert pool.push_call_offs == 1
        assert len(kill.killed) == 1 and pool.restarts == {0: 0, 1: 0, dead: 1} and pool.generation == 2
        names = ["worker0#1", "worker1#1"]
        names[dead] = f"worker{dead}#2"
        assert [(s["name"], s["generation"], s["version"], s["loop"]) for s in states(ray, pool)] == \
            [(names[0], 2, 1, True), (names[1], 2, 1, True)]
        assert ray.get(replay.calls.remote()) == [("release_worker", dead), ("close",), ("reopen",)]
        ray.get(learner.bump.remote())
        m = pool.push()
        assert m == {K.WEIGHTS_SYNC_S: 0.5, K.WEIGHTS_GBPS: pytest.approx(1000 / 0.5 / 1e9),  # 1000 B in 0.5 s
                     K.WEIGHTS_BYTES: 1000}
        assert [s["version"] for s in states(ray, pool)] == [2, 2]
        # the replay hears of a version once every worker holds it: the formation's 0, the regroup's push of 1,
        # then 2, never the broken push (a claim read at a version its worker lacks would get the wrong slots)
        assert ray.get(replay.engine_versions.remote()) == [0, 1, 2]
    finally:
        teardown(ray, pool, learner, replay, group)


def test_a_retried_call_reaches_the_replacement_once_it_holds_the_weights(ray_local):
    """``evaluate`` (``retry``): worker 1 is dead when the shards go out; its shard is evaluated by its
    replacement, after the regroup pushed it the learner's version 3 (never on the initial policy)."""
    ray = ray_local
    pool, learner, replay, group, started = make_pool(ray)
    try:
        pool.form_group()
        for _ in range(3):
            ray.get(learner.bump.remote())
        pool.push()
        dead = pool.workers[1]
        ray.kill(dead, no_restart=True)
        wait_actor_dead(dead)
        recs = pool.evaluate(list(range(5)), True, None)
        assert [(r["q"], r["by"], r["version"]) for r in recs] == \
            [(0, "worker0#1", 3), (2, "worker0#1", 3), (4, "worker0#1", 3), (1, "worker1#2", 3), (3, "worker1#2", 3)]
        assert pool.restarts == {0: 0, 1: 1}
    finally:
        teardown(ray, pool, learner, replay, group)


def test_a_silent_worker_is_replaced_and_a_call_error_propagates(ray_local):
    """No answer by the deadline is a fault like a death; an error the call raises is the call's own."""
    ray = ray_local
    pool, learner, replay, group, started = make_pool(ray)
    try:
        pool.form_group()
        # nobody else arrives: the group's timeout fires once worker 0 waits there (an event, not 600 s)
        fire = threading.Thread(target=lambda: (
            wait_until(lambda: ray.get(group.waiting.remote(("push", 1, 7))) == 1, what="worker 0 at the rendezvous"),
            ray.get(group.expire.remote(1))))
        fire.start()
        with pytest.raises(TimeoutError, match=r"rendezvous \('push', 1, 7\): 1 of 2"):
            pool.call("lone push", lambda w, i: w.push.remote(1, 2, 7), only=[0])
        fire.join()
        assert pool.restarts == {0: 0, 1: 0}
        out = pool.call("silent", lambda w, i: w.push.remote(9, 3, 1) if i == 1 else w.ready.remote(),
                        timeout=SILENT_CALL_S)  # worker 1 waits for a rendezvous that never completes
        assert out[1] is not None and repr(out[1]) == "<worker died>" and out[0]["name"] == "worker0#1"
        assert pool.restarts == {0: 0, 1: 1} and pool.generation == 2  # replaced, and the group re-formed
    finally:
        teardown(ray, pool, learner, replay, group)


def test_the_elastic_pool_grows_and_drains_through_regroups(ray_local):
    """A candidate joins once ready (a regroup of 3 + the learner); a drain removes the highest worker
    (its claims requeued) in a regroup of 2; the loops are paused around both."""
    ray = ray_local
    pool, learner, replay, group, started = make_pool(ray)
    try:
        pool.form_group()
        pool.begin_stage(1, object())
        assert pool.add_candidate() == 2 and len(pool.workers) == 2
        wait_until(lambda: pool.candidate() == "", what="the candidate to be ready")
        pool.admit_candidate()
        assert len(pool.workers) == 3 and pool.generation == 2 and pool.restarts == {0: 0, 1: 0, 2: 0}
        assert [(s["generation"], s["loop"]) for s in states(ray, pool)] == [(2, True)] * 3
        assert pool.shrink() == 3
        assert len(pool.workers) == 2 and pool.generation == 3
        assert [(s["generation"], s["loop"]) for s in states(ray, pool)] == [(3, True)] * 2
        assert ray.get(replay.calls.remote()) == [("close",), ("reopen",), ("close",), ("release_worker", 2),
                                                  ("reopen",)]
    finally:
        teardown(ray, pool, learner, replay, group)
