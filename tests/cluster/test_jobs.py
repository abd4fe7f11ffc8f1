"""Ray-job plumbing without Ray running: the runtime-env merge and the SIGTERM handler kept across ray.init."""
import json
import signal

import pytest
from ray.runtime_env.runtime_env import _merge_runtime_env  # what ray.init does with a job's runtime env

from sonar.cluster.wire.bootstrap import actor_env
from sonar.cluster.driver.jobs import (JOB_CONFIG_ENV, SONAR_ENV_VARS, driver_runtime_env, job_runtime_env,
                                       keep_sigterm_handler)


def _job(runtime_env) -> dict:
    return {JOB_CONFIG_ENV: json.dumps({"runtime_env": runtime_env, "metadata": {}})}


def test_outside_a_job_the_driver_passes_no_runtime_env():
    """Sonar's defaults are set by each actor's own process (``sonar.cluster.wire.bootstrap.role_process``), so an actor has
    no runtime env to be started through (Ray's pre-started workers serve it)."""
    assert driver_runtime_env({}) == {}
    assert job_runtime_env({JOB_CONFIG_ENV: "not json"}) == {}


def test_a_jobs_env_vars_stand_alone_and_win_in_the_actors():
    user = {"env_vars": {"HF_HUB_OFFLINE": "0", "MY_VAR": "x"}, "working_dir": "gcs://_ray_pkg_1.zip"}
    mine = driver_runtime_env(_job(user))
    assert mine == {}
    merged = _merge_runtime_env(user, mine, override=False)  # None would be Ray's "conflict" refusal
    assert merged is not None and merged["env_vars"] == {"HF_HUB_OFFLINE": "0", "MY_VAR": "x"}
    assert merged["working_dir"] == "gcs://_ray_pkg_1.zip"
    # what an actor then sets itself: Sonar's defaults for the keys the job leaves unset
    assert actor_env(user["env_vars"]) == {k: v for k, v in SONAR_ENV_VARS.items() if k != "HF_HUB_OFFLINE"}
    assert actor_env({}) == SONAR_ENV_VARS and actor_env(dict(SONAR_ENV_VARS)) == {}
    assert SONAR_ENV_VARS["OMP_NUM_THREADS"] == "1" and SONAR_ENV_VARS["HF_HUB_OFFLINE"] == "1"


def test_the_sigterm_handler_installed_before_ray_init_is_back_after_it():
    def mine(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, mine)
    try:
        with keep_sigterm_handler():
            signal.signal(signal.SIGTERM, lambda s, f: None)  # what ray.init does (sys.exit on SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with keep_sigterm_handler():  # none installed before: whatever ray.init set stays
            signal.signal(signal.SIGTERM, mine)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_a_job_driver_reruns_from_a_checkout_it_did_not_import(tmp_path):
    """checkout_to_run: only as a job's entrypoint, only in a Sonar checkout, only when that checkout is not
    the imported package, and once (the re-exec sets CHECKOUT_ENV)."""
    from sonar.cluster.driver.jobs import CHECKOUT_ENV, checkout_to_run, is_checkout

    other = tmp_path / "copy"
    other.mkdir()
    for rel in ("pyproject.toml", "__init__.py", "cluster/driver/cli.py"):
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        (other / rel).write_text((ROOT / rel).read_text())
    job = _job({"working_dir": "gcs://x.zip"})
    assert is_checkout(ROOT) and is_checkout(other) and not is_checkout(tmp_path)
    assert checkout_to_run(job, other, ROOT) == other.resolve()
    assert checkout_to_run({}, other, ROOT) is None  # not a job
    assert checkout_to_run(job, ROOT, ROOT) is None  # already the imported copy
    assert checkout_to_run(job, tmp_path, ROOT) is None  # a project folder, not a checkout
    assert checkout_to_run({**job, CHECKOUT_ENV: "/x/sonar"}, other, ROOT) is None  # re-executed already


def test_a_checkout_driver_ships_its_package_and_keeps_the_jobs_own_py_modules(monkeypatch):
    from sonar.cluster.driver.jobs import CHECKOUT_ENV, OVERRIDE_ENV, merge_override

    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    plain = _job({"working_dir": "gcs://x.zip"})
    env = driver_runtime_env({**plain, CHECKOUT_ENV: "/tmp/s/sonar"})
    assert env["py_modules"] == ["/tmp/s/sonar"]
    assert _merge_runtime_env({"working_dir": "gcs://x.zip"}, env, override=False) is not None
    with merge_override(env, plain):  # nothing clashes: Ray's own merge rule stays
        assert OVERRIDE_ENV not in __import__("os").environ

    user = {"working_dir": "gcs://x.zip", "py_modules": ["gcs://mine.zip"], "env_vars": {"MY_VAR": "x"}}
    env = driver_runtime_env({**_job(user), CHECKOUT_ENV: "/tmp/s/sonar"})
    assert env["py_modules"] == ["gcs://mine.zip", "/tmp/s/sonar"]  # the job's first, then the checkout
    assert _merge_runtime_env(user, env, override=False) is None  # what Ray would refuse without the override
    import os

    with merge_override(env, _job(user)):
        assert os.environ[OVERRIDE_ENV] == "1"
        merged = _merge_runtime_env(user, env, override=os.getenv(OVERRIDE_ENV) == "1")  # as ray.init reads it
    assert OVERRIDE_ENV not in os.environ  # only around ray.init
    assert merged["py_modules"] == ["gcs://mine.zip", "/tmp/s/sonar"] and merged["working_dir"] == "gcs://x.zip"
    assert merged["env_vars"] == {"MY_VAR": "x"}  # the user's env kept (Sonar's defaults: set in each actor)

    assert "py_modules" not in driver_runtime_env(_job({}))  # a plain job: nothing shipped


def _checkout_copy(dest):
    """The checkout's tracked files copied to ``dest`` (what a user's clone holds), plus untracked
    ``.git``, ``.venv`` and ``runs`` entries that must not travel."""
    from tests.checkout import copy_tracked

    copy_tracked(dest)
    for junk in (".git/HEAD", ".venv/lib/big.bin", "runs/old/mlflow.db"):
        (dest / junk).parent.mkdir(parents=True, exist_ok=True)
        (dest / junk).write_bytes(b"x" * 1000)
    return dest


@pytest.mark.slow
def test_the_staged_checkout_is_what_ray_ships_as_sonar(tmp_path):
    """stage_checkout, packed by Ray's own py_modules code path: every entry under ``sonar/`` (the folder's
    basename is the importable name), .gitignore'd and git's own files left home, a hash of its own
    (not the working dir's, whose package has no sonar/ level), and ``import sonar`` finds it first."""
    import subprocess
    import sys
    import zipfile

    from ray._private.runtime_env.packaging import _zip_files, get_uri_for_directory

    from sonar.cluster.driver.jobs import STAGE_MARKER, stage_checkout

    copy = _checkout_copy(tmp_path / "copy")
    (tmp_path / "stage").mkdir()
    stage = stage_checkout(copy, tmp_path / "stage")
    assert stage.name == "sonar" and (stage / STAGE_MARKER).is_file() and not (stage / ".git").exists()
    out = tmp_path / "pkg.zip"
    _zip_files(str(stage), [], str(out), include_gitignore=True, include_parent_dir=True)  # as py_modules does
    names = zipfile.ZipFile(out).namelist()
    assert names and all(n.startswith("sonar/") for n in names)
    assert {"sonar/__init__.py", "sonar/cluster/driver/cli.py", "sonar/actors/worker.py"} <= set(names)
    assert not [n for n in names if n.startswith(("sonar/.venv/", "sonar/runs/", "sonar/.git/"))], names
    print(f"py_modules package of the checkout: {out.stat().st_size / 2**20:.2f} MiB, {len(names)} files")
    # .venv alone would be GBs; this is far under Ray's upload limit (GCS_STORAGE_MAX_SIZE, ~500 MiB)
    assert out.stat().st_size < 64 * 2**20
    assert get_uri_for_directory(str(stage), True) != get_uri_for_directory(str(copy), True)
    # first on PYTHONPATH, the staged folder wins over the installed (editable) package
    init = copy / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.2.0"', '__version__ = "0.2.0+staged"'))
    got = subprocess.run([sys.executable, "-c", "import sonar, pathlib; print(sonar.__version__, "
                          "pathlib.Path(sonar.__file__).resolve().parent)"], cwd=copy, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(stage.parent)}, timeout=120)
    assert got.stdout.split() == ["0.2.0+staged", str(copy.resolve())], got.stderr


@pytest.mark.slow
def test_a_job_entrypoint_in_a_checkout_re_executes_and_says_which_sonar_runs(tmp_path):
    """`python -m sonar --version` as a job's entrypoint (its config env set, started in an edited copy):
    the copy's version; outside a job, the installed one (nothing changes)."""
    import os
    import subprocess
    import sys

    from sonar.cluster.driver.jobs import CHECKOUT_ENV

    copy = _checkout_copy(tmp_path / "copy")
    init = copy / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.2.0"', '__version__ = "0.2.0+edited"'))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_JOB", "SONAR_"))}
    # as Ray runs a job's working dir: the current directory, first on the path
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(copy), os.environ.get("PYTHONPATH")) if p)

    def version(env):
        p = subprocess.run([sys.executable, "-m", "sonar", "--version"], cwd=copy, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip(), p.stderr

    out, _ = version(base)
    assert out.startswith("sonar 0.2.0 from ") and str(copy) not in out  # not a job: the imported package
    out, err = version({**base, **_job({"working_dir": "gcs://x.zip"})})
    assert out == f"sonar 0.2.0+edited from {copy.resolve()}", err
    assert "job: running the working dir's Sonar" in err
    out, _ = version({**base, **_job({"working_dir": "gcs://x.zip"}), CHECKOUT_ENV: "/nowhere/sonar"})
    assert out.startswith("sonar 0.2.0 from ")  # the guard: never a second re-exec
