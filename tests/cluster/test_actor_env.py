"""Sonar's environment defaults reach every actor's process without a runtime env
(``sonar.cluster.wire.bootstrap.role_process``, the first line of each role module): an actor sets
``ACTOR_ENV`` when its role's module loads, except the keys its job's runtime env sets, and its own process is
one of the workers Ray started ahead of time (no ``setup_worker.py``)."""
import pytest

pytestmark = pytest.mark.ray

KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS")


def _probe(address, runtime_env):
    import ray

    class Probe:  # defined here: it travels by value, so loading it imports nothing of Sonar
        def __init__(self, keys):
            import os
            import sys

            self.argv0 = sys.argv[0]
            self.had_sonar = "sonar" in sys.modules
            self.before = {k: os.environ.get(k) for k in keys}
            for k in keys:  # what the process would otherwise hold: none of Sonar's values
                os.environ[k] = "unset-by-test"
            import sonar.learner.worker  # noqa: F401 - what loading the learner's actor class runs first

            self.env = {k: os.environ.get(k) for k in keys}
            from huggingface_hub.utils import are_progress_bars_disabled  # read at import, as transformers does

            self.bars_off = are_progress_bars_disabled()

        def report(self):
            return self.argv0, self.had_sonar, self.before, self.env, self.bars_off

    ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    try:
        actor = ray.remote(Probe).options(num_cpus=0).remote(KEYS)
        return ray.get(actor.report.remote(), timeout=300)
    finally:
        ray.shutdown()


def test_an_actor_sets_sonars_defaults_itself_and_leaves_the_jobs_keys(ray_cluster, monkeypatch):
    from sonar.cluster.wire.bootstrap import ACTOR_ENV

    if ray_cluster is None:
        pytest.skip("needs the session's Ray cluster")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv0, had_sonar, _, env, bars_off = _probe(ray_cluster.address, None)
    assert argv0.endswith("default_worker.py") and not had_sonar
    assert env == {k: ACTOR_ENV[k] for k in KEYS}
    assert bars_off  # transformers' "Loading weights" bars stay out of the driver's log
    # a job that sets three of the keys: its values stand (Sonar leaves them); the other two are Sonar's
    argv0, _, before, env, bars_off = _probe(ray_cluster.address, {"env_vars": {
        "HF_HUB_OFFLINE": "0", "TOKENIZERS_PARALLELISM": "true", "HF_HUB_DISABLE_PROGRESS_BARS": "0"}})
    assert (before["HF_HUB_OFFLINE"], before["TOKENIZERS_PARALLELISM"]) == ("0", "true")  # the job's, as Ray set them
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "unset-by-test",
                   "HF_HUB_OFFLINE": "unset-by-test", "HF_HUB_DISABLE_PROGRESS_BARS": "unset-by-test"}
    assert not bars_off  # a job that wants the bars keeps them


NICENESS_SCRIPT = r"""
import json, os
import ray
from sonar.cluster.driver.roles import init_ray
from sonar.cluster.wire.config import load_config

@ray.remote(num_cpus=0)
class Nice:
    def get(self):
        return os.getpriority(os.PRIO_PROCESS, 0)

assert init_ray(load_config([], ["cluster.num_cpus=1"]))
print(json.dumps({"driver": os.getpriority(os.PRIO_PROCESS, 0), "actor": ray.get(Nice.remote().get.remote(), timeout=300),
                  "env": os.environ.get("RAY_worker_niceness")}))
ray.shutdown()
"""


def test_a_local_cluster_runs_its_actors_at_the_drivers_niceness(tmp_path):
    """Ray's default (nice 15 for every worker) would make every role yield to any other process on the
    machine (``sonar.cluster.wire.bootstrap.LOCAL_NODE_ENV``): the driver's own start of a private cluster (``init_ray``, what
    ``sonar train`` runs) sets Sonar's value, and an actor then runs at the driver's priority."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_worker_niceness", "RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-c", NICENESS_SCRIPT], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"driver": out["driver"], "actor": out["driver"], "env": "0"}


@pytest.mark.parametrize("entry", ["driver", "bench"])
@pytest.mark.parametrize("preset", [None, "15"])
def test_the_local_clusters_niceness_is_the_environments_when_it_sets_one(preset, entry, monkeypatch):
    """What the raylet inherits when Sonar starts a local node (``roles.start_local_node``, for the driver's
    ``init_ray`` and the benchmarks' ``init_ray_local`` alike): Sonar's value, or the one the environment
    already holds (a user who wants Ray's default gives it back with RAY_worker_niceness=15)."""
    import os

    import ray

    from sonar.cluster.wire.bootstrap import LOCAL_NODE_ENV
    from sonar.bench.common import init_ray_local
    from sonar.cluster.driver import roles
    from sonar.cluster.wire.config import load_config

    seen = {}

    class Started(Exception):
        pass

    def init(*a, **k):  # where the node would start: the environment the raylet would inherit
        seen.update({k: os.environ.get(k) for k in LOCAL_NODE_ENV})
        raise Started

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    if preset is not None:
        monkeypatch.setenv("RAY_worker_niceness", preset)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Started):
        if entry == "driver":
            roles.init_ray(load_config([], ["cluster.num_cpus=1"]))
        else:
            init_ray_local(num_cpus=1)
    assert seen == {"RAY_worker_niceness": preset or "0"}
