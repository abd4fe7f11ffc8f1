"""The retriever protocol every backend implements.

``batch_search(queries, k) -> list[list[Hit]]``: one result list per input query, in input order,
each sorted by descending score, at most ``k`` long. One return type, no flags. A backend that fails
raises :class:`RetrievalError` with a ``kind``; retries, the circuit breaker and the conversion of a
failure into a "no results" document happen in layers above the backend (``resilient.py`` and the
rollout loop), so a failed search is data, not a crash.

Sync and async: ``batch_search`` always blocks. A retriever that can wait without a thread (the
Elasticsearch backend over aiohttp, the retrieval-service client over Ray) also has a coroutine
``abatch_search`` with the same contract. :func:`search_async` is the ONE bridge between the two
worlds: every async caller (the rollout loop, the service's dispatcher, the resilient wrapper)
awaits a retriever through it, whatever kind it is.

Pure module: standard library only.
"""
from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Hit:
    doc_id: str
    title: str
    text: str
    score: float


class RetrievalError(RuntimeError):
    """A search that failed. ``kind`` is one of KINDS and is what ``retrieval/errors/<kind>`` counts."""

    KINDS = ("timeout", "http_5xx", "http_429", "connection", "breaker_open", "bad_request", "internal")

    def __init__(self, kind: str, message: str, retryable: bool | None = None):
        if kind not in self.KINDS:
            kind = "internal"
        super().__init__(f"[{kind}] {message}")
        self.kind = kind
        self.retryable = kind in ("timeout", "http_5xx", "http_429", "connection") if retryable is None else retryable


@runtime_checkable
class Retriever(Protocol):
    name: str
    """Identifies backend + index (part of the cache key), e.g. 'tantivy:/path/to/index'."""

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]: ...


class AsyncRetriever(Protocol):
    """A retriever with a native coroutine (the same contract as ``Retriever.batch_search``)."""

    async def abatch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]: ...


def native_async(retriever: object) -> Callable[[Sequence[str], int], Awaitable[list[list[Hit]]]] | None:
    """The retriever's coroutine ``abatch_search``, or None when it has only the blocking one."""
    fn = getattr(retriever, "abatch_search", None)
    return fn if inspect.iscoroutinefunction(fn) else None


def check_retriever(retriever: object) -> None:
    """Raise ``TypeError`` naming the object unless it follows the convention above: a blocking
    ``batch_search``, and/or a coroutine ``abatch_search``."""
    sync = getattr(retriever, "batch_search", None)
    if inspect.iscoroutinefunction(sync):
        raise TypeError(f"{retriever!r}: batch_search is a coroutine function; by the retrieval.base convention "
                        "batch_search blocks and the coroutine is named abatch_search")
    if native_async(retriever) is None and not callable(sync):
        raise TypeError(f"{retriever!r} is not a retriever: it has neither batch_search nor a coroutine abatch_search")


def check_search_args(queries: object, k: int) -> None:
    """What every backend's ``batch_search`` refuses alike: ``k`` < 1, and one string for a sequence."""
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    if isinstance(queries, str):
        raise TypeError("batch_search takes a sequence of queries, not one string")


async def search_async(retriever: object, queries: Sequence[str], k: int,
                       executor: Executor | None = None) -> list[list[Hit]]:
    """Await one ``batch_search`` of any retriever without blocking the event loop.

    Its native ``abatch_search`` when it has one; otherwise the blocking ``batch_search`` runs in a
    thread of ``executor`` (None: asyncio's default pool). Cancelling the await (a timeout) abandons
    the thread, not the call: the blocking search runs to completion and its result is dropped.
    """
    queries = list(queries)
    native = native_async(retriever)
    if native is not None:
        return await native(queries, k)
    return await asyncio.get_running_loop().run_in_executor(executor, retriever.batch_search, queries, k)
