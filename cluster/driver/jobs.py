"""Running as a Ray job (``ray job submit ... -- sonar train``): the runtime env and the stop signal.

* **Runtime env.** Ray merges the job's runtime env (``--runtime-env-json``, handed to the driver in
  ``RAY_JOB_CONFIG_JSON_ENV_VAR``) with the one ``ray.init`` is given and refuses the same env-var key in
  both. Sonar's defaults (one thread per process, loopback, offline hub) are therefore passed only for
  the keys the job leaves unset: the user's values win, nothing conflicts.
* **SIGTERM.** ``ray job stop`` sends SIGTERM to the driver's process tree, then SIGKILL once
  ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by default, read by the head's job supervisor) have passed
  (``ray/dashboard/modules/job/job_supervisor.py``). ``ray.init`` installs its own SIGTERM handler
  (``sys.exit``), which the driver would report as FAILED; ``keep_sigterm_handler`` puts the handler that
  was there before back, so Sonar's CLI handler (``KeyboardInterrupt``) still answers it. ``loop.train``
  then works to fit the default wait: the KILLED status first (one write, before the queued metrics are
  flushed: ``MLflowSink.finish``), then every actor killed outright (``roles.kill_roles``, no waits on
  their loops). The actors would die with the driver anyway, being the job's.
"""
from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from typing import Mapping

log = logging.getLogger("sonar")

SONAR_ENV_VARS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                  "HF_HUB_OFFLINE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Environment every Sonar actor gets unless the job's runtime env sets the key itself."""
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Where Ray's job supervisor hands the job's config (runtime env, metadata) to the driver."""


def job_runtime_env(environ: Mapping[str, str]) -> dict:
    """The runtime env ``ray job submit`` gave this driver ({} outside a job, or when unreadable)."""
    raw = environ.get(JOB_CONFIG_ENV)
    if not raw:
        return {}
    try:
        env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return {}
    return env if isinstance(env, dict) else {}


def driver_runtime_env(environ: Mapping[str, str]) -> dict:
    """What the driver passes to ``ray.init``: ``SONAR_ENV_VARS`` less the keys the job's runtime env sets
    (Ray refuses a key set by both; the job's value is the one the user asked for)."""
    user = job_runtime_env(environ).get("env_vars") or {}
    mine = {k: v for k, v in SONAR_ENV_VARS.items() if k not in user}
    skipped = sorted(set(SONAR_ENV_VARS) & set(user))
    if skipped:
        log.info("runtime env: the job sets %s; Sonar's defaults for those keys are not passed", ", ".join(skipped))
    return {"env_vars": mine} if mine else {}


@contextlib.contextmanager
def keep_sigterm_handler():
    """Around ``ray.init``: afterwards, the SIGTERM handler installed before it (a Python callable, e.g.
    the CLI's) is installed again. Nothing changes off the main thread or when none was installed."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and callable(before) and signal.getsignal(signal.SIGTERM) is not before:
            signal.signal(signal.SIGTERM, before)
