"""The 2-minute chaos run (``sonar chaos``'s ``run_chaos``) on the smoke config: rollout workers
SIGKILLed every 20 s, the retrieval replica killed once, the learner killed once and resumed from
its checkpoint. It must finish with nothing lost and nothing trained twice, by the run's own records."""
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1800)]


def test_two_minute_chaos_run_loses_nothing_and_trains_nothing_twice(tmp_path, capsys):
    from sonar.cluster.driver.chaos import run_chaos
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    cfg = load_config([CONFIG_DIR / "smoke.yaml"],
                      [f"run.root={tmp_path}", "tracking.enabled=false", "eval.before=false", "eval.no_search=false",
                       "world.num_heldout_eval=4", "stages.0.steps=10", "run.checkpoint_every=3",
                       "cluster.max_worker_restarts=4", "cluster.auto_resume=1"])
    report = run_chaos(cfg, minutes=1.0, kill_every_s=20.0, seed=0)
    a, kinds = report["accounting"], [e["killed"] for e in report["events"]]
    assert "learner" in kinds and "retrieval replica 0" in kinds, report["events"]
    assert any(k.startswith("rollout worker") for k in kinds), report["events"]
    assert report["faults"]["learner_resumes"] == 1
    assert report["faults"]["worker_restarts"] == sum(k.startswith("rollout worker") for k in kinds)
    assert a["lost"] == 0 and a["trained_twice"] == 0 and a["balanced"], a
    assert a["trained"] > 0 and a["trained_prompts"] * cfg.rollout.group_size == a["trained"]
    out = capsys.readouterr().out
    assert "lost 0" in out and "trained_twice 0" in out
