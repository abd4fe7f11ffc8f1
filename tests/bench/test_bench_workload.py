"""The benchmark workload pieces, fast and without Ray: ``BenchEngine`` (bench/sim/bench_engine.py) and
``LatencyInjectingRetriever`` (bench/sim/retrieval_latency.py).

What must hold for the benchmarks to mean anything:
- BenchEngine turns parse under the protocol (searches then an answer), so retrieval, parsing, rewards
  and the codec all run; lengths are long-tailed; caps and stop ids follow the Engine contract; the
  sleep is ``token_ms`` x the longest row (rows overlap, as on a GPU); the weight path is HFEngine's.
- LatencyInjectingRetriever delays each batched call by a lognormal draw, delegates unchanged, keeps
  the inner name (cache keys), overlaps concurrent calls, and reports its totals with the inner stats.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import threading
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sonar.actors.engine import Engine, HFEngine, SamplingParams
from sonar.actors.prompts import get_protocol
from sonar.bench.sim.bench_engine import BenchEngine
from sonar.bench.sim.retrieval_latency import LatencyInjectingRetriever
from sonar.cluster.wire.protocol import SegmentKind
from sonar.retrieval.base import Hit


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def world_model():
    from sonar.actors.model import policy_and_tokenizer
    from sonar.actors.world import build_world
    from sonar.cluster.wire.config import ModelConfig, WorldConfig

    world = build_world(WorldConfig(num_entities=120))
    model, tok = policy_and_tokenizer(ModelConfig(), world)
    return world, model, tok


def make_engine(world_model, **kw) -> BenchEngine:
    from sonar.actors.model import policy_and_tokenizer
    from sonar.cluster.wire.config import ModelConfig

    world, _, _ = world_model
    model, tok = policy_and_tokenizer(ModelConfig(), world)  # a fresh model per engine
    kw.setdefault("token_ms", 0.0)
    return BenchEngine(model, tok, get_protocol(kw.pop("protocol", "rag_r1_multi")), **kw)


class FakeRetriever:
    name = "fake"

    def __init__(self):
        self.calls: list[list[str]] = []

    def batch_search(self, queries, k):
        self.calls.append(list(queries))
        return [[Hit(f"d{i}", "title", "alpha beta gamma", 1.0)] for i in range(len(queries))]


def rollout(engine, tok, world, n_items=4, group_size=8, seed=3, proto=None, retriever=None):
    from sonar.actors.rewards import trajectory_reward
    from sonar.actors.rollout import PromptItem, rollout_groups
    from sonar.cluster.wire.config import ProtocolConfig, RewardConfig

    items = [PromptItem(q.qid, q.question, list(q.golds)) for q in world.train[:n_items]]
    return asyncio.run(rollout_groups(
        items, engine=engine, retriever=retriever or FakeRetriever(), tokenizer=tok, tags=engine.tags,
        proto=proto or ProtocolConfig(), temperature=1.0, group_size=group_size, k=1,
        reward_fn=lambda t: trajectory_reward(RewardConfig(), t), seed=seed))


# ------------------------------------------------------------------------------------ BenchEngine
def test_bench_engine_satisfies_the_engine_protocol_and_says_what_it_is(world_model):
    eng = make_engine(world_model)
    assert eng.engine_kind == "bench" and "BENCHMARK" in BenchEngine.__doc__
    for name in ("generate", "load_weights", "parameter_specs", "state_checksum"):
        assert callable(getattr(eng, name)) and hasattr(Engine, name)
    assert isinstance(eng.version, int) and eng.version == 0
    assert eng.model is not None


@pytest.mark.parametrize("protocol", ["rag_r1_multi", "search_r1", "r1_searcher"])
def test_rollouts_search_one_to_three_times_then_answer(world_model, protocol):
    world, _, tok = world_model
    eng = make_engine(world_model, protocol=protocol, seed=5)
    retr = FakeRetriever()
    groups, stats = rollout(eng, tok, world, retriever=retr)
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 32
    reasons = Counter(t.finish_reason for t in trajs)
    # Most trajectories answer; the rest hit the long tail of the per-turn budget (malformed/max tokens).
    assert reasons["answered"] >= 20, reasons
    answered = [t for t in trajs if t.finish_reason == "answered"]
    assert {len(t.searches) for t in answered} <= {1, 2, 3}
    assert len({len(t.searches) for t in answered}) >= 2  # the number of searches varies
    assert retr.calls and stats.searches == sum(len(t.searches) for t in trajs)
    # Queries are words of the context (the question or retrieved text), so they hit a real index.
    vocab_words = set(world.vocab())
    for qs in retr.calls:
        for q in qs:
            assert q and all(w in vocab_words for w in q.split()), q
    # Every model segment carries the engine's version and negative logprobs of its length.
    for t in trajs:
        for s in t.segments:
            if s.kind == SegmentKind.MODEL:
                assert s.version == 0 and s.logprobs.shape == s.token_ids.shape and (s.logprobs < 0).all()


def test_stop_ids_caps_and_length_semantics(world_model):
    world, _, tok = world_model
    eng = make_engine(world_model, seed=1, median_tokens=20)
    tags = eng.tags
    qc, ac = tok.convert_tokens_to_ids(tags.query_close), tok.convert_tokens_to_ids(tags.answer_close)
    prompt = np.asarray(tok.encode(world.train[0].question, add_special_tokens=False), np.int32)
    prompts = [prompt] * 64
    # With the closing tags as stop ids: each row ends on one (kept) or is cut at the cap.
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=30, stop_token_ids=(qc, ac), seed=2))
    for g in gens:
        assert len(g.token_ids) <= 30 and g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
        if g.finish == "stop":
            assert g.token_ids[-1] == g.stop_token_id and g.stop_token_id in (qc, ac)
            assert not set(g.token_ids[:-1].tolist()) & {qc, ac}
        else:
            assert g.finish == "length" and len(g.token_ids) == 30 and g.stop_token_id is None
    assert {g.finish for g in gens} == {"stop", "length"}  # the tail reaches the cap sometimes
    # The first turn of a trajectory is always a search.
    assert all(g.stop_token_id == qc for g in gens if g.finish == "stop")
    # Per-prompt caps below max_new_tokens are honoured.
    caps = [0, 1, 3, 200] * 16
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=40, stop_token_ids=(qc, ac), seed=2),
                        max_new_tokens_per_prompt=caps)
    for g, c in zip(gens, caps):
        assert len(g.token_ids) <= min(c, 40)
    assert len(gens[0].token_ids) == 0 and gens[0].finish == "length"
    # Without stop ids a "model" keeps writing until the cap, like a real one.
    gens = eng.generate(prompts[:8], SamplingParams(max_new_tokens=64, seed=2))
    assert all(g.finish == "length" and len(g.token_ids) == 64 for g in gens)
    with pytest.raises(ValueError, match="entries"):
        eng.generate(prompts, SamplingParams(max_new_tokens=4), max_new_tokens_per_prompt=[1])


def test_lengths_are_long_tailed_and_seeded(world_model):
    world, _, tok = world_model
    eng = make_engine(world_model, seed=0, median_tokens=16, sigma=0.7)
    prompt = np.asarray(tok.encode(world.train[1].question, add_special_tokens=False), np.int32)
    p = SamplingParams(max_new_tokens=10_000, seed=7)  # no stop ids, huge cap: cut only by the turn
    qc, ac = tok.convert_tokens_to_ids(eng.tags.query_close), tok.convert_tokens_to_ids(eng.tags.answer_close)
    p = dataclasses.replace(p, stop_token_ids=(qc, ac))
    lens = np.array([len(g.token_ids) for g in eng.generate([prompt] * 2000, p)])
    med = float(np.median(lens))
    assert 13 <= med <= 19, med
    assert np.percentile(lens, 99) > 3.5 * med  # long right tail (lognormal sigma 0.7: ~5x)
    assert lens.max() > 4 * med and lens.min() >= 5
    # The same params.seed gives the same call; another seed a different one.
    a = eng.generate([prompt] * 4, p)
    b = eng.generate([prompt] * 4, p)
    c = eng.generate([prompt] * 4, dataclasses.replace(p, seed=8))
    assert all(np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.logprobs, y.logprobs)
               for x, y in zip(a, b))
    assert not all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, c))


def test_sleeps_token_ms_per_token_of_the_longest_row(world_model):
    world, _, tok = world_model
    eng = make_engine(world_model, token_ms=2.0, seed=4)
    prompt = np.asarray(tok.encode(world.train[2].question, add_special_tokens=False), np.int32)
    params = SamplingParams(max_new_tokens=25)  # no stop ids: every row writes exactly 25 tokens
    t0 = time.perf_counter()
    gens = eng.generate([prompt] * 16, params)
    dt = time.perf_counter() - t0
    assert all(len(g.token_ids) == 25 for g in gens)
    assert dt >= 0.050  # it really slept (a loaded machine only sleeps longer)
    s = eng.engine_stats()
    assert s["calls"] == 1 and s["generated_tokens"] == 16 * 25
    assert s["simulated_s"] == pytest.approx(0.050) and s["engine"] == "bench"  # 25 x 2 ms once, not 16 x
    assert s["simulated_s"] <= s["wall_s"] <= dt
    with pytest.raises(ValueError, match="token_ms"):
        make_engine(world_model, token_ms=-1.0)


def test_weight_path_is_hfengines(world_model):
    eng = make_engine(world_model)
    ref = HFEngine(eng.model, eos_token_id=None)
    assert [(s.name, s.shape) for s in eng.parameter_specs()] == [(s.name, s.shape) for s in ref.parameter_specs()]
    before = eng.state_checksum()
    new = {n: torch.full_like(p, 0.01) for n, p in eng.model.named_parameters()}
    eng.load_weights(new.items(), version=7)
    assert eng.version == 7 and eng.state_checksum() != before
    assert all(torch.equal(p, new[n]) for n, p in eng.model.named_parameters())
    with pytest.raises(ValueError, match="unknown parameter"):
        eng.load_weights([("nope.weight", torch.zeros(1))], version=8)
    assert eng.version == 7
    # Generations carry the version of the weights installed when the call started.
    g = eng.generate([np.array([30, 31], np.int32)], SamplingParams(max_new_tokens=3))[0]
    assert g.version == 7


# ------------------------------------------------------------------------------------ LatencyInjectingRetriever
class StatsRetriever(FakeRetriever):
    name = "tantivy:/some/index"

    def stats(self):
        return {"queries": sum(len(c) for c in self.calls)}


def test_latency_wrapper_delegates_and_keeps_the_name():
    inner = StatsRetriever()
    r = LatencyInjectingRetriever(inner, median_ms=5.0, sigma=0.0, seed=0)
    assert r.name == inner.name
    t0 = time.perf_counter()
    hits = r.batch_search(["a", "b"], 1)
    dt = time.perf_counter() - t0
    assert dt >= 0.005 and [h[0].doc_id for h in hits] == ["d0", "d1"] and inner.calls == [["a", "b"]]
    # No queries: no request, no delay (the counters below: still one injected call).
    assert r.batch_search([], 1) == []
    s = r.stats()
    assert s["queries"] == 2 and s["injected_calls"] == 1
    assert s["injected_ms_total"] == pytest.approx(5.0) and s["injected_ms_max"] == pytest.approx(5.0)
    assert s["injected_median_ms"] == 5.0 and s["injected_sigma"] == 0.0
    json.dumps(s)


def test_latency_draws_are_lognormal_and_seeded():
    r = LatencyInjectingRetriever(FakeRetriever(), median_ms=50.0, sigma=0.8, seed=1)
    xs = [r.draw_ms() for _ in range(4000)]
    logs = [math.log(x) for x in xs]
    assert statistics.median(xs) == pytest.approx(50.0, rel=0.08)
    assert statistics.pstdev(logs) == pytest.approx(0.8, rel=0.06)
    assert max(xs) > 5 * 50.0  # the tail is there
    r2 = LatencyInjectingRetriever(FakeRetriever(), median_ms=50.0, sigma=0.8, seed=1)
    assert [r2.draw_ms() for _ in range(10)] == xs[:10]
    assert LatencyInjectingRetriever(FakeRetriever(), 0.0, 0.8).draw_ms() == 0.0
    for bad in ({"median_ms": -1.0, "sigma": 0.1}, {"median_ms": 1.0, "sigma": -0.1},
                {"median_ms": float("nan"), "sigma": 0.1}):
        with pytest.raises(ValueError):
            LatencyInjectingRetriever(FakeRetriever(), **bad)


def _concurrently(n: int, fn) -> list[BaseException]:
    """Run ``fn(i)`` for i in 0..n-1, each in its own thread, all at once; the exceptions they raised."""
    errors: list[BaseException] = []

    def call(i):
        try:
            fn(i)
        except Exception as e:  # noqa: BLE001 - e.g. a broken barrier, surfaced by the caller
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_concurrent_calls_overlap_like_independent_requests(monkeypatch):
    """Six calls' delays run at the same time: each injected sleep waits at a barrier that opens only
    when all six are sleeping at once, so delays served one after another break the barrier."""
    import sonar.bench.sim.retrieval_latency as rl

    barrier, slept = threading.Barrier(6, timeout=30.0), []

    def sleep_together(s):
        slept.append(s)
        barrier.wait()

    monkeypatch.setattr(rl, "time", SimpleNamespace(sleep=sleep_together))
    r = LatencyInjectingRetriever(FakeRetriever(), median_ms=80.0, sigma=0.0)
    errors = _concurrently(6, lambda i: r.batch_search([f"q{i}"], 1))
    assert not errors and slept == [0.080] * 6
    assert r.stats()["injected_calls"] == 6


def test_a_cluster_of_two_servers_serves_two_requests_at_a_time(monkeypatch):
    """Six concurrent calls, two servers: each service time waits at a barrier of two, which opens only
    when two calls are in service together; never more than two are."""
    import sonar.bench.sim.retrieval_latency as rl

    barrier, in_service = threading.Barrier(2, timeout=60.0), []
    r = LatencyInjectingRetriever(FakeRetriever(), median_ms=10.0, sigma=0.0, servers=2, per_query_ms=2.0)

    def serve_in_pairs(s):
        in_service.append((s, r._in_service))
        barrier.wait()

    monkeypatch.setattr(rl, "time", SimpleNamespace(sleep=serve_in_pairs, perf_counter=time.perf_counter))
    errors = _concurrently(6, lambda i: r.batch_search([f"q{i}"] * 3, 1))
    assert not errors
    # service time: the median plus 2 ms for each of the 3 queries in the batch
    assert [x for x, _ in in_service] == [0.016] * 6 and all(n <= 2 for _, n in in_service)
    st = r.stats()
    assert st["max_in_service"] == 2 and st["injected_calls"] == 6 and st["injected_servers"] == 2
    assert st["injected_ms_total"] == pytest.approx(6 * 16.0) and st["queued_ms_total"] >= 0.0


def test_one_server_queues_every_request_behind_the_one_in_service(monkeypatch):
    import sonar.bench.sim.retrieval_latency as rl

    """The request in service holds its server until all five callers have started: an unbounded cluster
    would have let the other four in meanwhile."""
    r = LatencyInjectingRetriever(FakeRetriever(), median_ms=5.0, sigma=0.0, servers=1)
    seen, started, cv = [], [0], threading.Condition()

    def serve(s):
        with cv:
            assert cv.wait_for(lambda: started[0] == 5, timeout=60.0)
        seen.append(r._in_service)

    def call(i):
        with cv:
            started[0] += 1
            cv.notify_all()
        r.batch_search([f"q{i}"], 1)

    monkeypatch.setattr(rl, "time", SimpleNamespace(sleep=serve, perf_counter=time.perf_counter))
    assert not _concurrently(5, call)
    assert seen == [1] * 5 and r.stats()["max_in_service"] == 1


@pytest.mark.parametrize("bad", [{"servers": -1}, {"servers": 1.5}, {"per_query_ms": -1.0},
                                 {"per_query_ms": float("inf")}])
def test_bad_server_settings_raise(bad):
    with pytest.raises(ValueError, match="servers|per_query_ms"):
        LatencyInjectingRetriever(FakeRetriever(), 10.0, 0.0, **bad)


def test_factory_puts_the_wrapper_below_the_cache(tmp_path):
    """Through the production hook (``build_retriever(..., wrap_backend=)``), as the benchmarks wire it."""
    from sonar.bench.sim.config import SimConfig
    from sonar.bench.sim.hooks import sim_hooks
    from sonar.cluster.wire.config import RetrievalConfig
    from sonar.retrieval.cache import CachedRetriever
    from sonar.retrieval.factory import build_retriever

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in [
        {"id": "tokyo", "title": "Tokyo", "text": "Tokyo is the capital of Japan."},
        {"id": "nile", "title": "Nile", "text": "The Nile is a river in Africa."}]))
    wrap = sim_hooks(SimConfig(retrieval_latency_ms=30.0, retrieval_latency_sigma=0.0)).retriever_wrap
    r = build_retriever(RetrievalConfig(), str(corpus), str(tmp_path / "ix"), wrap_backend=wrap)
    assert isinstance(r, CachedRetriever) and isinstance(r.inner, LatencyInjectingRetriever)
    t0 = time.perf_counter()
    assert r.batch_search(["capital of Japan"], 1)[0][0].doc_id == "tokyo"
    assert time.perf_counter() - t0 >= 0.030  # the miss waited out the injected delay
    r.batch_search(["capital of Japan"], 1)
    assert r.inner.stats()["injected_calls"] == 1  # the cache hit skipped the injected delay
