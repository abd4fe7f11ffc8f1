"""A SIGKILLed driver leaves no Ray process behind (issue: a probe found the dashboard and runtime-env
agents of a killed driver's node still running). The driver here starts its node with ``roles.init_ray``,
as ``sonar train`` does, the test waits until the node's agents are up (they start seconds after the
raylet), SIGKILLs the driver by the handle it started, and waits for every process of the node to be
gone: the watchdog (``cluster/driver/reaper.py``) kills what Ray left."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.ray  # it starts a Ray node (in the driver it spawns)

DRIVER = textwrap.dedent("""
    import os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from sonar.cluster.driver.roles import init_ray
    from sonar.cluster.wire.config import load_config
    init_ray(load_config([], ["cluster.num_cpus=1"]))  # the driver's own private node, as `sonar train` starts it
    print("up", flush=True)
    sys.stdin.read()  # until it is killed
""")


def _gone(p) -> bool:
    import psutil

    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_sigkilled_driver_leaves_no_ray_process_behind():
    import psutil

    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert driver.stdout.readline().strip() == "up"
        me = psutil.Process(driver.pid)

        def agents():
            return [p for p in me.children(recursive=True) if "Agent" in " ".join(p.cmdline() or [p.name()])]

        wait_until(lambda: len(agents()) >= 2, 180, "the node's dashboard and runtime-env agents")
        node = me.children(recursive=True)
        assert any("raylet" in p.name() for p in node) and len(agents()) >= 2
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(60)
        wait_until(lambda: all(_gone(p) for p in node), 120,
                   lambda: "every process of the killed driver's node to be gone: "
                   + ", ".join(f"{p.pid} {p.name()}" for p in node if not _gone(p)))
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(60)
