"""sonar bench soak: the slope is least squares (pinned on a closed form), and --quick writes a valid result."""
from __future__ import annotations

import json
import math

import pytest

from sonar.bench import common, run
from sonar.bench.soak import RssSampler, analyse, rss_slope


def test_rss_slope_is_the_least_squares_slope_in_mb_per_minute():
    t = [0.0, 30.0, 60.0, 90.0]
    assert rss_slope(t, [100e6 + 2e6 * x / 60 for x in t]) == pytest.approx(2.0)  # exact line: 2 MB/min
    # closed form for 0,1,2 minutes with RSS 10, 11, 15 MB: slope = sum((t-1)(y-12)) / sum((t-1)^2) = 2.5
    assert rss_slope([0, 60, 120], [10e6, 11e6, 15e6]) == pytest.approx(2.5)
    assert rss_slope([0, 60], [5e6, 5e6]) == 0.0


def test_analyse_drops_the_warmup_samples():
    ss = [(0.0, 500e6), (60.0, 900e6), (120.0, 1000e6), (180.0, 1000e6), (240.0, 1000e6)]  # grows, then flat
    a = analyse({"learner": ss}, warmup=0.4)["learner"]
    assert a["warmup_samples"] == 2 and a["slope_mb_per_min"] == pytest.approx(0.0)
    assert a["rss_mb_after_warmup"] == 1000 and a["rss_mb_end"] == 1000


def test_the_window_is_the_rl_stage_only():
    # SFT grows the learner by 400 MB (its optimiser, the switch to RL); RL then is flat: only the samples
    # from the RL stage's first step count, and their first 40 % are its warm-up.
    ss = [(0.0, 100e6), (60.0, 300e6), (120.0, 500e6)] + [(180.0 + 60 * i, 500e6) for i in range(5)]
    a = analyse({"learner": ss}, warmup=0.4, window_t0=150.0)["learner"]
    assert a["warmup_samples"] == 2 and a["samples"] == 5 and a["slope_mb_per_min"] == pytest.approx(0.0)
    assert analyse({"learner": ss}, warmup=0.0)["learner"]["slope_mb_per_min"] > 0  # the whole run: it grows


def test_the_sampler_opens_its_window_at_the_rl_stages_first_step():
    s = RssSampler(every_s=3600.0, minutes=0.0, rl_stage=1)
    s.t0 = 0.0
    assert s.done(None, None, 0, 5) is False and s.window_t0 is None  # SFT steps do not open it
    assert s.done(None, None, 1, 1) is False and s.window_t0 is not None
    first = s.window_t0
    s.done(None, None, 1, 2)
    assert s.window_t0 == first  # opened once


@pytest.mark.slow
@pytest.mark.ray
def test_soak_quick(tmp_path):
    import ray

    assert run.main(["soak", "--quick", "--out", str(tmp_path), "--set", f"run.root={tmp_path / 'runs'}"]) == 0
    # The run ended through the driver's on_step hook and stopped its roles: no Ray cluster (and no actor
    # holding CPUs) is left in this process for the next test.
    assert not ray.is_initialized()
    files = sorted(tmp_path.glob("soak-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    common.validate_result(doc)
    assert doc["config"]["quick"] is True and files[0].with_suffix(".png").is_file()
    for role in ("driver", "learner", "worker"):
        sm = doc["metrics"][f"rss_slope_mb_per_min/{role}"]
        assert math.isfinite(sm["median"])
    assert sorted(doc["extra"]["pids"]) == ["driver", "learner", "worker0", "worker1"]  # smoke: two workers
    assert len(set(doc["extra"]["pids"].values())) == 4  # four distinct processes sampled
    # the window opened at the last RL stage's first step, after the earlier stages' samples
    assert doc["extra"]["rl_stage"] == 2 and doc["extra"]["window_t0_s"] > 0  # smoke: sft, rl, rl
