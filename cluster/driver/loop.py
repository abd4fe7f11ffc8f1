"""The driver loop: config -> Ray -> roles -> stages -> evaluation -> export.

``train(cfg)`` fits on one screen; every step it calls is named in ``roles``, ``reports`` or below.
"""
from __future__ import annotations

import logging
import time

from sonar.cluster.driver.reports import (Throughput, evaluate, print_summary, record_prompts, replay_metrics,
                                         retrieval_metrics)
from sonar.cluster.driver.roles import (Hooks, Roles, check_workers, export_model, maybe_checkpoint,
                                       maybe_resume, push_weights, save_checkpoint, start_roles, stop_roles,
                                       stop_rollouts, verify_weights)
from sonar.cluster.driver.run import Run, start_run
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config, StageConfig

log = logging.getLogger("sonar")

def train(cfg: Config, hooks: Hooks | None = None) -> dict:
    """``hooks``: extension points for code outside production (``roles.Hooks``); None for a real run."""
    run = start_run(cfg)
    roles = None
    try:
        roles = start_roles(cfg, run, hooks)
        start_stage, start_step = maybe_resume(cfg, roles, run)
        for index, stage in enumerate(cfg.stages):
            if index < start_stage:
                continue
            first = start_step if index == start_stage else 0
            log.info("stage %d %r (%s): steps %d..%d", index, stage.name, stage.kind, first, stage.steps)
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
            log.info("sft step %d/%d loss %.3f (%.0f tok/s)", step + 1, stage.steps, m[K.LEARNER_LOSS],
                     m[K.LEARNER_TOKENS_PER_S])
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
                     m.get(K.LEARNER_REWARD_MEAN, float("nan")), m.get(K.LEARNER_POLICY_LAG_MAX),
                     m.get(K.ROLLOUT_SEARCH_CALLS_MEAN, float("nan")), m.get(K.REPLAY_DROPPED_STALE))
        maybe_checkpoint(cfg, roles, run, index, steps)
    stop_rollouts(roles)
    run.results.setdefault("rl", {})[index] = {"steps": steps, "seconds": time.monotonic() - t_stage}


def generate_in_lockstep(cfg: Config, roles: Roles, index: int, stage: StageConfig, step: int) -> None:
    """Sync mode: the workers generate exactly one learner batch with the current weights, then stop."""
    import ray

    n, k = cfg.learner.groups_per_step, len(roles.workers)
    shares = [n // k + (1 if i < n % k else 0) for i in range(k)]
    ray.get([w.generate_groups.remote(roles.replay, index, stage, s, step)
             for w, s in zip(roles.workers, shares) if s], timeout=cfg.cluster.step_timeout_s)

