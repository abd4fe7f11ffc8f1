"""The driver loop: config -> Ray -> roles -> stages -> evaluation -> export.

``train(cfg)`` fits on one screen; every step it calls is named in ``roles``, ``rollout_pool``
(``roles.pool``: the rollout workers), ``reports`` or below.
"""
from __future__ import annotations

import logging
import time
import traceback

from sonar.cluster.driver.colocate import Colocation
from sonar.cluster.driver.critical_path import StepClock
from sonar.cluster.driver.data import stage_questions, write_stage_prompts
from sonar.cluster.driver.reports import (StageProgress, Throughput, answer, evaluate, print_summary, record_prompts,
                                         replay_metrics, retrieval_metrics, split_meter, step_log_line)
from sonar.cluster.driver.roles import (Hooks, Roles, export_model, kill_roles, maybe_checkpoint,
                                       maybe_resume, prepare_demonstrations, save_checkpoint, start_roles, stop_roles)
from sonar.cluster.driver.faults import OutagePause, auto_resume_config, check_starved, role_died
from sonar.cluster.driver.pool import Pool
from sonar.cluster.driver.run import Run, start_run
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config, StageConfig

log = logging.getLogger("sonar")

def train(cfg: Config, hooks: Hooks | None = None) -> dict:
    """``hooks``: extension points for code outside production (``roles.Hooks``); None for a real run."""
    run = start_run(cfg)
    roles, interrupted = None, False
    try:
        attempt_cfg, owns = cfg, False
        while True:
            try:
                roles = start_roles(attempt_cfg, run, hooks)  # waits for every role and the broadcast group
                roles.owns_ray = owns = roles.owns_ray or owns  # Ray outlives an auto-resume
                return _train_roles(attempt_cfg, roles, run)
            except BaseException as e:
                # A dead learner or replay queue: roles restarted from this run's last complete checkpoint,
                # while cluster.auto_resume lasts (faults.role_died decides; anything else propagates).
                if not role_died(cfg, roles, run, e):
                    raise
                attempt_cfg, roles = auto_resume_config(cfg, roles, run), None
    except KeyboardInterrupt as e:
        # Ctrl-C, or SIGTERM (`ray job stop`: Ray SIGKILLs the driver RAY_JOB_STOP_WAIT_TIME_S later, 3 s
        # by default). The status is written first (KILLED, one write, then the queued metrics: the sink's
        # finish), then the actors are killed outright, not stopped politely (no waits on their loops).
        run.finish("KILLED")
        interrupted = True
        since = getattr(e, "signal_at", None)  # set by the CLI's SIGTERM handler
        log.warning("interrupted (%s): MLflow run marked KILLED, its metrics flushed%s; killing the actors",
                    str(e) or "Ctrl-C", f" {time.monotonic() - since:.2f} s after the signal" if since is not None else "")
        raise
    except BaseException as e:
        # The traceback goes to the run directory (the CLI prints a RunFault as one line), then the status:
        # a failure to mark it (MLflow on a full disk) is logged, never raised over the run's own error.
        (run.dir / "error.log").write_text("".join(traceback.format_exception(e)))
        e.error_log = str(run.dir / "error.log")  # where the CLI's one line points
        try:
            run.finish("FAILED")
        except Exception as fe:  # noqa: BLE001 - the run's error is the one to report
            log.error("could not mark the run FAILED (%s: %s); its own error follows", type(fe).__name__,
                      " ".join(str(fe).split())[:300])
        raise
    finally:
        if interrupted:
            _kill_at_once(roles)
        else:
            stop_roles(roles)


def _kill_at_once(roles: Roles | None) -> None:
    """An interrupted run's teardown: every actor killed (``kill_roles``, no waits for their loops to
    stop), then Ray shut down when this driver started it (as ``stop_roles``)."""
    import ray

    if roles is not None and ray.is_initialized():
        kill_roles(roles)
    if ray.is_initialized() and (roles is None or roles.owns_ray):
        ray.shutdown()


def _train_roles(cfg: Config, roles: Roles, run: Run) -> dict:
    """The stages, the final checks, evaluation and export, on roles that are up."""
    start_stage, start_step = maybe_resume(cfg, roles, run)  # waits for the learner to load a checkpoint
    for index, stage in enumerate(cfg.stages):
        if index < start_stage or run.results.get("stopped_early"):
            continue
        first = start_step if index == start_stage else 0
        log.info("stage %d %r (%s): steps %d..%d", index, stage.name, stage.kind, first, stage.steps)
        if stage.kind == "sft":
            run_sft_stage(cfg, roles, run, index, stage, first)
        else:
            run_rl_stage(cfg, roles, run, index, stage, first)
        save_checkpoint(roles, run, index + 1, 0, tag=f"stage{index}")  # waits: a resume starts here
    run.results["weights"] = roles.pool.verify_weights()  # waits for every checksum: all must hold the same weights
    run.results["final"] = evaluate(cfg, roles, run, split="after")  # waits for every worker's shard
    export_model(cfg, roles, run)  # waits for the learner's HF export
    summary = print_summary(cfg, roles, run)
    run.finish("FINISHED")
    return summary


def run_sft_stage(cfg: Config, roles: Roles, run: Run, index: int, stage: StageConfig, start_step: int = 0) -> None:
    import ray

    # The driver builds the demonstrations; the learner only trains on them (and keeps their order,
    # so a resumed stage continues with the same next batches).
    demos = prepare_demonstrations(cfg, run, roles.policy)
    # Wait: the learner must hold the demonstrations and this stage's settings before its first step.
    info = answer(cfg, roles.learner.begin_stage.remote(index, stage, start_step, demos), "learner", "begin_stage",
                  cfg.cluster.step_timeout_s)
    colocation = Colocation(cfg, roles)
    if colocation.active:
        colocation.to_training()  # waits: the engines leave the devices to the learner for the whole stage
    log.info("stage %d (sft): %d demonstrations, %d steps", index, info.get("demonstrations", 0), stage.steps)
    progress = StageProgress(stage.steps, start_step, f"stage {index} {stage.name}")
    for step in range(start_step, stage.steps):
        # Wait for each step: the driver logs and checkpoints between steps (no rollouts run in SFT).
        m = ray.get(roles.learner.sft_step.remote(stage), timeout=cfg.cluster.step_timeout_s)
        run.step += 1
        progress.update()
        if run.step % cfg.run.log_every == 0:
            run.log({**m, "stage": index})
        if (step + 1) % 25 == 0 or step + 1 == stage.steps:
            log.info("sft step %d/%d loss %.3f (%.0f tok/s) %s", step + 1, stage.steps, m[K.LEARNER_LOSS],
                     m[K.LEARNER_TOKENS_PER_S], progress.text(step + 1))
        maybe_checkpoint(cfg, roles, run, index, step + 1)  # waits for the learner's save when one is due
    progress.close()
    # Waits until the workers hold the SFT weights (colocated: handed over, the engines awake): the next
    # stage samples them.
    run.log(colocation.to_generation(StepClock()) if colocation.active else roles.pool.push())


def run_rl_stage(cfg: Config, roles: Roles, run: Run, index: int, stage: StageConfig, start_step: int = 0) -> None:
    """The workers roll out (continuously, or one batch per step in sync mode) while the learner steps
    on whole groups from the replay; weights go out every ``learner.broadcast_every`` steps."""
    import ray

    # Wait: the learner must hold this stage's objective and optimizer settings before it trains a group.
    answer(cfg, roles.learner.begin_stage.remote(index, stage, start_step), "learner", "begin_stage",
           cfg.cluster.step_timeout_s)
    roles.pool.push()  # waits for every worker to hold the learner's weights: the stage starts on-policy
    if cfg.eval.before and start_step == 0 and "before" not in run.results:  # before the first RL stage
        run.results["before"] = evaluate(cfg, roles, run, split="before")  # waits for every worker's shard
    # This stage's questions (stages.N.data, else the world's): listed in the run directory, and the
    # replay's cursor sized to them (a no-op when the count is unchanged, e.g. on resume). Wait: the
    # workers claim indices into them next.
    questions = stage_questions(cfg, stage)
    write_stage_prompts(run.dir, index, questions)
    answer(cfg, roles.replay.set_num_prompts.remote(len(questions)), "replay queue", "set_num_prompts")
    # Wait: claims from here start only what the stage's remaining steps train (nothing left to requeue at its end).
    answer(cfg, roles.replay.set_stage_demand.remote((stage.steps - start_step) * cfg.learner.groups_per_step),
           "replay queue", "set_stage_demand")
    answer(cfg, roles.replay.reopen.remote(), "replay queue", "reopen")  # wait: the previous stage closed the replay
    sync = cfg.cluster.mode == "sync"
    # A worker restarted from here on starts its rollout loop too. Async: wait only until each loop has
    # started; they run until end_stage.
    roles.pool.begin_stage(index, stage)
    steps, t_stage, throughput, split = start_step, time.monotonic(), Throughput(), split_meter(cfg)
    pool = Pool(cfg, len(roles.workers))  # resizes an elastic rollout pool at step boundaries (pool.py)
    clock = StepClock()  # the step's wall time split along the critical path (critical_path.py)
    colocation = Colocation(cfg, roles)  # colocated placement: engines and learner take turns (colocate.py)
    progress = StageProgress(stage.steps, start_step, f"stage {index} {stage.name}")
    waiting_since = None  # when the learner's current wait for a batch began (a stall fails after step_timeout_s)
    outage = OutagePause()
    while steps < stage.steps:
        if sync:
            with clock.phase("generate_sync"):
                # Sync mode: waits for the batch, one learner step's groups with the current weights (the lockstep).
                roles.pool.generate(index, stage, cfg.learner.groups_per_step, steps)
        with clock.phase("health"):
            pings = roles.replicas.ping()  # sent first: answered while the workers' health is awaited (one round)
            worker_metrics = roles.pool.health()  # waits for health: a dead worker surfaces here
            worker_metrics.update(roles.replicas.check(pings))  # waits for the rest of the replicas' pings
        # Wait for one learner step. The learner waits at most 10 s for groups, so a stalled rollout
        # side comes back as `waiting` and meets the health check above instead of hanging here.
        # Colocated: waits for every engine to sleep before the step, and after it for the hand-over and
        # the engines' wake-up, so the next batch samples the new weights (a no-op in split placement).
        with colocation.training(clock) as switched:
            t_call = time.monotonic()
            res = ray.get(roles.learner.rl_step.remote(roles.replay, stage, 10.0), timeout=cfg.cluster.step_timeout_s)
            clock.parts["waiting_calls" if res.waiting else "learner_call"] += time.monotonic() - t_call
        record_prompts(run, res)
        outage.see(res)  # logs a pause for a retrieval outage (the replay holds the batch back) and its end
        if res.waiting:
            pool.step(roles.pool, res.metrics.get(K.LEARNER_WAIT_S, 0.0), 0)  # a starved learner grows it
            waiting_since = waiting_since or t_call
            check_starved(cfg, roles, time.monotonic() - waiting_since)  # no silent hang: fails with the replay's state
            continue
        waiting_since = None
        # The replay's counters after this step and the rollouts it accepted since the last trained step
        # (their metrics travel with them), answered during the push.
        counters = roles.replay.report.remote()
        steps += 1
        run.step += 1
        progress.update()
        m = {**res.metrics, **switched}
        if roles.hooks.on_learner_step is not None:
            # Waits: a benchmark's simulated learner time (Hooks.on_learner_step), before the weights go out.
            t_hook = time.monotonic()
            m.update(roles.hooks.on_learner_step(res.metrics) or {})
            clock.parts["learner_call"] += time.monotonic() - t_hook
        if steps % cfg.learner.broadcast_every == 0 and not colocation.active:  # waits for the collective: bounds the policy lag
            with clock.phase("push"):
                m.update(roles.pool.push())
        with clock.phase("log"):
            m.update(worker_metrics)
            m.update(replay_metrics(roles, counters))  # waits for the replay's report (asked after the step)
            m.update(pool.step(roles.pool, res.metrics.get(K.LEARNER_WAIT_S, 0.0), int(m[K.REPLAY_DEPTH])))  # may resize
            m.update(throughput.tick(m))
            m.update(split.tick(m, len(roles.workers)) if split else {})  # each side's idle share, the balancing split
            if steps % 10 == 0 or steps == stage.steps:
                m.update(retrieval_metrics(roles))  # waits for every retrieval replica's stats
        m.update(clock.finish(m))  # this step's split; run.log and the checkpoint go to the next step's log_s
        run.log({**m, "stage": index})
        if steps % 5 == 0 or steps == stage.steps:
            log.info("%s %s", step_log_line(steps, stage.steps, m), progress.text(steps))  # no nan: see step_log_line
        with clock.phase("log"):
            maybe_checkpoint(cfg, roles, run, index, steps)  # waits for the learner's save when one is due
        if roles.hooks.on_step is not None and roles.hooks.on_step(roles, run, index, steps):
            run.results["stopped_early"] = {"stage": index, "steps": steps}
            break
    progress.close()
    pool.close(roles.pool)
    run.results.setdefault("pool", {})[index] = pool.history  # (seconds, workers) at start and each resize
    roles.pool.end_stage()  # waits until every loop has ended and the replay is drained: the stage is over
    run.results.setdefault("rl", {})[index] = {"steps": steps, "seconds": time.monotonic() - t_stage}

