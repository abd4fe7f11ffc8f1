"""The reference workload (bench/sim/reference.py): its stated figures follow from its constants, its
overrides load as a valid benchmark config, and its learner model is the FLOP arithmetic it states."""
from __future__ import annotations

import math

import pytest

from sonar.bench.sim import reference as R
from sonar.bench.sim.config import load_bench_config
from sonar.bench.sim.hooks import LearnerTime, sim_hooks
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import CONFIG_DIR


def test_contexts_grow_to_2_4k_over_3_5_turns():
    assert R.TURNS == (3, 5)
    assert 2000 <= R.context_after(3) <= R.context_after(5) <= 4000
    assert R.context_after(4) == R.TOKENS_PER_TRAJ == 600 + 4 * (220 + 3 * 130)


def test_turn_lengths_span_100_500_with_a_tail():
    assert R.turn_tokens_quantile(0.5) == pytest.approx(220.0)
    assert 90 <= R.turn_tokens_quantile(0.05) <= 110 and 480 <= R.turn_tokens_quantile(0.95) <= 520
    assert R.TURN_MAX_TOKENS > 2 * R.turn_tokens_quantile(0.95)  # the clip leaves the tail


def test_learner_throughput_is_the_flop_arithmetic():
    # one GPU: 0.40 x 989.4e12 / (8 x 7.25e9) = 6,823 tokens/s
    assert R.learner_tokens_per_s(1, 0.40) == pytest.approx(0.40 * 989.4e12 / (8 * 7.25e9))
    assert R.learner_tokens_per_s(1, 0.40) == pytest.approx(6823.4, abs=0.5)
    assert R.learner_tokens_per_s(4) == pytest.approx(4 * R.learner_tokens_per_s(1))
    assert R.learner_tokens_per_s() == pytest.approx(R.LEARNER_GPUS * R.learner_tokens_per_s(1))
    with pytest.raises(ValueError):
        R.learner_tokens_per_s(0)
    with pytest.raises(ValueError):
        R.learner_tokens_per_s(1, 1.5)


def test_the_overrides_load_with_bench_yaml_and_give_every_hook():
    cfg, sim = load_bench_config([CONFIG_DIR / "bench.yaml"], R.overrides())
    assert (sim.decode_cost, sim.prefill_cost, sim.learner_cost) == ("gpu_7b", "gpu_7b", "flops_7b")
    assert sim.context_scale == R.CONTEXT_SCALE and sim.retrieval_servers == R.RETRIEVAL_SERVERS
    assert cfg.protocol.max_turns == 5 and cfg.rollout.continuous_batching
    hooks = sim_hooks(sim)
    assert hooks.engine_wrap is not None and hooks.retriever_wrap.servers == R.RETRIEVAL_SERVERS
    assert isinstance(hooks.on_learner_step, LearnerTime) and hooks.on_learner_step.gpus == R.LEARNER_GPUS
    lab = R.label()
    assert lab["workload"] == "reference-7b" and lab["overrides"] == R.overrides()
    assert lab["learner"]["tokens_per_s"] == pytest.approx(R.learner_tokens_per_s())


def test_learner_time_charges_the_trained_trajectories_before_the_push(monkeypatch):
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    lt = LearnerTime(tokens_per_traj=3000.0, gpus=2, mfu=0.5)
    tps = R.learner_tokens_per_s(2, 0.5)
    out = lt({K.LEARNER_TRAJECTORIES: 64.0, K.LEARNER_STEP_TIME: 0.25})
    target = 64 * 3000 / tps
    assert slept == [pytest.approx(target - 0.25)]
    assert out[K.LEARNER_STEP_TIME] == pytest.approx(target) and out["sim/learner_overrun"] == 0.0
    # a skipped step trains nothing and costs nothing; a real step longer than the model is kept, counted
    assert lt({K.LEARNER_STEP_TIME: 0.01})[K.LEARNER_STEP_TIME] == 0.01 and len(slept) == 1
    long = lt({K.LEARNER_TRAJECTORIES: 1.0, K.LEARNER_STEP_TIME: 100.0})
    assert long[K.LEARNER_STEP_TIME] == 100.0 and long["sim/learner_overrun"] == 1.0 and lt.overruns == 1
    assert lt.simulated_s == pytest.approx(target + 3000 / tps)


@pytest.mark.parametrize("overrides, match", [
    (["sim.learner_cost=flops_7b"], "learner_tokens_per_traj"),
    (["sim.learner_cost=flops_7b", "sim.learner_tokens_per_traj=100", "sim.learner_mfu=0"], "learner_mfu"),
    (["sim.learner_cost=flops_7b", "sim.learner_tokens_per_traj=100", "sim.learner_delay_ms=5"], "two learner-time"),
    (["sim.learner_cost=gpu"], "learner_cost"),
    (["sim.prefill_cost=fast"], "prefill_cost"),
    (["sim.retrieval_servers=-2"], "retrieval_servers"),
    (["sim.context_scale=0.5"], "context_scale"),
    (["sim.prefill_cost=gpu_7b", "sim.decode_ms_per_token=0", "sim.decode_cost=flat"], "paced continuous engine"),
    (["sim.prefill_cost=gpu_7b", "rollout.continuous_batching=false", "rollout.per_trajectory=false"],
     "paced continuous engine"),
])
def test_bad_reference_settings_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_bench_config([CONFIG_DIR / "bench.yaml"], overrides)
