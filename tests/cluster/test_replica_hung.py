"""Issue 54, finding 3: a hung (not dead) retrieval replica (SIGSTOP) stalled training without bound: the
driver counted a silent replica as coming back, and its stats call had no deadline. Now a replica silent
for ``replica_pool.SILENT_CHECKS`` health check(s) in a row is killed and replaced like a dead one, and the run
finishes. The stop lands after an RL step (``Hooks.on_step``): no sleeps."""
import os
import signal

import pytest

from tests.cluster.test_replica_replaced import _cfg

pytestmark = [pytest.mark.slow, pytest.mark.ray]


class StopReplica:
    """After RL step 2 of stage 1: SIGSTOP replica 0's process (alive, silent)."""

    def __init__(self):
        self.pid = self.stopped = None

    def __call__(self, roles, run, stage_index, steps):
        import ray

        if stage_index == 1 and steps == 2 and self.pid is None:
            self.stopped = roles.retrieval[0]._actor_id.hex()
            self.pid = ray.get(roles.retrieval[0].__ray_call__.remote(lambda self: os.getpid()), timeout=120)
            os.kill(self.pid, signal.SIGSTOP)
        return False


def test_a_hung_replica_is_replaced_and_the_run_finishes(tmp_path, shared_ray):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks

    import psutil

    hook = StopReplica()
    try:
        summary = train(_cfg(tmp_path, "cluster.max_replica_replacements=1", "cluster.health_timeout_s=15",
                             "retrieval.timeout_s=5"), Hooks(on_step=hook))
        # the stopped process itself is gone (killed by pid on its node: Ray's kill never reaches a stopped
        # actor, whose process then keeps its CPU slot from the replacement)
        gone = not psutil.pid_exists(hook.pid) or psutil.Process(hook.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if hook.pid is not None:
            try:
                os.kill(hook.pid, signal.SIGCONT)  # if it still exists
            except ProcessLookupError:
                pass
    assert gone, f"the stopped replica's process {hook.pid} is still there"
    assert hook.pid is not None, "the hook did not run at RL step 2"
    assert summary["faults"]["replica_replacements"] == 1
    assert summary["replay"]["balanced"] and summary["em_after_search"] is not None
