"""End to end (slow): colocated placement through the real driver (``cluster.placement=colocated``).

configs/smoke.yaml in sync mode with the learner and the engines taking turns: SFT with the engines
asleep, then every RL step generates with the engines awake, puts them to sleep, trains, hands the
weights over through shared memory (no broadcast group) and wakes them. After every hand-over each
worker holds exactly the learner's weights (checksums, asked from the driver's own step hook), every
RL step reports its phase switch, the accounting balances. A sleeping engine refuses to generate, so a
step that asked for rollouts out of turn would fail the run. The vLLM variant proves the hand-over into
vLLM's own worker (the extension joins the segment as it joins a broadcast group)."""
import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _train(tmp_path_factory, name: str, *overrides: str):
    import ray

    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    root = tmp_path_factory.mktemp(name)
    cfg = load_config([CONFIG_DIR / "smoke.yaml"], [
        f"run.root={root}", f"run.run_dir={root / name}", "cluster.placement=colocated", "cluster.mode=sync",
        "tracking.enabled=false", *overrides])
    after_push: list[dict] = []

    def on_step(roles, run, stage, steps):
        # The hand-over of this step is done (the loop logs the step after it): the staged weights go in,
        # then every worker's checksum against the learner's.
        roles.pool.call("apply_staged_weights", lambda w, i: w.apply_staged_weights.remote())
        learner = ray.get(roles.learner.checksum.remote())
        workers = roles.pool.call("checksum", lambda w, i: w.checksum.remote())
        after_push.append({"stage": stage, "step": steps, "learner": learner, "workers": workers})
        return False

    summary = train(cfg, Hooks(on_step=on_step))
    rows = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    return cfg, summary, after_push, rows


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory, shared_ray):
    return _train(tmp_path_factory, "smoke-colocated")


def test_every_hand_over_leaves_every_worker_with_the_learners_weights(colocated_run):
    cfg, _, after_push, _ = colocated_run
    rl_steps = sum(st.steps for st in cfg.stages if st.kind == "rl")
    assert len(after_push) == rl_steps
    versions = [p["learner"]["version"] for p in after_push]
    assert versions == sorted(versions) and len(set(versions)) == rl_steps  # a new version at every step
    for p in after_push:
        assert len(p["workers"]) == cfg.rollout.num_workers
        for w in p["workers"]:
            assert w["version"] == p["learner"]["version"]
            assert w["checksum"] == pytest.approx(p["learner"]["checksum"], rel=1e-12)


def test_every_rl_step_switched_phases_and_the_push_went_through_the_shared_segment(colocated_run):
    from sonar.cluster.wire import metrics as K

    cfg, s, _, rows = colocated_run
    rl = [r for r in rows if K.LEARNER_VERSION in r and K.LEARNER_TRAJECTORIES in r]
    assert len(rl) == sum(st.steps for st in cfg.stages if st.kind == "rl")
    for r in rl:
        for key in (K.COLOCATE_SLEEP_S, K.COLOCATE_WAKE_S, K.COLOCATE_HANDOVER_S, K.COLOCATE_RELOAD_S,
                    K.COLOCATE_OFFLOAD_S, K.WEIGHTS_SYNC_S, K.CRIT_SWITCH):
            assert r[key] >= 0.0, key
        assert r[K.COLOCATE_FREED] == 0.0  # on CPU no engine has device memory to release
        assert r[K.CRIT_GENERATE_SYNC] > 0.0  # sync: the batch was generated (awake) before the step
        assert r[K.LEARNER_POLICY_LAG_MAX] == 0.0  # every batch sampled the weights of the step before
    assert s["replay"]["balanced"] and s["replay"]["dropped_stale"] == 0
    assert s["policy_lag_max"] == 0


def test_the_run_ends_with_every_engine_holding_the_final_weights_and_no_segment_left(colocated_run):
    import os

    from sonar.cluster.transport.handover import segment_dir

    cfg, s, _, _ = colocated_run
    learner = s["weights"]["learner"]
    assert learner["version"] == sum(st.steps for st in cfg.stages)
    for w in s["weights"]["workers"]:
        assert w["checksum"] == pytest.approx(learner["checksum"], rel=1e-12)
    assert all(n > 0 for n in s["weights"]["worker_trajectories"])
    # each segment is unlinked once every engine mapped it; the roles are gone: nothing may stay behind
    assert not [f for f in os.listdir(segment_dir()) if f.startswith("sonar-") and "-sonar-weights-" in f]


@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_vllm_engines_receive_the_hand_over_in_their_own_worker(tmp_path_factory, shared_ray):
    cfg, s, after_push, _ = _train(
        tmp_path_factory, "smoke-colocated-vllm", "rollout.engine=vllm", "rollout.vllm_kv_cache_gib=0.25",
        "stages.0.steps=10", "stages.2.steps=1", "eval.before=false", "eval.no_search=false",
        "world.num_heldout_eval=8", "cluster.step_timeout_s=3000")
    assert after_push and all(w["checksum"] == pytest.approx(p["learner"]["checksum"], rel=1e-12)
                              for p in after_push for w in p["workers"])
    assert s["replay"]["balanced"] and all(n > 0 for n in s["weights"]["worker_trajectories"])
