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


# -- a new local store starts as a copy of MLflow's empty schema, built once per MLflow version ------

def _schema(db) -> tuple[dict, list, int]:
    """(every table's columns and every index's table, alembic's revision, the number of experiments) of a
    store. Columns, not the CREATE text: MLflow writes an enum's CHECK list in set order, which differs
    between two of its own builds of the same schema (string hashing is salted per process)."""
    import contextlib
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as c:
        objects = c.execute("SELECT type, name, tbl_name FROM sqlite_master WHERE type IN ('table', 'index')").fetchall()
        schema = {name: (kind, table, c.execute(f'PRAGMA table_info("{name}")').fetchall() if kind == "table" else None)
                  for kind, name, table in objects}
        return schema, c.execute("SELECT version_num FROM alembic_version").fetchall(), \
            c.execute("SELECT COUNT(*) FROM experiments").fetchone()[0]


def test_a_new_store_is_a_copy_of_mlflows_own_schema_and_mlflow_makes_its_default_experiment(tmp_path, monkeypatch):
    monkeypatch.setenv("SONAR_CACHE_DIR", str(tmp_path / "cache"))
    from mlflow.tracking import MlflowClient

    from sonar.cluster.driver import tracking

    built = tmp_path / "built" / "mlflow.db"  # MLflow's own way: tables, then every migration
    built.parent.mkdir()
    (exp_built,) = MlflowClient(tracking_uri=f"sqlite:///{built}").search_experiments()
    seeded = tmp_path / "project" / "mlflow.db"
    assert tracking.seed_sqlite_store(f"sqlite:///{seeded}") is True
    (template,) = (tmp_path / "cache").glob("mlflow-empty-store-*.db")
    tables, revision, experiments = _schema(seeded)
    mlflows, mlflows_revision, _ = _schema(built)
    assert tables == mlflows, {k: (tables.get(k), mlflows.get(k)) for k in set(tables) | set(mlflows)
                               if tables.get(k) != mlflows.get(k)}
    assert revision == mlflows_revision and len(tables) > 20 and len(revision) == 1
    assert experiments == 0 and _schema(template) == (tables, revision, 0)  # nothing of a project in it
    (exp,) = MlflowClient(tracking_uri=f"sqlite:///{seeded}").search_experiments()  # MLflow opens it as its own
    assert (exp.experiment_id, exp.name, exp.artifact_location) == \
        (exp_built.experiment_id, exp_built.name, exp_built.artifact_location)  # made here, not in the template

    # a store that exists is never touched; another kind of store is not Sonar's to seed
    before = seeded.read_bytes()
    assert tracking.seed_sqlite_store(f"sqlite:///{seeded}") is False and seeded.read_bytes() == before
    assert tracking.seed_sqlite_store("http://127.0.0.1:5000") is False
    assert tracking.seed_sqlite_store("sqlite:///relative.db") is False and not os.path.exists("relative.db")

    # the sink seeds a new store from the same template (not built again) and runs in it
    stamp = template.stat().st_mtime_ns
    sink = tracking.MLflowSink(tmp_path / "run", f"sqlite:///{tmp_path / 'second' / 'mlflow.db'}", "sonar", "r")
    sink.log_metrics({"x": 1.0}, step=1)
    sink.finish("FINISHED")
    assert template.stat().st_mtime_ns == stamp and list((tmp_path / "cache").iterdir()) == [template]
    run = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'second' / 'mlflow.db'}").get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"x": 1.0}


def test_without_a_usable_cache_mlflow_builds_the_store_itself(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should be
    monkeypatch.setenv("SONAR_CACHE_DIR", str(blocker / "sub"))
    from mlflow.tracking import MlflowClient

    from sonar.cluster.driver import tracking

    db = tmp_path / "project" / "mlflow.db"
    db.parent.mkdir()
    assert tracking.seed_sqlite_store(f"sqlite:///{db}") is False and not db.exists()
    assert not list((tmp_path / "project").glob(".mlflow.db.*"))  # no partial copy left behind
    (exp,) = MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    assert exp.name == "Default"
