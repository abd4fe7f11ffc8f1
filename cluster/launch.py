"""The driver: config -> Ray -> roles -> the training loop -> evaluation -> export.

``train(cfg)`` fits on one screen; every step it calls is a named function below it. The driver
holds only handles and small dicts: trajectories go worker -> replay -> learner, weights go over
the broadcast group, and only the driver writes to MLflow.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster import tracking as K
from cluster.config import Config, StageConfig, flatten, inflight_budget, to_dict, to_yaml

log = logging.getLogger("sonar")


def train(cfg: Config) -> dict:
    run = start_run(cfg)
    roles = None
    try:
        roles = start_roles(cfg, run)
        start_stage, start_step = maybe_resume(cfg, roles, run)
        for index, stage in enumerate(cfg.stages):
            if index < start_stage:
                continue
            first = start_step if index == start_stage else 0
            if stage.kind == "sft":
                run_sft_stage(cfg, roles, run, index, stage, first)
            else:
                run_rl_stage(cfg, roles, run, index, stage, first)
            save_checkpoint(roles, run, index + 1, 0, tag=f"stage{index}")
        run.results["weights"] = verify_weights(roles)
        run.results["final"] = evaluate(cfg, roles, run, split="after")
        export_model(cfg, roles, run)
        summary = print_summary(cfg, roles, run)
        run.finish("FINISHED")
        return summary
    except KeyboardInterrupt:
        run.finish("KILLED")
        raise
    except BaseException:
        run.finish("FAILED")
        raise
    finally:
        stop_roles(roles)


# ---------------------------------------------------------------------------- run setup
@dataclass
class Run:
    cfg: Config
    dir: Path
    sink: K.Sink
    step: int = 0
    t0: float = field(default_factory=time.monotonic)
    results: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    finished: bool = False

    def log(self, metrics: dict) -> None:
        self.sink.log_metrics(metrics, step=self.step)
        self.history.append({"step": self.step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})

    def finish(self, status: str) -> None:
        if not self.finished:
            self.finished = True
            (self.dir / "metrics.jsonl").write_text("\n".join(json.dumps(h) for h in self.history) + "\n")
            self.sink.finish(status)


def start_run(cfg: Config) -> Run:
    name = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = Path(cfg.run.run_dir or Path(cfg.run.root) / name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    sink = K.make_sink(cfg.tracking.enabled, run_dir, cfg.tracking.uri, cfg.tracking.experiment, name)
    sink.log_params(flatten(to_dict(cfg)))
    sink.log_artifact(str(run_dir / "config.yaml"))
    log.info("run directory %s (MLflow run %s)", run_dir, sink.run_id)
    return Run(cfg, run_dir, sink)


# ---------------------------------------------------------------------------- roles
@dataclass
class Roles:
    retrieval: list
    replay: object
    learner: object
    workers: list
    restarts: dict
    bcast_gen: int = 0
    corpus_path: str = ""
    owns_ray: bool = False


def init_ray(cfg: Config) -> bool:
    """Join RAY_ADDRESS / cluster.address (ray job submit sets it) or start a local cluster on loopback."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return False
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                        "HF_HUB_OFFLINE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        # address="local": always a new private cluster, never a stray one found in /tmp/ray.
        # Logical CPUs: enough for every role's request, so a local run never waits for resources
        # (the processes share the physical cores; each uses one thread).
        needed = cfg.learner.num_cpus + cfg.rollout.num_workers * cfg.rollout.num_cpus_per_worker
        ray.init(address="local", num_cpus=cfg.cluster.num_cpus or int(max(4, os.cpu_count() or 1, needed + 0.999)),
                 include_dashboard=False, _node_ip_address="127.0.0.1", runtime_env=env, log_to_driver=True)
    return True


def start_roles(cfg: Config, run: Run) -> Roles:
    import ray

    from cluster.replay import ReplayQueue
    from learner.worker import Learner

    owns = init_ray(cfg)
    corpus = prepare_corpus(cfg, run)
    retrieval = start_retrieval(cfg, run, corpus)
    num_train = len(_world(cfg).train)
    replay = ray.remote(num_cpus=0)(ReplayQueue).options(max_concurrency=1000).remote(
        cfg.replay.capacity_groups, cfg.replay.max_policy_lag, cfg.replay.stale_policy, num_train, cfg.run.seed,
        inflight_budget(cfg))
    learner = ray.remote(Learner).options(num_cpus=cfg.learner.num_cpus, num_gpus=cfg.learner.num_gpus).remote(cfg)
    workers = [start_worker(cfg, i, retrieval) for i in range(cfg.rollout.num_workers)]
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
    roles = Roles(retrieval, replay, learner, workers, {i: 0 for i in range(len(workers))}, corpus_path=corpus,
                  owns_ray=owns)
    connect_broadcast(cfg, roles)
    return roles


def _world(cfg: Config):
    return _world_of(cfg.world)


@functools.lru_cache(maxsize=2)
def _world_of(world_cfg):
    """The world is a pure function of its (frozen, hashable) config: build it once per driver."""
    from actors.world import build_world

    return build_world(world_cfg)


def prepare_corpus(cfg: Config, run: Run) -> str:
    if cfg.retrieval.corpus:
        return cfg.retrieval.corpus
    import hashlib

    from actors.world import write_corpus_jsonl

    # Named by content, not by seed: a changed world generator must never reuse a stale corpus/index.
    world = _world(cfg)
    digest = hashlib.sha1(json.dumps(world.corpus, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(cfg.run.root).resolve() / "corpus" / f"world-{cfg.world.seed}-{digest}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        write_corpus_jsonl(world, tmp)
        tmp.replace(path)
    return str(path)


def start_retrieval(cfg: Config, run: Run, corpus: str) -> list:
    from retrieval.factory import build_retriever
    from retrieval.service import start_retrieval_service

    rcfg = cfg.retrieval
    index_root = str(Path(cfg.run.root).resolve() / "index")
    build_retriever(rcfg, corpus, index_root)  # builds the index once, before replicas open it
    client = start_retrieval_service(rcfg, lambda: build_retriever(rcfg, corpus, index_root), max(1, rcfg.replicas))
    return list(client.handles)


def start_worker(cfg: Config, i: int, retrieval: list):
    import ray

    from actors.worker import RolloutWorker

    return ray.remote(RolloutWorker).options(
        num_cpus=cfg.rollout.num_cpus_per_worker, num_gpus=cfg.rollout.num_gpus_per_worker,
        max_concurrency=4, name=None).remote(i, cfg, retrieval)


def connect_broadcast(cfg: Config, roles: Roles) -> None:
    """(Re)build the broadcast group: every rank must join concurrently; layouts must agree."""
    import ray

    from learner.deepspeed_config import resolve_backend
    from learner.worker import free_port

    roles.bcast_gen += 1
    prefix = f"sonar-weights-{roles.bcast_gen}"
    port, n = free_port(), len(roles.workers) + 1
    backend = resolve_backend(cfg.learner, cfg.learner.num_gpus > 0)
    refs = [roles.learner.setup_broadcast.remote("127.0.0.1", port, n, backend, prefix)]
    refs += [w.setup_broadcast.remote("127.0.0.1", port, i + 1, n, backend, prefix) for i, w in enumerate(roles.workers)]
    digests = ray.get(refs, timeout=cfg.cluster.health_timeout_s)
    if len(set(digests)) != 1:
        raise RuntimeError(f"weight layouts differ between the learner and the workers: {digests} "
                           "(model.* config or model.path must be the same for every role)")
    push_weights(roles)


def push_weights(roles: Roles) -> dict:
    """One collective push: learner -> every worker. Only the version number crosses Ray."""
    import ray

    v = ray.get(roles.learner.ping.remote())["version"]
    out = ray.get([roles.learner.broadcast.remote()] + [w.receive_weights.remote(v) for w in roles.workers])
    sent = out[0]
    return {K.WEIGHTS_SYNC_S: sent["seconds"], K.WEIGHTS_GBPS: sent["bytes"] / max(sent["seconds"], 1e-9) / 1e9}


def stop_roles(roles: Roles | None) -> None:
    import ray

    if roles is not None:
        for w in roles.workers:
            try:
                ray.get(w.stop.remote(timeout_s=5), timeout=10)
            except Exception:
                pass
    if ray.is_initialized() and (roles is None or roles.owns_ray):
        ray.shutdown()


# ---------------------------------------------------------------------------- stages
def run_sft_stage(cfg: Config, roles: Roles, run: Run, index: int, stage: StageConfig, start_step: int = 0) -> None:
    import ray

    info = ray.get(roles.learner.begin_stage.remote(index, stage, roles.retrieval, start_step))
    log.info("stage %d (sft): %d demonstrations, %d steps", index, info.get("demonstrations", 0), stage.steps)
    for step in range(start_step, stage.steps):
        m = ray.get(roles.learner.sft_step.remote(stage), timeout=cfg.cluster.step_timeout_s)
        run.step += 1
        if run.step % cfg.run.log_every == 0:
            run.log({**m, "stage": index})
        if (step + 1) % 25 == 0:
            log.info("sft step %d/%d loss %.3f (%.0f tok/s)", step + 1, stage.steps, m["learner/loss"],
                     m["learner/tokens_per_s"])
        maybe_checkpoint(cfg, roles, run, index, step + 1)
    run.log(push_weights(roles))


def run_rl_stage(cfg: Config, roles: Roles, run: Run, index: int, stage: StageConfig, start_step: int = 0) -> None:
    import ray

    ray.get(roles.learner.begin_stage.remote(index, stage, roles.retrieval, start_step))
    push_weights(roles)
    if cfg.eval.before and start_step == 0 and "before" not in run.results:  # before the first RL stage
        run.results["before"] = evaluate(cfg, roles, run, split="before")
    ray.get(roles.replay.reopen.remote())
    sync = cfg.cluster.mode == "sync"
    if not sync:
        ray.get([w.start.remote(roles.replay, index, stage) for w in roles.workers])
    steps, t_stage = start_step, time.monotonic()
    throughput = Throughput()
    while steps < stage.steps:
        if sync:
            generate_in_lockstep(cfg, roles, index, stage, steps)
        worker_metrics = check_workers(cfg, roles, index, stage)
        m = ray.get(roles.learner.rl_step.remote(roles.replay, stage, 10.0), timeout=cfg.cluster.step_timeout_s)
        record_prompts(run, m)
        if m.get("waiting"):
            continue
        steps += 1
        run.step += 1
        if steps % cfg.learner.broadcast_every == 0:
            m.update(push_weights(roles))
        m.update(worker_metrics)
        m.update(replay_metrics(roles))
        m.update(throughput.tick(m))
        if steps % 10 == 0 or steps == stage.steps:
            m.update(retrieval_metrics(roles))
        m["stage"] = index
        run.log(m)
        if steps % 5 == 0 or steps == stage.steps:
            log.info("rl step %d/%d reward %.3f lag max %s searches/traj %.2f dropped %s", steps, stage.steps,
                     m.get("learner/reward/mean", float("nan")), m.get("learner/policy_lag/max"),
                     m.get(K.ROLLOUT_SEARCH_CALLS_MEAN, float("nan")), m.get(K.REPLAY_DROPPED_STALE))
        maybe_checkpoint(cfg, roles, run, index, steps)
    stop_rollouts(roles)
    run.results.setdefault("rl", {})[index] = {"steps": steps, "seconds": time.monotonic() - t_stage}


def record_prompts(run: Run, m: dict) -> None:
    """Append which prompts this step trained or dropped as stale to trained_prompts.jsonl (a resume
    is checked against it: no prompt trained twice, none skipped)."""
    prompts, dropped = m.pop("_prompts", []), m.pop("_dropped_prompts", [])
    if prompts or dropped:
        with open(run.dir / "trained_prompts.jsonl", "a") as fh:
            fh.write(json.dumps({"version": m.get("learner/version"), "trained": prompts, "dropped": dropped}) + "\n")


def generate_in_lockstep(cfg: Config, roles: Roles, index: int, stage: StageConfig, step: int) -> None:
    """Sync mode: the workers generate exactly one learner batch with the current weights, then stop."""
    import ray

    n, k = cfg.learner.groups_per_step, len(roles.workers)
    shares = [n // k + (1 if i < n % k else 0) for i in range(k)]
    ray.get([w.generate_groups.remote(roles.replay, index, stage, s, step)
             for w, s in zip(roles.workers, shares) if s], timeout=cfg.cluster.step_timeout_s)


def check_workers(cfg: Config, roles: Roles, stage_index: int, stage: StageConfig) -> dict:
    """Health check every iteration: a dead or silent worker is restarted or fails the run loudly."""
    import ray

    recent: list[dict] = []
    for i, w in enumerate(list(roles.workers)):
        try:
            h = ray.get(w.health.remote(), timeout=cfg.cluster.health_timeout_s)
            err = h["error"] or (None if h["alive"] or cfg.cluster.mode == "sync" else "rollout loop is not running")
            if err is None and cfg.cluster.mode == "async" and h["idle_s"] > cfg.cluster.step_timeout_s:
                err = f"no progress for {h['idle_s']:.0f}s"
        except Exception as e:  # actor died (RayActorError) or health timed out
            h, err = None, f"{type(e).__name__}: {e}"
        if err is None:
            recent.extend(h["recent"])
            continue
        restart_worker(cfg, roles, i, err, stage_index, stage)
    return rollout_metrics(recent)


class WorkerFailed(RuntimeError):
    pass


def restart_worker(cfg: Config, roles: Roles, i: int, err: str, stage_index: int, stage: StageConfig) -> None:
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
    roles.workers[i] = start_worker(cfg, i, roles.retrieval)
    ray.get(roles.workers[i].ready.remote())
    # The broadcast group includes every rank, so it is rebuilt: pause the others first (closing the
    # queue releases a producer blocked on backpressure; its prompt is requeued), then resume all.
    ray.get(roles.replay.close.remote())
    ray.get([w.stop.remote() for j, w in enumerate(roles.workers) if j != i])
    ray.get(roles.replay.reopen.remote())
    connect_broadcast(cfg, roles)
    if cfg.cluster.mode == "async":
        ray.get([w.start.remote(roles.replay, stage_index, stage) for w in roles.workers])


def stop_rollouts(roles: Roles) -> None:
    import ray

    ray.get(roles.replay.close.remote())
    ray.get([w.stop.remote() for w in roles.workers])
    ray.get(roles.replay.drain.remote())


def rollout_metrics(recent: list[dict]) -> dict:
    if not recent:
        return {}
    m = {K.ROLLOUT_REWARD_MEAN: float(np.mean([r["reward"] for r in recent])),
         K.ROLLOUT_SEARCH_CALLS_MEAN: float(np.mean([r["searches"] for r in recent])),
         K.ROLLOUT_TOKENS_MEAN: float(np.mean([r["model_tokens"] for r in recent]))}
    for part in recent[0]["parts"]:
        m[K.ROLLOUT_REWARD_PART.format(part=part)] = float(np.mean([r["parts"].get(part, 0.0) for r in recent]))
    for reason in ("answered", "max_turns", "max_tokens", "malformed", "retrieval_error"):
        m[K.ROLLOUT_FINISH.format(reason=reason)] = float(np.mean([r["finish"] == reason for r in recent]))
    lat = [x for r in recent for x in r["latency_ms"]]
    if lat:
        m[K.RETRIEVAL_LATENCY_P50] = float(np.percentile(lat, 50))
        m[K.RETRIEVAL_LATENCY_P99] = float(np.percentile(lat, 99))
    m[K.RETRIEVAL_ERRORS] = float(sum(r["failed_searches"] for r in recent))
    m["rollout/trajectories"] = float(len(recent))
    return m


class Throughput:
    """Rollout throughput between consecutive learner steps, from the replay's produced counter."""

    def __init__(self):
        self.t, self.produced = time.monotonic(), None

    def tick(self, m: dict) -> dict:
        now, produced = time.monotonic(), m.get(K.REPLAY_PRODUCED, 0)
        out = {}
        if self.produced is not None and now > self.t:
            out[K.ROLLOUT_TRAJ_PER_S] = (produced - self.produced) / (now - self.t)
            if K.ROLLOUT_TOKENS_MEAN in m:
                out[K.ROLLOUT_TOKENS_PER_S] = out[K.ROLLOUT_TRAJ_PER_S] * m[K.ROLLOUT_TOKENS_MEAN]
        self.t, self.produced = now, produced
        return out


def retrieval_metrics(roles: Roles) -> dict:
    """Service-side retrieval metrics (QPS, latency, batch size, cache hit rate, errors by kind)."""
    import ray

    stats = [s for s in ray.get([h.stats.remote() for h in roles.retrieval]) if s]
    if not stats:
        return {}
    m = {"retrieval/qps": sum(s["qps"] for s in stats),
         "retrieval/service/latency_ms/p50": max(s["latency_ms"]["p50"] for s in stats),
         "retrieval/service/latency_ms/p99": max(s["latency_ms"]["p99"] for s in stats),
         "retrieval/batch_size/mean": float(np.mean([s["mean_batch_size"] for s in stats]))}
    for s in stats:
        for kind, n in s["errors"].items():
            m[f"retrieval/errors/{kind}"] = m.get(f"retrieval/errors/{kind}", 0) + n
        cache = s.get("inner", {})
        if "hit_rate" in cache:
            m[K.RETRIEVAL_CACHE_HIT_RATE] = cache["hit_rate"]
    return m


def replay_metrics(roles: Roles) -> dict:
    import ray

    s = ray.get(roles.replay.stats.remote())
    return {K.REPLAY_DEPTH: s["depth_groups"], K.REPLAY_PRODUCED: s["produced"], K.REPLAY_CONSUMED: s["consumed"],
            K.REPLAY_DROPPED_STALE: s["dropped_stale"], K.REPLAY_REQUEUED: s["requeued_prompts"]}


# ---------------------------------------------------------------------------- eval, checkpoints, export
def evaluate(cfg: Config, roles: Roles, run: Run, split: str) -> dict:
    """Greedy held-out eval, with search and (optionally) without, sharded across the workers."""
    import ray

    from actors.rewards import exact_match, f1

    world = _world(cfg)
    qs = world.heldout[: cfg.world.num_heldout_eval or None]
    questions = [{"qid": q.qid, "question": q.question, "golds": list(q.golds)} for q in qs]
    stage = cfg.stages[-1]
    out = {}
    for mode in (["search", "no_search"] if cfg.eval.no_search else ["search"]):
        shards = [questions[i::len(roles.workers)] for i in range(len(roles.workers))]
        recs = [r for rs in ray.get([w.evaluate.remote(s, mode == "search", stage)
                                     for w, s in zip(roles.workers, shards) if s]) for r in rs]
        em = float(np.mean([exact_match(r["prediction"] or "", r["golden_answers"]) for r in recs]))
        f = float(np.mean([f1(r["prediction"] or "", r["golden_answers"]) for r in recs]))
        searches = float(np.mean([r["num_searches"] for r in recs]))
        out[mode] = {"em": em, "f1": f, "searches": searches, "n": len(recs)}
        key = f"{split}_{mode}"
        run.log({K.EVAL_EM.format(split=key): em, K.EVAL_F1.format(split=key): f,
                 K.EVAL_SEARCHES.format(split=key): searches})
        path = run.dir / f"predictions-{key}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        log.info("eval %s: EM %.3f F1 %.3f searches/q %.2f (n=%d)", key, em, f, searches, len(recs))
    return out


def verify_weights(roles: Roles) -> dict:
    """After a final push, every worker must hold exactly the learner's weights (checksums equal)."""
    import ray

    push_weights(roles)
    ray.get([w.apply_staged_weights.remote() for w in roles.workers])
    learner = ray.get(roles.learner.checksum.remote())
    workers = ray.get([w.checksum.remote() for w in roles.workers])
    produced = [ray.get(w.health.remote())["stats"]["trajectories"] for w in roles.workers]
    ok = all(w["version"] == learner["version"] and
             (w["checksum"] is None or abs(w["checksum"] - learner["checksum"]) <= 1e-9 * abs(learner["checksum"]))
             for w in workers)
    if not ok:
        raise RuntimeError(f"weights diverged after the final push: learner {learner}, workers {workers}")
    return {"learner": learner, "workers": workers, "worker_trajectories": produced}


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
    log.info("checkpoint saved: %s", path)
    return path


def maybe_resume(cfg: Config, roles: Roles, run: Run) -> tuple[int, int]:
    if not cfg.run.resume:
        return 0, 0
    import ray

    from learner.checkpoint import resolve_checkpoint

    path = resolve_checkpoint(cfg.run.resume, cfg.run.root)
    state = ray.get(roles.learner.load_checkpoint.remote(path))
    ray.get(roles.replay.load_state_dict.remote(state["replay"]))
    run.step = state.get("run_step", 0)
    push_weights(roles)
    run.sink.log_params({"run.resumed_from": path})
    log.info("resumed from %s at version %d, stage %d step %d", path, state["version"], state["resume_stage"],
             state["resume_step"])
    return int(state["resume_stage"]), int(state["resume_step"])


def export_model(cfg: Config, roles: Roles, run: Run) -> str:
    import ray

    path = ray.get(roles.learner.export_hf.remote(str(run.dir / "model")))
    if cfg.tracking.log_model:
        run.sink.log_artifacts(path, "model")
    return path


def print_summary(cfg: Config, roles: Roles, run: Run) -> dict:
    import ray

    before = run.results.get("before", {})
    after = run.results.get("final", {})
    stats = ray.get(roles.replay.stats.remote())
    lags = [h.get(K.LEARNER_POLICY_LAG_MAX, 0) for h in run.history]
    rl_hist = [h for h in run.history if "rollout/trajectories" in h]
    wall = time.monotonic() - run.t0
    summary = {
        "run_dir": str(run.dir), "mlflow_run_id": run.sink.run_id, "wall_s": wall,
        "em_before_search": before.get("search", {}).get("em"), "em_after_search": after.get("search", {}).get("em"),
        "f1_before_search": before.get("search", {}).get("f1"), "f1_after_search": after.get("search", {}).get("f1"),
        "em_after_no_search": after.get("no_search", {}).get("em"),
        "searches_per_question": after.get("search", {}).get("searches"),
        "trajectories_per_s": stats["consumed"] / max(1e-9, sum(v["seconds"] for v in run.results.get("rl", {}).values()) or wall),
        "tokens_per_s": float(np.mean([h.get(K.LEARNER_TOKENS_PER_S, 0) for h in rl_hist])) if rl_hist else None,
        "policy_lag_max": max(lags) if lags else 0, "replay": stats, "weights": run.results.get("weights"),
        "learner_steps": sum(1 for h in run.history if "learner/version" in h),
    }
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    rows = [("held-out EM (search) before RL", summary["em_before_search"]),
            ("held-out EM (search) after RL", summary["em_after_search"]),
            ("held-out F1 (search) before / after", f"{_fmt(summary['f1_before_search'])} / {_fmt(summary['f1_after_search'])}"),
            ("held-out EM (no search) after RL", summary["em_after_no_search"]),
            ("searches per question", summary["searches_per_question"]),
            ("trajectories/s (RL)", summary["trajectories_per_s"]),
            ("learner tokens/s", summary["tokens_per_s"]), ("policy lag (max)", summary["policy_lag_max"]),
            ("accounting balanced", stats["balanced"]), ("wall clock (s)", wall),
            ("MLflow run id", run.sink.run_id), ("run directory", run.dir)]
    width = max(len(r[0]) for r in rows)
    print("\n" + "\n".join(f"  {k.ljust(width)}  {_fmt(v)}" for k, v in rows) + "\n", flush=True)
    return summary


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
