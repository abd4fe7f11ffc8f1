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


def test_the_search_r1_shape_grows_to_2_4k_over_3_5_turns():
    assert R.TURNS == (3, 5)
    assert 2000 <= R.context_after(3) <= R.context_after(5) <= 4000
    assert R.context_after(4) == 600 + 4 * (220 + 3 * 130)


def test_turn_lengths_span_100_500_with_a_tail():
    assert R.turn_tokens_quantile(0.5) == pytest.approx(220.0)
    assert 90 <= R.turn_tokens_quantile(0.05) <= 110 and 480 <= R.turn_tokens_quantile(0.95) <= 520
    assert R.TURN_MAX_TOKENS > 2 * R.turn_tokens_quantile(0.95)  # the clip leaves the tail


def test_learner_throughput_is_the_flop_arithmetic():
    # one GPU, the update alone: 0.40 x 989.4e12 / (6 x 7.25e9) = 9,098 tokens/s
    assert R.learner_tokens_per_s(1, 0.40) == pytest.approx(0.40 * 989.4e12 / (6 * 7.25e9))
    assert R.learner_tokens_per_s(1, 0.40) == pytest.approx(9097.9, abs=0.5)
    assert R.learner_tokens_per_s(1, 0.40, forwards=1) == pytest.approx(0.40 * 989.4e12 / (8 * 7.25e9))
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
    lt = hooks.on_learner_step
    assert isinstance(lt, LearnerTime) and lt.gpus == R.LEARNER_GPUS
    # bench.yaml's GRPO (one update, off_policy tis, no KL) runs no extra forward: 6N per token
    assert (sim.learner_updates, sim.learner_forwards) == (1, 0) == (lt.updates, lt.forwards)
    assert lt.context_scale == R.CONTEXT_SCALE
    assert lt.hidden_per_traj == pytest.approx(R.hidden_tokens_per_traj(), abs=0.1)
    lab = R.label()
    assert lab["workload"] == "reference-7b" and lab["overrides"] == R.overrides()
    assert lab["realised"] == {k: list(v) for k, v in R.REALISED.items()}


def test_learner_time_charges_the_trained_tokens_before_the_push(monkeypatch):
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    lt = LearnerTime(gpus=2, mfu=0.5, updates=1, forwards=0, context_scale=8.0, hidden_per_traj=500.0)
    # 64 trajectories of 100 tiny tokens each: learner/tokens_per_s x step_time = 6,400 tiny tokens
    out = lt({K.LEARNER_TRAJECTORIES: 64.0, K.LEARNER_STEP_TIME: 0.25, K.LEARNER_TOKENS_PER_S: 6400 / 0.25})
    tokens = 8 * 6400 + 64 * 500
    target = 6 * R.MODEL_PARAMS * tokens / (2 * 0.5 * R.PEAK_BF16_FLOPS)
    assert slept == [pytest.approx(target - 0.25)]
    assert out[K.LEARNER_STEP_TIME] == pytest.approx(target) and out["sim/learner_overrun"] == 0.0
    assert out["sim/learner_tokens"] == pytest.approx(tokens) and out["sim/learner_compute_s"] == pytest.approx(target)
    # a skipped step trains nothing and costs nothing; a real step longer than the model is kept, counted
    assert lt({K.LEARNER_STEP_TIME: 0.01})[K.LEARNER_STEP_TIME] == 0.01 and len(slept) == 1
    long = lt({K.LEARNER_TRAJECTORIES: 1.0, K.LEARNER_STEP_TIME: 100.0, K.LEARNER_TOKENS_PER_S: 1.0})
    assert long[K.LEARNER_STEP_TIME] == 100.0 and long["sim/learner_overrun"] == 1.0 and lt.overruns == 1
    # a step without its token count (a PPO critic warm-up) is charged the mean tiny tokens per trajectory so far
    warm = lt({K.LEARNER_TRAJECTORIES: 2.0, K.LEARNER_STEP_TIME: 0.0})
    assert warm["sim/learner_tokens"] == pytest.approx(8 * 2 * (6400 + 100) / 65 + 2 * 500)


@pytest.mark.parametrize("overrides, match", [
    (["sim.learner_cost=flops_7b", "sim.learner_hidden_tokens_per_traj=-1"], "learner_hidden_tokens_per_traj"),
    (["sim.learner_cost=flops_7b", "sim.learner_forwards=-2"], "learner_forwards"),
    (["sim.learner_cost=flops_7b", "sim.learner_mfu=0"], "learner_mfu"),
    (["sim.learner_cost=flops_7b", "sim.learner_delay_ms=5"], "two learner-time"),
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
