"""A Ray head on 127.0.0.1 for `ray job submit` tests, and the helpers they share (submit a short smoke run,
read its run directory, MLflow status and live actors). The head is the test module's own (one start for
the module's jobs, 4-5 s and 2-4 s of teardown each on 2 cores): its teardown stops only the processes it
started, never `ray stop`.

Use: ``from tests.cluster.ray_head import ray_head, submit`` (importing the fixture into the test module
is how pytest finds it)."""
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from sonar.cluster.driver.roles import NODE_START_TIMEOUT, kill_processes
from tests.waiting import wait_until

BIN = Path(sys.executable).parent
_SUBMISSIONS = itertools.count()
# Small everywhere: one worker, a short SFT, one step per RL stage, a 4-question eval and no "before" eval.
SHORT = ["rollout.num_workers=1", "world.num_heldout_eval=4", "eval.before=false", "eval.no_search=false",
         "stages.0.steps=4", "stages.1.steps=1", "stages.2.steps=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "RAY_ADDRESS", "SONAR_RUN_ROOT", "RAY_JOB"))}
    env.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1",
                "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{BIN}:{env.get('PATH', '')}", **extra})
    return env


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on 127.0.0.1 under its own temp dir, for one test module; yields (dashboard URL, temp
    dir, run root): the run root is ``$SONAR_RUN_ROOT`` of every job the module submits (``_submit``),
    one root for several run names as a team shares it. Teardown ends the `ray start --block` process (it
    stops what it started), then any process still naming this head's temp dir, by pid."""
    tmp_path = tmp_path_factory.mktemp("jobs")
    temp = tempfile.mkdtemp(prefix="sj", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    port, dash = _free_port(), _free_port()
    # The head's dashboard agent takes the job submissions: its HTTP port is fixed (52365) by default, so
    # another Ray on the machine (a test's local cluster) could hold it and leave the job server with
    # "No available agent". Free ports for every listener the agents open.
    agent_ports = [f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
                   f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}"]
    # Ray's default graceful-stop window for `ray job stop` (RAY_JOB_STOP_WAIT_TIME_S unset: 3 s, then
    # SIGKILL): the driver must mark its run KILLED inside it (_env drops any RAY_JOB* of this process).
    env = _env()
    assert "RAY_JOB_STOP_WAIT_TIME_S" not in env
    url = f"http://127.0.0.1:{dash}"
    log_path = tmp_path / "ray-head.log"

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
             "--num-cpus=4", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
             f"--temp-dir={temp}", "--disable-usage-stats", *agent_ports],
            env={**env, "PYTHONUNBUFFERED": "1"},  # its "Ray runtime started." reaches the log at once
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    from ray.job_submission import JobSubmissionClient

    def client():
        try:
            return JobSubmissionClient(url)
        except Exception:
            return None
    def up() -> bool:
        # The job server can answer while the node is still starting (the raylet not yet registered): the
        # head is up once `ray start` says so, which it does only after its node started.
        return STARTED in log_path.read_text() and client() is not None

    head = start()
    try:
        for attempt in range(3):
            wait_until(lambda: head.poll() is not None or up(), 180,
                       "the Ray head started and its job server answering", poll_s=0.5)
            # Ray's fixed 30 s wait for the raylet to register (roles.NODE_START_TIMEOUT) can run out on a
            # loaded machine: `ray start` then exits. Stop what it left and start the head again.
            if head.poll() is None or NODE_START_TIMEOUT not in log_path.read_text() or attempt == 2:
                break
            _stop(head, temp)
            head = start()
        assert head.poll() is None, f"ray start --head exited:\n{log_path.read_text()[-3000:]}"
        yield url, temp, tmp_path / "persist" / "runs"
    finally:
        _stop(head, temp)
        shutil.rmtree(temp, ignore_errors=True)


def _stop(head: subprocess.Popen, temp: str) -> None:
    """End the `ray start --block` process (it stops what it started), then any process still naming the
    head's temp dir, by pid."""
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
    kill_processes([p for p in psutil.process_iter(["pid", "cmdline"])
                    if any(temp in a for a in (p.info["cmdline"] or []))])


STARTED = "Ray runtime started."
"""What `ray start` prints once its node has started (the raylet registered with the GCS): in a loaded run
of 68f87f5 the head's job server answered, the tests began submitting, and the node then timed out in
Ray's fixed 30 s wait (``NODE_START_TIMEOUT``) and `ray start` exited under them."""

NO_AGENT = "No available agent to submit job, please try again later"
"""The job server's answer while the head's dashboard agent has not registered yet (seconds after
`ray start` on a loaded machine): the job was not created, and Ray asks to try again."""


def _submit(url: str, wd: Path, root: Path, args: list[str], wait: bool = True, runtime_env: dict | None = None) -> str:
    """Submit the SHORT smoke run plus ``args`` from working dir ``wd`` (runs under ``root``); ``runtime_env``:
    more of the job's runtime env (keys besides ``env_vars``). Returns the submission id."""
    runtime_env = {**(runtime_env or {}),
                   "env_vars": {"SONAR_RUN_ROOT": str(root), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}}

    def attempt():
        sid = f"sonar-{next(_SUBMISSIONS)}-{os.getpid()}"
        cmd = [str(BIN / "ray"), "job", "submit", "--address", url, "--submission-id", sid, "--working-dir",
               str(wd), "--runtime-env-json", json.dumps(runtime_env), *([] if wait else ["--no-wait"]), "--",
               sys.executable, "-m", "sonar", "train", "--config", "smoke", "--config", "job.yaml", *SHORT, *args]
        p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
        return None if p.returncode != 0 and NO_AGENT in p.stdout + p.stderr else (sid, p)
    sid, p = wait_until(attempt, 180, "the head's job agent accepting a submission", poll_s=1.0)
    head_log = root.parent.parent / "ray-head.log"
    assert p.returncode == 0, (f"{' '.join(args)}: exit {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-3000:]}\n"
                               f"ray head: {head_log.read_text()[-3000:] if head_log.exists() else ''}")
    return sid


def _run_of(logs: str) -> tuple[Path, str]:
    """(run directory, MLflow run id) the driver logged."""
    found = re.findall(r"run directory (\S+) \(MLflow run (\w+)\)", logs)
    assert found, f"no 'run directory' line in the job's log:\n{logs[-4000:]}"
    return Path(found[-1][0]), found[-1][1]


def _mlflow_status(root: Path, run_id: str) -> str | None:
    """The MLflow status of ``run_id``, from whichever sqlite store under ``root`` holds it (a resume
    may continue the run it resumes)."""
    from mlflow.tracking import MlflowClient

    for db in root.rglob("mlflow.db"):
        try:
            return MlflowClient(tracking_uri=f"sqlite:///{db}").get_run(run_id).info.status
        except Exception:
            continue
    return None


def _alive_actors(url: str, job_id: str) -> list:
    from ray.util.state import list_actors

    return [a.class_name for a in list_actors(address=url, filters=[("state", "=", "ALIVE")], limit=1000)
            if a.job_id == job_id]
