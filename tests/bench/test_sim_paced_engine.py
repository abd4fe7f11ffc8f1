"""``PacedContinuousHFEngine`` (bench/sim/paced_engine.py): the continuous engine paced like a real-size policy.

Moved here with the pacing from the production engine: steps last ``step_ms``, and a row holds its slot
for a simulated tail after its real tokens (through the production engine's ``_release``/``_held``
extension points). Counters are read through ``_wait_idle`` (the decode thread parked, no work left).
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from sonar.actors.engine import SamplingParams
from sonar.actors.engine_continuous import ContinuousHFEngine
from sonar.bench.sim.paced_engine import PacedContinuousHFEngine
from tests.actors.test_engine import PROMPTS, tiny_model
from tests.actors.test_engine_continuous import JOIN_S, _Caller, _wait_idle


@pytest.fixture
def make_engine():
    """``make(model, **kw)``: a paced engine when ``step_ms`` is given, else the production one; all closed
    at teardown, and their decode threads must be gone."""
    engines: list[ContinuousHFEngine] = []

    def make(model, **kw) -> ContinuousHFEngine:
        kw.setdefault("eos_token_id", None)
        eng = PacedContinuousHFEngine(model, **kw) if "step_ms" in kw else ContinuousHFEngine(model, **kw)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()
        assert eng._thread is None or not eng._thread.is_alive(), "decode thread left running"


def _paced_run(make_engine, model, prompts, max_batch):
    eng = make_engine(model, max_batch=max_batch, step_ms=5.0, median_tokens=10, sigma=0.0, max_tokens=20)
    t0 = time.perf_counter()
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0))
    wall = time.perf_counter() - t0
    return gens, wall, _wait_idle(eng)


def test_pacing_holds_slots_for_the_simulated_tail(make_engine):
    model = tiny_model(seed=1)
    plain = make_engine(model).generate(PROMPTS * 2, SamplingParams(max_new_tokens=5, temperature=0.0))

    # 4 rows: steps 1..5 produce the 5 real tokens (rows leave the cache at step 5 with tail = 10),
    # steps 6..15 consume the tail (from the step after the row's last real token): 15 steps.
    gens4, wall4, st4 = _paced_run(make_engine, model, PROMPTS, max_batch=4)
    assert [g.token_ids.tolist() for g in gens4] == [g.token_ids.tolist() for g in plain[:4]]
    for g, q in zip(gens4, plain):
        np.testing.assert_allclose(g.logprobs, q.logprobs, atol=1e-6, rtol=0)
    assert st4["steps"] == 15 and st4["forward_steps"] == 5  # tail steps run no forward
    assert st4["simulated_s"] == pytest.approx(15 * 0.005)
    # a row holds its slot in every one of the 15 steps (5 real + 10 tail); it is released at the end
    # of step 15, so a queued row can be admitted at step 16
    assert st4["live_row_steps"] == 15 * 4 and st4["max_live_rows"] == 4 and st4["rows"] == 4
    # generate returns inside step 15 (before its pacing sleep): 14 full steps of >= 5 ms precede it
    assert wall4 >= 14 * 0.005

    # 8 rows, 4 slots: the second 4 are admitted only when the first 4 release their slots after
    # their tails (step 16): twice the steps, twice the (simulated and real) time.
    gens8, wall8, st8 = _paced_run(make_engine, model, PROMPTS * 2, max_batch=4)
    assert [g.token_ids.tolist() for g in gens8] == [g.token_ids.tolist() for g in plain]
    assert st8["steps"] == 30 and st8["forward_steps"] == 10 and st8["max_live_rows"] == 4
    assert st8["live_row_steps"] == 15 * 8
    assert st8["simulated_s"] == pytest.approx(2 * st4["simulated_s"])
    assert wall8 >= 29 * 0.005
    # Wall-clock ratio with a generous band (the lower bounds above are the exact part; the machine
    # may be loaded, which only stretches steps, so only a gross violation fails).
    assert wall8 > 1.3 * (15 * 0.005), (wall4, wall8)


def test_stats_report_the_pacing(make_engine):
    eng = make_engine(tiny_model(), step_ms=1.0, median_tokens=3, sigma=0.0, max_tokens=8)
    st = eng.engine_stats()
    assert st["engine"] == "paced(hf-continuous)" and st["simulated_s"] == 0.0 and st["steps"] == 0
    assert (st["token_ms"], st["median_tokens"], st["sigma"], st["max_tokens"]) == (1.0, 3.0, 0.0, 8)


def test_like_copies_the_production_engines_settings():
    prod = ContinuousHFEngine(tiny_model(), eos_token_id=3, max_batch=7)
    paced = PacedContinuousHFEngine.like(prod, step_ms=2.0, median_tokens=4, sigma=0.0, max_tokens=9, seed=5)
    try:
        assert (paced.model, paced.eos_token_id, paced.device, paced.max_batch) == (prod.model, 3, prod.device, 7)
        assert paced.step_ms == 2.0 and paced.lengths.max_tokens == 9
    finally:
        paced.close()
        prod.close()


def test_failure_while_rows_are_held_raises_in_their_callers(make_engine):
    """A row holding a slot (real tokens done, tail left) is still in flight: a failed step fails its call."""
    eng = make_engine(tiny_model(), step_ms=1.0, median_tokens=10_000, sigma=0.0, max_tokens=10_000)
    c = _Caller(lambda: eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0.0)))
    deadline = time.monotonic() + JOIN_S
    while not eng._held():
        assert time.monotonic() < deadline and c.thread.is_alive(), "the row never reached its tail"
        time.sleep(0.001)

    def boom(admit):
        raise ValueError("injected step failure")

    eng._step = boom  # the decode thread looks _step up on the instance every step
    c.join(timeout=JOIN_S)
    assert isinstance(c.error, RuntimeError) and "injected step failure" in str(c.error)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("step_ms", [0.0, -1.0, math.nan, math.inf])
def test_bad_step_ms_raises(step_ms):
    with pytest.raises(ValueError, match=r"sim\.decode_ms_per_token"):
        PacedContinuousHFEngine(tiny_model(), eos_token_id=None, step_ms=step_ms)


@pytest.mark.parametrize("kw", [dict(median_tokens=30, max_tokens=20), dict(median_tokens=0.5),
                                dict(sigma=-0.1)])
def test_bad_tail_distribution_raises(kw):
    with pytest.raises(ValueError, match=r"sim\.decode_"):
        PacedContinuousHFEngine(tiny_model(), eos_token_id=None, step_ms=1.0, **kw)


def test_production_engine_has_no_pacing():
    """The knobs are gone from the production engine: it refuses them, and holds no row after its tokens."""
    with pytest.raises(TypeError):
        ContinuousHFEngine(tiny_model(), eos_token_id=None, step_ms=1.0)
    eng = ContinuousHFEngine(tiny_model(), eos_token_id=None)
    try:
        assert eng._held() == [] and "simulated_s" not in eng.engine_stats()
    finally:
        eng.close()


# ------------------------------------------------------------------ prefill, KV recompute, context scale, overruns
def _recording(calls):
    def prefill(tokens):
        calls.append(tokens)
        return 0.002 * tokens  # small: the test does not wait on real time
    return prefill


def test_prefill_is_charged_for_admitted_prompts_and_contexts_scale(make_engine):
    """One prompt of P tokens, 3 real tokens, a tail of 2, context_scale 2: the decode costs see the real
    tokens doubled (2P, 2P+2, 2P+4, then 2(P+3) and 2(P+3)+1 in the tail), the prefill sees 2P once."""
    seen, calls = [], []

    def cost(rows, ctx):
        seen.append((rows, ctx))
        return 0.001 * ctx

    eng = make_engine(tiny_model(), max_batch=4, cost=cost, median_tokens=2, sigma=0.0, max_tokens=2,
                      prefill=_recording(calls), context_scale=2.0, step_ms=None)
    P = len(PROMPTS[0])
    eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3, temperature=0.0))
    st = _wait_idle(eng)
    assert seen == [(1, 2 * P), (1, 2 * P + 2), (1, 2 * P + 4), (1, 2 * P + 6), (1, 2 * P + 7)]
    assert calls == [2 * P]
    assert st["prefill_s"] == pytest.approx(0.002 * 2 * P / 1000)
    assert st["simulated_s"] == pytest.approx((sum(0.001 * c for _, c in seen) + 0.002 * 2 * P) / 1000)
    assert st["sim_recomputes"] == 0 and st["recompute_s"] == 0.0 and st["context_scale"] == 2.0
    assert st["prefill_cost"] == "function"
    assert st["ctx_admitted_n"] == 1 and st["ctx_admitted_tokens"] == st["ctx_admitted_max"] == 2 * P


def test_a_weight_swap_with_rows_in_flight_is_charged_one_recompute_of_their_contexts(make_engine):
    from tests.actors.test_engine_continuous import _wait_tokens

    calls = []
    eng = make_engine(tiny_model(seed=0), max_batch=4, cost=lambda rows, ctx: 0.01, median_tokens=1, sigma=0.0,
                      max_tokens=1, prefill=_recording(calls), step_ms=None)
    P = len(PROMPTS[0])
    caller = _Caller(lambda: eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=200, temperature=1.0, seed=3)))
    _wait_tokens(eng, caller, 20)
    eng.load_weights(tiny_model(seed=5).named_parameters(), version=7)
    caller.join()
    st = _wait_idle(eng)
    assert caller.error is None
    # admission (P), then one recompute of the one row in flight: its prompt and the tokens it had then
    assert len(calls) == 2 and calls[0] == P and P + 20 <= calls[1] <= P + 200
    assert st["sim_recomputes"] == 1 and st["cache_recomputes"] == 1  # the real engine recomputed too
    assert st["recompute_s"] == pytest.approx(0.002 * calls[1] / 1000)
    # no swap: no recompute charged, however many steps
    eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=5, temperature=0.0))
    assert _wait_idle(eng)["sim_recomputes"] == 1


def test_without_a_prefill_model_nothing_more_is_charged(make_engine):
    eng = make_engine(tiny_model(), max_batch=4, step_ms=1.0, median_tokens=1, sigma=0.0, max_tokens=1)
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=0.0))
    st = _wait_idle(eng)
    assert st["prefill_s"] == st["recompute_s"] == 0.0 and st["prefill_cost"] is None
    assert st["simulated_s"] == pytest.approx(st["steps"] * 0.001)


def test_steps_whose_real_work_outlasts_the_simulated_cost_are_counted(make_engine):
    """A simulated step of 0 ms: every step's real work (the model's forward) overruns it."""
    eng = make_engine(tiny_model(), max_batch=4, cost=lambda rows, ctx: 0.0, median_tokens=1, sigma=0.0,
                      max_tokens=1, step_ms=None)
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    st = _wait_idle(eng)
    assert st["overrun_steps"] == st["steps"] > 0 and st["overrun_s"] > 0


@pytest.mark.parametrize("scale", [0.5, float("nan"), float("inf")])
def test_bad_context_scale_raises(scale):
    with pytest.raises(ValueError, match="context_scale"):
        PacedContinuousHFEngine(tiny_model(), eos_token_id=None, step_ms=1.0, context_scale=scale)
