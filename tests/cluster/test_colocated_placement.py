"""Colocated placement on GPUs, as Ray schedules it: learner rank i and rollout worker i land on the same
GPU (bundle i of the learner's placement group, each asking for half of it), and different ranks on
different GPUs. Run on a node of the session's cluster that declares 2 GPUs (Ray's accounting needs no
device: it hands out GPU ids and sets CUDA_VISIBLE_DEVICES), with stand-in actors started with exactly
the options the driver computes (``learner_bundles``, ``resolved.ray_gpus``, ``worker_options``)."""
from __future__ import annotations

import pytest

from sonar.cluster.driver.demands import role_demands, total
from sonar.cluster.driver.learner_ranks import learner_bundles, needs_group
from sonar.cluster.driver.rollout_pool import worker_options
from sonar.cluster.wire.config import CONFIG_DIR, load_config
from sonar.cluster.wire.resolved import COLOCATED_GPU_SHARE, ray_gpus

GPU = ["cluster.placement=colocated", "cluster.mode=sync", "learner.num_gpus=1", "rollout.num_gpus_per_worker=1",
       "rollout.engine=vllm", "learner.num_ranks=2", "rollout.num_workers=2", "learner.num_cpus=1",
       "rollout.num_cpus_per_worker=1"]


def _cfg(*overrides):
    return load_config([CONFIG_DIR / "tiny.yaml"], [*GPU, *overrides])


def test_each_bundle_is_one_gpu_holding_a_rank_and_its_engine_and_ray_is_asked_for_the_gpus_once():
    cfg = _cfg()
    assert learner_bundles(cfg) == [{"CPU": 2.0, "GPU": 1.0}] * 2 and needs_group(cfg)
    assert ray_gpus(cfg, "learner") == ray_gpus(cfg, "rollout") == COLOCATED_GPU_SHARE
    d = role_demands(cfg)
    assert total(d, "GPU") == 2.0  # 2 GPUs in all, where split placement asks for 4
    split = load_config([CONFIG_DIR / "tiny.yaml"], ["learner.num_gpus=1", "rollout.num_gpus_per_worker=1",
                                                       "learner.num_ranks=2", "rollout.num_workers=2"])
    assert total(role_demands(split), "GPU") == 4.0 and ray_gpus(split, "rollout") == 1.0
    assert "scheduling_strategy" not in worker_options(split, 0)
    with pytest.raises(ValueError, match="no learner placement group was given"):
        worker_options(cfg, 0)


class _Probe:
    def gpus(self):
        import ray

        return ray.get_gpu_ids()


@pytest.mark.ray
def test_ray_puts_learner_rank_i_and_worker_i_on_the_same_gpu(shared_ray, ray_cluster):
    from sonar.cluster.driver.roles import start_local_node
    from tests.ray_job import ray_for_module

    if ray_cluster is None:
        pytest.skip("needs the session's cluster to add a GPU node to")
    node = start_local_node(lambda: ray_cluster.add_node(num_cpus=4, num_gpus=2, node_ip_address="127.0.0.1",
                                                         resources={"colocated_probe": 4}))
    try:
        with ray_for_module(__name__, shared_ray) as ray:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            cfg = _cfg("cluster.role_resources={learner: {colocated_probe: 1}}")
            pg = ray.util.placement_group(learner_bundles(cfg, {"colocated_probe": 1}), strategy="STRICT_PACK")
            ray.get(pg.ready(), timeout=120)
            probe = ray.remote(_Probe)
            ranks = [probe.options(num_cpus=cfg.learner.num_cpus, num_gpus=ray_gpus(cfg, "learner"),
                                   scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
                                   ).remote() for r in range(cfg.learner.num_ranks)]
            workers = [probe.options(**{**worker_options(cfg, i, pg), "resources": None}).remote()
                       for i in range(cfg.rollout.num_workers)]
            rank_gpus = ray.get([a.gpus.remote() for a in ranks], timeout=120)
            worker_gpus = ray.get([a.gpus.remote() for a in workers], timeout=120)
            assert rank_gpus == worker_gpus  # rank i and worker i share a device
            assert all(len(g) == 1 for g in rank_gpus) and len({g[0] for g in rank_gpus}) == 2  # one each
            ray.util.remove_placement_group(pg)
    finally:
        ray_cluster.remove_node(node)
