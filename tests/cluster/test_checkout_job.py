"""Code that travels: `ray job submit --working-dir <an edited copy of this checkout>` runs the copy's
code in the driver, the learner and the rollout workers (cluster/driver/jobs.py: the driver re-executes
from the checkout and ships it as py_modules), against a Ray head this test starts on 127.0.0.1. The job
names py_modules of its own too (a reward plug-in package): they are kept, and the workers import them."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster.ray_head import _run_of, _submit, ray_head  # noqa: F401  (ray_head: the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "fixtures" / "plugins" / "my_plugins.py"


def test_an_edited_checkout_runs_in_every_role_of_the_job(ray_head, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    from sonar.cluster.wire.paths import code_fingerprint

    url, temp = ray_head
    copy = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, copy / rel)
    init = copy / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.2.0"', '__version__ = "0.2.0+edited"'))
    assert "0.2.0+edited" in init.read_text()
    edited = f"sonar 0.2.0+edited ({code_fingerprint(copy)})"  # the copy's code, as every role must report it
    (copy / "job.yaml").write_text("run:\n  name: edited\n")
    plug = tmp_path / "user_modules" / "jobplug"  # the user's own py_modules: a package of plug-ins
    plug.mkdir(parents=True)
    (plug / "__init__.py").write_text("")
    shutil.copy(PLUGINS, plug / "rewards.py")
    reward = "jobplug.rewards:short_answer_reward"  # dotted: imported from py_modules, by the driver and workers
    sid = _submit(url, copy, tmp_path / "persist" / "runs", [f"stages.1.reward.name={reward}",
                                                             f"stages.2.reward.name={reward}"],
                  runtime_env={"py_modules": [str(plug)]})
    jobs = JobSubmissionClient(url)
    logs = jobs.get_job_logs(sid)
    said = "\n".join(ln for ln in logs.splitlines() if any(w in ln for w in ("job:", "code:", "Traceback", "runtime env")))
    assert jobs.get_job_status(sid) == JobStatus.SUCCEEDED, logs[-6000:]
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
