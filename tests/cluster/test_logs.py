"""The one log date (cluster/wire/logs.py): MLflow's own handler restamped, the run-folder stamp. The
CLI's own lines are checked end to end in tests/test_eval_cli.py."""
import logging
import re
import time

from sonar.cluster.wire.logs import LOG_DATEFMT, RUN_STAMP, restamp, run_stamp

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def test_mlflows_handler_writes_sonars_date_after_restamp():
    import mlflow  # noqa: F401 - installs its handler on the "mlflow" logger

    # MLflow's own handler, picked by its formatter: a test run earlier in this process may have added
    # others to the "mlflow" logger (the logger is process-wide), so "the only handler" is not assumed.
    (handler,) = [h for h in logging.getLogger("mlflow").handlers
                  if type(h.formatter).__module__ == "mlflow.utils.logging_utils"]
    record = logging.LogRecord("mlflow.store", logging.INFO, __file__, 1, "hello", None, None)
    handler.formatter.datefmt = "%Y/%m/%d %H:%M:%S"  # MLflow's own (logging_utils.LOGGING_DATETIME_FORMAT)
    assert re.match(r"\d{4}/\d\d/\d\d ", handler.format(record))
    restamp(("mlflow",))
    assert handler.formatter.datefmt == LOG_DATEFMT
    assert re.fullmatch(rf"{STAMP} INFO mlflow\.store: hello", handler.format(record)), handler.format(record)


def test_run_stamp_is_filename_safe_and_sorts_by_time():
    t = time.mktime((2026, 12, 2, 18, 33, 3, 0, 0, -1))
    assert run_stamp(t) == "20261202-183303" == time.strftime(RUN_STAMP, time.localtime(t))
    assert run_stamp(t) < run_stamp(t + 1) and not set(run_stamp(t)) & set(':/\\ ')
