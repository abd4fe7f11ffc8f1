"""Deaths by SIGKILL of the real process, in the middle of an RL stage, through the driver's own loop
(``loop.train`` with a ``Hooks.on_step`` that kills after a given RL step: no sleeps, the step itself
is the event). A worker and a replica die in one run (both are restarted in place), the learner in
another (it restarts every role). The run must finish with the role restarted (or resumed), the
accounting balanced, no prompt trained twice, and no trajectory trained on a failed search."""
import json
import os
import signal
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # slow: the 1,800 s hang guard (tests/conftest.py)


def _cfg(tmp_path, *extra):
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    # smoke, made smaller: 10 SFT steps, 6 + 1 RL steps, 4 held-out questions, no MLflow.
    return load_config([CONFIG_DIR / "smoke.yaml"],
                       [f"run.root={tmp_path}", f"run.run_dir={tmp_path / 'run'}", "tracking.enabled=false",
                        "eval.before=false", "eval.no_search=false", "world.num_heldout_eval=4",
                        "stages.0.steps=10", "stages.1.steps=6", "stages.2.steps=1", *extra])


class KillAfter:
    """on_step hook: after RL step ``at`` of stage 1, SIGKILL the process ``pick(roles)`` names
    (a handle's method that answers {"pid": ...})."""

    def __init__(self, at: int, pick):
        self.at, self.pick, self.killed = at, pick, []

    def __call__(self, roles, run, stage_index, steps):
        import ray

        if stage_index == 1 and steps == self.at and not self.killed:
            pid = ray.get(self.pick(roles).remote(), timeout=60)["pid"]
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)
        return False


def _records(run_dir: Path):
    recs = [json.loads(l) for l in (run_dir / "trained_prompts.jsonl").read_text().splitlines() if l.strip()]
    seen = [p for r in recs for p in r["trained"] + r["dropped"]]
    return recs, seen


def _metrics(run_dir: Path):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


class Kills:
    """on_step hook: several ``KillAfter`` hooks in one run (each at its own step); and, after the last
    RL step of stage 1, retrieval replica 0's pid (``replica_pids``: a restarted replica has a new one)."""

    def __init__(self, *hooks, last: int):
        self.hooks, self.last, self.replica_pids = hooks, last, []

    def __call__(self, roles, run, stage_index, steps):
        import ray

        for hook in self.hooks:
            hook(roles, run, stage_index, steps)
        if stage_index == 1 and steps == self.last:
            self.replica_pids.append(ray.get(roles.retrieval[0].health.remote(), timeout=120)["pid"])
        return False


@pytest.fixture(scope="module")
def worker_and_replica_killed(tmp_path_factory, shared_ray):
    """One run, two deaths that are restarted in place: rollout worker 1 SIGKILLed after RL step 2 and
    retrieval replica 0 after step 3 (of 6). The learner's death is a run of its own below: it restarts
    every role from a checkpoint, which would hide what these two restarts leave behind."""
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks

    tmp_path = tmp_path_factory.mktemp("sigkill")
    worker = KillAfter(2, lambda roles: roles.workers[1].ready)
    replica = KillAfter(3, lambda roles: roles.retrieval[0].health)
    hook = Kills(worker, replica, last=6)
    summary = train(_cfg(tmp_path, "cluster.max_worker_restarts=1", "cluster.max_replica_restarts=1"),
                    Hooks(on_step=hook))
    return summary, worker, replica, hook


def test_sigkilled_worker_is_restarted_and_the_run_completes(worker_and_replica_killed):
    import ray

    summary, hook, _, _ = worker_and_replica_killed
    assert len(hook.killed) == 1
    assert summary["faults"]["worker_restarts"] == 1
    # the new worker took part in the final push: every worker holds the learner's weights
    w = summary["weights"]
    assert all(x["version"] == w["learner"]["version"] for x in w["workers"])
    assert summary["replay"]["balanced"] and summary["replay"]["outstanding_claims"] == 0
    recs, seen = _records(Path(summary["run_dir"]))
    assert len(seen) == len(set(seen)), "a prompt was trained twice"
    assert sum(len(r["trained"]) for r in recs) == summary["replay"]["consumed_groups"]
    assert not ray.is_initialized()


def test_sigkilled_replica_is_restarted_and_failed_searches_are_not_trained(worker_and_replica_killed):
    from sonar.cluster.wire import metrics as K

    summary, _, hook, probe = worker_and_replica_killed
    seen_pids = probe.replica_pids
    assert len(hook.killed) == 1 and seen_pids and seen_pids[0] != hook.killed[0], "the replica was not restarted"
    assert summary["replay"]["balanced"]
    recs, seen = _records(Path(summary["run_dir"]))
    assert len(seen) == len(set(seen)), "a prompt was trained twice"
    rows = [r for r in _metrics(Path(summary["run_dir"])) if K.RETRIEVAL_ERRORS in r]
    assert rows, "no rollout metrics were logged"
    # Trajectories that reached the replay (and so the learner) had no failed search: a group with
    # one was requeued instead (cluster.requeue_failed_searches).
    assert all(r[K.RETRIEVAL_ERRORS] == 0 for r in rows), [r[K.RETRIEVAL_ERRORS] for r in rows]
    assert all(r.get(K.ROLLOUT_FINISH.format(reason="retrieval_error"), 0) == 0 for r in rows)


def test_sigkilled_learner_is_resumed_from_the_last_checkpoint(tmp_path, shared_ray):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks

    hook = KillAfter(3, lambda roles: roles.learner.ping)  # a checkpoint at step 2; step 3 is rolled back
    summary = train(_cfg(tmp_path, "cluster.auto_resume=1", "run.checkpoint_every=2"), Hooks(on_step=hook))
    assert len(hook.killed) == 1 and summary["faults"]["learner_resumes"] == 1
    assert summary["replay"]["balanced"]
    recs, seen = _records(Path(summary["run_dir"]))
    assert len(seen) == len(set(seen)), "a prompt was trained twice"
    # versions continue from the checkpoint (RL step 2): step 3 is trained again, recorded once
    versions = [r["version"] for r in recs]
    assert versions == sorted(versions) and len(versions) == len(set(versions))
    assert summary["weights"]["learner"]["version"] == versions[-1]


def test_sigkilled_replay_queue_is_resumed_from_the_last_checkpoint(tmp_path, shared_ray):
    """Finding: the replay's SIGKILL ended the run with a generic error, though its state (the prompt
    cursor, the accounting) is in every checkpoint. Now its death is a role death like the learner's:
    the roles restart from the last complete checkpoint (``cluster.auto_resume``), what was trained after
    it is trained again and recorded once, and the accounting balances."""
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks

    hook = KillAfter(3, lambda roles: roles.replay.ping)  # a checkpoint at step 2; step 3 is rolled back
    summary = train(_cfg(tmp_path, "cluster.auto_resume=1", "run.checkpoint_every=2"), Hooks(on_step=hook))
    assert len(hook.killed) == 1
    assert summary["faults"]["replay_resumes"] == 1 and summary["faults"]["learner_resumes"] == 0
    assert summary["replay"]["balanced"]
    recs, seen = _records(Path(summary["run_dir"]))
    assert len(seen) == len(set(seen)), "a prompt was trained twice"
    versions = [r["version"] for r in recs]
    assert versions == sorted(versions) and len(versions) == len(set(versions))
    assert sum(len(r["trained"]) for r in recs) == summary["replay"]["consumed_groups"]
