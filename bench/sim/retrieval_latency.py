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
remote cluster. It is not a model of server-side queueing: latency does not grow with load.

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

    def __init__(self, inner: Any, median_ms: float, sigma: float, seed: int | None = None):
        if not math.isfinite(median_ms) or median_ms < 0:
            raise ValueError(f"median_ms={median_ms} must be a finite number >= 0 (sim.retrieval_latency_ms)")
        if not math.isfinite(sigma) or sigma < 0:
            raise ValueError(f"sigma={sigma} must be a finite number >= 0 (sim.retrieval_latency_sigma)")
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
        delay_ms = self.draw_ms()
        if delay_ms > 0:
            time.sleep(delay_ms / 1000.0)
        with self._lock:
            self._calls += 1
            self._total_ms += delay_ms
            self._max_ms = max(self._max_ms, delay_ms)
        return self.inner.batch_search(queries, k)

    def stats(self) -> dict:
        """The inner retriever's ``stats()`` (if any) plus ``injected_*`` totals of this wrapper."""
        inner = self.inner.stats() if callable(getattr(self.inner, "stats", None)) else {}
        with self._lock:
            calls, total, mx = self._calls, self._total_ms, self._max_ms
        return {**dict(inner), "injected_calls": calls, "injected_ms_total": total,
                "injected_ms_mean": total / calls if calls else 0.0, "injected_ms_max": mx,
                "injected_median_ms": self.median_ms, "injected_sigma": self.sigma}

    def __repr__(self) -> str:
        return f"LatencyInjectingRetriever({self.name!r}, median_ms={self.median_ms}, sigma={self.sigma})"
