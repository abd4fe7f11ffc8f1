"""Keeps the ``ray``, ``vllm`` and ``slow`` markers true: a test that starts Ray or builds a vLLM engine in
the test process without its marker fails, naming the marker to add; so does a test in ``make test-fast``'s
set (none of the three markers) that starts a Python process.

``make test-fast`` deselects ``ray`` and ``vllm`` (and ``slow``) for a quick edit loop; a test that
starts a cluster without saying so would silently make that loop slow again. The check is at the
choke points every start goes through, not at the call sites a test might use:

- Ray: ``ray.init`` (also reached by Ray's auto-init from ``ray.get``/``ray.put``/...) and
  ``ray._private.node.Node.__init__`` (every node a process starts or joins: ``ray.init``,
  ``ray.cluster_utils.Cluster``).
- vLLM: ``EngineArgs.create_engine_config`` (every ``LLM``/``AsyncLLM``/``LLMEngine`` builds its config
  there before it starts its engine core).
- A Python process: ``subprocess.Popen._execute_child`` (every ``subprocess.run``/``Popen``) when the
  program is a Python interpreter or a Python script (``sonar``, ``ray``), and ``multiprocessing.util.
  spawnv_passfds`` (every spawn or forkserver start, ``torch.multiprocessing`` included). A fresh Python
  process that imports torch and transformers costs 4-5 s of a core before it does anything: such a test
  is ``slow`` (the README's definition: end-to-end runs and tests that spawn processes), which keeps the
  edit loop under 3 minutes. Tests marked ``ray`` or ``vllm`` are not in that loop and are not asked.

The hooks go in once per session (on the modules when they are first imported, so a fast run that never
imports vLLM never pays for it); whether they refuse is read per test from ``os.environ[ENV]``, which
tests/conftest.py sets around each test. Processes a test spawns (``sonar train`` in a subprocess,
Ray's own workers) are not watched: those tests are marked by hand (``pytestmark``).
"""
from __future__ import annotations

import ast
import functools
import inspect
import os
import sys
import textwrap
from typing import Callable

import pytest

from tests import import_hooks

ENV = "SONAR_TEST_UNMARKED"
"""Comma-separated markers the running test lacks among those watched (``ray``, ``vllm``, ``slow``); unset:
no check."""


def _refuse_unless_marked(kind: str, what: str) -> None:
    if kind in os.environ.get(ENV, "").split(","):
        raise RuntimeError(f"this test {what} but is not marked `{kind}`: add `pytest.mark.{kind}` (or "
                           f"`pytestmark = pytest.mark.{kind}` in its module) so `make test-fast` deselects it")


def _guard(owner, attr: str, kind: str, what: str) -> None:
    orig = getattr(owner, attr)
    if getattr(orig, "_sonar_backend_guard", False):
        return

    @functools.wraps(orig)
    def guarded(*args, **kwargs):
        _refuse_unless_marked(kind, what)
        return orig(*args, **kwargs)

    guarded._sonar_backend_guard = True
    setattr(owner, attr, guarded)


def _hook_ray(mod) -> None:
    _guard(mod, "init", "ray", "starts Ray (ray.init)")


def _hook_ray_node(mod) -> None:
    _guard(mod.Node, "__init__", "ray", "starts or joins a Ray node")


def _hook_vllm_args(mod) -> None:
    _guard(mod.EngineArgs, "create_engine_config", "vllm", "builds a vLLM engine")


QUICK_PROGRAMS = {
    "noida-db": "the test search server's launcher (Elasticsearch-compatible, `es` marker): a Python script "
                "without torch that starts in about 0.05 s",
}
"""Python programs cheap enough for the edit loop -> why."""


def python_program(args, executable=None) -> str | None:
    """The program of a ``subprocess.Popen(args, executable=...)`` call if it is a Python interpreter or a
    Python script (``sonar``, ``ray``, ``mlflow``: a ``#!...python`` first line) not in ``QUICK_PROGRAMS``,
    else None. A process
    that starts Python pays its imports again (torch and transformers alone are 4-5 s of a core here)."""
    import shlex
    import shutil

    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        try:
            first = shlex.split(text)[0] if executable is None else text
        except (ValueError, IndexError):
            return None
    else:
        args = list(args)
        if not args:
            return None
        first = os.fsdecode(args[0])
    program = os.fsdecode(executable) if executable is not None else first
    path = program if os.sep in program else (shutil.which(program) or program)
    if os.path.basename(program) in QUICK_PROGRAMS:
        return None
    real = os.path.realpath(path)
    if real == os.path.realpath(sys.executable) or os.path.basename(real).startswith("python"):
        return program
    try:
        with open(real, "rb") as f:
            line = f.readline(256)
    except OSError:
        return None
    return program if line.startswith(b"#!") and b"python" in line else None


def _hook_subprocess(mod) -> None:
    orig = mod.Popen._execute_child
    if getattr(orig, "_sonar_backend_guard", False):
        return

    @functools.wraps(orig)
    def guarded(self, args, executable, *rest, **kwargs):
        program = python_program(args, executable)
        if program is not None:
            _refuse_unless_marked("slow", f"starts a Python process ({os.path.basename(program)})")
        return orig(self, args, executable, *rest, **kwargs)

    guarded._sonar_backend_guard = True
    mod.Popen._execute_child = guarded


def _hook_multiprocessing(mod) -> None:
    _guard(mod, "spawnv_passfds", "slow", "starts a Python process (multiprocessing spawn or forkserver)")


CHOKE_POINTS = {"ray": _hook_ray, "ray._private.node": _hook_ray_node, "vllm.engine.arg_utils": _hook_vllm_args,
                "subprocess": _hook_subprocess, "multiprocessing.util": _hook_multiprocessing}
"""Module name -> what to patch in it once it has been executed."""


def install() -> None:
    """Hook the modules already imported and those imported later."""
    for name, hook in CHOKE_POINTS.items():
        import_hooks.after_import(name, hook)


# ------------------------------------------------------------------ what the run-time guard cannot see
RAY_CALLS = frozenset({"train", "init_ray", "start_roles", "init_ray_local", "start_ray", "Cluster"})
"""Calls that start Ray (``train``: the driver's, by name or as ``loop.train``; ``model.train()`` is not)."""

UNMARKED_RAY_STARTS = pytest.StashKey[Callable[[], list]]()
"""Where tests/conftest.py leaves ``unmarked_ray_starts`` of the whole collection for the test to read:
a function that reads it the first time it is called (only the process that runs the test pays)."""


def _starts_ray(node: ast.AST, local: set) -> str | None:
    """What in ``node`` starts Ray, or None; ``local``: the module's own function names (followed as
    helpers by ``ray_start_in``, never taken for the driver's ``train``)."""
    compared = {id(c) for n in ast.walk(node) if isinstance(n, ast.Compare) for c in ast.walk(n)}
    for n in ast.walk(node):
        if isinstance(n, (ast.List, ast.Tuple)) and id(n) not in compared:  # a command line, not an expected argv
            words = [e.value for e in n.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if "sonar" in words and "train" in words:
                return "`sonar train` in a subprocess"
            if "ray" in words and "start" in words:
                return "`ray start` in a subprocess"
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "ray" and name == "init":
            return "ray.init"
        if name in RAY_CALLS and not (isinstance(f, ast.Name) and name in local):
            if name == "train" and isinstance(f, ast.Attribute) and not (
                    isinstance(f.value, ast.Name) and f.value.id == "loop"):
                continue  # model.train(): torch's train mode
            return f"{name}()"
    return None


def ray_start_in(fn: ast.AST, functions: dict, seen: set) -> str | None:
    """What in ``fn`` (or in a module function it calls by name, transitively) starts Ray, or None."""
    found = _starts_ray(fn, set(functions))
    if found:
        return found
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in functions \
                and n.func.id not in seen:
            seen.add(n.func.id)
            found = ray_start_in(functions[n.func.id], functions, seen)
            if found:
                return f"{found} (in {n.func.id})"
    return None


def _module_functions(module) -> dict:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(module)))
    except (OSError, TypeError):
        return {}
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


NOT_RAY = {
    "tests/cluster/test_run_housekeeping.py::test_cli_resume_latest_without_a_checkpoint_is_one_line_and_leaves_nothing":
        "`sonar train` refused at start-up, before Ray (the test asserts Ray never started)",
}
"""Node id -> why a test that the reading below takes for a Ray start does not start Ray."""


def unmarked_ray_starts(items, exempt_files=()) -> list[str]:
    """``node id: what starts Ray`` for each item without the ``ray`` marker whose test function, or a
    fixture it uses from tests/, or a module function either calls, starts Ray. Covers what the run-time
    guard cannot see (``sonar train`` or ``ray start`` in a subprocess) and tests that did not run.
    ``exempt_files``: test files (names relative to tests/) left out."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    cache: dict[str, dict] = {}
    """Module name -> its functions: each module parsed once (a parametrized test is one function for
    hundreds of items; parsing once per item made this reading 30 s of each pytest process's collection)."""
    verdicts: dict[tuple[str, str], str | None] = {}
    """(module, function) -> what in it starts Ray, or None: read once per function, not once per item."""
    out = []

    def in_tests(f) -> str | None:
        try:
            path = os.path.abspath(inspect.getsourcefile(f) or "")
        except TypeError:
            return None
        return os.path.relpath(path, tests_dir) if path.startswith(tests_dir + os.sep) else None

    for item in items:
        func = getattr(item, "function", None)
        if func is None or item.get_closest_marker("ray") or in_tests(func) in exempt_files or item.nodeid in NOT_RAY:
            continue
        info = getattr(item, "_fixtureinfo", None)
        fixtures = [inspect.unwrap(d.func) for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
        for f in [func] + [f for f in fixtures if in_tests(f)]:
            module = sys.modules.get(f.__module__)
            if module is None:
                continue
            if module.__name__ not in cache:  # (setdefault would parse the module again for every item)
                cache[module.__name__] = _module_functions(module)
            functions = cache[module.__name__]
            fn = functions.get(f.__name__)
            key = (module.__name__, f.__name__)
            if fn is not None and key not in verdicts:
                verdicts[key] = ray_start_in(fn, functions, {fn.name})
            why = fn is not None and verdicts[key]
            if why:
                out.append(f"{item.nodeid}: {why} in {fn.name}")
                break
    return out
