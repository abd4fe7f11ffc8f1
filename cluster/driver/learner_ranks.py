"""Starting the learner: ``learner.num_ranks`` DeepSpeed ranks in one Ray placement group (in colocated
placement on GPUs, each bundle is a GPU shared with one rollout worker, which the pool starts there).

One bundle per rank ({CPU: learner.num_cpus, GPU: learner.num_gpus} plus ``cluster.role_resources.learner``),
placed by ``learner.placement_strategy`` (STRICT_PACK: one node). The driver starts rank 0 in bundle 0;
rank 0 binds the ranks' store and starts ranks 1.. in the other bundles (``learner.worker.Learner``), so
they share its fate. The driver talks to rank 0 only; collective calls fan out from there."""
from __future__ import annotations

from sonar.cluster.wire.config import Config
from sonar.cluster.wire.resolved import colocated_on_gpu, ray_gpus


def learner_bundles(cfg: Config, extra: dict | None = None) -> list[dict]:
    """The placement group's bundles, one per rank. Colocated placement on GPUs: each bundle is the GPU the
    rank shares with rollout worker i, and holds that worker's CPUs too (``resolved.ray_gpus``)."""
    L = cfg.learner
    if colocated_on_gpu(cfg):
        bundle = {"CPU": float(L.num_cpus + cfg.rollout.num_cpus_per_worker), "GPU": 1.0, **(extra or {})}
    else:
        bundle = {"CPU": float(L.num_cpus), **({"GPU": float(L.num_gpus)} if L.num_gpus > 0 else {}), **(extra or {})}
    return [dict(bundle) for _ in range(L.num_ranks)]


def needs_group(cfg: Config) -> bool:
    """Whether the learner starts in a placement group: several ranks, or colocated placement on GPUs (the
    rollout workers go into its bundles)."""
    return cfg.learner.num_ranks > 1 or colocated_on_gpu(cfg)


def start_learner(cfg: Config, policy: str, resources: dict | None = None):
    """(rank 0's actor handle, placement group or None). One rank: a plain actor, as before."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from sonar.learner.worker import Learner

    L = cfg.learner
    opts = dict(num_cpus=L.num_cpus, num_gpus=ray_gpus(cfg, "learner"), resources=resources)
    if not needs_group(cfg):
        return ray.remote(Learner).options(**opts).remote(cfg, policy), None
    pg = ray.util.placement_group(learner_bundles(cfg, resources), strategy=L.placement_strategy,
                                  name=f"sonar-learner-{id(cfg):x}")
    try:
        ray.get(pg.ready(), timeout=cfg.cluster.step_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"learner.num_ranks={L.num_ranks} ranks ({learner_bundles(cfg, resources)[0]} each, "
            f"learner.placement_strategy={L.placement_strategy!r}) could not be placed within "
            f"cluster.step_timeout_s={cfg.cluster.step_timeout_s}s; available {ray.available_resources()}") from None
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    learner = ray.remote(Learner).options(**opts, scheduling_strategy=strategy).remote(cfg, policy, placement_group=pg)
    return learner, pg


def remove_learner_group(pg) -> None:
    """Remove the learner's placement group (its ranks die with it); None: nothing to do."""
    if pg is None:
        return
    import ray

    try:
        ray.util.remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - Ray gone already
        pass
