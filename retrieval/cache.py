"""An LRU result cache in front of any Retriever, which also coalesces identical queries.

Key: ``(inner.name, normalised query, k, rerank_tag)``; ``inner.name`` identifies backend + index
(and reranker when the inner retriever is one), ``rerank_tag`` names the second stage explicitly
so that two configurations never share entries. Queries are normalised with
``corpus.normalise_query`` (control characters, whitespace, ``max_query_chars``) and the
normalised text is what the inner retriever receives; case is kept (a cased reranker may care).

Per ``batch_search``:

- a query whose key is cached is answered from the cache (``hits``);
- identical queries inside the batch -- the samples of a GRPO group often search for the same
  thing -- and queries another thread is fetching right now are sent to the inner retriever once
  (``coalesced``);
- the remaining unique queries go to the inner retriever in one ``batch_search`` (``misses``);
- an empty query (after normalisation) gets ``[]`` without a call (``empty_queries``).

``hit_rate`` = (hits + coalesced) / lookups: the fraction of non-empty queries the inner retriever
did not see. Failures are not cached: an exception from the inner retriever reaches every caller
waiting for that key. Entries are immutable tuples; callers get fresh lists. Thread-safe.
``max_entries=0`` stores nothing but still coalesces.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Sequence

from sonar.retrieval.base import Hit, Retriever, check_search_args
from sonar.retrieval.corpus import normalise_query

Key = tuple[str, str, int, str]


class CachedRetriever:
    def __init__(self, inner: Retriever, max_entries: int, rerank_tag: str = "none", *,
                 max_query_chars: int | None = None):
        if max_entries < 0:
            raise ValueError(f"max_entries={max_entries} must be >= 0")
        self.inner = inner
        self.max_entries = max_entries
        self.rerank_tag = rerank_tag
        self.max_query_chars = max_query_chars
        self.name = inner.name
        self._lru: OrderedDict[Key, tuple[Hit, ...]] = OrderedDict()
        self._inflight: dict[Key, Future] = {}
        self._lock = threading.Lock()
        self._c = {"hits": 0, "misses": 0, "coalesced": 0, "evictions": 0, "empty_queries": 0, "truncated": 0}

    def key(self, query: str, k: int) -> Key:
        return (self.inner.name, normalise_query(query, self.max_query_chars)[0], k, self.rerank_tag)

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        check_search_args(queries, k)
        name, tag = self.inner.name, self.rerank_tag
        results: list[list[Hit] | None] = [None] * len(queries)
        mine: dict[Key, list[int]] = {}          # keys this call fetches -> positions
        waiting: list[tuple[int, Future]] = []   # positions answered by another thread's fetch
        with self._lock:
            c = self._c
            for i, q in enumerate(queries):
                nq, cut = normalise_query(q, self.max_query_chars)
                c["truncated"] += cut
                if not nq:
                    c["empty_queries"] += 1
                    results[i] = []
                    continue
                key = (name, nq, k, tag)
                entry = self._lru.get(key)
                if entry is not None:
                    self._lru.move_to_end(key)
                    c["hits"] += 1
                    results[i] = list(entry)
                elif key in mine:
                    mine[key].append(i)
                    c["coalesced"] += 1
                elif key in self._inflight:
                    waiting.append((i, self._inflight[key]))
                    c["coalesced"] += 1
                else:
                    mine[key] = [i]
                    self._inflight[key] = Future()
                    c["misses"] += 1
        if mine:
            keys = list(mine)
            try:
                fetched = self.inner.batch_search([key[1] for key in keys], k)
                if len(fetched) != len(keys):
                    raise RuntimeError(f"{name}: {len(fetched)} result lists for {len(keys)} queries")
            except BaseException as e:
                with self._lock:
                    futs = [self._inflight.pop(key) for key in keys]
                for f in futs:
                    f.set_exception(e)
                raise
            with self._lock:
                futs = []
                for key, hits in zip(keys, fetched):
                    entry = tuple(hits)
                    if self.max_entries:
                        self._lru[key] = entry
                        self._lru.move_to_end(key)
                    futs.append((self._inflight.pop(key), entry))
                    for i in mine[key]:
                        results[i] = list(entry)
                while len(self._lru) > self.max_entries:
                    self._lru.popitem(last=False)
                    self._c["evictions"] += 1
            for f, entry in futs:
                f.set_result(entry)
        for i, f in waiting:
            results[i] = list(f.result())
        return results  # type: ignore[return-value]

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._c)
            s["entries"] = len(self._lru)
        s["lookups"] = s["hits"] + s["misses"] + s["coalesced"]
        s["hit_rate"] = (s["hits"] + s["coalesced"]) / s["lookups"] if s["lookups"] else 0.0
        inner_stats = getattr(self.inner, "stats", None)
        if callable(inner_stats):
            s["inner"] = inner_stats()  # e.g. the reranker's cost per search
        return s
