import asyncio

import pytest

from cluster.replay import PromptCursor, QueuedGroup, ReplayCore, ReplayQueue


def group(prompt, version, n=4, worker=0):
    return QueuedGroup(payload=b"x" * n, min_version=version, num_trajs=n, prompt_index=prompt, worker_id=worker)


def test_cursor_epochs_are_permutations_and_deterministic():
    a, b = PromptCursor(10, seed=3), PromptCursor(10, seed=3)
    first = a.take(10)
    assert sorted(first) == list(range(10)) and first == b.take(10)
    second = a.take(10)
    assert sorted(second) == list(range(10)) and second != first


def test_cursor_requeue_goes_first_and_state_round_trips():
    c = PromptCursor(7, seed=0)
    taken = c.take(3)
    c.requeue(taken[1:])
    state = c.state_dict()
    d = PromptCursor(7, seed=0)
    d.load_state_dict(state)
    assert c.take(5) == d.take(5)
    assert PromptCursor(7, seed=0).take(3)[1:] == taken[1:]


def test_cursor_state_for_another_dataset_is_refused():
    state = PromptCursor(7, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_prompts=7"):
        PromptCursor(8, seed=0).load_state_dict(state)


def test_staleness_bound_drops_and_counts():
    core = ReplayCore(capacity_groups=10, max_policy_lag=1, stale_policy="drop", num_prompts=20, seed=0)
    for p, v in enumerate([0, 1, 2, 3]):
        core.add(group(p, v))
    out, dropped = core.take(4, learner_version=3)
    assert [lag for _, lag, _ in out] == [1, 0] and [p for *_, p in out] == [2, 3]  # versions 2 and 3; 0 and 1 are older than lag 1
    assert dropped == 8 and core.counts["dropped_stale"] == 8 and core.counts["consumed"] == 8
    assert core.balance()["balanced"]


def test_downweight_policy_keeps_stale_groups():
    core = ReplayCore(10, 1, "downweight", 20, 0)
    core.add(group(0, 0))
    out, dropped = core.take(1, learner_version=5)
    assert dropped == 0 and out[0][1] == 5


def test_accounting_balances_through_drain_and_worker_death():
    core = ReplayCore(10, 2, "drop", 20, 0)
    claimed = core.claim(worker_id=1, n=3)
    core.add(group(claimed[0], 0, worker=1))
    assert core.release_worker(1) == 2  # the two undelivered claims are requeued
    assert core.cursor.take(2) == claimed[1:]
    core.add(group(5, 0))
    core.take(1, 0)
    assert core.drain() == 4
    b = core.balance()
    assert b["balanced"] and b["produced"] == 8 and b["consumed"] == 4 and b["requeued"] == 4


def test_state_dict_requeues_queued_prompts():
    core = ReplayCore(10, 2, "drop", 20, 0)
    idx = core.claim(0, 2)
    core.add(group(idx[0], 0))
    state = core.state_dict()
    fresh = ReplayCore(10, 2, "drop", 20, 0)
    fresh.load_state_dict(state)
    # the queued group's prompt and the outstanding claim come back first: nothing lost, nothing twice
    assert sorted(fresh.cursor.take(2)) == sorted(idx)
    assert fresh.balance()["balanced"]


def test_queue_actor_logic_backpressure_and_timeout():
    async def scenario():
        q = ReplayQueue(capacity_groups=1, max_policy_lag=4, stale_policy="drop", num_prompts=10, seed=0)
        assert await q.put(b"a", 0, 1, 0, 0)
        blocked = asyncio.create_task(q.put(b"b", 0, 1, 1, 0))
        await asyncio.sleep(0.05)
        assert not blocked.done()  # the queue is full: the producer waits
        got = await q.get(1, 0, timeout_s=1.0)
        assert got["groups"] == [b"a"]
        assert await asyncio.wait_for(blocked, 1.0)
        got = await q.get(2, 0, timeout_s=0.1)  # only one available: returns it after the timeout
        assert got["groups"] == [b"b"] and got["timed_out"]
        stats = await q.close()
        assert stats["balanced"]

    asyncio.run(scenario())


def test_closed_queue_requeues_the_producer_prompt():
    async def scenario():
        q = ReplayQueue(1, 4, "drop", 10, 0)
        idx = await q.claim(0, 2)
        assert await q.put(b"a", 0, 1, idx[0], 0)
        blocked = asyncio.create_task(q.put(b"b", 0, 1, idx[1], 0))
        await asyncio.sleep(0.05)
        await q.close()
        assert await blocked is False
        assert q.core.cursor.take(1) == [idx[1]]

    asyncio.run(scenario())
