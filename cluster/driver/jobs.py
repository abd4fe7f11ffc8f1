"""Running as a Ray job (``ray job submit ... -- sonar train``): the runtime env and the stop signal.

* **Runtime env.** Ray merges the job's runtime env (``--runtime-env-json``, handed to the driver in
  ``RAY_JOB_CONFIG_JSON_ENV_VAR``) with the one ``ray.init`` is given and refuses the same env-var key in
  both. Sonar's defaults (one thread per process, offline hub: ``sonar.cluster.wire.bootstrap.ACTOR_ENV``) are not passed in
  it: each actor's process sets them when its role module loads, for the keys the job's runtime env leaves unset
  (``sonar.cluster.wire.bootstrap.role_process``): the user's values win, nothing conflicts, and an actor without a runtime
  env of its own starts in one of the workers Ray keeps ready.
* **Code that travels.** ``pyproject.toml`` maps the package ``sonar`` to the repository root, so the
  folder ``ray job submit --working-dir .`` uploads holds the package's *contents*, not a ``sonar/``:
  Ray's job supervisor starts the entrypoint in that folder with it first on ``PYTHONPATH``
  (``ray/_private/runtime_env/working_dir.py``), where ``import sonar`` finds no ``sonar/`` and falls
  through to the installed copy, so a user's edits would not run. So when the CLI starts as a job's
  entrypoint (``JOB_CONFIG_ENV``, which only the job supervisor sets) in a Sonar checkout that is not the
  copy it imported (``checkout_to_run``), it re-executes itself once (``CHECKOUT_ENV`` guards it) with
  ``sonar`` resolving to the checkout: a staging folder ``sonar`` of links to the checkout's entries
  (``stage_checkout``), its parent first on ``PYTHONPATH``, so ``PathFinder`` finds it before the
  editable install's finder (appended to ``sys.meta_path``) or site-packages. The runtime env it passes
  to ``ray.init`` ships that folder as ``py_modules``: Ray zips it under its basename, ``sonar/``
  (``include_parent_dir``), honouring the checkout's ``.gitignore`` (so ``.venv`` and ``runs`` stay
  home), and puts the unpacked folder first on every actor's ``PYTHONPATH``; actors inherit the job's
  runtime env, and vLLM's and DeepSpeed's processes inherit the actor's environment. The driver logs
  which Sonar it runs, and every role reports its own (``roles.log_code_origins``). A job whose runtime
  env sets ``py_modules`` too keeps them: Ray refuses a key that both the job and ``ray.init`` set, so
  the driver passes the job's entries followed by the checkout and asks Ray to let ``ray.init``'s list
  stand for both (``merge_override``: only ``py_modules`` overlaps; Sonar's env vars never do).
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

from sonar.cluster.wire.bootstrap import ACTOR_ENV

log = logging.getLogger("sonar")

SONAR_ENV_VARS = ACTOR_ENV
"""Environment every Sonar actor gets unless the job's runtime env sets the key itself (``sonar.cluster.wire.bootstrap.ACTOR_ENV``,
applied by the actor's own process when its role module loads: ``sonar.cluster.wire.bootstrap.role_process``)."""
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
    """What the driver passes to ``ray.init``: nothing ({}), or, when this driver runs a job's checkout
    (``CHECKOUT_ENV``), that checkout as ``py_modules``, after the job's own entries when it names some
    (``merge_override`` then lets this list replace the job's). Sonar's environment defaults
    (``SONAR_ENV_VARS``) are not passed: each actor's process sets them itself, less the keys the job's
    runtime env sets (``sonar.cluster.wire.bootstrap.role_process``), so an actor has no runtime env of its own to wait for."""
    job = job_runtime_env(environ)
    user = job.get("env_vars") or {}
    skipped = sorted(set(SONAR_ENV_VARS) & set(user))
    if skipped:
        log.info("runtime env: the job sets %s; the actors keep the job's values, not Sonar's defaults",
                 ", ".join(skipped))
    env: dict = {}
    staged = environ.get(CHECKOUT_ENV)
    if staged:
        theirs = list(job.get("py_modules") or [])
        env["py_modules"] = [*theirs, staged]
        log.info("runtime env: shipping the checkout's Sonar to every actor as py_modules (%s)%s", staged,
                 f", after the job's own {theirs}" if theirs else "")
    return env


OVERRIDE_ENV = "RAY_OVERRIDE_JOB_RUNTIME_ENV"
"""Read by ``ray.init`` (``ray/_private/worker.py``): "1" lets its runtime env win a key the job's also sets."""


@contextlib.contextmanager
def merge_override(env: Mapping, environ: Mapping[str, str] | None = None):
    """Around ``ray.init(runtime_env=env)``: when ``env`` sets a key the job's runtime env sets too (only
    ``py_modules``, which ``driver_runtime_env`` builds from the job's own list), ``OVERRIDE_ENV`` is "1"
    for the call, so Ray takes ``env``'s list rather than refusing the merge; put back afterwards."""
    import os

    job = job_runtime_env(os.environ if environ is None else environ)
    clash = (set(env) - {"env_vars"}) & set(job)
    before = os.environ.get(OVERRIDE_ENV)
    if clash:
        assert clash == {"py_modules"}, f"runtime env keys set by both the job and Sonar: {sorted(clash)}"
        os.environ[OVERRIDE_ENV] = "1"
    try:
        yield
    finally:
        if clash:
            if before is None:
                os.environ.pop(OVERRIDE_ENV, None)
            else:
                os.environ[OVERRIDE_ENV] = before


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


NOT_STAGED = {".git", STAGE_MARKER}
"""Checkout entries the staged package leaves out: git's own store is no code (Ray would upload it whole:
its ``.gitignore`` does not list it)."""


def stage_checkout(checkout: Path, parent: Path) -> Path:
    """``parent/sonar``: a folder of links to ``checkout``'s entries (less ``NOT_STAGED``) and a marker
    file. With ``parent`` first on ``PYTHONPATH``, ``import sonar`` is the checkout; as ``py_modules`` Ray
    ships it as ``sonar/``, its ``.gitignore`` (a link too) honoured."""
    stage = parent / "sonar"
    stage.mkdir()
    for child in sorted(checkout.iterdir()):  # links, not copies: the package is the checkout itself
        if child.name not in NOT_STAGED:
            (stage / child.name).symlink_to(child, target_is_directory=child.is_dir())
    # Ray names an uploaded folder by its content's hash, paths taken relative to the folder: without a file
    # of its own this folder would hash like the working dir (the same files), and the actors would unpack
    # the working dir's package, which has no sonar/ level, instead of this one.
    (stage / STAGE_MARKER).write_text(f"py_modules copy of {checkout}\n")
    return stage


def reexec_from_checkout(argv: list[str]) -> None:
    """Under ``ray job submit --working-dir <checkout>``: re-execute ``python -m sonar <argv>`` so that
    ``import sonar`` is the checkout (module docstring); returns only when there is nothing to do. The
    re-executed driver says which Sonar it runs (version, fingerprint, folder)."""
    import os
    import sys
    import tempfile

    import sonar

    imported = Path(sonar.__file__).parent
    if os.environ.get(CHECKOUT_ENV) and os.environ.get(JOB_CONFIG_ENV):
        from sonar.cluster.wire.paths import code_origin

        log.info("job: the driver runs %s (the job's working dir, staged at %s)", code_origin(),
                 os.environ[CHECKOUT_ENV])
        return
    checkout = checkout_to_run(os.environ, Path.cwd(), imported)
    if checkout is None:
        return
    stage = stage_checkout(checkout, Path(tempfile.mkdtemp(prefix="sonar-checkout-")))
    env = dict(os.environ)
    env[CHECKOUT_ENV] = str(stage)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(stage.parent), env.get("PYTHONPATH")) if p)
    log.info("job: running the working dir's Sonar (%s) instead of the installed %s: re-executing", checkout,
             imported)
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
