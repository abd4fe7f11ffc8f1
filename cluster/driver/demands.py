"""What a run asks Ray for, role by role: the one description of the roles' resource requests.

The driver starts the roles with exactly these amounts (``roles.start_roles``, ``learner_ranks``); the
elastic pool asks the autoscaler for them (``pool.wanted_bundles``); the cluster-file tests feed them to
Ray's autoscaler node selection to check that a cluster file can host a preset. Pure: no Ray."""
from __future__ import annotations

from dataclasses import dataclass, field

from sonar.cluster.driver.learner_ranks import learner_bundles, needs_group
from sonar.cluster.wire.config import Config, pool_bounds
from sonar.cluster.wire.resolved import colocated_on_gpu


def _bundle(cpu: float, gpu: float, extra: dict | None) -> dict:
    b = {"CPU": float(cpu), "GPU": float(gpu), **{k: float(v) for k, v in (extra or {}).items()}}
    return {k: v for k, v in b.items() if v > 0}


@dataclass(frozen=True)
class Demands:
    """``learner_group``: (placement strategy, one bundle per rank) when ``learner.num_ranks`` > 1, else
    None and the learner's bundle is the first of ``actors``; ``actors``: the plain actors' bundles
    (learner with one rank, each rollout worker, each retrieval replica; zero amounts left out, an
    actor that asks for nothing is left out)."""

    learner_group: tuple[str, list[dict]] | None
    actors: list[dict] = field(default_factory=list)

    def flat(self) -> list[dict]:
        """Every bundle, the learner ranks' first (what ``request_resources`` is asked for)."""
        return (list(self.learner_group[1]) if self.learner_group else []) + list(self.actors)


def role_resources(cfg: Config, role: str) -> dict | None:
    """The extra Ray resources ``cluster.role_resources`` gives ``role`` (None: none), e.g. a custom
    resource only one node type declares, so the role lands there."""
    return dict(cfg.cluster.role_resources.get(role, {})) or None


def role_demands(cfg: Config, workers: int | None = None) -> Demands:
    """The bundles of the roles with ``workers`` rollout workers (None: ``rollout.max_workers``, the
    largest pool the run can grow to)."""
    extra = cfg.cluster.role_resources
    L, r = cfg.learner, cfg.rollout
    n = pool_bounds(cfg)[1] if workers is None else workers
    learner = _bundle(L.num_cpus, L.num_gpus, extra.get("learner"))
    group = (L.placement_strategy, learner_bundles(cfg, extra.get("learner"))) if needs_group(cfg) else None
    actors = [] if group else [learner]
    if not colocated_on_gpu(cfg):  # colocated on GPUs: each worker is in its learner rank's bundle
        actors += [_bundle(r.num_cpus_per_worker, r.num_gpus_per_worker, extra.get("rollout")) for _ in range(n)]
    actors += [_bundle(cfg.retrieval.num_cpus_per_replica, 0.0, extra.get("retrieval"))
               for _ in range(cfg.retrieval.replicas)]
    return Demands(group, [b for b in actors if b])


def total(demands: Demands, resource: str) -> float:
    """The sum of ``resource`` over every bundle."""
    return sum(b.get(resource, 0.0) for b in demands.flat())
