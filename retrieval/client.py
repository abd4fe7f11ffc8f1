"""The retrieval service's client: what rollout workers (and anyone else) search through.

:class:`RetrievalClient` holds the handles of the ``server.RetrievalServer`` actors and picks the
least-loaded healthy replica (ties round-robin). It follows the retriever convention of
``retrieval.base``: ``batch_search`` blocks (``ray.get``) and ``abatch_search`` awaits the ObjectRef
without a thread; both wait at most ``timeout_s`` (expiry -> ``RetrievalError('timeout')``, the
request is cancelled). A dead replica -> ``RetrievalError('connection')``, and the client skips it,
re-probing its ``health()`` every ``recheck_s`` in the background until it answers again. The
server's tagged replies (``("ok", hits)`` / ``("err", kind, message, retryable)``) become hits or a
``RetrievalError`` here. The client pickles (handles + settings), so it can be passed to
rollout-worker actors. A replica gone for good (its Ray restarts used up) is replaced in its slot by
the driver, which hands every copy of the client the new handle (``replace_replica``).
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, TaskCancelledError

from sonar.retrieval.base import Hit, RetrievalError


def _unwrap(reply: Any) -> list[list[Hit]]:
    if isinstance(reply, tuple) and reply and reply[0] == "ok":
        return reply[1]
    if isinstance(reply, tuple) and len(reply) == 4 and reply[0] == "err":
        _, kind, message, retryable = reply
        raise RetrievalError(kind, message, retryable)
    raise RetrievalError("internal", f"malformed reply from retrieval server: {type(reply).__name__}")


def _cancel(ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - finished or gone already
        pass


@dataclass
class _Replica:
    handle: Any
    inflight: int = 0
    dead: bool = False
    retry_at: float = 0.0
    probe: Any = None
    failures: int = 0
    last_error: str = ""


class _Expired(Exception):
    """Raised inside ``RetrievalClient._request`` when the reply did not come within ``timeout_s``."""


class RetrievalClient:
    """Client of the retrieval pool (see the module docstring): a ``Retriever`` (``batch_search``
    blocks) with a native coroutine ``abatch_search``."""

    def __init__(self, handles: Sequence[Any], timeout_s: float = 10.0, recheck_s: float = 5.0, name: str = "service",
                 wait_healthy_s: float = 0.0):
        """``wait_healthy_s``: while no replica is healthy (all dead or restarting), a search waits up to
        this long for one to come back (re-probing every ``recheck_s``) before it fails with
        ``RetrievalError('connection')``; 0: fail at once."""
        if not handles:
            raise ValueError("RetrievalClient needs at least one actor handle")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.handles = list(handles)
        self.timeout_s = float(timeout_s)
        self.recheck_s = float(recheck_s)
        self.name = name
        self.wait_healthy_s = float(wait_healthy_s)
        self._init_state()

    def _init_state(self) -> None:
        self._replicas = [_Replica(h) for h in self.handles]
        self._lock = threading.Lock()
        self._rr = itertools.count()
        self._c: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()

    def __getstate__(self) -> dict[str, Any]:
        return {"handles": self.handles, "timeout_s": self.timeout_s, "recheck_s": self.recheck_s, "name": self.name,
                "wait_healthy_s": self.wait_healthy_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("wait_healthy_s", 0.0)
        self.__dict__.update(state)
        self._init_state()

    def __repr__(self) -> str:
        return f"RetrievalClient(name={self.name!r}, replicas={len(self.handles)}, timeout_s={self.timeout_s})"

    # ----------------------------------------------------------------------------------- replicas
    def replace_replica(self, i: int, handle: Any) -> None:
        """Put ``handle`` (a new replica, already answering) in slot ``i`` in place of a dead one; it is
        healthy from now on. Requests still in flight on the old handle keep their slot's load count
        and, when they fail, no longer mark the slot dead (``_mark_dead`` checks the handle)."""
        if not 0 <= i < len(self.handles):
            raise ValueError(f"replica slot {i} out of range: the client holds {len(self.handles)} replicas")
        with self._lock:
            old = self._replicas[i]
            self.handles[i] = handle
            self._replicas[i] = _Replica(handle, inflight=old.inflight)
            self._c["replica_replacements"] += 1

    def _poll_probes(self, now: float) -> None:
        for rep in self._replicas:
            if not rep.dead:
                continue
            if rep.probe is not None:
                ready, _ = ray.wait([rep.probe], timeout=0)
                if not ready:
                    continue
                try:
                    ok = bool(ray.get(rep.probe, timeout=0).get("ok"))
                except Exception:  # noqa: BLE001 - still dead
                    ok = False
                rep.probe = None
                if ok:
                    rep.dead, rep.failures = False, 0
                    self._c["replica_recoveries"] += 1
                    continue
                rep.retry_at = now + self.recheck_s
            elif now >= rep.retry_at:
                try:
                    rep.probe = rep.handle.health.remote()
                except Exception:  # noqa: BLE001
                    rep.retry_at = now + self.recheck_s

    def _pick(self) -> int:
        with self._lock:
            self._poll_probes(time.monotonic())
            n = len(self._replicas)
            alive = [i for i, r in enumerate(self._replicas) if not r.dead]
            if not alive:
                raise RetrievalError("connection", f"no healthy retrieval replica ({n} dead; re-probing every "
                                                   f"{self.recheck_s}s)")
            start = next(self._rr) % n
            best = min(alive, key=lambda i: (self._replicas[i].inflight, (i - start) % n))
            self._replicas[best].inflight += 1
            return best

    def _release(self, i: int) -> None:
        with self._lock:
            self._replicas[i].inflight -= 1

    def _mark_dead(self, i: int, e: BaseException, handle: Any = None) -> None:
        """``handle``: the one the failed request went to; a slot that holds another one now (replaced
        meanwhile) is left as it is."""
        with self._lock:
            rep = self._replicas[i]
            if handle is not None and rep.handle is not handle:
                return
            if not rep.dead:
                self._c["replica_deaths"] += 1
            rep.dead, rep.failures, rep.probe = True, rep.failures + 1, None
            rep.retry_at = time.monotonic() + self.recheck_s
            rep.last_error = f"{type(e).__name__}: {str(e)[:200]}"

    def _fail(self, err: RetrievalError) -> RetrievalError:
        with self._lock:
            self._errors[err.kind] += 1
        return err

    def _map(self, i: int, e: BaseException, handle: Any = None) -> RetrievalError:
        if isinstance(e, (RayActorError, ObjectLostError)):
            self._mark_dead(i, e, handle)
            return RetrievalError("connection", f"retrieval replica {i} is unavailable: {type(e).__name__}")
        if isinstance(e, TaskCancelledError):
            return RetrievalError("timeout", f"retrieval request on replica {i} was cancelled")
        return RetrievalError("internal", f"retrieval replica {i}: {type(e).__name__}: {str(e)[:500]}")

    # ----------------------------------------------------------------------------------- search
    def _retry_after(self, e: RetrievalError, deadline: float) -> float | None:
        """Seconds to wait before trying again when ``e`` says a replica is dead or none is healthy and
        ``deadline`` (``wait_healthy_s`` after the first attempt) has not passed; None: give up."""
        if e.kind != "connection" or time.monotonic() >= deadline:
            return None
        with self._lock:
            self._c["waits_for_replica"] += 1
        return min(max(self.recheck_s / 4, 0.01), max(deadline - time.monotonic(), 0.0))

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Blocks until the reply (``ray.get``); for callers outside an event loop. A dead replica or
        none healthy: retried on the next healthy one for up to ``wait_healthy_s``."""
        deadline = time.monotonic() + self.wait_healthy_s
        while True:
            try:
                return self._batch_search_once(queries, k)
            except RetrievalError as e:
                pause = self._retry_after(e, deadline)
                if pause is None:
                    raise
                time.sleep(pause)  # waiting for a replica's restart (bounded by wait_healthy_s)

    async def abatch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Awaits the reply without a thread (the rollout loop's path, through ``base.search_async``);
        retried like ``batch_search`` while no replica is healthy."""
        deadline = time.monotonic() + self.wait_healthy_s
        while True:
            try:
                return await self._abatch_search_once(queries, k)
            except RetrievalError as e:
                pause = self._retry_after(e, deadline)
                if pause is None:
                    raise
                await asyncio.sleep(pause)

    def _batch_search_once(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        queries = list(queries)
        if not queries:
            return []
        with self._request(queries, k) as ref:
            try:
                reply = ray.get(ref, timeout=self.timeout_s)
            except GetTimeoutError:
                raise _Expired from None
        return self._unwrap_counted(reply)

    async def _abatch_search_once(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        queries = list(queries)
        if not queries:
            return []
        with self._request(queries, k) as ref:
            try:
                reply = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
            except asyncio.TimeoutError:
                raise _Expired from None
        return self._unwrap_counted(reply)

    @contextmanager
    def _request(self, queries: list[str], k: int) -> Iterator[Any]:
        """Send one request to the least-loaded healthy replica and yield its ObjectRef; the caller
        waits for the reply inside the ``with`` block (blocking or awaited: the only difference
        between the two search methods) and raises ``_Expired`` when ``timeout_s`` passes. Whatever
        goes wrong there becomes a counted ``RetrievalError``; the replica's slot is always released."""
        with self._lock:
            self._c["calls"] += 1
        i = self._pick()
        handle = self._replicas[i].handle  # the slot may be given a new replica while this request waits
        try:
            ref = handle.batch_search.remote(queries, k)
            try:
                yield ref
            except _Expired:
                _cancel(ref)
                raise self._fail(RetrievalError(
                    "timeout", f"retrieval replica {i} did not answer within {self.timeout_s}s")) from None
            except Exception as e:  # noqa: BLE001
                raise self._fail(self._map(i, e, handle)) from e
        finally:
            self._release(i)

    def _unwrap_counted(self, reply: Any) -> list[list[Hit]]:
        try:
            return _unwrap(reply)
        except RetrievalError as e:
            raise self._fail(e) from None

    # ----------------------------------------------------------------------------------- introspection
    def stats(self) -> dict[str, Any]:
        """Client-side counters and replica states (cheap, no remote call)."""
        with self._lock:
            return {"calls": self._c["calls"], "errors": dict(self._errors),
                    "replica_deaths": self._c["replica_deaths"], "replica_recoveries": self._c["replica_recoveries"],
                    "replica_replacements": self._c["replica_replacements"],
                    "waits_for_replica": self._c["waits_for_replica"],
                    "replicas": [{"dead": r.dead, "inflight": r.inflight, "failures": r.failures,
                                  "last_error": r.last_error} for r in self._replicas]}

    def server_stats(self, timeout_s: float = 5.0) -> list[dict[str, Any] | None]:
        """Each replica's ``stats()`` (None for a replica that does not answer)."""
        out: list[dict[str, Any] | None] = []
        for h in self.handles:
            try:
                out.append(ray.get(h.stats.remote(), timeout=timeout_s))
            except Exception:  # noqa: BLE001
                out.append(None)
        return out

    def health(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Each replica's ``health()``; a replica that does not answer reads {"ok": False, "error": ...}."""
        handles = list(self.handles)
        refs = [h.health.remote() for h in handles]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except Exception as e:  # noqa: BLE001
                self._mark_dead(i, e, handles[i])
                out.append({"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        return out
