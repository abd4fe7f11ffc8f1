"""The ``ray``, ``vllm`` and ``slow`` markers stay true (tests/backend_guard.py, tests/conftest.py).

``make test-fast`` deselects ``ray``, ``vllm`` and ``slow``. Two checks keep that honest: at run time, a
test without the marker that starts Ray or builds a vLLM engine in the test process fails (the guard);
and here, every collected test without the ``ray`` marker is read (its function, the fixtures it uses and
the module's functions they call) for what starts Ray in a process the guard cannot see: ``sonar train``
in a subprocess, ``ray start``, ``ray.cluster_utils.Cluster``.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests import backend_guard, import_hooks


def test_an_unmarked_test_that_starts_ray_fails_naming_the_marker():
    import ray

    assert backend_guard.ENV in os.environ  # set by conftest around every test
    with pytest.raises(RuntimeError, match=r"not marked `ray`: add `pytest.mark.ray`"):
        ray.init(address="local", num_cpus=1, include_dashboard=False)
    assert not ray.is_initialized()
    from ray._private.node import Node

    with pytest.raises(RuntimeError, match="starts or joins a Ray node"):
        Node(None, head=True, shutdown_at_exit=False)  # the guard refuses before any argument is read


def test_the_guard_calls_through_when_the_marker_is_there(monkeypatch):
    calls = []

    class Fake:
        @staticmethod
        def init(*args, **kwargs):
            calls.append((args, kwargs))
            return "started"

    backend_guard._guard(Fake, "init", "ray", "starts Ray")
    backend_guard._guard(Fake, "init", "ray", "starts Ray")  # idempotent: one wrapper, not two
    assert Fake.init.__wrapped__.__name__ == "init" and not hasattr(Fake.init.__wrapped__, "__wrapped__")
    monkeypatch.setenv(backend_guard.ENV, "vllm")  # a ray-marked test that is not marked vllm
    assert Fake.init(1, a=2) == "started" and calls == [((1,), {"a": 2})]
    monkeypatch.setenv(backend_guard.ENV, "ray,vllm")
    with pytest.raises(RuntimeError, match="this test starts Ray but is not marked `ray`"):
        Fake.init()
    assert len(calls) == 1


def test_a_module_imported_later_is_hooked_when_its_code_has_run(tmp_path, monkeypatch):
    (tmp_path / "sonar_guard_probe.py").write_text("class Engine:\n    def start(self):\n        return 'up'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def hook(mod):
        seen.append(mod.__name__)
        backend_guard._guard(mod.Engine, "start", "vllm", "builds a vLLM engine")

    monkeypatch.setitem(import_hooks.HOOKS, "sonar_guard_probe", [])
    monkeypatch.delitem(sys.modules, "sonar_guard_probe", raising=False)
    import_hooks.after_import("sonar_guard_probe", hook)
    assert seen == []  # not imported yet
    import sonar_guard_probe

    assert seen == ["sonar_guard_probe"]
    monkeypatch.setenv(backend_guard.ENV, "")
    assert sonar_guard_probe.Engine().start() == "up"
    monkeypatch.setenv(backend_guard.ENV, "ray,vllm")
    with pytest.raises(RuntimeError, match="not marked `vllm`"):
        sonar_guard_probe.Engine().start()
    monkeypatch.delitem(sys.modules, "sonar_guard_probe")


def test_the_hooked_vllm_and_ray_names_exist_in_the_pinned_libraries():
    """Read from source, not imported (vLLM takes seconds to import): a renamed choke point would leave
    the guard watching nothing."""
    def defines(package: str, rel: str, cls: str, method: str) -> bool:
        root = Path(importlib.util.find_spec(package).origin).parent
        tree = ast.parse((root / rel).read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return any(isinstance(f, ast.FunctionDef) and f.name == method for f in node.body)
        return False

    assert defines("vllm", "engine/arg_utils.py", "EngineArgs", "create_engine_config")
    assert defines("ray", "_private/node.py", "Node", "__init__")
    import multiprocessing.util
    import subprocess

    assert callable(subprocess.Popen._execute_child) and callable(multiprocessing.util.spawnv_passfds)
    assert set(backend_guard.CHOKE_POINTS) == {"ray", "ray._private.node", "vllm.engine.arg_utils", "subprocess",
                                               "multiprocessing.util"}
    assert all(backend_guard.CHOKE_POINTS[m] in import_hooks.HOOKS[m] for m in backend_guard.CHOKE_POINTS)


def test_every_collected_test_that_starts_ray_is_marked_ray(request):
    """Read at collection (tests/conftest.py), over every test collected, before ``-m``/``-k`` select."""
    check = request.config.stash.get(backend_guard.UNMARKED_RAY_STARTS, None)
    assert check is not None, "conftest did not keep the collection for the check"
    unmarked = check()
    assert not unmarked, "tests that start Ray without the `ray` marker:\n" + "\n".join(unmarked)


def test_the_collection_check_reads_tests_fixtures_and_the_helpers_they_call():
    src = textwrap.dedent("""
        def helper(root):
            from sonar.cluster.driver.loop import train
            return train(root)

        def via_helper():
            helper(1)

        def via_subprocess():
            subprocess.run([sys.executable, "-m", "sonar", "train", "--config", "x"])

        def ray_start():
            subprocess.run(["ray", "start", "--head"])

        def command_in_a_name():
            cmd = [sys.executable, "-m", "sonar", "train"]
            subprocess.Popen(cmd)

        def expected_argv(argv):
            assert argv[:2] == ["sonar", "train"]  # a manifest's command, compared, not run

        def plain():
            model.train()  # torch's train mode, not the driver
            world.train[:3]
    """)
    functions = {n.name: n for n in ast.parse(src).body}
    why = {name: backend_guard.ray_start_in(fn, functions, {name}) for name, fn in functions.items()}
    assert why == {"helper": "train()", "via_helper": "train() (in helper)",
                   "via_subprocess": "`sonar train` in a subprocess", "ray_start": "`ray start` in a subprocess",
                   "command_in_a_name": "`sonar train` in a subprocess", "expected_argv": None, "plain": None}


def test_an_edit_loop_test_that_starts_python_fails_naming_the_slow_marker(tmp_path):
    """This test has none of the three markers: it is in `make test-fast`'s set, so starting Python in a
    process of its own is refused before anything starts; other programs are not."""
    import multiprocessing
    import subprocess

    assert "slow" in os.environ[backend_guard.ENV].split(",")
    with pytest.raises(RuntimeError, match=r"starts a Python process \(python[0-9.]*\) but is not marked `slow`"):
        subprocess.run([sys.executable, "-c", "open(%r, 'w')" % str(tmp_path / "ran")])
    with pytest.raises(RuntimeError, match="not marked `slow`"):
        subprocess.run(f"{sys.executable} -c pass", shell=True)
    with pytest.raises(RuntimeError, match="multiprocessing spawn or forkserver"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    assert not (tmp_path / "ran").exists()
    assert subprocess.run(["true"]).returncode == 0  # not Python: runs
    assert subprocess.run("exit 3", shell=True).returncode == 3


@pytest.mark.slow
def test_a_slow_test_starts_python():
    import subprocess

    assert "slow" not in os.environ[backend_guard.ENV].split(",")
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout == "42\n"


def test_python_programs_are_told_from_other_programs(tmp_path):
    script = tmp_path / "tool"
    script.write_text("#!/usr/bin/env python3\nprint(1)\n")
    shell = tmp_path / "sh_tool"
    shell.write_text("#!/bin/sh\necho 1\n")
    bindir = Path(sys.executable).parent
    assert backend_guard.python_program([sys.executable, "-m", "sonar"]) == sys.executable
    assert backend_guard.python_program(["python3", "-c", "pass"]) == "python3"
    assert backend_guard.python_program([str(script)]) == str(script)
    assert backend_guard.python_program(f"{sys.executable} -m pytest") == sys.executable
    assert backend_guard.python_program(["x"], executable=sys.executable) == sys.executable
    assert backend_guard.python_program([str(shell)]) is None
    assert backend_guard.python_program(["git", "status"]) is None
    assert backend_guard.python_program([]) is None and backend_guard.python_program("'unterminated") is None
    assert backend_guard.python_program([str(bindir / "noida-db"), "start"]) is None  # QUICK_PROGRAMS
    if (bindir / "sonar").exists():
        assert backend_guard.python_program([str(bindir / "sonar"), "train"]) == str(bindir / "sonar")
