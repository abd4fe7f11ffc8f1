"""Colocated placement without Ray: what the config refuses (each refusal naming the fields), the phase
switch's order (cluster/driver/colocate.py) with fake roles, and a sleeping engine refusing to generate."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sonar.cluster.driver.colocate import Colocation
from sonar.cluster.driver.critical_path import StepClock
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import CONFIG_DIR, broadcast_backend, load_config

COLOCATED = ["cluster.placement=colocated", "cluster.mode=sync"]


def _tiny(*overrides: str):
    return load_config([CONFIG_DIR / "tiny.yaml"], [*COLOCATED, *overrides])


def test_tiny_colocated_loads_and_hands_over_through_shared_memory():
    cfg = _tiny()
    assert cfg.cluster.placement == "colocated" and broadcast_backend(cfg) == "shm"
    split = load_config([CONFIG_DIR / "tiny.yaml"], [])
    assert split.cluster.placement == "split" and broadcast_backend(split) == "gloo"


@pytest.mark.parametrize("overrides, match", [
    (["cluster.mode=async"], r"cluster.placement='colocated' with cluster.mode='async'.*cluster.mode='sync'"),
    (["learner.broadcast_every=2"], r"learner.broadcast_every=2.*set learner.broadcast_every=1"),
    (["rollout.min_workers=1", "rollout.max_workers=3"], r"an elastic pool.*needs cluster.mode='async'"),
    (["learner.dist_backend=nccl"], r"learner.dist_backend='nccl'.*handed over on the device"),
    (["learner.offload_while_generating=true"], r"learner.offload_while_generating=True with learner.zero_stage=0"),
])
def test_what_taking_turns_rules_out_is_refused_naming_the_fields(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config([CONFIG_DIR / "tiny.yaml"], [*COLOCATED[:1], *(["cluster.mode=sync"] if "cluster.mode=async"
                                                                   not in overrides else []), *overrides])


def test_offload_while_generating_needs_colocated_placement():
    with pytest.raises(ValueError, match=r"offload_while_generating=True needs cluster.placement='colocated'"):
        load_config([CONFIG_DIR / "tiny.yaml"], ["learner.offload_while_generating=true", "learner.zero_stage=1"])


@pytest.mark.parametrize("overrides, match", [
    (["learner.num_gpus=0.5", "rollout.num_gpus_per_worker=0.5"], r"learner.num_gpus=0.5 and rollout.num_gpus_per_worker=0.5"),
    (["rollout.tensor_parallel_size=2", "rollout.engine=vllm"], r"tensor_parallel_size=2"),
    (["rollout.num_workers=2", "learner.num_ranks=4"], r"rollout.num_workers=2 and learner.num_ranks=4.*rollout.num_workers=4"),
    (["rollout.engine=hf"], r"rollout.engine='hf'.*sleep mode"),
])
def test_on_gpus_each_learner_rank_shares_one_whole_gpu_with_one_vllm_engine(overrides, match):
    gpu = ["learner.num_gpus=1", "rollout.num_gpus_per_worker=1", "rollout.engine=vllm", "learner.num_ranks=2",
           "rollout.num_workers=2"]
    with pytest.raises(ValueError, match=match):
        load_config([CONFIG_DIR / "tiny.yaml"], [*COLOCATED, *gpu, *overrides])


class _Ref:
    def __init__(self, log, name, value):
        self.log, self.name, self.value = log, name, value


class _Method:
    def __init__(self, log, name, value):
        self.log, self.name, self.value = log, name, value

    def remote(self, *args):
        self.log.append(self.name)
        return _Ref(self.log, self.name, self.value)


class _Learner:
    def __init__(self, log):
        self.reload_states = _Method(log, "learner.reload", {"seconds": 0.0, "moved": False})
        self.offload_states = _Method(log, "learner.offload", {"seconds": 0.0, "moved": False})


class _Pool:
    def __init__(self, log, n=2):
        self.log, self.n = log, n

    def sleep(self, level):
        self.log.append(f"pool.sleep({level})")
        return [{"worker_id": i, "seconds": 0.0, "freed": i == 0} for i in range(self.n)]

    def wake(self, tags):
        self.log.append(f"pool.wake({','.join(tags)})")
        return [{"worker_id": i, "seconds": 0.0} for i in range(self.n)]

    def push(self):
        self.log.append("pool.push")
        return {K.WEIGHTS_SYNC_S: 0.5, K.WEIGHTS_GBPS: 1.0}


def _colocation(cfg, log):
    roles = dataclasses.make_dataclass("R", ["pool", "learner"])(_Pool(log), _Learner(log))
    return Colocation(cfg, roles, get=lambda ref, timeout: ref.value)


def test_engines_sleep_before_the_step_and_wake_around_the_hand_over_in_order():
    log: list[str] = []
    col = _colocation(_tiny("rollout.sleep_level=2"), log)
    clock = StepClock()
    with col.training(clock) as m:
        log.append("learner.rl_step")
    assert log == ["pool.sleep(2)", "learner.reload", "learner.rl_step", "pool.wake(weights)", "pool.push",
                   "learner.offload", "pool.wake(kv_cache)"]
    assert m[K.WEIGHTS_SYNC_S] == 0.5 and m[K.COLOCATE_FREED] == 1.0 and col.switches == 1
    for key in (K.COLOCATE_SLEEP_S, K.COLOCATE_RELOAD_S, K.COLOCATE_WAKE_S, K.COLOCATE_HANDOVER_S, K.COLOCATE_OFFLOAD_S):
        assert m[key] >= 0.0
    assert clock.parts["switch"] > 0.0 and clock.parts["push"] > 0.0


def test_a_failing_step_leaves_the_engines_asleep_and_split_placement_does_nothing():
    log: list[str] = []
    col = _colocation(_tiny(), log)
    with pytest.raises(RuntimeError, match="learner died"):
        with col.training(StepClock()):
            raise RuntimeError("learner died")
    assert log == ["pool.sleep(1)", "learner.reload"]  # no push from a learner that failed
    log.clear()
    split = _colocation(load_config([CONFIG_DIR / "tiny.yaml"], []), log)
    with split.training(StepClock()) as m:
        log.append("learner.rl_step")
    assert log == ["learner.rl_step"] and m == {} and not split.active


def test_a_sleeping_engine_refuses_to_generate_until_its_kv_cache_is_back():
    from sonar.actors.engine import SamplingParams
    from sonar.actors.worker import SwappingEngine

    class Inner:
        version = 0

        def generate(self, prompts, params, caps=None):
            return ["generated"]

    eng = SwappingEngine(Inner())
    prompt = [np.array([1, 2], dtype=np.int32)]
    params = SamplingParams(max_new_tokens=2)
    assert eng.generate(prompt, params) == ["generated"]
    eng.asleep = True
    with pytest.raises(RuntimeError, match="generate on a sleeping engine"):
        eng.generate(prompt, params)
