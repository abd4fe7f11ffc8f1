"""The fair synchronous baseline of ``sonar bench async-vs-sync`` (issue 11): sync mode submits the
whole step's share at once (no lane cap), so it holds as many rows in the engine as async mode does
under the same config; with ``rollout.per_trajectory`` every trajectory is its own coroutine, so a
slow row never delays another row's search. Fake engines, fake replay, no Ray."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from sonar.actors.engine import Generation
from sonar.actors.prompts import get_protocol
from sonar.actors.rollout import PromptItem, rollout_groups, row_seed
from sonar.cluster.wire.config import ProtocolConfig, load_config
from tests.actors.test_rollout import TAGS, TOK, FakeRetriever, em_reward, enc, tid
from tests.waiting import DEADLINE_S, wait_until


def _gen(text: str, params) -> Generation:
    ids = enc(text)
    return Generation(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop", 0, ids[-1])


# ------------------------------------------------------------------ one coroutine per trajectory
class SlowRowEngine:
    """France rows search at once; the germany row's first turn blocks until the retriever has
    received france's query (or the deadline), so it finishes only if france could search first."""

    def __init__(self, france_searched: threading.Event):
        self.france_searched = france_searched
        self.calls: list[int] = []
        self.seeds: list[int | None] = []
        self.version = 0
        self.waited: list[bool] = []

    def generate(self, prompts, params, max_new_tokens_per_prompt=None):
        self.calls.append(len(prompts))
        self.seeds.append(params.seed)
        out = []
        for p in prompts:
            ctx = list(map(int, p))
            searched = tid("city") in ctx  # the documents block ("<q> is a city") is in the context
            if searched:
                out.append(_gen("<answer> paris </answer>", params))
            elif tid("germany") in ctx:
                self.waited.append(self.france_searched.wait(DEADLINE_S))
                out.append(_gen("<search> capital of germany </search>", params))
            else:
                out.append(_gen("<search> capital of france </search>", params))
        return out


class SignallingRetriever(FakeRetriever):
    def __init__(self, event: threading.Event):
        super().__init__()
        self.event = event

    async def abatch_search(self, queries, k):
        if any("france" in q for q in queries):
            self.event.set()
        return await super().abatch_search(queries, k)


ITEMS = [PromptItem("q0", "what is the capital of france", ["paris"]),
         PromptItem("q1", "what is the capital of germany", ["berlin"])]


def _rollout(engine, retriever, per_trajectory: bool, seed=5):
    return asyncio.run(rollout_groups(ITEMS, engine=engine, retriever=retriever, tokenizer=TOK, tags=TAGS,
                                      proto=ProtocolConfig(), temperature=1.0, group_size=2, k=1,
                                      reward_fn=em_reward, seed=seed, per_trajectory=per_trajectory))


def test_per_trajectory_a_slow_row_does_not_delay_another_rows_search():
    event = threading.Event()
    engine, ret = SlowRowEngine(event), SignallingRetriever(event)
    groups, stats = _rollout(engine, ret, per_trajectory=True)
    assert engine.waited == [True, True]  # both germany rows saw france's search while still in their turn
    # france searched on its own, before germany's turn ended: its first retriever call holds no germany query
    assert ret.calls[0][0] == ["capital of france"]
    assert all(n == 1 for n in engine.calls)  # one row per engine call
    assert len(engine.calls) == 8 and stats.engine_calls == 8  # 4 rows x (search turn + answer turn)
    assert stats.retriever_calls == 4 and stats.searches == 4
    assert all(t.finish_reason == "answered" and len(t.searches) == 1 for g in groups for t in g)


def test_per_trajectory_hands_each_group_off_when_its_own_rows_end():
    """A request's groups are not held for its slowest: france's group reaches on_group (rewarded) while
    germany's rows are still in their first turn, which waits for that hand-off."""
    handed = threading.Event()
    engine = SlowRowEngine(handed)
    got: list[tuple[int, list]] = []

    async def on_group(i, group):
        got.append((i, [t.reward for t in group]))
        handed.set()

    groups, _ = asyncio.run(rollout_groups(ITEMS, engine=engine, retriever=FakeRetriever(), tokenizer=TOK, tags=TAGS,
                                           proto=ProtocolConfig(), temperature=1.0, group_size=2, k=1,
                                           reward_fn=em_reward, seed=5, per_trajectory=True, on_group=on_group))
    assert engine.waited == [True, True]  # germany's turn saw france's group handed off first
    assert [i for i, _ in got] == [0, 1] and got[0][1] == [t.reward for t in groups[0]]
    assert all(r == 1.0 for r in got[0][1])  # france's rows answered paris: rewarded before the hand-off
    with pytest.raises(ValueError, match="on_group needs per_trajectory"):
        asyncio.run(rollout_groups(ITEMS, engine=engine, retriever=FakeRetriever(), tokenizer=TOK, tags=TAGS,
                                   proto=ProtocolConfig(), temperature=1.0, group_size=2, k=1, reward_fn=em_reward,
                                   on_group=on_group))


def test_lockstep_rows_wait_for_the_slowest_turn_before_searching():
    """The contrast the per-trajectory mode removes: in lockstep the turn's one batched search goes
    out only after every row's turn, so france's query travels with germany's."""
    event = threading.Event()
    event.set()  # lockstep would deadlock on the slow row otherwise: let it through
    engine, ret = SlowRowEngine(event), SignallingRetriever(event)
    _rollout(engine, ret, per_trajectory=False)
    assert engine.calls == [4, 4]
    assert sorted(ret.calls[0][0]) == ["capital of france", "capital of germany"] and len(ret.calls) == 1


def test_per_trajectory_rows_sample_with_their_own_seeds():
    event = threading.Event()
    event.set()
    engine = SlowRowEngine(event)
    _rollout(engine, SignallingRetriever(event), per_trajectory=True, seed=5)
    expected = {row_seed(5, r, t) for r in range(4) for t in range(2)}
    assert set(engine.seeds) == expected and len(expected) == 8  # distinct per row and turn
    assert all(0 <= s < 2 ** 63 for s in expected)
    lock = SlowRowEngine(event)
    _rollout(lock, SignallingRetriever(event), per_trajectory=False, seed=5)
    assert lock.seeds == [5, 6]  # lockstep unchanged: one seed per call and turn


def test_per_trajectory_needs_an_engine_that_batches_concurrent_calls():
    with pytest.raises(ValueError, match=r"rollout.per_trajectory=True.*continuous_batching=False"):
        load_config([], ["rollout.per_trajectory=true", "rollout.continuous_batching=false"])
    cfg = load_config([], ["rollout.per_trajectory=true", "rollout.continuous_batching=true"])
    assert cfg.rollout.per_trajectory


# ------------------------------------------------------------------ rows in flight: sync vs async
class CountingEngine:
    """Counts rows inside ``generate``; every call waits until ``target`` rows are inside (or the
    deadline), so the peak is the number of rows the worker put in flight at once."""

    def __init__(self, target: int):
        self.target = target
        self.live = 0
        self.peak = 0
        self.cond = threading.Condition()
        self.version = 0

    def generate(self, prompts, params, max_new_tokens_per_prompt=None):
        with self.cond:
            self.live += len(prompts)
            self.peak = max(self.peak, self.live)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.peak >= self.target, DEADLINE_S)
        try:
            return [_gen("<answer> paris </answer>", params) for _ in prompts]
        finally:
            with self.cond:
                self.live -= len(prompts)

    def load_weights(self, named_tensors, version):
        pass

    def parameter_specs(self):
        return []


def _done(value) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f


class FakeReplay:
    """Answers the worker's ``claim`` / ``put`` / ``requeue`` like the replay actor (no budget)."""

    def __init__(self):
        self.next = 0
        self.puts = 0
        self.lock = threading.Lock()
        replay = self

        class _M:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *a):
                return SimpleNamespace(future=lambda: _done(self.fn(*a)))

        def claim(worker_id, n, wait_s=0.0, version=-1, off_engine_rows=None):  # ReplayQueue.claim's signature
            assert isinstance(version, int) and version >= 0, version  # the worker names its policy version
            assert isinstance(off_engine_rows, int) and off_engine_rows >= 0, off_engine_rows  # and its rows off
            with replay.lock:
                idx = list(range(replay.next, replay.next + n))
                replay.next += n
            return [i % 4 for i in idx]

        def put(*a):
            with replay.lock:
                replay.puts += 1
            return True

        self.claim, self.put, self.requeue = _M(claim), _M(put), _M(lambda *a: None)


def _worker(cfg, engine):
    from sonar.actors.rollout import OffEngine
    from sonar.actors.worker import RolloutWorker, SwappingEngine

    w = object.__new__(RolloutWorker)
    qs = [SimpleNamespace(qid=f"q{i}", question="what is the capital of france", golds=["paris"], meta={}) for i in range(4)]
    w.__dict__.update(worker_id=0, cfg=cfg, engine=SwappingEngine(engine), retriever=FakeRetriever(), tokenizer=TOK,
                      tags=get_protocol(cfg.protocol.name), world=SimpleNamespace(train=qs), _lock=threading.Lock(),
                      _stats={"groups": 0, "trajectories": 0, "model_tokens": 0, "searches": 0, "gen_s": 0.0,
                              "retrieve_s": 0.0, "requeued": 0, "busy_s": 0.0}, _working=0, _busy_since=0.0,
                      _recent=[], _last_progress=0.0, _stop=threading.Event(), _error=None, _thread=None,
                      _data_cache={}, tools=[], _off_engine=OffEngine())
    return w


CONCURRENCY = ["rollout.group_size=4", "rollout.groups_per_request=1", "rollout.batches_in_flight=4",
               "rollout.continuous_batching=true", "rollout.per_trajectory=true", "rollout.max_batch_rows=64",
               "learner.groups_per_step=4", "protocol.name=rag_r1_multi"]


def test_sync_puts_the_whole_share_in_flight_like_async_lanes():
    """Sync's share (4 groups x 4 rows) enters the engine at once, each row its own call; async's lanes
    (4 lanes x 1 group x 4 rows) under the same config put as many rows in flight. Before the fair
    baseline, sync ran at most ``batches_in_flight`` requests and each request's rows in lockstep."""
    stage = load_config([], CONCURRENCY).stages[-1]
    rows = 16

    sync_cfg = load_config([], CONCURRENCY + ["cluster.mode=sync"])
    sync_engine, replay = CountingEngine(rows), FakeReplay()
    out = _worker(sync_cfg, sync_engine).generate_groups(replay, 0, stage, 4, 0)
    assert out["groups"] == 4 and replay.puts == 4
    assert sync_engine.peak == rows

    async_cfg = load_config([], CONCURRENCY + ["cluster.mode=async"])
    async_engine = CountingEngine(rows)
    w = _worker(async_cfg, async_engine)
    w.start(FakeReplay(), 0, stage)
    try:
        wait_until(lambda: async_engine.peak >= rows, what=lambda: f"async rows in flight: peak {async_engine.peak}")
    finally:
        w.stop(DEADLINE_S)
    assert w._error is None
    assert async_engine.peak == rows == sync_engine.peak


def test_sync_share_is_not_capped_by_lanes():
    """With one lane, sync still submits its four requests together (16 rows)."""
    cfg = load_config([], CONCURRENCY + ["cluster.mode=sync", "rollout.batches_in_flight=1"])
    engine = CountingEngine(16)
    _worker(cfg, engine).generate_groups(FakeReplay(), 0, cfg.stages[-1], 4, 0)
    assert engine.peak == 16


# ------------------------------------------------------------------ rows off the engine (engine capacity)
class SearchThenAnswerEngine:
    """Every row searches in its first turn and answers in its second."""
    version = 0

    def generate(self, prompts, params, max_new_tokens_per_prompt=None):
        return [_gen("<answer> paris </answer>" if tid("city") in list(map(int, p))
                     else "<search> capital of france </search>", params) for p in prompts]


class CountingRetriever(FakeRetriever):
    def __init__(self, off):
        super().__init__()
        self.off, self.seen = off, []

    async def abatch_search(self, queries, k):
        self.seen.append(self.off.rows)
        return await super().abatch_search(queries, k)


@pytest.mark.parametrize("per_trajectory", [True, False])
def test_rows_waiting_on_a_search_or_their_group_count_as_off_the_engine(per_trajectory):
    """The replay's engine capacity counts only rows on the engine; the worker's ``OffEngine`` counts the rest:
    a row is off while it searches and, per trajectory, once done until its group is handed on."""
    from sonar.actors.rollout import OffEngine

    off = OffEngine()
    ret = CountingRetriever(off)
    at_hand_off: list[int] = []

    async def on_group(i, group):
        at_hand_off.append(off.rows)

    asyncio.run(rollout_groups(ITEMS[:1], engine=SearchThenAnswerEngine(), retriever=ret, tokenizer=TOK,
                               tags=TAGS, proto=ProtocolConfig(), temperature=1.0, group_size=2, k=1,
                               reward_fn=em_reward, seed=5, per_trajectory=per_trajectory,
                               on_group=on_group if per_trajectory else None, off_engine=off))
    if per_trajectory:  # each row searches on its own: itself, and perhaps its sibling, are off
        assert len(ret.seen) == 2 and all(1 <= n <= 2 for n in ret.seen), ret.seen
        assert at_hand_off == [0]  # the group's rows leave the count before the put that ends its claim
    else:  # lockstep: both rows search in one call
        assert ret.seen == [2]
    assert off.rows == 0
