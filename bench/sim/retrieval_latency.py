"""``LatencyInjectingRetriever``: a BENCHMARK wrapper that makes a fast local index behave like a remote one.

Why: the embedded tantivy index answers in about a millisecond, so on one machine retrieval never
stalls a rollout. A real search agent talks to a search cluster (Elasticsearch, a web-search API)
whose latency is tens to hundreds of milliseconds with a long right tail. Asynchronous RL exists
largely to hide that kind of wait, so the async-vs-sync benchmark needs it to be present and
configurable (``sim.retrieval_latency_ms`` / ``sim.retrieval_latency_sigma``, wired in by
``hooks.SimRetrieverWrap`` through the production hook ``build_retriever(..., wrap_backend=)``).

Model: every ``batch_search`` call (one batched request to the "cluster", whatever the number of
queries in it) first sleeps ``lognormal(ln median_ms, sigma)`` milliseconds, then delegates to the
real retriever, so the hits are real. ``sigma = 0`` gives a constant delay; ``sigma = 0.8`` gives a
mean of 1.38x and a p99 of about 6.4x the median. An empty query list makes no request and does not
sleep. The sleep runs outside any lock, so concurrent calls (the retrieval service runs up to
``retrieval.max_concurrency`` inner calls in threads) overlap, as independent requests to a cluster do.

The factory puts this wrapper *below* the reranker and the cache, so cache hits stay fast, as they would in front of a
remote cluster.

Server-side queueing (``servers`` > 0, ``sim.retrieval_servers``): the cluster serves at most ``servers``
requests at once; a request first waits for a free server (FIFO as the threads wake; the wait is counted
in ``queued_ms_*``), then holds it for its service time, the lognormal draw plus ``per_query_ms`` for each
query in the batch (an ``msearch`` costs more with more queries), plus the real search. Latency then grows
with load, as an M/G/c queue's does. ``servers`` = 0: unbounded, as before, and latency does not grow
with load.

Pure module: standard library only (``math``, ``random``, ``threading``, ``time``).
"""
from __future__ import annotations

import math
import random
import threading
import time
from typing import Any, Sequence


class LatencyInjectingRetriever:
    """A ``sonar.retrieval.base.Retriever`` that sleeps a lognormal time per call, then delegates to ``inner``.

    ``median_ms``: median injected delay in milliseconds (>= 0; 0 injects nothing).
    ``sigma``: lognormal shape (>= 0; 0 = constant ``median_ms``).
    ``seed``: seeds the delay sequence (None: nondeterministic). Delays are drawn in call order.
    ``name`` is ``inner.name``: the wrapper changes timing, not results, so cache keys stay valid.
    """

    def __init__(self, inner: Any, median_ms: float, sigma: float, seed: int | None = None, servers: int = 0,
                 per_query_ms: float = 0.0):
        if not math.isfinite(median_ms) or median_ms < 0:
            raise ValueError(f"median_ms={median_ms} must be a finite number >= 0 (sim.retrieval_latency_ms)")
        if not math.isfinite(sigma) or sigma < 0:
            raise ValueError(f"sigma={sigma} must be a finite number >= 0 (sim.retrieval_latency_sigma)")
        if int(servers) != servers or servers < 0:
            raise ValueError(f"servers={servers} must be an integer >= 0 (sim.retrieval_servers; 0: unbounded)")
        if not math.isfinite(per_query_ms) or per_query_ms < 0:
            raise ValueError(f"per_query_ms={per_query_ms} must be a finite number >= 0 (sim.retrieval_per_query_ms)")
        self.servers, self.per_query_ms = int(servers), float(per_query_ms)
        self._slots = threading.BoundedSemaphore(self.servers) if self.servers else None
        self._queued_ms = 0.0
        self._queued_max_ms = 0.0
        self._queued_calls = 0
        self._in_service = 0
        self.max_in_service = 0
        """Most requests in service at once (never above ``servers`` when it is set)."""
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.median_ms = float(median_ms)
        self.sigma = float(sigma)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._calls = 0
        self._total_ms = 0.0
        self._max_ms = 0.0

    def draw_ms(self) -> float:
        """One delay in milliseconds from lognormal(ln median_ms, sigma) (thread-safe)."""
        if self.median_ms == 0.0:
            return 0.0
        with self._lock:
            if self.sigma == 0.0:
                return self.median_ms
            return self._rng.lognormvariate(math.log(self.median_ms), self.sigma)

    def batch_search(self, queries: Sequence[str], k: int):
        if len(queries) == 0:
            return self.inner.batch_search(queries, k)
        delay_ms = self.draw_ms() + self.per_query_ms * len(queries)
        if self._slots is None:
            return self._serve(queries, k, delay_ms)
        t0 = time.perf_counter()
        with self._slots:  # wait for a free server: the queueing the cluster's load adds
            waited = (time.perf_counter() - t0) * 1000.0
            with self._lock:
                self._queued_ms += waited
                self._queued_max_ms = max(self._queued_max_ms, waited)
                self._queued_calls += waited > 0.1
            return self._serve(queries, k, delay_ms)

    def _serve(self, queries: Sequence[str], k: int, delay_ms: float):
        with self._lock:
            self._in_service += 1
            self.max_in_service = max(self.max_in_service, self._in_service)
        try:
            if delay_ms > 0:
                time.sleep(delay_ms / 1000.0)  # simulated service time, not synchronisation
            with self._lock:
                self._calls += 1
                self._total_ms += delay_ms
                self._max_ms = max(self._max_ms, delay_ms)
            return self.inner.batch_search(queries, k)
        finally:
            with self._lock:
                self._in_service -= 1

    def stats(self) -> dict:
        """The inner retriever's ``stats()`` (if any) plus ``injected_*`` totals of this wrapper."""
        inner = self.inner.stats() if callable(getattr(self.inner, "stats", None)) else {}
        with self._lock:
            calls, total, mx = self._calls, self._total_ms, self._max_ms
            queued, qmax, qcalls, busiest = self._queued_ms, self._queued_max_ms, self._queued_calls, self.max_in_service
        return {**dict(inner), "injected_calls": calls, "injected_ms_total": total,
                "injected_ms_mean": total / calls if calls else 0.0, "injected_ms_max": mx,
                "injected_median_ms": self.median_ms, "injected_sigma": self.sigma,
                "injected_servers": self.servers, "injected_per_query_ms": self.per_query_ms,
                "queued_ms_total": queued, "queued_ms_mean": queued / calls if calls else 0.0,
                "queued_ms_max": qmax, "queued_calls": qcalls, "max_in_service": busiest}

    def __repr__(self) -> str:
        return (f"LatencyInjectingRetriever({self.name!r}, median_ms={self.median_ms}, sigma={self.sigma}, "
                f"servers={self.servers}, per_query_ms={self.per_query_ms})")
