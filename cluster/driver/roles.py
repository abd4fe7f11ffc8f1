"""The roles and their lifecycle: Ray, retrieval service, replay queue, learner, rollout workers.

Starting, health-checking and stopping them; checkpoints and export. The rollout workers are the
pool's (``rollout_pool.RolloutPool``: their start, health, restarts, the weight transport's group and
the push, every call to them): ``start_roles`` starts the other roles and hands the workers to it.
The driver holds only handles and small dicts: trajectories go worker -> replay -> learner, weights
go over the transport (the broadcast group).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sonar.cluster.driver.data import cursor_prompts
from sonar.cluster.driver.demands import role_resources
from sonar.cluster.driver.learner_ranks import remove_learner_group, start_learner
from sonar.cluster.driver.reaper import start_reaper
from sonar.cluster.driver.replica_pool import ReplicaPool
from sonar.cluster.driver.reports import answer, eval_table, startup_phase
from sonar.cluster.driver.rollout_pool import RolloutPool, node_of
from sonar.cluster.driver.run import Run, world_of
from sonar.cluster.wire.startup import startup_without_gc
from sonar.cluster.wire.config import Config, inflight_budget, to_yaml, worker_capacity
from sonar.cluster.wire.policy import ADAPTER_DIR
from sonar.cluster.wire.resolved import colocated_on_gpu

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
    on_pool: Callable | None = None
    """Called in the driver's process (never sent to an actor) by the rollout pool at the points its
    fault tests synchronise on, as ``on_pool(event, pool)``: ``"group_open"`` (the learner's endpoint of
    the weight transport is open, no rank has joined yet) and ``"push_sent"`` (the learner's send is
    submitted, no worker's receive yet); ``rollout_pool`` module docstring."""
    on_learner_step: Callable | None = None
    """Called in the driver's process (never sent to an actor) with each trained RL step's learner metrics,
    after the learner step and before the weights go out, as ``on_learner_step(metrics) -> dict | None``;
    what it returns is logged with the step (and may replace the step's metrics). The push, hence the
    version the workers generate with, waits for it: a benchmark's simulated real-size learner time
    enters here (``bench/sim/hooks.py``: ``LearnerTime``)."""


@dataclass
class Roles:
    replicas: ReplicaPool
    """The retrieval replicas and every call to them (``replica_pool``)."""
    replay: object
    learner: object
    pool: RolloutPool
    """The rollout workers and every call to them (``rollout_pool``)."""
    owns_ray: bool = False
    hooks: Hooks = field(default_factory=Hooks)
    """What the roles were started with; a restarted worker gets the same engine hook."""
    policy: str = ""
    """The Hugging Face directory of the run's initial policy, which every role loads (``prepare_policy``)."""
    cfg: Config | None = None
    """The run's config."""
    learner_pg: object = None
    """The learner ranks' placement group (``learner.num_ranks`` > 1), removed with the roles."""
    files_node: str | None = None
    """The learner's Ray node id when the driver cannot see its ``run.dir`` and ``cluster.upload_files``
    streams its checkpoints and export here (``files.py``); None: the files are shared."""

    @property
    def retrieval(self) -> list:
        """The retrieval replicas' handles, slot i at index i: ``replicas.handles``, to read (the pool calls them)."""
        return self.replicas.handles

    @property
    def workers(self) -> list:
        """The rollout workers' handles, worker i at index i: ``pool.workers``, to read (the pool calls them)."""
        return self.pool.workers

    @property
    def restarts(self) -> dict:
        """Restarts per rollout worker index so far (``pool.restarts``)."""
        return self.pool.restarts


NODE_START_TIMEOUT = "timed out during startup"
"""Ray's error when the raylet has not registered with the GCS within the fixed 30 s that
``ray._private.node.Node`` waits (not configurable in Ray 2.60). On a loaded machine the usual cause is
the raylet exiting first: it waits a fixed ~20 s of its own for the dashboard agent (a Python process
with many imports) to write its ports (``node_manager.cc``: "Timed out waiting for file
.../dashboard_agent_listen_port_*"), and ``RAY_agent_register_timeout_ms`` does not change that wait."""


_REAPERS: list = []
"""The watchdogs of the Ray nodes this driver started (``reaper.start_reaper``), held for its life: closing
a watchdog's pipe is what tells it the node is over."""


def start_local_node(start: Callable, attempts: int = 3):
    """Return ``start()``, which starts a Ray node in this process (``ray.init(address="local")``, a
    ``ray.cluster_utils.Cluster``), retried when Ray's fixed wait for the raylet ran out. A failed attempt
    leaves its GCS, raylet and reaper running with no handle returned: they are the children of this
    process that were not there before it (Ray starts each with Popen), and are killed with their own
    children by pid (never by name) before the next try. Processes under an older child (a node added
    before) are not touched.

    Every node started here is on the machine this process runs on, so it gets ``sonar.cluster.wire.bootstrap.LOCAL_NODE_ENV``
    (its actors at the driver's priority) unless the environment already says otherwise: the driver's
    private cluster, the benchmarks' and the tests' clusters alike."""
    import psutil

    from sonar.cluster.wire.bootstrap import set_local_node_env

    set_local_node_env()  # the raylet reads it from the environment it inherits
    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in me.children()}
        try:
            return start()
        except Exception as e:
            if NODE_START_TIMEOUT not in str(e) or attempt == attempts:
                raise
            left = []
            for child in me.children():
                if child.pid not in before:
                    try:
                        left += [child, *child.children(recursive=True)]
                    except psutil.NoSuchProcess:
                        pass
            log.warning("Ray's node start timed out (attempt %d of %d: the raylet did not register in Ray's "
                        "fixed 30 s; a loaded machine?): stopping the %d processes it started and retrying",
                        attempt, attempts, len(left))
            kill_processes(left)


def kill_processes(procs: list, timeout_s: float = 30.0) -> None:
    """SIGKILL each ``psutil.Process`` (by pid; one already gone is skipped) and reap them, waiting at most
    ``timeout_s``: how Sonar stops processes it started but holds no handle of."""
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def init_ray(cfg: Config) -> bool:
    """Join RAY_ADDRESS / cluster.address (ray job submit sets it) or start a local cluster on loopback."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from sonar.cluster.wire.logs import restamp

    restamp(("ray",))  # the driver's ray.* lines with Sonar's log date (cluster/wire/logs.py)
    if ray.is_initialized():
        return False
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    from sonar.cluster.driver.jobs import driver_runtime_env, keep_sigterm_handler, merge_override

    env = driver_runtime_env(os.environ)  # merged with a job's --runtime-env-json, never conflicting
    # keep_sigterm_handler: ray.init's own SIGTERM handler would turn `ray job stop` into FAILED;
    # merge_override: a job's own py_modules, which env names before the checkout's, are not refused.
    with keep_sigterm_handler(), merge_override(env):
        if address:
            ray.init(address=address, runtime_env=env or None, log_to_driver=True)
        else:
            # address="local": always a new private cluster, never a stray one found in /tmp/ray.
            # Logical CPUs: enough for every role's request, so a local run never waits for resources
            # (the processes share the physical cores; each uses one thread).
            needed = roles_cpus(cfg)
            num_cpus = cfg.cluster.num_cpus or int(max(4, os.cpu_count() or 1, needed + 0.999))
            import psutil

            before = {p.pid for p in psutil.Process().children()}
            start_local_node(lambda: ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                                              _node_ip_address="127.0.0.1", runtime_env=env or None,
                                              log_to_driver=True))
            # The node's processes die with this driver, its agents included, however it dies (reaper.py).
            reaper = start_reaper([p.pid for p in psutil.Process().children() if p.pid not in before])
            if reaper is not None:
                _REAPERS.append(reaper)
    return True


@startup_without_gc()  # Ray's, transformers' and the index's imports, the policy (cluster/wire/startup.py)
def start_roles(cfg: Config, run: Run, hooks: Hooks | None = None) -> Roles:
    import ray

    from sonar.cluster.replay.queue import ReplayQueue

    hooks = hooks or Hooks()
    with startup_phase("ray"):
        owns = init_ray(cfg)
    with startup_phase("corpus and index"):
        corpus = prepare_corpus(cfg, run)
    with startup_phase("retrieval service"):
        retrieval = start_retrieval(cfg, run, corpus, hooks.retriever_wrap)
    with startup_phase("policy"):
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
        budget, cfg.learner.groups_per_step if budget else 0, worker_capacity(cfg),
        bool(budget) and cfg.replay.just_in_time, cfg.rollout.group_size)
    with startup_phase("learner and rollout workers"):
        learner, learner_pg = start_learner(cfg, policy, role_resources(cfg, "learner"))
        if colocated_on_gpu(cfg):
            # Waits: vLLM refuses to start unless vllm_gpu_memory_utilization of the GPU is free, so each
            # engine must start beside the learner in its generation-phase memory (states offloaded), as the
            # memory plan's generation row counts it.
            ray.get(learner.offload_states.remote(), timeout=cfg.cluster.step_timeout_s)
        pool = RolloutPool(cfg, learner=learner, replay=replay, retrieval=retrieval.handles, policy=policy,
                           placement_group=learner_pg,
                           engine_wrap=hooks.engine_wrap, on_event=hooks.on_pool)
        retrieval.on_replace = pool.replace_replica  # a replacement replica reaches every worker's clients
        pool.start(cfg.rollout.num_workers)
        try:
            learner_info = ray.get(learner.ping.remote(), timeout=cfg.cluster.step_timeout_s)
            workers_info = pool.ready()  # a worker that dies while starting is restarted; one still starting at the deadline raises
            log_code_origins(learner_info.get("code"), [w.get("code") for w in workers_info])
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(start_timeout_message(cfg, ray.cluster_resources(), ray.available_resources())) from None
    roles = Roles(retrieval, replay, learner, pool, owns_ray=owns, hooks=hooks, policy=policy, cfg=cfg,
                  learner_pg=learner_pg)
    with startup_phase("weight transport"):
        pool.form_group()  # every worker and the learner join the weight transport; the weights pushed
    roles.files_node = unshared_learner_node(cfg, roles, run)
    return roles


def roles_cpus(cfg: Config) -> float:
    """Logical CPUs the run's roles ask for: the learner's ranks, the rollout workers, the retrieval replicas."""
    return (cfg.learner.num_cpus * cfg.learner.num_ranks + cfg.rollout.num_workers * cfg.rollout.num_cpus_per_worker
            + cfg.retrieval.replicas * cfg.retrieval.num_cpus_per_replica)


def start_timeout_message(cfg: Config, total: dict, available: dict) -> str:
    """Why the learner and the rollout workers did not answer within ``cluster.step_timeout_s``, from
    the cluster's resources (``ray.cluster_resources()``, ``ray.available_resources()``): fewer CPUs/GPUs
    in all than the roles ask for (the retrieval replicas' included), or enough in all, so the roles wait
    for what another job holds or are still starting. The second is what a busy machine gives: in a loaded
    run (two busy loops beside ``make test``) a learner and two workers took over 90 s to start."""
    learner, rollout = cfg.learner, cfg.rollout
    cpus = roles_cpus(cfg)
    gpus = learner.num_gpus * learner.num_ranks + rollout.num_workers * rollout.num_gpus_per_worker
    asked = (f"learner.num_cpus={learner.num_cpus}, learner.num_gpus={learner.num_gpus}, learner.num_ranks="
             f"{learner.num_ranks}, rollout.num_cpus_per_worker={rollout.num_cpus_per_worker}, "
             f"rollout.num_gpus_per_worker={rollout.num_gpus_per_worker}, with the retrieval replicas "
             f"{cpus:g} CPUs and {gpus:g} GPUs")
    head = (f"the learner and {rollout.num_workers} rollout workers did not start within cluster.step_timeout_s="
            f"{cfg.cluster.step_timeout_s}s")
    has_cpus, has_gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    if has_cpus < cpus or has_gpus < gpus:
        return (f"{head}: the cluster has {has_cpus:g} CPUs and {has_gpus:g} GPUs in all, fewer than they ask for "
                f"({asked})")
    return (f"{head}: the cluster has the CPUs/GPUs they ask for ({asked}; {has_cpus:g} CPUs and {has_gpus:g} "
            f"GPUs in all, available now {available}), so they wait for resources another job holds or are still "
            f"starting (their imports and the policy's load can take minutes on a busy machine): raise "
            f"cluster.step_timeout_s")


def unshared_learner_node(cfg: Config, roles: Roles, run: Run) -> str | None:
    """None when the driver sees the learner's ``run.dir`` (one node, or shared storage); else the
    learner's node id, to upload from (``files.check_run_dir`` fails first unless ``cluster.upload_files``)."""
    import ray

    from sonar.cluster.driver.files import check_run_dir

    if sum(1 for n in ray.nodes() if n.get("Alive")) <= 1:
        return None
    node = node_of(roles.learner, cfg.cluster.health_timeout_s)
    return None if check_run_dir(cfg, node, run.dir) else node


def prepare_corpus(cfg: Config, run: Run) -> str | None:
    """``retrieval.corpus``, else the synthetic world's written to ``<run.root>/corpus``; None for
    ``retrieval.backend=http`` without one: the server holds its corpus and Sonar builds no index."""
    if cfg.retrieval.corpus:
        return cfg.retrieval.corpus
    if cfg.retrieval.backend == "http":
        return None
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


def log_code_origins(learner: str | None, workers: list) -> None:
    """One line saying which Sonar the driver, the learner and the rollout workers import (a job from a
    checkout runs the checkout's: ``cluster/driver/jobs.py``) and from which folders; a warning naming the
    roles that differ. Version and fingerprint are compared, not the folders: a job's actors run Ray's
    unpacked copy of the driver's checkout."""
    from sonar.cluster.wire.paths import code_origin

    mine = code_origin()
    others = {"learner": learner, **{f"rollout worker {i}": w for i, w in enumerate(workers)}}
    code = lambda origin: str(origin).split(" from ")[0]
    where = lambda origin: str(origin).split(" from ", 1)[-1]
    differ = {name: c for name, c in others.items() if code(c) != code(mine)}
    if differ:
        log.warning("code: the driver runs %s but %s", mine, "; ".join(f"{n} runs {c}" for n, c in differ.items()))
    else:
        folders = sorted({where(c) for name, c in others.items() if name != "learner"})
        log.info("code: driver, learner and %d rollout workers run %s (driver from %s; learner from %s; "
                 "rollout workers from %s)", len(workers), code(mine), where(mine), where(learner),
                 ", ".join(folders) or "-")


def prepare_policy(cfg: Config, run: Run) -> str:
    """Write the run's initial policy to ``<run>/policy`` (or name ``model.path`` as it is): every role
    loads this one directory, so none needs to know how the policy is built."""
    from sonar.actors.model import materialise_policy
    from sonar.cluster.driver.data import extra_vocab

    # Training or evaluating on files with the tiny word-level policy: its vocabulary also covers
    # the files' questions and answers and the corpus (data.extra_vocab; [] otherwise).
    from sonar.actors.tools import tool_tags

    policy = materialise_policy(cfg.model, world_of(cfg), run.dir / "policy", extra_vocab=extra_vocab(cfg),
                                extra_tags=tool_tags(cfg))
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
    from sonar.actors.tools import build_tools

    demos = make_demonstrations(world_of(cfg).train, get_protocol(cfg.protocol.name), load_tokenizer(policy),
                                retriever, cfg.protocol, cfg.retrieval.k, tools=build_tools(cfg))
    return [encode_group([d]) for d in demos]


def indexes_dir(cfg: Config) -> str:
    """Where the corpus indexes live unless ``retrieval.index_dir`` names one (``<run.root>/index``)."""
    return str(Path(cfg.run.root).resolve() / "index")


def start_retrieval(cfg: Config, run: Run, corpus: str | None, wrap_backend: Callable | None = None) -> ReplicaPool:
    """The retrieval replicas, in their pool; each builds ``build_retriever(..., wrap_backend=wrap_backend)``."""
    from sonar.retrieval.factory import build_retriever
    from sonar.retrieval.server import start_retrieval_service

    from sonar.retrieval.factory import probe_retriever

    # builds the index once, before replicas open it; then one query, no retries: a search service that is
    # down stops the run here, naming its address, before any learner or rollout worker holds a GPU
    probe_retriever(build_retriever(cfg.retrieval, corpus, indexes_dir(cfg), resilient=False), cfg.retrieval)
    # retrieval.replicas actors; Ray restarts a dead one (cluster.max_replica_restarts) under the same handle,
    # so the workers' clients keep working once it answers again (past that, ReplicaPool.replace).
    return ReplicaPool(cfg, start_replicas(cfg, corpus, cfg.retrieval.replicas, wrap_backend),
                       start=lambda n: start_replicas(cfg, corpus, n, wrap_backend))


def start_replicas(cfg: Config, corpus: str | None, n: int, wrap_backend: Callable | None = None) -> list:
    """``n`` retrieval replica actors over the index of ``corpus`` (built already), each answering
    ``health()`` when this returns; their handles."""
    from sonar.retrieval.factory import build_retriever
    from sonar.retrieval.server import start_retrieval_service

    rcfg, index_root, sources = cfg.retrieval, indexes_dir(cfg), dict(cfg.plugins)  # a file plug-in's code travels
    client = start_retrieval_service(
        rcfg, lambda: build_retriever(rcfg, corpus, index_root, wrap_backend=wrap_backend, plugins=sources), num_replicas=n,
        num_cpus=rcfg.num_cpus_per_replica, max_restarts=cfg.cluster.max_replica_restarts,
        actor_options={"resources": role_resources(cfg, "retrieval")})
    return list(client.handles)


def stop_roles(roles: Roles | None) -> None:
    import ray

    if roles is not None and ray.is_initialized():
        roles.pool.shutdown()
    if roles is not None and ray.is_initialized():
        remove_learner_group(roles.learner_pg)
    if ray.is_initialized() and (roles is None or roles.owns_ray):
        ray.shutdown()


def dead_role(cfg: Config, roles: Roles | None) -> str | None:
    """Which of the run's stateful roles is gone: ``"learner"`` (its ``ping`` raises ``RayActorError``),
    ``"replay queue"`` (its ``stats``), or None. Both hold state that only a checkpoint restores (the
    policy and optimizer; the prompt cursor and the accounting), so either death ends this set of roles."""
    import ray

    if roles is None:
        return None
    for name, call in (("learner", lambda: roles.learner.ping.remote()), ("replay queue", lambda: roles.replay.stats.remote())):
        try:
            ray.get(call(), timeout=cfg.cluster.health_timeout_s)
        except ray.exceptions.RayActorError:
            return name
        except Exception:  # noqa: BLE001 - alive but busy or failing: not a death
            pass
    return None


def kill_roles(roles: Roles) -> None:
    """Kill every actor of ``roles`` (workers, learner, replay, retrieval replicas), keeping Ray up:
    a learner death ends this set of roles and ``train`` starts a new one (``cluster.auto_resume``)."""
    import ray

    roles.pool.kill()
    roles.replicas.kill()
    for h in [roles.learner, roles.replay]:
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

    replay_state = answer(run.cfg, roles.replay.state_dict.remote(), "replay queue", "state_dict")
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

    from sonar.cluster.driver.run import resolve_resume_path

    # Resolved and checked by start_run, before Ray started (a harness's own Run may not have it).
    path = run.resume_from or resolve_resume_path(cfg)
    state = ray.get(roles.learner.load_checkpoint.remote(path))
    # The saved cursor spans the question set of the stage it was walking (files or the world): size
    # the replay's cursor to match before loading it (its check then holds).
    answer(cfg, roles.replay.set_num_prompts.remote(
        cursor_prompts(cfg, int(state["resume_stage"]), int(state["resume_step"]))), "replay queue", "set_num_prompts")
    answer(cfg, roles.replay.load_state_dict.remote(state["replay"]), "replay queue", "load_state_dict")
    run.step = state.get("run_step", 0)
    roles.pool.push()
    # MLflow params are write-once: an auto-resume (cluster.auto_resume) logs its checkpoint under its own key.
    n = sum(run.results.get("faults", {}).get(k, 0) for k in ("learner_resumes", "replay_resumes"))
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
    if cfg.learner.lora.rank:  # the trained adapter alone (megabytes; PeftModel.from_pretrained on the base)
        run.sink.log_artifacts(str(Path(path) / ADAPTER_DIR), ADAPTER_DIR)
    if cfg.tracking.log_model:  # transformers flavour, registered when tracking.registered_model_name is set
        import yaml

        uri = run.sink.log_model(path, eval_table=eval_table(run.results), config=yaml.safe_load(to_yaml(cfg)))
        if uri:
            log.info("final policy logged to MLflow as %s", uri)
    return path

