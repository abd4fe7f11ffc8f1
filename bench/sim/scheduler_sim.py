"""A discrete-event simulator that drives Sonar's own scheduler (``ReplayCore``) with simulated engines,
retrieval and learner. BENCHMARKS ONLY.

Why: the CPU benchmarks (async-vs-sync) run the real system with slept GPU costs, so one 8-step run of a
6-GPU layout takes minutes and a 1,024-GPU layout cannot run at all. The scheduling decisions, though, are
pure (``cluster/replay/queue.py``: admission, least-loaded first, engine capacity, just-in-time starts,
version-aware slots, the whole-batch take, stale drops). This module calls exactly that code on a simulated
clock (an event heap; nothing sleeps, no Ray, no torch), so a layout of thousands of GPUs runs in seconds
and a change to ``ReplayCore`` changes what it measures.

What is simulated, and how (``Workload`` holds the figures; ``bench/sim/workloads.py`` sources them):

- **Engines**, one per rollout GPU: continuous batching of up to ``row_cap`` rows, fewer while the rows'
  current contexts would overflow ``kv_tokens`` (no preemption). A decode step of R rows with contexts
  summing to C lasts ``t(R, C)`` (``gpu_cost.Gpu7BCost``); every admitted turn is prefilled (its whole
  context, no prefix cache: ``gpu_cost.Prefill7BCost``), all turns admitted at one step boundary as one
  batch. Between changes of the row set the steps run in closed form (R fixed, C grows by R per step), so
  an engine costs events per turn, not per token. New turns join at the next step boundary.
- **Weight updates**: ``interrupt``: a new version is applied at the next step boundary and the rows in
  flight go on with it (their KV recomputed, charged as a prefill); ``pause`` (production's default): a
  staged version stops admission until the rows in flight drain, then applies. A group's ``min_version``
  is the version its worker held when it claimed it (later turns may run newer weights).
- **Trajectories** are turns: each decodes a clipped lognormal number of tokens (plus ``turn_fixed``), then
  calls a tool whose latency is drawn per call (queued on ``retrieval_servers`` servers when > 0) and whose
  returned tokens join the context; the last turn answers; a context at ``max_context`` ends the trajectory.
- **The worker** (``actors/worker.py: _aproduce``): ``lanes`` lanes per worker, each claiming
  ``groups_per_request`` groups, rolling them out and putting each group when its last trajectory ends
  (``per_group_put``; off: the claim's groups are put together when its slowest ends, the pre-change code).
- **The claim** (``ReplayQueue.claim``): a lane registers in ``core.waiting`` (least-loaded first, when on),
  asks ``may_claim(n, version, worker_id, now)`` (as its two halves, ``pool_refusal`` and ``worker_refusal``,
  so that one wake asks a version's pool-wide verdict once) and otherwise waits for a put, a take or a push (the
  queue's ``notify_all``), for the push's ``set_engine_version`` (a claim refused for its version; with
  ``version_wait`` off, the rule before, it leaves the queue and asks again after the take or push that lifts
  the block), or for its just-in-time start (``jit_wait_s``). Waiters wake in the order they started waiting; each gives up
  after ``claim_wait_s`` and asks again 0.05 s later, at the back (the production loop). A push reaches
  every engine at once, so every lane asks at one version: a wake whose pool-wide verdict refuses it
  refuses every lane, and costs nothing per lane.
- **The learner**: ``take(B, version, whole=True, now)``; a step costs ``(6 + 2 x extra forwards) x N``
  FLOP per trained token at ``mfu`` of 989.4 TFLOPS per GPU (``reference.learner_step_s``), its tokens
  each trajectory's final context (or ``learner_tokens_per_traj``); groups of ``zero_signal_share`` are
  skipped (no tokens trained). Then the weights are pushed (``push_s``) and the engines get the version.
- **Modes**: ``async`` (the split layout, replay with lag L), ``sync_split`` (the same layout in lockstep:
  generate the batch with the current weights, train, push) and ``colocated`` (every GPU generates the
  batch, then every GPU trains it, ``switch_s`` per step).

Simplified away: the driver's and Ray's per-call overheads, the CPU work of parsing and rewards, retrieval
batching (each call is one request), prefix caching, preemption and chunked prefill, a learner's
and a learner's data-parallel inefficiency at large GPU counts.

Pure module: numpy, the standard library and ``sonar.cluster.replay.queue``.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from sonar.bench.sim import gpu_cost
from sonar.bench.sim.reference import PEAK_BF16_FLOPS
from sonar.cluster.replay.queue import LASTING, QueuedGroup, ReplayCore

MODES = ("async", "sync_split", "colocated")


@dataclass(frozen=True)
class Tool:
    """One tool a turn may call: ``share`` of the calls, latency lognormal (median ``median_ms``, ``sigma``),
    ``tokens`` appended to the context."""
    name: str
    share: float
    median_ms: float
    sigma: float
    tokens: int


@dataclass(frozen=True)
class Workload:
    """The job: model, trajectory shape, hardware figures. Units: tokens, ms, seconds, bytes/s."""
    name: str
    calls_pmf: tuple[float, ...]
    """P(k tool calls in a trajectory), k = 0, 1, ...; turns = calls + 1 (+ ``extra_turn_p``)."""
    turn_median: float
    turn_sigma: float
    turn_max: int
    prompt_tokens: int
    tools: tuple[Tool, ...]
    max_context: int
    params: float = 7.25e9
    group_size: int = 8
    turn_fixed: int = 0
    """Tokens every turn decodes besides its lognormal draw."""
    extra_turn_p: float = 0.0
    """Chance of one more turn that calls no tool (an invalid turn answered by a message)."""
    keep_generated: bool = True
    """A turn's generated tokens stay in the later turns' contexts (False: the paced CPU engine's hidden tail)."""
    retrieval_servers: int = 0
    """Tool requests served at once (0: unlimited); more queue, first come first served."""
    retrieval_per_call_ms: float = 0.0
    row_cap: int = 64
    kv_tokens: float = math.inf
    """KV cache per rollout GPU in tokens: rows are admitted only while their contexts fit."""
    mfu: float = 0.40
    extra_forwards: int = 1
    """Learner forwards besides the update, 2N FLOP per token each (old-logprob recompute; +1 with a KL ref)."""
    learner_tokens_per_traj: float | None = None
    """None: each trained trajectory's final context."""
    zero_signal_share: float = 0.0
    push_s: float = 0.0
    """Seconds per weight push, split layouts (learner busy, engines get the version at its end)."""
    switch_s: float = 0.0
    """Seconds per colocated step for the switch between generating and training (hand-over included)."""
    note: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Sim:
    """One run: the layout, the mode, the scheduler's options."""
    mode: str = "async"
    rollout_gpus: int = 6
    learner_gpus: int = 2
    groups_per_step: int = 8
    versions: int = 12
    lag: int = 2
    groups_per_request: int = 2
    lanes: int = 8
    capacity_groups: int = 0
    """Replay capacity in groups (0: (lag + 1) x groups_per_step, so a put never blocks under the budget)."""
    worker_capacity: bool = True
    decoding_rows: bool = True
    """Engine capacity counts the rows on the engine (a worker reports its rows waiting on a tool with each
    claim, ``ReplayCore.set_off_engine``); False: every claimed group's rows, as before."""
    least_loaded: bool = True
    just_in_time: bool = True
    per_group_put: bool = True
    weight_update: str = "pause"
    version_wait: bool = True
    """A claim refused for its version waits in the queue for the push (``ReplayCore.set_engine_version``);
    False: it returns at once, so its worker leaves the ``waiting`` registry, and asks again after the take or
    push that lifts the block (the rule before; its 0.05 s polling left out)."""
    claim_wait_s: float = 1.0
    engine_time_scale: float = 1.0
    """Every engine second (decode and prefill) times this: 1 everywhere but the validation, which charges
    what the real run's paced engines measured (their sleeps overran the cost model on a loaded CPU:
    ``1 + overrun_s / simulated_s``), so the check is of the scheduling, not of the CPU's pacing."""
    seed: int = 0

    def pre_change(self) -> "Sim":
        """The scheduler before engine capacity, least-loaded first, just in time, per-group puts and
        version-blocked claims that wait."""
        return replace(self, worker_capacity=False, decoding_rows=False, least_loaded=False, just_in_time=False,
                       per_group_put=False, version_wait=False)


# ------------------------------------------------------------------------------------------- entities
class Traj:
    __slots__ = ("group", "plan", "tools", "turn", "ctx", "decoded", "calls", "left", "cur")

    def __init__(self, group, plan, tools, ctx):
        self.group, self.plan, self.tools, self.ctx = group, plan, tools, ctx
        self.turn, self.decoded, self.calls, self.left, self.cur = 0, 0, 0, 0, 0


class Group:
    __slots__ = ("prompt", "worker", "min_version", "trajs", "left", "zero", "claim")

    def __init__(self, prompt, worker, min_version, zero, claim):
        self.prompt, self.worker, self.min_version, self.zero, self.claim = prompt, worker, min_version, zero, claim
        self.trajs, self.left = [], 0  # left: trajectories still running (the done ones are off the engine)


class Claim:
    """One ``_aproduce`` call: the groups a lane claimed; the lane claims again once all are put."""
    __slots__ = ("groups", "worker", "lane", "unfinished", "unput")

    def __init__(self, worker, lane):
        self.groups, self.worker, self.lane, self.unfinished, self.unput = [], worker, lane, 0, 0


class Engine:
    """One rollout GPU. Rows are ``Traj`` objects decoding a turn (``left`` tokens to go, ``ctx`` so far)."""

    def __init__(self, sim: "Simulator", idx: int):
        self.sim, self.idx = sim, idx
        self.rows: list[Traj] = []
        self.ctx_sum = 0.0  # sum of the rows' contexts at the last step boundary
        self.pending: deque[Traj] = deque()
        self.version, self.staged = 0, None
        self.seg = None  # (t_start, R, C0, K, extra_ms)
        self.token = 0   # invalidates a superseded segment-end event
        self.cut_at = None
        self.kicked = False
        self.busy_s = 0.0
        self.steps = 0
        self.row_steps = 0.0
        self.ctx_row_steps = 0.0

    @property
    def next_version(self) -> int:
        return self.staged if self.staged is not None else self.version

    def _ms(self, k: float, R: int, C0: float, extra: float) -> float:
        c = self.sim.cost
        return extra + k * (c.t0_ms + c.ms_per_row * R) + c.ms_per_1k_ctx / 1000.0 * (k * C0 + R * k * (k - 1) / 2)

    def _room(self, ctx: float) -> bool:
        w = self.sim.w
        if len(self.rows) >= w.row_cap:
            return False
        return not self.rows or self.ctx_sum + ctx <= w.kv_tokens

    def submit(self, t: Traj, now: float) -> None:
        """A turn arrives: it joins at the next step boundary if a slot is free, else waits."""
        self.pending.append(t)
        if self.seg is None:
            self._kick(now)
        else:
            self._cut(now)

    def _kick(self, now: float) -> None:
        """An idle engine starts at this instant, after every turn that arrives at it (one prefill batch)."""
        if not self.kicked:
            self.kicked = True
            self.sim.at(now, self._start)

    def _start(self) -> None:
        self.kicked = False
        if self.seg is None:
            self._boundary(self.sim.now)

    def stage(self, version: int, now: float) -> None:
        self.staged = version
        if self.seg is None:
            self._kick(now)
        elif self.sim.s.weight_update == "interrupt":
            self._cut(now)

    def _cut(self, now: float) -> None:
        """End the running segment at the step boundary that follows ``now`` (turns join there)."""
        t0, R, C0, K, extra = self.seg
        if self.cut_at is not None:
            return
        if self.sim.s.weight_update == "pause" and self.staged is not None:
            return  # draining: nothing joins until the rows in flight end
        if not self._room(self.pending[0].ctx if self.pending else 0) and self.staged is None:
            return
        el = (now - t0) * 1000.0
        c = self.sim.cost
        qa = c.ms_per_1k_ctx / 1000.0 * R / 2
        qb = c.t0_ms + c.ms_per_row * R + c.ms_per_1k_ctx / 1000.0 * (C0 - R / 2)
        qc = extra - el
        k = (-qb + math.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa) if qa > 0 else -qc / qb
        k = max(0, int(math.floor(k)))
        while k > 0 and self._ms(k, R, C0, extra) > el:
            k -= 1
        while self._ms(k + 1, R, C0, extra) <= el:
            k += 1
        kc = k + 1  # the step in progress ends
        if kc >= K:
            return
        self.token += 1
        self.seg = (t0, R, C0, kc, extra)
        self.cut_at = kc
        self.sim.at(t0 + self._ms(kc, R, C0, extra) / 1000.0, self._end, self.token)

    def _end(self, token: int) -> None:
        if token != self.token:
            return
        now = self.sim.now
        t0, R, C0, K, extra = self.seg
        self.busy_s += now - t0
        self.steps += K
        self.row_steps += R * K
        self.ctx_row_steps += K * C0 + R * K * (K - 1) / 2
        self.seg, self.cut_at = None, None
        done = []
        for r in self.rows:
            r.left -= K
            r.ctx += K
            if r.left <= 0:
                done.append(r)
        self.ctx_sum += R * K
        if done:
            self.rows = [r for r in self.rows if r.left > 0]
            self.ctx_sum -= sum(r.ctx for r in done)
            for r in done:
                self.sim.turn_done(r)
        self._boundary(now)

    def _boundary(self, now: float) -> None:
        """Apply a staged version if allowed, admit waiting turns, start the next segment."""
        extra = 0.0
        pre = self.sim.prefill
        if self.staged is not None and (self.sim.s.weight_update == "interrupt" or not self.rows):
            if self.rows:  # interrupt: the rows in flight recompute their KV cache with the new weights
                extra += pre.t0_ms + pre.ms_per_1k * self.ctx_sum / 1000.0
            self.version, self.staged = self.staged, None
            self.sim.engine_version_changed(self)
        admitted = 0.0
        if not (self.staged is not None and self.sim.s.weight_update == "pause"):
            while self.pending and self._room(self.pending[0].ctx):
                r = self.pending.popleft()
                self.rows.append(r)
                self.ctx_sum += r.ctx
                admitted += r.ctx
                self.sim.admitted_ctx += r.ctx
                self.sim.admitted_n += 1
        if admitted:
            extra += pre.t0_ms + pre.ms_per_1k * admitted / 1000.0
        if not self.rows:
            return
        R, C0 = len(self.rows), self.ctx_sum
        K = min(r.left for r in self.rows)
        self.token += 1
        self.seg = (now, R, C0, K, extra)
        self.sim.at(now + self._ms(K, R, C0, extra) / 1000.0, self._end, self.token)


# ------------------------------------------------------------------------------------------- simulator
class Simulator:
    """One run of ``Sim`` on ``Workload``. ``core_factory`` builds the replay core (``ReplayCore``; a test
    passes a subclass that counts or refuses)."""

    def __init__(self, w: Workload, s: Sim, core_factory=ReplayCore):
        if s.mode not in MODES:
            raise ValueError(f"mode={s.mode!r} is not one of {MODES}")
        if not s.engine_time_scale > 0:
            raise ValueError(f"engine_time_scale={s.engine_time_scale} must be > 0")
        if s.weight_update not in ("pause", "interrupt"):
            raise ValueError(f"weight_update={s.weight_update!r} is not 'pause' or 'interrupt'")
        if s.rollout_gpus < 1 or s.learner_gpus < 1 or s.groups_per_step < 1 or s.versions < 1:
            raise ValueError(f"rollout_gpus={s.rollout_gpus}, learner_gpus={s.learner_gpus}, "
                             f"groups_per_step={s.groups_per_step}, versions={s.versions}: each must be >= 1")
        self.w, self.s = w, s
        self.rng = np.random.default_rng([s.seed, 52])
        k = s.engine_time_scale  # the costs are linear in their coefficients: scaling these scales every step
        c, pre = gpu_cost.Gpu7BCost(), gpu_cost.Prefill7BCost()
        self.cost = gpu_cost.Gpu7BCost(c.t0_ms * k, c.ms_per_row * k, c.ms_per_1k_ctx * k)
        self.prefill = gpu_cost.Prefill7BCost(pre.t0_ms * k, pre.ms_per_1k * k)
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        colocated = s.mode == "colocated"
        n_eng = s.rollout_gpus + s.learner_gpus if colocated else s.rollout_gpus
        self.train_gpus = n_eng if colocated else s.learner_gpus
        self.engines = [Engine(self, i) for i in range(n_eng)]
        B = s.groups_per_step
        budget = (s.lag + 1) * B if s.mode == "async" else 0
        cap = s.capacity_groups or max(budget, B)
        self.core = core_factory(cap, s.lag if s.mode == "async" else 0, "drop", 1 << 16, s.seed,
                                 max_inflight_groups=budget, groups_per_step=B if budget else 0,
                                 worker_capacity=(max(1, w.row_cap // w.group_size)
                                                  if budget and s.worker_capacity else 0),
                                 just_in_time=bool(budget) and s.just_in_time, group_rows=w.group_size)
        self.version = 0
        self.learner_busy = False
        self.learner_busy_s = 0.0
        self.steps: list[dict] = []
        self.waiting: dict[int, list[tuple[float, int, int]]] = {}
        """Each worker's lanes waiting in ``claim``: (since, arrival number, lane), in the order they waited."""
        self.n_waiting = 0
        self.blocked: list[tuple[int, int, int]] = []
        """``version_wait`` off: lanes out of the queue until a take or push lifts their version's block
        (arrival, worker, lane)."""
        self._arrivals = 0
        self.candidates: set[int] = set()
        """Waiting workers a wake must ask: all but those whose engine refused them (``"engine"``) and whose
        claimed groups and off-engine rows have not changed since (``_touch``). That refusal reads only the
        worker's own claims and report, so asked again it would refuse again, and the ask would report the
        same rows: leaving them out changes no decision, and a wake costs the workers that may move, not
        every waiting one (at 1,024 GPUs, thousands of lanes a wake)."""
        self.blocked_puts: deque = deque()
        self.servers: list[float] = []
        self.done = False
        self._wake_at: float | None = None
        self.admitted_ctx = 0.0
        self.admitted_n = 0
        self.traj_turns: list[int] = []
        self.traj_calls: list[int] = []
        self.traj_final_ctx: list[float] = []
        self.off_rows = [0] * n_eng
        """Each worker's claimed trajectories off its engine now: waiting on a tool, or done while their group
        is not yet put (what it reports with a claim or put, ``ReplayCore.set_off_engine``)."""
        self._reask_at = [-1.0] * n_eng  # a wake is due then for the worker's next ask (decoding_rows)
        self.group_load = [0] * n_eng
        """Groups each worker claimed over the run (least-loaded first spreads them)."""
        self.lag_hist: dict[int, int] = {}
        self.trained_trajs = 0
        self.trained_tokens = 0.0
        pmf = np.asarray(w.calls_pmf, float)
        self._calls_cdf = np.cumsum(pmf / pmf.sum())[:-1]
        shares = np.asarray([t.share for t in w.tools], float)
        self._tools_cdf = np.cumsum(shares / shares.sum())[:-1]
        self._mu = math.log(w.turn_median)

    # ---------------------------------------------------------------- clock
    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self, max_events: int = 100_000_000) -> dict:
        if self.s.mode == "async":
            for e in self.engines:
                for lane in range(self.s.lanes):
                    self.at(0.0, self._lane_try, e.idx, lane)
        else:
            self.at(0.0, self._sync_step)
        n = 0
        while self._heap and not self.done:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
            n += 1
            if n > max_events:
                raise RuntimeError(f"more than {max_events} events: the run does not end")
        if not self.done:
            raise RuntimeError(f"the run stopped at version {self.version} of {self.s.versions} with nothing "
                               f"left to do: {self.core.stats()}")
        return self.result(n)

    # ---------------------------------------------------------------- trajectories
    def _new_claim(self, worker: int, lane: int, idx: list[int], version: int) -> Claim:
        w, c, rng, G = self.w, Claim(worker, lane), self.rng, self.w.group_size
        for prompt in idx:
            g = Group(prompt, worker, version, bool(rng.random() < w.zero_signal_share), c)
            calls = np.searchsorted(self._calls_cdf, rng.random(G), side="right")
            extra = rng.random(G) < w.extra_turn_p
            turns = calls + 1 + extra
            lens = np.exp(self._mu + w.turn_sigma * rng.standard_normal(int(turns.sum())))
            lens = (w.turn_fixed + np.clip(np.rint(lens), 1, w.turn_max)).astype(int).tolist()
            tools = np.searchsorted(self._tools_cdf, rng.random(int(calls.sum())), side="right").tolist()
            a = b = 0
            for k, n in zip(calls.tolist(), turns.tolist()):
                # an extra turn calls no tool: it sits before the answer
                plan_tools = tools[b:b + k] + [None] * (n - 1 - k)
                g.trajs.append(Traj(g, lens[a:a + n], plan_tools, float(w.prompt_tokens)))
                a, b = a + n, b + k
            g.left = len(g.trajs)
            c.groups.append(g)
        c.unfinished = c.unput = len(c.groups)
        self.group_load[worker] += len(c.groups)
        for g in c.groups:
            for t in g.trajs:
                self._start_turn(t)
        return c

    def _start_turn(self, t: Traj) -> None:
        room = self.w.max_context - t.ctx
        if room <= 0:
            return self._traj_done(t)
        t.left = t.cur = max(1, min(t.plan[t.turn], int(room)))
        self.engines[t.group.worker].submit(t, self.now)

    def turn_done(self, t: Traj) -> None:
        """An engine finished decoding ``t``'s turn (its context grew by the tokens decoded)."""
        w = self.w
        t.decoded += t.cur
        if not w.keep_generated:
            t.ctx -= t.cur  # the paced CPU engine's hidden tail does not stay in the next turn's prompt
        t.turn += 1
        if t.turn >= len(t.plan) or t.ctx >= w.max_context:
            return self._traj_done(t)
        tool = t.tools[t.turn - 1]
        if tool is None:
            return self._start_turn(t)
        t.calls += 1
        self._left_engine(t.group.worker)
        spec = w.tools[tool]
        lat = (spec.median_ms * math.exp(spec.sigma * self.rng.standard_normal()) + w.retrieval_per_call_ms) / 1000.0
        start = self.now
        if w.retrieval_servers > 0:  # first come first served on the servers (their free times in a heap)
            if len(self.servers) < w.retrieval_servers:
                heapq.heappush(self.servers, start)
            start = max(start, heapq.heappop(self.servers))
            heapq.heappush(self.servers, start + lat)
        self.at(start + lat, self._tool_back, t, spec.tokens)

    def _tool_back(self, t: Traj, tokens: int) -> None:
        self.off_rows[t.group.worker] -= 1
        self._touch(t.group.worker)
        t.ctx = min(self.w.max_context, t.ctx + tokens)
        self._start_turn(t)

    def _left_engine(self, worker: int) -> None:
        self.off_rows[worker] += 1
        self._touch(worker)
        if self.s.decoding_rows and self.s.worker_capacity and self.n_waiting:
            self._reask(worker)

    def _traj_done(self, t: Traj) -> None:
        self._left_engine(t.group.worker)
        self.traj_turns.append(t.turn)
        self.traj_calls.append(t.calls)
        self.traj_final_ctx.append(self._trained_tokens(t))
        g = t.group
        g.left -= 1
        if g.left:
            return
        c = g.claim
        c.unfinished -= 1
        if self.s.mode != "async" or self.s.per_group_put:
            self._put(g)
        elif c.unfinished == 0:
            for x in c.groups:  # the pre-change worker put a request's groups once its slowest ended
                self._put(x)

    def _trained_tokens(self, t: Traj) -> float:
        return t.ctx if self.w.keep_generated else t.ctx + t.decoded

    def _put(self, g: Group) -> None:
        """``ReplayQueue.put``: waits while the queue is full (backpressure), then ``core.add``."""
        self.off_rows[g.worker] -= len(g.trajs)  # handed on: the worker's report with the put leaves it out
        self._touch(g.worker)
        if self.s.decoding_rows:
            self.core.set_off_engine(g.worker, self.off_rows[g.worker])
        if self.core.full():
            self.blocked_puts.append(g)
            return
        self._add(g)

    def _add(self, g: Group) -> None:
        self.core.add(QueuedGroup(g, g.min_version, len(g.trajs), g.prompt, g.worker), self.now)
        self._touch(g.worker)  # its claim is released
        c = g.claim
        c.unput -= 1
        if self.s.mode == "async":
            if c.unput == 0:  # ``_aproduce`` returns: the lane loops and claims again
                self.at(self.now, self._lane_try, c.worker, c.lane)
            self._notify()
            self._learner_try()
        elif len(self.core.groups) >= self.s.groups_per_step:
            got, _ = self.core.take(self.s.groups_per_step, self.version, whole=True, now=self.now)
            self._train([p for p, _, _ in got], [lag for _, lag, _ in got])

    # ---------------------------------------------------------------- async: lanes and claims
    def _n(self) -> int:
        return self.s.groups_per_request

    def _may(self, worker: int) -> bool:
        return self._why(worker, {}) is None

    def _why(self, worker: int, pool: dict[int, str | None]) -> str | None:
        """``may_claim``'s answer with its reason (None: granted), the pool-wide part read from ``pool`` (policy
        version -> ``pool_refusal``, filled here) when the worker's version is in it."""
        s, core = self.s, self.core
        if s.decoding_rows:  # the claim call reports the rows waiting on a tool now
            core.set_off_engine(worker, self.off_rows[worker])
        v = core.claim_version(self.engines[worker].next_version)
        why = pool[v] if v in pool else pool.setdefault(v, core.pool_refusal(self._n(), v, self.now))
        if why is None and (s.least_loaded or s.worker_capacity):
            why = core.worker_refusal(worker, self._n())
        return why

    def _claim(self, worker: int, lane: int) -> None:
        idx = self.core.claim(worker, self._n(), self.now)
        self._touch(worker)
        self._new_claim(worker, lane, idx, self.engines[worker].next_version)

    def _register(self, worker: int, d: int) -> None:
        if not self.s.least_loaded:
            return  # the pre-change queue kept no registry: claims raced
        k = self.core.waiting.get(worker, 0) + d
        if k:
            self.core.waiting[worker] = k
        else:
            self.core.waiting.pop(worker, None)

    def _touch(self, worker: int) -> None:
        """``worker``'s claimed groups or off-engine rows changed: its engine's verdict may change."""
        if worker in self.waiting:
            self.candidates.add(worker)

    def _lane_try(self, worker: int, lane: int) -> None:
        """A lane calls ``ReplayQueue.claim``: it registers as waiting, and is granted now or waits."""
        if self.done:
            return
        self._register(worker, +1)
        if self._may(worker):
            self._register(worker, -1)
            self._claim(worker, lane)
            self._notify()  # the loads changed: a waiting lane may now go first
            return
        self._arrivals += 1
        if not self.s.version_wait and self._version_blocked():
            self._register(worker, -1)  # it returns at once: registered only inside the queue's lock
            self.blocked.append((self._arrivals, worker, lane))
            return
        self.waiting.setdefault(worker, []).append((self.now, self._arrivals, lane))
        self.n_waiting += 1
        self.candidates.add(worker)
        self._jit_timer()

    def _reask(self, worker: int) -> None:
        """A row of ``worker`` left its engine: its waiting lane reports that when it next asks (a refused
        claim returns after ``claim_wait_s`` and asks again 0.05 s later), so a check is due then. The check
        reads the count at that moment, not the one of the ask: optimistic by the rows that move between."""
        period = self.s.claim_wait_s + 0.05
        asks = [since + (math.floor((self.now - since) / period) + 1) * period
                for since, _, _ in self.waiting.get(worker, ())]
        if not asks:
            return
        t = min(asks) + 1e-6  # inside the ask, not at its boundary (float rounding)
        if self.now < self._reask_at[worker] <= t:
            return  # a check for that worker is already due no later
        self._reask_at[worker] = t
        self.at(t, self._wake)

    def _jit_timer(self) -> None:
        """A claim held back just in time wakes when its start comes, not only on a put or take."""
        if self.core.jit is None or not self.n_waiting:
            return
        wait = self.core.jit_wait_s(self._n(), self.now)
        if wait > 0:
            t = self.now + wait
            if self._wake_at is None or self._wake_at <= self.now or t < self._wake_at:
                self._wake_at = t
                self.at(t, self._wake)

    def _notify(self) -> None:
        """``cond.notify_all()``: the waiting lanes re-check (once per instant, however many notifies)."""
        if self.n_waiting and self._wake_at != self.now:
            self._wake_at = self.now
            self.at(self.now, self._wake)

    def _version_blocked(self) -> bool:
        """``version_wait`` off: the rule before, refused for the claim's version (only a take or newer weights
        lift it). Every engine holds one next version (a push stages it on all), so the block is pool-wide."""
        slots, inflight = self.core.fresh_slots(self.engines[0].next_version), self.core.inflight()
        return slots is not None and (slots <= 0 or (inflight > 0 and inflight + self._n() > slots))

    def _block_all(self) -> bool:
        """``version_wait`` off: when the version is blocked, every waiting claim re-checks on the notify and
        returns, its lane out of the queue until ``_unblock``."""
        if self.s.version_wait or not self._version_blocked():
            return False
        for worker, mine in self.waiting.items():
            self.blocked += [(seq, worker, lane) for _, seq, lane in mine]
            self._register(worker, -len(mine))
        self.blocked.sort()
        self.waiting.clear()
        self.candidates.clear()
        self.n_waiting = 0
        return True

    def _unblock(self) -> None:
        """After a take or a push: blocked lanes ask again, in the order they first asked."""
        if self.blocked and not self._version_blocked():
            for _, worker, lane in self.blocked:
                self.at(self.now, self._lane_try, worker, lane)
            self.blocked = []

    def _wake(self) -> None:
        if not self.n_waiting or self.done or self._block_all():
            return
        period, wait_s = self.s.claim_wait_s + 0.05, self.s.claim_wait_s
        now = self.now
        core, n = self.core, self._n()
        version = core.claim_version(self.engines[0].next_version)  # every lane's (the push reached all at once)

        def shut() -> bool:  # refused for every lane alike: the stage, the version, the budget or just in time
            return core.pool_refusal(n, version, now) is not None

        if shut():  # no lane may claim now: their order is not read (the next wake sorts them again)
            self._jit_timer()
            return
        # A lane gives up after claim_wait_s and asks again 0.05 s later, at the back: it queues since the
        # start of its current ask (two lanes tie only when their waits began a whole number of periods
        # apart, and then always did: the one that waited first goes first), and between giving up and
        # asking again it is not asked. Only the candidates' lanes: the others would be refused again.
        lanes = []
        for worker in self.candidates:
            for since, seq, lane in self.waiting[worker]:
                if (now - since) % period <= wait_s:
                    lanes.append((since + math.floor((now - since) / period) * period, seq, worker, since, lane))
        lanes.sort()
        # Between two claims nothing a verdict reads changes (the clock stands, the core is pure and the
        # off-engine report a worker gives is its current one), so each version's pool-wide verdict and each
        # worker's own are asked once however many lanes wait. A claim lifts no ``LASTING`` verdict, so the
        # next pass starts at the first lane whose verdict it may lift, and ``shut`` is read again.
        pool: dict[int, str | None] = {}  # policy version -> core.pool_refusal
        verdict: dict[int, str | None] = {}  # worker -> its refusal (None: granted)
        i, closed, reopen = 0, False, None
        while i < len(lanes) and not closed:
            _, seq, worker, since_i, lane = lanes[i]
            if worker in verdict:
                why = verdict[worker]
            else:
                why = verdict[worker] = self._why(worker, pool)
                if why == "engine":
                    self.candidates.discard(worker)  # until its claims or report change (``_touch``)
            if why is None:
                lanes.pop(i)
                mine = self.waiting[worker]
                mine.remove((since_i, seq, lane))
                if not mine:
                    del self.waiting[worker]
                    self.candidates.discard(worker)
                self.n_waiting -= 1
                self._register(worker, -1)
                self._claim(worker, lane)
                verdict = {w: r for w, r in verdict.items() if r in LASTING}
                pool = {v: r for v, r in pool.items() if r is not None}
                closed = shut() or self._block_all()
                if self.s.least_loaded and reopen is not None:
                    i = reopen  # the loads changed: a lane before it that deferred may go now
                reopen = None
                continue
            if reopen is None and why not in LASTING:
                reopen = i
            i += 1
        self._jit_timer()

    def engine_version_changed(self, e: Engine) -> None:
        if self.s.mode == "async":
            self._notify()  # a claim refused for its version may pass with the new one

    # ---------------------------------------------------------------- learner
    def _learner_try(self) -> None:
        if self.learner_busy or self.done:
            return
        got, _ = self.core.take(self.s.groups_per_step, self.version, whole=True, now=self.now)
        self.core.dropped_prompts = []
        if not got:
            return
        while self.blocked_puts and not self.core.full():
            self._add(self.blocked_puts.popleft())
        self._notify()
        self._unblock()
        self._train([p for p, _, _ in got], [lag for _, lag, _ in got])

    def _train(self, groups: list[Group], lags: list[int]) -> None:
        w = self.w
        tokens, trajs = 0.0, 0
        for g in groups:
            if g.zero:
                continue  # a group whose rewards are all equal carries no gradient: not trained
            for t in g.trajs:
                tokens += w.learner_tokens_per_traj if w.learner_tokens_per_traj is not None else \
                    self._trained_tokens(t)
                trajs += 1
        for lag in lags:
            self.lag_hist[lag] = self.lag_hist.get(lag, 0) + 1
        flops = (6.0 + 2.0 * w.extra_forwards) * w.params * tokens  # 6N update + 2N per extra forward
        train_s = flops / (self.train_gpus * w.mfu * PEAK_BF16_FLOPS)
        if self.s.mode == "colocated" and trajs:
            train_s += w.switch_s
        push = w.push_s if self.s.mode != "colocated" else 0.0
        self.learner_busy = True
        self.learner_busy_s += train_s + push
        n = sum(len(g.trajs) for g in groups)
        self.trained_trajs += n
        self.trained_tokens += tokens
        self.steps.append({"t_take": self.now, "train_s": train_s, "push_s": push, "trajs": n})
        self.at(self.now + train_s + push, self._pushed)

    def _pushed(self) -> None:
        self.version += 1
        self.steps[-1]["t_end"] = self.now
        self.learner_busy = False
        self.core.advance(self.version)
        if self.version >= self.s.versions:
            self.done = True
            return
        for e in self.engines:
            e.stage(self.version, self.now)
        if self.s.mode == "async":
            if self.s.version_wait:
                self.core.set_engine_version(self.version)  # the pool tells the queue: the push reached every engine
            self._notify()
            self._unblock()
            self._learner_try()
        else:
            self.at(self.now, self._sync_step)

    # ---------------------------------------------------------------- lockstep modes
    def _sync_step(self) -> None:
        """The driver's step: each worker gets its share of the batch, all submitted at once with the
        current weights (``RolloutWorker.generate_groups``), in requests of ``groups_per_request``."""
        B, E, per = self.s.groups_per_step, len(self.engines), self._n()
        share = [B // E + (i < B % E) for i in range(E)]
        for e, k in zip(self.engines, share):
            for j in range(0, k, per):
                idx = self.core.claim(e.idx, min(per, k - j), self.now)
                self._new_claim(e.idx, j, idx, e.version)

    # ---------------------------------------------------------------- results
    def result(self, events: int) -> dict:
        s = self.s
        steps = [st for st in self.steps if "t_end" in st]
        wall = steps[-1]["t_end"]
        t1 = steps[0]["t_end"]
        steady = sum(st["trajs"] for st in steps[1:]) / (wall - t1) if len(steps) > 1 else float("nan")
        gen_busy = sum(e.busy_s for e in self.engines)
        n_eng = len(self.engines)
        bal = self.core.balance()
        turns = np.asarray(self.traj_turns or [0])
        rows = sum(e.row_steps for e in self.engines)
        steps_run = sum(e.steps for e in self.engines)
        generated = len(self.traj_turns)
        # GPU-seconds per trajectory on each side, at this run's loads: the split that would balance them
        g_per = gen_busy / max(1, generated)
        l_per = (self.learner_busy_s - (s.mode == "colocated") * 0.0) * self.train_gpus / max(1, self.trained_trajs)
        gpus = s.rollout_gpus + s.learner_gpus
        return {
            "mode": s.mode, "rollout_gpus": s.rollout_gpus, "learner_gpus": s.learner_gpus, "lag": s.lag,
            "groups_per_step": s.groups_per_step, "versions": len(steps), "seed": s.seed,
            "trained_traj_per_s": steady, "run_traj_per_s": self.trained_trajs / wall,
            "first_version_s": t1, "wall_s": wall, "trained_trajs": self.trained_trajs,
            "produced_trajs": bal["produced"], "stale_trajs": bal["dropped_stale"],
            "stale_share": bal["dropped_stale"] / bal["produced"] if bal["produced"] else 0.0,
            "untrained_at_end": generated - self.trained_trajs - bal["dropped_stale"],
            "lag_hist": {str(k): v for k, v in sorted(self.lag_hist.items())},
            "rollout_idle_share": 1.0 - gen_busy / (n_eng * wall),
            "learner_idle_share": 1.0 - self.learner_busy_s / wall,
            "rollout_gpu_s_per_traj": g_per, "learner_gpu_s_per_traj": l_per,
            "balanced_rollout_gpus": gpus * g_per / (g_per + l_per) if g_per + l_per > 0 else float("nan"),
            "step_s": [st["t_end"] - st["t_take"] for st in steps],
            "step_end_s": [st["t_end"] for st in steps],
            "balance": bal, "events": events, "group_load": list(self.group_load),
            "workload": {
                "turns_mean": float(turns.mean()), "turns_p90": float(np.percentile(turns, 90)),
                "turns_max": int(turns.max()), "tool_calls_mean": float(np.mean(self.traj_calls or [0])),
                "decode_context_mean": sum(e.ctx_row_steps for e in self.engines) / rows if rows else 0.0,
                "rows_per_step_mean": rows / steps_run if steps_run else 0.0,
                "ctx_admitted_mean": self.admitted_ctx / self.admitted_n if self.admitted_n else 0.0,
                "decode_tokens_per_traj": rows / max(1, generated),
                "learner_tokens_per_traj": self.trained_tokens / max(1, self.trained_trajs),
                "final_context_mean": float(np.mean(self.traj_final_ctx or [0])),
                "learner_gpu_share": l_per / (g_per + l_per) if g_per + l_per > 0 else float("nan"),
            },
        }


def simulate(w: Workload, s: Sim, core_factory=ReplayCore) -> dict:
    """Run one simulation; returns its metrics (``Simulator.result``)."""
    return Simulator(w, s, core_factory).run()
