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
TRANSPORT = "sonar.cluster.transport"
REPLAY = "sonar.cluster.replay"
ALLOWED = {  # room -> prefixes it may import (its own room is always allowed)
    "sonar.cluster.wire": (),
    REPLAY: (WIRE,),  # the queue between the workers and the learner: the driver starts it, they call it
    TRANSPORT: (WIRE,),  # both ends of the weight push: the learner sends, the workers receive
    "sonar.actors": (WIRE, TRANSPORT, "sonar.retrieval.base"),
    "sonar.learner": (WIRE, TRANSPORT),
    "sonar.retrieval": (WIRE,),
    "sonar.cluster.driver": (WIRE, REPLAY, TRANSPORT, "sonar.actors", "sonar.learner", "sonar.retrieval", "sonar"),
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


@pytest.mark.slow
def test_the_wheel_installs_one_namespace(tmp_path):
    """``pip install .`` puts ``sonar`` into site-packages and no top-level actors/learner/cluster/bench,
    and setuptools builds it without a warning (the build backend's output, shown by ``-v``; the editable
    install's notice is another matter, pyproject.toml says why)."""
    import subprocess
    import sys
    import zipfile

    from tests.checkout import copy_tracked

    src = copy_tracked(tmp_path / "src")  # built from a copy: setuptools writes build/ where it builds
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # not setuptools': pip's notes on this machine's index locations, and byte-compiling switched off
    # by PYTHONDONTWRITEBYTECODE in the environment
    noise = [line for line in (out.stdout + out.stderr).splitlines()
             if re.search(r"warning|deprecat|!!", line, re.I)
             and "byte-compiling is disabled" not in line and "Location '" not in line]
    assert not noise, noise[:10]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"sonar"}, f"the wheel installs top-level {sorted(tops)}"
    for module in ("sonar/__init__.py", "sonar/__main__.py", "sonar/cluster/wire/config.py",
                   "sonar/cluster/driver/cli.py", "sonar/learner/algo/losses.py", "sonar/bench/run.py"):
        assert module in names, f"{module} missing from the wheel"
    assert not any(n.startswith("sonar/tests/") for n in names), "tests must not be installed"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "sonar = sonar.cluster.driver.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


# ---------------------------------------------------------------------- no import cycle

def import_graph(modules: dict[str, Path] | None = None) -> dict[str, dict[str, int]]:
    """Production module -> {production module it imports: first line}. Every import counts (function-local
    ones too), and importing ``a.b.c`` imports its packages ``a.b`` and ``a`` as well (their ``__init__``)."""
    modules = MODULES if modules is None else modules
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for m, p in modules.items():
        for line, name in imports_of(m, p):
            parts = name.split(".")
            for k in range(len(parts), 0, -1):
                target = ".".join(parts[:k])
                if target in modules and target != m and not m.startswith(target + "."):
                    graph[m].setdefault(target, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected component of
    more than one module, in a stable order (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    cycles = []
    for comp in sorted(comps):
        members, start = set(comp), comp[0]
        # the shortest way back to start through the component (breadth first)
        prev, frontier, found = {start: None}, [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v is not None and v != start:
            path.insert(1, v)
            v = prev[v]
        cycles.append(path + [start])
    return cycles


def test_no_import_cycle_among_production_modules():
    """Doors open one way inside a room too: no module imports itself back through others."""
    graph = import_graph()
    bad = []
    for c in import_cycles(graph):
        path = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
        reach = {c[0]}
        while True:  # the whole tangle: every module on some cycle through c[0]
            more = {b for a in reach for b in graph[a] if c[0] in _reachable(graph, b)} - reach
            if not more:
                break
            reach |= more
        bad.append(path + (f"  [tangled with it: {', '.join(sorted(reach - set(c)))}]" if reach - set(c) else ""))
    assert not bad, "import cycles (a function-local import counts):\n" + "\n".join(bad)


def _reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for b in graph[todo.pop()]:
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def test_the_cycle_finder_finds_a_cycle_through_a_function_local_import(tmp_path):
    """The checker itself: x imports y at the top, y imports x inside a function; z only imports x."""
    (tmp_path / "x.py").write_text("import sonar.y\n")
    (tmp_path / "y.py").write_text("def f():\n    from sonar.x import thing\n")
    (tmp_path / "z.py").write_text("from sonar import x\n")
    mods = {f"sonar.{n}": tmp_path / f"{n}.py" for n in "xyz"}
    assert import_cycles(import_graph(mods)) == [["sonar.x", "sonar.y", "sonar.x"]]
    three = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "b": 2}, "d": {"a": 1}}
    assert import_cycles(three) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b": 1}, "b": {}}) == []


# ---------------------------------------------------------------------- every worker call through the pool

POOL_MODULE = "sonar.cluster.driver.rollout_pool"
"""The one module that calls rollout workers (``RolloutPool``); inside it, through ``RolloutPool.call``."""


def public_methods(path: Path, cls: str) -> set[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not f.name.startswith("_")}


WORKER_METHODS = public_methods(ROOT / "actors" / "worker.py", "RolloutWorker") | {"__ray_call__", "__ray_ready__"}
OTHER_ACTOR_METHODS = (public_methods(ROOT / "learner" / "worker.py", "Learner")
                       | public_methods(ROOT / "cluster" / "replay" / "queue.py", "ReplayQueue")
                       | public_methods(ROOT / "retrieval" / "server.py", "RetrievalServerImpl"))
WORKER_ONLY = WORKER_METHODS - OTHER_ACTOR_METHODS - {"__ray_call__", "__ray_ready__"}
"""Methods only a rollout worker has: a ``.remote`` call of one is a worker call, whatever the handle's name."""


def _scopes(tree: ast.AST) -> dict[int, list[ast.AST]]:
    """id(function or module) -> the nodes whose nearest enclosing function (or the module) it is."""
    out: dict[int, list[ast.AST]] = {}

    def visit(node: ast.AST, scope: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            out.setdefault(id(scope), []).append(child)
            visit(child, child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else scope)

    visit(tree, tree)
    return out


def _names_bound_from_workers(nodes: list[ast.AST]) -> set[str]:
    """Names bound by a loop or comprehension over (or an assignment from) an expression that mentions a
    ``workers`` list: they hold worker handles."""
    out: set[str] = set()
    for node in nodes:
        pairs = []
        if isinstance(node, (ast.For, ast.comprehension)):
            pairs.append((node.target, node.iter))
        elif isinstance(node, ast.Assign):
            pairs += [(t, node.value) for t in node.targets]
        for target, source in pairs:
            if "workers" in ast.unparse(source):
                out |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return out


def _is_worker_handle(expr: ast.AST, tainted: set[str]) -> bool:
    """An expression that is a rollout worker's handle: an element of a ``workers`` list, a name bound from
    one, or a name that says so (``w``, ``worker``...)."""
    if isinstance(expr, ast.Subscript) and "workers" in ast.unparse(expr.value):
        return True
    if isinstance(expr, ast.Name):
        return expr.id in tainted or expr.id == "w" or "worker" in expr.id.lower()
    return isinstance(expr, ast.Attribute) and expr.attr in ("worker", "_worker")


def worker_calls_outside_the_pool(tree: ast.AST) -> list[str]:
    """Every place a module takes a rollout worker's method (to call it, ``.remote``, or to hand it on):
    a worker-only method on any handle, or any actor method on a worker handle. One entry per line."""
    bad: dict[int, str] = {}
    for nodes in _scopes(tree).values():
        tainted = _names_bound_from_workers(nodes)
        for node in nodes:
            if not isinstance(node, ast.Attribute):
                continue
            if node.attr in WORKER_METHODS and _is_worker_handle(node.value, tainted):
                bad.setdefault(node.lineno, f"line {node.lineno}: {ast.unparse(node)}")
            elif (node.attr == "remote" and isinstance(node.value, ast.Attribute) and node.value.attr in WORKER_ONLY
                  and not isinstance(node.value.value, ast.Call)):
                bad.setdefault(node.lineno, f"line {node.lineno}: {ast.unparse(node)}")
    return [bad[k] for k in sorted(bad)]


TRANSPORT_WORKER_METHODS = {
    f.name for f in next(n for n in ast.parse((ROOT / "cluster" / "transport" / "transport.py").read_text()).body
                         if isinstance(n, ast.ClassDef) and n.name == "WeightTransport").body
    if isinstance(f, ast.FunctionDef) and len(f.args.args) > 1 and f.args.args[1].arg == "worker"}
"""The transport's methods that address a worker (their first argument is its handle)."""
CANDIDATE_PROBE = {"add_candidate"}
"""RolloutPool methods allowed to call a worker outside ``call``: the readiness probe of a worker that is
not a member yet (a failed candidate is dropped, not restarted)."""


def worker_calls_around_the_pools_call(tree: ast.AST) -> list[str]:
    """Inside ``RolloutPool``: every ``.remote`` call on anything but the learner or the replay, and every
    transport call that addresses a worker, must sit in a lambda handed to ``self.call`` (the one fault
    path), or in the candidate probe."""
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "RolloutPool")
    inside: set[int] = set()  # ids of nodes within a lambda passed to self.call
    for node in ast.walk(cls):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.call":
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Lambda):
                    inside |= {id(n) for n in ast.walk(arg)}
    bad = []
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or method.name in CANDIDATE_PROBE:
            continue
        for node in ast.walk(method):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or id(node) in inside:
                continue
            f = node.func
            if f.attr == "remote":
                if ast.unparse(f.value) == "ray":
                    continue  # ray.remote(cls): the decorator
                target = f.value.value if isinstance(f.value, ast.Attribute) else f.value
                if isinstance(target, ast.Call) or ast.unparse(target) in ("self.learner", "self.replay"):
                    continue  # an actor's creation, or a call of the learner or the replay
                bad.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
            elif f.attr in TRANSPORT_WORKER_METHODS and ast.unparse(f.value) in ("t", "self.transport"):
                bad.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [b for _, b in sorted(bad)]


def test_every_worker_call_goes_through_the_pool():
    """``cluster/driver``: no module but the pool's takes a rollout worker's method, and inside the pool
    every worker call is made by ``RolloutPool.call`` (its fault path: restart, or a failure naming the
    worker)."""
    assert "ready" in WORKER_ONLY and "receive_weights" in WORKER_ONLY and "health" not in WORKER_ONLY
    assert TRANSPORT_WORKER_METHODS == {"ranks", "join", "receive"}
    found = {}
    for module, path in MODULES.items():
        if module.startswith("sonar.cluster.driver.") and module != POOL_MODULE:
            bad = worker_calls_outside_the_pool(ast.parse(path.read_text()))
            if bad:
                found[module] = bad
    assert not found, "rollout worker calls outside the pool (use RolloutPool's methods):\n" + "\n".join(
        f"{m}: {b}" for m, bs in found.items() for b in bs)
    bad = worker_calls_around_the_pools_call(ast.parse(MODULES[POOL_MODULE].read_text()))
    assert not bad, "worker calls in RolloutPool that bypass RolloutPool.call:\n" + "\n".join(bad)


def test_the_worker_call_rules_catch_a_bypass():
    """The checkers themselves, on the calls that bypassed ``call_workers`` before the pool (b405bc9)."""
    old = ast.parse(
        "def connect_broadcast(cfg, roles):\n"
        "    ranks = ray.get([w.broadcast_ranks.remote() for w in roles.workers])\n"          # 2
        "    refs = [roles.learner.setup_broadcast.remote(addr, port, n, backend, prefix)]\n"  # 3: the learner's
        "    refs += [h.setup_broadcast.remote(addr, b) for h, b in zip(roles.workers, bases)]\n"  # 4
        "def check_workers(cfg, roles):\n"
        "    refs = [x.health.remote() for x in roles.workers]\n"                              # 6
        "    ray.get(roles.workers[i].ready.remote(), timeout=9)\n"                            # 7
        "    kill(roles.workers[i].ready)\n"                                                   # 8: handed on
        "    ray.get([h.health.remote() for h in roles.retrieval])\n"                          # 9: replicas'
        "    ray.get(roles.learner.checksum.remote())\n"                                       # 10: learner's
        "    node = ray.get(roles.workers[0].__ray_call__.remote(f))\n"                        # 11
        "    ray.get(handle.receive_weights.remote(v))\n")                                     # 12: worker-only
    lines = [int(b.split(":")[0].split()[1]) for b in worker_calls_outside_the_pool(old)]
    assert lines == [2, 4, 6, 7, 8, 11, 12]
    pool = ast.parse(
        "class RolloutPool:\n"
        "    def ok(self, t):\n"
        "        self.call('ready', lambda w, i: w.ready.remote())\n"
        "        self.call('join', lambda w, i: t.join(w, ep, 1))\n"
        "        ray.get(self.learner.ping.remote())\n"
        "        ray.remote(Worker).options(num_cpus=1).remote(0)\n"
        "    def bad(self, t):\n"
        "        ray.get(self.workers[0].ready.remote())\n"                                    # 8
        "        t.receive(self.workers[0], 3)\n"                                              # 9
        "        self.call('x', fn)\n"
        "        refs = [w.stop.remote() for w in self.workers]\n")                            # 11
    assert [int(b.split(":")[0].split()[1]) for b in worker_calls_around_the_pools_call(pool)] == [8, 9, 11]


def test_architecture_lists_every_production_module():
    """ARCHITECTURE.md's module map names every production file (by its file name under its folder's
    entry), so a new module cannot land undocumented."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    missing = sorted(str(p.relative_to(ROOT)) for p in production_modules().values()
                     if p.name not in ("__init__.py", "__main__.py") and p.name not in text)
    assert not missing, f"ARCHITECTURE.md does not list: {missing}"


def test_nothing_cites_a_file_outside_the_repository():
    """Documents, comments and presets say the fact, not "see" a development machine's notes: a path like
    ``/work/shared/GUIDE.md`` or ``../shared`` means nothing in a user's clone."""
    import subprocess

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml", "*.toml", "Makefile", ".ci/*"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    this = Path(__file__).relative_to(ROOT).as_posix()
    bad = [f"{f}:{i}" for f in files if f != this
           for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1)
           if "/work/shared" in line or "../shared" in line or "GUIDE.md" in line]
    assert not bad, f"cites a file outside the repository: {bad}"


TESTS_ONLY_ALLOWED = {
    ("cluster/wire/protocol.py", "encode_trajectory"): "the wire's one-trajectory codec beside encode_group: "
                                                       "public API for users' tools and the schema tests",
    ("cluster/wire/protocol.py", "decode_trajectory"): "its inverse",
    ("actors/world.py", "write_questions_jsonl"): "exports the synthetic world's questions as FlashRAG JSONL, "
                                                  "the format `sonar eval --data` reads (write_corpus_jsonl's pair)",
}
"""Public production names that only tests call, each with the reason it stays in production."""


def unused_public_names(sources: dict[str, str]) -> list[tuple[str, str]]:
    """(file, name) of every public top-level function or class that no production file uses: not
    mentioned again in its own file and not in any other. Decorated ones count as used (a registry's
    ``@REWARDS.register(...)`` is their use)."""
    from collections import Counter

    words = {rel: Counter(re.findall(r"\w+", text)) for rel, text in sources.items()}
    out = []
    for rel, text in sources.items():
        for node in ast.parse(text).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            if node.decorator_list:
                continue
            if words[rel][node.name] > 1 or any(node.name in w for r, w in words.items() if r != rel):
                continue
            out.append((rel, node.name))
    return out


def test_no_production_function_is_called_only_by_tests():
    """Dead code and test-only helpers live in the tests, not in production (issue 25); the names that
    stay (TESTS_ONLY_ALLOWED) say why."""
    sources = {p.relative_to(ROOT).as_posix(): p.read_text() for p in production_modules().values()}
    unused = unused_public_names(sources)
    assert sorted(set(unused) - set(TESTS_ONLY_ALLOWED)) == [], "only tests (or nothing) use these"
    assert sorted(set(TESTS_ONLY_ALLOWED) - set(unused)) == [], "production uses these now: drop them from the list"


def test_the_unused_name_rule_sees_dead_code_and_spares_registered_and_used_names():
    sources = {"a.py": "@R.register('x')\ndef plug():\n    pass\n\ndef dead():\n    pass\n\ndef used():\n    pass\n",
               "b.py": "from a import used\nclass _Private:\n    pass\n\nclass Lonely:\n    pass\n"}
    assert unused_public_names(sources) == [("a.py", "dead"), ("b.py", "Lonely")]


def test_the_package_root_does_nothing_at_import_and_each_role_module_bootstraps_first():
    """Issue 55: the root ``__init__.py`` holds its docstring and version only (no import hooks, no patching
    of other packages); each module Ray loads to run a role calls ``role_process()`` before any other import
    of Sonar or of torch (an actor's thread and hub settings are read when those load)."""
    from sonar.cluster.wire.bootstrap import ROLE_MODULES

    root = ast.parse((ROOT / "__init__.py").read_text())
    kinds = [type(n).__name__ for n in root.body]
    assert kinds == ["Expr", "Assign"] and root.body[1].targets[0].id == "__version__", kinds
    for module in ROLE_MODULES:
        body = [n for n in ast.parse(MODULES[module].read_text()).body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))  # the docstring
                and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
        first, second = body[0], body[1]
        assert isinstance(first, ast.ImportFrom) and first.module == "sonar.cluster.wire.bootstrap", module
        assert isinstance(second, ast.Expr) and ast.unparse(second) == "role_process()", module


def test_the_readme_diagram_names_the_folder_of_every_room():
    """Issue 55: each box of README.md's "What runs" diagram names the folder that holds it, so a reader goes
    from the picture to the code; every room of the rules above is in it (the benchmarks aside)."""
    block = re.search(r"## What runs.*?```\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    rooms = [r for r in ALLOWED if r.startswith("sonar.") and r != "sonar.bench"]
    missing = [r for r in rooms if r.removeprefix("sonar.").replace(".", "/") + "/" not in block]
    assert not missing, f"README.md's diagram names no folder for: {missing}"
