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
