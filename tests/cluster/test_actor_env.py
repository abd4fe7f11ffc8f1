"""Sonar's environment defaults reach every actor's process without a runtime env (``sonar._apply_actor_env``):
an actor sets ``sonar.ACTOR_ENV`` at its first ``import sonar``, except the keys its job's runtime env
sets, and its own process is one of the workers Ray started ahead of time (no ``setup_worker.py``)."""
import pytest

pytestmark = pytest.mark.ray

KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE")


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
            import sonar  # noqa: F401 - what loading any Sonar actor class runs first

            self.env = {k: os.environ.get(k) for k in keys}

        def report(self):
            return self.argv0, self.had_sonar, self.before, self.env

    ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    try:
        actor = ray.remote(Probe).options(num_cpus=0).remote(KEYS)
        return ray.get(actor.report.remote(), timeout=300)
    finally:
        ray.shutdown()


def test_an_actor_sets_sonars_defaults_itself_and_leaves_the_jobs_keys(ray_cluster, monkeypatch):
    from sonar import ACTOR_ENV

    if ray_cluster is None:
        pytest.skip("needs the session's Ray cluster")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv0, had_sonar, _, env = _probe(ray_cluster.address, None)
    assert argv0.endswith("default_worker.py") and not had_sonar
    assert env == {k: ACTOR_ENV[k] for k in KEYS}
    # a job that sets two of the keys: its values stand; the other two are Sonar's
    argv0, _, before, env = _probe(ray_cluster.address, {"env_vars": {"HF_HUB_OFFLINE": "0",
                                                                        "TOKENIZERS_PARALLELISM": "true"}})
    assert (before["HF_HUB_OFFLINE"], before["TOKENIZERS_PARALLELISM"]) == ("0", "true")  # the job's, as Ray set them
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "unset-by-test",
                   "HF_HUB_OFFLINE": "unset-by-test"}
