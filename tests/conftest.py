"""Test-wide environment: one thread per process, Ray on loopback without token auth and with its workers at
Sonar's niceness (``sonar.cluster.wire.bootstrap.LOCAL_NODE_ENV``: without it every actor yields to any other process), offline HF.

And what keeps the suite at a developer's pace (issue 26):
- the ``ray``/``vllm`` markers kept true (``tests/backend_guard.py``: an unmarked test that starts Ray or
  builds a vLLM engine fails; a test using a Ray fixture below is marked ``ray`` here), so that
  ``make test-fast`` (``-m "not slow and not ray and not vllm"``) stays fast;
- one Ray cluster per session for the in-process runs (``ray_cluster``, ``shared_ray``);
- ``--durations-file PATH``: every test phase's seconds, the record ``make test`` keeps for CI.
"""
import functools
import os

# Set before torch/ray are imported anywhere in the test process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
# The suite's start-up speed-ups (tests/speedups/: transformers without sklearn/SciPy, on-disk caches of the
# installed packages' module map and transformers' import structure), in this process and, through
# PYTHONPATH and its sitecustomize, in every process the suite starts (the Ray nodes' workers inherit it).
_SPEEDUPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "speedups")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SPEEDUPS, os.environ.get("PYTHONPATH")) if p)
import sys  # noqa: E402

sys.path.insert(0, _SPEEDUPS)
import sonar_test_speedups  # noqa: E402

sonar_test_speedups.install()
from sonar.cluster.wire.bootstrap import set_local_node_env  # noqa: E402

set_local_node_env()  # every cluster a test starts runs its actors at the driver's priority

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

from tests import backend_guard  # noqa: E402

RAY_FIXTURES = frozenset({"ray_local", "ray_head", "ray_session", "ray_cluster", "shared_ray"})
"""Fixtures that start (or are) a Ray cluster: a test using one is marked ``ray`` automatically."""

_BACKENDS = ("ray", "vllm")

COST_MARKERS = ("vllm", "slow", "ray")
"""A test file's rank in the run order, costliest first (see ``_heaviest_files_first``)."""


def pytest_addoption(parser):
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help="write every test phase's seconds to PATH (tab-separated: seconds, phase, node id; "
                          "slowest first), the record `make test` keeps for CI")


def pytest_configure(config):
    backend_guard.install()
    path = config.getoption("--durations-file")
    if path and not hasattr(config, "workerinput"):  # pytest-xdist: the controller writes it, from every worker's reports
        config.pluginmanager.register(_DurationsFile(path), "sonar-durations-file")


class _DurationsFile:
    """Collects (seconds, phase, node id) from every report and writes them once the session ends."""

    def __init__(self, path: str):
        self.path, self.rows = path, []

    def pytest_runtest_logreport(self, report):
        self.rows.append((report.duration, report.when, report.nodeid))

    def pytest_sessionfinish(self, session):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            f.write("seconds\tphase\tnodeid\n")
            for seconds, when, nodeid in sorted(self.rows, key=lambda r: -r[0]):
                f.write(f"{seconds:.3f}\t{when}\t{nodeid}\n")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: `-m "not ray"` must see the added marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.ray)
    # The reading of every collected test's source (about 2 s of CPU) is done when the one test that
    # checks it asks, not in every pytest-xdist worker; over the whole collection, as it stands here
    # (before `-m`/`-k` deselect). tests/test_backend_guard.py starts Ray unmarked on purpose (to see the
    # guard refuse it).
    collected = list(items)
    config.stash[backend_guard.UNMARKED_RAY_STARTS] = functools.cache(lambda: backend_guard.unmarked_ray_starts(
        collected, exempt_files={"test_backend_guard.py"}))
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    items[:] = _heaviest_files_first(items)


SLOW_TIMEOUT_S = 1800
"""The hang guard of a ``slow`` test (one that starts Ray roles, vLLM engines or subprocess runs) that
names none itself; the others keep pyproject's 600 s. It stays a hang guard: in the loaded run of
617adb3 (two busy loops beside ``make test``, load average 8-10), the async-vs-sync ``--quick`` run and
the vLLM end-to-end fixture took over 600 s on 2 cores and were stopped by the 600 s guard."""


def _rank(item) -> int:
    return next((i for i, m in enumerate(COST_MARKERS) if item.get_closest_marker(m)), len(COST_MARKERS))


def _heaviest_files_first(items):
    """Whole files, those with a vLLM, slow or Ray test first (in that order), each file's tests kept
    together and in their order, ties in collection order (deterministic: every pytest-xdist worker must
    collect the same list). ``make test`` hands out whole files (``--dist loadfile``, so a module's
    fixtures are built once) in this order: the long runs start first and the many quick files fill the
    workers' ends, instead of one long file starting last on one worker while the other idles."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(files.values(), key=lambda group: min(_rank(i) for i in group))  # stable
    return [item for group in order for item in group]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    # Set before the item's fixtures (module-scoped ones included) are made, and kept through the call.
    unmarked = [b for b in _BACKENDS if not item.get_closest_marker(b)]
    if len(unmarked) == len(_BACKENDS) and not item.get_closest_marker("slow"):
        unmarked.append("slow")  # in `make test-fast`'s set: no Python process may start either
    os.environ[backend_guard.ENV] = ",".join(unmarked)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    os.environ.pop(backend_guard.ENV, None)


SHARED_RAY_CPUS = 8
"""Logical CPUs of the session's cluster: the largest run here asks for 5 (a 2-rank learner, 2 workers,
a replica); the rest is room for a finished job's actors that are still being torn down."""


SHARED_RAY_STORE_BYTES = 1 << 30
"""Its object store (``Cluster`` would give 150 MiB; the benchmarks put tens of MB at a time)."""

PRIVATE_RAY_ENV = "SONAR_TEST_PRIVATE_RAY"
"""Set (to anything): no shared cluster, every run starts its own as before (to measure, or to rule the
sharing out)."""


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (GCS and raylet on 127.0.0.1) for the session's in-process runs, started
    the first time a test asks for it. Starting a cluster costs 5-9 s on 2 cores, joining one about
    0.5 s. Each user joins it as a Ray job of its own (``shared_ray``), and the job's end kills the job's
    actors and placement groups, so no run sees another's roles."""
    if os.environ.get(PRIVATE_RAY_ENV):
        yield None
        return
    from ray.cluster_utils import Cluster

    # The raylet (and every worker it starts) inherits this process's environment: not the per-test
    # marker list that happens to be set while the first user's fixtures run.
    unmarked = os.environ.pop(backend_guard.ENV, None)
    try:
        from sonar.cluster.driver.roles import start_local_node

        cluster = start_local_node(lambda: Cluster(
            initialize_head=True, connect=False,
            head_node_args={"num_cpus": SHARED_RAY_CPUS, "include_dashboard": False, "node_ip_address": "127.0.0.1",
                            "object_store_memory": SHARED_RAY_STORE_BYTES}))
    finally:
        if unmarked is not None:
            os.environ[backend_guard.ENV] = unmarked
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def shared_ray(ray_cluster):
    """For a module whose runs start Ray as the driver does (``roles.init_ray``, the benchmarks'
    ``start_ray``): ``RAY_ADDRESS`` names the session's cluster, so each run joins it (``ray.init(address=
    ...)``) instead of starting one, and leaves it with ``ray.shutdown()``, which ends its job. A module
    using it must not depend on environment variables set after the cluster started reaching the actors
    (only the driver's runtime env does), nor inspect Ray's own processes."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        if ray_cluster is not None:
            mp.setenv("RAY_ADDRESS", ray_cluster.address)
        yield ray_cluster and ray_cluster.address
        if ray.is_initialized():  # a run that failed half-way: end its job, and its actors with it
            ray.shutdown()
