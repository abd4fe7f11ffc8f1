"""A chaos run (``sonar chaos``'s ``run_chaos``) on the smoke config, scheduled in RL learner steps (not
seconds, so it means the same on a loaded machine): rollout workers SIGKILLed at RL steps 3 and 6, the
retrieval replica at 5, the learner at 7 (resumed from its checkpoint at step 6), a worker killed during
the pushes after steps 2, 4 and 8 (rank positions 0, 1, 0), a worker paused (SIGSTOP) at step 4,
training ended at step 9. It must finish with nothing lost and nothing trained twice, by the run's own
records, every mid-push kill calling its push off, and the paused worker replaced."""
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # slow: the 1,800 s hang guard (tests/conftest.py)


def test_chaos_run_by_learner_steps_loses_nothing_and_trains_nothing_twice(tmp_path, capsys, shared_ray):
    from sonar.cluster.driver.chaos import run_chaos
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    cfg = load_config([CONFIG_DIR / "smoke.yaml"],
                      [f"run.root={tmp_path}", "tracking.enabled=false", "eval.before=false", "eval.no_search=false",
                       "world.num_heldout_eval=4", "stages.0.steps=10", "run.checkpoint_every=3"])
    report = run_chaos(cfg, steps=9, kill_every=3, replica_at=5, learner_at=7, seed=0, push_kill_every=2, pause_at=4)
    a, events = report["accounting"], report["events"]
    kills = [e for e in events if "killed" in e and not e["killed"].endswith("mid-push")]
    at = {kind: [e["rl_step"] for e in kills if e["killed"].startswith(kind)]
          for kind in ("rollout worker", "retrieval replica", "learner")}
    # every kind killed, each at its scheduled step (the learner's checkpoint of step 6 exists by 7)
    assert at == {"rollout worker": [3, 6], "retrieval replica": [5], "learner": [7]}, events
    # the mid-push kills: one per scheduled step (2, 4, 6, 8; step 6's push may be the resumed learner's),
    # each rank position in turn, each push called off for the others
    mid = [e["killed"] for e in events if e.get("killed", "").endswith("mid-push")]
    assert mid == [f"rollout worker {i % 2} mid-push" for i in range(len(mid))] and len(mid) == 4, events
    assert report["faults"]["push_call_offs"] == len(mid)
    assert report["kills"] == {"rollout worker": 2 + len(mid), "retrieval replica": 1, "learner": 1, "mid-push": len(mid)}
    assert report["pauses"] == {"rollout worker": 1, "retrieval replica": 0}
    assert report["rl_steps"] == 9 and report["ended_by"] == "steps"
    # step 7, lost with the learner, is trained again after the resume from step 6: 10 steps logged
    assert report["rl_steps_logged"] == 10, events
    assert report["faults"]["learner_resumes"] == 1
    assert report["faults"]["worker_restarts"] == 2 + len(mid) + 1  # the kills, the mid-push kills, the paused one
    assert a["lost"] == 0 and a["trained_twice"] == 0 and a["balanced"], a
    assert a["trained"] > 0 and a["trained_prompts"] * cfg.rollout.group_size == a["trained"]
    out = capsys.readouterr().out
    assert "lost 0" in out and "trained_twice 0" in out
