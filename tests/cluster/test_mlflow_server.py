"""The tracking sink against a local ``mlflow server`` on 127.0.0.1 (started here, stopped by its
process group): params, async metrics flushed at KILLED, artifacts through the server, and the final
policy logged with the transformers flavour and registered. Slow: the server takes 5-25 s to start."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from sonar.cluster.driver import tracking
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import load_config
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    log = open(d / "server.log", "w")
    proc = subprocess.Popen([mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{d / 'server.db'}",
                             "--artifacts-destination", str(d / "artifacts")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            # the server's GenAI job executor (a runner and seven huey consumers, each a
                            # process importing MLflow) serves nothing a training run logs: off
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        # The server's start (migrations, then its job executor, now off) took over 180 s with both cores busy
        # in a loaded CI run (07:59:09 -> 08:00:19 for the executor alone): the bound is on a readiness event.
        wait_until(lambda: proc.poll() is not None or _healthy(url), 420.0,
                   lambda: f"mlflow server not healthy: {(d / 'server.log').read_text()[-2000:]}", poll_s=0.2)
        assert proc.poll() is None, (d / "server.log").read_text()[-2000:]
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own group (its gunicorn/uvicorn workers)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_a_run_over_http_keeps_every_metric_artifact_and_the_registered_model(mlflow_server, tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    from sonar.actors.model import materialise_policy
    from sonar.actors.world import build_world

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # the standard variable picks the server
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "server-test")
    cfg = load_config([], [f"run.root={tmp_path}", "run.name=smoke", "tracking.system_metrics=false",
                           "tracking.registered_model_name=sonar-server"])
    policy = materialise_policy(cfg.model, build_world(cfg.world), tmp_path / "policy")
    (tmp_path / "r").mkdir()
    sink = tracking.make_sink(cfg, tmp_path / "r", "r")
    try:
        sink.log_params({"run.name": "smoke"})
        keys = [f"learner/k{i}" for i in range(45)]
        for step in range(20):
            sink.log_metrics({**{k: step + i for i, k in enumerate(keys)}, "stage": 0}, step=step)
        (tmp_path / "r" / "predictions-after_search.jsonl").write_text('{"prediction": "x"}\n')
        sink.log_artifact(str(tmp_path / "r" / "predictions-after_search.jsonl"), "predictions")
        uri = sink.log_model(policy, eval_table={"after_search": {"n": 3, "em": 1.0}}, config={"run": {"name": "smoke"}})
    finally:
        sink.finish("KILLED")
    assert not (tmp_path / "mlflow.db").exists()  # nothing went to the default store
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(sink.run_id)
    assert run.info.status == "KILLED" and run.data.tags["sonar.preset"] == "smoke"
    assert client.get_experiment(run.info.experiment_id).name == "server-test"
    # the 45 learner keys, and the evaluation logged with the model (MLflow links a model's metrics to its run too)
    assert set(run.data.metrics) == {*keys, "eval/after_search/questions", "eval/after_search/em"}
    assert "stage" not in run.data.metrics and run.data.tags["sonar.stage"] == "0"
    assert sorted(m.step for m in client.get_metric_history(sink.run_id, keys[44])) == list(range(20))
    assert [a.path for a in client.list_artifacts(sink.run_id, "predictions")] == ["predictions/predictions-after_search.jsonl"]
    assert uri == "models:/sonar-server/1"
    mlflow.set_tracking_uri(mlflow_server)
    assert "transformers" in mlflow.models.get_model_info(uri).flavors
    assert client.get_model_version("sonar-server", "1").run_id == sink.run_id
