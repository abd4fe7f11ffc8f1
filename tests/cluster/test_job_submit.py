"""`ray job submit` end to end against a Ray head this test starts on 127.0.0.1 (and stops: only the
processes it started, never `ray stop`).

1. A short smoke run submitted with ``--working-dir`` (a config file from the uploaded folder) and
   ``--runtime-env-json`` env vars that Sonar also sets: it runs on that cluster, SUCCEEDED, and its
   MLflow run and checkpoints are under ``$SONAR_RUN_ROOT``, nothing under Ray's package folder.
2. A long run, stopped with ``ray job stop`` once it has a checkpoint, under Ray's default stop wait
   (SIGTERM, then SIGKILL 3 s later): MLflow KILLED within it, no actor left.
3. A fresh submission of the same run name with ``run.resume=latest`` resumes the stopped run's
   checkpoint (not the first run's, of another name under the same root) and finishes.
"""
import re
import subprocess
from pathlib import Path

import pytest

from tests.cluster.ray_head import (BIN, _alive_actors, _env, _mlflow_status, _run_of, _submit,  # noqa: F401
                                    ray_head)  # (ray_head: the fixture)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_submit_stop_and_resume_through_ray_jobs(ray_head, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors

    from sonar.learner.checkpoint import CheckpointError, resolve_checkpoint

    url, temp = ray_head
    jobs = JobSubmissionClient(url)
    wd = tmp_path / "wd"  # the user's project folder: uploaded, run from Ray's package folder
    wd.mkdir()
    (wd / "job.yaml").write_text("run:\n  name: job\n")
    root = tmp_path / "persist" / "runs"

    # 1. a short run: SUCCEEDED, on this cluster, its files under SONAR_RUN_ROOT
    first = _submit(url, wd, root, [])
    assert jobs.get_job_status(first) == JobStatus.SUCCEEDED
    logs = jobs.get_job_logs(first)
    assert "temporary package folder" in logs and str(root) in logs
    job_id = jobs.get_job_info(first).job_id  # the driver's Ray job: its actors ran on this head
    ran_here = {a.class_name for a in list_actors(address=url, limit=1000) if a.job_id == job_id}
    assert any("Learner" in n for n in ran_here) and any("Worker" in n for n in ran_here), ran_here
    run1, id1 = _run_of(logs)
    assert run1.parent == root and run1.name.startswith("job-")
    assert resolve_checkpoint(str(run1), str(root))  # a complete checkpoint where configured
    assert _mlflow_status(root, id1) == "FINISHED"
    pkg = Path(temp)
    assert not [p for p in pkg.rglob("working_dir_files/*/*") if p.name in ("runs", "mlflow.db", "index")]

    # 2. a long run, stopped once it has a checkpoint: KILLED, no actor left
    long_ = _submit(url, wd, root, ["run.name=long", "run.checkpoint_every=2", "stages.0.steps=100000"], wait=False)

    def checkpoint():
        for d in root.glob("long-*"):
            try:
                return resolve_checkpoint(str(d), str(root))
            except (CheckpointError, OSError):
                return None
        if jobs.get_job_status(long_).is_terminal():
            raise AssertionError(f"the long run ended: {jobs.get_job_logs(long_)[-4000:]}")
        return None
    ckpt = wait_until(checkpoint, 600, "the long run's first checkpoint", poll_s=0.5)
    stop = subprocess.run([str(BIN / "ray"), "job", "stop", "--address", url, long_], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert jobs.get_job_status(long_) == JobStatus.STOPPED
    long_logs = jobs.get_job_logs(long_)
    run2, id2 = _run_of(long_logs)
    assert _mlflow_status(root, id2) == "KILLED", long_logs[-4000:]
    # the driver's own account: KILLED written on the SIGTERM, before the actors were killed
    took = re.findall(r"interrupted \(signal 15\): MLflow run marked KILLED, its metrics flushed ([0-9.]+) s after "
                      r"the signal", long_logs)
    assert took, long_logs[-4000:]
    print(f"ray job stop: KILLED and metrics flushed {took[0]} s after the SIGTERM (Ray's stop wait: 3 s)")
    long_job_id = jobs.get_job_info(long_).job_id
    wait_until(lambda: not _alive_actors(url, long_job_id), 60,
               lambda: f"the stopped job's actors to end: {_alive_actors(url, long_job_id)}", poll_s=0.5)

    # 3. a fresh submission resumes it
    third = _submit(url, wd, root, ["run.name=long", "run.resume=latest"])
    assert jobs.get_job_status(third) == JobStatus.SUCCEEDED
    resumed_logs = jobs.get_job_logs(third)
    # the stopped run's checkpoint (the first one seen, or one it saved before the stop took effect)
    assert f"resumed from {Path(ckpt).parent}/" in resumed_logs, resumed_logs[-4000:]
    _, id3 = _run_of(resumed_logs)
    assert _mlflow_status(root, id3) == "FINISHED"
