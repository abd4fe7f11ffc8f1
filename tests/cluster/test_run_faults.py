"""How a run that fails says so (issue: deaths and hangs of the roles ended runs with generic errors).

- A ``RunFault`` (a role or resource named in its message) is one line on the terminal, ``sonar: run
  failed: ...`` and exit 1, with the traceback in the run directory's ``error.log``.
- A failure to mark the run FAILED (MLflow on a full disk) is logged, never raised over the run's own error.
- A stopped (SIGSTOP) replay queue fails the learner's next get within its wait plus
  ``cluster.health_timeout_s``, naming the queue, instead of the driver's ``step_timeout_s`` later; every
  driver call to it has a deadline too (``reports.answer``).
"""
import logging
import os
import signal
import types

import pytest


def test_a_run_fault_is_one_line_naming_the_error_log(monkeypatch, tmp_path, capsys):
    from sonar.cluster.driver import cli, loop
    from sonar.cluster.driver.rollout_pool import WorkerFailed

    def fail(cfg):
        e = WorkerFailed("rollout worker 1 failed (3 prompts requeued) and cluster.max_worker_restarts=0 is used up:\n"
                         "generate: ActorDiedError: the actor died")
        e.error_log = str(tmp_path / "error.log")
        raise e

    monkeypatch.setattr(loop, "train", fail)
    rc = cli.main(["train", "--config", "smoke", f"run.root={tmp_path}", "tracking.enabled=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1] == ("sonar: run failed: rollout worker 1 failed (3 prompts requeued) and cluster.max_worker_restarts=0 "
                       f"is used up: generate: ActorDiedError: the actor died (traceback in {tmp_path / 'error.log'})")


@pytest.mark.ray  # it calls train (tests/backend_guard.py reads the call); start_roles is replaced, Ray never starts
def test_a_failure_to_mark_the_run_failed_does_not_hide_the_runs_own_error(monkeypatch, tmp_path, caplog):
    """The roles fail to start; marking the MLflow run FAILED then raises too (a full disk): the run's own
    error is the one raised, the other is logged, and the traceback is in ``error.log``."""
    from sonar.cluster.driver import loop
    from sonar.cluster.driver.rollout_pool import WorkerFailed
    from sonar.cluster.wire.config import load_config

    class Sink:
        def finish(self, status):
            raise OSError(28, "No space left on device")

    run = types.SimpleNamespace(dir=tmp_path, finish=lambda status: Sink().finish(status))
    monkeypatch.setattr(loop, "start_run", lambda cfg: run)

    def start_roles(cfg, run, hooks):
        raise WorkerFailed("rollout worker 0 failed")

    monkeypatch.setattr(loop, "start_roles", start_roles)
    monkeypatch.setattr(loop, "stop_roles", lambda roles: None)
    with caplog.at_level(logging.ERROR, logger="sonar"), pytest.raises(WorkerFailed, match="rollout worker 0 failed") as ei:
        loop.train(load_config([], [f"run.root={tmp_path}"]))
    assert any(r.getMessage().startswith("could not mark the run FAILED (OSError: [Errno 28] No space left on device)")
               for r in caplog.records)
    assert ei.value.error_log == str(tmp_path / "error.log")
    assert "WorkerFailed: rollout worker 0 failed" in (tmp_path / "error.log").read_text()


@pytest.mark.ray
def test_a_stopped_replay_queue_fails_the_learners_get_naming_it(shared_ray):
    """SIGSTOP on the replay's process: the learner's get (a 0.5 s wait) raises ``ReplayUnresponsive`` once
    0.5 s + ``cluster.health_timeout_s`` (2 s here) pass without an answer. Before, the get had no deadline
    and the driver's ``ray.get`` of the learner step waited ``cluster.step_timeout_s`` (11 minutes with the
    health checks in the probe), then said only ``GetTimeoutError``."""
    from sonar.cluster.wire.config import load_config
    from sonar.cluster.driver.reports import answer
    from sonar.cluster.wire.errors import ReplayUnresponsive, RoleUnresponsive
    from sonar.cluster.replay.queue import ReplayQueue
    from sonar.learner.worker import Learner
    from tests.ray_job import ray_for_module

    with ray_for_module(__name__, shared_ray) as ray:
        replay = ray.remote(ReplayQueue).options(num_cpus=0).remote(8, 2, "drop", 10, 0)
        pid = ray.get(replay.ping.remote(), timeout=120)["pid"]
        cfg = load_config([], ["cluster.health_timeout_s=2", "learner.groups_per_step=1"])
        me = types.SimpleNamespace(cfg=cfg, version=0)
        assert Learner._replay_get(me, replay, 0.5)["timed_out"]  # alive: an empty answer after its wait
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(ReplayUnresponsive, match=r"the replay queue did not answer the learner's get within "
                                                         r"2.5 s \(its 0.5 s wait \+ cluster.health_timeout_s=2\): hung"):
                Learner._replay_get(me, replay, 0.5)
            # the driver's own calls to it: a deadline each, the role and the call named
            with pytest.raises(RoleUnresponsive, match=r"^the replay queue did not answer drain within 2 s \(hung"):
                answer(cfg, replay.drain.remote(), "replay queue", "drain")
        finally:
            os.kill(pid, signal.SIGCONT)
            ray.kill(replay, no_restart=True)
