"""The README's results are the measurement's, not prose (issue 25: one number per fact, measured on the
commit). ``sonar bench default-run`` runs the README's own command per training seed and writes a JSON;
``--readme`` renders the results table and the run-time phrase from it. These tests (no Ray, no runs)
keep the README equal to that rendering, the JSON a full measurement from a clean commit of this history,
and the preset it measured the one that ships now.
"""
from __future__ import annotations

import copy
import json
import shutil
import subprocess

import pytest

from sonar.bench import common, default_run as D

README = D.README.read_text()


@pytest.fixture(scope="module")
def doc() -> dict:
    path = D.REPO_ROOT / "bench" / "results" / D.readme_json(README)
    assert path.is_file(), f"README.md's results table names {path.name}, which is not in bench/results"
    out = json.loads(path.read_text())
    common.validate_result(out)
    return out


def test_the_readme_shows_its_json(doc):
    name = D.readme_json(README)
    assert D.splice(README, D.TABLE_BEGIN, D.TABLE_END, D.render_table(doc, name), "table") == README, \
        "README.md's results table differs from its JSON: `sonar bench default-run --readme`"
    assert D.render_time(doc) in README, "README.md's run time differs from its JSON: `sonar bench default-run --readme`"


def test_the_json_is_a_full_measurement_of_todays_preset(doc):
    cfg = doc["config"]
    assert doc["name"] == D.NAME and cfg["quick"] is False and cfg["config"] == "tiny" and cfg["overrides"] == []
    assert doc["dirty"] is False and doc["allow_dirty"] is False, "results are written only from a clean commit"
    assert len(cfg["seeds"]) >= 2 and [r["seed"] for r in doc["extra"]["runs"]] == cfg["seeds"]
    assert cfg["preset_sha256"] == D.preset_sha256(D.REPO_ROOT / "configs" / "tiny.yaml"), \
        "configs/tiny.yaml's settings changed after the README's measurement: run `sonar bench default-run` again"
    for r in doc["extra"]["runs"]:
        assert r["balanced"] and r["policy_lag_max"] <= r["max_policy_lag"]
        assert r["argv"][:2] == ["sonar", "train"] and f"run.seed={r['seed']}" in r["argv"]


@pytest.mark.skipif(shutil.which("git") is None or not (D.REPO_ROOT / ".git").exists(), reason="not a git checkout")
def test_the_json_comes_from_this_history(doc):
    if subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=D.REPO_ROOT, capture_output=True,
                      text=True).stdout.strip() == "true":
        pytest.skip("a shallow clone does not hold the history to check")
    rc = subprocess.run(["git", "merge-base", "--is-ancestor", doc["commit"], "HEAD"], cwd=D.REPO_ROOT,
                        capture_output=True).returncode
    assert rc == 0, f"the README's measurement names commit {doc['commit']}, which is not an ancestor of HEAD"


def _doc(**over) -> dict:
    # argv as the JSON records it (a list; split from one string so tests/backend_guard.py does not take
    # this record for a command that starts Ray)
    run = {"seed": 3, "argv": "sonar train --config tiny run.seed=3 model.seed=3 run.root=/x".split(),
           "em_before_search": 0.8, "em_after_search": 0.9413, "f1_before_search": 0.81234, "f1_after_search": 0.95,
           "acc_r_after_search": 0.96, "em_after_no_search": None, "searches_per_question": 1.444,
           "trajectories_per_s": 276.6, "tokens_per_s": 11785.4, "policy_lag_max": 2.0, "max_policy_lag": 2,
           "balanced": True, "command_wall_s": 419.6, "peak_pss_gb": 3.14, "peak_rss_gb": 4.66,
           "eval_n": {"before_search": 375, "after_search": 375}, "loadavg": {"start": [1.04, 1.0, 0.9]}}
    run.update(over)
    return {"commit": "0123456789abcdef", "timestamp": "2026-12-03T13:00:00+00:00",
            "hardware": {"cpu_model": "Xeon", "cpu_usable": 2, "memory_gb": 23.5},
            "metrics": {"command_wall_s": common.summarise([419.6, 480.2])}, "extra": {"runs": [run]}}


def test_the_rendering_pins_formats():
    table = D.render_table(_doc(), "r.json")
    lines = table.splitlines()
    assert lines[0].startswith(D.TABLE_BEGIN + "bench/results/r.json ") and lines[-1] == D.TABLE_END
    assert lines[1] == "| | seed 3 |" and lines[2] == "|---|---|"
    rows = dict(ln.strip("| ").split(" | ") for ln in lines[3:3 + len(D.ROWS)])
    assert rows["held-out EM with search, after async GRPO"] == "**94.1 %**"
    assert rows["held-out F1 with search, before → after RL"] == "81.2 % → 95.0 %"
    assert rows["held-out EM with search disabled, after RL"] == "n/a"  # eval.no_search off
    assert rows["searches per question (held-out, after RL)"] == "1.44"
    assert rows["learner tokens/s"] == "11,785" and rows["policy lag, max (bound)"] == "2 (2)"
    assert rows["wall clock, whole command"] == "7 min 00 s"  # 419.6 s: 59.6 s rounds up to the next minute
    assert "load average 1.0 at the start" in table and "`sonar train --config tiny run.seed=3 model.seed=3`" in table
    assert "run.root" not in table and "Held-out: 375 questions." in table
    assert D.render_time(_doc()) == (D.TIME_BEGIN + "in about 7 minutes (7 min 00 s to 8 min 00 s over 2 seeds on "
                                     "0123456789)" + D.TIME_END)
    bad = D.render_table(_doc(balanced=False, command_wall_s=61.2), "r.json")
    assert "| **no** |" in bad and "| 1 min 01 s |" in bad


def test_splice_needs_exactly_one_span():
    text = f"a {D.TIME_BEGIN}old{D.TIME_END} b"
    assert D.splice(text, D.TIME_BEGIN, D.TIME_END, "NEW", "phrase") == "a NEW b"
    for broken in ("no markers", text + text):
        with pytest.raises(ValueError, match="expected one phrase"):
            D.splice(broken, D.TIME_BEGIN, D.TIME_END, "NEW", "phrase")


def test_write_readme_refuses_a_dirty_or_quick_result(tmp_path, doc):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    for change in ({"dirty": True}, {"config": {**doc["config"], "quick": True}}, {"name": "end-to-end"}):
        bad = copy.deepcopy(doc) | change
        (tmp_path / "r.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="not a full default-run result from a clean tree"):
            D.write_readme(tmp_path / "r.json", readme)
    assert readme.read_text() == README  # nothing written
    (tmp_path / "ok.json").write_text(json.dumps(doc))
    D.write_readme(tmp_path / "ok.json", readme)  # the committed result re-renders to the same README
    assert readme.read_text() == README.replace(D.readme_json(README), "ok.json")
