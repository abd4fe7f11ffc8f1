"""A learner that dies: the run's roles restarted from its last complete checkpoint (``cluster.auto_resume``).

Rollout workers and retrieval replicas are restarted in place (``rollout_pool.RolloutPool.call``,
``roles.check_retrieval``, Ray's ``max_restarts``); the learner holds the optimizer state and the
policy version, so its death ends that set of roles. ``train`` (``loop.py``) then asks
``learner_died``; if so, ``auto_resume_config`` kills what is left, rolls this run's records back to
the checkpoint (``trained_prompts.jsonl`` and the metric history: what was trained after it is
trained again, by the resumed learner) and returns the config that resumes from it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from sonar.cluster.driver.roles import Roles, kill_roles, learner_dead
from sonar.cluster.driver.run import Run
from sonar.cluster.wire.config import Config

log = logging.getLogger("sonar")

ROLLED_BACK = "trained_prompts.rolled_back.jsonl"
"""Where the records of learner steps lost with a dead learner go (kept for the audit, not counted)."""


def learner_died(cfg: Config, roles: Roles | None, run: Run, error: BaseException) -> bool:
    """True when ``error`` ended the roles because the learner is gone and ``cluster.auto_resume``
    allows another attempt (counted in ``run.results['faults']['learner_resumes']``)."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or roles is None:
        return False
    used = run.results.get("faults", {}).get("learner_resumes", 0)
    if used >= cfg.cluster.auto_resume or not learner_dead(cfg, roles):
        return False
    log.warning("the learner died (%s: %s); auto-resume %d of cluster.auto_resume=%d", type(error).__name__,
                str(error).splitlines()[0] if str(error) else "", used + 1, cfg.cluster.auto_resume)
    return True


def auto_resume_config(cfg: Config, roles: Roles, run: Run) -> Config:
    """Kill the remaining roles, roll the run's records back to its last complete checkpoint and
    return ``cfg`` with ``run.resume`` set to it (the original ``run.resume`` when this run saved
    none yet: the run starts over from there)."""
    from sonar.learner.checkpoint import CheckpointError, resolve_checkpoint

    faults = run.results.setdefault("faults", {})
    faults["learner_resumes"] = faults.get("learner_resumes", 0) + 1
    restarts = faults.setdefault("worker_restarts", 0)
    faults["worker_restarts"] = restarts + sum(roles.restarts.values())
    replaced = sum(getattr(roles, "replica_replacements", {}).values())
    faults["replica_replacements"] = faults.get("replica_replacements", 0) + replaced
    kill_roles(roles)
    try:
        path: str | None = resolve_checkpoint(str(run.dir), cfg.run.root)
        state = json.loads((Path(path) / "state.json").read_text())
        version, run_step = int(state["version"]), int(state.get("run_step", 0))
    except (CheckpointError, FileNotFoundError, OSError):
        path, version, run_step = cfg.run.resume, -1, 0
    rollback_records(run, version, run_step)
    run.resume_from = path  # what maybe_resume loads (start_run resolved the original run.resume)
    log.warning("auto-resume from %s (learner version %d, run step %d)", path or "the start", version, run_step)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=path))


def rollback_records(run: Run, version: int, run_step: int) -> int:
    """Keep the learner steps up to ``version`` in ``trained_prompts.jsonl`` (the rest move to
    ``ROLLED_BACK``) and the metric history up to ``run_step``; returns how many records moved.
    ``version`` < 0: everything moves (no checkpoint: the run starts over)."""
    path = run.dir / "trained_prompts.jsonl"
    moved = 0
    if path.exists():
        keep, lost = [], []
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                (keep if version >= 0 and (rec.get("version") or 0) <= version else lost).append(line)
        if lost:
            with open(run.dir / ROLLED_BACK, "a") as fh:
                fh.write("".join(line + "\n" for line in lost))
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
        moved = len(lost)
    kept = [h for h in run.history if h.get("step", 0) <= run_step]
    run.history.clear()
    run.history.extend(kept)
    return moved


class LearnerStarved(RuntimeError):
    """The learner waited longer than ``cluster.step_timeout_s`` for one batch while every worker was alive:
    a scheduling stall, reported with the replay's state instead of a silent hang."""


def check_starved(cfg: Config, roles: Roles, waited_s: float) -> None:
    """Raise ``LearnerStarved`` once the learner has waited ``waited_s`` > ``cluster.step_timeout_s`` for one
    batch (the health checks found every worker alive meanwhile), naming the replay's counts."""
    import ray

    if waited_s <= cfg.cluster.step_timeout_s:
        return
    try:
        stats = ray.get(roles.replay.stats.remote(), timeout=cfg.cluster.health_timeout_s)
    except Exception as e:  # noqa: BLE001 - the report goes out either way
        stats = f"unavailable ({type(e).__name__})"
    raise LearnerStarved(starved_message(cfg, waited_s, stats))


def starved_message(cfg: Config, waited_s: float, stats) -> str:
    """What ``LearnerStarved`` says: the wait, the deadline, the batch and the replay's state."""
    return (f"the learner has waited {waited_s:.0f} s (> cluster.step_timeout_s={cfg.cluster.step_timeout_s:g}) for a "
            f"batch of learner.groups_per_step={cfg.learner.groups_per_step} groups while every rollout worker "
            f"answered its health check: the rollout side is not producing (replay: {stats})")
