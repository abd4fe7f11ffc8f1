"""The calibrated decode-cost model (bench/sim/gpu_cost.py) and how the simulators charge it.

Pins: the shipped coefficients are the least-squares fit of the points derived from the published
runs (re-derived and re-fitted here), the fit stays within its stated residuals, the model is
monotone in rows and context, the paced continuous engine charges sum over steps of t(rows, ctx) on a
hand-computed case, and the static wrapper charges its closed form.
"""
from __future__ import annotations

import numpy as np
import pytest

from sonar.bench.sim import gpu_cost as G
from sonar.bench.sim.config import SimConfig
from sonar.bench.sim.decode_latency import static_sleep_ms


def test_points_follow_the_published_runs_structure():
    for run in G.RUNS:
        assert len(run.input_lens) == len(run.output_lens)
        # the timing request's ITL count is what 10-token chunks of its output length give
        assert len(run.timing_itl_ms) == G.chunks_of(run.output_lens[run.timing_request])
        assert max(G.chunks_of(o) for o in run.output_lens) >= len(run.timing_itl_ms) - 1
    pts = G.published_points()
    assert pts.shape == (183, 3)
    assert pts[:, 0].min() == 1 and pts[:, 0].max() == 64
    # 10-prompt file, chunk 0: the 9 requests with output, each at context input + 1 + 5
    first = pts[0]
    ins, outs = G.RUNS[0].input_lens, G.RUNS[0].output_lens
    assert first[0] == 9 and first[1] == sum(i + 6 for i, o in zip(ins, outs) if o > 0)
    assert first[2] == pytest.approx(7.086)


def test_shipped_coefficients_are_the_fit_of_the_published_points():
    coef, res = G.fit(G.published_points())
    assert coef[0] == pytest.approx(G.T0_MS, abs=1e-4)
    assert coef[1] == pytest.approx(G.MS_PER_ROW, abs=1e-4)
    assert coef[2] == pytest.approx(G.MS_PER_1K_CTX, abs=1e-4)
    rms = float(np.sqrt(np.mean(res ** 2)))
    assert rms == pytest.approx(G.FIT_RMS_MS, abs=1e-3)
    assert float(np.abs(res).max()) == pytest.approx(G.FIT_MAX_ABS_MS, abs=1e-3)


def test_model_reproduces_every_published_point_within_the_stated_tolerance():
    cost = G.Gpu7BCost()
    pts = G.published_points()
    pred = np.array([cost(int(r), int(c)) for r, c, _ in pts])
    assert np.abs(pred - pts[:, 2]).max() <= 0.25  # ms; <= 3.5 % of any point
    assert np.abs(pred / pts[:, 2] - 1).max() <= 0.035


def test_monotone_in_rows_and_context():
    cost = G.Gpu7BCost()
    assert cost(0, 0) == 0.0  # no rows, no step
    for ctx in (0, 1_000, 50_000):
        xs = [cost(r, ctx) for r in (1, 2, 8, 64, 256)]
        assert all(b > a for a, b in zip(xs, xs[1:]))
    for rows in (1, 16, 64):
        xs = [cost(rows, c) for c in (0, 100, 10_000, 100_000)]
        assert all(b > a for a, b in zip(xs, xs[1:]))
    assert G.T0_MS > 0 and G.MS_PER_ROW > 0 and G.MS_PER_1K_CTX > 0


def test_sim_cost_label_names_the_model_and_its_source():
    flat = G.sim_cost_label(SimConfig(decode_ms_per_token=10.0))
    assert flat["decode_cost"] == "flat" and flat["step_ms"] == 10.0
    gpu = G.sim_cost_label(SimConfig(decode_cost="gpu_7b"))
    assert gpu["decode_cost"] == "gpu_7b" and gpu["t0_ms"] == G.T0_MS
    assert "LambdaLabsML/vllm-benchmark" in gpu["source"]["url"] and gpu["tail"]["sigma"] == 0.7
    assert G.sim_cost_label(SimConfig())["decode_cost"] == "real"
    assert G.sim_cost_label(SimConfig(engine="bench"))["decode_cost"] == "bench_engine"


def test_config_validates_decode_cost_and_learner_delay():
    assert SimConfig(decode_cost="gpu_7b").validate().simulates_decode
    assert not SimConfig().validate().simulates_decode
    with pytest.raises(ValueError, match=r"sim\.decode_cost='gpu_8b'"):
        SimConfig(decode_cost="gpu_8b").validate()
    with pytest.raises(ValueError, match=r"sim\.learner_delay_ms=-1"):
        SimConfig(learner_delay_ms=-1.0).validate()
    with pytest.raises(ValueError, match=r"sim\.decode_cost='gpu_7b' with sim\.engine='bench'"):
        SimConfig(engine="bench", decode_cost="gpu_7b").validate()


def test_static_wrapper_charges_the_closed_form():
    cost = G.Gpu7BCost()
    ctx, L = [40, 60, 100], [3, 3, 3]  # equal lengths: every step has all rows
    n, s = len(ctx), sum(ctx)
    closed = sum(G.T0_MS + G.MS_PER_ROW * n + G.MS_PER_1K_CTX * (s + n * k) / 1000 for k in range(1, 4))
    assert static_sleep_ms(cost, ctx, L) == pytest.approx(closed, rel=1e-12)
    # unequal lengths: rows drop out; steps 1-2 hold both rows, step 3-4 only the second
    got = static_sleep_ms(lambda r, c: 1000.0 * r + c, [10, 20], [2, 4])
    assert got == pytest.approx((2000 + 30 + 2) + (2000 + 30 + 4) + (1000 + 20 + 3) + (1000 + 20 + 4))
    flat = static_sleep_ms(G.FlatCost(10.0), [5, 5], [2, 7])
    assert flat == pytest.approx(70.0)  # the flat model: ms_per_token x the longest row, as before


def test_static_wrapper_engine_sleeps_the_cost(monkeypatch):
    from sonar.actors.engine import Generation, SamplingParams
    from sonar.bench.sim import decode_latency as D

    class Inner:
        version = 0

        def generate(self, prompts, params, caps=None):
            return [Generation(np.arange(4, dtype=np.int32), np.zeros(4, np.float32), "stop", 0, None)
                    for _ in prompts]

    slept = []
    monkeypatch.setattr(D.time, "sleep", slept.append)
    eng = D.DecodeLatencyEngine(Inner(), None, median_tokens=5, sigma=0.0, max_tokens=5, cost=G.Gpu7BCost())
    eng.generate([np.zeros(10, np.int64), np.zeros(20, np.int64)], SamplingParams(max_new_tokens=4))
    ctx = [10 + 4, 20 + 4]
    expect = sum(G.T0_MS + 2 * G.MS_PER_ROW + G.MS_PER_1K_CTX * (sum(ctx) + 2 * k) / 1000 for k in range(1, 6))
    assert slept == [pytest.approx(expect / 1000)]
    assert eng.engine_stats()["simulated_s"] == pytest.approx(expect / 1000)


def test_paced_engine_charges_the_sum_of_t_per_step():
    """One prompt of P tokens, 3 real tokens (greedy, no EOS), a tail of 2 simulated tokens: 5 steps with
    one row each and contexts P, P+1, P+2 (decode) then P+3, P+4 (tail)."""
    from sonar.actors.engine import SamplingParams
    from sonar.bench.sim.paced_engine import PacedContinuousHFEngine
    from tests.actors.test_engine import PROMPTS, tiny_model
    from tests.actors.test_engine_continuous import _wait_idle

    seen = []

    def cost(rows, ctx):
        seen.append((rows, ctx))
        return 0.01 * rows + 0.001 * ctx  # small: the test does not wait on real time

    eng = PacedContinuousHFEngine(tiny_model(), eos_token_id=None, max_batch=4, cost=cost, median_tokens=2,
                                  sigma=0.0, max_tokens=2)
    try:
        prompt = PROMPTS[0]
        P = len(prompt)
        gens = eng.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0.0))
        st = _wait_idle(eng)
    finally:
        eng.close()
    assert len(gens[0].token_ids) == 3
    assert seen == [(1, P), (1, P + 1), (1, P + 2), (1, P + 3), (1, P + 4)]
    assert st["simulated_s"] == pytest.approx(sum(0.01 + 0.001 * c for _, c in seen) / 1000)
    assert st["steps"] == 5 and st["decode_cost"] == "function"  # a bare callable is named by its type


def test_paced_engine_flat_cost_is_the_old_fixed_step():
    from sonar.bench.sim.paced_engine import PacedContinuousHFEngine
    from tests.actors.test_engine import tiny_model

    eng = PacedContinuousHFEngine(tiny_model(), eos_token_id=None, step_ms=3.0)
    try:
        assert eng.cost(1, 10) == eng.cost(64, 100_000) == 3.0 and eng.engine_stats()["decode_cost"] == "flat"
    finally:
        eng.close()


# ------------------------------------------------------------------ prefill
def test_prefill_points_are_the_published_runs_batches():
    pts = G.prefill_points()
    assert len(G.PREFILL_TTFT_MS) == len(G.RUNS[1].input_lens) == 80
    # 74 requests with a first token; the first batch (8 requests at 261-262 ms) is dropped with the run's start
    assert pts.shape == (12, 2)
    assert pts[:, 0].sum() + 1231 == sum(n for n, t in zip(G.RUNS[1].input_lens, G.PREFILL_TTFT_MS) if t > 0)
    # the second batch: the 3 requests with first tokens at 307.7-308.3 ms, 46.2 ms after the first batch ended
    assert pts[0, 0] == 1447 and pts[0, 1] == pytest.approx(308.3 - 262.1)
    assert pts[:, 1].sum() == pytest.approx(777.7 - 262.1)  # back to back: the steps add up to the span


def test_shipped_prefill_coefficients_are_the_fit():
    coef, res = G.fit_prefill(G.prefill_points())
    assert coef[0] == pytest.approx(G.PREFILL_T0_MS, abs=0.01)
    assert coef[1] == pytest.approx(G.PREFILL_MS_PER_1K, abs=0.01)
    assert float(np.sqrt(np.mean(res ** 2))) == pytest.approx(G.PREFILL_FIT_RMS_MS, abs=0.01)
    # the slope is the FLOP floor of the H100 at 7.25e9 parameters (2 FLOP per parameter and token, 989 TFLOPS)
    assert G.PREFILL_MS_PER_1K == pytest.approx(2 * 7.25e9 * 1000 / 989e12 * 1000, rel=0.02)


def test_prefill_cost_form_and_label():
    c = G.Prefill7BCost()
    assert c(0) == 0.0 and c(-5) == 0.0
    assert c(1000) == pytest.approx(G.PREFILL_T0_MS + G.PREFILL_MS_PER_1K)
    assert c(4000) - c(2000) == pytest.approx(2 * G.PREFILL_MS_PER_1K)
    lab = c.label()
    assert lab["prefill_cost"] == "gpu_7b_prefill" and lab["source"]["commit"] == G.SOURCE["commit"]
    assert lab["refit"]["t0_ms"] == pytest.approx(G.PREFILL_T0_MS, abs=0.01) and lab["refit"]["rms_ms"] < 7.0
