"""The replay queue between rollout workers and the learner, and the prompt cursor.

``ReplayCore`` is pure (no Ray) and holds the invariants; ``ReplayQueue`` is the thin async Ray
actor around it that adds waiting (backpressure for producers, batching for the consumer).

Units: the queue holds whole GRPO *groups* (one msgpack message each); accounting counts
*trajectories*. The invariant, checked by ``balance()`` and by the end-to-end test:

    produced == consumed + dropped_stale + requeued + queued

(requeued: trajectories of groups still queued when a stage ends; their prompts go back to the cursor.)

Policy lag of a group = learner version when it is handed out - the oldest policy version that
sampled any of its tokens. Groups with lag > max_policy_lag are dropped (and counted) under the
``drop`` policy; under ``downweight`` they are handed out and the learner weights them.

Admission (async runs, ``max_inflight_groups`` > 0): a claim is granted only while the groups claimed
and not yet put plus the groups queued stay within the budget, by default (max_policy_lag + 1) x
groups_per_step (AReaL's staleness-aware rule): workers may start prompts for future learner steps,
but not so many that they would be stale before they are trained. ``ReplayQueue.claim`` waits up to
``wait_s`` for room and otherwise returns [] (the worker retries).

Version-aware admission (``groups_per_step`` = B > 0 and the claim names the policy version w the
worker holds): a group sampled from w is fresh for the learner's takes at versions <= w + L. With the
learner at version u, having handed out h groups at u, that leaves

    slots(w) = (w + L + 1 - u) * B - h

groups the learner will take before the new group goes stale, and the claim must fit in them
(pipeline + n <= slots(w)). The flat budget alone admits B groups at the moment the learner takes,
while the workers still hold the previous weights: those groups start one version behind and need
to be taken within L steps behind L*B groups already in flight, so under any spread of completion
times many go stale (measured: ~30 % of generated trajectories at L = 1 and 2, simulated 7B decode
costs). Hand-out is oldest policy version first (FIFO among equals), so a late group is trained
while it is still fresh instead of behind newer ones.

A claim refused for its version waits in the queue like any other (registered, so least loaded first
still orders the claims once it lifts) until newer weights reach the workers: the rollout pool tells the
queue after every push (``set_engine_version``: every worker's engine holds that version at least), and a
claim's version is read as at least that one. Returning at once instead, so the worker asked again with
its new weights, made the claims race when the block lifted: whichever worker polled first took the slots
while other engines idled (about half the throughput on an ASearcher-shaped job at its default batch:
bench README, schedule-sim's ablation, "version-blocked claims return").

Scheduling (async runs with a budget; every decision here is pure, so ``bench/sim/scheduler_sim.py``
drives this same code with simulated engines and learner):

- *Engine capacity and a fair share.* A worker's engine may hold at most ``worker_capacity`` groups (the
  groups it decodes at once: ``rollout.max_batch_rows // rollout.group_size``; AReaL's
  ``max_concurrent_rollouts`` per engine), counted in the rows *on* the engine: a trajectory waiting on
  a search or another tool, or finished while its group's others run, holds no engine row (vLLM frees a
  finished request's slot; the next turn is a new request), so the worker reports those rows with each
  claim and put (``set_off_engine``) and the claimed groups' rows less them must fit. Counting every
  claimed group instead left about half the rows empty on a Search-R1-shaped workload (bench README,
  schedule-sim ablation). With the pool's size known (``set_workers``), a worker also holds at
  most its share of the budget in claimed groups, ``ceil(budget / workers)``: the workers that start
  first cannot take the whole budget while a later one idles (measured: 3 of 4 workers held all 24
  groups of a lag-2 budget).
- *Least loaded first.* While several workers wait for room, a claim is granted to the one whose engine
  holds the fewest groups (veRL's ``AsyncLLMServerManager`` sends each request to the least-loaded
  server): claims balance over the engines instead of racing (a race split one run's 32 trajectories
  [32, 0, 0, 0]).
- *Just in time* (``replay.just_in_time``). When the learner is the bottleneck, filling the pipeline to
  the staleness bound buys nothing: the groups only age in the queue. With ``gen_s`` (measured seconds
  from a claim to its group's put) and ``take_s`` (measured seconds between the learner's takes), a claim
  whose last group sits at pipeline position ``p`` (groups claimed or queued before it, plus its own) is
  taken at the ``k = ceil(p / B)``-th take from the last one, so it waits until

      now >= last_take + (k - 1) * take_s - gen_s

  (it is done no earlier than the take before the one that trains it). In a rollout-bound run every
  position up to the engines' capacity passes at once (Little's law: positions <= gen_s / take_s * B),
  so it throttles only the learner-bound side. Before the first measured take it admits as before.

- *Only what the stage trains.* With the stage's demand set (``set_stage_demand``: its remaining steps x B
  groups), no claim starts a group beyond what the stage's learner steps will take (groups handed out
  this stage + claimed + queued): at the stage's end nothing is left generating only to be requeued, and
  the stage-end drain does not wait for such work. A group dropped as stale leaves room for another, and
  a claim is granted as many prompts as are still needed (``grant_size``), fewer than it asked for if
  need be: a request of 2 must not wait for room for 2 when the learner's last step lacks 1 group (it
  would wait forever: the queue never empties while the learner waits for that group).

Retrieval outages (issue: a long outage trained the policy away from searching). A group with a search
that failed for infrastructure reasons is requeued, not trained (``ReplayQueue.requeue``); the groups
that still reach the queue then are the ones that never searched, and training on them alone teaches
the policy not to search. So the first such requeue starts an *outage*: the learner's takes hand out
nothing (it pauses; its wait is bounded by ``cluster.step_timeout_s`` like any other, and the driver logs
the pause and its cause), and a group put without a successful search is requeued too (counted in
``requeued_outage``) instead of queued behind the pause. The first group put with a successful search
ends the outage (its seconds go to ``outage_s``), before it waits for room, so a full queue cannot keep
the outage from ending. Groups queued before the outage stay and are trained after it.

Prompts: workers claim prompt indices from a seeded epoch permutation. A claim is released when its
group is put; the claims of a dead worker are requeued at the front, so no prompt is lost. A put is
accepted only against an outstanding claim (one claim admits one group), so a put that outlived its
dead worker cannot train a requeued prompt a second time.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np


def policy_lag(learner_version: int, min_version: int) -> int:
    """Learner versions between the oldest policy that sampled a group and the learner (>= 0).

    ``min_version < 0``: no MODEL token (``protocol.group_min_version``), nothing to correct: lag 0.
    A group sampled by a policy newer than the learner is a protocol error (the learner makes every
    version, so a worker can never hold a newer one)."""
    if min_version < 0:
        return 0
    if min_version > learner_version:
        raise ValueError(f"min_version={min_version} > learner_version={learner_version}: a group cannot be "
                         "sampled by a policy newer than the learner")
    return int(learner_version - min_version)


@dataclass
class QueuedGroup:
    payload: bytes
    min_version: int
    num_trajs: int
    prompt_index: int
    worker_id: int


class PromptCursor:
    """Seeded epoch permutations over ``num_prompts`` indices, with a front requeue list."""

    def __init__(self, num_prompts: int, seed: int):
        if num_prompts <= 0:
            raise ValueError(f"num_prompts={num_prompts}: the training set is empty")
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch, self.pos = 0, 0
        self.requeued: deque[int] = deque()
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and self.requeued:
            out.append(self.requeued.popleft())
        while len(out) < n:
            if self.pos >= self.num_prompts:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            out.append(int(self._perm[self.pos]))
            self.pos += 1
        return out

    def requeue(self, indices: list[int]) -> None:
        self.requeued.extendleft(reversed(indices))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "requeued": list(self.requeued),
                "num_prompts": self.num_prompts, "seed": self.seed}

    def load_state_dict(self, s: dict) -> None:
        if s["num_prompts"] != self.num_prompts or s["seed"] != self.seed:
            raise ValueError(f"prompt cursor state is for num_prompts={s['num_prompts']}, seed={s['seed']}; "
                             f"this run has num_prompts={self.num_prompts}, seed={self.seed}")
        self.epoch, self.pos = s["epoch"], s["pos"]
        self.requeued = deque(s["requeued"])
        self._perm = self._permutation(self.epoch)


class JustInTime:
    """Estimates behind just-in-time admission (module doc): exponentially weighted means of the seconds
    from a claim to its group's put (``gen_s``) and of the seconds between the learner's whole-batch takes
    (``take_s``), and the time of the last take. Pure: the caller passes every clock reading (seconds,
    any monotonic origin), so a simulator drives it on its own clock."""

    ALPHA = 0.3
    """Weight of the newest observation: about the last 3 takes count, so a change of regime (the learner
    or the engines slowing down) is followed within a few steps."""

    def __init__(self):
        self.gen_s: float | None = None
        self.take_s: float | None = None
        self.last_take: float | None = None

    def _mean(self, old: float | None, x: float) -> float:
        return x if old is None else (1 - self.ALPHA) * old + self.ALPHA * x

    def observe_put(self, seconds: float) -> None:
        self.gen_s = self._mean(self.gen_s, max(0.0, seconds))

    def observe_take(self, now: float) -> None:
        if self.last_take is not None:
            self.take_s = self._mean(self.take_s, max(0.0, now - self.last_take))
        self.last_take = now

    def reset_takes(self) -> None:
        """A stage starts: the gap since the last stage's take (evaluation, a checkpoint) is no take interval."""
        self.take_s, self.last_take = None, None

    def earliest(self, position: int, per_take: int) -> float | None:
        """When a claim whose last group sits at pipeline ``position`` (>= 1) should start, with the
        learner taking ``per_take`` groups at a time; None before the estimates exist."""
        if self.gen_s is None or self.take_s is None or self.last_take is None or per_take <= 0:
            return None
        k = math.ceil(max(1, position) / per_take)
        return self.last_take + (k - 1) * self.take_s - self.gen_s


LASTING = frozenset({"stage", "version", "budget", "jit"})
"""Refusals (``ReplayCore.pool_refusal``) that another claim granted at the same clock reading cannot lift: a
claim only adds to the pipeline, and the pipeline plus what the next claim is granted (``grant_size``: the
stage's need caps it, and that need shrinks by as much as the pipeline grows) never falls, so the budget,
the fresh slots and the just-in-time position stay passed. A scheduler granting several claims in one
instant may keep such a verdict until a put, a take, a push or the clock moves it. A worker's own refusal
is not one: a smaller grant may fit an engine that a larger one did not."""


class ReplayCore:
    def __init__(self, capacity_groups: int, max_policy_lag: int, stale_policy: str,
                 num_prompts: int, seed: int, max_inflight_groups: int = 0, groups_per_step: int = 0,
                 worker_capacity: int = 0, just_in_time: bool = False, group_rows: int = 1):
        if max_inflight_groups < 0:
            raise ValueError(f"max_inflight_groups={max_inflight_groups} must be >= 0 (0: unlimited)")
        if groups_per_step < 0:
            raise ValueError(f"groups_per_step={groups_per_step} must be >= 0 (0: no version-aware admission)")
        if worker_capacity < 0:
            raise ValueError(f"worker_capacity={worker_capacity} must be >= 0 (0: no per-worker bound)")
        if just_in_time and groups_per_step <= 0:
            raise ValueError("just_in_time admission needs groups_per_step > 0 (the learner's take)")
        self.max_inflight = max_inflight_groups
        self.groups_per_step = groups_per_step
        if group_rows < 1:
            raise ValueError(f"group_rows={group_rows} must be >= 1 (trajectories per group)")
        self.worker_capacity = worker_capacity
        self.group_rows = group_rows
        self.off_engine: dict[int, int] = {}
        """Rows (trajectories) of each worker's claimed groups off its engine (waiting on a tool, or done
        while their group's others run), as it last reported them (``set_off_engine``)."""
        self.jit = JustInTime() if just_in_time else None
        self.waiting: dict[int, int] = {}
        """Claim calls waiting for room, per worker (``ReplayQueue.claim`` registers them): least loaded first."""
        self._claimed_at: dict[tuple[int, int], float] = {}  # (worker, prompt) -> clock at its claim
        self.workers = 0
        """Rollout workers in the pool (0: unknown); with a budget, each holds at most its share of it."""
        self.stage_demand: int | None = None
        """Groups the current stage's remaining learner steps take (None: no bound)."""
        self._stage_base = 0  # consumed_groups when the demand was set
        self.handed_at_version = 0
        """Groups handed to the learner at ``learner_version`` (its current step's batch so far)."""
        if stale_policy not in ("drop", "downweight"):
            raise ValueError(f"replay.stale_policy={stale_policy!r} is not 'drop' or 'downweight'")
        self.capacity = capacity_groups
        self.max_lag = max_policy_lag
        self.stale_policy = stale_policy
        self.groups: deque[QueuedGroup] = deque()
        self.cursor = PromptCursor(num_prompts, seed)
        self.claims: dict[int, list[int]] = {}
        self._claimed = 0  # sum of len(v) for v in claims.values(), kept as they change: admission asks
        # inflight() for every claim, and summing over 1,000 engines' claims each time dominated the DES
        self.learner_version = 0
        self.engine_version = -1
        """The policy version every worker's engine holds at least (``set_engine_version``; -1: unknown)."""
        self.counts = {"produced": 0, "consumed": 0, "dropped_stale": 0, "requeued": 0, "requeued_prompts": 0,
                       "produced_groups": 0, "consumed_groups": 0, "dropped_groups": 0}
        self.dropped_prompts: list[int] = []
        """Prompt indices of groups dropped as stale since the last ``get`` (handed to the learner's log)."""
        self.outage: dict | None = None
        """The retrieval outage in progress (module doc): ``{"since": clock, "failed": groups requeued for
        failed searches}``, or None."""

    # -- prompts
    def set_num_prompts(self, num_prompts: int) -> bool:
        """A stage with another question set (``stages.N.data``): a fresh cursor over ``num_prompts``
        indices (same seed), its requeued indices dropped (they index the previous set). Same count:
        the cursor continues (stages that share the world's questions walk one permutation). Only
        between stages: claims and queued groups must be gone. Returns whether the cursor was replaced."""
        if num_prompts == self.cursor.num_prompts:
            return False
        if self.groups or any(self.claims.values()):
            raise ValueError(f"set_num_prompts({num_prompts}) with {len(self.groups)} queued groups and "
                             f"{sum(len(v) for v in self.claims.values())} claimed prompts: only between stages")
        self.cursor = PromptCursor(num_prompts, self.cursor.seed)
        return True

    def inflight(self) -> int:
        """Groups in the pipeline: claimed and not yet put, plus queued."""
        return self._claimed + len(self.groups)

    def fresh_slots(self, version: int) -> int | None:
        """Groups the learner will still take before a group sampled from policy ``version`` goes
        stale (``slots(w)`` in the module doc); None when admission is not version-aware."""
        if self.groups_per_step <= 0 or version < 0:
            return None
        return (version + self.max_lag + 1 - self.learner_version) * self.groups_per_step - self.handed_at_version

    def set_stage_demand(self, groups: int | None) -> None:
        """The stage's learner steps from here will take ``groups`` groups (None: unbounded)."""
        if groups is not None and groups < 0:
            raise ValueError(f"stage demand {groups} must be >= 0 groups")
        self.stage_demand, self._stage_base = groups, self.counts["consumed_groups"]

    def stage_left(self) -> int | None:
        """Groups the stage will still take and nothing claimed or queued covers yet (None: unbounded)."""
        if self.stage_demand is None:
            return None
        return self.stage_demand - (self.counts["consumed_groups"] - self._stage_base) - self.inflight()

    def grant_size(self, n: int) -> int:
        """Prompts a claim of ``n`` is granted: ``n``, or what the stage still needs if less (module doc)."""
        left = self.stage_left()
        return n if left is None else max(0, min(n, left))

    def load(self, worker_id: int) -> int:
        """Groups ``worker_id`` has claimed and not yet put."""
        return len(self.claims.get(worker_id, ()))

    def set_workers(self, n: int) -> None:
        """The pool has ``n`` rollout workers (the driver tells it at a stage's start and every change)."""
        if n < 0:
            raise ValueError(f"workers={n} must be >= 0 (0: unknown)")
        self.workers = n

    def set_engine_version(self, version: int) -> None:
        """Every worker's engine now holds policy ``version`` at least (the pool's push reached them all)."""
        self.engine_version = max(self.engine_version, version)

    def claim_version(self, version: int) -> int:
        """The policy version a claim made with ``version`` samples from at least (-1 stays unknown: a claim
        that names no version is admitted on the flat budget alone)."""
        return version if version < 0 else max(version, self.engine_version)

    def set_off_engine(self, worker_id: int, rows: int) -> None:
        """``worker_id`` has ``rows`` trajectories of its claimed groups off its engine (module doc)."""
        if rows < 0:
            raise ValueError(f"off-engine rows={rows} must be >= 0")
        self.off_engine[worker_id] = rows

    def engine_load(self, worker_id: int) -> float:
        """Groups' worth of rows on ``worker_id``'s engine: its claimed groups less the rows it last reported
        off the engine. The report is as old as the worker's last claim or put, so a row that went back to
        the engine since counts as off until the next one (the cap may be passed by that much: vLLM queues
        the excess), and the load never goes below zero."""
        load = self.load(worker_id)
        off = min(self.off_engine.get(worker_id, 0), load * self.group_rows)
        return load - off / self.group_rows

    def share_cap(self) -> int:
        """Claimed groups one worker may hold: its share of the budget (0: no bound, pool size unknown)."""
        return math.ceil(self.max_inflight / self.workers) if self.workers and self.max_inflight else 0

    def _fits_worker(self, worker_id: int, n: int) -> bool:
        """Within the engine's capacity (in rows on it, ``engine_load``) and the worker's share of the budget
        (in claimed groups), or the worker holds nothing (a request larger than a cap must still run
        alone, or it never would)."""
        load = self.load(worker_id)
        if load == 0:
            return True
        share, cap = self.share_cap(), self.worker_capacity
        return (share == 0 or load + n <= share) and (cap == 0 or self.engine_load(worker_id) + n <= cap)

    def defers(self, worker_id: int, n: int) -> bool:
        """Another worker waits for room with fewer groups on its engine, and its claim fits: it goes first
        (least loaded first)."""
        mine = self.engine_load(worker_id)
        return any(w != worker_id and k > 0 and self.engine_load(w) < mine and self._fits_worker(w, n)
                   for w, k in self.waiting.items())

    def may_claim(self, n: int, version: int = -1, worker_id: int | None = None, now: float | None = None) -> bool:
        """Admission: within the budget and, for a claim that names its policy ``version``, within
        the groups the learner takes while that version is fresh; or the pipeline is empty (a
        request larger than the budget must still run, or nothing ever would). A claim that names its
        ``worker_id`` must also fit that worker's engine and yield to a less-loaded waiting worker; one
        that passes the clock reading ``now`` waits for its just-in-time start (module doc)."""
        if self.max_inflight == 0:
            return True
        # The worker's own checks last: every condition is pure, so the order changes no answer, and
        # ``defers`` is a pass over the waiting workers while the pool-wide ones are O(1) (a full budget,
        # the common refusal, then costs nothing per waiting worker).
        return self.pool_refusal(n, version, now) is None and (
            worker_id is None or self.worker_refusal(worker_id, n) is None)

    def pool_refusal(self, n: int, version: int = -1, now: float | None = None) -> str | None:
        """Why ``may_claim`` refuses any worker's claim of ``n`` groups sampled from ``version`` now (None: it
        does not): ``"stage"`` (the stage's steps are covered), ``"version"`` (stale before its take),
        ``"budget"`` (the pipeline is full) or ``"jit"`` (its just-in-time start is later), each
        ``LASTING``."""
        if self.max_inflight == 0:
            return None
        n = self.grant_size(n)
        if n == 0:
            return "stage"  # more would only be requeued at the stage's end
        slots = self.fresh_slots(version)
        if slots is not None and slots <= 0:
            return "version"  # stale before any take: wait for newer weights (the next push brings them)
        inflight = self.inflight()
        if not inflight:
            return None  # an empty pipeline admits anything, or an oversized request would never run
        if inflight + n > self.max_inflight:
            return "budget"
        if slots is not None and inflight + n > slots:
            return "version"
        return "jit" if self.jit_wait_s(n, now) > 0 else None

    def worker_refusal(self, worker_id: int, n: int) -> str | None:
        """Why ``may_claim`` refuses ``worker_id``'s claim of ``n`` groups once the pool admits it (None: it
        does not): ``"engine"`` (beyond its engine's capacity or its share) or ``"defer"`` (a less-loaded
        waiting worker goes first)."""
        if self.max_inflight == 0:
            return None
        n = self.grant_size(n)
        if not self._fits_worker(worker_id, n):
            return "engine"
        return "defer" if self.defers(worker_id, n) else None

    def jit_wait_s(self, n: int, now: float | None) -> float:
        """Seconds until a claim of ``n`` groups may start just in time (0: now; module doc)."""
        if self.jit is None or now is None:
            return 0.0
        t = self.jit.earliest(self.inflight() + n, self.groups_per_step)
        return 0.0 if t is None else max(0.0, t - now)

    def claim(self, worker_id: int, n: int, now: float | None = None) -> list[int]:
        """Claim up to ``n`` prompts for ``worker_id`` (``grant_size``: fewer when the stage needs fewer)."""
        if self.max_inflight:
            n = self.grant_size(n)
        idx = self.cursor.take(n)
        self.claims.setdefault(worker_id, []).extend(idx)
        self._claimed += len(idx)
        if now is not None:
            for i in idx:
                self._claimed_at[(worker_id, i)] = now
        return idx

    def holds_claim(self, worker_id: int, prompt_index: int) -> bool:
        """Whether ``worker_id`` still holds an outstanding claim on ``prompt_index``."""
        return prompt_index in self.claims.get(worker_id, ())

    def release_worker(self, worker_id: int) -> int:
        """Requeue every outstanding claim of a dead worker; returns how many."""
        lost = self.claims.pop(worker_id, [])
        self.off_engine.pop(worker_id, None)
        self._claimed -= len(lost)
        for i in lost:
            self._claimed_at.pop((worker_id, i), None)
        self.cursor.requeue(lost)
        self.counts["requeued_prompts"] += len(lost)
        return len(lost)

    def requeue_claim(self, worker_id: int, prompt_index: int) -> None:
        claims = self.claims.get(worker_id, [])
        if prompt_index in claims:
            claims.remove(prompt_index)
            self._claimed -= 1
        self._claimed_at.pop((worker_id, prompt_index), None)
        self.cursor.requeue([prompt_index])
        self.counts["requeued_prompts"] += 1

    # -- retrieval outages (module doc)
    def search_failed(self, now: float) -> None:
        """A group's search failed for infrastructure reasons (its prompt was requeued): an outage starts,
        or goes on."""
        if self.outage is None:
            self.outage = {"since": now, "failed": 0}
            self.counts["outages"] = self.counts.get("outages", 0) + 1
        self.outage["failed"] += 1

    def search_worked(self, now: float) -> None:
        """A group was put with a successful search: the outage in progress, if any, is over."""
        if self.outage is not None:
            self.counts["outage_s"] = self.counts.get("outage_s", 0.0) + max(0.0, now - self.outage["since"])
            self.outage = None

    def outage_report(self, now: float) -> dict | None:
        """``{"seconds", "failed"}`` of the outage in progress, or None."""
        if self.outage is None:
            return None
        return {"seconds": max(0.0, now - self.outage["since"]), "failed": self.outage["failed"]}

    # -- groups
    def full(self) -> bool:
        return len(self.groups) >= self.capacity

    def add(self, g: QueuedGroup, now: float | None = None) -> None:
        """Queue a finished group, releasing its claim; ``now``: the clock reading, which times the
        group's generation from its claim (just-in-time admission's ``gen_s``)."""
        claims = self.claims.get(g.worker_id, [])
        if g.prompt_index in claims:
            claims.remove(g.prompt_index)
            self._claimed -= 1
        t0 = self._claimed_at.pop((g.worker_id, g.prompt_index), None)
        if self.jit is not None and now is not None and t0 is not None:
            self.jit.observe_put(now - t0)
        self.groups.append(g)
        self.counts["produced"] += g.num_trajs
        self.counts["produced_groups"] += 1

    def lag(self, g: QueuedGroup) -> int:
        return policy_lag(self.learner_version, g.min_version)

    def advance(self, learner_version: int) -> None:
        """The learner is at ``learner_version`` (never moves back); a new version starts a new batch."""
        if learner_version > self.learner_version:
            self.learner_version, self.handed_at_version = learner_version, 0

    def drop_stale(self) -> int:
        """Under ``drop``, drop (and count) every queued group already past ``max_lag`` at the current
        learner version: lags only grow, so it could never be trained. Returns the trajectories dropped."""
        if self.stale_policy != "drop":
            return 0
        dropped, keep = 0, deque()
        for g in self.groups:
            if self.lag(g) > self.max_lag:
                self.counts["dropped_stale"] += g.num_trajs
                self.counts["dropped_groups"] += 1
                dropped += g.num_trajs
                self.dropped_prompts.append(g.prompt_index)
            else:
                keep.append(g)
        self.groups = keep
        return dropped

    def take(self, n_groups: int, learner_version: int,
             whole: bool = False, now: float | None = None) -> tuple[list[tuple[bytes, int, int]], int]:
        """Pop up to n fresh groups, oldest policy version first (FIFO among equals); stale ones are
        dropped and counted. Returns ([(payload, lag, prompt_index)], dropped trajectories); dropped
        prompts go to ``dropped_prompts``. ``whole``: all n or none (the stale dropped either way), so a
        learner step trains exactly its configured batch, however long the groups take to arrive.
        ``now``: the clock reading; a whole batch handed out is a take just-in-time admission times."""
        self.advance(learner_version)
        out: list[tuple[bytes, int]] = []
        dropped = 0
        if self.outage is not None:
            return [], self.drop_stale() if whole else 0  # paused: the queue holds only groups that never searched
        if whole:
            dropped = self.drop_stale()
            if len(self.groups) < n_groups:
                return [], dropped
        while self.groups and len(out) < n_groups:
            oldest = min(range(len(self.groups)), key=lambda i: self.groups[i].min_version)  # first among equals
            g = self.groups[oldest]
            del self.groups[oldest]
            lag = self.lag(g)
            if lag > self.max_lag and self.stale_policy == "drop":
                self.counts["dropped_stale"] += g.num_trajs
                self.counts["dropped_groups"] += 1
                dropped += g.num_trajs
                self.dropped_prompts.append(g.prompt_index)
                continue
            self.counts["consumed"] += g.num_trajs
            self.counts["consumed_groups"] += 1
            self.handed_at_version += 1
            out.append((g.payload, lag, g.prompt_index))
        if whole and out and self.jit is not None and now is not None:
            self.jit.observe_take(now)
        return out, dropped

    def drain(self) -> int:
        """Stage end: queued groups are not trained; their prompts go back to the cursor (requeued)."""
        n = 0
        while self.groups:
            g = self.groups.popleft()
            self.cursor.requeue([g.prompt_index])
            self.counts["requeued"] += g.num_trajs
            self.counts["requeued_prompts"] += 1
            n += g.num_trajs
        return n

    def queued_trajs(self) -> int:
        return sum(g.num_trajs for g in self.groups)

    def balance(self) -> dict:
        c = dict(self.counts)
        c["queued"] = self.queued_trajs()
        c["balanced"] = c["produced"] == c["consumed"] + c["dropped_stale"] + c["requeued"] + c["queued"]
        return c

    def stats(self) -> dict:
        s = self.balance()
        s["depth_groups"] = len(self.groups)
        s["learner_version"] = self.learner_version
        s["outstanding_claims"] = sum(len(v) for v in self.claims.values())
        return s

    def state_dict(self) -> dict:
        """Checkpointed state. Queued groups are not saved: on resume their prompts are requeued,
        so nothing is lost and nothing is trained twice (they were never consumed)."""
        pending = [g.prompt_index for g in self.groups] + [i for v in self.claims.values() for i in v]
        cursor = self.cursor.state_dict()
        cursor["requeued"] = pending + cursor["requeued"]
        counts = dict(self.counts)
        return {"cursor": cursor, "counts": counts, "learner_version": self.learner_version,
                "queued_trajs": self.queued_trajs(), "requeued_on_save": pending}

    def load_state_dict(self, s: dict) -> None:
        self.cursor.load_state_dict(s["cursor"])
        self.counts = dict(s["counts"])
        # Groups queued at save time were produced but never consumed: their prompts were put back on
        # the cursor, so their trajectories count as requeued.
        self.counts["requeued"] += s["queued_trajs"]
        self.learner_version = s["learner_version"]


RECORDS_KEPT = 100_000
"""Rollout records the replay keeps for the driver's next report at most (a few hundred bytes each); older
ones are dropped and counted (``records_dropped``), so a driver that stops reading cannot fill its memory."""


class ReplayQueue:
    """Async Ray actor around ReplayCore. Create with ``ray.remote(ReplayQueue)``.

    It also carries the rollout records of the groups it accepts (``put``'s ``records``: each trajectory's
    reward, finish, searches, tokens) to the driver, which reads them with the counters in one call per
    trained step (``report``): the rollout metrics travel with the rollouts, not on the workers' health
    checks."""

    def __init__(self, capacity_groups: int, max_policy_lag: int, stale_policy: str, num_prompts: int, seed: int,
                 max_inflight_groups: int = 0, groups_per_step: int = 0, worker_capacity: int = 0,
                 just_in_time: bool = False, group_rows: int = 1):
        self.core = ReplayCore(capacity_groups, max_policy_lag, stale_policy, num_prompts, seed, max_inflight_groups,
                               groups_per_step, worker_capacity, just_in_time, group_rows)
        self._cond: asyncio.Condition | None = None
        self._closed = False
        self._records: list[dict] = []
        self._records_dropped = 0

    def _c(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def claim(self, worker_id: int, n: int, wait_s: float = 0.0, version: int = -1,
                    off_engine_rows: int | None = None) -> list[int]:
        """n prompt indices, or [] if admission refused it for ``wait_s`` seconds or the queue is closed (the
        caller retries, so a stopping worker is never stuck in here).
        ``version``: the policy version the worker samples with (-1: unknown, flat budget only); read as at
        least the pushed ``engine_version``.
        ``off_engine_rows``: its claimed trajectories off its engine now (None: not reported; module doc)."""
        cond = self._c()
        core = self.core
        deadline = time.monotonic() + wait_s
        async with cond:
            if off_engine_rows is not None:
                core.set_off_engine(worker_id, off_engine_rows)
                cond.notify_all()  # its engine may have room now: its other waiting claims re-check
            core.waiting[worker_id] = core.waiting.get(worker_id, 0) + 1  # least loaded first: others yield to it
            try:
                # Refused for its version too, it waits here (module doc): a push's ``set_engine_version``
                # wakes it with newer weights, a claim_version the worker's engine holds by then.
                while not core.may_claim(n, core.claim_version(version), worker_id, time.monotonic()) \
                        and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return []
                    # A claim held back just in time wakes when its start comes, not only on a put or take.
                    jit = core.jit_wait_s(n, time.monotonic())
                    try:
                        await asyncio.wait_for(cond.wait(), timeout=min(remaining, jit) if jit > 0 else remaining)
                    except asyncio.TimeoutError:
                        pass
                if self._closed and not core.may_claim(n, core.claim_version(version)):
                    return []
                return core.claim(worker_id, n, time.monotonic())
            finally:
                core.waiting[worker_id] -= 1
                if not core.waiting[worker_id]:
                    del core.waiting[worker_id]
                cond.notify_all()  # the loads changed (or this claim gave up): a waiting worker may now go first

    async def release_worker(self, worker_id: int) -> int:
        cond = self._c()
        async with cond:
            n = self.core.release_worker(worker_id)
            cond.notify_all()
            return n

    async def requeue(self, worker_id: int, prompt_index: int) -> None:
        """A claimed prompt whose group is not put (its searches failed for infrastructure reasons):
        back to the front of the cursor, counted in ``requeued_prompts`` and ``requeued_infra``. Its
        trajectories were never produced, so the accounting is unchanged. A retrieval outage starts or
        goes on (module doc)."""
        cond = self._c()
        async with cond:
            self.core.requeue_claim(worker_id, prompt_index)
            self.core.counts["requeued_infra"] = self.core.counts.get("requeued_infra", 0) + 1
            self.core.search_failed(time.monotonic())
            cond.notify_all()

    async def put(self, payload: bytes, min_version: int, num_trajs: int, prompt_index: int, worker_id: int,
                  searched: bool | None = None, off_engine_rows: int | None = None,
                  records: list[dict] | None = None) -> bool:
        """Waits while the queue is full (backpressure). Returns False if the queue was closed, or if a
        retrieval outage requeued the group. ``searched``: whether a search of the group succeeded (None:
        not said, the group counts as searched); during an outage a group that did not is requeued, and
        one that did ends the outage (module doc). ``off_engine_rows``: as for ``claim``, without this
        group's rows (its claim ends here). ``records``: the group's rollout records, kept for the
        driver's next ``report`` when the group is accepted."""
        cond = self._c()
        async with cond:
            if off_engine_rows is not None:
                self.core.set_off_engine(worker_id, off_engine_rows)
            if searched is not False:
                self.core.search_worked(time.monotonic())
            elif self.core.outage is not None and self.core.holds_claim(worker_id, prompt_index):
                self.core.requeue_claim(worker_id, prompt_index)
                self.core.counts["requeued_outage"] = self.core.counts.get("requeued_outage", 0) + 1
                cond.notify_all()
                return False
            while self.core.full() and not self._closed:
                await cond.wait()
            if not self.core.holds_claim(worker_id, prompt_index):
                # The claim was released while this put waited for room: its worker was declared dead
                # and the prompt requeued, so another claim now owns it. This put outlived its caller
                # (an actor keeps running a call whose caller died); adding the group would train the
                # prompt twice. Its trajectories never count as produced.
                self.core.counts["orphan_puts"] = self.core.counts.get("orphan_puts", 0) + 1
                return False
            if self._closed:
                self.core.requeue_claim(worker_id, prompt_index)  # never silently lost
                return False
            self.core.add(QueuedGroup(payload, min_version, num_trajs, prompt_index, worker_id), time.monotonic())
            self._keep(records or ())
            cond.notify_all()
            return True

    def _keep(self, records) -> None:
        self._records.extend(records)
        over = len(self._records) - RECORDS_KEPT
        if over > 0:
            del self._records[:over]
            self._records_dropped += over

    async def get(self, n_groups: int, learner_version: int, timeout_s: float) -> dict:
        """Wait for a whole batch of n fresh groups (stale ones are dropped on the way) and hand it out at
        once. On timeout hands out nothing (the groups stay queued: ``timed_out``), so the caller can check
        worker health instead of hanging, and a learner step never trains a smaller batch than configured
        because generation was slower than the timeout (a 7B turn is; measured in async-vs-sync's
        reference workload before this was so: 22 of 32 groups trained in 4 steps)."""
        cond = self._c()
        deadline = time.monotonic() + timeout_s
        got: list[tuple[bytes, int, int]] = []
        dropped = 0
        async with cond:
            while True:
                got, d = self.core.take(n_groups, learner_version, whole=True, now=time.monotonic())
                dropped += d
                if got or d:
                    cond.notify_all()  # room in the queue: a blocked put may go on
                if len(got) >= n_groups:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    break
                try:
                    await asyncio.wait_for(cond.wait(), timeout=remaining)
                except asyncio.TimeoutError:
                    pass
        dropped_prompts, self.core.dropped_prompts = self.core.dropped_prompts, []
        return {"groups": [g[0] for g in got], "lags": [g[1] for g in got], "prompts": [g[2] for g in got],
                "dropped": dropped, "dropped_prompts": dropped_prompts,
                "timed_out": len(got) < n_groups, "outage": self.core.outage_report(time.monotonic())}

    async def set_workers(self, n: int) -> None:
        """``ReplayCore.set_workers``: the rollout pool calls it at a stage's start and after every change."""
        self.core.set_workers(n)
        cond = self._c()
        async with cond:
            cond.notify_all()  # a larger share may let a waiting claim through

    async def set_stage_demand(self, groups: int | None) -> None:
        """``ReplayCore.set_stage_demand``: the driver calls it when an RL stage (or its resume) starts."""
        self.core.set_stage_demand(groups)

    async def set_learner_version(self, version: int) -> None:
        self.core.advance(version)

    async def set_engine_version(self, version: int) -> None:
        """``ReplayCore.set_engine_version``: the rollout pool calls it after every push that reached every worker."""
        self.core.set_engine_version(version)
        cond = self._c()
        async with cond:
            cond.notify_all()  # a claim refused for its version may pass with the new one

    async def stats(self) -> dict:
        return {**self.core.stats(), "outage": self.core.outage_report(time.monotonic())}

    async def report(self) -> dict:
        """``stats()`` and the rollout records of the groups accepted since the last report (drained:
        each record is reported once), with ``records_dropped`` so far (``RECORDS_KEPT``)."""
        records, self._records = self._records, []
        return {**self.core.stats(), "outage": self.core.outage_report(time.monotonic()), "records": records,
                "records_dropped": self._records_dropped}

    async def ping(self) -> dict:
        """``{"pid"}``: alive, and the process a fault test signals."""
        import os

        return {"pid": os.getpid()}

    async def state_dict(self) -> dict:
        return self.core.state_dict()

    async def load_state_dict(self, s: dict) -> None:
        self.core.load_state_dict(s)

    async def drain(self) -> int:
        cond = self._c()
        async with cond:
            n = self.core.drain()
            cond.notify_all()
            return n

    async def reopen(self) -> None:
        """A stage starts: accept claims and puts again; the take interval is measured afresh, and the
        previous stage's unreported rollout records are not this stage's metrics."""
        self._closed = False
        self._records = []
        if self.core.jit is not None:
            self.core.jit.reset_takes()

    async def set_num_prompts(self, num_prompts: int) -> bool:
        """``ReplayCore.set_num_prompts``: the driver calls it before an RL stage (and before a resume)."""
        return self.core.set_num_prompts(num_prompts)

    async def close(self) -> dict:
        """Stop accepting: waiting producers return (their prompts are requeued). Returns final stats."""
        self._closed = True
        cond = self._c()
        async with cond:
            cond.notify_all()
        return self.core.stats()
