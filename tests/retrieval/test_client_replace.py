"""A retrieval replica replaced in its slot (``RetrievalClient.replace_replica``): the client searches
through the new handle at once, a late failure of a request sent to the old one does not mark the new
one dead, and a pickled copy (what a worker restarted later gets) holds the new handle. No Ray: the
handles are stand-ins the client only stores and compares."""
import pickle

import pytest
from ray.exceptions import RayActorError

from sonar.retrieval.client import RetrievalClient


class Handle:
    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, Handle) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


def _client(*names):
    # recheck far away: no background probe of a dead slot is sent to a stand-in handle
    return RetrievalClient([Handle(n) for n in names], timeout_s=1.0, recheck_s=1e9)


def test_a_replaced_slot_is_healthy_and_picked_with_the_new_handle():
    c = _client("old")
    old = c.handles[0]
    c._mark_dead(0, RayActorError(error_msg="gone"))
    assert c.stats()["replicas"][0]["dead"] and c.stats()["replica_deaths"] == 1
    new = Handle("new")
    c.replace_replica(0, new)
    st = c.stats()
    assert st["replicas"][0]["dead"] is False and st["replica_replacements"] == 1
    assert c.handles == [new] and c._replicas[0].handle is new and c.handles[0] is not old
    assert c._pick() == 0  # the only slot is usable again (it raised "no healthy replica" before)
    c._release(0)


def test_a_late_failure_on_the_old_handle_does_not_mark_the_new_one_dead():
    c = _client("a", "b")
    old = c.handles[1]
    assert c._pick() == 0 and c._pick() == 1  # one request in flight on each slot (old handle on slot 1)
    c.replace_replica(1, Handle("b2"))
    assert c._replicas[1].inflight == 1  # the request in flight keeps its slot's load count
    err = c._map(1, RayActorError(error_msg="the old replica died"), old)
    assert err.kind == "connection"
    assert c.stats()["replicas"][1]["dead"] is False and c.stats()["replica_deaths"] == 0
    c._release(1)
    assert c._replicas[1].inflight == 0
    # a failure on the handle the slot holds now does mark it
    c._map(1, RayActorError(error_msg="the new one died"), c.handles[1])
    assert c.stats()["replicas"][1]["dead"] is True and c.stats()["replica_deaths"] == 1


def test_a_pickled_copy_holds_the_new_handle_and_bad_slots_are_refused():
    c = _client("a", "b")
    c.replace_replica(0, Handle("a2"))
    copy = pickle.loads(pickle.dumps(c))
    assert copy.handles == [Handle("a2"), Handle("b")]
    with pytest.raises(ValueError, match="slot 2 out of range: the client holds 2 replicas"):
        c.replace_replica(2, Handle("c"))
