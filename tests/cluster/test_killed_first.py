"""An interrupted run's MLflow status is written before anything slow: ``ray job stop`` SIGKILLs the
driver 3 s (Ray's default) after its SIGTERM, and flushing MLflow's async queue alone can take a second.
KILLED is in the store before the flush starts, and the queued metrics still land after it; FINISHED and
FAILED keep the order metrics, then status. No Ray."""
import pytest

from sonar.cluster.driver import tracking
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import load_config


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "RAY_JOB_CONFIG_JSON_ENV_VAR",
                "RAY_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    yield
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


def _sink_with_a_watched_flush(tmp_path, monkeypatch):
    """A sink (async logging on) whose flush records the run's status in the store when it starts."""
    from mlflow.tracking import MlflowClient

    (tmp_path / "r").mkdir()
    cfg = load_config([], [f"run.root={tmp_path}", "tracking.system_metrics=false"])
    sink = tracking.make_sink(cfg, tmp_path / "r", "r").inner
    assert sink.async_logging
    seen = []
    flush = sink._mlflow.flush_async_logging

    def watched():
        seen.append(MlflowClient(tracking_uri=sink.uri).get_run(sink.run_id).info.status)
        flush()
    monkeypatch.setattr(sink._mlflow, "flush_async_logging", watched)
    for step in range(1, 21):
        sink.log_metrics({K.LEARNER_LOSS: 1.0 / step}, step=step)
    return sink, seen


@pytest.mark.parametrize("status, at_flush", [("KILLED", "KILLED"), ("FAILED", "RUNNING"), ("FINISHED", "RUNNING")])
def test_killed_is_written_before_the_flush_and_no_metric_is_lost(tmp_path, monkeypatch, status, at_flush):
    from mlflow.tracking import MlflowClient

    sink, seen = _sink_with_a_watched_flush(tmp_path, monkeypatch)
    sink.finish(status)
    assert seen == [at_flush]
    client = MlflowClient(tracking_uri=sink.uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == status and run.info.end_time is not None
    assert sorted(m.step for m in client.get_metric_history(sink.run_id, K.LEARNER_LOSS)) == list(range(1, 21))
