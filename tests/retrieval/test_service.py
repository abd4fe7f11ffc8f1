"""The retrieval service: micro-batching, ordering, errors as data, timeouts, dead replicas.

The first tests drive the actor body (RetrievalServerImpl) in a plain event loop; the ``ray`` tests
run the real actors on a local Ray cluster on 127.0.0.1 shared by the module.
"""
from __future__ import annotations

import asyncio
import pickle
import threading
import time
from dataclasses import replace

import pytest

from sonar.cluster.wire.config import RetrievalConfig
from sonar.retrieval.base import Hit, RetrievalError
from sonar.retrieval.server import RetrievalServerImpl, _percentile
from tests.ray_job import ray_for_module
from tests.waiting import wait_actor_dead


class EchoRetriever:
    """Hit ids are '<query>#<rank>'. Special queries: 'err:<kind>' raises RetrievalError(kind),
    'boom' raises ValueError, 'sleep:<s>' sleeps."""

    name = "echo:test"

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.calls = 0
        self.sizes: list[int] = []
        self.inflight = 0
        self.max_inflight = 0
        self._lock = threading.Lock()

    def batch_search(self, queries, k):
        with self._lock:
            self.calls += 1
            self.sizes.append(len(queries))
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            time.sleep(self.delay_s)
            for q in queries:
                if q.startswith("err:"):
                    raise RetrievalError(q[4:], f"injected {q}")
                if q == "boom":
                    raise ValueError("injected bug")
                if q.startswith("sleep:"):
                    time.sleep(float(q[6:]))
            return [[Hit(f"{q}#{j}", q, f"text of {q}", float(k - j)) for j in range(k)] for q in queries]
        finally:
            with self._lock:
                self.inflight -= 1

    def stats(self):
        with self._lock:
            return {"calls": self.calls, "sizes": list(self.sizes), "max_inflight": self.max_inflight}


def _ids(hits):
    return [[h.doc_id for h in row] for row in hits]


def _expected(queries, k):
    return [[f"{q}#{j}" for j in range(k)] for q in queries]


# ------------------------------------------------------------------------------------ actor body, no Ray
def test_percentile_nearest_rank():
    assert _percentile([], 50) == 0.0
    assert _percentile([5.0], 99) == 5.0
    vals = list(range(1, 101))
    assert _percentile(vals, 50) == 50 and _percentile(vals, 99) == 99 and _percentile(vals, 100) == 100


def test_micro_batching_merges_concurrent_requests_and_keeps_order():
    async def main():
        srv = RetrievalServerImpl(lambda: EchoRetriever(delay_s=0.01), batch_window_ms=20, max_batch=64,
                                  max_concurrency=2)
        reqs = [[f"r{i}q{j}" for j in range(1 + i % 3)] for i in range(30)]
        replies = await asyncio.gather(*(srv.batch_search(q, 2) for q in reqs))
        for q, reply in zip(reqs, replies):
            assert reply[0] == "ok" and _ids(reply[1]) == _expected(q, 2)
        st = await srv.stats()
        assert st["requests"] == 30 and st["queries"] == sum(map(len, reqs))
        assert st["inner_calls"] < 30 and st["inner"]["calls"] == st["inner_calls"]
        assert st["mean_batch_size"] > 1.0 and st["mean_requests_per_batch"] > 1.0
        return st

    st = asyncio.run(main())
    for key in ("qps", "latency_ms", "inner_latency_ms", "errors", "mean_batch_size"):
        assert key in st
    assert st["latency_ms"]["p50"] <= st["latency_ms"]["p99"]


def test_max_batch_bounds_merged_calls_but_never_splits_a_request():
    async def main():
        srv = RetrievalServerImpl(lambda: EchoRetriever(), batch_window_ms=50, max_batch=5, max_concurrency=1)
        reqs = [[f"a{i}", f"b{i}"] for i in range(6)] + [[f"big{j}" for j in range(9)]]
        replies = await asyncio.gather(*(srv.batch_search(q, 1) for q in reqs))
        assert [_ids(r[1]) for r in replies] == [_expected(q, 1) for q in reqs]
        return srv.retriever.sizes

    sizes = asyncio.run(main())
    assert 9 in sizes  # the oversized request went alone, whole
    assert all(s <= 5 for s in sizes if s != 9) and sum(sizes) == 21


def test_different_k_are_not_merged_and_concurrency_is_limited():
    async def main():
        srv = RetrievalServerImpl(lambda: EchoRetriever(delay_s=0.03), batch_window_ms=1, max_batch=2,
                                  max_concurrency=2)
        reqs = [([f"q{i}"], 1 + i % 3) for i in range(24)]
        replies = await asyncio.gather(*(srv.batch_search(q, k) for q, k in reqs))
        for (q, k), r in zip(reqs, replies):
            assert _ids(r[1]) == _expected(q, k)
        return await srv.stats()

    st = asyncio.run(main())
    assert st["max_inflight_seen"] <= 2 and st["inner"]["max_inflight"] <= 2
    assert st["inner"]["max_inflight"] == 2  # the pool was used


def test_inner_errors_are_replies_not_crashes():
    async def main():
        srv = RetrievalServerImpl(lambda: EchoRetriever(), batch_window_ms=0, max_batch=8, max_concurrency=1)
        r429 = await srv.batch_search(["err:http_429"], 1)
        rbug = await srv.batch_search(["boom"], 1)
        rk = await srv.batch_search(["x"], 0)
        ok = await srv.batch_search(["fine"], 1)
        empty = await srv.batch_search([], 3)
        return srv, r429, rbug, rk, ok, empty, await srv.stats(), await srv.health()

    srv, r429, rbug, rk, ok, empty, st, health = asyncio.run(main())
    assert r429[0] == "err" and r429[1] == "http_429" and r429[3] is True
    assert rbug[0] == "err" and rbug[1] == "internal" and "injected bug" in rbug[2]
    assert rk[0] == "err" and rk[1] == "bad_request"
    assert ok == ("ok", [[Hit("fine#0", "fine", "text of fine", 1.0)]]) and empty == ("ok", [])
    assert st["errors"] == {"http_429": 1, "internal": 1, "bad_request": 1}
    assert health["ok"] and health["name"] == "echo:test"


# ------------------------------------------------------------------------------------ real Ray actors
@pytest.fixture(scope="module")
def ray_local(shared_ray):
    with ray_for_module(__name__, shared_ray) as ray:
        yield ray


CFG = RetrievalConfig(timeout_s=10.0, batch_window_ms=20.0, max_batch=64, max_concurrency=2, replicas=1)


@pytest.mark.ray
def test_service_orders_results_across_concurrent_callers_and_merges_requests(ray_local):
    from sonar.retrieval.server import start_retrieval_service, stop

    client = start_retrieval_service(CFG, lambda: EchoRetriever(delay_s=0.02))
    try:
        assert client.name == "service:echo:test"
        reqs = [[f"w{i}-q{j}" for j in range(1 + i % 4)] for i in range(40)]

        async def main():
            return await asyncio.gather(*(client.abatch_search(q, 3) for q in reqs))

        out = asyncio.run(main())
        assert [_ids(r) for r in out] == [_expected(q, 3) for q in reqs]
        assert _ids(client.batch_search(["solo"], 2)) == [["solo#0", "solo#1"]]
        (st,) = client.server_stats()
        assert st["requests"] == 41
        assert st["inner"]["calls"] == st["inner_calls"] < 40  # concurrent requests were merged
        assert st["mean_batch_size"] > 1.0
        assert st["qps"] > 0 and st["latency_ms"]["p99"] >= st["latency_ms"]["p50"] > 0
        assert st["errors"] == {} and st["inner_mode"] == "thread"
        assert client.stats()["errors"] == {}
    finally:
        stop(client)


@pytest.mark.ray
def test_service_errors_come_back_as_retrieval_errors_with_kinds(ray_local):
    from sonar.retrieval.server import start_retrieval_service, stop

    client = start_retrieval_service(replace(CFG, batch_window_ms=0.0), lambda: EchoRetriever())
    try:
        for kind in ("http_429", "http_5xx", "timeout", "connection", "bad_request"):
            with pytest.raises(RetrievalError) as ei:
                client.batch_search([f"err:{kind}"], 1)
            assert ei.value.kind == kind
        with pytest.raises(RetrievalError) as ei:
            asyncio.run(client.abatch_search(["boom"], 1))
        assert ei.value.kind == "internal" and not ei.value.retryable
        # The actor survived every one of them.
        assert client.health()[0]["ok"]
        assert _ids(client.batch_search(["after"], 1)) == [["after#0"]]
        (st,) = client.server_stats()
        assert st["errors"] == {"http_429": 1, "http_5xx": 1, "timeout": 1, "connection": 1, "bad_request": 1,
                                "internal": 1}
        assert client.stats()["errors"]["internal"] == 1
    finally:
        stop(client)


@pytest.mark.ray
def test_service_timeout_becomes_timeout_error(ray_local):
    from sonar.retrieval.server import start_retrieval_service, stop

    # Two slow calls keep two inner slots busy after their callers time out (a thread cannot be
    # cancelled); the third slot still serves. The searches outlast the test, so an answer other than
    # the 0.3 s timeout's error could only come from a client that waited for them.
    client = start_retrieval_service(replace(CFG, timeout_s=0.3, batch_window_ms=0.0, max_concurrency=3),
                                     lambda: EchoRetriever())
    try:
        with pytest.raises(RetrievalError) as ei:
            asyncio.run(client.abatch_search(["sleep:600"], 1))
        assert ei.value.kind == "timeout"
        with pytest.raises(RetrievalError) as ei:
            client.batch_search(["sleep:600"], 1)
        assert ei.value.kind == "timeout"
        assert _ids(client.batch_search(["quick"], 1)) == [["quick#0"]]  # a free slot still serves
        assert client.stats()["errors"] == {"timeout": 2}
    finally:
        stop(client)


@pytest.mark.ray
def test_dead_replica_is_reported_then_skipped(ray_local):
    import ray

    from sonar.retrieval.server import start_retrieval_service, stop

    client = start_retrieval_service(replace(CFG, batch_window_ms=0.0), lambda: EchoRetriever(), num_replicas=2)
    client.recheck_s = 0.2
    try:
        ray.kill(client.handles[0], no_restart=True)
        wait_actor_dead(client.handles[0])
        outcomes = []
        for i in range(8):
            try:
                outcomes.append(_ids(client.batch_search([f"q{i}"], 1))[0][0])
            except RetrievalError as e:
                outcomes.append(e.kind)
            if i == 3:
                time.sleep(0.3)  # a timer, not a synchronisation: past recheck_s, the client re-probes
        assert outcomes.count("connection") == 1, outcomes
        assert [o for o in outcomes if o != "connection"] == [f"q{i}#0" for i in range(8) if outcomes[i] != "connection"]
        st = client.stats()
        assert st["replicas"][0]["dead"] and not st["replicas"][1]["dead"]
        assert st["replica_deaths"] == 1 and st["replica_recoveries"] == 0
        # Async path also skips it.
        assert _ids(asyncio.run(client.abatch_search(["z"], 1))) == [["z#0"]]
        ray.kill(client.handles[1], no_restart=True)
        wait_actor_dead(client.handles[1])
        kinds = set()
        for _ in range(3):
            try:
                client.batch_search(["x"], 1)
            except RetrievalError as e:
                kinds.add(e.kind)
        assert kinds == {"connection"}  # all replicas dead -> connection errors, no crash
    finally:
        stop(client)


@pytest.mark.ray
def test_client_travels_to_other_workers(ray_local):
    import ray

    from sonar.retrieval.server import start_retrieval_service, stop

    client = start_retrieval_service(CFG, lambda: EchoRetriever())
    try:
        @ray.remote(num_cpus=0)
        def worker(c, i):
            return [[h.doc_id for h in row] for row in c.batch_search([f"from-worker-{i}"], 1)]

        outs = ray.get([worker.remote(client, i) for i in range(3)], timeout=60)
        assert outs == [[[f"from-worker-{i}#0"]] for i in range(3)]
        assert pickle.loads(pickle.dumps(client)).timeout_s == client.timeout_s
    finally:
        stop(client)


@pytest.mark.ray
def test_factory_failure_fails_start_loudly(ray_local):
    from sonar.retrieval.server import start_retrieval_service

    def bad_factory():
        raise FileNotFoundError("no index at /nowhere")

    with pytest.raises(RuntimeError, match="replica 0 failed to start"):
        start_retrieval_service(CFG, bad_factory, start_timeout_s=60)
    with pytest.raises(ValueError, match="num_replicas"):
        start_retrieval_service(CFG, lambda: EchoRetriever(), num_replicas=0)


@pytest.mark.ray
@pytest.mark.es
def test_service_over_elasticsearch_uses_the_async_client(ray_local, es_url, make_es_config):
    """The full stack in the actor: ResilientRetriever(ElasticRetriever) built by the factory inside
    the actor; the server awaits its abatch_search (AsyncElasticsearch on the actor's event loop)."""
    from sonar.retrieval.elastic import ElasticRetriever, bulk_index
    from sonar.retrieval.resilient import ResilientRetriever
    from sonar.retrieval.server import start_retrieval_service, stop

    ecfg = make_es_config(es_url)
    driver_side = ElasticRetriever.from_config(ecfg)
    driver_side.create_index()
    docs = [{"id": f"p{i}", "title": f"{w} facts", "text": f"all about the {w}"}
            for i, w in enumerate(["heron", "otter", "walrus", "lynx", "badger", "ibis"])]
    bulk_index(driver_side.client, driver_side.index, docs, progress=False)
    driver_side.close()

    def factory():
        return ResilientRetriever(ElasticRetriever.from_config(ecfg), max_retries=1, backoff_s=0.05)

    client = start_retrieval_service(replace(CFG, batch_window_ms=10.0), factory)
    try:
        words = ["walrus", "heron", "ibis", "lynx", "otter", "badger"] * 3

        async def main():
            return await asyncio.gather(*(client.abatch_search([w], 1) for w in words))

        out = asyncio.run(main())
        assert [hits[0][0].title for hits in out] == [f"{w} facts" for w in words]
        (st,) = client.server_stats()
        assert st["inner_mode"] == "async"
        inner = st["inner"]
        assert inner["successes"] == st["inner_calls"] < len(words)
        assert inner["inner"]["requests"] == st["inner_calls"]  # one _msearch per merged batch
        assert client.name.startswith("service:elasticsearch:")
    finally:
        stop(client)
