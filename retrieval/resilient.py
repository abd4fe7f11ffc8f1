"""Retries with bounded exponential backoff, and a circuit breaker, around any Retriever.

``ResilientRetriever(inner)`` is itself a Retriever. A call to ``batch_search`` (or to its awaited
form ``abatch_search``, which reaches ``inner`` through ``base.search_async``; both share one
bookkeeping, :class:`_Call`):

1. **Breaker check.** *closed*: go on. *open*: if fewer than ``breaker_reset_s`` have passed since it
   opened, fail at once with ``RetrievalError('breaker_open')`` without touching the inner retriever
   (so a dead server is not hammered). Otherwise the call becomes the single *half-open probe*;
   concurrent callers keep failing fast while the probe is in flight.
2. **Attempts.** Up to ``1 + max_retries`` calls of ``inner.batch_search`` (the probe gets exactly one).
   A *retryable* ``RetrievalError`` (timeout, http_5xx, http_429, connection) is retried after
   ``min(max_backoff_s, backoff_s * 2**i)`` seconds scaled by a jitter factor in ``[1 - jitter, 1]``,
   so each sleep is bounded by ``max_backoff_s`` and the total by ``max_retries * max_backoff_s``.
   A non-retryable error (bad_request, internal) is raised at once, with no retry.
3. **Outcome.** Success closes the breaker and resets the failure streak. A call whose attempts all
   failed with retryable errors counts one failure; ``breaker_failures`` consecutive failed calls open
   the breaker, and a failed probe re-opens it for another ``breaker_reset_s``. The error raised has
   the kind of the last attempt. A non-retryable error proves that the server answered, so for the
   breaker it counts as a success (a malformed query must not cut off a healthy server).

Any other exception from the inner retriever is wrapped as ``RetrievalError('internal')``: the
contract above us is "a failed search is data", so nothing else escapes.

``stats()`` returns plain counters (errors by kind, retries, breaker state...), plus the inner
retriever's ``stats()`` under ``"inner"`` when it has one. Thread-safe: the Ray service runs several
inner calls at once from a thread pool. Time comes from the injected ``clock`` and ``sleep`` so the
unit tests drive the breaker with a fake clock.

Pure module: standard library only.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from typing import Any, Awaitable, Callable, Iterator, Sequence

from sonar.retrieval.base import Hit, RetrievalError, Retriever, search_async

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class ResilientRetriever:
    """Retry + circuit breaker around ``inner``. See the module docstring for the exact semantics."""

    def __init__(
        self,
        inner: Retriever,
        max_retries: int = 2,
        backoff_s: float = 0.1,
        breaker_failures: int = 5,
        breaker_reset_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        *,
        max_backoff_s: float = 2.0,
        jitter: float = 0.5,
        rng: random.Random | None = None,
        asleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} must be >= 0")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"backoff_s={backoff_s} / max_backoff_s={max_backoff_s} must be >= 0")
        if breaker_failures < 1:
            raise ValueError(f"breaker_failures={breaker_failures} must be >= 1")
        if breaker_reset_s < 0:
            raise ValueError(f"breaker_reset_s={breaker_reset_s} must be >= 0")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter={jitter} must be in [0, 1]")
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.jitter = jitter
        self.breaker_failures = breaker_failures
        self.breaker_reset_s = breaker_reset_s
        self._clock = clock
        self._sleep = sleep
        self._asleep = asleep
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._state = CLOSED
        self._opened_at = 0.0
        self._probe_in_flight = False
        self._streak = 0
        self._c: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._attempt_errors: Counter[str] = Counter()

    def __repr__(self) -> str:
        return (f"ResilientRetriever({self.inner!r}, max_retries={self.max_retries}, backoff_s={self.backoff_s}, "
                f"breaker_failures={self.breaker_failures}, breaker_reset_s={self.breaker_reset_s})")

    # ----------------------------------------------------------------------------------- breaker
    @property
    def state(self) -> str:
        """closed | open | half_open (as of now: an open breaker past its reset time reads half_open)."""
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.breaker_reset_s:
                return HALF_OPEN
            return self._state

    def backoff_delay(self, attempt: int) -> float:
        """Sleep before retry number ``attempt + 1`` (0-based): capped exponential with jitter."""
        base = min(self.max_backoff_s, self.backoff_s * (2.0 ** attempt))
        return base * (1.0 - self.jitter * self._rng.random())

    def _admit(self) -> bool:
        """Returns True when this call is the half-open probe; raises breaker_open to fail fast."""
        with self._lock:
            self._c["calls"] += 1
            if self._state == CLOSED:
                return False
            waited = self._clock() - self._opened_at
            if self._state == OPEN and waited >= self.breaker_reset_s and not self._probe_in_flight:
                self._state = HALF_OPEN
                self._probe_in_flight = True
                self._c["probes"] += 1
                return True
            self._c["fast_failed"] += 1
            self._errors["breaker_open"] += 1
            left = max(0.0, self.breaker_reset_s - waited)
        raise RetrievalError(
            "breaker_open",
            f"circuit breaker open for {self.name} after {self.breaker_failures} consecutive failures; "
            f"next probe in {left:.2f}s", retryable=False)

    def _on_success(self, probe: bool) -> None:
        with self._lock:
            self._c["successes"] += 1
            self._streak = 0
            if probe or self._state != CLOSED:
                self._c["breaker_closes"] += 1
            self._state = CLOSED
            if probe:
                self._probe_in_flight = False

    def _on_failure(self, probe: bool, err: RetrievalError) -> None:
        with self._lock:
            self._c["failures"] += 1
            self._errors[err.kind] += 1
            self._streak += 1
            if probe:
                self._probe_in_flight = False
                self._state = OPEN
                self._opened_at = self._clock()
                self._c["breaker_reopens"] += 1
            elif self._state == CLOSED and self._streak >= self.breaker_failures:
                self._state = OPEN
                self._opened_at = self._clock()
                self._c["breaker_opens"] += 1

    def _on_attempt_error(self, err: RetrievalError) -> None:
        with self._lock:
            self._attempt_errors[err.kind] += 1

    @staticmethod
    def _as_retrieval_error(e: BaseException) -> RetrievalError:
        if isinstance(e, RetrievalError):
            return e
        return RetrievalError("internal", f"{type(e).__name__}: {e}", retryable=False)

    def _final(self, err: RetrievalError, attempts: int) -> RetrievalError:
        out = RetrievalError(err.kind, f"{self.name}: gave up after {attempts} attempt(s): {err}",
                             retryable=err.retryable)
        out.__cause__ = err
        return out

    # ----------------------------------------------------------------------------------- search
    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        call = _Call(self)
        for delay in call.waits():
            if delay is not None:
                self._sleep(delay)
            try:
                out = self.inner.batch_search(queries, k)
            except Exception as e:  # noqa: BLE001 - every failure becomes a RetrievalError
                call.failed(e)
                continue
            return call.succeeded(out)
        raise call.gave_up()

    async def abatch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """The same call awaited: the inner retriever through ``base.search_async`` (its own
        ``abatch_search`` when it has one, else a thread), backoff with ``asleep``."""
        call = _Call(self)
        try:
            for delay in call.waits():
                if delay is not None:
                    await self._asleep(delay)
                try:
                    out = await search_async(self.inner, queries, k)
                except Exception as e:  # noqa: BLE001
                    call.failed(e)
                    continue
                return call.succeeded(out)
        except asyncio.CancelledError:
            call.cancelled()
            raise
        raise call.gave_up()

    def _answered_with_error(self, probe: bool, err: RetrievalError) -> RetrievalError:
        """A non-retryable error: the server answered (only the query was bad), so the breaker counts
        a success; the error is returned to be raised."""
        self._on_success(probe)
        with self._lock:
            self._errors[err.kind] += 1
        return err

    # ----------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters since construction. ``errors``: calls that raised, by final kind (breaker_open
        included); ``attempt_errors``: every failed inner attempt, by kind."""
        state = self.state
        with self._lock:
            out: dict[str, Any] = {
                "calls": self._c["calls"],
                "successes": self._c["successes"],
                "failures": self._c["failures"],
                "attempts": self._c["attempts"],
                "retries": self._c["retries"],
                "fast_failed": self._c["fast_failed"],
                "probes": self._c["probes"],
                "breaker_opens": self._c["breaker_opens"],
                "breaker_reopens": self._c["breaker_reopens"],
                "breaker_closes": self._c["breaker_closes"],
                "breaker_state": state,
                "consecutive_failures": self._streak,
                "errors": dict(self._errors),
                "attempt_errors": dict(self._attempt_errors),
            }
        inner_stats = getattr(self.inner, "stats", None)
        if callable(inner_stats):
            out["inner"] = inner_stats()
        return out


class _Call:
    """The bookkeeping of one ``batch_search`` call, shared by the blocking and the awaited loop (they
    differ only in how they sleep and how they call the inner retriever). Admission (the breaker
    check) happens on construction and may raise ``breaker_open``."""

    def __init__(self, r: ResilientRetriever):
        self.r = r
        self.probe = r._admit()
        self.attempts = 1 if self.probe else 1 + r.max_retries
        self.last: RetrievalError | None = None

    def waits(self) -> Iterator[float | None]:
        """One item per attempt: None before the first, the backoff delay in seconds before a retry."""
        for i in range(self.attempts):
            if i:
                with self.r._lock:
                    self.r._c["retries"] += 1
                delay = self.r.backoff_delay(i - 1)
            else:
                delay = None
            with self.r._lock:
                self.r._c["attempts"] += 1
            yield delay

    def failed(self, e: BaseException) -> None:
        """An attempt raised: a non-retryable error is re-raised at once, a retryable one remembered."""
        err = self.r._as_retrieval_error(e)
        self.r._on_attempt_error(err)
        if not err.retryable:
            raise self.r._answered_with_error(self.probe, err)
        self.last = err

    def succeeded(self, out: list[list[Hit]]) -> list[list[Hit]]:
        self.r._on_success(self.probe)
        return out

    def gave_up(self) -> RetrievalError:
        """Every attempt failed with a retryable error: count the failure, return the error to raise."""
        assert self.last is not None
        self.r._on_failure(self.probe, self.last)
        return self.r._final(self.last, self.attempts)

    def cancelled(self) -> None:
        """The awaiting caller went away: a half-open probe no longer blocks the next one."""
        if self.probe:
            with self.r._lock:
                self.r._probe_in_flight = False
