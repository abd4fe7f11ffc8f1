import os
import signal

import pytest

from sonar.cluster.driver.tracking import _atomic_write


@pytest.fixture
def sigint_default():
    """Python's own Ctrl-C handler, whatever this process inherited (CI may start it with SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_interrupt_during_an_mlflow_write_is_deferred_until_it_finishes(sigint_default):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with _atomic_write():
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-write
            done.append("write completed")
    assert done == ["write completed"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_an_ignored_sigint_stays_ignored_during_a_write():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _atomic_write():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # no KeyboardInterrupt, still ignored
    finally:
        signal.signal(signal.SIGINT, before)


# -- a SIGKILLed driver's run is marked FAILED at the next start on the same store -------------------

def _dead_pid():
    import subprocess

    p = subprocess.Popen(["true"])  # any process that has ended (not Python: the edit loop starts none)
    p.wait()
    return p.pid


def test_a_run_left_running_by_a_dead_driver_is_marked_failed_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow
    from mlflow.tracking import MlflowClient

    from sonar.cluster.driver import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("sonar", artifact_location=(tmp_path / "art").as_uri())
    dead_pid = _dead_pid()
    killed = client.create_run(exp, tags=tracking.owner_tags(os.getpid()) | {tracking.PID_TAG: str(dead_pid)}).info.run_id
    reused = client.create_run(exp, tags=tracking.owner_tags(os.getpid()) | {tracking.PID_START_TAG: "1.00"}).info.run_id
    alive = client.create_run(exp, tags=tracking.owner_tags(os.getpid())).info.run_id  # this process: still running
    elsewhere = client.create_run(exp, tags={tracking.HOST_TAG: "another-host", tracking.PID_TAG: str(dead_pid)}).info.run_id
    untagged = client.create_run(exp).info.run_id
    try:
        sink = tracking.MLflowSink(tmp_path, uri, "sonar", "next")
        assert sorted(sink.marked_dead) == sorted([killed, reused])
        status = {r: client.get_run(r).info.status for r in (killed, reused, alive, elsewhere, untagged)}
        assert status == {killed: "FAILED", reused: "FAILED", alive: "RUNNING", elsewhere: "RUNNING",
                          untagged: "RUNNING"}
        assert client.get_run(killed).data.tags["sonar.end_reason"].startswith("driver process gone")
        # the new run carries its own owner tags, so the start after it can tell
        assert client.get_run(sink.run_id).data.tags[tracking.PID_TAG] == str(os.getpid())
        sink.finish("FINISHED")
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()


def test_a_resume_marks_the_killed_run_in_its_own_run_directory(tmp_path):
    from mlflow.tracking import MlflowClient

    from sonar.cluster.driver import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("sonar", artifact_location=(tmp_path / "art").as_uri())
    rid = client.create_run(exp, tags=tracking.owner_tags(os.getpid()) | {tracking.PID_TAG: str(_dead_pid())}).info.run_id
    assert tracking.mark_dead_runs_in_run_dir(tmp_path) == [rid]
    assert client.get_run(rid).info.status == "FAILED"
    assert tracking.mark_dead_runs_in_run_dir(tmp_path / "no-such-run") == []
