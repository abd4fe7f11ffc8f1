"""Ctrl-C stops everything cleanly: exit 130, the MLflow run is marked KILLED, and no process the
run started (Ray's GCS, raylet, workers, actors) outlives it."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parent.parent


def test_ctrl_c_marks_run_killed_and_leaves_no_processes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sonar", "train", "--config", str(ROOT / "configs" / "smoke.yaml"),
           f"run.root={tmp_path}", f"run.run_dir={run_dir}", "stages.0.steps=100000", "rollout.num_workers=1"]
    # A terminal's Ctrl-C: SIGINT handled by default in the child even if this test process inherited it
    # ignored (a CI job started in the background), which Python would otherwise pass on.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    deadline = time.monotonic() + 240
    try:
        # Wait until the SFT stage is training (every role up, the learner holding the stage's
        # demonstrations: the driver then logs the stage's line and starts its steps): Ctrl-C lands mid-run.
        begun = "stage 0 (sft): "
        for line in proc.stdout:
            lines.append(line)
            if begun in line or time.monotonic() > deadline:
                break
        assert any(begun in l for l in lines), "".join(lines[-30:])
        started = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert started, "the run started no child processes?"
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, "".join(lines[-20:]) + rest[-3000:]

    def alive() -> list[int]:
        out = []
        for p in started:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def still_running() -> str:
        names = []
        for p in alive():
            try:
                names.append(psutil.Process(p).cmdline()[:3])
            except psutil.NoSuchProcess:
                pass
        return f"every process the run started to exit; still running: {names}"

    # The run's children (Ray's GCS, raylet, workers) exit on their own after it: wait for that.
    wait_until(lambda: not alive(), 60.0, still_running)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")  # run.root's store
    runs = client.search_runs([client.get_experiment_by_name("sonar").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]
