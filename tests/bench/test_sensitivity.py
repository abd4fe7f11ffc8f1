"""``sonar bench sensitivity``: the one-at-a-time grid (pure) and its ``--quick`` run (slow: it runs
sync and async lag 2 once each through the driver)."""
from __future__ import annotations

import json
import math

import pytest

from sonar.bench import common, run, sensitivity as S


def test_points_move_one_knob_at_a_time_from_the_base():
    axes = {"learner_delay_ms": [0, 250], "decode_sigma": [0.7, 1.2], "groups_per_step": [8, 4]}
    pts = dict(S.points(axes))
    base = ["sim.learner_delay_ms=0", "sim.decode_sigma=0.7", "learner.groups_per_step=8",
            "replay.capacity_groups=16"]
    assert list(pts) == ["base", "learner_delay_ms=250", "decode_sigma=1.2", "groups_per_step=4"]
    assert pts["base"] == base
    assert pts["learner_delay_ms=250"] == ["sim.learner_delay_ms=250"] + base[1:]
    assert pts["decode_sigma=1.2"] == [base[0], "sim.decode_sigma=1.2"] + base[2:]
    assert pts["groups_per_step=4"] == base[:2] + ["learner.groups_per_step=4", "replay.capacity_groups=8"]
    with pytest.raises(ValueError, match="unknown axis 'tail'"):
        S.points({"tail": [1, 2]})


def test_learner_share_counts_the_simulated_delay():
    m = {"train_s_per_step": 0.5, "sync_s_per_step": 0.1, "seconds_per_step": 2.0}
    assert S.learner_share(m, 0.0) == pytest.approx(0.3)
    assert S.learner_share(m, 400.0) == pytest.approx(0.5)


def test_registered_as_a_benchmark():
    assert run.find_module("sensitivity") == "sonar.bench.sensitivity"


@pytest.mark.slow
@pytest.mark.ray
def test_sensitivity_quick(tmp_path, shared_ray):
    assert run.main(["sensitivity", "--quick", "--out", str(tmp_path), "--allow-dirty",
                     "--set", f"run.root={tmp_path / 'runs'}"]) == 0
    files = sorted(tmp_path.glob("sensitivity-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    common.validate_result(doc)
    assert doc["config"]["cost_model"]["decode_cost"] == "gpu_7b" and doc["extra"]["cost_model"]["t0_ms"] > 0
    sp = doc["metrics"]["speedup"]
    assert set(sp) == {"base"}  # --quick: the base point, with the knob at 200 ms
    assert all(math.isfinite(v["median"]) and v["median"] > 0 for v in sp.values())
    (row,) = doc["extra"]["points"]["base"]
    assert row["overrides"] == ["sim.learner_delay_ms=200"]
    # the simulated 200 ms per step is counted in the sync learner share (learner_share), which is a fraction
    assert 0.0 < row["sync_learner_share"] <= 1.0 + 1e-9
