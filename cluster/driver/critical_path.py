"""Where an RL step's wall-clock goes, measured on the driver's critical path (issue 11).

The workers' ``gen_s`` / ``retrieve_s`` are summed over lanes and rows and exceed the wall time; they say
how busy the rollout side was, not what the learner waited for. This splits the driver's own clock
instead: the seconds between the end of one trained step and the end of the next are cut into the
phases the driver loop runs in sequence, so the parts add up to the step's wall time exactly (``other``
is the remainder: Ray round trips outside the timed phases, bookkeeping).

- ``generate_sync_s``: sync mode only, the lockstep generation of the batch (async: 0; generation
  overlaps and reaches the critical path only as queue wait);
- ``health_s``: the workers' and retrieval replicas' health checks;
- ``queue_wait_s``: the learner blocked on the replay for a full batch (its ``learner/wait_s``, plus the
  whole of every call that came back ``waiting``): in async mode, the rollout side's cost that was
  not hidden;
- ``learner_compute_s``: the learner's step (``learner/step_time_s``: collate, forward, backward,
  optimizer);
- ``learner_rpc_s``: the rest of the learner call (decode of the groups, the Ray round trip,
  ``set_learner_version``);
- ``broadcast_s``: the learner's bucketed send (``weights/sync_s``), ``engine_load_s``: the rest of
  the driver's push (the workers receive and stage, or vLLM loads the weights);
- ``switch_s``: colocated placement only, the phase switches (engines to sleep and the learner's states
  back before the step; engines awake and the learner's states out after the hand-over);
- ``log_s``: replay/retrieval metrics, logging, checkpoint; ``other_s``: the remainder.

The clock is injectable so a test pins the arithmetic with a fake clock (``tests/cluster/test_critical_path.py``).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from sonar.cluster.wire import metrics as K

PHASES = ("generate_sync", "health", "switch", "learner_call", "waiting_calls", "push", "log")
"""The phases the driver loop times with ``StepClock.phase``."""


class StepClock:
    """Times the phases of the driver's RL loop; ``finish`` turns one trained step's phases into metrics."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.t_last = clock()
        self.parts: dict[str, float] = {p: 0.0 for p in PHASES}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.parts:
            raise ValueError(f"StepClock.phase: unknown phase {name!r}, expected one of {PHASES}")
        t = self.clock()
        try:
            yield
        finally:
            self.parts[name] += self.clock() - t

    def finish(self, metrics: dict) -> dict:
        """The breakdown of the step that just ended (its learner ``metrics`` give the wait, compute and
        broadcast seconds); starts the next step's clock. The ``learner/critical/*`` parts sum to
        ``learner/critical/wall_s``."""
        now = self.clock()
        wall = now - self.t_last
        p = self.parts
        call = p["learner_call"]
        wait = min(call, max(0.0, float(metrics.get(K.LEARNER_WAIT_S, 0.0))))
        compute = min(call - wait, max(0.0, float(metrics.get(K.LEARNER_STEP_TIME, 0.0) or 0.0)))
        broadcast = min(p["push"], max(0.0, float(metrics.get(K.WEIGHTS_SYNC_S, 0.0))))
        out = {
            K.CRIT_WALL: wall,
            K.CRIT_GENERATE_SYNC: p["generate_sync"],
            K.CRIT_HEALTH: p["health"],
            K.CRIT_QUEUE_WAIT: wait + p["waiting_calls"],
            K.CRIT_LEARNER_COMPUTE: compute,
            K.CRIT_LEARNER_RPC: call - wait - compute,
            K.CRIT_BROADCAST: broadcast,
            K.CRIT_ENGINE_LOAD: p["push"] - broadcast,
            K.CRIT_SWITCH: p["switch"],
            K.CRIT_LOG: p["log"],
        }
        out[K.CRIT_OTHER] = wall - sum(v for k, v in out.items() if k != K.CRIT_WALL)
        self.t_last = now
        self.parts = {k: 0.0 for k in PHASES}
        return out


CRITICAL_PARTS = ("generate_sync", "health", "switch", "queue_wait", "learner_compute", "learner_rpc", "broadcast",
                  "engine_load", "log", "other")
"""The parts of ``learner/critical/wall_s``, in the order the loop runs them."""
