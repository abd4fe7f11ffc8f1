"""ContinuousHFEngine: continuous batching across concurrent generate calls.

Covered: greedy == no-cache reference with queueing; sampled logprobs == teacher forcing while calls with
different seeds/temperatures/stops join and leave one running batch (cache merge, left padding,
compaction); concurrent calls really share decode steps; per-prompt caps; seeds; weights swapped
between decode steps; loud failure; validation; config. (The benchmarks' paced subclass is tested in
tests/bench/test_sim_paced_engine.py.)

Counters (``engine_stats``) are updated by the decode thread *after* the step in which a call's last row
finished (``generate`` may return first), so tests read them through ``_wait_idle``, which waits until
the decode thread is parked in its ``Condition.wait`` with nothing to do (no sleeps-and-hope).
"""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from sonar.actors.engine import SamplingParams
from sonar.actors.engine_continuous import ContinuousHFEngine
from tests.actors.test_engine import PROMPTS, VOCAB, greedy_reference, teacher_forced_logprobs, tiny_model
from tests.waiting import wait_until

JOIN_S = 30.0  # generous: a hang fails the test instead of blocking the suite


# ---------------------------------------------------------------- helpers

@pytest.fixture
def make_engine():
    """Factory; every engine it made is closed at teardown and its decode thread must be gone."""
    engines: list[ContinuousHFEngine] = []

    def make(model, **kw) -> ContinuousHFEngine:
        kw.setdefault("eos_token_id", None)
        eng = ContinuousHFEngine(model, **kw)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()
        assert eng._thread is None or not eng._thread.is_alive(), "decode thread left running"


def _stack(thread: threading.Thread) -> list[str]:
    """Function names of a live thread's Python stack, innermost first."""
    f = sys._current_frames().get(thread.ident)
    names = []
    while f is not None:
        names.append(f.f_code.co_name)
        f = f.f_back
    return names


def _wait_idle(eng: ContinuousHFEngine, timeout: float = JOIN_S) -> dict:
    """engine_stats once the decode thread is parked in ``_run``'s Condition.wait with no work left."""
    def idle() -> bool:
        t = eng._thread
        if t is None:
            return True
        if _stack(t)[:2] == ["wait", "_run"]:
            with eng._cv:
                return not (eng._queue or eng._rows or eng._held())
        return False

    wait_until(idle, timeout, lambda: f"the decode thread to be idle: {_stack(eng._thread)}")
    return eng.engine_stats()


def _wait_tokens(eng, caller, n):
    """Until the first running row has sampled n tokens (the call is in flight)."""
    def sampled() -> int:
        assert caller.thread.is_alive(), f"the call returned before its first row sampled {n} tokens"
        rows = list(eng._rows)
        return len(rows[0].ids) if rows and len(rows[0].ids) >= n else 0

    return wait_until(sampled, JOIN_S, f"the first running row to sample {n} tokens")


def _blocked_in_generate(thread: threading.Thread) -> bool:
    names = _stack(thread)
    return bool(names) and names[0] == "wait" and "generate" in names


class _Caller:
    """Runs ``fn`` in a thread (optionally behind a barrier); keeps its result or exception."""

    def __init__(self, fn, barrier: threading.Barrier | None = None):
        self.result, self.error = None, None

        def body():
            if barrier is not None:
                barrier.wait(timeout=JOIN_S)
            try:
                self.result = fn()
            except BaseException as e:  # noqa: BLE001 -- inspected by the test
                self.error = e

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def join(self, timeout: float = JOIN_S):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "generate did not return (hang)"
        return self


def _check_row(model, prompt, g, T, stop, cap):
    """Stop/length semantics of one Generation and its logprobs against teacher forcing."""
    toks = g.token_ids.tolist()
    assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
    assert g.token_ids.shape == g.logprobs.shape
    if g.finish == "stop":
        assert toks[-1] in stop and g.stop_token_id == toks[-1]
        assert not any(t in stop for t in toks[:-1])
        assert 1 <= len(toks) <= cap
    else:
        assert g.finish == "length" and g.stop_token_id is None
        assert len(toks) == cap and not any(t in stop for t in toks)
    if toks:
        np.testing.assert_allclose(g.logprobs, teacher_forced_logprobs(model, prompt, g.token_ids, T),
                                   atol=1e-5, rtol=0)


# ---------------------------------------------------------------- 1. greedy == no-cache reference

@pytest.mark.parametrize("max_batch", [1, 2, 3, 64])
def test_greedy_equals_no_cache_reference_with_queueing(make_engine, max_batch):
    model = tiny_model(seed=1)
    eng = make_engine(model, max_batch=max_batch)
    # Different caps: with max_batch < 4, queued rows join while longer rows are still running (cache
    # merge with left padding of either side) and leave at different steps (compaction).
    caps = [3, 20, 11, 20]
    gens = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0.0),
                        max_new_tokens_per_prompt=caps)
    for p, c, g in zip(PROMPTS, caps, gens):
        assert g.token_ids.tolist() == greedy_reference(model, p, c, set())
        assert g.finish == "length" and g.stop_token_id is None and g.version == 0
        np.testing.assert_allclose(g.logprobs, teacher_forced_logprobs(model, p, g.token_ids, 1.0), atol=1e-5)
    st = _wait_idle(eng)
    assert st["max_live_rows"] == min(max_batch, 4) and st["rows"] == 4


def test_greedy_stop_truncates_and_eos_from_constructor(make_engine):
    model = tiny_model(seed=2)
    eng = make_engine(model, max_batch=2)
    for p in PROMPTS:
        ref = greedy_reference(model, p, 10, set())
        s = ref[2]
        g = eng.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(s,)))[0]
        assert g.token_ids.tolist() == ref[:ref.index(s) + 1]
        assert g.finish == "stop" and g.stop_token_id == s
    first = greedy_reference(model, PROMPTS[0], 1, set())[0]
    eos_eng = make_engine(model, eos_token_id=first)
    g = eos_eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
    assert g.token_ids.tolist() == [first] and g.finish == "stop" and g.stop_token_id == first


# ---------------------------------------------------------------- 2. sampled logprobs == teacher forcing

@pytest.mark.parametrize("T,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.5)])
def test_sampled_logprobs_match_teacher_forcing_alone(make_engine, T, top_p):
    model = tiny_model()
    eng = make_engine(model, max_batch=3)
    gens = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=T, top_p=top_p, seed=1))
    assert len(gens) == len(PROMPTS)
    for p, g in zip(PROMPTS, gens):
        assert g.token_ids.shape == (12,)
        _check_row(model, p, g, T, set(), 12)  # top_p < 1: logprobs stay full-distribution


def test_concurrent_calls_with_different_params_match_teacher_forcing(make_engine):
    """4 threads, different seeds/temperatures/top_p/stops/caps: rows join and leave at different steps."""
    model = tiny_model(seed=2)
    eng = make_engine(model, max_batch=5)  # 32 rows through 5 slots: queueing, merging, compaction
    every3, every4 = tuple(range(0, VOCAB, 3)), tuple(range(1, VOCAB, 4))
    prompts = PROMPTS * 2
    calls = [
        (SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=every3, seed=1), None),
        (SamplingParams(max_new_tokens=9, temperature=0.7, seed=2), [9, 1, 5, 9, 3, 9, 2, 7]),
        (SamplingParams(max_new_tokens=15, temperature=0.7, top_p=0.5, stop_token_ids=every4, seed=3), None),
        (SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=every3, seed=4),
         [2, 10, 0, 7, 10, 1, 10, 4]),
    ]
    barrier = threading.Barrier(len(calls))
    callers = [_Caller(lambda sp=sp, c=c: eng.generate(prompts, sp, max_new_tokens_per_prompt=c), barrier)
               for sp, c in calls]
    finishes = set()
    for (sp, caps), caller in zip(calls, callers):
        caller.join()
        assert caller.error is None, caller.error
        gens = caller.result
        assert len(gens) == len(prompts)
        caps = caps or [sp.max_new_tokens] * len(prompts)
        for p, c, g in zip(prompts, caps, gens):
            assert g.version == 0
            if c == 0:
                assert g.token_ids.shape == (0,) and g.finish == "length"
                continue
            _check_row(model, p, g, sp.temperature, set(sp.stop_token_ids), c)
            finishes.add(g.finish)
    assert finishes == {"stop", "length"}, finishes
    st = _wait_idle(eng)
    assert st["max_live_rows"] == 5  # the slot limit is respected (and reached)
    assert st["rows"] == 4 * len(prompts) - 1  # the cap-0 row never enters the batch


# ---------------------------------------------------------------- 3. concurrency batches

def test_concurrent_calls_share_decode_steps(make_engine):
    model = tiny_model(seed=1)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    alone = make_engine(model)
    ref = [g.token_ids.tolist() for g in alone.generate(PROMPTS, params)]
    single = _wait_idle(alone)["forward_steps"]
    assert single == 20  # 1 prefill (first token) + 19 decode steps

    eng = make_engine(model)
    # Deterministic overlap: hold the step lock (stands in for a step in progress) until both callers
    # are blocked inside generate, so both calls' rows are queued or admitted before step 1 runs.
    # Worst case the decode thread admitted one call's rows first: the other joins at step 2 (21 steps).
    eng._lock.acquire()
    try:
        barrier = threading.Barrier(2)
        callers = [_Caller(lambda: eng.generate(PROMPTS, params), barrier) for _ in range(2)]
        wait_until(lambda: all(_blocked_in_generate(c.thread) for c in callers), JOIN_S,
                   "both callers to block inside generate")
    finally:
        eng._lock.release()
    for c in callers:
        c.join()
        assert c.error is None, c.error
        assert [g.token_ids.tolist() for g in c.result] == ref
    st = _wait_idle(eng)
    assert st["forward_steps"] <= single + 1 < 1.6 * single
    assert st["max_live_rows"] == 8

    # Without the lock: only a barrier. Overlap is then a race (the second caller must enqueue before
    # the first finishes its 20 steps); the bound only requires *some* overlap (sequential = 40).
    eng2 = make_engine(model)
    barrier = threading.Barrier(2)
    callers = [_Caller(lambda: eng2.generate(PROMPTS, params), barrier) for _ in range(2)]
    for c in callers:
        c.join()
        assert c.error is None, c.error
    st2 = _wait_idle(eng2)
    assert st2["forward_steps"] < 2 * single and st2["max_live_rows"] >= 5


# ---------------------------------------------------------------- 4. caps and argument errors

def test_per_prompt_caps_and_argument_errors(make_engine):
    model = tiny_model()
    eng = make_engine(model, max_batch=3)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    gens = eng.generate(PROMPTS, params, max_new_tokens_per_prompt=[0, 2, 9, 6])
    assert [len(g.token_ids) for g in gens] == [0, 2, 6, 6]
    assert gens[0].finish == "length" and gens[0].logprobs.shape == (0,) and gens[0].version == 0
    full = eng.generate(PROMPTS, params)
    assert gens[1].token_ids.tolist() == full[1].token_ids[:2].tolist()
    assert [g.token_ids.tolist() for g in gens[2:]] == [g.token_ids.tolist() for g in full[2:]]
    # all caps 0: returns at once with empty generations
    zero = eng.generate(PROMPTS[:2], params, max_new_tokens_per_prompt=[0, 0])
    assert [len(g.token_ids) for g in zero] == [0, 0]
    assert eng.generate([], params) == []
    with pytest.raises(ValueError, match="empty"):
        eng.generate([PROMPTS[0], np.array([], dtype=np.int32)], params)
    with pytest.raises(ValueError):
        eng.generate(PROMPTS, params, max_new_tokens_per_prompt=[1])
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=2, top_p=0.0))
    # the engine still works after rejected calls
    assert eng.generate([PROMPTS[1]], params)[0].token_ids.tolist() == full[1].token_ids.tolist()


# ---------------------------------------------------------------- 5. seeds

def test_seed_reproducible_alone_and_differs_across_seeds(make_engine):
    eng = make_engine(tiny_model(), max_batch=3)
    a = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=7))
    b = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=7))
    c = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=8))
    assert all(x.token_ids.tolist() == y.token_ids.tolist() for x, y in zip(a, b))
    assert all(np.array_equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    assert any(x.token_ids.tolist() != y.token_ids.tolist() for x, y in zip(a, c))


# ---------------------------------------------------------------- 6. weights swapped between steps

def test_load_weights_mid_generation_versions_and_prefix(make_engine):
    old_ref, new = tiny_model(seed=0), tiny_model(seed=5)
    eng = make_engine(tiny_model(seed=0))
    caller = _Caller(lambda: eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=200, temperature=1.0, seed=3)))
    _wait_tokens(eng, caller, 20)
    rows = list(eng._rows)
    before = len(rows[0].ids)  # sampled before load_weights started: old weights for sure
    eng.load_weights(new.named_parameters(), version=7)
    after = len(rows[0].ids)   # load_weights returned between steps: every later token is post-swap
    assert eng.version == 7
    caller.join()
    assert caller.error is None, caller.error
    g = caller.result[0]
    assert g.version == 0 and len(g.token_ids) == 200  # version at admission: the oldest contributing
    assert after < 200, "the swap landed after the call ended: nothing tested"
    lp_old = teacher_forced_logprobs(old_ref, PROMPTS[0], g.token_ids, 1.0)
    np.testing.assert_allclose(g.logprobs[:before], lp_old[:before], atol=1e-5, rtol=0)
    assert not np.allclose(g.logprobs[after:], lp_old[after:], atol=1e-5), "the swap had no effect"
    # a call admitted after the swap runs wholly under the new weights
    later = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert all(x.version == 7 for x in later)
    assert [x.token_ids.tolist() for x in later] == [greedy_reference(new, p, 12, set()) for p in PROMPTS]
    s = eng.generate([PROMPTS[2]], SamplingParams(max_new_tokens=12, temperature=1.0, seed=4))[0]
    np.testing.assert_allclose(s.logprobs, teacher_forced_logprobs(new, PROMPTS[2], s.token_ids, 1.0), atol=1e-5)


def test_tokens_after_swap_are_exact_for_the_new_weights(make_engine):
    """Swap deterministically between steps 30 and 31 (from the decode thread, before the step takes
    the lock): tokens 0..29 come from the old weights, tokens 30.. must be exact for the new ones."""
    old_ref, new = tiny_model(seed=0), tiny_model(seed=5)
    eng = make_engine(tiny_model(seed=0))
    inner = eng._step

    def step(admit):
        if eng.steps == 30:
            eng.load_weights(new.named_parameters(), version=7)
        inner(admit)

    eng._step = step
    g = eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=60, temperature=1.0, seed=3))[0]
    assert g.version == 0 and eng.version == 7
    lp_old = teacher_forced_logprobs(old_ref, PROMPTS[0], g.token_ids, 1.0)
    lp_new = teacher_forced_logprobs(new, PROMPTS[0], g.token_ids, 1.0)
    np.testing.assert_allclose(g.logprobs[:30], lp_old[:30], atol=1e-5, rtol=0)
    np.testing.assert_allclose(g.logprobs[30:], lp_new[30:], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- 7. failure is loud

def test_step_failure_mid_flight_raises_in_waiting_and_later_calls(make_engine):
    eng = make_engine(tiny_model())
    c = _Caller(lambda: eng.generate(PROMPTS, SamplingParams(max_new_tokens=200, temperature=1.0, seed=1)))
    _wait_tokens(eng, c, 3)

    def boom(admit):
        raise ValueError("injected step failure")

    eng._step = boom  # the decode thread looks _step up on the instance every step
    c.join()
    assert isinstance(c.error, RuntimeError) and isinstance(c.error.__cause__, ValueError)
    assert "injected step failure" in str(c.error)
    eng._thread.join(JOIN_S)  # callers are released before the thread logs and exits
    assert not eng._thread.is_alive()
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    with pytest.raises(RuntimeError, match="failed earlier"):
        eng.generate(PROMPTS, params)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(PROMPTS, params)


def test_failure_while_admitting_rows_raises(make_engine):
    eng = make_engine(tiny_model())
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))  # thread started and healthy
    _wait_idle(eng)

    def forward(*a, **k):
        raise ValueError("injected prefill failure")

    eng.model.forward = forward
    c = _Caller(lambda: eng.generate(PROMPTS, SamplingParams(max_new_tokens=4))).join()
    assert isinstance(c.error, RuntimeError) and "injected prefill failure" in str(c.error)


def test_model_failure_mid_flight_fails_running_and_queued_calls(make_engine, monkeypatch):
    eng = make_engine(tiny_model(), max_batch=4)
    long = SamplingParams(max_new_tokens=200, temperature=1.0, seed=1)
    first = _Caller(lambda: eng.generate(PROMPTS, long))
    _wait_tokens(eng, first, 5)
    second = _Caller(lambda: eng.generate(PROMPTS, long))  # queued behind 4 busy slots
    wait_until(lambda: _blocked_in_generate(second.thread), JOIN_S, "the second call to queue inside generate")

    def forward(*a, **k):
        raise ValueError("injected forward failure")

    monkeypatch.setattr(eng.model, "forward", forward)
    for c in (first, second):
        c.join()
        assert isinstance(c.error, RuntimeError) and "injected forward failure" in str(c.error)
    eng._thread.join(JOIN_S)  # callers are released before the thread logs and exits
    assert not eng._thread.is_alive()


def test_close_fails_calls_in_flight(make_engine):
    eng = make_engine(tiny_model())
    c = _Caller(lambda: eng.generate(PROMPTS, SamplingParams(max_new_tokens=200, temperature=1.0, seed=1)))
    _wait_tokens(eng, c, 3)
    eng.close()
    assert eng._thread is not None
    assert not eng._thread.is_alive()
    c.join()
    assert isinstance(c.error, RuntimeError)
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------- 8. validation

def test_engine_surface():
    eng = ContinuousHFEngine(tiny_model(), eos_token_id=None)
    try:
        assert ContinuousHFEngine.concurrent is True
        st = eng.engine_stats()
        assert st["engine"] == "hf-continuous" and st["steps"] == st["forward_steps"] == 0
        with pytest.raises(ValueError, match="max_batch"):
            ContinuousHFEngine(tiny_model(), eos_token_id=None, max_batch=0)
    finally:
        eng.close()


# ---------------------------------------------------------------- 9. config wiring

def test_config_validation():
    from sonar.cluster.wire.config import load_config

    cfg = load_config(["configs/tiny.yaml"], ["rollout.continuous_batching=true"])
    assert cfg.rollout.continuous_batching and cfg.rollout.engine == "hf"
    with pytest.raises(ValueError, match=r"rollout\.continuous_batching"):
        load_config(["configs/tiny.yaml"], ["rollout.continuous_batching=true", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match=r"rollout\.max_batch_rows"):
        load_config(["configs/tiny.yaml"], ["rollout.max_batch_rows=0"])
