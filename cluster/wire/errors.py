"""Faults whose message is the whole story: ``RunFault``.

A run that ends on one of these says so in one line (``sonar train``: ``sonar: run failed: <message>``,
exit 1), with the traceback in the run directory's ``error.log``, not on the terminal: the message
already names the role, the deadline or the path and what to do. Every role raises them (a learner's
error reaches the driver as Ray's ``RayTaskError``, which is also an instance of its cause's class; the
cause is its ``cause``), so the class lives with the wires, which every room may import.
"""
from __future__ import annotations


class RunFault(RuntimeError):
    """A fault of a role or a resource, named in the message (``WorkerFailed``, ``LearnerStarved``,
    ``ReplayUnresponsive``, ``ReplicaFailed``, ``CheckpointWriteError``)."""


class RoleUnresponsive(RunFault):
    """A role (the learner, the replay queue) did not answer a driver call within its deadline."""


class ReplayUnresponsive(RoleUnresponsive):
    """The replay queue did not answer within its deadline (a stopped or deadlocked process)."""


def one_line(e: BaseException) -> str:
    """The fault's own message on one line: a ``RayTaskError``'s cause's, not Ray's traceback."""
    cause = getattr(e, "cause", None)
    return " ".join(str(cause if isinstance(cause, BaseException) else e).split())
