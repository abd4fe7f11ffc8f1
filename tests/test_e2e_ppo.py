"""End to end (slow): configs/rag_r1_tiny.yaml's PPO with a critic through the real driver — Ray actors, the
DeepSpeed learner with its separate value model, one sample per prompt, KL 0.001 as a reward penalty,
four mini-batches per rollout batch — shrunk to a few steps on smoke.yaml's small world. It checks that
the run completes, that every RL step trained the critic and logged its metrics, and that the stage's
checkpoint holds the critic."""
import json
import math
from pathlib import Path

import pytest

from tests.sizing import smoke_sizing

from sonar.cluster.wire import metrics as K

pytestmark = [pytest.mark.slow, pytest.mark.ray]

CRITIC_KEYS = (K.LEARNER_CRITIC_VALUE_LOSS, K.LEARNER_CRITIC_EXPLAINED_VAR, K.LEARNER_CRITIC_VALUE_MEAN,
               K.LEARNER_CRITIC_RETURN_MEAN, K.LEARNER_CRITIC_GRAD_NORM, K.LEARNER_CRITIC_VALUE_CLIPFRAC)


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, shared_ray):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    root = tmp_path_factory.mktemp("runs")
    cfg = load_config([smoke_sizing(root), CONFIG_DIR / "rag_r1_tiny.yaml"], [
        f"run.root={root}", f"run.run_dir={root / 'ppo'}", "world.num_heldout_eval=8", "eval.no_search=false",
        "stages.0.steps=10", "stages.0.batch_size=16", "stages.1.steps=3", "learner.groups_per_step=8",
        "tracking.log_model=false", "rollout.num_workers=1"])
    assert cfg.stages[1].algo.name == "ppo" and cfg.rollout.group_size == 1
    return cfg, train(cfg)


def test_the_ppo_run_completes_and_every_rl_step_trained_the_critic(ppo_run):
    cfg, s = ppo_run
    assert s["learner_steps"] == sum(st.steps for st in cfg.stages)
    rows = [json.loads(l) for l in open(f"{s['run_dir']}/metrics.jsonl")]
    rl = [r for r in rows if r.get("stage") == 1 and K.LEARNER_VERSION in r]
    assert len(rl) == cfg.stages[1].steps
    for r in rl:
        for key in CRITIC_KEYS:
            assert key in r and math.isfinite(r[key]), (key, r.get(key))
        assert r[K.LEARNER_CRITIC_WARMUP] == 0.0
        assert r[K.LEARNER_OPTIMIZER_STEPS] == cfg.stages[1].algo.mini_batches  # 8 rows, 4 mini-batches
        assert K.LEARNER_KL_REWARD_PENALTY in r


def test_the_stage_checkpoint_holds_the_critic(ppo_run):
    _, s = ppo_run
    ckpts = [p for p in (Path(s["run_dir"]) / "checkpoints").iterdir() if (p / "COMPLETE").exists()]
    assert ckpts and all((p / "critic.pt").is_file() for p in ckpts)
