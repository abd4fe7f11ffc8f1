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
from dataclasses import dataclass, field
from pathlib import Path

from sonar.cluster.driver import tracking
from sonar.cluster.wire.config import Config, flatten, to_dict, to_yaml

log = logging.getLogger("sonar")

@dataclass
class Run:
    cfg: Config
    dir: Path
    sink: tracking.Sink
    step: int = 0
    t0: float = field(default_factory=time.monotonic)
    results: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    finished: bool = False

    def log(self, metrics: dict) -> None:
        self.sink.log_metrics(metrics, step=self.step)
        self.history.append({"step": self.step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})

    def finish(self, status: str) -> None:
        if not self.finished:
            self.finished = True
            (self.dir / "metrics.jsonl").write_text("\n".join(json.dumps(h) for h in self.history) + "\n")
            self.sink.finish(status)


def start_run(cfg: Config) -> Run:
    name = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = Path(cfg.run.run_dir or Path(cfg.run.root) / name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    sink = tracking.make_sink(cfg.tracking.enabled, run_dir, cfg.tracking.uri, cfg.tracking.experiment, name)
    sink.log_params(flatten(to_dict(cfg)))
    sink.log_artifact(str(run_dir / "config.yaml"))
    log.info("run directory %s (MLflow run %s)", run_dir, sink.run_id)
    return Run(cfg, run_dir, sink)



def world_of(cfg: Config):
    """The run's synthetic world (built once per driver process)."""
    return _build_world(cfg.world)


@functools.lru_cache(maxsize=2)
def _build_world(world_cfg):
    """The world is a pure function of its (frozen, hashable) config: build it once per driver."""
    from sonar.actors.world import build_world

    return build_world(world_cfg)
