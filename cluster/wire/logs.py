"""The one timestamp format of everything Sonar writes to a log, and the one stamp of a run's folder name.

A log line reads ``2026-12-02 18:33:03 INFO sonar: ...`` whoever configured the logger: Sonar's own
(``sonar train``/``eval``/``index``, the benchmarks) through :func:`configure_logging`, and MLflow's,
vLLM's and DeepSpeed's loggers, which install their own handlers with their own date formats (MLflow
``2026/12/02 18:33:03``, vLLM ``12-02 18:33:03``, DeepSpeed ``2026-12-02 18:33:03,123``), through
:func:`restamp` once they are imported (DeepSpeed's by the learner, ``learner/deepspeed_config.py``). Ray's own lines
(``ray.*`` loggers) use Python's default ``2026-12-02 18:33:03,123``, the same fields with milliseconds;
:func:`restamp` aligns those too where this process owns them (the driver). Not reached: the processes
vLLM itself spawns (its engine core) configure their logging at their own import and keep vLLM's date,
and lines Ray's workers print are forwarded as they were written.

A folder name cannot hold ``:`` on every file system, so run and eval directories use :data:`RUN_STAMP`
(``20261202-183303``), which sorts the same way.
"""
from __future__ import annotations

import logging
import time

LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"
"""The date of every log line Sonar writes (local time, ISO-8601 with a space)."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Sonar's log line: date, level, logger name, message."""
RUN_STAMP = "%Y%m%d-%H%M%S"
"""The stamp in run and eval directory names (``<preset>-<stamp>-<pid>``, ``eval-<stamp>``): filename-safe."""
FOREIGN_LOGGERS = ("mlflow", "vllm", "ray")
"""Libraries that install their own handlers (with their own date formats) on these loggers."""


def run_stamp(t: float | None = None) -> str:
    """``t`` (default: now, local time) as :data:`RUN_STAMP`."""
    return time.strftime(RUN_STAMP, time.localtime(t))


def configure_logging(level: int = logging.INFO) -> None:
    """INFO lines in :data:`LOG_FORMAT` on stderr (``logging.basicConfig``: a handler already installed
    by the caller, e.g. pytest's, is kept), and the libraries already imported restamped."""
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=LOG_DATEFMT)
    restamp()


def restamp(names: tuple[str, ...] = FOREIGN_LOGGERS) -> None:
    """Give the handlers of the loggers ``names`` :data:`LOG_DATEFMT` (their line layout is kept: vLLM's
    names its process, MLflow's its logger). Call after importing the library, which installs its
    handlers at import. ``Formatter.formatTime`` reads ``datefmt`` on every record (and appends Python's
    default milliseconds only when there is none), so setting it is enough."""
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if handler.formatter is not None:
                handler.formatter.datefmt = LOG_DATEFMT
