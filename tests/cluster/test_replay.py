import asyncio
import random
import time

import pytest

from sonar.cluster.replay.queue import PromptCursor, QueuedGroup, ReplayCore, ReplayQueue
from tests.waiting import await_until, settle


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


def test_policy_lag():
    from sonar.cluster.replay.queue import policy_lag

    assert policy_lag(10, 10) == 0
    assert policy_lag(10, 7) == 3
    assert policy_lag(5, -1) == 0  # no MODEL token: nothing to correct
    with pytest.raises(ValueError, match="min_version=6 > learner_version=5"):
        policy_lag(5, 6)


def test_a_group_without_model_tokens_is_never_stale():
    """min_version -1 is lag 0 (it was learner_version + 1, so such a group was dropped as stale)."""
    core = ReplayCore(10, 1, "drop", 20, 0)
    core.add(group(0, -1))
    out, dropped = core.take(1, learner_version=5)
    assert dropped == 0 and [lag for _, lag, _ in out] == [0]


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
        idx = await q.claim(0, 2)
        assert await q.put(b"a", 0, 1, idx[0], 0)
        blocked = asyncio.create_task(q.put(b"b", 0, 1, idx[1], 0))
        await settle()
        assert not blocked.done()  # the queue is full: the producer waits
        got = await q.get(1, 0, timeout_s=1.0)
        assert got["groups"] == [b"a"]
        await await_until(blocked.done, what="the get to wake the blocked put")
        assert blocked.result()
        got = await q.get(2, 0, timeout_s=0.1)  # one of two available: nothing handed out, b stays queued
        assert got["groups"] == [] and got["timed_out"]
        assert (await q.stats())["depth_groups"] == 1 and (await q.stats())["consumed_groups"] == 1
        stats = await q.close()
        assert stats["balanced"] and stats["queued"] == 1

    asyncio.run(scenario())


def test_rollout_records_travel_with_their_groups_and_each_is_reported_once():
    """The driver reads the rollout metrics from the replay's report after each trained step. A group's
    records count from the moment the replay accepts it: those of groups put before a learner call that
    came back waiting (no row logged) are in the next report; a report drains them; a refused put's are
    not kept; a new stage starts without the previous stage's."""
    from sonar.cluster.replay import queue as Q

    async def scenario():
        q = ReplayQueue(4, 4, "drop", 10, 0)
        idx = await q.claim(0, 4)
        assert await q.put(b"a", 0, 1, idx[0], 0, records=[{"reward": 1.0}])
        assert (await q.get(2, 0, timeout_s=0.05))["timed_out"]  # a learner call that came back waiting
        assert await q.put(b"b", 0, 1, idx[1], 0, records=[{"reward": 0.0}])
        first = await q.report()
        assert first["records"] == [{"reward": 1.0}, {"reward": 0.0}] and first["records_dropped"] == 0
        assert (await q.report())["records"] == []  # reported once
        assert not await q.put(b"c", 0, 1, 9, 1, records=[{"reward": 5.0}])  # no claim: refused, not kept
        assert await q.put(b"d", 0, 1, idx[2], 0, records=[{"reward": 2.0}])
        await q.close()
        await q.reopen()  # the next stage
        assert (await q.report())["records"] == []
        q._keep([{"n": i} for i in range(Q.RECORDS_KEPT + 3)])  # a driver that stopped reading
        last = await q.report()
        assert len(last["records"]) == Q.RECORDS_KEPT and last["records"][0] == {"n": 3} and last["records_dropped"] == 3

    asyncio.run(scenario())


def test_closed_queue_requeues_the_producer_prompt():
    async def scenario():
        q = ReplayQueue(1, 4, "drop", 10, 0)
        idx = await q.claim(0, 2)
        assert await q.put(b"a", 0, 1, idx[0], 0)
        blocked = asyncio.create_task(q.put(b"b", 0, 1, idx[1], 0))
        await settle()
        assert not blocked.done()  # the queue is full: the producer waits
        await q.close()
        assert await blocked is False
        assert q.core.cursor.take(1) == [idx[1]]

    asyncio.run(scenario())


# -- admission budget (replay.max_inflight_groups) ------------------------------------------------

def test_budget_must_not_be_negative():
    with pytest.raises(ValueError, match="max_inflight_groups=-1"):
        ReplayCore(10, 2, "drop", 20, 0, max_inflight_groups=-1)
    with pytest.raises(ValueError, match="max_inflight_groups=-3"):
        ReplayQueue(10, 2, "drop", 20, 0, -3)


def test_budget_counts_claims_and_queued_groups():
    core = ReplayCore(capacity_groups=10, max_policy_lag=2, stale_policy="drop", num_prompts=50, seed=0,
                      max_inflight_groups=4)
    assert core.inflight() == 0 and core.may_claim(4) and core.may_claim(6)  # empty: anything goes
    a = core.claim(0, 2)
    assert core.inflight() == 2 and core.may_claim(2) and not core.may_claim(3)
    b = core.claim(1, 2)
    assert core.inflight() == 4 and not core.may_claim(1) and not core.may_claim(2)
    # a put moves a group from "claimed" to "queued": still in the pipeline, the budget stays full
    core.add(group(a[0], 0, worker=0))
    assert core.inflight() == 4 and len(core.claims[0]) == 1 and not core.may_claim(1)
    # the learner's take frees it
    out, _ = core.take(1, learner_version=0)
    assert [p for *_, p in out] == [a[0]]
    assert core.inflight() == 3 and core.may_claim(1) and not core.may_claim(2)
    # a stale group dropped by take frees its slot as well
    core.add(group(a[1], 0, worker=0))
    assert core.inflight() == 3
    out, dropped = core.take(1, learner_version=5)
    assert out == [] and dropped == 4 and core.inflight() == 2 and core.may_claim(2)
    # release_worker (a dead worker) frees its outstanding claims
    assert core.release_worker(1) == 2
    assert core.inflight() == 0 and core.cursor.take(2) == b
    # drain frees queued groups
    c = core.claim(2, 2)
    core.add(group(c[0], 0, worker=2))
    core.add(group(c[1], 0, worker=2))
    core.claim(2, 2)
    assert core.inflight() == 4 and not core.may_claim(1)
    assert core.drain() == 8
    assert core.inflight() == 2 and core.may_claim(2) and not core.may_claim(3)
    assert core.balance()["balanced"]


def test_request_larger_than_budget_runs_only_alone():
    core = ReplayCore(10, 2, "drop", 50, 0, max_inflight_groups=4)
    core.claim(0, 1)
    assert not core.may_claim(6)  # something in the pipeline: the oversized request waits
    core.release_worker(0)
    assert core.inflight() == 0 and core.may_claim(6)  # empty pipeline: it must run, or nothing ever would
    idx = core.claim(0, 6)
    assert core.inflight() == 6 and not core.may_claim(1)  # and it runs alone
    for p in idx[:3]:
        core.add(group(p, 0))
    core.take(3, 0)
    assert core.inflight() == 3 and core.may_claim(1) and not core.may_claim(2)
    # a queued group alone also makes the pipeline non-empty
    for p in idx[3:]:
        core.add(group(p, 0))
    core.take(2, 0)
    assert core.inflight() == 1 and not core.may_claim(6) and core.may_claim(3)
    core.take(1, 0)
    assert core.inflight() == 0 and core.may_claim(6)
    assert core.balance()["balanced"]


def test_unlimited_budget_never_refuses():
    core = ReplayCore(1000, 2, "drop", 50, 0)  # default: 0 = unlimited
    assert core.max_inflight == 0
    for w in range(20):
        assert core.may_claim(100)
        idx = core.claim(w % 3, 7)
        for p in idx[:3]:
            core.add(group(p, 0, worker=w % 3))
    assert core.inflight() == 20 * 7 and core.may_claim(1) and core.may_claim(10_000)


def test_accounting_balances_with_the_budget_on():
    core = ReplayCore(10, 1, "drop", 30, 0, max_inflight_groups=6)
    version, drained_groups, refused = 0, 0, 0
    for round_ in range(30):
        for w in range(3):
            if not core.may_claim(2):
                refused += 1
                continue
            for p in core.claim(w, 2)[: 1 + (round_ + w) % 2]:  # put one or both, keep the rest claimed
                core.add(group(p, version - (round_ % 3), n=2 + w, worker=w))
            assert core.balance()["balanced"] and core.inflight() <= 6
        version += 1
        core.take(2, version)
        assert core.balance()["balanced"]
        if round_ % 7 == 3:
            core.release_worker(round_ % 3)
        if round_ % 11 == 5:
            drained_groups += len(core.groups)
            core.drain()
        assert core.balance()["balanced"] and core.inflight() <= 6
    b = core.balance()
    assert refused > 0  # the budget did hold producers back
    assert b["dropped_stale"] > 0 and b["consumed"] > 0 and b["requeued"] > 0  # every path was exercised
    assert b["produced_groups"] == b["consumed_groups"] + b["dropped_groups"] + drained_groups + len(core.groups)
    assert core.inflight() == len(core.groups) + sum(len(v) for v in core.claims.values())


def _queue(budget: int, capacity: int = 100) -> ReplayQueue:
    return ReplayQueue(capacity_groups=capacity, max_policy_lag=100, stale_policy="drop", num_prompts=1000, seed=0,
                       max_inflight_groups=budget)


def test_blocked_claim_times_out_with_nothing():
    async def scenario():
        q = _queue(4)
        await q.claim(0, 2)
        await q.claim(1, 2)
        refused = asyncio.create_task(q.claim(2, 1))  # default wait_s=0: refused at once
        await settle()
        assert refused.done() and refused.result() == []
        wait_s = 0.3
        t0 = time.monotonic()
        assert await q.claim(2, 1, wait_s) == []
        assert time.monotonic() - t0 >= wait_s * 0.9  # it waited out wait_s (a load only lengthens this)
        assert q.core.inflight() == 4 and 2 not in q.core.claims  # nothing was claimed on the way out
        # a claim within the budget does not wait at all
        q2 = _queue(4)
        within = asyncio.create_task(q2.claim(0, 3, 60.0))
        await settle()
        assert within.done() and len(within.result()) == 3

    asyncio.run(scenario())


def test_learner_get_wakes_a_blocked_claim():
    async def scenario():
        q = _queue(4)
        a = await q.claim(0, 2)
        b = await q.claim(1, 2)
        for p in a:
            assert await q.put(b"g", 0, 1, p, 0)  # queued: still in the pipeline
        blocked = asyncio.create_task(q.claim(2, 2, 600.0))  # only an event can end this wait in time
        await settle()
        assert not blocked.done()  # put does not free budget
        got = await q.get(2, 0, timeout_s=1.0)
        assert got["prompts"] == a and not got["timed_out"]
        await await_until(blocked.done, what="the get to wake the blocked claim")
        idx = blocked.result()
        assert len(idx) == 2 and not set(idx) & set(a + b)
        assert q.core.claims[2] == idx and q.core.inflight() == 4

    asyncio.run(scenario())


def test_learner_get_wakes_a_claim_when_it_takes_stale_groups_too():
    async def scenario():
        q = ReplayQueue(100, 0, "drop", 100, 0, 2)
        a = await q.claim(0, 2)
        for p in a:
            await q.put(b"g", 0, 1, p, 0)
        blocked = asyncio.create_task(q.claim(1, 1, 600.0))
        await settle()
        assert not blocked.done()
        got = await q.get(1, learner_version=3, timeout_s=0.2)  # both stale: dropped, the get times out
        assert got["groups"] == [] and got["dropped"] == 2
        await await_until(blocked.done, what="the stale drop to wake the blocked claim")
        assert len(blocked.result()) == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["release_worker", "drain"])
def test_release_and_drain_wake_a_blocked_claim(how):
    async def scenario():
        q = _queue(2)
        a = await q.claim(0, 2)
        if how == "drain":
            for p in a:
                await q.put(b"g", 0, 1, p, 0)
        blocked = asyncio.create_task(q.claim(1, 2, 600.0))
        await settle()
        assert not blocked.done()
        if how == "drain":
            assert await q.drain() == 2
        else:
            assert await q.release_worker(0) == 2
        await await_until(blocked.done, what=f"{how} to wake the blocked claim")
        assert sorted(blocked.result()) == sorted(a)  # the requeued prompts come back first

    asyncio.run(scenario())


def test_closed_queue_refuses_claims_over_budget_at_once():
    async def scenario():
        q = _queue(4)
        await q.claim(0, 4)
        blocked = asyncio.create_task(q.claim(1, 1, 600.0))
        await settle()
        assert not blocked.done()
        await q.close()
        await await_until(blocked.done, what="close to wake the blocked claim")
        assert blocked.result() == []
        after = asyncio.create_task(q.claim(1, 1, 600.0))  # after close: no waiting at all
        await settle()
        assert after.done() and after.result() == []
        assert 1 not in q.core.claims and q.core.inflight() == 4
        await q.release_worker(0)
        assert len(await q.claim(1, 1, 5.0)) == 1  # within budget a closed queue still hands out prompts
        await q.reopen()
        assert len(await q.claim(1, 3, 0.0)) == 3

    asyncio.run(scenario())


# -- property: the budget holds under random producer/consumer interleavings ---------------------

def _check_admission(core, budget: int, events: list):
    """Wrap core.claim: every admitted request fits the budget, or runs alone in an empty pipeline."""
    real = core.claim

    def claim(worker_id, n, now=None):
        before = core.inflight()
        assert before + n <= budget or before == 0, (before, n, budget)
        events.append((before, n))
        return real(worker_id, n, now)

    core.claim = claim


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_property_budget_holds_under_random_interleavings(seed):
    rng = random.Random(seed)
    budget, B = 6, 3
    core = ReplayCore(capacity_groups=8, max_policy_lag=1, stale_policy="drop", num_prompts=40, seed=seed,
                      max_inflight_groups=budget)
    admitted: list = []
    _check_admission(core, budget, admitted)
    held = {w: [] for w in range(3)}  # the fake workers' view: claimed prompts not yet put
    version, drained_groups, refused, oversized = 0, 0, 0, 0
    wants = {w: 0 for w in range(3)}  # a refused oversized request is asked for again (a worker retrying)
    limit = budget  # what inflight may reach: the budget, or an oversized request running alone
    for _ in range(2000):
        op = rng.random()
        w = rng.randrange(3)
        before, grew_alone = core.inflight(), False
        if op < 0.40:  # a worker asks for 1-2 groups (rarely a request larger than the budget)
            n = wants[w] or (rng.choice([1, 2]) if rng.random() > 0.02 else budget + 2)
            if core.may_claim(n):
                held[w].extend(core.claim(w, n))
                wants[w] = 0
                if n > budget:
                    assert before == 0
                    oversized += 1
                    limit, grew_alone = n, True
            else:
                refused += 1
                assert before + n > budget and before > 0
                wants[w] = n if n > budget else 0
        elif op < 0.75:  # a worker puts one of its groups (if the queue has room)
            if held[w] and not core.full():
                p = held[w].pop(rng.randrange(len(held[w])))
                core.add(group(p, version - rng.choice([0, 0, 0, 2]), n=rng.randint(1, 4), worker=w))
        elif op < 0.97:  # the learner takes B groups and steps
            core.take(B, version)
            version += rng.random() < 0.5
        elif op < 0.99:  # a worker dies
            core.release_worker(w)
            held[w] = []
        else:  # a stage ends
            drained_groups += len(core.groups)
            core.drain()
        now = core.inflight()
        assert now == len(core.groups) + sum(len(v) for v in held.values())  # the budget's count is honest
        assert now <= limit, (now, limit)
        if now > budget:
            assert now <= before or grew_alone  # above the budget the pipeline only drains
        else:
            limit = budget
    b = core.balance()
    assert b["balanced"]
    assert b["produced_groups"] == b["consumed_groups"] + b["dropped_groups"] + drained_groups + len(core.groups)
    # the run exercised what it claims to: refusals, the budget reached, stale drops, an oversized request
    assert refused > 50 and max(bf + n for bf, n in admitted) == budget + 2 and oversized >= 1
    assert any(bf + n == budget for bf, n in admitted) and b["dropped_groups"] > 0


@pytest.mark.timeout(60)
def test_property_budget_holds_with_concurrent_async_workers_and_learner():
    """Three worker tasks (claim -> "generate" -> put) and a learner task (get B) on the async queue:
    the admission check runs at every claim, and inflight is sampled after every step."""
    budget, B = 6, 3

    async def scenario():
        rng = random.Random(7)
        q = ReplayQueue(8, 100, "drop", 200, 0, budget)
        admitted: list = []
        _check_admission(q.core, budget, admitted)
        peak, stop, taken = [0], asyncio.Event(), [0]

        def sample():
            peak[0] = max(peak[0], q.core.inflight())
            assert q.core.inflight() <= budget

        async def worker(w: int):
            while not stop.is_set():
                idx = await q.claim(w, rng.choice([1, 2]), 0.05)
                sample()
                if not idx:
                    await asyncio.sleep(0)  # a real worker's claim is a remote call: it always yields
                for p in idx:
                    await asyncio.sleep(rng.random() * 0.004)
                    assert await q.put(b"g", 0, 1, p, w) or stop.is_set()
                    sample()

        async def learner():
            while taken[0] < 120:
                got = await q.get(B, 0, timeout_s=1.0)
                taken[0] += len(got["groups"])
                sample()
                await asyncio.sleep(rng.random() * 0.01)
            stop.set()
            await q.close()

        await asyncio.wait_for(asyncio.gather(learner(), *(worker(w) for w in range(3))), 30.0)
        assert peak[0] == budget and len(admitted) > 40
        return q

    q = asyncio.run(scenario())
    assert q.core.balance()["balanced"]


def test_a_put_that_outlives_its_dead_worker_cannot_train_a_requeued_prompt_twice():
    """Found by the 10-minute chaos run: a worker's put waited for room in a full queue, the worker was
    SIGKILLed, the driver requeued its claims, another worker trained the requeued prompt, and then the
    orphaned put landed too: the prompt was trained twice in one learner step."""
    async def scenario():
        q = ReplayQueue(1, 4, "drop", 10, 0)
        a = await q.claim(0, 1)
        b = await q.claim(1, 1)
        assert await q.put(b"a", 0, 1, a[0], 0)                 # the queue is now full
        orphan = asyncio.create_task(q.put(b"b", 0, 1, b[0], 1))
        await settle()
        assert not orphan.done()                               # worker 1's put waits for room...
        assert await q.release_worker(1) == 1                  # ...worker 1 dies, its claim requeued
        again = await q.claim(0, 1)
        assert again == b                                      # worker 0 now owns the prompt
        await q.get(1, 0, timeout_s=1.0)                       # room: the orphaned put wakes up
        assert await orphan is False                           # and is refused
        assert await q.put(b"b2", 0, 1, again[0], 0)           # the live claim's group is accepted
        got = await q.get(1, 0, timeout_s=1.0)
        assert got["groups"] == [b"b2"]
        stats = await q.close()
        assert stats["balanced"] and stats["orphan_puts"] == 1 and stats["produced"] == 2

    asyncio.run(scenario())


# -- version-aware admission (groups_per_step > 0) -----------------------------------------------

def test_fresh_slots_closed_form():
    """slots(w) = (w + L + 1 - u) * B - h, with u the learner version and h the groups handed at u."""
    L, B = 1, 4
    core = ReplayCore(100, L, "drop", 100, 0, max_inflight_groups=(L + 1) * B, groups_per_step=B)
    assert core.fresh_slots(-1) is None and ReplayCore(100, L, "drop", 100, 0, 8).fresh_slots(0) is None
    assert core.fresh_slots(0) == 8  # stage start: takes at versions 0 and 1 are both fresh for w=0
    idx = core.claim(0, 8)
    for p in idx:
        core.add(group(p, 0))
    core.take(3, learner_version=0)
    assert core.fresh_slots(0) == 8 - 3 and core.inflight() == 5
    core.take(1, learner_version=0)
    # the learner holds its batch at version 0 and trains; weights 0 are fresh only for the take at 1
    assert core.fresh_slots(0) == 4 and core.pool_refusal(1, version=0) == "version"
    # the flat budget alone would admit it (4 + 1 <= 8): that group would go stale behind the 4 ahead
    assert core.may_claim(1) and core.may_claim(4, version=-1)
    core.advance(1)  # the learner is at version 1; the push of weights 1 has not reached the worker
    assert core.fresh_slots(0) == 4 and not core.may_claim(1, version=0)
    assert core.fresh_slots(1) == 8 and core.may_claim(4, version=1) and not core.may_claim(5, version=1)
    core.take(4, learner_version=1)
    assert core.inflight() == 0 and core.fresh_slots(0) == 0
    # an empty pipeline admits an oversized request, but never one that is stale before any take
    assert core.pool_refusal(1, version=0) == "version"
    assert core.may_claim(9, version=1) and core.pool_refusal(9, version=1) is None
    # once the pool's push reached every worker, a claim naming the old version is read at the new one
    core.set_engine_version(1)
    assert core.claim_version(0) == 1 and core.claim_version(2) == 2 and core.claim_version(-1) == -1


def test_hand_out_is_oldest_version_first_fifo_among_equals():
    core = ReplayCore(100, 3, "drop", 100, 0)
    for p, v in [(0, 2), (1, 1), (2, 2), (3, 1), (4, 0)]:
        core.add(group(p, v))
    out, _ = core.take(5, learner_version=3)
    assert [prompt for *_, prompt in out] == [4, 1, 3, 0, 2]
    assert [lag for _, lag, _ in out] == [3, 2, 2, 1, 1]


async def _registered(q: ReplayQueue, worker: int, claim) -> None:
    """Until ``worker``'s claim waits in the queue (the event loop runs it to its wait); fails if the claim
    ended instead (it returned rather than wait)."""
    while q.core.waiting.get(worker) != 1:
        assert not claim.done(), f"worker {worker}'s claim returned {claim.result()} instead of waiting"
        await asyncio.sleep(0)


def test_a_version_blocked_claim_waits_for_the_push_that_lifts_it():
    """A claim refused for its version waits in the queue (it does not return for the worker to poll): the
    pool's ``set_engine_version`` wakes it and it is granted at the pushed version, well before ``wait_s``."""
    async def scenario():
        q = ReplayQueue(100, 1, "drop", 100, 0, max_inflight_groups=8, groups_per_step=4)
        assert len(await q.claim(0, 4, 0.0, version=0)) == 4
        await q.get(4, learner_version=1, timeout_s=0.0)  # hands nothing (none put), the learner is at 1
        assert await q.claim(1, 1, 0.0, version=0) == []  # weights 0: no fresh take left for it
        waiting = asyncio.ensure_future(q.claim(1, 1, 600.0, version=0))
        await _registered(q, 1, waiting)  # registered: least loaded first counts it
        await q.set_engine_version(1)
        assert len(await asyncio.wait_for(waiting, 60.0)) == 1  # woken by the push, not by its 600 s timeout
        assert 1 not in q.core.waiting

    asyncio.run(scenario())


def test_least_loaded_first_holds_when_a_version_block_lifts():
    """Two workers wait, both refused for their version; when the push lifts the block, the one whose engine
    holds fewer groups is granted first, whichever asked first (returning at once made them race: the first
    to poll took the slots)."""
    async def scenario():
        q = ReplayQueue(100, 1, "drop", 100, 0, max_inflight_groups=8, groups_per_step=4, worker_capacity=8)
        assert len(await q.claim(0, 3, 0.0, version=0)) == 3  # worker 0's engine holds 3 groups
        assert len(await q.claim(1, 1, 0.0, version=0)) == 1  # worker 1's, 1
        await q.get(4, learner_version=1, timeout_s=0.0)
        busy = asyncio.ensure_future(q.claim(0, 4, 600.0, version=0))  # asks first
        await _registered(q, 0, busy)
        idle = asyncio.ensure_future(q.claim(1, 4, 600.0, version=0))
        await _registered(q, 1, idle)
        await q.set_engine_version(1)  # slots(1) = 8 - 4 in flight: room for one claim of 4
        assert len(await asyncio.wait_for(idle, 60.0)) == 4
        assert not busy.done() and q.core.waiting == {0: 1}
        await q.close()
        assert await asyncio.wait_for(busy, 60.0) == []

    asyncio.run(scenario())


def _simulate(version_aware: bool, lag: int, B: int = 4, steps: int = 150, train_s: float = 1.0, push_s: float = 0.2,
              median_s: float = 0.5, sigma: float = 0.7, seed: int = 0) -> dict:
    """Discrete-event loop reference of an async run on the pure core: workers (64 slots) claim one
    group at a time with the policy version they hold; a group takes a lognormal time; the learner
    takes B groups (get: stale ones dropped on the way), trains ``train_s``, and its weights reach
    the workers ``push_s`` later. No clock, no Ray: the same seed gives the same run."""
    import heapq
    import math

    rng = random.Random(seed)
    core = ReplayCore(10_000, lag, "drop", 100_000, 0, max_inflight_groups=(lag + 1) * B,
                      groups_per_step=B if version_aware else 0)
    events, seq, now = [], 0, 0.0
    worker_version = learner_version = busy = done = 0
    learner_free, pending = True, []

    def at(when, kind, data=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (when, seq, kind, data))

    while done < steps:
        while busy < 64 and core.may_claim(1, worker_version):
            (p,) = core.claim(0, 1)
            busy += 1
            at(now + median_s * math.exp(sigma * rng.gauss(0.0, 1.0)), "put", (p, worker_version))
        if learner_free:
            items, _ = core.take(B - len(pending), learner_version)
            pending += items
            if len(pending) == B:
                assert max(lag_ for _, lag_, _ in pending) <= lag
                pending, learner_free = [], False
                at(now + train_s, "trained")
        now, _, kind, data = heapq.heappop(events)
        if kind == "put":
            busy -= 1
            core.add(group(data[0], data[1], n=1))
        elif kind == "trained":
            learner_version, done, learner_free = learner_version + 1, done + 1, True
            core.advance(learner_version)
            at(now + push_s, "pushed", learner_version)
        else:
            worker_version = data
    b = core.balance()
    return {"stale_share": b["dropped_stale"] / b["produced"], "steps_per_s": steps / now}


@pytest.mark.parametrize("lag", [1, 2])
def test_version_aware_admission_cuts_stale_waste_at_equal_throughput(lag):
    """The flat budget admits groups at the moment the learner takes, while the workers still hold
    the previous weights; they start one version behind and most go stale. Counting slots by the
    claim's version keeps the waste to the true stragglers (groups slower than the lag allows)."""
    flat = [_simulate(False, lag, seed=s) for s in range(3)]
    aware = [_simulate(True, lag, seed=s) for s in range(3)]
    for f, a in zip(flat, aware):
        assert f["stale_share"] > 0.3  # the failure this admission fixes (bench: ~30 % at lag 1 and 2)
        assert a["stale_share"] < f["stale_share"] / 3
        assert a["steps_per_s"] > 0.9 * f["steps_per_s"]
    # Equal durations: version-aware wastes nothing; the flat budget still loses a fifth or more.
    assert _simulate(True, lag, sigma=0.0)["stale_share"] == 0.0 < 0.2 < _simulate(False, lag, sigma=0.0)["stale_share"]


def test_a_whole_take_hands_the_full_batch_or_nothing_and_drops_the_stale_either_way():
    """The learner's batch is its configured size whatever the arrival times: ``take(whole=True)`` (what
    ``ReplayQueue.get`` uses) hands n groups or none; groups already past the lag bound are dropped and
    counted on the way, since they could never be trained."""
    core = ReplayCore(capacity_groups=8, max_policy_lag=1, stale_policy="drop", num_prompts=10, seed=0)
    idx = core.claim(0, 4)
    core.add(group(idx[0], 0))  # sampled at version 0: stale once the learner is at 2
    core.add(group(idx[1], 1))
    core.add(group(idx[2], 2))
    out, dropped = core.take(3, learner_version=2, whole=True)
    assert out == [] and dropped == 4 and core.dropped_prompts == [idx[0]]  # 4 trajectories in the group
    assert len(core.groups) == 2 and core.counts["consumed_groups"] == 0 and core.handed_at_version == 0
    core.add(group(idx[3], 2))
    out, dropped = core.take(3, learner_version=2, whole=True)
    assert [p for _, _, p in out] == [idx[1], idx[2], idx[3]] and [lag for _, lag, _ in out] == [1, 0, 0]
    assert dropped == 0 and core.handed_at_version == 3 and core.balance()["balanced"]
    # the default (incremental) take still hands what there is
    core.add(group(core.claim(0, 1)[0], 2))
    assert len(core.take(3, learner_version=2)[0]) == 1


# ---------------------------------------------------------------- scheduling (module doc "Scheduling")
def _sched(capacity=0, jit=False, budget=100, B=4, lag=10, group_rows=1):
    return ReplayCore(capacity_groups=1000, max_policy_lag=lag, stale_policy="drop", num_prompts=1000, seed=0,
                      max_inflight_groups=budget, groups_per_step=B, worker_capacity=capacity, just_in_time=jit,
                      group_rows=group_rows)


def test_engine_capacity_counts_only_the_rows_on_the_engine():
    """Finding (schedule-sim ablation): counting every claimed group against the engine's capacity left a
    third of its rows empty on a Search-R1-shaped workload, since a trajectory waiting on a search holds
    no engine row. A worker reports its rows waiting on a tool with each claim; they leave room."""
    core = _sched(capacity=2, group_rows=8)  # 16 rows: 2 groups of 8
    core.claim(0, 2)
    assert core.engine_load(0) == 2 and not core.may_claim(1, worker_id=0)
    core.set_off_engine(0, 7)  # 7 of its 16 rows are searching: 9 on the engine, 7 free (< a group of 8)
    assert core.engine_load(0) == 2 - 7 / 8 and not core.may_claim(1, worker_id=0)
    core.set_off_engine(0, 8)  # a whole group's worth of rows off the engine: one more group fits
    assert core.engine_load(0) == 1 and core.may_claim(1, worker_id=0)
    core.claim(0, 1)
    assert core.engine_load(0) == 2 and not core.may_claim(1, worker_id=0)  # the new group's rows count at once
    # a stale report cannot take the load below zero: 20 rows reported off, 3 groups (24 rows) claimed
    core.set_off_engine(0, 20)
    assert core.engine_load(0) == 3 - 20 / 8
    for p in list(core.claims[0]):
        core.add(group(p, 0, worker=0))
    assert core.load(0) == 0 and core.engine_load(0) == 0
    # least loaded first goes by the rows on the engine: worker 1 holds more groups but fewer rows on it
    core = _sched(capacity=4, group_rows=8)
    core.claim(0, 2)
    core.claim(1, 3)
    core.set_off_engine(1, 16)  # worker 1: 3 groups, 1 on the engine; worker 0: 2 on it
    core.waiting = {0: 1, 1: 1}
    assert core.defers(0, 1) and not core.defers(1, 1)
    core.release_worker(1)
    assert 1 not in core.off_engine  # a dead worker's report goes with its claims
    with pytest.raises(ValueError, match="off-engine rows=-1"):
        core.set_off_engine(0, -1)
    with pytest.raises(ValueError, match="group_rows=0"):
        _sched(group_rows=0)


def test_a_worker_holds_at_most_its_engine_capacity_but_a_lone_oversized_request_runs():
    core = _sched(capacity=3)
    assert core.may_claim(2, worker_id=0)
    core.claim(0, 2)
    assert not core.may_claim(2, worker_id=0)  # 2 + 2 > 3: it would queue inside a full engine
    assert core.may_claim(1, worker_id=0)
    assert core.may_claim(2, worker_id=1)  # another engine has room
    big = _sched(capacity=3)
    assert big.may_claim(5, worker_id=0)  # holds nothing: a request larger than the engine still runs
    core.add(group(core.claims[0][0], 0, worker=0))
    assert core.load(0) == 1 and core.may_claim(2, worker_id=0)


def test_least_loaded_waiting_worker_claims_first():
    core = _sched(capacity=8)
    core.claim(0, 3)
    core.claim(1, 1)
    core.waiting = {0: 1, 1: 1}
    assert not core.may_claim(1, worker_id=0)  # worker 1 waits holding fewer: it goes first
    assert core.may_claim(1, worker_id=1)
    core.claim(1, 2)  # now 3 each: neither yields
    assert core.may_claim(1, worker_id=0) and core.may_claim(1, worker_id=1)
    core.waiting = {1: 1}
    core.claim(1, 2)  # worker 1 holds 5 and waits; worker 0 (3) is not waiting: nobody to yield to
    assert core.may_claim(1, worker_id=0)
    full = _sched(capacity=3)
    full.claim(0, 3)
    full.claim(1, 2)
    full.waiting = {0: 1, 1: 1}
    assert full.may_claim(1, worker_id=1)  # worker 0 holds more
    full.claim(2, 1)
    full.waiting = {2: 1, 1: 1}
    assert not full.may_claim(1, worker_id=1)  # worker 2 (1 group) fits: it goes first
    assert not full.defers(2, 1)


def test_least_loaded_ignores_a_waiter_whose_engine_is_full():
    core = _sched(capacity=2)
    core.claim(0, 2)  # full
    core.claim(1, 2)
    core.claim(1, 1)  # (a lone oversized history: 3 > 2) worker 1 holds more than 0
    core.waiting = {0: 1, 1: 1}
    # worker 0 holds fewer but cannot take 1 more (2 + 1 > 2): worker 1 is not made to wait for it
    assert not core.defers(1, 1)


def test_refusal_reasons_and_what_a_claim_cannot_lift():
    """``may_claim`` is ``pool_refusal`` then ``worker_refusal``, each naming its reason; a scheduler that
    grants several claims in one instant (the DES's wake) keeps a ``LASTING`` verdict across them, so a
    claim must never lift one. Random states at one clock reading: every refusal in ``LASTING`` survives
    every other claim that is granted then."""
    from sonar.cluster.replay.queue import LASTING

    rng = random.Random(0)
    seen = set()
    for trial in range(400):
        core = _sched(capacity=rng.choice([0, 2, 3, 4]), jit=rng.random() < 0.5, budget=rng.choice([6, 10, 16]),
                      B=rng.choice([2, 4]), lag=rng.choice([0, 1, 2]), group_rows=rng.choice([1, 4]))
        core.set_workers(rng.choice([0, 3, 4]))
        if rng.random() < 0.5:
            core.set_stage_demand(rng.randrange(4, 20))
        if core.jit is not None and rng.random() < 0.7:  # a measured pace: positions far back wait
            core.jit.observe_put(rng.uniform(0.5, 5.0))
            core.jit.observe_take(0.0)
            core.jit.observe_take(rng.uniform(0.5, 3.0))
        for _ in range(rng.randrange(0, 6)):
            w = rng.randrange(4)
            core.claim(w, rng.choice([1, 2]))
            core.set_off_engine(w, rng.randrange(0, 4))
        core.learner_version = rng.randrange(0, 3)
        core.waiting = {w: 1 for w in range(4) if rng.random() < 0.7}
        now, n = rng.uniform(0, 6), rng.choice([1, 2])
        versions = {w: rng.randrange(-1, 3) for w in range(4)}

        def why(w):
            return core.pool_refusal(n, versions[w], now) or core.worker_refusal(w, n)

        for w in range(4):  # the split is may_claim's answer
            assert (why(w) is None) == core.may_claim(n, versions[w], w, now)
        for _ in range(3):  # grant claims in this instant, in random order; the lasting verdicts hold
            before = {w: why(w) for w in range(4)}
            seen.update(before.values())
            granted = [w for w in range(4) if before[w] is None]
            if not granted:
                break
            core.claim(rng.choice(granted), n, now)
            for w, r in before.items():
                if r in LASTING:
                    assert why(w) is not None, (trial, w, r)
    assert seen >= {None, "budget", "version", "engine", "defer", "jit", "stage"}  # every reason was exercised
    # and why a worker's own refusal is not lasting: the stage's need shrinks the next grant
    core = _sched(capacity=3, B=4)
    core.set_stage_demand(5)
    core.claim(0, 2)
    assert core.worker_refusal(0, 2) == "engine"  # 2 + 2 > 3
    core.claim(1, 2)
    assert core.grant_size(2) == 1 and core.worker_refusal(0, 2) is None  # granted 1: 2 + 1 fits
    unlimited = _sched(budget=0)
    assert unlimited.pool_refusal(5) is None and unlimited.worker_refusal(0, 5) is None


def test_just_in_time_closed_form():
    from sonar.cluster.replay.queue import JustInTime

    j = JustInTime()
    assert j.earliest(5, 4) is None  # no estimates yet: admit as before
    j.observe_put(3.0)
    j.observe_take(100.0)
    assert j.earliest(5, 4) is None  # one take: no interval yet
    j.observe_take(110.0)
    assert j.take_s == 10.0 and j.gen_s == 3.0
    # position p is trained at the ceil(p/B)-th take after the last: start gen_s before the take before it
    assert j.earliest(4, 4) == 110.0 + 0 * 10.0 - 3.0
    assert j.earliest(5, 4) == 110.0 + 1 * 10.0 - 3.0
    assert j.earliest(12, 4) == 110.0 + 2 * 10.0 - 3.0
    j.observe_take(130.0)  # interval 20: exponentially weighted with ALPHA
    assert j.take_s == pytest.approx((1 - JustInTime.ALPHA) * 10.0 + JustInTime.ALPHA * 20.0)
    j.reset_takes()
    assert j.earliest(5, 4) is None


def _take_batch(core, B, version, now):
    for i, w in enumerate(list(core.claims)):
        for p in list(core.claims[w]):
            core.add(group(p, version, worker=w), now)
    return core.take(B, version, whole=True, now=now)


def test_just_in_time_holds_back_a_learner_bound_pipeline_and_not_a_rollout_bound_one():
    B = 4
    # Learner-bound: groups take 2 s to generate, the learner takes a batch every 10 s.
    core = _sched(jit=True, B=B)
    for t0 in (0.0, 10.0):
        core.claim(0, B, now=t0 - 2.0)
        out, _ = _take_batch(core, B, 0, now=t0)
        assert len(out) == B
    assert core.jit.take_s == 10.0 and core.jit.gen_s == 2.0
    core.claim(0, B, now=10.0)  # the next batch (positions 1..4) is admitted at once
    assert core.may_claim(B, now=10.5) is False  # positions 5..8: trained two takes on, start at 10 + 10 - 2
    assert core.jit_wait_s(B, 10.5) == pytest.approx(7.5)
    assert core.may_claim(B, now=18.0) is True
    # Rollout-bound: groups take 10 s, the learner takes every 2 s (it waits for groups): positions up to
    # gen_s / take_s * B = 20 groups start at once.
    fast = _sched(jit=True, B=B)
    fast.claim(0, B, now=-10.0)
    _take_batch(fast, B, 0, now=0.0)
    fast.claim(0, B, now=-8.0)
    _take_batch(fast, B, 0, now=2.0)
    assert fast.jit.take_s == 2.0 and fast.jit.gen_s == pytest.approx((1 - 0.3) * 10.0 + 0.3 * 10.0)
    fast.claim(0, 16, now=2.0)
    assert fast.jit_wait_s(4, 2.0) == 0 and fast.may_claim(4, now=2.0)  # position 20: 2 + 4 * 2 - 10 <= now
    assert fast.jit_wait_s(12, 2.0) == pytest.approx(2.0)  # position 28: starts at 2 + 6 * 2 - 10 = 4, 2 s on


def test_queue_grants_room_to_the_least_loaded_waiting_worker():
    """Two workers wait on a full budget; the one that holds fewer groups gets the slot a take frees."""

    async def scenario():
        q = ReplayQueue(8, 100, "drop", 200, 0, max_inflight_groups=2)
        held = await q.claim(0, 2)
        assert await q.put(b"g", 0, 1, held[0], 0)  # worker 0: one group queued, one claimed (budget full)
        w0 = asyncio.ensure_future(q.claim(0, 1, wait_s=60.0))
        w1 = asyncio.ensure_future(q.claim(1, 1, wait_s=60.0))
        await await_until(lambda: q.core.waiting == {0: 1, 1: 1}, what="both claims to wait")
        got = await q.get(1, 0, timeout_s=5.0)  # frees one slot
        assert len(got["groups"]) == 1
        await await_until(w1.done, what="the less-loaded worker's claim")
        assert len(w1.result()) == 1 and not w0.done()  # worker 0 (holding 1) still waits: budget full again
        await q.close()
        assert await w0 == []

    asyncio.run(scenario())


def test_no_claim_starts_a_group_the_stage_will_not_train():
    core = _sched(B=4)
    core.set_stage_demand(10)  # 2.5 steps' worth left in the stage
    assert core.may_claim(4)
    core.claim(0, 4)
    core.claim(0, 4)
    assert core.stage_left() == 2 and core.may_claim(2) and core.grant_size(3) == 2  # a claim of 3 gets the 2 left
    core.claim(1, 2)
    assert core.stage_left() == 0 and not core.may_claim(1) and core.grant_size(2) == 0
    for w in (0, 1):
        for p in list(core.claims[w]):
            core.add(group(p, 0, worker=w))
    out, _ = core.take(4, 0, whole=True)
    assert len(out) == 4 and core.stage_left() == 0  # handed out counts against the demand too
    out, dropped = core.take(4, 20, whole=True)  # lag 20 > 10: the queued groups are dropped, their room comes back
    assert out == [] and dropped == 6 * 4 and core.stage_left() == 6
    assert core.may_claim(4)
    core.set_stage_demand(None)
    assert core.stage_left() is None
    lone = _sched(B=4)
    lone.set_stage_demand(1)
    assert lone.may_claim(2) and len(lone.claim(0, 2)) == 1  # granted what is left
    with pytest.raises(ValueError, match="stage demand -1"):
        lone.set_stage_demand(-1)


def test_queue_claim_takes_the_workers_report_of_rows_off_the_engine():
    async def scenario():
        q = ReplayQueue(1000, 10, "drop", 1000, 0, max_inflight_groups=100, groups_per_step=4, worker_capacity=2,
                        group_rows=8)
        assert len(await q.claim(0, 2, 0.0, -1, 0)) == 2
        assert await q.claim(0, 1, 0.0, -1, 0) == []  # its engine holds 2 groups' rows
        assert len(await q.claim(0, 1, 0.0, -1, 8)) == 1  # a group's worth of rows is searching
        assert q.core.off_engine == {0: 8}

    asyncio.run(scenario())


def test_each_worker_holds_at_most_its_share_of_the_budget():
    core = _sched(capacity=8, budget=24)
    assert core.share_cap() == 0  # pool size unknown: the engine's capacity alone
    core.set_workers(4)
    assert core.share_cap() == 6  # ceil(24 / 4): three early workers cannot take all 24
    for w in range(3):
        core.claim(w, 6)
        assert not core.may_claim(2, worker_id=w)
        core.set_off_engine(w, 6)  # the share counts claimed groups: rows off the engine do not lift it
        assert not core.may_claim(2, worker_id=w)
    assert core.may_claim(2, worker_id=3)  # the late worker still finds its share
    core.set_workers(5)
    assert core.share_cap() == 5
    core.set_workers(2)
    assert core.share_cap() == 12
    roomy = _sched(capacity=8, budget=100)
    roomy.set_workers(2)  # a share of 50
    roomy.claim(0, 8)
    assert not roomy.may_claim(1, worker_id=0) and roomy.may_claim(1, worker_id=1)  # the engine bounds a larger share
    with pytest.raises(ValueError, match="workers=-1"):
        core.set_workers(-1)


def test_the_last_group_a_step_lacks_is_granted_to_a_request_of_two():
    """The deadlock a real run met: 7 fresh groups queued, the learner's last step needs 8, requests of 2.
    Refusing 2 for lack of room for 2 would wait forever (the queue never empties); 1 is granted."""
    core = _sched(B=8, budget=24)
    core.set_stage_demand(8)
    for p in core.claim(0, 7):
        core.add(group(p, 0, worker=0))
    assert core.stage_left() == 1 and core.may_claim(2, version=0, worker_id=1)
    got = core.claim(1, 2)
    assert len(got) == 1
    core.add(group(got[0], 0, worker=1))
    out, _ = core.take(8, 0, whole=True)
    assert len(out) == 8 and core.stage_left() == 0


def test_property_a_stage_always_finishes_with_random_drops_and_requests():
    """Random request sizes, completion order and stale drops: the learner always gets its whole batches
    and the stage ends (every step taken), with the accounting balanced."""
    for seed in range(20):
        rng = random.Random(seed)
        B, steps = 4, 6
        core = _sched(B=B, budget=12, lag=1, capacity=5)
        core.set_workers(3)
        core.set_stage_demand(B * steps)
        version, taken, held = 0, 0, {w: [] for w in range(3)}
        for _ in range(5000):
            w = rng.randrange(3)
            n = rng.choice([2, 3])  # never 1: the last group of a step must come from a larger request
            if core.may_claim(n, version=version, worker_id=w):
                held[w] += [(p, version) for p in core.claim(w, n)]
            if held[w] and rng.random() < 0.5:
                p, v = held[w].pop(rng.randrange(len(held[w])))
                core.add(group(p, v if rng.random() > 0.2 else v - 2, worker=w))
            out, _ = core.take(B, version, whole=True)
            if out:
                taken += 1
                version += 1
                if taken == steps:
                    break
        assert taken == steps, f"seed {seed}: the stage stalled after {taken} steps ({core.stats()})"
        assert core.balance()["balanced"]


# ------------------------------------------------------------ retrieval outages
def test_a_retrieval_outage_pauses_the_learner_and_requeues_the_groups_that_never_searched():
    """Finding: a retrieval outage requeued the groups whose searches failed and trained on the rest, the
    groups that never searched (``rollout/reward/num_searches`` 0.00 while the server answered 500): a
    long outage taught the policy not to search. Now the first failed-search requeue starts an outage:
    the learner's get hands out nothing and says why, a group put without a successful search is requeued
    (not queued), and the first group that searched successfully ends it; the groups queued before it are
    then trained, and the accounting balances."""
    async def scenario():
        q = ReplayQueue(8, 4, "drop", 20, 0)
        p = await q.claim(0, 4)
        assert await q.put(b"before", 0, 2, p[0], 0, searched=True)  # queued before the outage
        await q.requeue(0, p[1])  # its search failed for infrastructure reasons: the outage starts
        assert await q.put(b"no-search", 0, 2, p[2], 0, searched=False) is False  # requeued, not queued
        got = await q.get(1, 0, timeout_s=0.01)
        assert got["groups"] == [] and got["timed_out"] and got["outage"]["failed"] == 1
        s = await q.stats()
        assert s["outage"]["failed"] == 1 and s["requeued_outage"] == 1 and s["depth_groups"] == 1
        assert s["outages"] == 1 and s["balanced"]
        assert await q.put(b"searched", 0, 2, p[3], 0, searched=True)  # retrieval answers again: over
        got = await q.get(2, 0, timeout_s=1.0)
        assert got["groups"] == [b"before", b"searched"] and got["outage"] is None
        s = await q.stats()
        assert s["outage"] is None and s["outage_s"] >= 0 and s["balanced"] and s["consumed"] == 4
        again = await q.claim(1, 2)  # the outage's prompts come back first (requeued at the front)
        assert sorted(again) == sorted([p[1], p[2]])

    asyncio.run(scenario())


def test_a_full_queue_cannot_keep_an_outage_from_ending():
    """The queue is full (the learner paused) when retrieval comes back: the searched group's put ends the
    outage before it waits for room, so the learner takes again and the put goes in."""
    async def scenario():
        q = ReplayQueue(1, 4, "drop", 20, 0)
        p = await q.claim(0, 3)
        assert await q.put(b"a", 0, 1, p[0], 0, searched=True)  # the queue is full
        await q.requeue(0, p[1])
        put = asyncio.create_task(q.put(b"b", 0, 1, p[2], 0, searched=True))
        await settle()
        assert not put.done() and q.core.outage is None  # ended; waits only for room
        got = await q.get(1, 0, timeout_s=60.0)
        assert got["groups"] == [b"a"]
        await await_until(put.done, what="the put to get the room the take made")
        assert put.result() is True

    asyncio.run(scenario())


def test_the_driver_says_when_an_outage_pauses_the_learner_and_when_it_resumes(caplog):
    import logging

    from sonar.cluster.driver.faults import OutagePause, starved_message
    from sonar.cluster.wire import metrics as K
    from sonar.cluster.wire.config import load_config
    from sonar.cluster.wire.protocol import StepResult

    log = OutagePause()
    with caplog.at_level(logging.WARNING, logger="sonar"):
        log.see(StepResult({K.REPLAY_OUTAGE_NOW_S: 12.0}, waiting=True))
        log.see(StepResult({K.REPLAY_OUTAGE_NOW_S: 22.0}, waiting=True))  # said once
        log.see(StepResult({K.LEARNER_LOSS: 0.1}))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2
    assert msgs[0].startswith("learner paused: a retrieval outage (searches failing for infrastructure reasons for 12 s)")
    assert msgs[1] == "learner resumed: a group searched successfully, the retrieval outage is over"
    cfg = load_config([], ["cluster.step_timeout_s=600"])
    m = starved_message(cfg, 700, {"outage": {"seconds": 650.0, "failed": 9}, "depth_groups": 8})
    assert "paused by a retrieval outage: searches have failed for infrastructure reasons for 650 s (9 groups " \
           "requeued)" in m
