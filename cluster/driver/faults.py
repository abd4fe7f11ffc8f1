"""A learner or replay queue that dies: the run's roles restarted from its last complete checkpoint
(``cluster.auto_resume``).

Rollout workers and retrieval replicas are restarted in place (``rollout_pool.RolloutPool.call``,
``ReplicaPool.check``, Ray's ``max_restarts``); the learner holds the optimizer state and the
policy version, the replay queue the prompt cursor and the accounting (both saved in every
checkpoint), so the death of either ends that set of roles. ``train`` (``loop.py``) then asks
``role_died``; if so, ``auto_resume_config`` kills what is left, rolls this run's records back to
the checkpoint (``trained_prompts.jsonl`` and the metric history: what was trained after it is
trained again, by the resumed learner) and returns the config that resumes from it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from sonar.cluster.driver.roles import Roles, dead_role, kill_roles
from sonar.cluster.driver.run import Run
from sonar.cluster.wire.config import Config
from sonar.cluster.wire.errors import RunFault

log = logging.getLogger("sonar")

ROLLED_BACK = "trained_prompts.rolled_back.jsonl"
"""Where the records of learner steps lost with a dead learner go (kept for the audit, not counted)."""


RESUME_KEYS = {"learner": "learner_resumes", "replay queue": "replay_resumes"}
"""Where ``run.results['faults']`` counts the auto-resumes each role's death caused; ``cluster.auto_resume``
bounds their sum."""


def role_died(cfg: Config, roles: Roles | None, run: Run, error: BaseException) -> bool:
    """True when ``error`` ended the roles because the learner or the replay queue is gone and
    ``cluster.auto_resume`` allows another attempt (counted under ``RESUME_KEYS``)."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or roles is None:
        return False
    faults = run.results.setdefault("faults", {})
    used = sum(faults.get(k, 0) for k in RESUME_KEYS.values())
    role = dead_role(cfg, roles) if used < cfg.cluster.auto_resume else None
    if role is None:
        return False
    faults[RESUME_KEYS[role]] = faults.get(RESUME_KEYS[role], 0) + 1
    log.warning("the %s died (%s: %s); auto-resume %d of cluster.auto_resume=%d", role, type(error).__name__,
                str(error).splitlines()[0] if str(error) else "", used + 1, cfg.cluster.auto_resume)
    return True


def auto_resume_config(cfg: Config, roles: Roles, run: Run) -> Config:
    """Kill the remaining roles, roll the run's records back to its last complete checkpoint and
    return ``cfg`` with ``run.resume`` set to it (the original ``run.resume`` when this run saved
    none yet: the run starts over from there)."""
    from sonar.learner.checkpoint import CheckpointError, resolve_checkpoint

    faults = run.results.setdefault("faults", {})
    restarts = faults.setdefault("worker_restarts", 0)
    faults["worker_restarts"] = restarts + sum(roles.restarts.values())
    faults["push_call_offs"] = faults.get("push_call_offs", 0) + getattr(roles.pool, "push_call_offs", 0)
    replaced = sum(roles.replicas.replacements.values())
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


class OutagePause:
    """Says once when a retrieval outage pauses the learner (``cluster/replay/queue.py``) and once when
    training resumes; ``see`` takes each learner call's ``StepResult``."""

    def __init__(self):
        self.since_s: float | None = None

    def see(self, res) -> None:
        from sonar.cluster.wire import metrics as K

        now_s = res.metrics.get(K.REPLAY_OUTAGE_NOW_S, 0.0)
        if res.waiting and now_s > 0 and self.since_s is None:
            self.since_s = now_s
            log.warning("learner paused: a retrieval outage (searches failing for infrastructure reasons for "
                        "%.0f s); groups without a successful search are requeued, not trained, until one "
                        "searches again (bounded by cluster.step_timeout_s)", now_s)
        elif not res.waiting and self.since_s is not None:
            self.since_s = None
            log.warning("learner resumed: a group searched successfully, the retrieval outage is over")


class LearnerStarved(RunFault):
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
    """What ``LearnerStarved`` says: the wait, the deadline, the batch and the replay's state (and the
    retrieval outage that paused the learner, if one did)."""
    outage = stats.get("outage") if isinstance(stats, dict) else None
    if outage:
        return (f"the learner has waited {waited_s:.0f} s (> cluster.step_timeout_s={cfg.cluster.step_timeout_s:g}), "
                f"paused by a retrieval outage: searches have failed for infrastructure reasons for "
                f"{outage['seconds']:.0f} s ({outage['failed']} groups requeued) and no group has searched "
                f"successfully since; check the retrieval service (replay: {stats})")
    return (f"the learner has waited {waited_s:.0f} s (> cluster.step_timeout_s={cfg.cluster.step_timeout_s:g}) for a "
            f"batch of learner.groups_per_step={cfg.learner.groups_per_step} groups while every rollout worker "
            f"answered its health check: the rollout side is not producing (replay: {stats})")
