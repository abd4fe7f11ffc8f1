"""End to end (slow): the R1-Searcher and Search-R1 presets run through the real driver, shrunk to a few
steps on smoke.yaml's small world (configs/rag_r1_tiny.yaml's PPO with a critic has its own: test_e2e_ppo.py).

Each run checks what makes the preset that paper's, not only that it completes: the protocol's tags in
what the policy wrote, the reward's parts, the algorithm's optimizer steps per rollout batch, and that
no group was dropped where upstream keeps every group (REINFORCE++ / group_norm have no dynamic sampling).
"""
import json

import pytest

from tests.sizing import smoke_sizing

from sonar.cluster.wire import metrics as K

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SHRINK = ["world.num_heldout_eval=8", "stages.0.steps=10", "stages.0.batch_size=16", "rollout.group_size=4",
          "learner.groups_per_step=2", "replay.capacity_groups=4", "tracking.log_model=false",
          "rollout.num_workers=1"]  # one worker: these runs check a preset's stages, not the pool


def _run(tmp_path_factory, preset: str, extra: list[str]):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    root = tmp_path_factory.mktemp(preset)
    cfg = load_config([smoke_sizing(root), CONFIG_DIR / f"{preset}.yaml"],
                      [f"run.root={root}", f"run.run_dir={root / preset}", *SHRINK, *extra])
    summary = train(cfg)
    rows = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    return cfg, summary, rows


@pytest.fixture(scope="module")
def r1_run(tmp_path_factory, shared_ray):
    return _run(tmp_path_factory, "r1_searcher_tiny", ["stages.1.steps=2", "stages.2.steps=2"])


@pytest.fixture(scope="module")
def search_r1_run(tmp_path_factory, shared_ray):
    # 10 SFT steps leave every reward at 0 and GRPO's dynamic sampling would drop every group, so the
    # steps would train nothing; keeping them checks the update path (zero-signal groups add no gradient).
    # Run as the paper recipe runs (configs/search_r1.yaml): Search-R1's own parsing, on-policy in lockstep
    # (off_policy auto -> none), the entropy bonus; the tiny preset's Sonar-rules path is the R1 run's.
    return _run(tmp_path_factory, "search_r1_tiny", ["stages.1.steps=2", "stages.1.algo.dynamic_sampling=false",
                                                     "protocol.rules=upstream", "cluster.mode=sync",
                                                     "replay.max_policy_lag=0", "stages.1.algo.off_policy=auto",
                                                     "stages.1.algo.entropy_coef=0.001"])


def _common(cfg, s, rows):
    assert s["learner_steps"] == sum(st.steps for st in cfg.stages)
    r = s["replay"]
    assert r["balanced"] and r["consumed"] > 0
    for i, st in enumerate(cfg.stages):
        if st.kind == "rl":
            steps = [x for x in rows if x.get("stage") == i and K.LEARNER_VERSION in x]
            assert len(steps) == st.steps, (st.name, len(steps))
            for x in steps:
                assert x[K.LEARNER_OPTIMIZER_STEPS] == st.algo.mini_batches * st.algo.ppo_epochs


def test_r1_searcher_preset_runs_its_two_rl_stages(r1_run):
    cfg, s, rows = r1_run
    assert cfg.protocol.name == "r1_searcher"
    assert [st.reward.name for st in cfg.stages if st.kind == "rl"] == ["r1_stage1", "r1_stage2"]
    assert [st.algo.name for st in cfg.stages if st.kind == "rl"] == ["group_norm", "reinforce_pp_baseline"]
    _common(cfg, s, rows)
    # Upstream keeps every group: no dynamic sampling for group_norm / REINFORCE++.
    rl = [x for x in rows if x.get("stage") in (1, 2) and K.LEARNER_VERSION in x]
    assert all(x.get(K.LEARNER_GROUPS_ZERO_SIGNAL, 0) == 0 for x in rl)
    # The held-out evaluation ran and wrote one record per question.
    from pathlib import Path
    (path,) = Path(s["run_dir"]).glob("predictions-after_search.jsonl")
    assert len(path.read_text().splitlines()) == cfg.world.num_heldout_eval


def test_search_r1_preset_trains_em_without_a_format_term(search_r1_run):
    cfg, s, rows = search_r1_run
    assert cfg.protocol.name == "search_r1" and cfg.stages[1].reward.name == "search_r1"
    _common(cfg, s, rows)
    rl = [x for x in rows if x.get("stage") == 1 and K.ROLLOUT_REWARD_MEAN in x]
    assert rl
    # The reward is the answer's EM and nothing else (the format part is logged as a diagnostic only).
    assert all(x[K.ROLLOUT_REWARD_MEAN] == pytest.approx(x["rollout/reward/em"], abs=1e-12) for x in rl)
    # upstream rules, lockstep, no off-policy correction, and the entropy bonus in every RL step's loss
    assert (cfg.protocol.rules, cfg.cluster.mode, cfg.stages[1].algo.off_policy) == ("upstream", "sync", "none")
    steps = [x for x in rows if x.get("stage") == 1 and K.LEARNER_VERSION in x]
    assert steps and all(K.LEARNER_LOSS_PART.format(part="entropy_loss") in x for x in steps)
