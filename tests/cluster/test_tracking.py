import os
import signal

import pytest

from cluster.tracking import _atomic_write


def test_interrupt_during_an_mlflow_write_is_deferred_until_it_finishes():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with _atomic_write():
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-write
            done.append("write completed")
    assert done == ["write completed"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
