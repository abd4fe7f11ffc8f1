"""The house rules, checked on the source: one namespace, and doors that open one way.

Rooms (``ARCHITECTURE.md`` draws them):

    sonar.cluster.wire    config schema, protocol + codec, weight broadcast, replay core, metric keys
                          -> imports nothing else of Sonar
    sonar.actors          engines, rollout loop, parsing, rewards, the rollout actor
                          -> the wires, and retrieval's protocol (``sonar.retrieval.base``)
    sonar.learner         pure algorithms, batching, train step, the learner actor, checkpoints
                          -> the wires only
    sonar.retrieval       backends, rerank, cache, resilience, the service
                          -> the wires only
    sonar.cluster.driver  roles, the loop, reports, CLI, evaluation, tracking
                          -> anything but ``sonar.bench`` (the CLI's ``sonar bench`` dispatch excepted)
    sonar.bench           benchmarks and simulators -> anything; imported by nobody but the CLI

Every import counts, function-local ones included: a door hidden inside a function is still a door.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("actors", "learner", "retrieval", "cluster", "bench")

WIRE = "sonar.cluster.wire"
ALLOWED = {  # room -> prefixes it may import (its own room is always allowed)
    "sonar.cluster.wire": (),
    "sonar.actors": (WIRE, "sonar.retrieval.base"),
    "sonar.learner": (WIRE,),
    "sonar.retrieval": (WIRE,),
    "sonar.cluster.driver": (WIRE, "sonar.actors", "sonar.learner", "sonar.retrieval", "sonar"),
    "sonar.bench": ("sonar",),
    "sonar": ("sonar.cluster.driver.cli",),  # __init__ / __main__
}
BENCH_DISPATCH = {"sonar.cluster.driver.cli"}  # the only production module that may import sonar.bench


def production_modules() -> dict[str, Path]:
    mods = {"sonar": ROOT / "__init__.py", "sonar.__main__": ROOT / "__main__.py"}
    for top in TOP:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods["sonar." + ".".join(parts)] = path
    return mods


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """Every imported module name (absolute), with its line; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from sonar.x import y`` may import the submodule sonar.x.y: count both spellings.
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"
                    and (ROOT / Path(*f"{base}.{a.name}".split(".")[1:])).with_suffix(".py").exists()]
    return out


def room_of(module: str) -> str:
    for room in sorted(ALLOWED, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    return module


MODULES = production_modules()


def test_every_package_folder_is_installed_under_sonar():
    listed = set(re.findall(r'"(sonar(?:\.[a-z_]+)*)"', (ROOT / "pyproject.toml").read_text()))
    folders = {"sonar"} | {"sonar." + ".".join(p.parent.relative_to(ROOT).parts)
                           for top in TOP for p in (ROOT / top).rglob("__init__.py")}
    assert folders <= listed, f"package folders missing from pyproject's packages list: {sorted(folders - listed)}"


def test_no_module_imports_a_bare_top_level_folder():
    bad = [f"{m}:{line} imports {name}" for m, p in MODULES.items() for line, name in imports_of(m, p)
           if name.split(".")[0] in TOP]
    assert not bad, "import through the sonar namespace:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_doors_open_one_way(module):
    room = room_of(module)
    bad = []
    for line, name in imports_of(module, MODULES[module]):
        if not (name == "sonar" or name.startswith("sonar.")):
            continue
        if name.startswith("sonar.bench"):
            if room != "sonar.bench" and module not in BENCH_DISPATCH:
                bad.append(f"line {line}: {name} (nothing in production imports the benchmarks)")
            continue
        target = room_of(name)
        if target == room or name == "sonar":
            continue
        if not any(name == p or name.startswith(p + ".") or (p == "sonar" and name.startswith("sonar."))
                   for p in ALLOWED[room]):
            bad.append(f"line {line}: {name} (room {room} may import {ALLOWED[room] or 'nothing else of Sonar'})")
    assert not bad, f"{module} opens a door the wrong way:\n" + "\n".join(bad)


def test_the_rules_catch_a_wrong_door(tmp_path):
    """The checker itself: a learner module importing the actors is caught, a function-local one too."""
    f = tmp_path / "x.py"
    f.write_text("import os\n\ndef f():\n    from sonar.actors.model import build_policy\n")
    names = [n for _, n in imports_of("sonar.learner.x", f)]
    assert "sonar.actors.model" in names
    assert room_of("sonar.actors.model") == "sonar.actors"
    assert not any("sonar.actors.model".startswith(p) for p in ALLOWED["sonar.learner"])


def test_the_wheel_installs_one_namespace(tmp_path):
    """``pip install .`` puts ``sonar`` into site-packages and no top-level actors/learner/cluster/bench."""
    import subprocess
    import sys
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"sonar"}, f"the wheel installs top-level {sorted(tops)}"
    for module in ("sonar/__init__.py", "sonar/__main__.py", "sonar/cluster/wire/config.py",
                   "sonar/cluster/driver/cli.py", "sonar/learner/algo/losses.py", "sonar/bench/run.py"):
        assert module in names, f"{module} missing from the wheel"
    assert not any(n.startswith("sonar/tests/") for n in names), "tests must not be installed"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "sonar = sonar.cluster.driver.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
