"""bench/README.md's async-vs-sync results are the measurement's, not prose (issue 24: "the README's results
tables are regenerated from the JSONs by a script, so they cannot drift"). ``sonar bench async-vs-sync
--readme JSON`` renders the block from a result; these tests (no Ray, no runs) pin the rendering on a
result built from ``compare`` and keep bench/README.md equal to the rendering of the JSON it names.
"""
from __future__ import annotations

import json
import math
import subprocess

import pytest

from sonar.bench import async_vs_sync as A
from sonar.bench import common
from sonar.bench.stats import mean_ci

KEYS = [k for _, k, _ in A.SETTING_ROWS] + ["generated_per_trained", "generated_tokens_per_trained_traj",
                                            "generated_tokens_per_s", "command_s", "wall_with_startup_s"]


def _run(wall: float, em: float, stale: float = 0.0, trained: float = 640.0, reward: float = 0.5) -> dict:
    m = {k: 1.0 for k in KEYS}
    m.update(wall_s=wall, wall_with_startup_s=wall + 10, command_s=wall + 20, heldout_em=em, stale_share=stale,
             reward_last=reward, trained_traj_per_s=trained / wall, mfu=0.25)
    return {"metrics": m}


def _doc(per: dict, lags: list[int], baselines: list[str]) -> dict:
    by = {b: A.compare(per, lags, baseline=b) for b in baselines}
    best = A.better_baseline(per, baselines)
    return {"name": A.NAME, "argv": ["sonar", "bench", "async-vs-sync", "--workload", "reference-7b"],
            "commit": "0123456789abcdef", "timestamp": "2026-12-05T03:00:00", "dirty": False,
            "hardware": {"cpu_model": "Test CPU", "cpu_usable": 2},
            "config": {"quick": False, "lags": lags, "workload": {"workload": "reference-7b"},
                       "resolved": {"stages": [{"steps": 300}, {"steps": 8}]}},
            "extra": {"settings": {n: [{"seed": i, **r} for i, r in enumerate(rs)] for n, rs in per.items()},
                      "baseline": best, "comparison": by[best], "comparison_by_baseline": by, "seeds": [0, 1, 2],
                      "machine_note": "load 0.5 to 0.7", "wall_s": 3600.0}}


def test_the_block_shows_means_intervals_speedups_and_the_equivalence_verdicts():
    per = {"sync": [_run(60, 0.80), _run(60, 0.81), _run(60, 0.82)],
           "sync_full": [_run(50, 0.80), _run(52, 0.80), _run(54, 0.80)],
           "async_lag2": [_run(20, 0.81, 0.05), _run(20, 0.81, 0.05), _run(20, 0.81, 0.05)]}
    doc = _doc(per, [2], ["sync", "sync_full"])
    out = A.render_table(doc, "r.json")
    assert out.startswith(A.TABLE_BEGIN + "bench/results/r.json") and out.endswith(A.TABLE_END)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    # sync's held-out EM over seeds: 81.0 % +- t(0.975, 2) * 1 pt / sqrt(3) = 2.5 pt
    half = mean_ci([0.80, 0.81, 0.82])["half"]
    assert f"| 81.0 % ± {100 * half:.1f} pt |" in rows["final held-out EM"]
    assert rows["stale share of generated"].endswith("| 0.0 % ± 0.0 pt | 0.0 % ± 0.0 pt | 5.0 % ± 0.0 pt |")
    # sync_full is the better baseline (640 / 52 traj/s over 640 / 60): marked, and async is 2.6x it on average
    lines = [line for line in out.splitlines() if line.startswith("| lag 2 |")]
    assert len(lines) == 2 and "| sync_full (better) |" in lines[1] and "(better)" not in lines[0]
    sp = mean_ci([50 / 20, 52 / 20, 54 / 20])
    assert f"| {sp['mean']:.2f} [{sp['lo']:.2f}, {sp['hi']:.2f}]× |" in lines[1]
    # against sync: EM differences [0.01, 0, -0.01], 90 % interval inside 3 pt -> equivalent, every goal met
    assert "| 3.00 [3.00, 3.00]× | 0.0 pt [-1.7 pt, 1.7 pt] ±3.0 pt: **equivalent** |" in lines[0]
    assert lines[0].endswith("| yes |")
    # against sync_full: EM differences all +0.01 (sd 0): equivalent by the mean; reward equal; goal met
    assert lines[1].endswith("| yes |")
    assert "8 RL steps per run" in out and "`reference-7b`" in out and "commit 0123456789" in out


def test_the_goal_column_names_what_was_missed():
    per = {"sync": [_run(60, 0.80), _run(61, 0.80), _run(62, 0.80)],
           "async_lag2": [_run(40, 0.70, 0.2), _run(41, 0.90, 0.2), _run(42, 0.60, 0.2)]}
    line = [x for x in A.render_table(_doc(per, [2], ["sync"]), "r.json").splitlines() if x.startswith("| lag 2")][0]
    assert "not shown" in line
    assert line.endswith("| no: speedup_ge_2, equal_heldout_em, stale_le_10pct |")


def test_write_readme_refuses_a_quick_or_dirty_result(tmp_path):
    per = {"sync": [_run(60, 0.8)] * 3, "async_lag2": [_run(30, 0.8)] * 3}
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{A.TABLE_BEGIN}old -->\n{A.TABLE_END}\ny\n")
    for bad in ({"dirty": True}, {"config": {"quick": True}}):
        doc = {**_doc(per, [2], ["sync"]), **bad}
        (tmp_path / "r.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError, match="not a full async-vs-sync result"):
            A.write_readme(tmp_path / "r.json", readme)
    (tmp_path / "r.json").write_text(json.dumps(_doc(per, [2], ["sync"])))
    A.write_readme(tmp_path / "r.json", readme)
    assert A.readme_json(readme.read_text()) == "r.json" and readme.read_text().startswith("x\n")



def test_bench_readme_shows_its_async_vs_sync_json():
    text = A.README.read_text()
    name = A.readme_json(text)
    assert name, f"bench/README.md has no {A.TABLE_BEGIN!r} block: `sonar bench async-vs-sync --readme JSON`"
    path = A.REPO_ROOT / "bench" / "results" / name
    doc = json.loads(path.read_text())
    common.validate_result(doc)
    assert doc["name"] == A.NAME and doc["config"]["quick"] is False and doc["dirty"] is False
    assert common.splice(text, A.TABLE_BEGIN, A.TABLE_END, A.render_table(doc, name), "block") == text, \
        "bench/README.md's async-vs-sync block differs from its JSON: `sonar bench async-vs-sync --readme JSON`"
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=A.REPO_ROOT, capture_output=True,
                             text=True).stdout.strip()
    if shallow == "false":
        assert subprocess.run(["git", "merge-base", "--is-ancestor", doc["commit"], "HEAD"], cwd=A.REPO_ROOT,
                              capture_output=True).returncode == 0, f"{name} names a commit outside this history"
    assert math.isfinite(doc["extra"]["wall_s"])


def test_a_variant_block_is_the_same_rendering_between_its_own_markers():
    """A second result shown beside the main one (e.g. ``sim.learner_gpus=4``) renders the same rows between
    markers of its own, so `--readme` keeps writing the main block and each names its JSON."""
    per = {"sync": [_run(60, 0.80), _run(62, 0.81)], "async_lag2": [_run(30, 0.80), _run(31, 0.81)]}
    doc = _doc(per, [2], ["sync"])
    main, var = A.render_table(doc, "r.json"), A.render_variant_table(doc, "v.json")
    assert var.startswith(A.VARIANT_BEGIN + "bench/results/v.json") and var.endswith(A.VARIANT_END)
    assert A.TABLE_BEGIN not in var and A.TABLE_END not in var
    assert var.splitlines()[1:-1] == main.splitlines()[1:-1]
