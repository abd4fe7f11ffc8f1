"""Nothing of a local Ray node outlives it: a watchdog for the processes the driver's node started.

A driver that starts its own Ray node (``roles.init_ray``, ``address="local"``) owns its processes. Ray
ties the GCS and the raylet to the driver, but the raylet's children (the dashboard agent and the
runtime-env agent) are not tied to the raylet: a driver killed with SIGKILL (``ray job stop`` past its
grace, the OOM killer, ``kill -9``) left both running, each holding ports and memory, until someone
found them by name. So ``start_reaper`` starts a small process beside the node that

- remembers every descendant of the node's processes (``roots``: the driver's children Ray started),
  by pid and creation time, looking every ``POLL_S`` (an agent is born seconds after its raylet);
- and once the driver is gone (its end of a pipe closes: the kernel closes it on any death) or the node
  is (every root has exited: ``ray.shutdown``), SIGKILLs the remembered processes still alive, checked
  by pid *and* creation time (a reused pid is someone else's), and exits.

It kills only what the driver's own node started, never by name (the guide's rule).
"""
from __future__ import annotations

import os
import select
import subprocess
import sys

POLL_S = 2.0
"""Seconds between two looks at the node's process tree (the pipe's close wakes the watchdog at once)."""


def start_reaper(roots: list[int]) -> subprocess.Popen | None:
    """Start the watchdog for the node whose top processes are ``roots`` (pids); the returned handle's
    ``stdin`` is the pipe whose close (this process's death) ends the node. None without roots."""
    if not roots:
        return None
    return subprocess.Popen([sys.executable, "-m", "sonar.cluster.driver.reaper", *map(str, roots)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


def _key(p) -> tuple[int, float] | None:
    try:
        return p.pid, p.create_time()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return None


def snapshot(roots: list, known: dict[int, float]) -> None:
    """Add every live root and descendant of ``roots`` (``psutil.Process``) to ``known`` {pid: create time}."""
    import psutil

    for r in roots:
        try:
            procs = [r, *r.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            k = _key(p)
            if k is not None:
                known.setdefault(*k)


def kill_if_same(pid: int, created: float) -> bool:
    """SIGKILL ``pid`` if it is still the process created at ``created`` (a reused pid is someone else's) and
    not already a zombie; returns whether it was."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.create_time() != created or p.status() == psutil.STATUS_ZOMBIE:
            return False
        p.kill()
        return True
    except psutil.NoSuchProcess:
        return False


def kill_process_on(node_id: str, pid: int, created: float, timeout_s: float) -> bool:
    """SIGKILL process ``pid`` created at ``created`` on Ray node ``node_id`` (a zero-CPU task pinned
    there), as its own health answer gave them: never a later process that reuses the pid. A SIGSTOPped
    actor never answers Ray's kill request, and its process keeps its resources (measured: the replacement
    replica of a stopped one waited for its CPU slot until its own start timeout). Returns whether it was
    alive."""
    import logging

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(kill_if_same).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    try:
        return bool(ray.get(task.remote(pid, created), timeout=timeout_s))
    except Exception as e:  # noqa: BLE001 - the node is gone too: nothing left to free there
        logging.getLogger("sonar").warning("could not kill pid %d on node %s: %s: %s", pid, node_id[:12], type(e).__name__, e)
        return False


def reap(known: dict[int, float]) -> list[int]:
    """SIGKILL every remembered process still alive with its remembered creation time; returns their pids."""
    return [pid for pid, created in known.items() if kill_if_same(pid, created)]


def main(argv: list[str]) -> int:
    import psutil

    roots = []
    for a in argv:
        try:
            roots.append(psutil.Process(int(a)))
        except psutil.NoSuchProcess:
            pass
    known: dict[int, float] = {}
    while True:
        snapshot(roots, known)
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # EOF: the driver is gone
        if not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in roots):
            break  # the node was shut down: what it left behind goes too
    snapshot(roots, known)
    reap(known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
