"""The one sync/async bridge (``retrieval.base.search_async``) and the retriever convention check.

Every async caller (the rollout loop, the service's dispatcher, the resilient wrapper) awaits a
retriever through ``search_async``; this is where that bridge is tested.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from sonar.retrieval.base import Hit, check_retriever, native_async, search_async
from tests.waiting import await_until


class Blocking:
    """Only the blocking method; records the thread each call ran on; ``gate`` holds a call open."""

    name = "blocking"

    def __init__(self, gate: threading.Event | None = None):
        self.threads: list[int] = []
        self.gate = gate

    def batch_search(self, queries, k):
        self.threads.append(threading.get_ident())
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        return [[Hit(f"{q}#{j}", q, q, 1.0) for j in range(k)] for q in queries]


class Both(Blocking):
    """Both methods: the bridge must await the native coroutine and never touch the blocking one."""

    async def abatch_search(self, queries, k):
        return [[Hit(f"async:{q}", q, q, 1.0)] for q in queries]


def test_blocking_retriever_runs_in_a_thread_and_the_loop_stays_free():
    gate = threading.Event()
    r = Blocking(gate)

    async def main():
        task = asyncio.create_task(search_async(r, ("a", "b"), 2))  # a tuple is passed on as a list
        # The loop keeps running while the search blocks: this coroutine opens the gate.
        await await_until(lambda: r.threads, what="the search to start in its thread")
        gate.set()
        return await task

    out = asyncio.run(main())
    assert [[h.doc_id for h in row] for row in out] == [["a#0", "a#1"], ["b#0", "b#1"]]
    assert r.threads and r.threads[0] != threading.get_ident()


def test_blocking_retriever_uses_the_given_executor():
    r = Blocking()
    with ThreadPoolExecutor(1) as ex:  # one thread: the search must have run on it
        asyncio.run(search_async(r, ["q"], 1, ex))
        mine = ex.submit(threading.get_ident).result()
    assert r.threads == [mine]


def test_native_coroutine_is_awaited_not_threaded():
    r = Both()
    assert native_async(r) is not None and native_async(Blocking()) is None
    out = asyncio.run(search_async(r, ["q"], 1))
    assert out[0][0].doc_id == "async:q" and r.threads == []


def test_convention_check_names_the_mistake():
    class CoroutineNamedBatchSearch:
        async def batch_search(self, queries, k):
            return []

    check_retriever(Blocking())
    check_retriever(Both())
    with pytest.raises(TypeError, match="abatch_search"):
        check_retriever(CoroutineNamedBatchSearch())
    with pytest.raises(TypeError, match="not a retriever"):
        check_retriever(object())
