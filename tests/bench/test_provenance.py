"""Provenance of benchmark results (issue 11): a result is written only from a clean tree -- untracked
source files count as dirty -- unless the benchmark is told ``--allow-dirty``, and the JSON says so."""
from __future__ import annotations

import json
import subprocess

import pytest

from sonar.bench import common


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(root), "PATH": "/usr/bin:/bin"})


@pytest.fixture
def repo(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "bench" / "results").mkdir(parents=True)
    (root / "bench" / "a.py").write_text("x = 1\n")
    (root / ".gitignore").write_text("runs/\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "init")
    monkeypatch.setattr(common, "REPO_ROOT", root)
    monkeypatch.delenv(common.ALLOW_DIRTY_ENV, raising=False)
    return root


def _write(out, **kw):
    return common.write_result("unit", {"a": 1}, {"x": common.summarise([1.0])}, None, out, **kw)


def test_clean_tree_writes_and_records_clean(repo, tmp_path):
    doc = json.loads(_write(tmp_path / "out").read_text())
    assert doc["dirty"] is False and doc["dirty_files"] == [] and doc["allow_dirty"] is False


def test_a_variant_has_a_file_of_its_own_beside_the_defaults(repo, tmp_path):
    """``rollout-scaling --engine vllm`` at the commit of a default ``rollout-scaling``: both kept (a variant
    once replaced the default's file of the same commit)."""
    default, vllm = _write(tmp_path / "out"), _write(tmp_path / "out", variant="vllm")
    assert default != vllm and default.exists() and vllm.exists()
    assert vllm.name.startswith("unit-vllm-") and not default.name.startswith("unit-vllm-")
    docs = [json.loads(p.read_text()) for p in (default, vllm)]
    assert [(d["name"], d["variant"]) for d in docs] == [("unit", None), ("unit", "vllm")]


@pytest.mark.parametrize("change", ["untracked", "modified", "staged", "deleted"])
def test_dirty_tree_refuses_and_writes_nothing(repo, tmp_path, change):
    if change == "untracked":  # what `git status --untracked-files=no` missed
        (repo / "bench" / "new_bench.py").write_text("y = 2\n")
        expect = "bench/new_bench.py"
    elif change == "modified":
        (repo / "bench" / "a.py").write_text("x = 2\n")
        expect = "bench/a.py"
    elif change == "staged":
        (repo / "b.py").write_text("z\n")
        _git(repo, "add", "b.py")
        expect = "b.py"
    else:
        (repo / "bench" / "a.py").unlink()
        expect = "bench/a.py"
    assert common.dirty_files(repo) == [expect]
    out = tmp_path / "out"
    with pytest.raises(common.DirtyTreeError, match=expect.replace(".", r"\.")):
        _write(out)
    assert not out.exists() or not list(out.iterdir())


def test_ignored_files_and_result_outputs_do_not_count(repo):
    (repo / "runs").mkdir()
    (repo / "runs" / "log.txt").write_text("ignored\n")
    (repo / "bench" / "results" / "other-host-abc.json").write_text("{}\n")
    assert common.dirty_files(repo) == []


def test_allow_dirty_writes_and_records_the_files(repo, tmp_path):
    (repo / "bench" / "new_bench.py").write_text("y = 2\n")
    doc = json.loads(_write(tmp_path / "o1", allow_dirty=True).read_text())
    assert doc["allow_dirty"] is True and doc["dirty"] is True and doc["dirty_files"] == ["bench/new_bench.py"]


def test_allow_dirty_flag_on_every_benchmark_parser(repo, tmp_path, monkeypatch):
    """The shared parser refuses a dirty tree at parse time (before a long run), and ``--allow-dirty``
    carries through to ``write_result``, which every benchmark calls without the parsed args."""
    (repo / "bench" / "new_bench.py").write_text("y = 2\n")
    p = common.driver_bench_parser("unit", "unit", "x")
    with pytest.raises(SystemExit):
        p.parse_args(["--quick"])
    args = p.parse_args(["--quick", "--allow-dirty"])
    assert args.allow_dirty is True
    doc = json.loads(_write(tmp_path / "o2").read_text())
    assert doc["allow_dirty"] is True and doc["dirty_files"] == ["bench/new_bench.py"]


@pytest.mark.parametrize("env", [None, "0"])
def test_a_result_records_the_priorities_its_processes_ran_at(env, monkeypatch):
    """Under other load, a result whose actors ran at Ray's default nice 15 measured starved actors
    (bench/README.md, "Priority"): each result says which it was."""
    import os

    if env is None:
        monkeypatch.delenv("RAY_worker_niceness", raising=False)
    else:
        monkeypatch.setenv("RAY_worker_niceness", env)
    nice = common.hardware_info()["niceness"]
    assert nice == {"driver": os.getpriority(os.PRIO_PROCESS, 0), "ray_workers_env": env}


def _head(root) -> str:
    return subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit_during_the_run(repo):
    (repo / "bench" / "a.py").write_text("x = 3\n")
    _git(repo, "commit", "-q", "-am", "mid-run")


def test_a_commit_during_the_run_is_refused_naming_both_commits(repo, tmp_path, monkeypatch):
    """The parser records the commit the run starts from; a result written after HEAD moved (a commit or a
    checkout while an hour-long benchmark ran) would name code that only the later processes ran."""
    monkeypatch.setattr(common, "_RUN_START", None)
    start = _head(repo)
    common.driver_bench_parser("unit", "unit", "x").parse_args(["--quick"])
    _commit_during_the_run(repo)
    now = _head(repo)
    assert now != start and common.dirty_files(repo) == []  # clean: only the commit check can tell
    out = tmp_path / "out"
    with pytest.raises(common.DirtyTreeError, match=f"moved from {start} to {now}"):
        _write(out)
    assert not out.exists() or not list(out.iterdir())


def test_an_allowed_run_that_saw_head_move_names_its_start_commit_and_records_the_move(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "_RUN_START", None)
    start = _head(repo)
    common.driver_bench_parser("unit", "unit", "x").parse_args(["--quick", "--allow-dirty"])
    _commit_during_the_run(repo)
    path = _write(tmp_path / "out")
    doc = json.loads(path.read_text())
    assert doc["commit"] == start and doc["commit_moved_to"] == _head(repo) and doc["allow_dirty"] is True
    assert path.name.endswith(f"-{start}.json")


def test_a_run_that_stayed_on_its_commit_records_no_move(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "_RUN_START", None)
    common.driver_bench_parser("unit", "unit", "x").parse_args(["--quick"])
    doc = json.loads(_write(tmp_path / "out").read_text())
    assert doc["commit"] == _head(repo) and "commit_moved_to" not in doc
