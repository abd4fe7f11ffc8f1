"""Experiment tracking: an MLflow sink, a null sink, and Ray dashboard metrics.

Only the driver writes metrics; actors return small dicts. Keys are the slash-namespaced constants
of ``sonar.cluster.wire.metrics``. MLflow by its conventions:

- Where: ``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else one sqlite store per project,
  ``<run.root>/mlflow.db`` (artifacts in ``<run.root>/mlartifacts``), shared by every run, resume and
  ``sonar eval`` so they sit side by side in one UI; ``sonar eval`` of a training run's checkpoint uses
  that run's store (its ``mlflow.json``) unless a store is named, and nests under that run. The
  experiment: ``tracking.experiment``, else ``MLFLOW_EXPERIMENT_NAME``, else "sonar". A server's token comes from ``MLFLOW_TRACKING_TOKEN``
  (never from the config, never logged).
- A new local sqlite store starts as a copy of MLflow's empty schema, built by MLflow once per MLflow
  version under Sonar's cache folder (``seed_sqlite_store``), not by replaying its migrations each time.
- A resume continues the MLflow run of the run it resumes (``<run_dir>/mlflow.json`` names it); a
  param whose value changed on resume (MLflow params are write-once) becomes a ``sonar.param_changed.*`` tag.
- Tags: git commit (+ dirty flag), Ray job id and submission id, preset (``run.name``), Sonar version,
  owner (host, pid); the stage being trained is the ``sonar.stage`` tag, not a metric.
- Metrics leave the training thread: MLflow's async logging batches them on a background thread, and
  the run's end (FINISHED, KILLED or FAILED) flushes them before the status is written.
- System metrics (``system/*``) are sampled beside the run; the final policy is logged with the
  transformers flavour and registered under ``tracking.registered_model_name``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.redact import has_userinfo, redact

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "sonar"
STORE_FILE = "mlflow.db"
"""The project's default store under ``run.root``."""
ARTIFACTS_DIR = "mlartifacts"
RUN_FILE = "mlflow.json"
"""In a run (or eval) directory: the store, experiment and MLflow run id of that directory's run."""
STAGE_TAG = "sonar.stage"
NON_METRIC_KEYS = {"stage": STAGE_TAG}
"""Keys of a metrics row that MLflow gets as a tag (the latest value), not as a metric series."""


@dataclass(frozen=True)
class DataFile:
    """A dataset file a run reads, as MLflow records it among the run's inputs (``log_inputs``)."""
    path: str
    name: str
    """The field that names it: ``stages[1].data[0]``, ``eval.data[0]``."""
    context: str
    """MLflow's input context: ``training`` or ``evaluation``."""


def data_files(cfg: Any) -> list[DataFile]:
    """The dataset files ``cfg`` trains and evaluates on (none for the synthetic world's questions)."""
    def listed(data) -> list:  # a field holds one path or a list of them
        return [] if data is None else [data] if isinstance(data, str) else list(data)

    out = [DataFile(str(path), f"stages[{i}].data[{j}]", "training")
           for i, st in enumerate(cfg.stages) for j, path in enumerate(listed(st.data))]
    out += [DataFile(str(path), f"eval.data[{j}]", "evaluation") for j, path in enumerate(listed(cfg.eval.data))]
    return out


def file_digest(path: str, chunk: int = 1 << 20) -> str:
    """The first 16 hex digits of the file's SHA-256 (MLflow's dataset digest: a changed file is another
    dataset); "" when the file cannot be read here (the cluster's storage)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    except OSError:
        return ""
    return h.hexdigest()[:16]


class Sink(Protocol):
    run_id: str | None

    def log_params(self, params: Mapping[str, str]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def set_tags(self, tags: Mapping[str, str]) -> None: ...

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None: ...

    def log_artifacts(self, path: str, artifact_path: str | None = None) -> None: ...

    def log_inputs(self, files: Sequence[DataFile]) -> None: ...

    def log_model(self, path: str, eval_table: Mapping | None = None, config: Mapping | None = None) -> str | None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


class NullSink:
    run_id = None

    def log_params(self, params): pass

    def log_metrics(self, metrics, step): pass

    def set_tags(self, tags): pass

    def log_artifact(self, path, artifact_path=None): pass

    def log_artifacts(self, path, artifact_path=None): pass

    def log_inputs(self, files): pass

    def log_model(self, path, eval_table=None, config=None): return None

    def finish(self, status="FINISHED"): pass


def _clean(metrics: Mapping[str, float]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if k in NON_METRIC_KEYS:
            continue
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


# -- where: the standard environment variables, then one store per project ---------------------------

def resolve_uri(uri: str | None, root: str | Path) -> str:
    """``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///<root>/mlflow.db``."""
    if uri:
        return uri
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / STORE_FILE}"


def resolve_experiment(name: str | None) -> str:
    """``tracking.experiment``, else ``MLFLOW_EXPERIMENT_NAME``, else "sonar"."""
    return name or os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or DEFAULT_EXPERIMENT


def default_artifact_location(uri: str, root: str | Path) -> str | None:
    """The project's artifact folder for a new experiment in the default sqlite store; None (the
    server's or the store's own default) for any other store."""
    if uri == f"sqlite:///{Path(root).expanduser().resolve() / STORE_FILE}":
        return (Path(root).expanduser().resolve() / ARTIFACTS_DIR).as_uri()
    return None


# -- tags --------------------------------------------------------------------------------------------

def git_tags(cwd: str | Path | None = None) -> dict[str, str]:
    """``mlflow.source.git.commit`` and ``sonar.git.dirty`` of the checkout Sonar runs from (none outside git)."""
    cwd = str(cwd or Path(__file__).resolve().parents[2])

    def git(*args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)

    try:
        commit = git("rev-parse", "HEAD")
        if commit.returncode != 0:
            return {}
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {}
    tags = {"mlflow.source.git.commit": commit.stdout.strip()}
    if dirty.returncode == 0:
        tags["sonar.git.dirty"] = str(bool(dirty.stdout.strip())).lower()
    return tags


def ray_submission_id() -> str | None:
    """The ``ray job submit`` submission id of this driver (Ray passes it in the job config), if any."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        return (json.loads(raw).get("metadata") or {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None


def run_tags(cfg: Any) -> dict[str, str]:
    """Tags every Sonar run carries: git commit and dirty flag, the code's fingerprint (``sonar.code``, also
    without git), preset (``run.name``; every shipped preset names itself), Sonar version, Ray job
    submission id (``ray job submit``) or ``RAY_JOB_ID``."""
    import sonar
    from sonar import __version__
    from sonar.cluster.wire.paths import code_fingerprint

    # sonar.code: the production code's hash, recorded also where there is no git (a Ray job's uploaded
    # working dir): two runs with equal hashes ran the same code
    tags = {**git_tags(), "sonar.preset": str(cfg.run.name), "sonar.version": __version__,
            "sonar.code": code_fingerprint(Path(sonar.__file__).resolve().parent)}
    if sub := ray_submission_id():
        tags["ray.job_submission_id"] = sub
    if job := os.environ.get("RAY_JOB_ID"):
        tags["ray.job_id"] = job
    return tags


# -- a new local store ------------------------------------------------------------------------------

SQLITE_PREFIX = "sqlite:///"
EMPTY_STORE = "mlflow-empty-store-{version}.db"
"""Under Sonar's cache folder (``SONAR_CACHE_DIR``, else ``~/.cache/sonar``): MLflow's tables with every
schema migration applied and nothing in them, one file per MLflow version."""


def cache_dir() -> Path:
    """Where Sonar keeps files it can rebuild (the empty MLflow store template): ``$SONAR_CACHE_DIR``, else
    ``~/.cache/sonar``."""
    return Path(os.environ.get("SONAR_CACHE_DIR") or Path.home() / ".cache" / "sonar")


def seed_sqlite_store(uri: str) -> bool:
    """Give a new local sqlite store (``uri`` names a file that does not exist yet) MLflow's empty schema
    by copying a store MLflow built once per MLflow version, rather than letting MLflow build its tables
    and replay its schema migrations (about 50) in every new store: 1.38 -> 0.49 s from opening a new
    store to its first answer, on a 2-core machine; every test run and every new project paid it. The copy
    holds no experiment, run or model (only alembic's schema revision): MLflow still creates the Default
    experiment itself, as in any store without one, so nothing in it depends on where, when or by whom the
    empty store was built. True when the store was
    seeded; False when there is nothing to do (another store, or the file exists) or seeding failed
    (MLflow then builds the store as it always did)."""
    if not uri.startswith(SQLITE_PREFIX):
        return False
    path = Path(uri[len(SQLITE_PREFIX):].split("?", 1)[0])
    if not path.is_absolute() or path.exists():
        return False
    try:
        import shutil
        import tempfile

        import mlflow

        template = cache_dir() / EMPTY_STORE.format(version=mlflow.__version__)
        if not template.is_file():
            _build_empty_store(template)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            shutil.copyfile(template, tmp)
            os.link(tmp, path)  # never over a store another process created meanwhile
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True
    except Exception as e:  # noqa: BLE001 - an optimisation: MLflow builds the store itself
        log.debug("MLflow store %s not seeded (%s): MLflow builds it", path, e)
        return False


def _build_empty_store(template: Path) -> None:
    """MLflow's own table creation and migrations (``mlflow.store.db.utils._initialize_tables``) into a
    temporary file, renamed into place once complete (a concurrent builder's rename is as good)."""
    import tempfile

    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    template.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{template.name}.", dir=template.parent)
    os.close(fd)
    try:
        engine = sqlalchemy.create_engine(f"{SQLITE_PREFIX}{tmp}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(tmp, template)
    except BaseException:
        os.unlink(tmp)
        raise


# -- the MLflow run ----------------------------------------------------------------------------------

ASYNC_BUFFER_ENV, ASYNC_BUFFER_S = "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1"
"""MLflow's async logging buffer (whole seconds): what an async sink sets unless the environment does."""


class MLflowSink:
    """One MLflow run. A step's metrics are one ``log_metrics`` call; with ``async_logging`` it only
    enqueues them (MLflow's async logging thread writes batches), and ``finish`` flushes before it
    writes the status, so nothing is lost at exit, KILLED and FAILED included."""

    def __init__(self, run_dir: str | Path | None, uri: str | None, experiment: str, run_name: str, *,
                 artifact_location: str | None = None, resume_run_id: str | None = None,
                 tags: Mapping[str, str] | None = None, async_logging: bool = False,
                 system_metrics: bool = False, registered_model_name: str = ""):
        import mlflow

        from sonar.cluster.wire.logs import restamp

        restamp(("mlflow",))  # MLflow's handler (installed at import) with Sonar's log date, not "%Y/%m/%d"
        self._mlflow = mlflow
        self.uri = uri or f"sqlite:///{Path(run_dir).resolve() / STORE_FILE}"
        self.async_logging = async_logging
        if async_logging:
            # MLflow's logging thread otherwise blocks in ``queue.get(timeout=1)`` and sees the stop only
            # when that returns: every flush and every run's end (a shutdown each) waited up to 1 s on an
            # idle queue. Buffered, it waits on the stop event itself (ends at once) and writes what
            # queued in that second as merged batches. A value the user set wins.
            os.environ.setdefault(ASYNC_BUFFER_ENV, ASYNC_BUFFER_S)
        self.registered_model_name = registered_model_name
        # MLflow copies the URI into MLFLOW_TRACKING_URI: put the user's value back, so the next sink
        # in this process (a resume, ``sonar eval`` after training, a test) resolves from what the user set.
        user_env = os.environ.get("MLFLOW_TRACKING_URI")
        seed_sqlite_store(self.uri)
        mlflow.set_tracking_uri(self.uri)
        if user_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = user_env
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.uri)
        exp = mlflow.get_experiment_by_name(experiment)
        if exp is None:
            if artifact_location is None and not uri:  # a run directory's own store (tests, harnesses)
                artifact_location = (Path(run_dir).resolve() / ARTIFACTS_DIR).as_uri()
            exp_id = mlflow.create_experiment(experiment, artifact_location=artifact_location)
        else:
            exp_id = exp.experiment_id
        self.experiment_id = exp_id
        # A run whose driver was SIGKILLed stays RUNNING: mark it before starting this one.
        self.marked_dead = mark_dead_runs(self.uri, exp_id)
        self._params: dict[str, str] = {}
        all_tags = {**(tags or {}), **owner_tags()}
        resumed = None
        if resume_run_id:
            try:
                resumed = self._client.get_run(resume_run_id)
            except Exception as e:  # another store, or a deleted run: a new run, said loudly
                log.warning("MLflow run %s to continue is not in %s (%s): starting a new run", resume_run_id,
                            redact(self.uri), str(e).splitlines()[0] if str(e) else type(e).__name__)
        if resumed is not None:
            self._params = dict(resumed.data.params)
            with _atomic_write():
                self._run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=system_metrics)
                mlflow.set_tags(all_tags)
        else:
            with _atomic_write():
                self._run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=all_tags,
                                             log_system_metrics=system_metrics)
        self.resumed = resumed is not None
        self.run_id = self._run.info.run_id

    def write_run_file(self, directory: str | Path) -> None:
        """``<directory>/mlflow.json``: what a resume from this directory's checkpoints continues."""
        (Path(directory) / RUN_FILE).write_text(json.dumps(
            {"tracking_uri": redact(self.uri), "experiment_id": self.experiment_id, "run_id": self.run_id}))

    def log_params(self, params: Mapping[str, str]) -> None:
        items = {k: str(v)[:6000] for k, v in params.items()}
        new = {k: v for k, v in items.items() if k not in self._params}
        changed = {f"sonar.param_changed.{k}": v for k, v in items.items()
                   if k in self._params and self._params[k] != v}
        keys = list(new)
        with _atomic_write():
            for i in range(0, len(keys), 100):  # MLflow caps a batch at 100 params
                self._mlflow.log_params({k: new[k] for k in keys[i:i + 100]})
            if changed:  # params are write-once: a value a resume changed is kept as a tag
                self._mlflow.set_tags(changed)
        self._params.update(new)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        tags = {tag: str(metrics[k]) for k, tag in NON_METRIC_KEYS.items() if k in metrics}
        if tags:
            self.set_tags(tags)
        m = _clean(metrics)
        if m:
            with _atomic_write():
                self._mlflow.log_metrics(m, step=step, synchronous=not self.async_logging)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        with _atomic_write():
            self._mlflow.set_tags({k: str(v) for k, v in tags.items()}, synchronous=not self.async_logging)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        with _atomic_write():
            self._mlflow.log_artifact(path, artifact_path)

    def log_artifacts(self, path: str, artifact_path: str | None = None) -> None:
        with _atomic_write():
            self._mlflow.log_artifacts(path, artifact_path)

    def log_inputs(self, files: Sequence[DataFile]) -> None:
        """Each file as an MLflow dataset input of the run (its source the file, its digest the content's),
        so the run's page lists what it trained and evaluated on; a resume logs them again (MLflow keeps one
        entry per dataset and context)."""
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource

        with _atomic_write():
            for f in files:
                ds = MetaDataset(LocalArtifactDatasetSource(f.path), name=f.name, digest=file_digest(f.path) or None)
                self._mlflow.log_input(ds, context=f.context)

    def log_model(self, path: str, eval_table: Mapping | None = None, config: Mapping | None = None) -> str | None:
        """The exported Hugging Face folder, logged with the transformers flavour as a text-generation
        model (from the folder itself: nothing is loaded), with the eval table and the resolved config
        in its metadata; registered under ``registered_model_name`` when set, the eval table then also
        the version's description. Returns the model URI (``models:/<name>/<version>`` when registered)."""
        import torch
        import transformers

        meta = {"sonar_eval": dict(eval_table or {}), "sonar_config": dict(config or {})}
        with _atomic_write(), _no_hub_lookup_warnings():
            info = self._mlflow.transformers.log_model(
                transformers_model=str(path), task="text-generation", name="model",
                # explicit: MLflow's inference would import torchvision, which CPU installs lack
                pip_requirements=[f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"],
                metadata=json.loads(json.dumps(meta, default=str)),
                registered_model_name=self.registered_model_name or None)
            # The model's own metrics are the held-out evaluation (eval/<split>/<metric>: EM, F1, ACC_R, ...),
            # not the system samples MLflow would otherwise show on it.
            model_metrics = eval_metrics(eval_table or {})
            if model_metrics:
                self._mlflow.log_metrics(model_metrics, model_id=info.model_id, synchronous=True)
        if not self.registered_model_name:
            return info.model_uri
        version = str(info.registered_model_version)
        with _atomic_write():
            self._client.update_model_version(self.registered_model_name, version,
                                              description=eval_markdown(eval_table or {}))
            self._client.set_model_version_tag(self.registered_model_name, version, "sonar.run_id", self.run_id)
        return f"models:/{self.registered_model_name}/{version}"

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with ``status``, the queued metrics flushed. FINISHED and FAILED: the metrics first,
        then the status. KILLED (Ctrl-C, ``ray job stop``) has a deadline, Ray SIGKILLing the driver 3 s
        after its SIGTERM by default, and a flush is as long as the writes it has left: the status is
        written first (one write), then the metrics,
        which MLflow still accepts on an ended run, then the run is ended as usual."""
        if self._mlflow.active_run() is not None:
            with _atomic_write():
                if status == "KILLED":
                    self._client.set_terminated(self.run_id, status)
                if self.async_logging:
                    self._mlflow.flush_async_logging()  # every queued step is written before end_run
                self._mlflow.end_run(status=status)


def eval_metrics(table: Mapping) -> dict[str, float]:
    """An eval table ({split or dataset: summary}) as the evaluation's metrics, ``eval/<split>/<metric>``
    (``actors.evaluation.eval_metrics``: the keys of ``cluster/wire/metrics.py``)."""
    from sonar.actors.evaluation import eval_metrics as split_metrics

    return {k: v for split, row in table.items() if isinstance(row, Mapping) for k, v in split_metrics(split, row).items()}


def eval_markdown(table: Mapping) -> str:
    """An eval table ({split or dataset: {metric: value}}) as a markdown table."""
    rows = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    if not rows:
        return ""
    cols = sorted({c for v in rows.values() for c, x in v.items() if isinstance(x, (int, float))})
    fmt = lambda x: f"{x:.4g}" if isinstance(x, float) else str(x)  # noqa: E731
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(fmt(v.get(c, "")) for c in cols) + " |" for k, v in rows.items()]
    return "\n".join(lines)


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


def run_file(directory: str | Path) -> dict | None:
    """What ``<directory>/mlflow.json`` records (tracking URI, experiment id, run id), or None."""
    f = Path(directory) / RUN_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def find_run_dir(path: str | Path, levels: int = 4) -> Path | None:
    """The run directory ``path`` lies in: ``path`` or the nearest of its ``levels`` parents holding an
    ``mlflow.json`` (``<run>/model``, ``<run>/checkpoints/<tag>/hf``, ...), or None."""
    p = Path(path).resolve()
    for d in [p, *p.parents][:levels + 1]:
        if run_file(d) is not None:
            return d
    return None


def find_run_file(path: str | Path, levels: int = 4) -> dict | None:
    """The ``mlflow.json`` of the run directory ``path`` lies in (:func:`find_run_dir`), or None."""
    d = find_run_dir(path, levels)
    return run_file(d) if d is not None else None


def store_root(uri: str) -> Path | None:
    """The folder of a default project store (``sqlite:///<root>/mlflow.db``), None for any other store."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and uri.endswith("/" + STORE_FILE):
        return Path(uri[len(prefix):]).parent
    return None


def _experiment_name(uri: str, experiment_id: str | None) -> str | None:
    """The name of experiment ``experiment_id`` in the store ``uri``; None when it cannot be read."""
    if not experiment_id:
        return None
    try:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=uri).get_experiment(experiment_id).name
    except Exception:  # noqa: BLE001 - a store that cannot answer: the configured experiment is used
        return None


def make_sink(cfg: Any, run_dir: str | Path, run_name: str, *, tags: Mapping[str, str] | None = None,
              resume_dir: str | Path | None = None, parent_of: str | Path | None = None) -> Sink:
    """The run's sink from ``cfg.tracking`` (a ``Config``): where and which experiment by the standard
    environment variables and the project store under ``cfg.run.root`` (module docstring); ``resume_dir``:
    the directory of a run being resumed, whose MLflow run this one continues when it is in the same
    store. ``parent_of``: a path inside a training run's directory (``sonar eval``'s checkpoint): unless
    ``tracking.uri`` or ``MLFLOW_TRACKING_URI`` names a store, this run goes to the store (and, unless one
    is named, the experiment) that run's ``mlflow.json`` records; it is tagged with that run's id
    (``sonar.train_run_id``) and nested under it when both are in one store and experiment. Records ``<run_dir>/mlflow.json``. Wrapped so the key metrics also reach Ray's dashboard."""
    t = cfg.tracking
    if not t.enabled:
        return RayDashboardSink(NullSink())
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow  # noqa: F401 - its handler installed now, restamped before the store is first opened

    from sonar.cluster.wire.logs import restamp

    restamp(("mlflow",))
    train = find_run_file(parent_of) if parent_of is not None else None
    user_uri = t.uri or os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    experiment = resolve_experiment(t.experiment)
    root = cfg.run.root
    if train and not user_uri and train.get("tracking_uri") and not has_userinfo(train["tracking_uri"]):
        # Nobody chose a store: the training run's own (its run.root may not be this one's), so the
        # evaluation is nested under it rather than alone in a new store under the current directory.
        # A recorded URI with "***" in it lost its credentials to redaction and cannot be reopened.
        uri = train["tracking_uri"]
        root = store_root(uri) or root
        if not (t.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip()):
            experiment = _experiment_name(uri, train.get("experiment_id")) or experiment
    else:
        uri = resolve_uri(t.uri, cfg.run.root)
    resume_id = None
    if resume_dir is not None and (prev := run_file(resume_dir)) and prev.get("tracking_uri") == redact(uri):
        resume_id = prev.get("run_id")
    tags = dict(tags or {})
    if train and train.get("tracking_uri") == redact(uri):
        tags["sonar.train_run_id"] = train["run_id"]
        with contextlib.suppress(Exception):
            from mlflow.tracking import MlflowClient

            exp = MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
            if exp is not None and exp.experiment_id == train.get("experiment_id"):
                tags["mlflow.parentRunId"] = train["run_id"]  # shown nested under the training run
    sink = MLflowSink(run_dir, uri, experiment, run_name,
                      artifact_location=default_artifact_location(uri, root), resume_run_id=resume_id,
                      tags={**run_tags(cfg), **tags}, async_logging=t.async_logging,
                      system_metrics=t.system_metrics, registered_model_name=t.registered_model_name)
    sink.write_run_file(run_dir)
    return RayDashboardSink(sink)


# -- Ray's dashboard ---------------------------------------------------------------------------------

RAY_GAUGES = {
    K.LEARNER_VERSION: ("sonar_learner_version", "policy version the learner has reached"),
    K.LEARNER_REWARD_MEAN: ("sonar_reward_mean", "mean reward of the groups of the last learner step"),
    K.LEARNER_TOKENS_PER_S: ("sonar_learner_tokens_per_s", "learner throughput, tokens per second"),
    K.ROLLOUT_TOKENS_PER_S: ("sonar_rollout_tokens_per_s", "rollout throughput, tokens per second"),
    K.REPLAY_DEPTH: ("sonar_replay_depth", "groups waiting in the replay queue"),
    K.LEARNER_POLICY_LAG_MAX: ("sonar_policy_lag_max", "largest policy lag in the last learner step"),
}
"""Metric key -> (Ray metric name, description): the key training metrics exported as gauges."""
RAY_STEP_GAUGE = ("sonar_step", "driver step (the MLflow step of the last row logged)")
RAY_ROWS_COUNTER = ("sonar_rows_logged", "metric rows the driver has logged")


class RayDashboardSink:
    """A sink that forwards everything to ``inner`` and also sets ``ray.util.metrics`` gauges (step,
    reward, throughput, replay depth, policy lag; a counter of rows logged) from the driver, so they
    show in Ray's dashboard / Prometheus. The metric objects are created on the first row logged once
    Ray is initialised (the sink is made before ``ray.init``); then the Ray job id is tagged too.
    ``metrics_module``: ``ray.util.metrics`` or a stand-in with the same ``Gauge``/``Counter``."""

    def __init__(self, inner: Sink, metrics_module: Any = None, ray_ready: Callable[[], bool] | None = None):
        self.inner = inner
        self._module = metrics_module
        self._ready = ray_ready
        self.gauges: dict[str, Any] | None = None
        self.counter: Any = None
        self._broken = False

    @property
    def run_id(self):
        return self.inner.run_id

    def __getattr__(self, name):  # what only the inner sink has (uri, marked_dead, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _init_ray_metrics(self) -> bool:
        if self.gauges is not None:
            return True
        if self._module is None:
            try:
                import ray
            except ImportError:
                return False
            if not ray.is_initialized():
                return False
            import ray.util.metrics as module

            self._module = module
            with contextlib.suppress(Exception):  # the Ray job id, now that there is one
                self.inner.set_tags({"ray.job_id": ray.get_runtime_context().get_job_id()})
        elif self._ready is not None and not self._ready():
            return False
        Gauge, Counter = self._module.Gauge, self._module.Counter
        self.gauges = {k: Gauge(name, description=desc) for k, (name, desc) in RAY_GAUGES.items()}
        self.gauges["step"] = Gauge(RAY_STEP_GAUGE[0], description=RAY_STEP_GAUGE[1])
        self.counter = Counter(RAY_ROWS_COUNTER[0], description=RAY_ROWS_COUNTER[1])
        return True

    def export(self, metrics: Mapping[str, float], step: int) -> None:
        if self._broken:
            return
        try:
            if not self._init_ray_metrics():
                return
            self.gauges["step"].set(float(step))
            self.counter.inc(1.0)
            for k, v in _clean(metrics).items():
                if k in self.gauges:
                    self.gauges[k].set(v)
        except Exception as e:  # the dashboard is a view: it never stops a run
            log.warning("could not export metrics to Ray (not exported from now on): %s", e)
            self._broken = True

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.inner.log_metrics(metrics, step)
        self.export(metrics, step)

    def log_params(self, params): self.inner.log_params(params)

    def set_tags(self, tags): self.inner.set_tags(tags)

    def log_artifact(self, path, artifact_path=None): self.inner.log_artifact(path, artifact_path)

    def log_artifacts(self, path, artifact_path=None): self.inner.log_artifacts(path, artifact_path)

    def log_inputs(self, files): self.inner.log_inputs(files)

    def log_model(self, path, eval_table=None, config=None): return self.inner.log_model(path, eval_table, config)

    def finish(self, status="FINISHED"): self.inner.finish(status)


HUB_LOOKUP_WARNINGS = ("The model card could not be retrieved from the hub",
                       "Unable to find license information for this model")
"""What ``mlflow.transformers`` warns when it looks a model folder up on the Hugging Face Hub by its
path (``_fetch_model_card``, ``_write_license_information``): Sonar logs a local folder, the trained
policy, so the lookup cannot succeed and the two warnings say nothing about it."""


class _DropHubLookupWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(HUB_LOOKUP_WARNINGS)


@contextlib.contextmanager
def _no_hub_lookup_warnings():
    """``mlflow.transformers``'s Hub-lookup warnings dropped for the duration (nothing else it says); one
    line of Sonar's says instead what the logged model carries."""
    target = logging.getLogger("mlflow.transformers")
    drop = _DropHubLookupWarnings()
    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)
    log.info("final policy logged as a local folder: no Hugging Face model card or license file (the license is "
             "model.path's, the base model's; none for a randomly initialised policy)")
