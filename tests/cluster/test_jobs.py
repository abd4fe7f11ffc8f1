"""Ray-job plumbing without Ray running: the runtime-env merge and the SIGTERM handler kept across ray.init."""
import json
import signal

from ray.runtime_env.runtime_env import _merge_runtime_env  # what ray.init does with a job's runtime env

from sonar.cluster.driver.jobs import (JOB_CONFIG_ENV, SONAR_ENV_VARS, driver_runtime_env, job_runtime_env,
                                       keep_sigterm_handler)


def _job(runtime_env) -> dict:
    return {JOB_CONFIG_ENV: json.dumps({"runtime_env": runtime_env, "metadata": {}})}


def test_outside_a_job_the_driver_passes_all_of_sonars_env():
    assert driver_runtime_env({}) == {"env_vars": SONAR_ENV_VARS}
    assert job_runtime_env({JOB_CONFIG_ENV: "not json"}) == {}


def test_user_env_vars_merge_with_sonars_and_win():
    user = {"env_vars": {"HF_HUB_OFFLINE": "0", "MY_VAR": "x"}, "working_dir": "gcs://_ray_pkg_1.zip"}
    mine = driver_runtime_env(_job(user))
    assert "HF_HUB_OFFLINE" not in mine["env_vars"] and mine["env_vars"]["OMP_NUM_THREADS"] == "1"
    merged = _merge_runtime_env(user, mine, override=False)  # None would be Ray's "conflict" refusal
    assert merged is not None
    assert merged["env_vars"] == {**SONAR_ENV_VARS, "HF_HUB_OFFLINE": "0", "MY_VAR": "x"}
    assert merged["working_dir"] == "gcs://_ray_pkg_1.zip"
    # the conflict the issue reported: Sonar's full env against the same user env
    assert _merge_runtime_env(user, {"env_vars": dict(SONAR_ENV_VARS)}, override=False) is None


def test_a_job_that_sets_every_key_gets_no_env_from_sonar():
    assert driver_runtime_env(_job({"env_vars": dict(SONAR_ENV_VARS)})) == {}


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


def test_a_checkout_driver_ships_its_package_unless_the_job_names_py_modules(caplog):
    from sonar.cluster.driver.jobs import CHECKOUT_ENV

    env = driver_runtime_env({**_job({"working_dir": "gcs://x.zip"}), CHECKOUT_ENV: "/tmp/s/sonar"})
    assert env["py_modules"] == ["/tmp/s/sonar"]
    assert _merge_runtime_env({"working_dir": "gcs://x.zip"}, env, override=False) is not None
    with caplog.at_level("WARNING", logger="sonar"):
        env = driver_runtime_env({**_job({"py_modules": ["gcs://mine.zip"]}), CHECKOUT_ENV: "/tmp/s/sonar"})
    assert "py_modules" not in env and "not shipped" in caplog.text
    assert "py_modules" not in driver_runtime_env(_job({}))  # a plain job: nothing shipped
