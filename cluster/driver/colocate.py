"""Colocated placement's phase switch (``cluster.placement=colocated``): the learner and the engines take
turns on the devices they share.

One RL step on each device, as ``loop.run_rl_stage`` drives it (sync mode only):

    generate          the engines are awake; the learner keeps its parameters (and, unless
                      learner.offload_while_generating, its optimizer states) resident
    to_training       every engine sleeps (rollout.sleep_level: vLLM's sleep mode frees weights and KV
                      cache), then the learner's offloaded states come back
    learner step      the learner alone on the device
    to_generation     the engines wake their weights; the new weights are handed over on the device
                      (the pool's push through the hand-over, cluster/transport/handover.py); the learner
                      offloads its states; the engines wake their KV cache

The order inside ``to_generation`` keeps the peak at the hand-over below the generation phase's: the KV
cache comes back only after the learner's states left (``cluster/wire/memory.py``'s colocated rows).
A worker that dies in a switch is replaced by the pool's one fault path; its replacement starts awake,
holds the learner's weights once the group re-forms, and is put to sleep with the others at the next
switch.

Split placement: :class:`Colocation` does nothing (``active`` False), so the loop calls it unconditionally.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config


class Colocation:
    """The phase switch of one run's roles (module docstring). ``roles``: the driver's ``Roles``."""

    def __init__(self, cfg: Config, roles, get=None):
        """``get``: how an actor call's ObjectRef is waited for, ``get(ref, timeout=...)`` (None: ``ray.get``;
        a unit test passes its own to run the switch without Ray)."""
        self.cfg, self.roles = cfg, roles
        self._get = get
        self.active = cfg.cluster.placement == "colocated"
        self.switches = 0
        """Training phases entered so far (each one sleep and one wake per engine)."""

    def get(self, ref, timeout: float):
        if self._get is not None:
            return self._get(ref, timeout=timeout)
        import ray

        return ray.get(ref, timeout=timeout)

    @contextmanager
    def training(self, clock) -> Iterator[dict]:
        """The block runs with every engine asleep and the learner's states on its devices; on a normal
        exit the new weights are handed over and the engines are awake again. Yields the dict the switch's
        metrics go into (``weights/colocate/*``, ``weights/sync_s``). ``clock``: the step's
        ``StepClock`` (``switch`` and ``push`` phases). An error inside leaves the engines asleep: the run
        is failing (a dead learner restarts every role)."""
        metrics: dict = {}
        if not self.active:
            yield metrics
            return
        with clock.phase("switch"):
            metrics.update(self.to_training())
        yield metrics
        metrics.update(self.to_generation(clock))

    def to_training(self) -> dict:
        """Every engine asleep, then the learner's states back: waits for both (the learner must not
        allocate on a device an engine still holds)."""
        pool, learner, c = self.roles.pool, self.roles.learner, self.cfg.cluster
        t0 = time.monotonic()
        slept = pool.sleep(self.cfg.rollout.sleep_level)  # waits: every engine has released its device
        t1 = time.monotonic()
        self.get(learner.reload_states.remote(), timeout=c.step_timeout_s)  # waits: the states are back
        self.switches += 1
        return {K.COLOCATE_SLEEP_S: t1 - t0, K.COLOCATE_RELOAD_S: time.monotonic() - t1,
                K.COLOCATE_FREED: float(sum(bool(s.get("freed")) for s in slept))}

    def to_generation(self, clock) -> dict:
        """Weights awake, hand-over, learner offload, KV cache awake: each waited for in turn (the next
        needs the memory the previous one freed, or the weights it loaded)."""
        pool, learner, c = self.roles.pool, self.roles.learner, self.cfg.cluster
        m: dict = {}
        with clock.phase("switch"):
            t0 = time.monotonic()
            pool.wake(["weights"])  # waits: the push loads into resident weights
            wake_s = time.monotonic() - t0
        with clock.phase("push"):
            t1 = time.monotonic()
            m.update(pool.push())  # waits: every engine holds the step's weights
            m[K.COLOCATE_HANDOVER_S] = time.monotonic() - t1
        with clock.phase("switch"):
            t2 = time.monotonic()
            self.get(learner.offload_states.remote(), timeout=c.step_timeout_s)  # waits: the device is the engines'
            t3 = time.monotonic()
            pool.wake(["kv_cache"])  # waits: every engine can generate
            wake_s += time.monotonic() - t3
        m[K.COLOCATE_OFFLOAD_S] = t3 - t2
        m[K.COLOCATE_WAKE_S] = wake_s
        return m
