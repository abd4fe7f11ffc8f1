"""Plug-ins through `ray job submit` (issue 23's acceptance run): the smoke preset with a reward, a tool
and a retriever that live outside the package, in the job's working dir and in another temporary folder
(neither on the installed package's sys.path), submitted to a Ray head this test starts on 127.0.0.1.
The trajectories show each was used: the retriever's documents, the tool's calls, the reward's own part."""
import json
import shutil
from pathlib import Path

import pytest

from tests.cluster.ray_head import _run_of, _submit, ray_head  # noqa: F401  (ray_head: the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.ray]

PLUGINS = Path(__file__).resolve().parents[1] / "fixtures" / "plugins" / "my_plugins.py"


def test_a_job_runs_a_reward_a_tool_and_a_retriever_from_outside_the_package(ray_head, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    from sonar.cluster.wire import metrics as K

    url, _ = ray_head
    wd = tmp_path / "project"  # the user's project folder, uploaded as the job's working dir
    wd.mkdir()
    shutil.copy(PLUGINS, wd / "my_plugins.py")
    elsewhere = tmp_path / "elsewhere"  # a file outside the working dir, named by its absolute path
    elsewhere.mkdir()
    shutil.copy(PLUGINS, elsewhere / "rewards.py")
    (wd / "job.yaml").write_text(
        "run:\n  name: plugjob\n"
        "protocol:\n  tools: [search, \"my_plugins.py:make_lookup\"]\n"
        "retrieval:\n  backend: \"my_plugins.py:make_echo_retriever\"\n")
    root = tmp_path / "persist" / "runs"
    reward = f"{elsewhere / 'rewards.py'}:short_answer_reward"
    sid = _submit(url, wd, root, ["stages.0.steps=60", "stages.1.steps=2", f"stages.1.reward.name={reward}",
                                  f"stages.2.reward.name={reward}"])
    jobs = JobSubmissionClient(url)
    assert jobs.get_job_status(sid) == JobStatus.SUCCEEDED
    run_dir, _ = _run_of(jobs.get_job_logs(sid))
    recs = [json.loads(line) for line in (run_dir / "predictions-after_search.jsonl").read_text().splitlines()]
    searched = [d for r in recs for s in r["searches"] for ids in s["doc_ids"] for d in ids]
    assert searched and all(d.startswith("echo-") for d in searched)  # the plug-in retriever answered
    lookups = [c for r in recs for c in r["tool_calls"] if c["tool"] == "lookup"]
    assert lookups and any(c["refs"] and c["refs"][0].startswith("echo-") for c in lookups)  # the plug-in tool ran
    assert all("extra_searches" in r["reward_parts"] for r in recs)  # the plug-in reward scored them
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(K.ROLLOUT_REWARD_PART.format(part="extra_searches") in x for x in rows)
    assert any(K.ROLLOUT_TOOL_CALLS_MEAN.format(tool="lookup") in x for x in rows)
    assert "def short_answer_reward" in (run_dir / "config.yaml").read_text()  # the code it ran, recorded
