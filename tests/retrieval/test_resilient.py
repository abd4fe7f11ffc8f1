"""ResilientRetriever: retries with bounded backoff and the circuit breaker, on a fake clock."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from sonar.retrieval.base import Hit, RetrievalError
from sonar.retrieval.resilient import ResilientRetriever
from tests.waiting import DEADLINE_S


class FakeClock:
    def __init__(self):
        self.t = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.sleeps.append(s)
        self.t += s

    async def asleep(self, s: float) -> None:
        self.sleep(s)


class Flaky:
    """Fails with ``kind`` while ``down`` (or for the first ``fail_first`` calls), then answers."""

    name = "fake:flaky"

    def __init__(self, kind: str = "connection", fail_first: int = 0, down: bool = False):
        self.kind = kind
        self.fail_first = fail_first
        self.down = down
        self.calls = 0

    def batch_search(self, queries, k):
        self.calls += 1
        if self.down or self.calls <= self.fail_first:
            raise RetrievalError(self.kind, f"fake failure #{self.calls}")
        return [[Hit(doc_id=q, title=q, text=q, score=1.0)] for q in queries]

    def stats(self):
        return {"calls": self.calls}


def make(inner, clock, **kw):
    args = dict(max_retries=2, backoff_s=0.1, breaker_failures=3, breaker_reset_s=5.0, max_backoff_s=0.3,
                jitter=0.5, rng=random.Random(0))
    args.update(kw)
    return ResilientRetriever(inner, clock=clock, sleep=clock.sleep, asleep=clock.asleep, **args)


def test_passes_through_and_keeps_name():
    clock = FakeClock()
    inner = Flaky()
    r = make(inner, clock)
    assert r.name == "fake:flaky"
    assert [h[0].doc_id for h in r.batch_search(["a", "b"], 1)] == ["a", "b"]
    assert inner.calls == 1 and clock.sleeps == []
    s = r.stats()
    assert s["successes"] == 1 and s["retries"] == 0 and s["breaker_state"] == "closed"
    assert s["inner"] == {"calls": 1}


@pytest.mark.parametrize("kind", ["timeout", "http_5xx", "http_429", "connection"])
def test_retryable_errors_are_retried_then_succeed(kind):
    clock = FakeClock()
    inner = Flaky(kind, fail_first=2)
    r = make(inner, clock)
    assert r.batch_search(["q"], 1)[0][0].doc_id == "q"
    assert inner.calls == 3
    s = r.stats()
    assert s["retries"] == 2 and s["attempt_errors"] == {kind: 2} and s["errors"] == {}
    assert s["consecutive_failures"] == 0


def test_retries_exhausted_raise_last_kind_and_backoff_is_bounded():
    clock = FakeClock()
    inner = Flaky("http_5xx", down=True)
    r = make(inner, clock, max_retries=4, backoff_s=0.1, max_backoff_s=0.3, breaker_failures=100)
    with pytest.raises(RetrievalError) as ei:
        r.batch_search(["q"], 1)
    assert ei.value.kind == "http_5xx" and ei.value.retryable
    assert inner.calls == 5  # 1 + max_retries
    assert len(clock.sleeps) == 4
    caps = [0.1, 0.2, 0.3, 0.3]  # exponential, capped at max_backoff_s
    for s, cap in zip(clock.sleeps, caps):
        assert cap * 0.5 <= s <= cap  # jitter in [1 - jitter, 1] of the cap
    assert sum(clock.sleeps) <= 4 * 0.3
    st = r.stats()
    assert st["errors"] == {"http_5xx": 1} and st["attempt_errors"] == {"http_5xx": 5} and st["failures"] == 1


def test_backoff_delay_grows_then_caps_for_many_draws():
    r = ResilientRetriever(Flaky(), backoff_s=0.05, max_backoff_s=1.0, jitter=0.25, rng=random.Random(1))
    for attempt in range(12):
        cap = min(1.0, 0.05 * 2 ** attempt)
        for _ in range(50):
            d = r.backoff_delay(attempt)
            assert 0.75 * cap - 1e-12 <= d <= cap + 1e-12


@pytest.mark.parametrize("kind", ["bad_request", "internal"])
def test_non_retryable_errors_are_not_retried_and_do_not_trip_the_breaker(kind):
    clock = FakeClock()
    inner = Flaky(kind, down=True)
    r = make(inner, clock, breaker_failures=1)
    for _ in range(3):
        with pytest.raises(RetrievalError) as ei:
            r.batch_search(["q"], 1)
        assert ei.value.kind == kind
    assert inner.calls == 3 and clock.sleeps == []
    assert r.state == "closed"
    assert r.stats()["errors"] == {kind: 3}


def test_foreign_exceptions_become_internal():
    class Broken:
        name = "broken"

        def batch_search(self, queries, k):
            raise KeyError("boom")

    r = make(Broken(), FakeClock())
    with pytest.raises(RetrievalError) as ei:
        r.batch_search(["q"], 1)
    assert ei.value.kind == "internal" and "KeyError" in str(ei.value)


def test_breaker_opens_fails_fast_probes_and_recovers():
    clock = FakeClock()
    inner = Flaky("connection", down=True)
    r = make(inner, clock, max_retries=1, breaker_failures=3, breaker_reset_s=5.0)

    # Three failed calls (2 attempts each) open the breaker.
    for i in range(3):
        assert r.state == "closed"
        with pytest.raises(RetrievalError) as ei:
            r.batch_search(["q"], 1)
        assert ei.value.kind == "connection"
    assert inner.calls == 6
    assert r.state == "open" and r.stats()["breaker_opens"] == 1

    # While open: immediate breaker_open, the inner retriever is not touched, no sleeping.
    sleeps_before = len(clock.sleeps)
    for _ in range(10):
        clock.t += 0.4
        with pytest.raises(RetrievalError) as ei:
            r.batch_search(["q"], 1)
        assert ei.value.kind == "breaker_open" and not ei.value.retryable
    assert inner.calls == 6 and len(clock.sleeps) == sleeps_before
    assert r.stats()["fast_failed"] == 10

    # After breaker_reset_s: ONE probe (a single attempt, no retries); it fails -> open again.
    clock.t += 1.1
    assert r.state == "half_open"
    with pytest.raises(RetrievalError) as ei:
        r.batch_search(["q"], 1)
    assert ei.value.kind == "connection"
    assert inner.calls == 7 and r.state == "open"
    with pytest.raises(RetrievalError) as ei:
        r.batch_search(["q"], 1)
    assert ei.value.kind == "breaker_open" and inner.calls == 7

    # The server comes back; the next probe succeeds and closes the breaker.
    inner.down = False
    clock.t += 5.0
    assert r.batch_search(["q"], 1)[0][0].doc_id == "q"
    assert inner.calls == 8 and r.state == "closed"
    assert r.batch_search(["a", "b"], 1)[1][0].doc_id == "b"
    s = r.stats()
    assert s["probes"] == 2 and s["breaker_reopens"] == 1 and s["breaker_closes"] == 1
    assert s["errors"] == {"connection": 4, "breaker_open": 11}
    assert s["consecutive_failures"] == 0


def test_success_resets_the_failure_streak():
    clock = FakeClock()
    inner = Flaky("timeout", down=True)
    r = make(inner, clock, max_retries=0, breaker_failures=3)
    for _ in range(2):
        with pytest.raises(RetrievalError):
            r.batch_search(["q"], 1)
    inner.down = False
    r.batch_search(["q"], 1)
    inner.down = True
    for _ in range(2):
        with pytest.raises(RetrievalError):
            r.batch_search(["q"], 1)
    assert r.state == "closed"  # 2 + 2 failures, never 3 in a row


def test_only_one_half_open_probe_at_a_time():
    clock = FakeClock()
    entered, release = threading.Event(), threading.Event()

    class Slow(Flaky):
        def batch_search(self, queries, k):
            if not self.down:
                entered.set()
                assert release.wait(DEADLINE_S)
            return super().batch_search(queries, k)

    inner = Slow("connection", down=True)
    r = make(inner, clock, max_retries=0, breaker_failures=1, breaker_reset_s=1.0)
    with pytest.raises(RetrievalError):
        r.batch_search(["q"], 1)
    assert r.state == "open"
    inner.down = False
    clock.t += 2.0
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("probe", r.batch_search(["p"], 1)))
    t.start()
    assert entered.wait(DEADLINE_S)
    with pytest.raises(RetrievalError) as ei:  # a concurrent caller while the probe is in flight
        r.batch_search(["q"], 1)
    assert ei.value.kind == "breaker_open"
    release.set()
    t.join(DEADLINE_S)
    assert out["probe"][0][0].doc_id == "p" and r.state == "closed"


def test_async_twin_retries_and_breaks_the_same_way():
    clock = FakeClock()
    inner = Flaky("http_429", fail_first=1)
    r = make(inner, clock, max_retries=1, breaker_failures=1, breaker_reset_s=2.0)

    async def main():
        out = await r.abatch_search(["a"], 1)
        assert out[0][0].doc_id == "a" and inner.calls == 2
        inner.down = True
        with pytest.raises(RetrievalError) as ei:
            await r.abatch_search(["a"], 1)
        assert ei.value.kind == "http_429"
        with pytest.raises(RetrievalError) as ei:
            await r.abatch_search(["a"], 1)
        assert ei.value.kind == "breaker_open"
        inner.down = False
        clock.t += 2.0
        assert (await r.abatch_search(["z"], 1))[0][0].doc_id == "z"

    asyncio.run(main())
    assert r.state == "closed" and len(clock.sleeps) == 2


def test_rejects_bad_parameters():
    with pytest.raises(ValueError, match="breaker_failures"):
        ResilientRetriever(Flaky(), breaker_failures=0)
    with pytest.raises(ValueError, match="max_retries"):
        ResilientRetriever(Flaky(), max_retries=-1)
