"""Every shipped benchmark result can be traced to what produced it (issue 24, provenance).

A result under ``bench/results/`` (any folder but ``legacy/``) is a full run (not ``--quick``) written from
a clean tree, by a commit of this history that holds the benchmark's script. What fails that lives in
``bench/results/legacy/``, which says why for each file, and only what fails it may live there. Every
result path the READMEs quote exists. ``bench/results/gpu/`` holds ``bench/gpu_check.py``'s records from the
device machine instead: each names a commit of this history, the GPU, torch, and a status per check. No Ray,
no runs: JSON and git only.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sonar.bench import common
from sonar.bench.run import BENCHMARKS, find_module

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
LEGACY = RESULTS / "legacy"
GPU = RESULTS / "gpu"
"""``bench/gpu_check.py``'s records from the device machine: not ``sonar bench`` results (checked below)."""
CURRENT = sorted(p for p in RESULTS.rglob("*.json") if LEGACY not in p.parents and GPU not in p.parents)
OLD = sorted(LEGACY.glob("*.json"))


def _load(p: Path) -> dict:
    doc = json.loads(p.read_text())
    common.validate_result(doc)
    return doc


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def _history() -> bool:
    return (shutil.which("git") is not None and (REPO / ".git").exists()
            and _git("rev-parse", "--is-shallow-repository").stdout.strip() == "false")


def _script(name: str) -> str:
    assert name in BENCHMARKS, f"a result names benchmark {name!r}, which `sonar bench` does not know"
    mod = find_module(name)
    assert mod is not None, f"benchmark {name!r} has no module"
    return mod.removeprefix("sonar.").replace(".", "/") + ".py"


def _faults(doc: dict, history: bool) -> list[str]:
    """Why ``doc`` is not a traceable result ([] if it is)."""
    out = []
    if doc.get("dirty") is not False or doc.get("allow_dirty"):
        out.append(f"written from a dirty tree (dirty={doc.get('dirty')}, allow_dirty={doc.get('allow_dirty')})")
    if doc["config"].get("quick"):
        out.append("a --quick run")
    if history:
        if _git("merge-base", "--is-ancestor", doc["commit"], "HEAD").returncode != 0:
            out.append(f"commit {doc['commit']} is not an ancestor of HEAD")
        elif _git("cat-file", "-e", f"{doc['commit']}:{_script(doc['name'])}").returncode != 0:
            out.append(f"commit {doc['commit']} has no {_script(doc['name'])}")
    return out


def test_there_are_results_to_check():
    assert CURRENT and all(p.with_suffix(".png").is_file() for p in CURRENT), "a result without its plot"


@pytest.mark.parametrize("path", CURRENT, ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_shipped_result_is_traceable(path):
    doc = _load(path)
    assert path.name.startswith(doc["name"] + "-") and doc["commit"] in path.name, \
        f"{path.name}: the file name does not say the benchmark {doc['name']!r} and commit {doc['commit']!r} it holds"
    faults = _faults(doc, _history())
    assert not faults, f"{path.relative_to(REPO)}: {'; '.join(faults)}: re-measure it, or move it to bench/results/legacy/"


def test_the_legacy_readme_lists_exactly_the_legacy_results():
    """Each result in ``bench/results/legacy/`` has its line in the README's table, and each line a file
    (none today: the three that were there were measured again on 2026-12-04)."""
    readme = (LEGACY / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.-]+\.json)`", readme, flags=re.M))
    assert listed == {p.name for p in OLD}, f"legacy README lists {sorted(listed)}, the folder holds {[p.name for p in OLD]}"


def test_a_legacy_result_is_legacy_for_a_reason():
    history = _history()
    for path in OLD:
        doc = _load(path)
        if not history and doc.get("dirty") is False:
            continue  # no git history here to show why this clean result is legacy
        assert _faults(doc, history), f"{path.name} passes the provenance check: it belongs in bench/results/"


@pytest.mark.parametrize("doc_name", ["README.md", "bench/README.md"])
def test_every_result_the_readmes_quote_exists(doc_name):
    text = (REPO / doc_name).read_text()
    quoted = set(re.findall(r"bench/results/[\w./-]+?\.(?:json|png)", text))
    assert quoted, f"{doc_name} quotes no result"
    missing = sorted(q for q in quoted if not (REPO / q).is_file())
    assert not missing, f"{doc_name} quotes results that are not there: {missing}"


@pytest.mark.parametrize("path", sorted(GPU.glob("*.json")), ids=lambda p: p.name)
def test_a_gpu_check_record_names_its_commit_device_and_every_check(path):
    doc = json.loads(path.read_text())
    assert doc["script"] == "bench/gpu_check.py" and doc["device"] == "cuda" and doc["gpu"] and doc["torch"]
    assert doc["checks"] and all(c["status"] in ("PASS", "FAIL", "SKIP") for c in doc["checks"].values())
    if _history():
        assert _git("cat-file", "-e", f"{doc['commit']}^{{commit}}").returncode == 0, doc["commit"]
