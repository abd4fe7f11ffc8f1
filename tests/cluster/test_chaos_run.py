"""A chaos run (``sonar chaos``'s ``run_chaos``) on the smoke config, scheduled in RL learner steps (not
seconds, so it means the same on a loaded machine): rollout workers SIGKILLed at RL steps 3 and 6, the
retrieval replica at 5, the learner at 7 (resumed from its checkpoint at step 6), training ended at step
9. It must finish with nothing lost and nothing trained twice, by the run's own records."""
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # slow: the 1,800 s hang guard (tests/conftest.py)


def test_chaos_run_by_learner_steps_loses_nothing_and_trains_nothing_twice(tmp_path, capsys, shared_ray):
    from sonar.cluster.driver.chaos import run_chaos
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    cfg = load_config([CONFIG_DIR / "smoke.yaml"],
                      [f"run.root={tmp_path}", "tracking.enabled=false", "eval.before=false", "eval.no_search=false",
                       "world.num_heldout_eval=4", "stages.0.steps=10", "run.checkpoint_every=3"])
    report = run_chaos(cfg, steps=9, kill_every=3, replica_at=5, learner_at=7, seed=0)
    a, events = report["accounting"], report["events"]
    at = {kind: [e["rl_step"] for e in events if e["killed"].startswith(kind)]
          for kind in ("rollout worker", "retrieval replica", "learner")}
    # every kind killed, each at its scheduled step (the learner's checkpoint of step 6 exists by 7)
    assert at == {"rollout worker": [3, 6], "retrieval replica": [5], "learner": [7]}, events
    assert report["kills"] == {"rollout worker": 2, "retrieval replica": 1, "learner": 1}
    assert report["rl_steps"] == 9 and report["ended_by"] == "steps"
    # step 7, lost with the learner, is trained again after the resume from step 6: 10 steps logged
    assert report["rl_steps_logged"] == 10, events
    assert report["faults"]["learner_resumes"] == 1
    assert report["faults"]["worker_restarts"] == 2
    assert a["lost"] == 0 and a["trained_twice"] == 0 and a["balanced"], a
    assert a["trained"] > 0 and a["trained_prompts"] * cfg.rollout.group_size == a["trained"]
    out = capsys.readouterr().out
    assert "lost 0" in out and "trained_twice 0" in out
