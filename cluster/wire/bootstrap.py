"""Start-up work of Sonar's processes, called where it runs (nothing here runs at import).

- ``role_process()``: the first line of every module whose class or function Ray runs as a Sonar role
  (``ROLE_MODULES``), before their imports of torch, transformers or the hub client, which read these
  variables when they load: one thread per process, no hub access, no progress bars (``ACTOR_ENV``), in a
  Ray worker process only.
- ``set_local_node_env()``: the driver (``roles.start_local_node``), the benchmarks and the test suite call
  it before they start a Ray node on their own machine (``LOCAL_NODE_ENV``).

Imports nothing of Sonar (a wire): every room may call it.
"""
import sys as _sys

ROLE_MODULES = ("sonar.actors.worker", "sonar.learner.worker", "sonar.retrieval.server", "sonar.retrieval.indexer",
                "sonar.bench.weight_sync")
"""The modules Ray loads to run a Sonar role (an actor class or a remote function) that imports torch,
transformers or the hub client: each calls ``role_process()`` before any other import of Sonar
(``tests/test_layout.py`` keeps it so)."""


ACTOR_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Environment every Sonar actor gets (one thread per process, no hub access, no progress bars) unless the
job's runtime env sets the key itself: the job's value wins. Progress bars: Ray forwards an actor's stderr to
the driver line by line, so transformers' "Loading weights" / "Writing model shards" bars (every worker start,
every checkpoint) arrived as ``(Learner pid=...) Writing model shards: 0%| ... 100%|...`` lines in the run's
log; transformers and huggingface_hub read the variable when they are imported, after ``import sonar``."""


LOCAL_NODE_ENV = {"RAY_worker_niceness": "0"}
"""Environment of every Ray node Sonar starts on the machine it runs on (``roles.start_local_node`` sets it:
``init_ray``'s private cluster, so ``sonar train`` and ``make run``; the benchmarks' clusters; the test
suite's): a key the environment already sets wins. Ray starts its worker processes, i.e. every actor and the vLLM processes
an actor spawns, at nice 15 (its ``worker_niceness``), which keeps its raylet responsive on a dedicated
node but makes every Sonar role yield to any other process on a shared one (weight 36 against 1,024 for
nice 0): beside two busy loops on a 2-core machine, ``tests/test_e2e.py`` took 435 s against 28 s idle,
and 45 s with the workers at nice 0. The cluster files' nodes are dedicated and keep Ray's default."""


def set_local_node_env() -> None:
    """Put ``LOCAL_NODE_ENV`` into this process's environment, less the keys it already sets, before it
    starts a Ray node: the raylet reads them from the environment it inherits."""
    import os

    for key, value in LOCAL_NODE_ENV.items():
        os.environ.setdefault(key, value)


def actor_env(job_env_vars) -> dict:
    """What a Sonar actor's process sets in its environment: ``ACTOR_ENV`` less the keys the job's runtime
    env sets (``job_env_vars``)."""
    return {k: v for k, v in ACTOR_ENV.items() if k not in job_env_vars}


def role_process() -> None:
    """In a Ray worker process (an actor's: Ray runs ``default_worker.py``), set ``ACTOR_ENV``; called by the
    first line of each of ``ROLE_MODULES``, which loading the role runs before torch, transformers or the hub
    client are imported. Anywhere else (a driver, a test importing a role module) it does nothing.

    Why here and not in ``ray.init(runtime_env={"env_vars": ...})``: an actor with a runtime env of its own
    cannot use the workers Ray starts ahead of time, and is started through Ray's runtime-env agent and
    ``setup_worker.py``, one more Python process (about 0.35 s of CPU) per actor; a run starts a learner,
    workers, replicas and a replay for every run, and the test suite about 240. The job's runtime env
    still reaches the process first, so its keys are read back from it and left alone."""
    if not _sys.argv or not str(_sys.argv[0]).endswith("default_worker.py"):
        return
    import os

    # A process spawned by an actor (vLLM's engine core and workers: multiprocessing's spawn copies argv)
    # is not connected to Ray and inherited the actor's environment: every key it holds stays.
    ray = _sys.modules.get("ray")
    try:
        if ray is None or not ray.is_initialized():
            raise RuntimeError("not connected to Ray")
        job = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    except Exception:  # noqa: BLE001 - the job's keys unknown: none of those set is overwritten
        job = {k: os.environ[k] for k in ACTOR_ENV if k in os.environ}
    os.environ.update(actor_env(job))
