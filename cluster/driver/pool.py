"""The elastic rollout pool: between ``rollout.min_workers`` and ``rollout.max_workers`` workers.

``PoolController`` is pure (no Ray; its clock is an argument, so tests drive it with a fake one). At
every learner-step boundary the driver hands it the learner's wait (``learner/wait_s``) and the
replay's depth; once a window of ``rollout.pool_window_s`` seconds (and ``rollout.pool_cooldown_s``
after the last resize) has passed it answers:

- +1 (grow) when the learner waited for groups more than ``rollout.pool_grow_wait_share`` of the
  window's wall time: the rollout side is the bottleneck;
- -1 (shrink) when the replay was full at more than ``rollout.pool_shrink_full_share`` of the window's
  steps: the workers produce faster than the learner trains. "Full" is judged right after the learner
  took its batch: depth >= capacity - groups_per_step (producers blocked on backpressure refill it at
  once);
- 0 otherwise, or at a bound. Growing wins when both hold.

``Pool`` has the decisions carried out by the workers' owner (``rollout_pool.RolloutPool``, the only
code that calls a worker). It asks the autoscaler for the bundles of the
target pool first (``ray.autoscaler.sdk.request_resources``: the learner's, one per worker and the
retrieval replicas'), so a cluster launcher adds nodes before the worker asks for them; a new worker is
started without waiting and joins at the first step boundary after it is ready (or is given up after
``cluster.step_timeout_s``).

The weight-broadcast group has a fixed world size (every rank joins at creation; a gloo/NCCL broadcast
with a missing rank hangs), so the pool re-forms it at the step boundary where its membership changes,
as a worker restart does (``RolloutPool.regroup``): the replay is closed and every rollout loop stopped
(no new claims; the groups in flight finish and are put, or, if the queue is full, their claims are
requeued: ``ReplayQueue.put`` on a closed queue), the worker joins or leaves, the group is rebuilt with
the current members and the current weights pushed, and the loops start again. A removed worker is the
highest-numbered one (worker ids stay 0..n-1); its outstanding claims are released to the front of the
prompt cursor before it is killed. So the replay's accounting stays exact (produced = trained + dropped
stale + requeued + queued) and no prompt is trained twice (a put is accepted only against an outstanding
claim).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from sonar.cluster.driver.demands import role_demands
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config, pool_bounds

log = logging.getLogger("sonar")


@dataclass
class _Obs:
    t: float
    dt: float
    wait_s: float
    full: bool


class PoolController:
    """Pure pool decisions (module docstring). ``now``: the caller's clock reading at construction."""

    def __init__(self, min_workers: int, max_workers: int, size: int, *, window_s: float, grow_wait_share: float,
                 shrink_full_share: float, cooldown_s: float, now: float):
        if not 1 <= min_workers <= size <= max_workers:
            raise ValueError(f"pool: need 1 <= min_workers={min_workers} <= size={size} <= max_workers={max_workers}")
        self.min, self.max, self.size = min_workers, max_workers, size
        self.window_s, self.cooldown_s = window_s, cooldown_s
        self.grow_share, self.shrink_share = grow_wait_share, shrink_full_share
        self._obs: deque[_Obs] = deque()
        self._since = self._last = now

    def observe(self, now: float, wait_s: float, full: bool) -> None:
        """One learner step (or one empty wait) ended at ``now``: it waited ``wait_s`` for groups; the
        replay was ``full`` after it."""
        self._obs.append(_Obs(now, max(0.0, now - self._last), max(0.0, wait_s), bool(full)))
        self._last = now
        while self._obs and self._obs[0].t < now - self.window_s:
            self._obs.popleft()

    def shares(self) -> tuple[float, float]:
        """(learner wait share of the window's wall time, share of its steps with the replay full)."""
        if not self._obs:
            return 0.0, 0.0
        wall = sum(o.dt for o in self._obs)
        wait = min(1.0, sum(o.wait_s for o in self._obs) / wall) if wall > 0 else 0.0
        return wait, sum(o.full for o in self._obs) / len(self._obs)

    def decide(self, now: float) -> int:
        """+1, -1 or 0 (module docstring). A window must have passed since the last resize."""
        if now - self._since < max(self.window_s, self.cooldown_s) or not self._obs:
            return 0
        wait, full = self.shares()
        if wait > self.grow_share and self.size < self.max:
            return 1
        if full > self.shrink_share and wait <= self.grow_share and self.size > self.min:
            return -1
        return 0

    def resized(self, size: int, now: float) -> None:
        """The pool now has ``size`` workers: the window starts again."""
        self.size = size
        self._obs.clear()
        self._since = self._last = now


def wanted_bundles(cfg: Config, workers: int) -> list[dict]:
    """The resource bundles of the roles with ``workers`` rollout workers: one per learner rank, one per
    worker, one per retrieval replica (what ``request_resources`` is asked for; zero amounts left out).
    The amounts are the ones the roles are started with (``demands.role_demands``)."""
    return role_demands(cfg, workers).flat()


@dataclass
class Pool:
    """The elastic pool of one RL stage (module docstring): the decisions; ``rollout_pool.RolloutPool``
    carries them out (``step``'s ``rollout``: anything with its ``workers``, ``add_candidate``,
    ``candidate``, ``drop_candidate``, ``admit_candidate`` and ``shrink``). Fixed (min == max): it only
    logs the pool size. ``clock``: seconds, monotonic (tests may pass a fake one)."""

    cfg: Config
    size: int
    clock: object = time.monotonic
    resizes: int = 0
    history: list = field(default_factory=list)
    """(seconds since the pool started, pool size) at start and after every resize."""

    def __post_init__(self):
        lo, hi = pool_bounds(self.cfg)
        r = self.cfg.rollout
        self.elastic = lo < hi
        self.t0 = self.clock()
        self.ctl = PoolController(lo, hi, self.size, window_s=r.pool_window_s, grow_wait_share=r.pool_grow_wait_share,
                                  shrink_full_share=r.pool_shrink_full_share, cooldown_s=r.pool_cooldown_s,
                                  now=self.t0)
        self.target = self.size
        self._pending = None  # (worker index, started at) of the candidate being started
        self.history.append((0.0, self.size))

    def full(self, depth: int) -> bool:
        """The replay counts as full right after the learner's take (module docstring)."""
        return depth >= max(1, self.cfg.replay.capacity_groups - self.cfg.learner.groups_per_step)

    def observe(self, wait_s: float, depth: int) -> None:
        self.ctl.observe(self.clock(), wait_s, self.full(depth))

    def step(self, rollout, wait_s: float, depth: int) -> dict:
        """A trained learner step: observe it, carry out a decision on ``rollout``, return the pool's metrics."""
        self.observe(wait_s, depth)
        if self.elastic:
            self._join_pending(rollout)
            if self._pending is None:
                delta = self.ctl.decide(self.clock())
                if delta > 0:
                    self._grow(rollout)
                elif delta < 0:
                    self._shrink(rollout)
        wait, full = self.ctl.shares()
        return {K.ROLLOUT_POOL_SIZE: float(len(rollout.workers)), K.ROLLOUT_POOL_TARGET: float(self.target),
                K.ROLLOUT_POOL_WAIT_SHARE: wait, K.ROLLOUT_POOL_FULL_SHARE: full,
                K.ROLLOUT_POOL_RESIZES: float(self.resizes)}

    # ------------------------------------------------------------------ Ray side
    def _request(self, workers: int) -> None:
        """Ask the autoscaler for the target's bundles (a hint; a cluster without one ignores it)."""
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=wanted_bundles(self.cfg, workers))
        except Exception as e:  # noqa: BLE001 - a hint only: never fail the run over it
            log.warning("request_resources for %d workers failed: %s", workers, e)

    def _grow(self, rollout) -> None:
        self.target = len(rollout.workers) + 1
        self._request(self.target)
        i = rollout.add_candidate()
        self._pending = (i, self.clock())
        log.info("pool: starting rollout worker %d (learner wait share %.2f)", i, self.ctl.shares()[0])
        self._join_pending(rollout)

    def _join_pending(self, rollout) -> None:
        """A started worker joins once it is ready (checked without waiting), or is given up."""
        if self._pending is None:
            return
        i, t = self._pending
        state = rollout.candidate()
        if state is None:
            if self.clock() - t > self.cfg.cluster.step_timeout_s:
                log.warning("pool: worker %d not ready after cluster.step_timeout_s=%ss (no resources?): given up",
                            i, self.cfg.cluster.step_timeout_s)
                rollout.drop_candidate()
                self._gave_up(rollout)
            return
        if state:  # it failed to start: dropped, not added
            log.warning("pool: worker %d failed to start: %s", i, state)
            self._gave_up(rollout)
            return
        self._pending = None
        rollout.admit_candidate()
        self._resized(rollout)

    def _gave_up(self, rollout) -> None:
        self._pending, self.target = None, len(rollout.workers)
        self._request(self.target)
        self.ctl.resized(len(rollout.workers), self.clock())

    def _shrink(self, rollout) -> None:
        i = len(rollout.workers) - 1
        self.target = i
        log.info("pool: draining rollout worker %d (replay full share %.2f)", i, self.ctl.shares()[1])
        rollout.shrink()
        self._request(self.target)
        self._resized(rollout)

    def _resized(self, rollout) -> None:
        self.resizes += 1
        self.ctl.resized(len(rollout.workers), self.clock())
        self.history.append((round(self.clock() - self.t0, 2), len(rollout.workers)))
        log.info("pool: %d rollout workers", len(rollout.workers))

    def close(self, rollout) -> None:
        """Stage end: a worker still starting is dropped."""
        if self._pending is not None:
            rollout.drop_candidate()
            self._pending = None
