"""One run: its directory, its MLflow sink, the metric history and the results.

The run directory holds the resolved config, checkpoints, predictions and ``metrics.jsonl``; only the
driver writes metrics (``Run.log``).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sonar.cluster.driver import tracking
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config, flatten, to_dict, to_yaml
from sonar.cluster.wire.logs import run_stamp

log = logging.getLogger("sonar")

HISTORY_WINDOW = 1000
"""Rows of ``Run.history`` kept in memory (the newest ones); every row is in ``metrics.jsonl`` and
the run's summary reads ``Run.totals``, so nothing the driver holds grows with the run's length."""

RESUME_MUST_MATCH = ("world", "model", "protocol", "critic", "stages", "learner.zero_stage")
"""Config fields (sections, or dotted fields) a checkpoint's saved config must equal for a resume:
they fix the parameters' shapes, the tokenizer, the question set and the meaning of the saved stage
index and cursor. ``stages.N.steps`` is exempt (a resume may lengthen or shorten a stage)."""


class ResumeError(ValueError):
    """``run.resume`` names no checkpoint, or one whose config does not match: raised before Ray starts."""


@dataclass
class Totals:
    """Running aggregates over every row logged (what ``reports.print_summary`` reads)."""

    policy_lag_max: float = 0
    learner_steps: int = 0
    rl_rows: int = 0
    tokens_per_s_sum: float = 0.0

    def add(self, row: dict) -> None:
        self.policy_lag_max = max(self.policy_lag_max, row.get(K.LEARNER_POLICY_LAG_MAX, 0))
        self.learner_steps += K.LEARNER_VERSION in row
        if K.ROLLOUT_TRAJECTORIES in row:
            self.rl_rows += 1
            self.tokens_per_s_sum += float(row.get(K.LEARNER_TOKENS_PER_S, 0))

    @property
    def tokens_per_s_mean(self) -> float | None:
        return self.tokens_per_s_sum / self.rl_rows if self.rl_rows else None


@dataclass
class Run:
    cfg: Config
    dir: Path
    sink: tracking.Sink
    step: int = 0
    t0: float = field(default_factory=time.monotonic)
    results: dict = field(default_factory=dict)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_WINDOW))
    """The newest ``HISTORY_WINDOW`` rows logged (all of them are in ``metrics.jsonl``)."""
    totals: Totals = field(default_factory=Totals)
    rows_logged: int = 0
    """Rows logged so far (``history_since`` takes a value of it)."""
    finished: bool = False
    resume_from: str | None = None
    """The checkpoint ``run.resume`` resolved to, checked before Ray started (None: a fresh run)."""
    _metrics_file: object = None

    def log(self, metrics: dict) -> None:
        self.sink.log_metrics(metrics, step=self.step)
        row = {"step": self.step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.history.append(row)
        self.totals.add(row)
        self.rows_logged += 1
        if self._metrics_file is None:  # line-buffered: each row is on disk when log returns
            self._metrics_file = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._metrics_file.write(json.dumps(row) + "\n")

    def history_since(self, rows_logged: int) -> list[dict]:
        """The rows logged after ``rows_logged`` rows (as far as the window still holds them)."""
        n = self.rows_logged - rows_logged
        return list(self.history)[-n:] if n > 0 else []

    def finish(self, status: str) -> None:
        if not self.finished:
            self.finished = True
            if self._metrics_file is not None:
                self._metrics_file.close()
            self.sink.finish(status)


def resolve_resume(cfg: Config) -> str | None:
    """The checkpoint ``run.resume`` names (None without one), checked without Ray or torch state:
    it exists and is complete, and its run's saved config matches ``cfg`` in ``RESUME_MUST_MATCH``.
    Raises ``ResumeError`` (one line) otherwise."""
    if not cfg.run.resume:
        return None
    from sonar.learner.checkpoint import CheckpointError, validate_checkpoint

    try:
        path = str(validate_checkpoint(resolve_resume_path(cfg)))
    except CheckpointError as e:
        raise ResumeError(f"run.resume={cfg.run.resume!r}: {e}") from None
    saved = Path(path).parent.parent / "config.yaml"
    if not saved.is_file():
        log.warning("run.resume: %s has no saved config.yaml beside it; its config cannot be checked", path)
        return path
    try:
        old = yaml.safe_load(saved.read_text())
    except yaml.YAMLError as e:
        raise ResumeError(f"run.resume={cfg.run.resume!r}: saved config {str(saved)!r} is unreadable: "
                          f"{str(e).splitlines()[0]}") from None
    diffs = config_differences(old if isinstance(old, dict) else {}, to_dict(cfg))
    if diffs:
        raise ResumeError(f"run.resume={cfg.run.resume!r}: checkpoint {path} was saved by a run whose config "
                          f"differs in " + "; ".join(diffs) + " (saved " + str(saved) + ")")
    return path


def resolve_resume_path(cfg: Config) -> str:
    """Where ``run.resume`` points: a checkpoint or run directory as given; 'latest' the newest checkpoint
    under ``run.root`` of a run of this ``run.name`` (and of ``tracking.experiment`` when set), never
    another experiment's sharing the root. Raises ``CheckpointError`` naming the name and the root."""
    from sonar.learner.checkpoint import resolve_checkpoint

    return resolve_checkpoint(cfg.run.resume, cfg.run.root, name=cfg.run.name, experiment=cfg.tracking.experiment)


def config_differences(saved: dict, current: dict) -> list[str]:
    """``"field: checkpoint X, now Y"`` for each field of ``RESUME_MUST_MATCH`` that differs. A field
    the saved config lacks (the schema grew since) is not compared."""
    old_flat, new_flat = flatten(saved), flatten(current)
    out = []
    n_old, n_new = len(saved.get("stages") or []), len(current.get("stages") or [])
    if n_old != n_new:
        out.append(f"stages: checkpoint has {n_old} stages, now {n_new}")
    for key in sorted(new_flat):
        if not any(key == m or key.startswith(m + ".") for m in RESUME_MUST_MATCH):
            continue
        if key.startswith("stages.") and key.endswith(".steps"):
            continue
        if key in old_flat and old_flat[key] != new_flat[key]:
            out.append(f"{key}: checkpoint {old_flat[key]}, now {new_flat[key]}")
    return out


def start_run(cfg: Config) -> Run:
    # The resume target is checked first: a bad one fails here, before a directory, an MLflow run or Ray.
    resume_from = resolve_resume(cfg)
    if resume_from is not None and cfg.tracking.enabled and not cfg.tracking.uri:
        # The resumed run's own store: its run was left RUNNING if its driver was killed.
        tracking.mark_dead_runs_in_run_dir(Path(resume_from).parent.parent)
    name = f"{cfg.run.name}-{run_stamp()}-{os.getpid()}"
    run_dir = Path(cfg.run.run_dir or Path(cfg.run.root) / name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    # The project's one MLflow store (env vars first); a resume continues its run's MLflow run.
    sink = tracking.make_sink(cfg, run_dir, name,
                              resume_dir=Path(resume_from).parent.parent if resume_from else None)
    sink.log_params(flatten(to_dict(cfg)))
    sink.log_inputs(tracking.data_files(cfg))  # the training and evaluation files, as the run's MLflow inputs
    # A continued MLflow run keeps its first config at the top; each resume's beside it.
    sink.log_artifact(str(run_dir / "config.yaml"), f"resumes/{name}" if getattr(sink, "resumed", False) else None)
    log.info("run directory %s (MLflow run %s)", run_dir, sink.run_id)
    return Run(cfg, run_dir, sink, resume_from=resume_from)



def world_of(cfg: Config):
    """The run's synthetic world (built once per driver process)."""
    return _build_world(cfg.world)


@functools.lru_cache(maxsize=2)
def _build_world(world_cfg):
    """The world is a pure function of its (frozen, hashable) config: build it once per driver."""
    from sonar.actors.world import build_world

    return build_world(world_cfg)
