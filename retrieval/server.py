"""The retrieval service's server: a small pool of Ray actors that serves every rollout worker.

:class:`RetrievalServer` is the async Ray actor; the plain class :class:`RetrievalServerImpl` is its
body (usable without Ray, in an event loop, in tests). It builds its retriever ONCE from a zero-arg
``factory`` (e.g. ``lambda: build_retriever(cfg, ...)``; the factory should return the whole stack:
cache -> resilient -> backend). Requests are **micro-batched**: a dispatcher waits for a free
inner-call slot (``max_concurrency`` calls in flight at most), then collects queued requests for up
to ``batch_window_ms`` after the oldest one arrived or until ``max_batch`` queries are queued, and
sends them as ONE inner search through ``base.search_async`` (the retriever's own ``abatch_search``
when it has one, else ``batch_search`` in the server's thread pool). Each caller gets its own slice,
in order. While every slot is busy, requests keep merging, so batches grow with load. Requests with
different ``k`` are never merged. A request is never split: one with more than ``max_batch`` queries
is sent alone. An inner failure fails every request merged into that call (backends turn a single
bad query into ``[]``, see ``elastic.py``).

Replies are tagged tuples, ``("ok", hits)`` or ``("err", kind, message, retryable)``, rather than
raised exceptions: inner errors never crash the actor, and nothing depends on pickling
:class:`RetrievalError` across processes (``client.py`` turns them back into hits or errors).
``health()`` and ``stats()`` (QPS, latency p50/p99 in ms, mean batch size, errors by kind, and the
inner retriever's own ``stats()`` -- e.g. the cache's hit rate -- under ``"inner"``) are cheap actor
calls. ``start_retrieval_service`` starts the pool and returns a ``client.RetrievalClient`` on it.

The inner retriever must be thread-safe when ``max_concurrency > 1``.
"""
from __future__ import annotations

from sonar.cluster.wire.bootstrap import role_process

role_process()  # first: in an actor's process, its thread and hub settings before torch and transformers load

import asyncio
import logging
import math
import operator
import os
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray

from sonar.retrieval.base import RetrievalError, Retriever, native_async, search_async
from sonar.retrieval.client import RetrievalClient

log = logging.getLogger(__name__)

Reply = tuple  # ("ok", list[list[Hit]]) | ("err", kind, message, retryable)


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    idx = min(len(s), max(1, math.ceil(q / 100.0 * len(s)))) - 1
    return float(s[idx])


def _err(kind: str, message: str, retryable: bool | None = None) -> Reply:
    e = RetrievalError(kind, message, retryable)
    return ("err", e.kind, message, e.retryable)


@dataclass
class _Request:
    queries: list[str]
    k: int
    future: asyncio.Future
    t_enqueued: float


class RetrievalServerImpl:
    """The actor's body (also usable without Ray, e.g. in an event loop in tests)."""

    def __init__(self, factory: Callable[[], Retriever], batch_window_ms: float = 2.0, max_batch: int = 64,
                 max_concurrency: int = 16, latency_window: int = 10_000,
                 qps_window_s: float = 60.0):
        if max_batch < 1 or max_concurrency < 1 or batch_window_ms < 0:
            raise ValueError(f"max_batch={max_batch} and max_concurrency={max_concurrency} must be >= 1, "
                             f"batch_window_ms={batch_window_ms} >= 0")
        self.retriever = factory()
        self.name = str(getattr(self.retriever, "name", type(self.retriever).__name__))
        self.window_s = batch_window_ms / 1000.0
        self.max_batch = max_batch
        self.max_concurrency = max_concurrency
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="retrieval")
        self._queue: deque[_Request] = deque()
        self._queued_queries = 0
        self._started = time.monotonic()
        self._dispatcher: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._full: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()
        self._inflight = 0
        self._max_inflight_seen = 0
        self._c: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._latency_ms: deque[float] = deque(maxlen=latency_window)
        self._inner_ms: deque[float] = deque(maxlen=latency_window)
        self._recent: deque[tuple[float, int]] = deque()
        self._qps_window_s = qps_window_s

    # ----------------------------------------------------------------------------------- requests
    async def batch_search(self, queries: Sequence[str], k: int) -> Reply:
        """One caller's request. Returns ("ok", hits) or ("err", kind, message, retryable)."""
        t0 = time.monotonic()
        queries = [str(q) for q in queries]
        self._c["requests"] += 1
        self._c["queries"] += len(queries)
        self._recent.append((t0, len(queries)))
        try:
            k = operator.index(k)  # accepts numpy integers, refuses floats
        except TypeError:
            k = -1
        if k < 1:
            reply = _err("bad_request", "k must be an integer >= 1")
        elif not queries:
            reply = ("ok", [])
        else:
            try:
                self._ensure_dispatcher()
                fut = asyncio.get_running_loop().create_future()
                self._queue.append(_Request(queries, k, fut, t0))
                self._queued_queries += len(queries)
                self._wake.set()
                if self._queued_queries >= self.max_batch:
                    self._full.set()
                reply = await fut
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never crash the actor
                log.exception("retrieval server: unexpected error")
                reply = _err("internal", f"{type(e).__name__}: {e}")
        if reply[0] == "err":
            self._errors[reply[1]] += 1
        self._latency_ms.append((time.monotonic() - t0) * 1000.0)
        return reply

    def _ensure_dispatcher(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            if self._dispatcher is not None and not self._dispatcher.cancelled() and self._dispatcher.exception():
                log.error("retrieval dispatcher died, restarting: %r", self._dispatcher.exception())
                self._c["dispatcher_restarts"] += 1
            self._wake = asyncio.Event()
            self._full = asyncio.Event()
            self._slots = asyncio.Semaphore(self.max_concurrency)
            if self._queue:
                self._wake.set()
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            await self._slots.acquire()
            try:
                if not self._queue:
                    self._wake.clear()
                    self._slots.release()
                    continue
                delay = self.window_s - (time.monotonic() - self._queue[0].t_enqueued)
                if delay > 0 and self._queued_queries < self.max_batch:
                    try:
                        await asyncio.wait_for(self._full.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
                batch = self._take()
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                continue
            task = loop.create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Request]:
        """Pop queued requests with the first one's k, up to max_batch queries (at least one request)."""
        if not self._queue:
            return []
        k = self._queue[0].k
        batch: list[_Request] = []
        kept: deque[_Request] = deque()
        n, full = 0, False
        while self._queue:
            r = self._queue.popleft()
            if r.future.done():  # the caller went away (cancelled after a client timeout)
                self._queued_queries -= len(r.queries)
                continue
            if not full and r.k == k and (not batch or n + len(r.queries) <= self.max_batch):
                batch.append(r)
                n += len(r.queries)
                self._queued_queries -= len(r.queries)
            else:
                full = full or r.k == k  # later same-k requests wait too, so each caller stays FIFO
                kept.append(r)
        self._queue = kept
        if self._queued_queries < self.max_batch:
            self._full.clear()
        if not self._queue:
            self._wake.clear()
        return batch

    async def _run(self, batch: list[_Request]) -> None:
        self._inflight += 1
        self._max_inflight_seen = max(self._max_inflight_seen, self._inflight)
        flat = [q for r in batch for q in r.queries]
        k = batch[0].k
        t0 = time.monotonic()
        try:
            results = await search_async(self.retriever, flat, k, self._executor)
            if not isinstance(results, list) or len(results) != len(flat):
                raise RetrievalError("internal", f"{self.name} returned {len(results) if isinstance(results, list) else type(results).__name__} "
                                                 f"result lists for {len(flat)} queries")
            replies: list[Reply] = []
            i = 0
            for r in batch:
                replies.append(("ok", [list(h)[:k] for h in results[i:i + len(r.queries)]]))
                i += len(r.queries)
        except RetrievalError as e:
            replies = [("err", e.kind, str(e), e.retryable)] * len(batch)
        except Exception as e:  # noqa: BLE001 - inner failures are data, never an actor crash
            replies = [_err("internal", f"{type(e).__name__}: {e}", retryable=False)] * len(batch)
        finally:
            self._inflight -= 1
            self._slots.release()
        self._c["inner_calls"] += 1
        self._c["inner_queries"] += len(flat)
        self._c["inner_requests"] += len(batch)
        self._inner_ms.append((time.monotonic() - t0) * 1000.0)
        for r, reply in zip(batch, replies):
            if not r.future.done():
                r.future.set_result(reply)

    # ----------------------------------------------------------------------------------- introspection
    async def health(self) -> dict[str, Any]:
        dispatcher_ok = self._dispatcher is None or not self._dispatcher.done()
        return {"ok": dispatcher_ok, "name": self.name, "pid": os.getpid(), "inflight": self._inflight,
                "queued": len(self._queue), "uptime_s": time.monotonic() - self._started,
                # where the driver kills it if it hangs (in-process, without Ray, there is no node: asking would start Ray)
                "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
                "created": _created()}

    async def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > self._qps_window_s:
            self._recent.popleft()
        span = min(self._qps_window_s, max(now - self._started, 1e-3))
        calls = self._c["inner_calls"]
        lat, inner = list(self._latency_ms), list(self._inner_ms)
        out: dict[str, Any] = {
            "name": self.name,
            "inner_mode": "async" if native_async(self.retriever) is not None else "thread",
            "requests": self._c["requests"],
            "queries": self._c["queries"],
            "qps": sum(n for _, n in self._recent) / span,
            "requests_per_s": len(self._recent) / span,
            "inner_calls": calls,
            "mean_batch_size": self._c["inner_queries"] / calls if calls else 0.0,
            "mean_requests_per_batch": self._c["inner_requests"] / calls if calls else 0.0,
            "latency_ms": {"p50": _percentile(lat, 50), "p99": _percentile(lat, 99),
                           "mean": sum(lat) / len(lat) if lat else 0.0},
            "inner_latency_ms": {"p50": _percentile(inner, 50), "p99": _percentile(inner, 99)},
            "errors": dict(self._errors),
            "inflight": self._inflight,
            "max_inflight_seen": self._max_inflight_seen,
            "queued": len(self._queue),
            "dispatcher_restarts": self._c["dispatcher_restarts"],
        }
        inner_stats = getattr(self.retriever, "stats", None)
        if callable(inner_stats):
            try:
                out["inner"] = inner_stats()
            except Exception as e:  # noqa: BLE001
                out["inner"] = {"stats_error": f"{type(e).__name__}: {e}"}
        return out


RetrievalServer = ray.remote(RetrievalServerImpl)
"""``RetrievalServer.options(...).remote(factory, batch_window_ms, max_batch, max_concurrency)``."""


def _created() -> float | None:
    """This process's creation time (``psutil``), which tells it apart from a later one with its pid."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - no psutil: the driver then never kills by pid
        return None


def start_retrieval_service(cfg: Any, factory: Callable[[], Retriever], num_replicas: int | None = None, *,
                            num_cpus: float = 0.0, start_timeout_s: float = 300.0, recheck_s: float = 5.0,
                            max_restarts: int = 0, actor_options: dict[str, Any] | None = None) -> RetrievalClient:
    """Start ``num_replicas`` (default ``cfg.replicas``) RetrievalServer actors built with ``factory``
    and the batching/concurrency settings of ``cfg`` (a :class:`RetrievalConfig`), wait until each
    answers ``health()``, and return a :class:`RetrievalClient` (``client.handles``) with
    ``timeout_s = cfg.timeout_s``. ``num_cpus=0`` by default: the servers mostly wait on I/O or on
    an index in a thread, and must not take the CPU slots of the rollout workers.

    A factory that raises makes this raise ``RuntimeError`` naming the replica, after killing the
    replicas already started."""
    if not ray.is_initialized():
        raise RuntimeError("start_retrieval_service: call ray.init() first")
    n = cfg.replicas if num_replicas is None else num_replicas
    if n < 1:
        raise ValueError(f"num_replicas={n} must be >= 1 (retrieval.replicas counts the service's Ray actors)")
    opts = {"num_cpus": num_cpus, "max_concurrency": 1000, "max_restarts": max_restarts}
    opts.update(actor_options or {})
    handles = [RetrievalServer.options(**opts).remote(factory, cfg.batch_window_ms, cfg.max_batch, cfg.max_concurrency)
               for _ in range(n)]
    refs = [h.health.remote() for h in handles]
    name = "service"
    for i, ref in enumerate(refs):
        try:
            info = ray.get(ref, timeout=start_timeout_s)
        except Exception as e:  # noqa: BLE001
            stop(handles)
            raise RuntimeError(f"retrieval replica {i} failed to start: {type(e).__name__}: {str(e)[:2000]}") from e
        name = f"service:{info['name']}"
    return RetrievalClient(handles, timeout_s=cfg.timeout_s, recheck_s=recheck_s, name=name)


def stop(service: RetrievalClient | Sequence[Any]) -> None:
    """Kill the replicas of a client (or a list of handles). Idempotent."""
    handles = service.handles if isinstance(service, RetrievalClient) else list(service)
    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
