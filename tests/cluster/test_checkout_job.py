"""Code that travels: `ray job submit --working-dir <an edited copy of this checkout>` runs the copy's
code in the driver, the learner and the rollout workers (cluster/driver/jobs.py: the driver re-executes
from the checkout and ships it as py_modules), against a Ray head this test starts on 127.0.0.1."""
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster.test_job_submit import _submit, ray_head  # noqa: F401  (ray_head: the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]


def test_an_edited_checkout_runs_in_every_role_of_the_job(ray_head, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    url, _ = ray_head
    copy = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, copy / rel)
    init = copy / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.2.0"', '__version__ = "0.2.0+edited"'))
    assert "0.2.0+edited" in init.read_text()
    (copy / "job.yaml").write_text("run:\n  name: edited\n")
    sid = _submit(url, copy, tmp_path / "persist" / "runs", [])
    jobs = JobSubmissionClient(url)
    assert jobs.get_job_status(sid) == JobStatus.SUCCEEDED
    logs = jobs.get_job_logs(sid)
    said = "\n".join(ln for ln in logs.splitlines() if any(w in ln for w in ("job:", "code:", "Traceback", "runtime env", "packag")))
    assert "job: running the working dir's Sonar" in logs, logs[:4000]
    assert "code: driver, learner and 1 rollout workers run sonar 0.2.0+edited (" in logs, said
    assert "code: the driver runs" not in logs  # no role imported another copy
