"""CachedRetriever (LRU, in-batch and in-flight coalescing, counters, thread safety) and the pure
multi-query step functions (actors.multiquery: training's and the retrieval benchmark's), which run in
front of the cache in a RAG-R1 step."""
import threading

import pytest

from sonar.retrieval.base import Hit, RetrievalError, Retriever
from sonar.retrieval.cache import CachedRetriever
from sonar.actors.multiquery import dedupe_step, plan_step
from tests.waiting import DEADLINE_S, wait_until


class CountingInner:
    """A fake backend: hit ids derived from the query; records every call. With a ``gate``, a call
    stays in flight until the test opens it."""

    def __init__(self, name="fake:idx", gate: threading.Event | None = None, fail=None):
        self.name = name
        self.calls: list[tuple[list[str], int]] = []
        self.gate = gate
        self.fail = fail
        self._lock = threading.Lock()

    def batch_search(self, queries, k):
        with self._lock:
            self.calls.append((list(queries), k))
        if self.gate is not None:
            assert self.gate.wait(DEADLINE_S), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        return [[Hit(f"{q}#{i}", q, f"text {i}", float(k - i)) for i in range(k)] for q in queries]

    @property
    def queries_seen(self):
        return [q for qs, _ in self.calls for q in qs]


def test_is_a_retriever_and_group_duplicates_sent_once():
    inner = CountingInner()
    c = CachedRetriever(inner, max_entries=100, rerank_tag="none")
    assert isinstance(c, Retriever) and c.name == inner.name
    group = ["who founded x"] * 8 + ["where is y"] * 4  # the samples of a GRPO group
    res = c.batch_search(group, k=2)
    assert inner.calls == [(["who founded x", "where is y"], 2)]
    assert [r[0].doc_id for r in res] == ["who founded x#0"] * 8 + ["where is y#0"] * 4
    s = c.stats()
    assert (s["misses"], s["coalesced"], s["hits"]) == (2, 10, 0)
    assert s["hit_rate"] == pytest.approx(10 / 12)


def test_cached_entries_answer_without_inner_call():
    inner = CountingInner()
    c = CachedRetriever(inner, 100, "none")
    first = c.batch_search(["a", "b"], 3)
    again = c.batch_search(["b", "  a\n", "c"], 3)  # " a\n" normalises to "a"
    assert inner.calls == [(["a", "b"], 3), (["c"], 3)]
    assert again[0] == first[1] and again[1] == first[0]
    s = c.stats()
    assert (s["hits"], s["misses"], s["coalesced"], s["lookups"]) == (2, 3, 0, 5)
    assert s["hit_rate"] == pytest.approx(2 / 5)


def test_key_includes_k_inner_name_and_rerank_tag():
    inner = CountingInner()
    c = CachedRetriever(inner, 100, "none")
    c.batch_search(["q"], 1)
    c.batch_search(["q"], 2)
    assert len(inner.calls) == 2
    assert c.key("q", 1) == ("fake:idx", "q", 1, "none")
    other = CachedRetriever(inner, 100, "dense:minilm@20")
    assert other.key("q", 1) != c.key("q", 1)
    assert CachedRetriever(CountingInner(name="fake:other"), 10).key("q", 1)[0] == "fake:other"


def test_lru_eviction_order_and_counter():
    inner = CountingInner()
    c = CachedRetriever(inner, max_entries=2, rerank_tag="none")
    c.batch_search(["a"], 1)
    c.batch_search(["b"], 1)
    c.batch_search(["a"], 1)  # a is now most recent
    c.batch_search(["c"], 1)  # evicts b
    assert c.stats()["evictions"] == 1 and c.stats()["entries"] == 2
    n = len(inner.calls)
    c.batch_search(["a", "c"], 1)
    assert len(inner.calls) == n  # both still cached
    c.batch_search(["b"], 1)
    assert inner.calls[-1] == (["b"], 1)


def test_zero_entries_only_coalesces():
    inner = CountingInner()
    c = CachedRetriever(inner, max_entries=0)
    c.batch_search(["a", "a"], 1)
    c.batch_search(["a"], 1)
    assert inner.calls == [(["a"], 1), (["a"], 1)]
    assert c.stats()["entries"] == 0


def test_empty_queries_answered_without_call_and_truncation_in_key():
    inner = CountingInner()
    c = CachedRetriever(inner, 10, max_query_chars=10)
    res = c.batch_search(["", " \t\n", "\x00"], 2)
    assert res == [[], [], []] and inner.calls == []
    c.batch_search(["0123456789 tail one", "0123456789 tail two"], 1)  # same after truncation
    assert inner.calls == [(["0123456789"], 1)]
    s = c.stats()
    assert s["empty_queries"] == 3 and s["truncated"] == 2


def test_results_are_fresh_lists():
    c = CachedRetriever(CountingInner(), 10)
    r1 = c.batch_search(["a", "a"], 2)
    r1[0].clear()
    assert len(r1[1]) == 2
    assert len(c.batch_search(["a"], 2)[0]) == 2


def test_errors_are_not_cached():
    inner = CountingInner(fail=RetrievalError("timeout", "slow"))
    c = CachedRetriever(inner, 10)
    with pytest.raises(RetrievalError):
        c.batch_search(["a", "a"], 1)
    inner.fail = None
    assert c.batch_search(["a"], 1)[0][0].doc_id == "a#0"
    assert len(inner.calls) == 2 and c.stats()["entries"] == 1


def test_concurrent_identical_queries_fetch_once():
    gate = threading.Event()
    inner = CountingInner(gate=gate)
    c = CachedRetriever(inner, 100)
    results = []

    def worker():
        results.append(c.batch_search(["same query"], 3))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    # The first lookup is in flight (held at the gate) until the five others have joined it.
    wait_until(lambda: c.stats()["coalesced"] == 5, what="five lookups to wait on the one in flight")
    gate.set()
    for t in threads:
        t.join()
    assert len(inner.calls) == 1
    assert all(r == results[0] for r in results)
    s = c.stats()
    assert s["misses"] == 1 and s["coalesced"] + s["hits"] == 5


def test_concurrent_failure_reaches_waiters():
    gate = threading.Event()
    inner = CountingInner(gate=gate, fail=RetrievalError("connection", "down"))
    c = CachedRetriever(inner, 100)
    errors = []

    def worker():
        try:
            c.batch_search(["q"], 1)
        except RetrievalError as e:
            errors.append(e.kind)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: c.stats()["coalesced"] == 3, what="three lookups to wait on the failing one in flight")
    gate.set()
    for t in threads:
        t.join()
    assert errors == ["connection"] * 4 and len(inner.calls) == 1


def test_thread_safety_under_load():
    inner = CountingInner()
    c = CachedRetriever(inner, max_entries=50)
    vocab = [f"q{i}" for i in range(80)]

    def worker(seed):
        for j in range(200):
            qs = [vocab[(seed * 7 + j * 3 + m) % 80] for m in range(4)]
            res = c.batch_search(qs, 2)
            assert [r[0].title for r in res] == qs

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = c.stats()
    assert s["lookups"] == 4 * 200 * 4
    assert s["misses"] == len(inner.queries_seen)
    assert s["entries"] <= 50 and s["evictions"] == s["misses"] - s["entries"]


# ----------------------------------------------------------------------- multi-query step helpers

def H(doc_id):
    return Hit(doc_id, doc_id, "", 1.0)


def test_plan_step_strips_drops_empty_and_counts_over_budget():
    # training's planning: pieces stripped, empty ones gone (not counted), the first `budget` kept and
    # the rest counted; a repeated query is kept (it is searched once and shown new documents)
    kept, dropped = plan_step([" a b ", "A  b", "", "  ", "c", "a b", "e"], budget=3)
    assert kept == ["a b", "A  b", "c"] and dropped == 2
    assert plan_step(["x", ""], 3) == (["x"], 0) and plan_step([], 3) == ([], 0)
    with pytest.raises(ValueError, match="budget=0"):
        plan_step(["x"], 0)


def test_dedupe_step_skips_documents_shown_earlier():
    results = [
        [H("d1"), H("d2"), H("d3")],
        [H("d1"), H("d4"), H("d2"), H("d5")],  # d1 shown for query 0: takes d4, then d5 (d2 shown)
        [H("d2"), H("d2"), H("d4")],  # nothing new left
    ]
    out = dedupe_step(results, per_query=2)
    assert [[h.doc_id for h in r] for r in out] == [["d1", "d2"], ["d4", "d5"], []]
    assert dedupe_step([[H("x"), H("x"), H("y")]], 2)[0] == [H("x"), H("y")]
    with pytest.raises(ValueError, match="per_query=0"):
        dedupe_step(results, 0)


def test_dedupe_step_upstream_shows_each_query_its_own_top_hits():
    # protocol.rules=upstream (RAG-R1's released code): repeats across and within queries kept
    results = [[H("d1"), H("d2"), H("d3")], [H("d1"), H("d1"), H("d4")]]
    out = dedupe_step(results, per_query=2, distinct=False)
    assert [[h.doc_id for h in r] for r in out] == [["d1", "d2"], ["d1", "d1"]]


def test_a_repeated_query_backfills_from_its_deeper_hits():
    # k above docs_per_query is what lets a later (or repeated) query show new documents
    same = [H("d1"), H("d2"), H("d3"), H("d4")]
    out = dedupe_step([same, same], per_query=2)
    assert [[h.doc_id for h in r] for r in out] == [["d1", "d2"], ["d3", "d4"]]


def test_multiquery_step_through_cache():
    inner = CountingInner()
    c = CachedRetriever(inner, 100)
    kept, dropped = plan_step(["alpha", "beta", "alpha", "gamma"], budget=2)
    res = dedupe_step(c.batch_search(kept, 2), per_query=1)
    assert [r[0].doc_id for r in res] == ["alpha#0", "beta#0"] and dropped == 2
    assert inner.calls == [(["alpha", "beta"], 2)]
