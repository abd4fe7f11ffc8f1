"""start_local_node: Ray's fixed 30 s wait for the raylet is retried, and a failed attempt's processes go.

No Ray: the "node" is a child process that the start callable spawns, as ray.init's GCS and raylet are
children of the process that calls it."""
import subprocess

import psutil
import pytest

from sonar.cluster.driver.roles import NODE_START_TIMEOUT, start_local_node

RAY_ERROR = ("The current node timed out during startup. This could happen because some of the raylet "
             "failed to startup or the GCS has become overloaded.")  # ray/_private/node.py, Ray 2.60


def _spawn(kept: list) -> subprocess.Popen:
    p = subprocess.Popen(["cat"], stdin=subprocess.PIPE)  # lives until killed (or its stdin closes)
    kept.append(p)
    return p


def test_the_error_text_is_rays():
    assert NODE_START_TIMEOUT in RAY_ERROR


def test_a_timed_out_start_is_retried_after_its_processes_are_killed():
    kept: list[subprocess.Popen] = []
    calls = []

    def start():
        calls.append(_spawn(kept))
        if len(calls) < 3:
            raise Exception(RAY_ERROR)
        return "node"

    try:
        assert start_local_node(start, attempts=3) == "node"
        assert len(calls) == 3
        # The two failed attempts' processes were killed and reaped (by start_local_node's wait, so Popen
        # sees them gone), the successful one's is left running for its owner.
        assert [p.poll() is not None for p in calls[:2]] == [True, True]
        assert calls[2].poll() is None and psutil.pid_exists(calls[2].pid)
    finally:
        for p in kept:
            p.kill()
            p.wait()


def test_other_errors_and_the_last_timeout_are_raised_and_keep_processes_that_were_there_before():
    kept: list[subprocess.Popen] = []
    try:
        older = _spawn(kept)  # this process's child from before: never a failed attempt's

        def fails(msg):
            def start():
                _spawn(kept)
                raise RuntimeError(msg)
            return start

        with pytest.raises(RuntimeError, match="port in use"):
            start_local_node(fails("port in use"), attempts=3)
        assert len(kept) == 2 and kept[1].poll() is None  # not a timeout: one attempt, nothing killed
        with pytest.raises(RuntimeError, match="timed out during startup"):
            start_local_node(fails(RAY_ERROR), attempts=2)
        assert len(kept) == 4 and kept[2].poll() is not None  # the first try's, killed before the second
        assert older.poll() is None
    finally:
        for p in kept:
            p.kill()
            p.wait()


SPAWNER = "while read line; do sleep 3600 & echo $!; done"
"""A node (a shell, not Python: the edit loop starts no Python process): starts a worker (its child) for
each line it reads, and prints the worker's pid."""


def test_a_failed_attempts_children_go_with_their_own_children_and_an_older_childs_stay():
    """A raylet's workers are its children: they go with it. A node added before (an older child) keeps
    the processes it starts meanwhile, as a head's raylet starts workers while another node is added."""
    kept: list[subprocess.Popen] = []
    workers: list[psutil.Process] = []

    def node() -> subprocess.Popen:
        p = subprocess.Popen(["sh", "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        kept.append(p)
        return p

    def worker_of(p: subprocess.Popen) -> psutil.Process:
        p.stdin.write("start a worker\n")
        p.stdin.flush()
        workers.append(psutil.Process(int(p.stdout.readline())))
        return workers[-1]

    def gone(w: psutil.Process) -> bool:
        try:
            return w.status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by its dead parent's init
        except psutil.NoSuchProcess:
            return True
    try:
        older = node()
        calls = []

        def start():
            calls.append(node())
            worker_of(calls[-1])
            if len(calls) == 1:
                worker_of(older)  # the older node starts a worker while this attempt runs
                raise Exception(RAY_ERROR)
        start_local_node(start, attempts=2)
        failed_worker, old_worker, new_worker = workers
        assert calls[0].poll() is not None and gone(failed_worker)
        assert older.poll() is None and not gone(old_worker)
        assert calls[1].poll() is None and not gone(new_worker)
    finally:
        for w in workers:
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass
        for p in kept:
            p.kill()
            p.wait()


def test_a_start_timeout_says_whether_the_cluster_lacks_the_resources_or_the_roles_are_still_starting():
    """In a loaded run the learner and two workers took over 90 s to start on a cluster with CPUs to
    spare, and the message said the cluster lacked them: it now tells the two cases apart."""
    from sonar.cluster.driver.roles import start_timeout_message
    from sonar.cluster.wire.config import load_config

    cfg = load_config([], ["rollout.num_workers=2", "learner.num_cpus=1", "rollout.num_cpus_per_worker=1",
                           "retrieval.replicas=1", "retrieval.num_cpus_per_replica=1", "cluster.step_timeout_s=90"])
    slow = start_timeout_message(cfg, {"CPU": 8.0}, {"CPU": 4.0})
    assert slow.startswith("the learner and 2 rollout workers did not start within cluster.step_timeout_s=90.0s: "
                           "the cluster has the CPUs/GPUs they ask for")
    assert "4 CPUs and 0 GPUs" in slow and "8 CPUs and 0 GPUs in all" in slow and "{'CPU': 4.0}" in slow
    assert "still starting" in slow and "raise cluster.step_timeout_s" in slow
    short = start_timeout_message(cfg, {"CPU": 3.0}, {"CPU": 0.0})
    assert "the cluster has 3 CPUs and 0 GPUs in all, fewer than they ask for" in short and "still starting" not in short
    gpus = load_config([], ["rollout.num_workers=2", "rollout.num_gpus_per_worker=1", "learner.num_gpus=1"])
    assert "fewer than they ask for" in start_timeout_message(gpus, {"CPU": 64.0, "GPU": 2.0}, {})
