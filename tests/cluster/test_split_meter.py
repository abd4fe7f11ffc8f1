"""Each side's measured idle share and the split that would balance them (issue 52: "the split between
rollout and learner GPUs reported from measured idle time per pool"). Pure: a fake clock, no Ray."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from sonar.cluster.driver.reports import SplitMeter, balanced_rollout_share, split_meter
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import load_config


def test_balanced_share_gives_each_side_devices_in_proportion_to_its_work():
    # 6 rollout GPUs busy 50 %, 2 learner GPUs busy 100 %: work 3 and 2 device-seconds per second
    assert balanced_rollout_share(0.5, 6, 1.0, 2) == pytest.approx(3 / 5)
    # balanced already: the present share comes back
    assert balanced_rollout_share(1.0, 6, 1.0, 2) == pytest.approx(6 / 8)
    assert balanced_rollout_share(0.0, 4, 0.0, 4) is None
    assert balanced_rollout_share(0.0, 4, 0.3, 4) == 0.0


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_split_meter_measures_idle_shares_between_steps():
    clock = Clock()
    meter = SplitMeter(per_worker=1.0, learner=2.0, clock=clock)
    assert meter.tick({K.ROLLOUT_BUSY_S: 0.0}, workers=4) == {}  # the first step only starts the window
    clock.t = 10.0
    # 4 workers busy 30 s of 40; the learner trained 6 s and pushed 1 s of the 10
    out = meter.tick({K.ROLLOUT_BUSY_S: 30.0, K.LEARNER_STEP_TIME: 6.0, K.WEIGHTS_SYNC_S: 1.0}, workers=4)
    assert out[K.ROLLOUT_IDLE_SHARE] == pytest.approx(0.25) and out[K.LEARNER_IDLE_SHARE] == pytest.approx(0.3)
    assert out[K.ROLLOUT_DEVICE_SHARE] == pytest.approx(4 / 6)
    assert out[K.ROLLOUT_BALANCED_SHARE] == pytest.approx(0.75 * 4 / (0.75 * 4 + 0.7 * 2))
    clock.t = 20.0  # a worker was replaced: its count restarted below the last sum; never a negative busy time
    out = meter.tick({K.ROLLOUT_BUSY_S: 5.0, K.LEARNER_STEP_TIME: 10.0}, workers=4)
    assert out[K.ROLLOUT_IDLE_SHARE] == 1.0 and out[K.LEARNER_IDLE_SHARE] == 0.0


def test_no_split_meter_in_colocated_placement():
    assert split_meter(load_config([], [])) is not None
    assert split_meter(load_config([], ["cluster.mode=sync", "cluster.placement=colocated"])) is None


def test_a_worker_counts_the_seconds_with_a_request_in_flight(monkeypatch):
    from sonar.actors import worker as W

    now = [100.0]
    monkeypatch.setattr(W.time, "monotonic", lambda: now[0])
    w = SimpleNamespace(_lock=threading.Lock(), _stats={"busy_s": 0.0}, _working=0, _busy_since=0.0)
    work = W.RolloutWorker._work
    work(w, +1)  # lane 1 starts at 100
    now[0] = 102.0
    work(w, +1)  # lane 2 starts at 102: still one busy period
    now[0] = 105.0
    work(w, -1)
    assert w._stats["busy_s"] == 0.0  # lane 2 still in flight
    now[0] = 107.0
    work(w, -1)
    assert w._stats["busy_s"] == 7.0
    now[0] = 200.0  # idle from 107 to 200: not busy
    work(w, +1)
    now[0] = 203.0
    work(w, -1)
    assert w._stats["busy_s"] == 10.0
