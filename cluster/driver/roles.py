"""The roles and their lifecycle: Ray, retrieval service, replay queue, learner, rollout workers.

Starting, health-checking, restarting and stopping them; the weight push; checkpoints and export.
The driver holds only handles and small dicts: trajectories go worker -> replay -> learner, weights
go over the broadcast group.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sonar.cluster.driver.data import cursor_prompts
from sonar.cluster.driver.learner_ranks import remove_learner_group, start_learner
from sonar.cluster.driver.reports import eval_table, rollout_metrics
from sonar.cluster.driver.run import Run, world_of
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config, StageConfig, inflight_budget, to_yaml

log = logging.getLogger("sonar")


@dataclass(frozen=True)
class Hooks:
    """Extension points for code outside production: the benchmarks (``sonar.bench.sim``) put their
    simulators into this driver through them, and production never imports the benchmarks. Both are
    sent into Ray actors, so both must be picklable (a top-level function, or an instance of a
    top-level class). None: production as it is."""

    engine_wrap: Callable | None = None
    """Handed to every rollout worker's ``build_engine`` (``actors/engines.py``): wraps or replaces
    the engine ``rollout.*`` describes."""
    retriever_wrap: Callable | None = None
    """Handed to ``build_retriever`` (``retrieval/factory.py``) in every retrieval replica: wraps the
    search backend, below the reranker and the cache."""
    on_step: Callable | None = None
    """Called in the driver's process (never sent to an actor) after every logged RL step, as
    ``on_step(roles, run, stage_index, steps)``; a truthy return ends training early (the current stage
    stops, later stages are skipped, the run finishes as usual). The fault tests and ``sonar chaos``
    kill processes from here, so the faults land in the middle of an RL stage of the driver's own loop."""


@dataclass
class Roles:
    retrieval: list
    replay: object
    learner: object
    workers: list
    restarts: dict
    bcast_gen: int = 0
    owns_ray: bool = False
    hooks: Hooks = field(default_factory=Hooks)
    """What the roles were started with; a restarted worker gets the same engine hook."""
    policy: str = ""
    """The Hugging Face directory of the run's initial policy, which every role loads (``prepare_policy``)."""
    cfg: Config | None = None
    """The run's config (restarts need it)."""
    active: tuple | None = None
    """(stage index, StageConfig) while an RL stage's rollout loops run (a restarted worker starts its
    loop too); None otherwise."""
    learner_pg: object = None
    """The learner ranks' placement group (``learner.num_ranks`` > 1), removed with the roles."""
    files_node: str | None = None
    """The learner's Ray node id when the driver cannot see its ``run.dir`` and ``cluster.upload_files``
    streams its checkpoints and export here (``files.py``); None: the files are shared."""


def init_ray(cfg: Config) -> bool:
    """Join RAY_ADDRESS / cluster.address (ray job submit sets it) or start a local cluster on loopback."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return False
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    from sonar.cluster.driver.jobs import driver_runtime_env, keep_sigterm_handler

    env = driver_runtime_env(os.environ)  # merged with a job's --runtime-env-json, never conflicting
    with keep_sigterm_handler():  # ray.init's own SIGTERM handler would turn `ray job stop` into FAILED
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        else:
            # address="local": always a new private cluster, never a stray one found in /tmp/ray.
            # Logical CPUs: enough for every role's request, so a local run never waits for resources
            # (the processes share the physical cores; each uses one thread).
            needed = (cfg.learner.num_cpus * cfg.learner.num_ranks
                      + cfg.rollout.num_workers * cfg.rollout.num_cpus_per_worker
                      + cfg.retrieval.replicas * cfg.retrieval.num_cpus_per_replica)
            ray.init(address="local", num_cpus=cfg.cluster.num_cpus or int(max(4, os.cpu_count() or 1, needed + 0.999)),
                     include_dashboard=False, _node_ip_address="127.0.0.1", runtime_env=env, log_to_driver=True)
    return True


def start_roles(cfg: Config, run: Run, hooks: Hooks | None = None) -> Roles:
    import ray

    from sonar.cluster.wire.replay import ReplayQueue

    hooks = hooks or Hooks()
    owns = init_ray(cfg)
    corpus = prepare_corpus(cfg, run)
    retrieval = start_retrieval(cfg, run, corpus, hooks.retriever_wrap)
    policy = prepare_policy(cfg, run)
    if cfg.world.force:
        log.warning("world.force=true: the toy world's questions with model.path=%s and retrieval.corpus=%s, as asked",
                    cfg.model.path, cfg.retrieval.corpus)
    if sum(1 for n in ray.nodes() if n.get("Alive")) > 1:  # one node sees what the driver wrote
        from sonar.cluster.driver.files import POLICY_ID_FILE, check_policy_visible

        mark = Path(policy) / POLICY_ID_FILE
        check_policy_visible(cfg, policy, mark.read_text().strip() if mark.is_file() else None)
    num_train = len(world_of(cfg).train)
    budget = inflight_budget(cfg)  # 0: no admission control, so no version-aware slots either
    replay = ray.remote(num_cpus=0)(ReplayQueue).options(max_concurrency=1000).remote(
        cfg.replay.capacity_groups, cfg.replay.max_policy_lag, cfg.replay.stale_policy, num_train, cfg.run.seed,
        budget, cfg.learner.groups_per_step if budget else 0)
    learner, learner_pg = start_learner(cfg, policy, role_resources(cfg, "learner"))
    workers = [start_worker(cfg, i, retrieval, hooks.engine_wrap, policy=policy) for i in range(cfg.rollout.num_workers)]
    try:
        ray.get([learner.ping.remote()] + [w.ready.remote() for w in workers], timeout=cfg.cluster.step_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"the learner and {len(workers)} rollout workers did not start within cluster.step_timeout_s="
            f"{cfg.cluster.step_timeout_s}s: the cluster lacks the CPUs/GPUs they ask for "
            f"(learner.num_cpus={cfg.learner.num_cpus}, learner.num_gpus={cfg.learner.num_gpus}, "
            f"rollout.num_cpus_per_worker={cfg.rollout.num_cpus_per_worker}, "
            f"rollout.num_gpus_per_worker={cfg.rollout.num_gpus_per_worker}; available {ray.available_resources()})"
        ) from None
    roles = Roles(retrieval, replay, learner, workers, {i: 0 for i in range(len(workers))},
                  owns_ray=owns, hooks=hooks, policy=policy, cfg=cfg, learner_pg=learner_pg)
    connect_broadcast(cfg, roles)
    roles.files_node = unshared_learner_node(cfg, roles, run)
    return roles


def unshared_learner_node(cfg: Config, roles: Roles, run: Run) -> str | None:
    """None when the driver sees the learner's ``run.dir`` (one node, or shared storage); else the
    learner's node id, to upload from (``files.check_run_dir`` fails first unless ``cluster.upload_files``)."""
    import ray

    from sonar.cluster.driver.files import check_run_dir

    if sum(1 for n in ray.nodes() if n.get("Alive")) <= 1:
        return None
    node = node_of(roles.learner, cfg.cluster.health_timeout_s)
    return None if check_run_dir(cfg, node, run.dir) else node


def prepare_corpus(cfg: Config, run: Run) -> str:
    if cfg.retrieval.corpus:
        return cfg.retrieval.corpus
    import hashlib

    from sonar.actors.world import write_corpus_jsonl

    # Named by content, not by seed: a changed world generator must never reuse a stale corpus/index.
    world = world_of(cfg)
    digest = hashlib.sha1(json.dumps(world.corpus, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(cfg.run.root).resolve() / "corpus" / f"world-{cfg.world.seed}-{digest}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        write_corpus_jsonl(world, tmp)
        tmp.replace(path)
    return str(path)


def prepare_policy(cfg: Config, run: Run) -> str:
    """Write the run's initial policy to ``<run>/policy`` (or name ``model.path`` as it is): every role
    loads this one directory, so none needs to know how the policy is built."""
    from sonar.actors.model import materialise_policy
    from sonar.cluster.driver.data import extra_vocab

    # Training or evaluating on files with the tiny word-level policy: its vocabulary also covers
    # the files' questions and answers and the corpus (data.extra_vocab; [] otherwise).
    policy = materialise_policy(cfg.model, world_of(cfg), run.dir / "policy", extra_vocab=extra_vocab(cfg))
    if Path(policy).resolve().is_relative_to(run.dir.resolve()):  # our copy (never the user's model.path)
        import uuid

        from sonar.cluster.driver.files import POLICY_ID_FILE

        (Path(policy) / POLICY_ID_FILE).write_text(uuid.uuid4().hex)
    return policy


def prepare_demonstrations(cfg: Config, run: Run, policy: str) -> list[bytes]:
    """SFT demonstrations of the world's training questions, one encoded group each (``encode_group``),
    for the learner, which trains on them and builds nothing itself.

    They are searched in process, through the stack the retrieval replicas run (``build_retriever``,
    without the benchmark hook), not through the service: the demonstrations are training data, so
    they must not depend on timing, and a service call can time out under load. The tokenizer is the
    policy's (``policy``: its directory). A failed search raises (a broken index fails loudly)."""
    from sonar.actors.demos import make_demonstrations
    from sonar.actors.prompts import get_protocol
    from sonar.cluster.wire.policy import load_tokenizer
    from sonar.cluster.wire.protocol import encode_group
    from sonar.retrieval.factory import build_retriever

    retriever = build_retriever(cfg.retrieval, prepare_corpus(cfg, run), indexes_dir(cfg))
    demos = make_demonstrations(world_of(cfg).train, get_protocol(cfg.protocol.name), load_tokenizer(policy),
                                retriever, cfg.protocol, cfg.retrieval.k)
    return [encode_group([d]) for d in demos]


def indexes_dir(cfg: Config) -> str:
    """Where the corpus indexes live unless ``retrieval.index_dir`` names one (``<run.root>/index``)."""
    return str(Path(cfg.run.root).resolve() / "index")


def start_retrieval(cfg: Config, run: Run, corpus: str, wrap_backend: Callable | None = None) -> list:
    """The retrieval replicas; each builds ``build_retriever(..., wrap_backend=wrap_backend)``."""
    from sonar.retrieval.factory import build_retriever
    from sonar.retrieval.server import start_retrieval_service

    rcfg = cfg.retrieval
    index_root = indexes_dir(cfg)
    build_retriever(rcfg, corpus, index_root)  # builds the index once, before replicas open it
    # retrieval.replicas actors; Ray restarts a dead one (cluster.max_replica_restarts) under the same handle,
    # so the workers' clients keep working once it answers again.
    client = start_retrieval_service(
        rcfg, lambda: build_retriever(rcfg, corpus, index_root, wrap_backend=wrap_backend),
        num_cpus=rcfg.num_cpus_per_replica, max_restarts=cfg.cluster.max_replica_restarts,
        actor_options={"resources": role_resources(cfg, "retrieval")})
    return list(client.handles)


def start_worker(cfg: Config, i: int, retrieval: list, engine_wrap: Callable | None = None, *, policy: str):
    """Rollout worker ``i``, searching through clients of the ``retrieval`` replicas (a client pickles:
    handles and settings), holding the policy loaded from the directory ``policy``.

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
    return ray.remote(RolloutWorker).options(
        num_cpus=cfg.rollout.num_cpus_per_worker, num_gpus=cfg.rollout.num_gpus_per_worker,
        resources=role_resources(cfg, "rollout"), max_concurrency=4, name=None).remote(i, cfg, client, eval_retriever=eval_client, policy=policy,
                                             engine_wrap=engine_wrap)


def role_resources(cfg: Config, role: str) -> dict | None:
    """The extra Ray resources ``cluster.role_resources`` gives ``role`` (None: none), e.g. a custom
    resource only one node type declares, so the role lands there."""
    return dict(cfg.cluster.role_resources.get(role, {})) or None


def node_of(handle, timeout_s: float) -> str:
    """The Ray node id an actor runs on (asked of the actor itself)."""
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()),
                   timeout=timeout_s)


def check_reachable(cfg: Config, roles: Roles, addr: str) -> None:
    """A broadcast rendezvous on loopback (``cluster.bind_host``) reaches only the learner's own node:
    fail naming the workers elsewhere, rather than letting them time out dialling their own loopback."""
    import ray

    from sonar.cluster.wire.weights import is_loopback

    # Only the explicit choice: a simulated cluster's nodes have distinct 127/8 addresses of their own.
    if cfg.cluster.bind_host != "loopback" or not is_loopback(addr) or sum(1 for n in ray.nodes() if n.get("Alive")) <= 1:
        return
    home = node_of(roles.learner, cfg.cluster.health_timeout_s)
    away = [i for i, w in enumerate(roles.workers) if node_of(w, cfg.cluster.health_timeout_s) != home]
    if away:
        raise RuntimeError(f"cluster.bind_host={cfg.cluster.bind_host!r}: the learner's broadcast listens on {addr}, "
                           f"but rollout workers {away} run on other nodes and cannot reach it (use 'auto' or the "
                           "learner node's address)")


def connect_broadcast(cfg: Config, roles: Roles) -> None:
    """(Re)build the broadcast group: every rank must join concurrently; layouts must agree.

    Ranks: the learner is 0; worker i takes ``broadcast_ranks()`` consecutive ranks from ``bases[i]``
    (one for a transformers engine, one per tensor-parallel rank of a vLLM engine, whose worker
    processes join themselves). The group meets at the learner's node address, on a port the learner
    has bound (``broadcast_endpoint``); gloo unless every rank has a GPU (``broadcast_backend``)."""
    import ray

    from sonar.cluster.wire.config import broadcast_backend

    roles.bcast_gen += 1
    prefix = f"sonar-weights-{roles.bcast_gen}"
    ranks = ray.get([w.broadcast_ranks.remote() for w in roles.workers], timeout=cfg.cluster.health_timeout_s)
    bases = [1 + sum(ranks[:i]) for i in range(len(ranks))]
    n = 1 + sum(ranks)
    addr, port = ray.get(roles.learner.broadcast_endpoint.remote(n), timeout=cfg.cluster.health_timeout_s)
    check_reachable(cfg, roles, addr)
    backend = broadcast_backend(cfg)
    # The learner's specs (names, shapes, dtypes: a few KB) set the buckets' dtypes on every rank: a bf16
    # learner sends bf16 to engines holding float32, which cast on load.
    sender = ray.get(roles.learner.param_specs.remote(), timeout=cfg.cluster.health_timeout_s)
    refs = [roles.learner.setup_broadcast.remote(addr, port, n, backend, prefix)]
    refs += [w.setup_broadcast.remote(addr, port, b, n, backend, prefix, sender) for w, b in zip(roles.workers, bases)]
    digests = ray.get(refs, timeout=cfg.cluster.health_timeout_s)
    if len(set(digests)) != 1:
        raise RuntimeError(f"weight layouts differ between the learner and the workers: {digests} "
                           "(model.* config or model.path must be the same for every role)")
    push_weights(roles)


def push_weights(roles: Roles) -> dict:
    """One collective push: learner -> every worker. Only the version number crosses Ray.

    A worker that died meanwhile is restarted (``restart_worker``: the group is rebuilt with the new
    worker and the weights pushed again inside it), or the run fails naming it."""
    import ray

    v = ray.get(roles.learner.ping.remote())["version"]
    sent_ref = roles.learner.broadcast.remote()
    got = call_workers(roles, lambda w, i: w.receive_weights.remote(v), "receive_weights", retry=False)
    if any(g is _DIED for g in got):
        # The learner's half of the broken collective fails (its peer is gone) or was superseded:
        # restart_worker rebuilt the group and pushed the current weights to every worker.
        try:
            ray.get(sent_ref)
        except ray.exceptions.RayActorError:
            raise
        except Exception:  # noqa: BLE001 - the broken group's send; the rebuilt one delivered
            pass
        return {}
    sent = ray.get(sent_ref)
    return {K.WEIGHTS_SYNC_S: sent["seconds"], K.WEIGHTS_GBPS: sent["bytes"] / max(sent["seconds"], 1e-9) / 1e9}


REPLICA_RECHECK_S = 1.0
"""Seconds between two health probes of a dead retrieval replica in the workers' clients."""

_DIED = object()
"""``call_workers``' result for a worker that died during the call and was restarted (``retry=False``)."""


def call_workers(roles: Roles, call: Callable, what: str, *, retry: bool = True, timeout: float | None = None,
                 only: list[int] | None = None) -> list:
    """The one place the driver calls rollout workers: ``call(handle, index)`` -> ObjectRef for every
    worker (or those in ``only``), all at once; returns their results in worker order.

    A worker whose call fails because it died (``RayActorError``) is restarted (``restart_worker``:
    its claimed prompts requeued, the broadcast group rebuilt, its rollout loop started when a stage is
    running) within ``cluster.max_worker_restarts``, else ``WorkerFailed`` names it and the call. With
    ``retry`` the call is then made once more on the new worker; without, its result is ``_DIED``.
    Any other error is the call's own and propagates."""
    import ray

    cfg = roles.cfg
    idx = list(range(len(roles.workers))) if only is None else list(only)
    refs = {i: call(roles.workers[i], i) for i in idx}
    out: dict[int, object] = {}
    dead: list[tuple[int, str]] = []
    for i in idx:
        try:
            out[i] = ray.get(refs[i], timeout=timeout)
        except ray.exceptions.RayActorError as e:
            dead.append((i, f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            out[i] = _DIED
    for i, err in dead:
        stage_index, stage = roles.active or (None, None)
        restart_worker(cfg, roles, i, err, stage_index, stage)
        if retry:
            out[i] = call_workers(roles, call, what, retry=False, timeout=timeout, only=[i])[0]
    return [out[i] for i in idx]


def stop_roles(roles: Roles | None) -> None:
    import ray

    if roles is not None:
        for w in roles.workers:
            try:
                ray.get(w.stop.remote(timeout_s=5), timeout=10)
            except Exception:
                pass
    if roles is not None and ray.is_initialized():
        remove_learner_group(roles.learner_pg)
    if ray.is_initialized() and (roles is None or roles.owns_ray):
        ray.shutdown()


def check_workers(cfg: Config, roles: Roles, stage_index: int, stage: StageConfig) -> dict:
    """Health check every iteration: a dead or silent worker is restarted or fails the run loudly.

    Every worker is asked at once and all answers share one deadline (``cluster.health_timeout_s``),
    so a silent worker costs one timeout per check, not one per worker. Restarts then run in worker
    order, as the answers were judged."""
    import ray

    refs = [w.health.remote() for w in roles.workers]
    # Wait: for every answer or the deadline. A dead actor's call finishes at once, with its error.
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=cfg.cluster.health_timeout_s)[0]) if refs else set()
    recent: list[dict] = []
    for i, ref in enumerate(refs):
        h, err = None, (f"GetTimeoutError: no health answer within cluster.health_timeout_s="
                        f"{cfg.cluster.health_timeout_s}s")
        if ref in ready:
            try:
                h = ray.get(ref)
                stopped = not h["alive"] and cfg.cluster.mode == "async"
                err = h["error"] or ("rollout loop is not running" if stopped else None)
                if err is None and cfg.cluster.mode == "async" and h["idle_s"] > cfg.cluster.step_timeout_s:
                    err = f"no progress for {h['idle_s']:.0f}s"
            except Exception as e:  # the actor died (RayActorError) or its health call raised
                h, err = None, f"{type(e).__name__}: {e}"
        if err is None:
            recent.extend(h["recent"])
            continue
        restart_worker(cfg, roles, i, err, stage_index, stage)
    return rollout_metrics(recent)


class WorkerFailed(RuntimeError):
    pass


def restart_worker(cfg: Config, roles: Roles, i: int, err: str, stage_index: int | None = None,
                   stage: StageConfig | None = None) -> None:
    """Worker ``i`` died or hangs: requeue its claimed prompts, start a new one in its place (within
    ``cluster.max_worker_restarts``, else ``WorkerFailed`` naming it), rebuild the broadcast group with
    it and push the current weights. When ``stage`` is given (an RL stage is running, async mode) the
    rollout loops are paused for the rebuild and started again, the new worker's too."""
    import ray

    requeued = ray.get(roles.replay.release_worker.remote(i))
    if roles.restarts[i] >= cfg.cluster.max_worker_restarts:
        raise WorkerFailed(f"rollout worker {i} failed ({requeued} prompts requeued) and "
                           f"cluster.max_worker_restarts={cfg.cluster.max_worker_restarts} is used up:\n{err}")
    roles.restarts[i] += 1
    log.warning("restarting rollout worker %d (restart %d): %s", i, roles.restarts[i], err.splitlines()[-1] if err else err)
    try:
        ray.kill(roles.workers[i], no_restart=True)
    except Exception:
        pass
    roles.workers[i] = start_worker(cfg, i, roles.retrieval, roles.hooks.engine_wrap, policy=roles.policy)
    ray.get(roles.workers[i].ready.remote(), timeout=cfg.cluster.step_timeout_s)
    running = stage is not None and cfg.cluster.mode == "async"
    # The broadcast group includes every rank, so it is rebuilt: pause the others first (closing the
    # queue releases a producer blocked on backpressure; its prompt is requeued), then resume all.
    if running:
        ray.get(roles.replay.close.remote())
        call_workers(roles, lambda w, j: w.stop.remote(), "stop", retry=False,
                     only=[j for j in range(len(roles.workers)) if j != i])
        ray.get(roles.replay.reopen.remote())
    connect_broadcast(cfg, roles)
    if running:
        call_workers(roles, lambda w, j: w.start.remote(roles.replay, stage_index, stage), "start")


def stop_rollouts(roles: Roles) -> None:
    import ray

    roles.active = None  # a worker found dead from here on is restarted without a rollout loop
    ray.get(roles.replay.close.remote())
    call_workers(roles, lambda w, i: w.stop.remote(), "stop", retry=False)
    ray.get(roles.replay.drain.remote())


def verify_weights(roles: Roles) -> dict:
    """After a final push, every worker must hold exactly the learner's weights (checksums equal)."""
    import ray

    push_weights(roles)
    call_workers(roles, lambda w, i: w.apply_staged_weights.remote(), "apply_staged_weights")
    learner = ray.get(roles.learner.checksum.remote())
    workers = call_workers(roles, lambda w, i: w.checksum.remote(), "checksum")
    produced = [h["stats"]["trajectories"] for h in call_workers(roles, lambda w, i: w.health.remote(), "health")]
    ok = all(w["version"] == learner["version"] and
             (w["checksum"] is None or abs(w["checksum"] - learner["checksum"]) <= 1e-9 * abs(learner["checksum"]))
             for w in workers)
    if not ok:
        raise RuntimeError(f"weights diverged after the final push: learner {learner}, workers {workers}")
    return {"learner": learner, "workers": workers, "worker_trajectories": produced}


class ReplicaFailed(RuntimeError):
    pass


class LearnerDied(RuntimeError):
    pass


def check_retrieval(cfg: Config, roles: Roles) -> dict:
    """Ping every retrieval replica at once (``health()``: a cheap actor call), one shared deadline
    (``cluster.health_timeout_s``). A replica Ray is restarting (``ActorUnavailableError``), or that
    is silent, counts as unhealthy for now: the workers' clients wait for it (``cluster.retrieval_wait_s``).
    One that is gone for good (its ``cluster.max_replica_restarts`` used up) is reported; when every
    replica is gone the run fails with ``ReplicaFailed`` naming them. Returns the healthy count."""
    import ray

    refs = [h.health.remote() for h in roles.retrieval]
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=cfg.cluster.health_timeout_s)[0])
    healthy, gone = 0, []
    for i, ref in enumerate(refs):
        if ref not in ready:
            continue
        try:
            healthy += bool(ray.get(ref).get("ok"))
        except ray.exceptions.ActorDiedError as e:
            gone.append(f"retrieval replica {i}: {type(e).__name__}")
        except ray.exceptions.RayActorError:  # restarting (ActorUnavailableError): it comes back
            pass
    if gone and len(gone) == len(refs):
        raise ReplicaFailed(f"every retrieval replica is dead and cluster.max_replica_restarts="
                            f"{cfg.cluster.max_replica_restarts} is used up: {'; '.join(gone)}")
    if gone:
        log.warning("retrieval running degraded: %s", "; ".join(gone))
    return {K.RETRIEVAL_REPLICAS_HEALTHY: float(healthy)}


def learner_dead(cfg: Config, roles: Roles | None) -> bool:
    """Whether the learner actor is gone (its ``ping`` raises ``RayActorError``)."""
    import ray

    if roles is None:
        return False
    try:
        ray.get(roles.learner.ping.remote(), timeout=cfg.cluster.health_timeout_s)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - alive but busy or failing: not a death
        return False
    return False


def kill_roles(roles: Roles) -> None:
    """Kill every actor of ``roles`` (workers, learner, replay, retrieval replicas), keeping Ray up:
    a learner death ends this set of roles and ``train`` starts a new one (``cluster.auto_resume``)."""
    import ray

    for h in [*roles.workers, roles.learner, roles.replay, *roles.retrieval]:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
    remove_learner_group(roles.learner_pg)


def maybe_checkpoint(cfg: Config, roles: Roles, run: Run, stage_index: int, steps: int) -> None:
    if cfg.run.checkpoint_every and steps % cfg.run.checkpoint_every == 0 and steps < cfg.stages[stage_index].steps:
        save_checkpoint(roles, run, stage_index, steps, tag=f"step{run.step}")


def save_checkpoint(roles: Roles, run: Run, resume_stage: int, resume_step: int, tag: str) -> str:
    """Learner state + replay accounting and prompt cursor. Groups still queued are not saved: their
    prompts are requeued in the cursor, so after a resume nothing is lost and nothing trained twice."""
    import ray

    replay_state = ray.get(roles.replay.state_dict.remote())
    path = str(run.dir / "checkpoints" / tag)
    path = ray.get(roles.learner.save_checkpoint.remote(
        path, {"resume_stage": resume_stage, "resume_step": resume_step, "replay": replay_state,
               "run_step": run.step}))
    if roles.files_node is not None:  # the learner's node does not share run.dir: bring it here
        from sonar.cluster.driver.files import fetch_dir

        fetch_dir(roles.files_node, path, path)
    log.info("checkpoint saved: %s", path)
    return path


def maybe_resume(cfg: Config, roles: Roles, run: Run) -> tuple[int, int]:
    if not cfg.run.resume:
        return 0, 0
    import ray

    from sonar.learner.checkpoint import resolve_checkpoint

    # Resolved and checked by start_run, before Ray started (a harness's own Run may not have it).
    path = run.resume_from or resolve_checkpoint(cfg.run.resume, cfg.run.root)
    state = ray.get(roles.learner.load_checkpoint.remote(path))
    # The saved cursor spans the question set of the stage it was walking (files or the world): size
    # the replay's cursor to match before loading it (its check then holds).
    ray.get(roles.replay.set_num_prompts.remote(
        cursor_prompts(cfg, int(state["resume_stage"]), int(state["resume_step"]))))
    ray.get(roles.replay.load_state_dict.remote(state["replay"]))
    run.step = state.get("run_step", 0)
    push_weights(roles)
    # MLflow params are write-once: an auto-resume (cluster.auto_resume) logs its checkpoint under its own key.
    n = run.results.get("faults", {}).get("learner_resumes", 0)
    run.sink.log_params({"run.resumed_from" if n == 0 else f"run.auto_resumed_from.{n}": path})
    log.info("resumed from %s at version %d, stage %d step %d", path, state["version"], state["resume_stage"],
             state["resume_step"])
    return int(state["resume_stage"]), int(state["resume_step"])


def export_model(cfg: Config, roles: Roles, run: Run) -> str:
    import ray

    path = ray.get(roles.learner.export_hf.remote(str(run.dir / "model")))
    if roles.files_node is not None:  # the learner's node does not share run.dir: bring it here
        from sonar.cluster.driver.files import fetch_dir

        fetch_dir(roles.files_node, path, path)
    if cfg.tracking.log_model:  # transformers flavour, registered when tracking.registered_model_name is set
        import yaml

        uri = run.sink.log_model(path, eval_table=eval_table(run.results), config=yaml.safe_load(to_yaml(cfg)))
        if uri:
            log.info("final policy logged to MLflow as %s", uri)
    return path

