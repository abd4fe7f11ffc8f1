"""Waiting in tests without sleeping and hoping: poll a condition against a deadline, or let an event
loop run until every ready task has blocked.

A test that sleeps "long enough" for another thread, task or process to get somewhere passes on an
idle machine and fails on a loaded one. These helpers wait for the thing itself; the deadline only
turns a hang into a failure that says what never happened, so it is generous (seconds, not
milliseconds) and never part of what a test asserts.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

DEADLINE_S = 30.0
"""Default deadline: long enough for a loaded 2-core machine, short enough that a hang fails fast."""

_POLL_S = 0.002
"""Seconds between two checks of the predicate (the wait's own pacing, not a synchronisation)."""


def _describe(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


def wait_until(predicate: Callable[[], Any], timeout_s: float = DEADLINE_S, what: str | Callable[[], str] = "",
               poll_s: float = _POLL_S) -> Any:
    """Call ``predicate`` until it returns something truthy and return that; raise ``TimeoutError``
    naming ``what`` (a string, or a callable evaluated at the timeout for the latest state) if
    ``timeout_s`` seconds pass first. The predicate is checked once more at the deadline, so a slow
    machine that gets there late still passes."""
    if not what:
        raise ValueError("wait_until needs `what`: the timeout message must say what was awaited")
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            value = predicate()
            if value:
                return value
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {_describe(what)}")
        time.sleep(poll_s)


async def await_until(predicate: Callable[[], Any], timeout_s: float = DEADLINE_S,
                      what: str | Callable[[], str] = "", poll_s: float = _POLL_S) -> Any:
    """``wait_until`` for a coroutine: the event loop keeps running other tasks between checks."""
    if not what:
        raise ValueError("await_until needs `what`: the timeout message must say what was awaited")
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            value = predicate()
            if value:
                return value
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {_describe(what)}")
        await asyncio.sleep(poll_s)


async def settle(rounds: int = 100) -> None:
    """Let the running event loop run every ready task until it blocks, without letting time pass:
    ``rounds`` zero-length yields. Nothing here depends on the clock, so a task that is still not done
    afterwards is blocked on something (a condition, a queue), however slow the machine. ``rounds``
    covers the few hops a task takes to park (``wait_for`` wraps the awaited coroutine in a task)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class WaiterCountingLock:
    """A ``threading.Lock`` that counts the threads blocked in ``acquire``: put in place of a lock
    under test, it lets a test see that a thread waits for the lock, without sleeping."""

    def __init__(self):
        self._lock, self._count_lock, self.waiting = threading.Lock(), threading.Lock(), 0

    def _count(self, d: int) -> None:
        with self._count_lock:
            self.waiting += d

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self._count(1)
        try:
            return self._lock.acquire(blocking, timeout)
        finally:
            self._count(-1)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def wait_actor_dead(actor, timeout_s: float = DEADLINE_S, what: str = "the killed actor to be reported dead") -> None:
    """Until Ray reports ``actor`` dead: a call to it raises ``ActorDiedError``.

    ``ray.kill`` only asks the GCS to kill the actor and returns at once; until the death is
    processed, a call submitted to the actor can still reach the live process and succeed."""
    import ray

    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5.0)
        except ray.exceptions.ActorDiedError:
            return True
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):  # going down: ask again
            return False
        return False

    wait_until(dead, timeout_s, what, poll_s=0.05)
