"""The rollout workers, owned by one object: ``RolloutPool``.

Starting them, waiting for them, their health, restarts, the elastic pool's grow and drain, the weight
transport's group (``cluster/transport/transport.py``) and the weight push: all of it is here, and every call
the driver makes to a member worker goes through ``RolloutPool.call``, the one fault path:

- A worker whose call fails because it died (``RayActorError``), or that does not answer by the call's
  deadline, is *replaced* at once: its claimed prompts are requeued (``ReplayQueue.release_worker``),
  it is killed and a new worker takes its index and is waited for, within
  ``cluster.max_worker_restarts`` per index; past that ``WorkerFailed`` names the worker, the call and
  the error (at once: the run does not wait for the other workers' answers first).
- A replaced worker is not in the transport's group (membership is fixed when the group forms), so the
  pool then *regroups*, once per call however many it replaced: every rollout loop paused (in an async
  RL stage: the replay closed, so a producer blocked on backpressure lets go and its claim is requeued;
  every loop stopped), the group formed again with every worker, the learner's current weights pushed,
  the loops started again, the new worker's too. A call that asks for ``retry`` is then made once more
  on the new worker (it holds the current weights by then).
- Inside a regroup (pausing, forming, pushing, resuming) a fault replaces the worker and the regroup
  starts over. A worker found dead while the group forms calls the formation off first
  (``WeightTransport.abort``): the ranks waiting for it at the presence barrier give up at once. One that
  dies mid-push calls the push off the same way: every rank waiting in it (the learner's send, the ranks
  downstream of the dead one in the broadcast) raises at its next look at the key, within
  ``weights.PUSH_CALL_OFF_POLL_S``, and the group forms again with the replacement. One that dies inside
  the backend's rendezvous costs at most the group's timeout (``cluster.broadcast_timeout_s``).

Errors that are not a death or a silence are the call's own and propagate (after the deaths are
handled), except inside the group's formation and the push, where a dead peer is the likely cause of
the others' errors: there they are ignored when a worker died, and raised when none did.

Membership changes of the elastic pool (``pool.Pool`` decides when; ``add_candidate``, ``candidate``,
``admit_candidate`` and ``shrink`` carry it out) are regroups too. The one call to a worker outside
``call`` is the readiness probe of a candidate that is not a member yet (``candidate``): a candidate
that fails is dropped, there is nothing to restart.

``on_event(event, pool)`` (``roles.Hooks.on_pool``; None in production) is called at two points the
fault tests synchronise on: ``"group_open"`` (the learner's endpoint is open, no rank has joined) and
``"push_sent"`` (the learner's send is submitted, no worker's receive yet).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable

from sonar.cluster.driver.reports import answer
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config, StageConfig, broadcast_backend
from sonar.cluster.wire.errors import RunFault
from sonar.cluster.transport.transport import BroadcastTransport, Endpoint, WeightTransport

log = logging.getLogger("sonar")

REPLICA_RECHECK_S = 1.0
"""Seconds between two health probes of a dead retrieval replica in the workers' clients."""


class WorkerFailed(RunFault):
    """A rollout worker failed and ``cluster.max_worker_restarts`` is used up; the message names it."""


class _Died:
    def __repr__(self) -> str:
        return "<worker died>"


DIED = _Died()
"""``call``'s result for a worker that died (or stayed silent) during the call and was replaced."""


def start_worker(cfg: Config, i: int, retrieval: list, engine_wrap: Callable | None = None, *, policy: str,
                 placement_group=None):
    """Rollout worker ``i``, searching through clients of the ``retrieval`` replicas (a client pickles:
    handles and settings), holding the policy loaded from the directory ``policy``. Not waited for.
    ``placement_group``: the learner's, in colocated placement on GPUs: worker i goes into bundle i, the GPU
    it shares with learner rank i (``worker_options``).

    Rollouts search with ``retrieval.timeout_s``: a slow search is data (a failed call, "no results").
    Evaluation searches wait up to ``cluster.step_timeout_s`` instead: a held-out measurement must not
    depend on load, and a timed-out search there would turn into a wrong answer."""
    import ray

    from sonar.actors.worker import RolloutWorker
    from sonar.retrieval.client import RetrievalClient

    # While no replica is healthy (dead, restarting), searches wait up to cluster.retrieval_wait_s for one.
    client = RetrievalClient(retrieval, timeout_s=cfg.retrieval.timeout_s, recheck_s=REPLICA_RECHECK_S,
                             wait_healthy_s=cfg.cluster.retrieval_wait_s)
    eval_client = RetrievalClient(retrieval, timeout_s=cfg.cluster.step_timeout_s, name="service-eval",
                                  recheck_s=REPLICA_RECHECK_S, wait_healthy_s=cfg.cluster.retrieval_wait_s)
    return ray.remote(RolloutWorker).options(**worker_options(cfg, i, placement_group), max_concurrency=4,
                                             name=None).remote(
        i, cfg, client, eval_retriever=eval_client, policy=policy, engine_wrap=engine_wrap)


def worker_options(cfg: Config, i: int, placement_group=None) -> dict:
    """Ray options of rollout worker ``i``: its CPUs, GPUs and role resources; in colocated placement on
    GPUs its share of bundle ``i`` of the learner's ``placement_group`` (``resolved.ray_gpus``)."""
    from sonar.cluster.driver.demands import role_resources
    from sonar.cluster.wire.resolved import colocated_on_gpu, ray_gpus

    opts = dict(num_cpus=cfg.rollout.num_cpus_per_worker, num_gpus=ray_gpus(cfg, "rollout"),
                resources=role_resources(cfg, "rollout"))
    if colocated_on_gpu(cfg):
        if placement_group is None:
            raise ValueError(f"rollout worker {i}: cluster.placement='colocated' on GPUs starts each worker in its "
                             "learner rank's bundle, and no learner placement group was given")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=i)
    return opts


def node_ref(handle):
    """ObjectRef of the Ray node id the actor ``handle`` runs on (asked of the actor itself)."""
    import ray

    return handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())


def node_of(handle, timeout_s: float) -> str:
    """The Ray node id the actor ``handle`` runs on."""
    import ray

    return ray.get(node_ref(handle), timeout=timeout_s)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


class RolloutPool:
    """The rollout workers of one set of roles (module docstring).

    ``learner``, ``replay``: the roles' handles (the learner is the transport's source; the replay takes
    a replaced worker's claims back). ``start(i)``: starts worker ``i`` and returns its handle (default:
    ``start_worker`` with ``retrieval``, ``engine_wrap`` and ``policy``). ``transport``: default the
    broadcast group (``BroadcastTransport``). ``workers``: handles of workers already started (the pool
    owns them from here on). ``placement_group``: the learner's, where colocated placement on GPUs starts
    each worker in its rank's bundle (``worker_options``)."""

    def __init__(self, cfg: Config, *, learner=None, replay=None, retrieval: list | None = None, policy: str = "",
                 engine_wrap: Callable | None = None, transport: WeightTransport | None = None,
                 start: Callable | None = None, on_event: Callable | None = None, workers: list | None = None,
                 placement_group=None):
        self.cfg = cfg
        self.learner, self.replay = learner, replay
        self.transport = transport if transport is not None else BroadcastTransport(learner, broadcast_backend(cfg))
        # ``retrieval`` is the roles' own list: a replica replaced in it reaches workers started later.
        self.retrieval = retrieval if retrieval is not None else []
        self._start = start or (lambda i: start_worker(cfg, i, self.retrieval, engine_wrap, policy=policy,
                                                       placement_group=placement_group))
        self.on_event = on_event
        self.workers: list = list(workers or [])
        """The members' handles, worker i at index i (ids stay 0..n-1). Read them; call them through ``call``."""
        self.restarts: dict[int, int] = {i: 0 for i in range(len(self.workers))}
        """Restarts so far per worker index (``cluster.max_worker_restarts`` bounds each)."""
        self.active: tuple[int, StageConfig] | None = None
        """(stage index, StageConfig) while an RL stage runs (``begin_stage``..``end_stage``): a regroup
        in async mode pauses and resumes the rollout loops, and starts a replaced worker's."""
        self.generation = 0
        """Formations of the group so far (0: none yet); each formation's ``Endpoint.generation``."""
        self.push_call_offs = 0
        self.push_bytes: int | None = None
        """Bytes the last completed push moved (the summary's "bytes per weight push")."""
        """Pushes called off because a worker died during them (the others stopped waiting at once)."""
        self._endpoint: Endpoint | None = None  # the formed group's meeting point: where a push is called off
        self._stale = False  # a member was replaced since the group last formed
        self._depth = 0  # nesting of _deferred blocks: a regroup waits for the outermost to end
        self._regrouping = False
        self._closed = False  # shutdown: faults are no longer repaired
        self._candidate = None  # (index, handle, ready ref) of a worker the elastic pool is adding
        """Rollout records the workers' health answers returned since the last trained step was logged
        (``logged``): a health check before a learner call that came back waiting must not lose them."""

    # ------------------------------------------------------------------ start
    def start(self, n: int) -> None:
        """Start workers 0..n-1 (``ready`` waits for them)."""
        self.workers = [self._start(i) for i in range(n)]
        self.restarts = {i: 0 for i in range(n)}

    def adopt(self, handles: list) -> None:
        """Make ``handles`` (workers already started and ready) the members, worker i at index i, with no
        restarts counted; call ``form_group`` next (a benchmark sweeps pool sizes so)."""
        self.workers = list(handles)
        self.restarts = {i: 0 for i in range(len(handles))}

    def ready(self) -> list[dict]:
        """Wait until every worker has started (``ready``), up to ``cluster.step_timeout_s``. A worker that
        dies meanwhile is replaced; one still starting at the deadline raises ``GetTimeoutError`` (the
        cluster lacks what it asks for: a restart would not help)."""
        return self.call("ready", lambda w, i: w.ready.remote(), timeout=self.cfg.cluster.step_timeout_s,
                         hung="raise")

    # ------------------------------------------------------------------ the one fault path
    def call(self, what: str, fn: Callable, *, only: list[int] | None = None, timeout: float | None = None,
             retry: bool = False, collect: bool = False, hung: str = "restart",
             on_died: Callable[[int], None] | None = None) -> list:
        """Call every member (or those in ``only``) at once: ``fn(handle, index)`` -> ObjectRef; returns
        their results in index order (module docstring for what a fault does).

        ``timeout``: one deadline for every answer (None: wait). A silent worker is replaced
        (``hung="restart"``) or raises ``GetTimeoutError`` naming the silent ones (``hung="raise"``).
        A replaced worker's result is ``DIED``, or, with ``retry``, the result of the call made again on
        its replacement after the regroup. ``collect``: another error is returned as the exception in
        that worker's place instead of being raised. ``on_died(i)``: called when worker ``i`` is found dead or
        silent, before it is replaced (the group's formation calls itself off there)."""
        import ray

        idx = list(range(len(self.workers))) if only is None else list(only)
        if retry and (self._depth or self._regrouping):
            raise RuntimeError(f"RolloutPool.call({what!r}, retry=True) inside a regroup: a replacement would "
                               "be called before it holds the weights")
        out: dict[int, object] = {}
        replaced: list[int] = []
        error: BaseException | None = None
        with self._deferred():
            refs = {fn(self.workers[i], i): i for i in idx}
            pending = list(refs)
            end = None if timeout is None else time.monotonic() + timeout
            while pending:  # answers as they come: a death is repaired (or fails the run) at once
                left = None if end is None else max(0.0, end - time.monotonic())
                done, pending = ray.wait(pending, num_returns=1, timeout=left)
                if not done:  # the deadline passed
                    break
                i = refs[done[0]]
                try:
                    out[i] = ray.get(done[0])
                except ray.exceptions.RayActorError as e:
                    out[i] = DIED
                    replaced.append(i)
                    if on_died is not None:
                        on_died(i)
                    self._replace(i, f"{what}: {type(e).__name__}: {_first_line(e)}")
                except Exception as e:  # noqa: BLE001 - the call's own error
                    out[i] = e
                    error = error or e
            silent = sorted(refs[r] for r in pending)
            if silent and hung == "raise":
                raise ray.exceptions.GetTimeoutError(
                    f"rollout workers {silent}: no answer to {what} within {timeout:g} s")
            for i in silent:
                out[i] = DIED
                replaced.append(i)
                if on_died is not None:
                    on_died(i)
                self._replace(i, f"{what}: no answer within {timeout:g} s")
        if error is not None and not collect:
            raise error
        if retry and replaced and not self._closed:
            again = self.call(what, fn, only=replaced, timeout=timeout, retry=True, collect=collect, hung=hung)
            out.update(zip(replaced, again))
        return [out[i] for i in idx]

    def _replace(self, i: int, err: str) -> None:
        """Worker ``i`` died or is silent: requeue its claimed prompts and start a new worker in its place
        (within ``cluster.max_worker_restarts``, else ``WorkerFailed`` naming it). The group is re-formed
        when the outermost call ends (``_settle``)."""
        import ray

        if self._closed:
            return
        cfg = self.cfg
        requeued = ray.get(self.replay.release_worker.remote(i), timeout=cfg.cluster.step_timeout_s)
        if self.restarts.get(i, 0) >= cfg.cluster.max_worker_restarts:
            raise WorkerFailed(f"rollout worker {i} failed ({requeued} prompts requeued) and "
                               f"cluster.max_worker_restarts={cfg.cluster.max_worker_restarts} is used up:\n{err}")
        self.restarts[i] = self.restarts.get(i, 0) + 1
        log.warning("restarting rollout worker %d (restart %d): %s", i, self.restarts[i], err.splitlines()[-1])
        try:
            ray.kill(self.workers[i], no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
        self.workers[i] = self._start(i)
        self._stale = True
        # Nested: a replacement that dies or stays silent while starting is replaced in turn (same budget).
        self.call("ready", lambda w, j: w.ready.remote(), only=[i], timeout=cfg.cluster.step_timeout_s)

    @contextmanager
    def _deferred(self):
        """Faults inside are repaired at once; the group is re-formed once, when the outermost block ends
        without an error (``_settle``)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        self._settle()

    def _settle(self) -> None:
        if self._stale and self._depth == 0 and not self._regrouping and self.generation > 0 and not self._closed:
            self.regroup()

    # ------------------------------------------------------------------ the group and the push
    def form_group(self) -> None:
        """(Re)form the transport's group with every member and push the learner's current weights."""
        self.regroup()

    def regroup(self, change: Callable | None = None) -> None:
        """Pause the rollout loops (async RL stage), ``change()`` the membership, form the group with
        every member, push the current weights, resume the loops; over again while a worker fails in
        between (module docstring)."""
        import ray

        if self._regrouping:
            raise RuntimeError("RolloutPool.regroup inside a regroup")
        self._regrouping = True
        try:
            while not self._closed:
                running = self.active is not None and self.cfg.cluster.mode == "async"
                if running:
                    ray.get(self.replay.close.remote(), timeout=self.cfg.cluster.step_timeout_s)
                    self.call("stop", lambda w, j: w.stop.remote())
                if change is not None:
                    change()
                    change = None
                    if self.replay is not None:  # each worker's share of the budget follows the pool's size
                        ray.get(self.replay.set_workers.remote(len(self.workers)),
                                timeout=self.cfg.cluster.step_timeout_s)
                if running:
                    ray.get(self.replay.reopen.remote(), timeout=self.cfg.cluster.step_timeout_s)
                self._stale = False
                if not self._form() or self._push_once() is None:
                    continue  # a worker died (replaced): form again with its replacement
                if running:
                    index, stage = self.active
                    self.call("start", lambda w, j: w.start.remote(self.replay, index, stage))
                if not self._stale:
                    return
        finally:
            self._regrouping = False

    def _form(self) -> bool:
        """One formation: ranks, the learner's endpoint, every rank joins at once, layouts compared.
        False: a worker died meanwhile (replaced); the caller forms again."""
        import ray

        t, c = self.transport, self.cfg.cluster
        ranks = self.call("broadcast_ranks", lambda w, i: t.ranks(w), timeout=c.health_timeout_s)
        if any(r is DIED for r in ranks):
            return False
        bases = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        self.generation += 1
        host, port = ray.get(t.open(1 + sum(ranks)), timeout=c.health_timeout_s)
        ep = Endpoint(host, int(port), 1 + sum(ranks), self.generation)
        if not self._check_reachable(host):
            return False
        self._event("group_open")
        # A worker found dead while the group forms calls the formation off (transport.abort) before it is
        # replaced: the ranks waiting for it give up at once. Past the presence barrier (weights.py) the
        # backend's rendezvous fails on the others within the group's timeout (cluster.broadcast_timeout_s):
        # the deadline covers it, so only a truly silent worker is replaced.
        deadline = c.broadcast_timeout() + c.health_timeout_s
        source = t.join_source(ep)
        called_off: list[int] = []

        def call_off(i: int) -> None:
            if not called_off:
                called_off.append(i)
                t.abort(ep, f"rollout worker {i} died before the group formed (generation {ep.generation})")

        digests = self.call("join", lambda w, i: t.join(w, ep, bases[i]), timeout=deadline, collect=True,
                            on_died=call_off)
        died = any(d is DIED for d in digests)
        try:
            digest = ray.get(source, timeout=deadline)
        except ray.exceptions.RayActorError:
            raise  # the learner is gone: not the pool's to repair (faults.role_died)
        except Exception as e:  # noqa: BLE001 - with a dead peer, the learner's rendezvous fails too
            if not died:
                raise
            log.info("weight-broadcast group generation %d abandoned (the learner: %s: %s)", ep.generation,
                     type(e).__name__, _first_line(e))
        if died:
            return False
        self._endpoint = ep
        errors = [d for d in digests if isinstance(d, BaseException)]
        if errors:
            raise errors[0]
        if len({digest, *digests}) != 1:
            raise RuntimeError(f"weight layouts differ between the learner and the workers: {[digest, *digests]} "
                               "(model.* config or model.path must be the same for every role)")
        return True

    def _check_reachable(self, host: str) -> bool:
        """A rendezvous on loopback (``cluster.bind_host``) reaches only the learner's own node: fail
        naming the workers elsewhere, rather than letting them time out dialling their own loopback.
        False: a worker died while asked (replaced)."""
        import ray

        from sonar.cluster.transport.weights import is_loopback

        c = self.cfg.cluster
        # Only the explicit choice: a simulated cluster's nodes have distinct 127/8 addresses of their own.
        if c.bind_host != "loopback" or not is_loopback(host) or sum(1 for n in ray.nodes() if n.get("Alive")) <= 1:
            return True
        home = node_of(self.learner, c.health_timeout_s)
        nodes = self.call("node", lambda w, i: node_ref(w), timeout=c.health_timeout_s)
        if any(n is DIED for n in nodes):
            return False
        away = [i for i, n in enumerate(nodes) if n != home]
        if away:
            raise RuntimeError(f"cluster.bind_host={c.bind_host!r}: the learner's broadcast listens on {host}, "
                               f"but rollout workers {away} run on other nodes and cannot reach it (use 'auto' or the "
                               "learner node's address)")
        return True

    def push(self) -> dict:
        """One push of the learner's current weights to every worker; returns its metrics. A worker that
        dies mid-push: the learner's send raises within the group's timeout (or completes), the worker is
        replaced, the group formed again and the weights pushed again (the broken push's metrics: {})."""
        with self._deferred():
            m = self._push_once()
        return m or {}

    def _push_once(self) -> dict | None:
        """The collective: learner -> every worker; only the version number crosses Ray. None: a worker
        died meanwhile (replaced)."""
        import ray

        t, c = self.transport, self.cfg.cluster
        version = ray.get(self.learner.ping.remote(), timeout=c.step_timeout_s)["version"]
        sent = t.send()
        self._event("push_sent")
        deadline = c.broadcast_timeout() + c.health_timeout_s  # the collective's own bound is broadcast_timeout()
        ep, called_off = self._endpoint, []

        def call_off(i: int) -> None:
            # the ranks downstream of the dead one would wait the group's timeout for its bytes: the call-off
            # ends every rank's wait at once (weights.BroadcastGroup._wait), the learner's send included
            if not called_off and ep is not None:
                called_off.append(i)
                t.abort(ep, f"rollout worker {i} died during the push of version {version} (generation {ep.generation})")

        got = self.call("receive_weights", lambda w, i: t.receive(w, version), timeout=deadline, collect=True,
                        on_died=call_off)
        died = any(g is DIED for g in got)
        try:
            s = ray.get(sent, timeout=deadline)
        except ray.exceptions.RayActorError:
            raise  # the learner is gone
        except Exception:  # noqa: BLE001 - the broken group's send: the push is made again
            if not died:
                raise
        if died:
            self.push_call_offs += len(called_off)
            return None
        errors = [g for g in got if isinstance(g, BaseException)]
        if errors:
            raise errors[0]
        self.push_bytes = int(s["bytes"])
        if self.replay is not None:  # waits: claims refused for their version pass with these weights (replay.py)
            answer(self.cfg, self.replay.set_engine_version.remote(version), "replay queue", "set_engine_version")
        return {K.WEIGHTS_SYNC_S: s["seconds"], K.WEIGHTS_GBPS: s["bytes"] / max(s["seconds"], 1e-9) / 1e9,
                K.WEIGHTS_BYTES: s["bytes"]}

    def _event(self, name: str) -> None:
        if self.on_event is not None:
            self.on_event(name, self)

    # ------------------------------------------------------------------ stages
    def begin_stage(self, index: int, stage: StageConfig) -> None:
        """An RL stage starts: from here a replaced worker starts its rollout loop too; in async mode every
        loop starts now (and runs until ``end_stage``)."""
        import ray

        self.active = (index, stage)
        # Wait: each worker's share of the admission budget is set before any loop claims.
        ray.get(self.replay.set_workers.remote(len(self.workers)), timeout=self.cfg.cluster.step_timeout_s)
        if self.cfg.cluster.mode != "sync":
            self.call("start", lambda w, i: w.start.remote(self.replay, index, stage))

    def end_stage(self) -> None:
        """The stage is over: no new claims (replay closed), every loop stopped (its groups in flight put,
        or their claims requeued), the replay drained."""
        import ray

        self.active = None  # a worker found dead from here on is restarted without a rollout loop
        answer(self.cfg, self.replay.close.remote(), "replay queue", "close")
        self.call("stop", lambda w, i: w.stop.remote())
        answer(self.cfg, self.replay.drain.remote(), "replay queue", "drain")

    def generate(self, index: int, stage: StageConfig, n_groups: int, step: int) -> None:
        """Sync mode: the workers generate exactly ``n_groups`` groups with the current weights (shared as
        evenly as the count allows), then stop. A worker that dies meanwhile is replaced; its share is
        missing from this batch (the learner waits, the loop generates again)."""
        k = len(self.workers)
        shares = [n_groups // k + (1 if i < n_groups % k else 0) for i in range(k)]
        self.call("generate_groups", lambda w, i: w.generate_groups.remote(self.replay, index, stage, shares[i], step),
                  timeout=self.cfg.cluster.step_timeout_s, only=[i for i, s in enumerate(shares) if s])

    def sleep(self, level: int) -> list[dict]:
        """Colocated placement: every engine frees its device for the learner (``RolloutWorker.sleep``); their
        answers. A worker that dies meanwhile is replaced and its replacement put to sleep too."""
        return self.call("sleep", lambda w, i: w.sleep.remote(level), timeout=self.cfg.cluster.step_timeout_s,
                         retry=True)

    def wake(self, tags: list | None = None) -> list[dict]:
        """Undo ``sleep`` for ``tags`` on every engine (``RolloutWorker.wake``); their answers. A replacement
        starts awake, so a retry on it is harmless."""
        return self.call("wake", lambda w, i: w.wake.remote(tags), timeout=self.cfg.cluster.step_timeout_s,
                         retry=True)

    def health(self) -> dict:
        """Health check every iteration: every worker asked at once, one deadline for every answer
        (``cluster.health_timeout_s``: a silent worker costs one timeout per check, not one per worker).
        A dead, silent, failed or (async) stalled worker is replaced. A small answer: liveness and the
        worker's counters; the rollout metrics come with the rollouts, through the replay
        (``ReplayQueue.report``). Returns the busy time of the workers that answered, as a metric."""
        c = self.cfg.cluster
        busy = None  # seconds with a claimed request in flight, summed over the workers that answered (None: none did)
        with self._deferred():  # one regroup for every worker replaced here
            answers = self.call("health", lambda w, i: w.health.remote(), timeout=c.health_timeout_s, collect=True)
            for i, h in enumerate(answers):
                if h is DIED:
                    continue
                if isinstance(h, BaseException):  # its health call raised
                    err = f"health: {type(h).__name__}: {h}"
                else:
                    stopped = not h["alive"] and c.mode == "async"
                    err = h["error"] or ("rollout loop is not running" if stopped else None)
                    if err is None and c.mode == "async" and h["idle_s"] > c.step_timeout_s:
                        err = f"no progress for {h['idle_s']:.0f}s"
                if err is None:
                    busy = (busy or 0.0) + float(h["stats"].get("busy_s", 0.0))
                else:
                    self._replace(i, err)
        return {} if busy is None else {K.ROLLOUT_BUSY_S: busy}

    def evaluate(self, questions: list, search: bool, stage: StageConfig) -> list[dict]:
        """Held-out evaluation sharded over the workers (worker i takes ``questions[i::n]``); the records,
        worker by worker. A worker that dies meanwhile is replaced and its shard evaluated again."""
        n = len(self.workers)
        shards = [questions[i::n] for i in range(n)]
        got = self.call("evaluate", lambda w, i: w.evaluate.remote(shards[i], search, stage),
                        only=[i for i, s in enumerate(shards) if s], retry=True)
        return [r for rs in got for r in rs]

    def verify_weights(self) -> dict:
        """After a final push, every worker must hold exactly the learner's weights (checksums equal)."""
        import ray

        self.push()
        self.call("apply_staged_weights", lambda w, i: w.apply_staged_weights.remote(), retry=True)
        learner = ray.get(self.learner.checksum.remote())
        workers = self.call("checksum", lambda w, i: w.checksum.remote(), retry=True)
        produced = [h["stats"]["trajectories"] for h in self.call("health", lambda w, i: w.health.remote(), retry=True)]
        ok = all(w["version"] == learner["version"] and
                 (w["checksum"] is None or abs(w["checksum"] - learner["checksum"]) <= 1e-9 * abs(learner["checksum"]))
                 for w in workers)
        if not ok:
            raise RuntimeError(f"weights diverged after the final push: learner {learner}, workers {workers}")
        return {"learner": learner, "workers": workers, "worker_trajectories": produced,
                "push_bytes": self.push_bytes}

    def replace_replica(self, slot: int, handle) -> None:
        """Retrieval replica ``slot`` was replaced by ``handle``: every worker's retrieval clients switch to
        it. A worker replaced meanwhile was started with it already (the roles' replica list holds it)."""
        self.call("replace_retrieval_replica", lambda w, i: w.replace_retrieval_replica.remote(slot, handle))

    def pid(self, i: int) -> int:
        """Worker ``i``'s process id (a dead one is replaced first: the new one's)."""
        return int(self.call("ready", lambda w, j: w.ready.remote(), only=[i], retry=True,
                             timeout=self.cfg.cluster.health_timeout_s)[0]["pid"])

    # ------------------------------------------------------------------ the elastic pool's mechanics
    def add_candidate(self) -> int:
        """Start worker ``len(workers)`` without waiting; it joins at ``admit_candidate`` once ``candidate``
        says it is ready. Returns its index."""
        i = len(self.workers)
        w = self._start(i)
        self._candidate = (i, w, w.ready.remote())
        return i

    def candidate(self) -> str | None:
        """The candidate's state, asked without waiting: None (still starting), "" (ready) or why it failed
        (it is dropped then)."""
        import ray

        i, w, ref = self._candidate
        if not ray.wait([ref], timeout=0)[0]:
            return None
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a worker that failed to start is not added
            self.drop_candidate()
            return f"{type(e).__name__}: {_first_line(e)}"
        return ""

    def drop_candidate(self) -> None:
        """Kill the candidate, if any (never a member)."""
        import ray

        if self._candidate is not None:
            try:
                ray.kill(self._candidate[1], no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass
            self._candidate = None

    def admit_candidate(self) -> None:
        """The ready candidate becomes a member: a regroup adds it."""
        i, w, _ = self._candidate
        self._candidate = None

        def add():
            self.workers.append(w)
            self.restarts.setdefault(i, 0)

        self.regroup(add)

    def shrink(self) -> int:
        """Drain the highest-numbered worker (ids stay 0..n-1) in a regroup: its loop stops with the
        others' (its groups in flight are put, or their claims requeued: ``ReplayQueue.put`` on a closed
        queue), what it still holds goes back to the front of the prompt cursor, then it is killed.
        Returns the prompts requeued."""
        import ray

        i = len(self.workers) - 1
        removed = {"requeued": 0}

        def remove():
            removed["requeued"] = answer(self.cfg, self.replay.release_worker.remote(i), "replay queue", "release_worker")
            w = self.workers.pop()
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass

        self.regroup(remove)
        return removed["requeued"]

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Stop every worker's loop (best effort, one 10 s deadline); nothing is restarted from here on.
        Never raises: it runs while a run ends, perhaps on another error."""
        self._closed = True
        try:
            self.drop_candidate()
            if self.workers:
                self.call("stop", lambda w, i: w.stop.remote(timeout_s=5), timeout=10, collect=True)
        except Exception as e:  # noqa: BLE001 - teardown: the run's own outcome stands
            log.warning("stopping the rollout workers: %s: %s", type(e).__name__, _first_line(e))

    def kill(self) -> None:
        """Kill every worker (and a candidate); nothing is restarted from here on."""
        import ray

        self._closed = True
        self.drop_candidate()
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass
