"""A role's start-up runs without the cyclic garbage collector (cluster/wire/startup.py), which is back on
when the start-up ends, with the start-up's reference cycles in its youngest generation (freed by its next
young collection, not kept for a full one): the rollout worker's and the learner's ``__init__`` and the
driver's ``start_roles``."""
import gc
import weakref

import pytest

from sonar.cluster.wire.startup import startup_without_gc


class Node:
    pass


def _cycle() -> weakref.ref:
    """A two-object reference cycle nothing else holds: only the cyclic collector can free it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def collector_on():
    assert gc.isenabled(), "pytest runs with the collector on"
    yield
    assert gc.isenabled()


def test_paused_inside_and_back_on_with_the_blocks_cycles_young():
    gc.collect()
    with startup_without_gc():
        assert not gc.isenabled()
        before = gc.get_count()[0]
        ref = _cycle()
        assert gc.get_count()[0] > before  # allocations counted, no automatic collection run
    assert gc.isenabled()
    gc.collect(0)  # the next young collection (the collector's own, a few allocations on)
    assert ref() is None


def test_back_on_when_the_start_up_raises():
    with pytest.raises(RuntimeError, match="start-up failed"):
        with startup_without_gc():
            raise RuntimeError("start-up failed")
    assert gc.isenabled()


def test_a_pause_the_caller_holds_is_left_to_the_caller():
    gc.disable()
    try:
        with startup_without_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # not resumed behind the caller's back
        with startup_without_gc():
            with startup_without_gc():  # nested: the outer block resumes
                pass
            assert not gc.isenabled()
    finally:
        gc.enable()


def test_as_a_decorator_each_call_pauses_and_resumes():
    seen = []

    @startup_without_gc()
    def start(x):
        seen.append((x, gc.isenabled()))
        return x + 1

    assert start(1) == 2 and start(2) == 3  # a fresh pause per call, the wrapped function's result
    assert seen == [(1, False), (2, False)] and gc.isenabled()
    assert start.__wrapped__.__name__ == "start"


class Stop(Exception):
    """Raised by a patched first step of a role's start-up, once it recorded the collector's state."""


def _stop_recording(seen):
    def first_step(*args, **kwargs):
        seen.append(gc.isenabled())
        raise Stop
    return first_step


def test_the_rollout_workers_start_up_loads_its_policy_with_the_collector_paused(monkeypatch):
    import sonar.actors.worker as W
    from sonar.cluster.wire.config import load_config

    seen = []
    monkeypatch.setattr(W, "_set_threads", lambda n: None)  # this process's torch threads stay as they are
    monkeypatch.setattr(W, "load_policy", _stop_recording(seen))
    with pytest.raises(Stop):
        W.RolloutWorker(0, load_config([], []), retriever=object(), policy="unused")
    assert seen == [False] and gc.isenabled()


def test_the_learners_start_up_imports_deepspeed_with_the_collector_paused(monkeypatch):
    import sonar.learner.worker as L
    from sonar.cluster.wire.config import load_config

    import torch

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)  # the learner sets them before importing DeepSpeed: undone after
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    seen = []
    monkeypatch.setattr(L, "_import_deepspeed_without_shm_jit", _stop_recording(seen))
    with pytest.raises(Stop):
        L.Learner(load_config([], []), "unused")
    assert seen == [False] and gc.isenabled()


@pytest.mark.ray  # it calls start_roles (tests/backend_guard.py reads the call), whose init_ray is replaced here
def test_the_drivers_start_roles_runs_with_the_collector_paused(monkeypatch):
    import sonar.cluster.driver.roles as R
    from sonar.cluster.wire.config import load_config

    seen = []
    monkeypatch.setattr(R, "init_ray", _stop_recording(seen))
    with pytest.raises(Stop):
        R.start_roles(load_config([], []), run=None)
    assert seen == [False] and gc.isenabled()
