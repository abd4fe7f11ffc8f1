"""The retrieval replicas' only owner, as ``RolloutPool`` is the rollout workers': their handles, the health
check with its deadline, the replacement of a replica that is dead for good or hung, and the service-side
stats. The driver calls them only through it.

Fault rules (cluster/README.md, "Faults"): Ray restarts a dead replica under the same handle
(``cluster.max_replica_restarts``), so the workers' clients keep working once it answers again; past that,
the replica is replaced by a new actor in its slot (``cluster.max_replica_replacements`` per slot), whose
handle every worker's client gets (``on_replace``: ``RolloutPool.replace_replica``); a replica silent for
``SILENT_CHECKS`` health checks in a row is hung and replaced the same way, its stopped process killed by
pid on its node first; when every replica is gone for good the run fails with ``ReplicaFailed``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from sonar.cluster.driver.reaper import kill_process_on
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config
from sonar.cluster.wire.errors import RunFault

log = logging.getLogger("sonar")


class ReplicaFailed(RunFault):
    """Every retrieval replica is dead and their replacements are used up; the message names them."""


SILENT_CHECKS = 1
"""Health checks in a row a retrieval replica may let pass unanswered before it is replaced as hung. One:
a check waits ``cluster.health_timeout_s`` for a call the replica answers at once (an async method, no
work), so a replica silent that long is hung, and a hang then costs one health deadline plus the
replacement's start (two cost a chaos run's learner 132 s at the default 60 s)."""


class ReplicaPool:
    """The retrieval replicas of a run. ``handles[i]`` is slot i's actor (the list the rollout pool's new
    workers are started with: a replacement is seen there too). ``start(n)`` starts ``n`` replicas and
    returns their handles once they answer (``roles.start_replicas``)."""

    def __init__(self, cfg: Config, handles: list, start: Callable[[int], list],
                 on_replace: Callable[[int, Any], None] | None = None):
        self.cfg = cfg
        self.handles = handles
        self._start = start
        self.on_replace = on_replace
        """Told every replacement (slot, new handle): the rollout pool hands it to every worker's client."""
        self.replacements: dict[int, int] = {}
        """Slot -> replacements so far (bounded by ``cluster.max_replica_replacements``)."""
        self.silent: dict[int, int] = {}
        """Slot -> health checks in a row it let pass without an answer."""
        self.procs: dict[int, tuple[str, int, float]] = {}
        """Slot -> (node id, pid, creation time) from its last health answer: a hung replica's process is killed
        there (``kill_process_on``), since Ray cannot stop a stopped actor's process itself."""

    def ping(self) -> tuple[float, list]:
        """Send every replica its health ping now (``health()``: a cheap actor call); ``check`` reads the
        answers. The driver sends them before it waits for the workers' health, so both are one round."""
        return time.monotonic(), [h.health.remote() for h in self.handles]

    def check(self, pings: tuple[float, list] | None = None) -> dict:
        """Read every replica's ping (``pings`` from ``ping``, else sent now) under one shared deadline,
        ``cluster.health_timeout_s`` from when they were sent. A replica Ray is restarting (``ActorUnavailableError``), or that is
        silent, counts as unhealthy for now: the workers' clients wait for it (``cluster.retrieval_wait_s``).
        One gone for good is replaced (``replace``); one past its replacements is reported, and when every
        replica is gone the run fails with ``ReplicaFailed`` naming them. Returns the healthy count and the
        replacements so far, as metrics."""
        import ray

        cfg = self.cfg
        sent, refs = pings if pings is not None else self.ping()
        left = max(0.0, cfg.cluster.health_timeout_s - (time.monotonic() - sent))
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=left)[0])
        healthy, gone = 0, []
        for i, ref in enumerate(refs):
            if ref not in ready:
                silent = self.silent[i] = self.silent.get(i, 0) + 1
                if silent >= SILENT_CHECKS and self.replacements.get(i, 0) < cfg.cluster.max_replica_replacements:
                    self.replace(i, f"retrieval replica {i}: no answer to {silent} health checks in a row "
                                    f"(cluster.health_timeout_s={cfg.cluster.health_timeout_s} each): hung", hung=True)
                    self.silent[i] = 0
                    healthy += 1
                continue
            self.silent[i] = 0
            try:
                answer = ray.get(ref)
                healthy += bool(answer.get("ok"))
                if answer.get("node") and answer.get("pid") and answer.get("created"):
                    self.procs[i] = (answer["node"], int(answer["pid"]), float(answer["created"]))
            except ray.exceptions.ActorDiedError as e:
                if not self.dead_for_good(self.handles[i]):
                    continue  # it died in that call and Ray restarts it: it comes back under the same handle
                err = f"retrieval replica {i}: {type(e).__name__}"
                if self.replacements.get(i, 0) < cfg.cluster.max_replica_replacements:
                    self.replace(i, err)
                    healthy += 1
                else:
                    gone.append(err + f" (cluster.max_replica_replacements={cfg.cluster.max_replica_replacements} "
                                      "used up)")
            except ray.exceptions.RayActorError:  # restarting (ActorUnavailableError): it comes back
                pass
        if gone and len(gone) == len(refs):
            raise ReplicaFailed(f"every retrieval replica is dead and cluster.max_replica_restarts="
                                f"{cfg.cluster.max_replica_restarts} is used up: {'; '.join(gone)}")
        if gone:
            log.warning("retrieval running degraded: %s", "; ".join(gone))
        return {K.RETRIEVAL_REPLICAS_HEALTHY: float(healthy),
                K.RETRIEVAL_REPLICAS_REPLACED: float(sum(self.replacements.values()))}

    def dead_for_good(self, handle) -> bool:
        """After a ping failed with ``ActorDiedError``: whether the replica is dead and Ray will not restart
        it. A process that dies while a call runs fails that call with ``ActorDiedError`` even when Ray then
        restarts it; a second call to a restarting actor waits for the restart (answered, or silent within
        ``cluster.health_timeout_s``), while one to an actor that is dead for good fails at once."""
        import ray

        try:
            ray.get(handle.health.remote(), timeout=self.cfg.cluster.health_timeout_s)
        except ray.exceptions.ActorDiedError:
            return True
        except Exception:  # noqa: BLE001 - restarting, or slow: not gone
            return False
        return False

    def replace(self, i: int, err: str, hung: bool = False) -> None:
        """Slot ``i``'s replica is dead for good (or hung): start a new actor there (with its own Ray restarts)
        and hand its handle on (``on_replace``: every rollout worker's retrieval clients; a worker that died
        meanwhile is restarted with it). ``handles`` holds it from now on, so workers started later and the
        stats calls use it too."""
        import ray

        cfg = self.cfg
        self.replacements[i] = self.replacements.get(i, 0) + 1
        log.warning("replacing retrieval replica %d (replacement %d of cluster.max_replica_replacements=%d): %s",
                    i, self.replacements[i], cfg.cluster.max_replica_replacements, err)
        proc = self.procs.pop(i, None)
        if hung and proc is not None:  # a stopped process keeps its CPU slot: Ray's kill does not reach it
            kill_process_on(*proc, timeout_s=cfg.cluster.health_timeout_s)
        try:
            ray.kill(self.handles[i], no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass
        new = self._start(1)[0]  # waits until it answers
        self.handles[i] = new
        if self.on_replace is not None:
            self.on_replace(i, new)

    def stats(self) -> list[dict]:
        """Each answering replica's service stats (``RetrievalServer.stats``), one shared deadline
        (``cluster.health_timeout_s``): a hung, dead or restarting replica has none this step."""
        import ray

        refs = [h.stats.remote() for h in self.handles]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=self.cfg.cluster.health_timeout_s)[0])
        out = []
        for ref in refs:
            if ref not in ready:
                continue
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                continue
        return out

    def kill(self) -> None:
        """Kill every replica, for good (the roles end; Ray stays up)."""
        import ray

        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass
