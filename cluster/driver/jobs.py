"""Running as a Ray job (``ray job submit ... -- sonar train``): the runtime env and the stop signal.

* **Runtime env.** Ray merges the job's runtime env (``--runtime-env-json``, handed to the driver in
  ``RAY_JOB_CONFIG_JSON_ENV_VAR``) with the one ``ray.init`` is given and refuses the same env-var key in
  both. Sonar's defaults (one thread per process, loopback, offline hub) are therefore passed only for
  the keys the job leaves unset: the user's values win, nothing conflicts.
* **Code that travels.** ``pyproject.toml`` maps the package ``sonar`` to the repository root, so the
  folder ``ray job submit --working-dir .`` uploads holds the package's *contents*, not a ``sonar/``:
  Python in the job would import the installed copy and a user's edits would not run. So when the CLI
  starts as a job's entrypoint in a Sonar checkout that is not the copy it imported
  (``checkout_to_run``), it re-executes itself once with ``sonar`` resolving to the checkout (a staging
  folder ``sonar`` of links to its entries, first on ``PYTHONPATH``; ``reexec_from_checkout``), and the
  runtime env it passes to ``ray.init`` ships that folder as ``py_modules`` (Ray uploads it, honouring
  the checkout's ``.gitignore``, and puts it first on every actor's ``PYTHONPATH``, ahead of the
  installed package). Every role reports which copy it runs (``roles.log_code_origins``). A job whose
  own runtime env sets ``py_modules`` keeps it (Ray refuses the key twice): a warning says the actors
  then import what it names.
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
from pathlib import Path
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


STAGE_MARKER = ".sonar-py-module"
"""A file only the staged package holds (``reexec_from_checkout``)."""
CHECKOUT_ENV = "SONAR_CHECKOUT_PACKAGE"
"""Set by ``reexec_from_checkout``: the staged ``sonar`` folder (a link to the job's checkout) that this
driver imports and ships to its actors as ``py_modules``."""


def driver_runtime_env(environ: Mapping[str, str]) -> dict:
    """What the driver passes to ``ray.init``: ``SONAR_ENV_VARS`` less the keys the job's runtime env sets
    (Ray refuses a key set by both; the job's value is the one the user asked for), and, when this driver
    runs a job's checkout (``CHECKOUT_ENV``), that checkout as ``py_modules`` unless the job sets its own."""
    job = job_runtime_env(environ)
    user = job.get("env_vars") or {}
    mine = {k: v for k, v in SONAR_ENV_VARS.items() if k not in user}
    skipped = sorted(set(SONAR_ENV_VARS) & set(user))
    if skipped:
        log.info("runtime env: the job sets %s; Sonar's defaults for those keys are not passed", ", ".join(skipped))
    env: dict = {"env_vars": mine} if mine else {}
    staged = environ.get(CHECKOUT_ENV)
    if staged:
        if job.get("py_modules"):
            log.warning("runtime env: the job sets py_modules %s, so the checkout's Sonar (%s) is not shipped to the "
                        "actors; they import what those name", job["py_modules"], staged)
        else:
            env["py_modules"] = [staged]
            log.info("runtime env: shipping the checkout's Sonar to every actor as py_modules (%s)", staged)
    return env


def is_checkout(path: Path) -> bool:
    """Whether ``path`` is a Sonar source tree: its ``pyproject.toml`` names the project ``sonar-rl`` and the
    package's own files are there."""
    try:
        head = (path / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return ('name = "sonar-rl"' in head and (path / "__init__.py").is_file()
            and (path / "cluster" / "driver" / "cli.py").is_file())


def checkout_to_run(environ: Mapping[str, str], cwd: Path, imported: Path) -> Path | None:
    """The checkout a job's driver should run instead of the package it imported: ``cwd`` when this
    process is a Ray job's entrypoint (``JOB_CONFIG_ENV``), ``cwd`` is a Sonar checkout, it is not the
    imported package's directory, and no re-exec happened yet (``CHECKOUT_ENV``); else None."""
    if not environ.get(JOB_CONFIG_ENV) or environ.get(CHECKOUT_ENV):
        return None
    cwd = cwd.resolve()
    if not is_checkout(cwd) or cwd == imported.resolve():
        return None
    return cwd


def reexec_from_checkout(argv: list[str]) -> None:
    """Under ``ray job submit --working-dir <checkout>``: re-execute ``python -m sonar <argv>`` so that
    ``import sonar`` is the checkout (module docstring); returns only when there is nothing to do."""
    import os
    import sys
    import tempfile

    import sonar

    checkout = checkout_to_run(os.environ, Path.cwd(), Path(sonar.__file__).parent)
    if checkout is None:
        return
    stage = Path(tempfile.mkdtemp(prefix="sonar-checkout-")) / "sonar"  # py_modules ships it as "sonar"
    stage.mkdir()
    for child in checkout.iterdir():  # links, not copies: the package is the checkout itself
        (stage / child.name).symlink_to(child, target_is_directory=child.is_dir())
    # Ray names an uploaded folder by its content's hash: without a file of its own this folder would hash
    # like the working dir (the same files), and the actors would unpack the working dir's package, which
    # has no sonar/ level, instead of this one.
    (stage / STAGE_MARKER).write_text(f"py_modules copy of {checkout}\n")
    env = dict(os.environ)
    env[CHECKOUT_ENV] = str(stage)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(stage.parent), env.get("PYTHONPATH")) if p)
    log.info("job: running the working dir's Sonar (%s) instead of the installed %s", checkout,
             Path(sonar.__file__).parent)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "sonar", *argv], env)


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
