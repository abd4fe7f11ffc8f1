"""`ray job submit` end to end against one Ray head this module starts on 127.0.0.1 (and stops: only the
processes it started, never `ray stop`). Every job's ``$SONAR_RUN_ROOT`` is one root, as a team shares it.

1. Code that travels, and plug-ins from outside the package (issue 23's acceptance run), in one short run:
   submitted with ``--working-dir`` an edited copy of this checkout (cluster/driver/jobs.py: the driver
   re-executes from the checkout and ships it as py_modules), a config file from the uploaded folder,
   ``--runtime-env-json`` env vars that Sonar also sets and py_modules of its own (a reward plug-in
   package, stage 1's reward), a tool and a retriever from a file in the working dir, and stage 2's reward
   from a file in another temporary folder, named by its absolute path. It runs on that cluster,
   SUCCEEDED, the copy's code in the driver, the learner and the rollout workers, the job's py_modules
   kept and imported by the workers, the trajectories show each plug-in was used; its MLflow run and
   checkpoints are under ``$SONAR_RUN_ROOT``, nothing under Ray's package folder.
2. A long run, stopped with ``ray job stop`` once it has a checkpoint, under Ray's default stop wait
   (SIGTERM, then SIGKILL 3 s later): MLflow KILLED within it, no actor left. A fresh submission of the
   same run name with ``run.resume=latest`` resumes the stopped run's checkpoint (not run 1's, of another
   name under the same root) and finishes.

The tests share the head (one start, not one each) and run 1 (one short run, where there were two: the
plug-ins had a run of their own) is the run the others' checks need before them.
"""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.checkout import copy_tracked
from tests.cluster.ray_head import (BIN, _alive_actors, _env, _mlflow_status, _run_of, _submit,  # noqa: F401
                                    ray_head)  # (ray_head: the fixture)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "examples" / "plugins" / "my_plugins.py"


@pytest.fixture(scope="module")
def checkout_job(ray_head, tmp_path_factory):
    """Run 1: the short smoke run from an edited copy of this checkout, with a py_modules reward package
    (stage 1), a tool and a retriever from the working dir and a reward named by its path (stage 2).
    Returns (submission id, the copy's code as every role must report it, the job's logs)."""
    from ray.job_submission import JobSubmissionClient

    from sonar.cluster.wire.paths import code_fingerprint

    url, _, root = ray_head
    tmp_path = tmp_path_factory.mktemp("checkout_job")
    copy = copy_tracked(tmp_path / "checkout")
    init = copy / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.2.0"', '__version__ = "0.2.0+edited"'))
    assert "0.2.0+edited" in init.read_text()
    shutil.copy(PLUGINS, copy / "my_plugins.py")  # the user's file in the uploaded working dir
    edited = f"sonar 0.2.0+edited ({code_fingerprint(copy)})"  # the copy's code, as every role must report it
    (copy / "job.yaml").write_text(
        "run:\n  name: edited\n"
        "protocol:\n  tools: [search, \"my_plugins.py:make_lookup\"]\n"
        "retrieval:\n  backend: \"my_plugins.py:make_echo_retriever\"\n")
    plug = tmp_path / "user_modules" / "jobplug"  # the user's own py_modules: a package of plug-ins
    plug.mkdir(parents=True)
    (plug / "__init__.py").write_text("")
    shutil.copy(PLUGINS, plug / "rewards.py")
    elsewhere = tmp_path / "elsewhere"  # a file outside the working dir, named by its absolute path
    elsewhere.mkdir()
    shutil.copy(PLUGINS, elsewhere / "rewards.py")
    # SFT long enough for the tiny policy to learn the lookup call its demonstrations make
    sid = _submit(url, copy, root, ["stages.0.steps=60", "stages.1.steps=2", "stages.2.steps=2",
                                    "stages.1.reward.name=jobplug.rewards:short_answer_reward",  # dotted: py_modules
                                    f"stages.2.reward.name={elsewhere / 'rewards.py'}:short_answer_reward"],
                  runtime_env={"py_modules": [str(plug)]})
    return sid, edited, JobSubmissionClient(url).get_job_logs(sid)


def test_a_submitted_run_ran_on_the_head_with_its_files_under_sonar_run_root(ray_head, checkout_job):
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors

    from sonar.learner.checkpoint import resolve_checkpoint

    url, temp, root = ray_head
    sid, _, logs = checkout_job
    jobs = JobSubmissionClient(url)
    assert jobs.get_job_status(sid) == JobStatus.SUCCEEDED, logs[-6000:]
    assert "temporary package folder" in logs and str(root) in logs
    job_id = jobs.get_job_info(sid).job_id  # the driver's Ray job: its actors ran on this head
    ran_here = {a.class_name for a in list_actors(address=url, limit=1000) if a.job_id == job_id}
    assert any("Learner" in n for n in ran_here) and any("Worker" in n for n in ran_here), ran_here
    run1, id1 = _run_of(logs)
    assert run1.parent == root and run1.name.startswith("edited-")
    assert resolve_checkpoint(str(run1), str(root))  # a complete checkpoint where configured
    assert _mlflow_status(root, id1) == "FINISHED"
    pkg = Path(temp)
    assert not [p for p in pkg.rglob("working_dir_files/*/*") if p.name in ("runs", "mlflow.db", "index")]


def test_an_edited_checkout_runs_in_every_role_of_the_job(ray_head, checkout_job):
    _, temp, _ = ray_head
    _, edited, logs = checkout_job
    said = "\n".join(ln for ln in logs.splitlines() if any(w in ln for w in ("job:", "code:", "Traceback", "runtime env")))
    assert "job: running the working dir's Sonar" in logs, said
    # the driver: the copy (its working dir as Ray unpacked it), not the installed package
    driver = re.search(r"job: the driver runs (sonar \S+ \(\w+\)) from (\S+) \(the job's working dir", logs)
    assert driver, said
    assert driver.group(1) == edited
    assert Path(driver.group(2)).name != "wt-travel" and "working_dir_files" in driver.group(2), said
    # the learner and the workers: the same code, from Ray's unpacked py_modules copy of the staged checkout
    roles = re.search(r"code: driver, learner and 1 rollout workers run (sonar \S+ \(\w+\)) \(driver from (\S+); "
                      r"learner from (\S+); rollout workers from (\S+)\)", logs)
    assert roles, said
    assert roles.group(1) == edited and roles.group(2) == driver.group(2)
    for folder in roles.group(3, 4):
        assert "py_modules_files" in folder and folder.startswith(temp) and folder.endswith("/sonar"), said
    assert "code: the driver runs" not in logs  # no role imported another copy
    assert "after the job's own" in logs  # the job's py_modules kept, the checkout after them
    run_dir, _ = _run_of(logs)
    recs = [json.loads(line) for line in (run_dir / "predictions-after_search.jsonl").read_text().splitlines()]
    assert recs and all("extra_searches" in r["reward_parts"] for r in recs)  # the user's module's reward scored


def test_a_job_runs_a_reward_a_tool_and_a_retriever_from_outside_the_package(ray_head, checkout_job):
    from sonar.cluster.wire import metrics as K

    run_dir, _ = _run_of(checkout_job[2])
    recs = [json.loads(line) for line in (run_dir / "predictions-after_search.jsonl").read_text().splitlines()]
    searched = [d for r in recs for s in r["searches"] for ids in s["doc_ids"] for d in ids]
    assert searched and all(d.startswith("echo-") for d in searched)  # the plug-in retriever answered
    lookups = [c for r in recs for c in r["tool_calls"] if c["tool"] == "lookup"]
    assert lookups and any(c["refs"] and c["refs"][0].startswith("echo-") for c in lookups)  # the plug-in tool ran
    assert all("extra_searches" in r["reward_parts"] for r in recs)  # the plug-in reward scored them
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    part = K.ROLLOUT_REWARD_PART.format(part="extra_searches")
    assert {r["stage"] for r in rows if part in r} == {1, 2}  # both rewards scored their stage's rollouts
    assert any(K.ROLLOUT_TOOL_CALLS_MEAN.format(tool="lookup") in x for x in rows)
    recorded = (run_dir / "config.yaml").read_text()
    assert "def short_answer_reward" in recorded  # the code it ran, recorded


def test_stop_and_resume_through_ray_jobs(ray_head, checkout_job, tmp_path):
    """Needs run 1 (``checkout_job``): another run name under the same root, which resume=latest skips."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from sonar.learner.checkpoint import CheckpointError, resolve_checkpoint

    url, _, root = ray_head
    jobs = JobSubmissionClient(url)
    run1, _ = _run_of(checkout_job[2])
    assert run1.parent == root and resolve_checkpoint(str(run1), str(root))  # a checkpoint resume must not pick
    wd = tmp_path / "wd"  # the user's project folder: uploaded, run from Ray's package folder
    wd.mkdir()
    (wd / "job.yaml").write_text("run:\n  name: job\n")

    # a long run, stopped once it has a checkpoint: KILLED, no actor left
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

    # a fresh submission resumes it
    third = _submit(url, wd, root, ["run.name=long", "run.resume=latest"])
    assert jobs.get_job_status(third) == JobStatus.SUCCEEDED
    resumed_logs = jobs.get_job_logs(third)
    # the stopped run's checkpoint (the first one seen, or one it saved before the stop took effect)
    assert f"resumed from {Path(ckpt).parent}/" in resumed_logs, resumed_logs[-4000:]
    _, id3 = _run_of(resumed_logs)
    assert _mlflow_status(root, id3) == "FINISHED"
