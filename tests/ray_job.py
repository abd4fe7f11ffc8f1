"""Ray for a module of tests that drive actors of their own (fakes, gates): a job on the session's cluster
(``shared_ray``, tests/conftest.py) when there is one, else a private 2-CPU cluster on 127.0.0.1. Joining
costs about 0.5 s where starting a cluster costs 5-9 s on 2 cores; the job's end (``ray.shutdown``) kills
the module's actors, so no other module sees them."""
from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def ray_for_module(module_name: str, shared_address: str | None):
    """Yields ``ray``, initialised. The module's own classes travel into the actors by value: pytest names a
    test module after the checkout's folder (the repository root is itself a package), which Ray's worker
    processes cannot import. A Ray the caller already initialised is used and left as it was."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[module_name])
    started = False
    if not ray.is_initialized():
        if shared_address:
            ray.init(address=shared_address, log_to_driver=False, configure_logging=False)
        else:
            from sonar.cluster.driver.roles import start_local_node  # retried past Ray's fixed 30 s node-start wait

            start_local_node(lambda: ray.init(address="local", num_cpus=2, include_dashboard=False,
                                              _node_ip_address="127.0.0.1", log_to_driver=False,
                                              configure_logging=False))
        started = True
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
