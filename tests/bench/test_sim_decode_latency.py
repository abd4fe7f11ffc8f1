"""Tests for ``sonar.bench.sim.decode_latency.DecodeLatencyEngine`` (the benchmark decode-time wrapper)
and its settings, the ``sim.decode_*`` fields of ``SimConfig`` (which the production schema does not have).

The inner engine is a tiny in-file fake: the wrapper is what is under test (delegation, the timing
model, the lock, the length draws, validation) and none of that depends on a real model. Timings use
1-5 ms per token and short lengths so every test stays well under a second.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import sonar.bench.sim.decode_latency as dl
from sonar.actors.engine import Generation, SamplingParams
from sonar.bench.sim.config import load_bench_config
from sonar.bench.sim.decode_latency import DecodeLatencyEngine
from sonar.cluster.wire.config import ConfigError, load_config
from tests.waiting import DEADLINE_S, WaiterCountingLock, wait_until

ROOT = Path(__file__).resolve().parents[2]
CONFIG_YAML = str(ROOT / "configs" / "tiny.yaml")  # a production config: no sim: section, nothing simulated
PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)


class FakeEngine:
    """Records calls; returns one deterministic Generation per prompt stamped with ``self.version``."""

    def __init__(self, version: int = 3):
        self.version = version
        self.model = object()
        self.generate_calls: list[dict] = []
        self.generate_times: list[float] = []
        self.loaded: list[tuple[list, int]] = []
        self.last_gens: list[Generation] = []

    def generate(self, prompts, params, *args, **kwargs):
        self.generate_times.append(time.perf_counter())
        self.generate_calls.append({"prompts": list(prompts), "params": params, "args": args, "kwargs": kwargs})
        gens = []
        for i, p in enumerate(prompts):
            n = 1 + (int(np.asarray(p).sum()) + i) % 4
            ids = (np.arange(n, dtype=np.int32) + 10 * i + 1).astype(np.int32)
            lps = -np.linspace(0.1, 0.9, n).astype(np.float32) - i
            gens.append(Generation(ids, lps, "length", self.version, None))
        self.last_gens = gens
        return gens

    def load_weights(self, named_tensors, version: int) -> None:
        self.loaded.append((list(named_tensors), version))
        self.version = version

    def parameter_specs(self):
        return ["spec-a", "spec-b"]

    def state_checksum(self) -> float:
        return 123.5 + self.version


def prompts(n: int) -> list[np.ndarray]:
    return [np.array([1, 2, i], dtype=np.int64) for i in range(n)]


def make(inner=None, ms=2.0, median=10, sigma=0.0, max_tokens=64, seed=0) -> DecodeLatencyEngine:
    return DecodeLatencyEngine(inner if inner is not None else FakeEngine(), ms, median, sigma, max_tokens, seed=seed)


# ------------------------------------------------------------------ delegation

def test_generations_are_exactly_the_inner_ones():
    inner = FakeEngine(version=7)
    eng = make(inner, ms=1.0, median=2)
    out = eng.generate(prompts(5), PARAMS)
    assert len(out) == 5
    assert len(inner.generate_calls) == 1
    for got, ref in zip(out, inner.last_gens):
        assert got is ref  # the very objects, not copies
        np.testing.assert_array_equal(got.token_ids, ref.token_ids)
        np.testing.assert_array_equal(got.logprobs, ref.logprobs)
        assert got.version == 7 and got.finish == "length"
    # prompts and params reach the inner engine unchanged
    call = inner.generate_calls[0]
    assert call["params"] is PARAMS
    assert [p.tolist() for p in call["prompts"]] == [p.tolist() for p in prompts(5)]


def test_per_prompt_caps_passed_only_when_given():
    inner = FakeEngine()
    eng = make(inner, ms=1.0, median=1)
    eng.generate(prompts(3), PARAMS)
    assert inner.generate_calls[-1]["args"] == () and inner.generate_calls[-1]["kwargs"] == {}
    eng.generate(prompts(3), PARAMS, None)
    assert inner.generate_calls[-1]["args"] == () and inner.generate_calls[-1]["kwargs"] == {}
    caps = [1, 2, 3]
    eng.generate(prompts(3), PARAMS, caps)
    passed = inner.generate_calls[-1]["args"] + tuple(inner.generate_calls[-1]["kwargs"].values())
    assert passed == (caps,)


def test_weight_path_and_attributes_delegate_to_inner():
    inner = FakeEngine(version=3)
    eng = make(inner, ms=1.0, median=1)
    assert eng.version == 3
    assert eng.model is inner.model
    assert eng.parameter_specs() == ["spec-a", "spec-b"]
    assert eng.state_checksum() == 126.5
    tensors = [("w", np.ones(2)), ("b", np.zeros(1))]
    eng.load_weights(iter(tensors), 9)
    assert len(inner.loaded) == 1
    assert [name for name, _ in inner.loaded[0][0]] == ["w", "b"] and inner.loaded[0][1] == 9
    assert eng.version == 9  # read through, not cached
    assert eng.state_checksum() == 132.5
    assert eng.generate(prompts(2), PARAMS)[0].version == 9


def test_model_is_none_when_inner_has_none():
    inner = FakeEngine()
    del inner.model
    assert make(inner).model is None


def test_works_behind_swapping_engine():
    """The worker wraps it in SwappingEngine, which always passes caps (None) positionally."""
    from sonar.actors.worker import SwappingEngine

    inner = FakeEngine(version=1)
    eng = make(inner, ms=1.0, median=2)
    swap = SwappingEngine(eng)
    swap.stage(4, {"w": np.ones(1)})
    out = swap.generate(prompts(2), PARAMS)
    assert inner.loaded and inner.loaded[0][1] == 4
    assert [g.version for g in out] == [4, 4]
    assert inner.generate_calls[-1]["args"] == ()
    assert eng.calls == 1 and eng.rows == 2


# ------------------------------------------------------------------ timing model

def test_constant_length_sleeps_ms_times_length_and_counters_match():
    ms, L, rows = 3.0, 20, 4
    eng = make(ms=ms, median=L, sigma=0.0, max_tokens=64)
    expected = ms * L / 1000.0  # 60 ms per call
    for k in range(1, 4):
        t0 = time.perf_counter()
        eng.generate(prompts(rows), PARAMS)
        dt = time.perf_counter() - t0
        assert dt >= expected * 0.999  # it really slept (a loaded machine only sleeps longer)
        assert eng.calls == k
        assert eng.rows == k * rows
        assert eng.simulated_tokens == k * rows * L
        assert eng.simulated_s == pytest.approx(k * ms * L / 1000.0)
        assert eng.wall_s >= eng.simulated_s * 0.999


def test_sleep_happens_after_inner_call_inside_lock(monkeypatch):
    inner = FakeEngine()
    eng = make(inner, ms=4.0, median=10, sigma=0.5, max_tokens=64)
    monkeypatch.setattr(eng, "draw_tokens", lambda n: np.array([3, 17, 5][:n], dtype=np.int64))
    seen = []

    def fake_sleep(s):
        seen.append((s, len(inner.generate_calls), eng._lock.locked()))

    monkeypatch.setattr(dl.time, "sleep", fake_sleep)
    eng.generate(prompts(3), PARAMS)
    assert len(seen) == 1
    s, inner_calls_before_sleep, locked = seen[0]
    assert s == pytest.approx(4.0 * 17 / 1000.0)  # the longest row, not the sum or the mean
    assert inner_calls_before_sleep == 1
    assert locked
    assert eng.simulated_tokens == 3 + 17 + 5
    assert eng.simulated_s == pytest.approx(0.068)


def test_call_waits_for_its_longest_drawn_row():
    ms, seed, rows = 1.0, 7, 8
    ref = make(ms=ms, median=5, sigma=1.0, max_tokens=60, seed=seed)
    first, second = ref.draw_tokens(rows), ref.draw_tokens(rows)
    assert first.max() > first.min()  # the draws differ, so max != mean != min
    eng = make(ms=ms, median=5, sigma=1.0, max_tokens=60, seed=seed)
    t0 = time.perf_counter()
    eng.generate(prompts(rows), PARAMS)
    dt = time.perf_counter() - t0
    assert eng.simulated_s == pytest.approx(ms * first.max() / 1000.0)
    assert eng.simulated_tokens == int(first.sum())
    assert dt >= ms * first.max() / 1000.0 * 0.999
    eng.generate(prompts(rows), PARAMS)  # the next call continues the same stream
    assert eng.simulated_s == pytest.approx(ms * (first.max() + second.max()) / 1000.0)
    assert eng.simulated_tokens == int(first.sum() + second.sum())


def test_same_seed_same_draws_different_seed_different_draws():
    a = make(median=16, sigma=0.7, max_tokens=256, seed=3).draw_tokens(64)
    b = make(median=16, sigma=0.7, max_tokens=256, seed=3).draw_tokens(64)
    c = make(median=16, sigma=0.7, max_tokens=256, seed=4).draw_tokens(64)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_empty_call_does_not_sleep(monkeypatch):
    inner = FakeEngine()
    eng = make(inner, ms=5.0, median=50, sigma=0.0, max_tokens=64)
    slept = []
    monkeypatch.setattr(dl, "time", SimpleNamespace(sleep=slept.append, perf_counter=time.perf_counter))
    assert eng.generate([], PARAMS) == []
    assert slept == []
    assert eng.rows == 0 and eng.simulated_tokens == 0 and eng.simulated_s == 0.0


# ------------------------------------------------------------------ draw_tokens distribution

def test_draw_median_and_bounds():
    eng = make(median=16, sigma=0.7, max_tokens=256, seed=11)
    x = eng.draw_tokens(20000)
    assert x.dtype == np.int64 and x.shape == (20000,)
    assert abs(np.median(x) - 16) <= 0.05 * 16
    assert x.min() >= 1 and x.max() <= 256
    # a long right tail: p99 ~ 16 * exp(2.326 * 0.7) ~ 81
    assert 65 <= np.percentile(x, 99) <= 100


def test_draw_clips_at_max_tokens():
    eng = make(median=16, sigma=0.7, max_tokens=20, seed=1)
    x = eng.draw_tokens(20000)
    assert x.max() == 20
    # P(lognormal > 19.5) = 1 - Phi(ln(19.5/16) / 0.7) ~ 0.39: all of that mass sits at 20
    assert 0.33 < np.mean(x == 20) < 0.45


def test_draw_clips_at_one():
    x = make(median=1, sigma=2.0, max_tokens=50, seed=2).draw_tokens(5000)
    assert x.min() == 1
    assert np.mean(x == 1) > 0.4  # everything below 1.5 (about 58%) lands on 1
    assert not np.any(x == 0)


@pytest.mark.parametrize("median, expect", [(16, 16), (7.4, 7), (1, 1), (256, 256)])
def test_sigma_zero_is_constant_rounded_median(median, expect):
    x = make(median=median, sigma=0.0, max_tokens=256, seed=5).draw_tokens(100)
    assert np.all(x == expect)


# ------------------------------------------------------------------ serialisation

def test_concurrent_calls_queue_on_the_lock():
    ms, L = 3.0, 20
    single = ms * L / 1000.0  # 60 ms
    inner = FakeEngine()
    eng = make(inner, ms=ms, median=L, sigma=0.0, max_tokens=64)
    barrier = threading.Barrier(2)
    errors = []

    def run():
        try:
            barrier.wait()
            eng.generate(prompts(2), PARAMS)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "generate did not return"
    total = time.perf_counter() - t0
    assert not errors
    assert total >= 2 * single * 0.9  # one call after the other (a loaded machine only takes longer)
    assert eng.calls == 2 and eng.rows == 4
    assert eng.simulated_s == pytest.approx(2 * single)
    # the second inner call starts only after the first call's simulated decode is done
    t_a, t_b = sorted(inner.generate_times)
    assert t_b - t_a >= single * 0.99
    # wall_s counts the queueing: the queued call waited about one extra call
    assert eng.wall_s >= 3 * single * 0.9


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("kwargs, field", [
    ({"ms": 0.0}, "sim.decode_ms_per_token"),
    ({"ms": -1.0}, "sim.decode_ms_per_token"),
    ({"ms": float("nan")}, "sim.decode_ms_per_token"),
    ({"ms": float("inf")}, "sim.decode_ms_per_token"),
    ({"median": 0.5}, "sim.decode_median_tokens"),
    ({"median": float("nan")}, "sim.decode_median_tokens"),
    ({"sigma": -0.1}, "sim.decode_sigma"),
    ({"sigma": float("nan")}, "sim.decode_sigma"),
    ({"median": 32, "max_tokens": 16}, "sim.decode_max_tokens"),
])
def test_invalid_knobs_name_the_config_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make(**kwargs)


def test_boundary_values_are_accepted():
    eng = make(ms=1e-3, median=1, sigma=0.0, max_tokens=1)
    assert np.all(eng.draw_tokens(10) == 1)
    make(median=16, max_tokens=16)


# ------------------------------------------------------------------ config

def test_config_enables_wrapper():
    _, sim = load_bench_config([CONFIG_YAML], ["sim.decode_ms_per_token=10"])
    assert sim.decode_ms_per_token == 10.0
    assert (sim.decode_median_tokens, sim.decode_sigma, sim.decode_max_tokens) == (16.0, 0.7, 256)
    assert load_bench_config([CONFIG_YAML])[1].decode_ms_per_token == 0.0  # off by default


def test_production_schema_has_no_simulation_knobs():
    """The knobs moved out of production: its schema refuses them, and the bench engine is no engine kind."""
    for o in ("rollout.inject_decode_ms_per_token=10", "rollout.bench_token_ms=2", "retrieval.inject_latency_ms=5",
              "sim.decode_ms_per_token=10"):
        with pytest.raises(ConfigError):
            load_config([CONFIG_YAML], [o])
    with pytest.raises(ValueError, match=r"rollout\.engine='bench'"):
        load_config([CONFIG_YAML], ["rollout.engine=bench"])


def test_config_rejects_wrapper_with_bench_engine():
    with pytest.raises(ValueError) as e:
        load_bench_config([CONFIG_YAML], ["sim.decode_ms_per_token=10", "sim.engine=bench"])
    msg = str(e.value)
    assert "sim.decode_ms_per_token" in msg and "sim.engine" in msg
    # the bench engine alone is fine
    assert load_bench_config([CONFIG_YAML], ["sim.engine=bench"])[1].engine == "bench"


@pytest.mark.parametrize("overrides, fields", [
    (["sim.decode_ms_per_token=-1"], ["sim.decode_ms_per_token"]),
    (["sim.decode_ms_per_token=.nan"], ["sim.decode_ms_per_token"]),
    (["sim.decode_ms_per_token=10", "sim.decode_median_tokens=500"],
     ["sim.decode_median_tokens=500", "sim.decode_max_tokens=256"]),
    (["sim.decode_ms_per_token=10", "sim.decode_median_tokens=0.5"],
     ["sim.decode_median_tokens=0.5"]),
    (["sim.decode_ms_per_token=10", "sim.decode_sigma=-0.5"],
     ["sim.decode_sigma=-0.5"]),
])
def test_config_rejects_bad_decode_values(overrides, fields):
    with pytest.raises(ValueError) as e:
        load_bench_config([CONFIG_YAML], overrides)
    for f in fields:
        assert f in str(e.value)


def test_config_shape_knobs_unchecked_while_disabled():
    _, sim = load_bench_config([CONFIG_YAML], ["sim.decode_median_tokens=500"])
    assert sim.decode_ms_per_token == 0.0 and sim.decode_median_tokens == 500


def test_config_knobs_build_a_valid_engine():
    _, sim = load_bench_config([CONFIG_YAML], ["sim.decode_ms_per_token=10"])
    eng = DecodeLatencyEngine(FakeEngine(), sim.decode_ms_per_token, sim.decode_median_tokens,
                              sim.decode_sigma, sim.decode_max_tokens, seed=1009)
    assert eng.ms_per_token == 10.0 and eng.max_tokens == 256


# ------------------------------------------------------------------ stats

def test_engine_stats_reports_counters_and_engine_name():
    eng = make(ms=2.0, median=5, sigma=0.0, max_tokens=30)
    s0 = eng.engine_stats()
    assert s0["calls"] == 0 and s0["rows"] == 0 and s0["simulated_tokens"] == 0 and s0["simulated_s"] == 0.0
    eng.generate(prompts(3), PARAMS)
    eng.generate(prompts(2), PARAMS)
    s = eng.engine_stats()
    assert "decode_latency" in s["engine"] and "FakeEngine" in s["engine"]
    assert s["engine"] == "decode_latency(FakeEngine)"
    assert s["calls"] == 2 and s["rows"] == 5
    assert s["simulated_tokens"] == 5 * 5
    assert s["simulated_s"] == pytest.approx(2 * 2.0 * 5 / 1000.0)
    assert s["wall_s"] >= s["simulated_s"] * 0.999
    assert (s["token_ms"], s["median_tokens"], s["sigma"], s["max_tokens"]) == (2.0, 5.0, 0.0, 30)
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in s.values())
    assert "FakeEngine" in repr(eng) and "ms_per_token=2.0" in repr(eng)


def test_load_weights_waits_for_the_simulated_decode(monkeypatch):
    """A static-batch engine never swaps weights inside a call: the simulated part counts as the call.
    The simulated decode is held open (its sleep waits for the test) while load_weights is called."""
    inner = FakeEngine(version=1)
    eng = make(inner, ms=5.0, median=40, sigma=0.0, max_tokens=64)
    eng._lock = WaiterCountingLock()
    in_decode, end_decode, order = threading.Event(), threading.Event(), []

    def held_sleep(s):
        in_decode.set()
        assert end_decode.wait(DEADLINE_S), "the test never ended the simulated decode"
        order.append("decode done")

    monkeypatch.setattr(dl, "time", SimpleNamespace(sleep=held_sleep, perf_counter=time.perf_counter))
    load = inner.load_weights
    monkeypatch.setattr(inner, "load_weights", lambda named, v: (order.append("load"), load(named, v)))
    call = threading.Thread(target=eng.generate, args=(prompts(2), PARAMS))
    call.start()
    assert in_decode.wait(DEADLINE_S), "generate never reached its simulated decode"
    # stats do not wait for a call: read them while the decode is held open
    reader = threading.Thread(target=eng.engine_stats)
    reader.start()
    reader.join(DEADLINE_S)
    assert not reader.is_alive(), "engine_stats waited for the call"
    loader = threading.Thread(target=eng.load_weights, args=([("w", 0)], 2))
    loader.start()
    wait_until(lambda: eng._lock.waiting == 1 or order, what="load_weights to wait for the device lock")
    end_decode.set()
    for t in (call, loader):
        t.join(DEADLINE_S)
        assert not t.is_alive()
    assert order == ["decode done", "load"]  # the weights changed only after the simulated decode
    assert eng.version == 2 and inner.loaded[-1][1] == 2
