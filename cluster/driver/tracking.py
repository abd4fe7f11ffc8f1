"""Experiment tracking: an MLflow sink and a null sink.

Only the driver writes metrics; actors return small dicts. Keys are the slash-namespaced constants
of ``sonar.cluster.wire.metrics``. The default store is sqlite inside the run directory (no server);
``tracking.uri`` points at a server, whose token MLflow reads from ``MLFLOW_TRACKING_TOKEN`` in the
environment (never from the config, never logged).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Mapping, Protocol

from sonar.cluster.wire.redact import redact

log = logging.getLogger(__name__)



class Sink(Protocol):
    run_id: str | None

    def log_params(self, params: Mapping[str, str]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None: ...

    def log_artifacts(self, path: str, artifact_path: str | None = None) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


class NullSink:
    run_id = None

    def log_params(self, params): pass

    def log_metrics(self, metrics, step): pass

    def log_artifact(self, path, artifact_path=None): pass

    def log_artifacts(self, path, artifact_path=None): pass

    def finish(self, status="FINISHED"): pass


def _clean(metrics: Mapping[str, float]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if f == f and abs(f) != float("inf"):
            out[k] = f
    return out


@contextlib.contextmanager
def _atomic_write():
    """Defer Ctrl-C / SIGTERM until an MLflow write has finished.

    An interrupt raised inside a sqlite write leaves its transaction open and the database locked,
    and then the run can no longer be marked KILLED. The signal is remembered and re-raised as
    KeyboardInterrupt right after the write (main thread only; elsewhere signals are not delivered)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    # A signal the process ignores (SIGINT under `nohup ... &`) stays ignored.
    handlers = {sig: h for sig in (signal.SIGINT, signal.SIGTERM) if (h := signal.getsignal(sig)) != signal.SIG_IGN}
    for sig in handlers:
        signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        if got:
            raise KeyboardInterrupt(f"signal {got[0]}")


class MLflowSink:
    """One MLflow run. Metrics are batched into one ``log_metrics`` call per step (a synchronous
    call costs ~50 ms; one per key would dominate a tiny run)."""

    def __init__(self, run_dir: str | Path, uri: str | None, experiment: str, run_name: str):
        import mlflow

        self._mlflow = mlflow
        run_dir = Path(run_dir).resolve()
        self.uri = uri or f"sqlite:///{run_dir / 'mlflow.db'}"
        mlflow.set_tracking_uri(self.uri)
        exp = mlflow.get_experiment_by_name(experiment)
        if exp is None:
            artifact_location = None if uri else (run_dir / "mlartifacts").as_uri()
            exp_id = mlflow.create_experiment(experiment, artifact_location=artifact_location)
        else:
            exp_id = exp.experiment_id
        # A run whose driver was SIGKILLed stays RUNNING: mark it before starting this one.
        self.marked_dead = mark_dead_runs(self.uri, exp_id)
        self._run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=owner_tags())
        self.run_id = self._run.info.run_id

    def log_params(self, params: Mapping[str, str]) -> None:
        items = {k: str(v)[:6000] for k, v in params.items()}
        keys = list(items)
        with _atomic_write():
            for i in range(0, len(keys), 100):  # MLflow caps a batch at 100 params
                self._mlflow.log_params({k: items[k] for k in keys[i:i + 100]})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        m = _clean(metrics)
        if m:
            with _atomic_write():
                self._mlflow.log_metrics(m, step=step)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        with _atomic_write():
            self._mlflow.log_artifact(path, artifact_path)

    def log_artifacts(self, path: str, artifact_path: str | None = None) -> None:
        with _atomic_write():
            self._mlflow.log_artifacts(path, artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        if self._mlflow.active_run() is not None:
            with _atomic_write():
                self._mlflow.end_run(status=status)


HOST_TAG, PID_TAG, PID_START_TAG = "sonar.host", "sonar.pid", "sonar.pid_start"
DEAD_STATUS = "FAILED"
"""What a run left RUNNING by a dead driver becomes (MLflow's KILLED means "stopped by the user")."""


def _pid_start(pid: int) -> str | None:
    """The process's start time (distinguishes a reused pid); None when there is no such process."""
    try:
        import psutil

        return f"{psutil.Process(pid).create_time():.2f}"
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    except Exception:  # psutil.NoSuchProcess, AccessDenied, ...
        return None


def owner_tags(pid: int | None = None) -> dict[str, str]:
    """Tags naming the driver process that owns a run: host, pid and the pid's start time."""
    pid = os.getpid() if pid is None else pid
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(pid), PID_START_TAG: _pid_start(pid) or "?"}


def owner_alive(tags: Mapping[str, str]) -> bool | None:
    """Whether the driver that tagged a run still runs: None when it cannot be told (another host,
    no tags: a run from before these tags, or from another program)."""
    if tags.get(HOST_TAG) != socket.gethostname() or not str(tags.get(PID_TAG, "")).isdigit():
        return None
    start = _pid_start(int(tags[PID_TAG]))
    if start is None:
        return False
    recorded = tags.get(PID_START_TAG, "?")
    return start == recorded or "?" in (start, recorded)


def mark_dead_runs(uri: str, experiment_id: str) -> list[str]:
    """Runs of the experiment still RUNNING whose driver (same host, by pid and start time) is gone
    are marked FAILED (``DEAD_STATUS``), with the tag ``sonar.end_reason``; returns their ids."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    dead = []
    try:
        runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000)
    except Exception as e:  # a store that cannot search must not stop the run
        log.warning("could not look for stale MLflow runs in %s: %s", redact(uri), e)
        return dead
    for r in runs:
        if owner_alive(r.data.tags) is False:
            with _atomic_write():
                client.set_tag(r.info.run_id, "sonar.end_reason", "driver process gone (killed)")
                client.set_terminated(r.info.run_id, status=DEAD_STATUS)
            dead.append(r.info.run_id)
            log.warning("MLflow run %s was left RUNNING by driver pid %s, which is gone: marked %s",
                        r.info.run_id, r.data.tags.get(PID_TAG), DEAD_STATUS)
    return dead


def mark_dead_runs_in_run_dir(run_dir: str | Path) -> list[str]:
    """The same, in the default store of an earlier run directory (``<run_dir>/mlflow.db``): a resume
    starts a new directory, so it marks the run it resumes if that run was killed."""
    db = Path(run_dir) / "mlflow.db"
    if not db.is_file():
        return []
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{db.resolve()}"
    try:
        exps = MlflowClient(tracking_uri=uri).search_experiments()
    except Exception as e:
        log.warning("could not read the MLflow store %s: %s", db, e)
        return []
    return [rid for e in exps for rid in mark_dead_runs(uri, e.experiment_id)]


def make_sink(enabled: bool, run_dir: str | Path, uri: str | None, experiment: str, run_name: str) -> Sink:
    if not enabled:
        return NullSink()
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MLflowSink(run_dir, uri, experiment, run_name)
