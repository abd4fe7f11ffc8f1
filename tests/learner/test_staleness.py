"""Staleness: lag, drop/downweight decisions, histograms."""
import numpy as np
import pytest
import torch

from sonar.cluster.wire.config import ReplayConfig
from sonar.learner.algo.staleness import apply_staleness, importance_weight_histogram, lag_histogram, staleness_decision


@pytest.mark.parametrize("lag,max_lag,policy,gamma,expect", [
    (0, 0, "drop", 0.5, (True, 1.0)),
    (2, 2, "drop", 0.5, (True, 1.0)),
    (3, 2, "drop", 0.5, (False, 0.0)),
    (2, 2, "downweight", 0.5, (True, 1.0)),
    (3, 2, "downweight", 0.5, (True, 0.5)),
    (5, 2, "downweight", 0.5, (True, 0.125)),
    (1, 0, "downweight", 0.9, (True, 0.9)),
    (4, 0, "downweight", 1.0, (True, 1.0)),
])
def test_staleness_decision_table(lag, max_lag, policy, gamma, expect):
    keep, w = staleness_decision(lag, max_lag, policy, gamma)
    assert keep == expect[0] and w == pytest.approx(expect[1])


def test_staleness_errors_name_values():
    with pytest.raises(ValueError, match="stale_policy='keep'"):
        staleness_decision(1, 0, "keep", 0.5)
    with pytest.raises(ValueError, match="stale_downweight=0.0"):
        staleness_decision(1, 0, "downweight", 0.0)
    with pytest.raises(ValueError):
        staleness_decision(-1, 0, "drop", 0.5)


def _groups(n_groups: int, size: int = 2):
    from sonar.cluster.wire.protocol import Trajectory

    return [[Trajectory(traj_id=f"g{g}-{j}", group_id=f"g{g}", prompt_id=f"p{g}", actor_id=0, segments=[])
             for j in range(size)] for g in range(n_groups)]


def test_apply_staleness_weights_or_drops_whole_groups_from_config():
    groups, lags = _groups(4), [0, 1, 2, 3]
    down = apply_staleness(groups, lags, ReplayConfig(max_policy_lag=1, stale_policy="downweight", stale_downweight=0.25))
    assert [[t.weight for t in g] for g in down] == [[1.0, 1.0], [1.0, 1.0], [0.25, 0.25], [0.0625, 0.0625]]
    drop = apply_staleness(groups, lags, ReplayConfig(max_policy_lag=1, stale_policy="drop"))
    assert [g[0].group_id for g in drop] == ["g0", "g1"] and all(t.weight == 1.0 for g in drop for t in g)
    assert all(t.weight == 1.0 for g in groups for t in g)  # the inputs are untouched
    with pytest.raises(ValueError, match="3 groups but 2 lags"):
        apply_staleness(groups[:3], [0, 1], ReplayConfig())


def test_lag_histogram():
    h = lag_histogram([0, 0, 1, 3, 4, 9], max_bins=3)
    assert h == {"0": 2, "1": 1, "2": 0, "ge3": 3}
    assert sum(h.values()) == 6
    assert lag_histogram([], 2) == {"0": 0, "1": 0, "ge2": 0}
    with pytest.raises(ValueError):
        lag_histogram([-1], 2)


def test_importance_weight_histogram():
    w = torch.tensor([[0.1, 0.5, 0.99, 1.0], [1.5, 2.0, 7.0, float("inf")]])
    h = importance_weight_histogram(w, [0.5, 1, 2])
    assert h == {"lt0.5": 1, "0.5-1": 2, "1-2": 2, "ge2": 3}
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1.0]])
    assert importance_weight_histogram(w, [0.5, 1, 2], mask) == {"lt0.5": 0, "0.5-1": 2, "1-2": 1, "ge2": 1}
    assert importance_weight_histogram(np.array([1.0, 3.0]), [2.0]) == {"lt2": 1, "ge2": 1}
    with pytest.raises(ValueError):
        importance_weight_histogram([1.0], [2.0, 1.0])
    with pytest.raises(ValueError, match="NaN"):
        importance_weight_histogram([float("nan")], [1.0])
    # keys are MLflow-safe
    import re
    assert all(re.fullmatch(r"[\w\-. /:]+", k) for k in list(h) + list(lag_histogram([1], 2)))
