"""The RL step's critical-path split (cluster/driver/critical_path.py): with a fake clock, each part is
the time its phase took, the learner call splits into queue wait / compute / RPC by the learner's own
metrics, the push into broadcast / engine load, and the parts sum to the step's wall time."""
from __future__ import annotations

import pytest

from sonar.cluster.driver.critical_path import CRITICAL_PARTS, StepClock
from sonar.cluster.wire import metrics as K


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, s):
        self.t += s


def _parts(m):
    return {k: v for k, v in m.items() if k != K.CRIT_WALL}


def test_phases_split_the_wall_time_exactly():
    c = FakeClock()
    sc = StepClock(clock=c)
    c.advance(0.5)  # untimed: lands in other
    with sc.phase("generate_sync"):
        c.advance(3.0)
    with sc.phase("health"):
        c.advance(0.2)
    sc.parts["waiting_calls"] += 10.0  # a call that came back waiting (the loop adds it this way)
    c.advance(10.0)
    with sc.phase("learner_call"):
        c.advance(2.0)
    with sc.phase("push"):
        c.advance(0.7)
    with sc.phase("log"):
        c.advance(0.1)
    with sc.phase("switch"):  # colocated placement: the engines' sleep and wake, the learner's offload
        c.advance(0.4)
    m = sc.finish({K.LEARNER_WAIT_S: 0.6, K.LEARNER_STEP_TIME: 1.1, K.WEIGHTS_SYNC_S: 0.25})
    assert m[K.CRIT_SWITCH] == pytest.approx(0.4)
    assert m[K.CRIT_WALL] == pytest.approx(16.9)
    assert m[K.CRIT_GENERATE_SYNC] == pytest.approx(3.0)
    assert m[K.CRIT_HEALTH] == pytest.approx(0.2)
    assert m[K.CRIT_QUEUE_WAIT] == pytest.approx(10.6)
    assert m[K.CRIT_LEARNER_COMPUTE] == pytest.approx(1.1)
    assert m[K.CRIT_LEARNER_RPC] == pytest.approx(2.0 - 0.6 - 1.1)
    assert m[K.CRIT_BROADCAST] == pytest.approx(0.25)
    assert m[K.CRIT_ENGINE_LOAD] == pytest.approx(0.45)
    assert m[K.CRIT_LOG] == pytest.approx(0.1)
    assert m[K.CRIT_OTHER] == pytest.approx(0.5)
    assert sum(_parts(m).values()) == pytest.approx(m[K.CRIT_WALL], abs=1e-12)
    assert len(_parts(m)) == len(CRITICAL_PARTS)


def test_next_step_starts_fresh_and_clamps_cross_process_clocks():
    c = FakeClock()
    sc = StepClock(clock=c)
    with sc.phase("learner_call"):
        c.advance(1.0)
    sc.finish({})
    with sc.phase("learner_call"):
        c.advance(1.0)
    # learner-side seconds measured on another process's clock can exceed the driver's call: clamped,
    # so no part is negative and the sum still equals the wall time
    m = sc.finish({K.LEARNER_WAIT_S: 0.7, K.LEARNER_STEP_TIME: 0.6, K.WEIGHTS_SYNC_S: 5.0})
    assert m[K.CRIT_WALL] == pytest.approx(1.0)
    assert m[K.CRIT_QUEUE_WAIT] == pytest.approx(0.7) and m[K.CRIT_LEARNER_COMPUTE] == pytest.approx(0.3)
    assert m[K.CRIT_LEARNER_RPC] == pytest.approx(0.0) and m[K.CRIT_BROADCAST] == 0.0
    assert min(_parts(m).values()) >= 0.0
    assert sum(_parts(m).values()) == pytest.approx(1.0)


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown phase 'train'"):
        with StepClock().phase("train"):
            pass
