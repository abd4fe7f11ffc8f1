"""The driver's RL step log line never prints nan: a step whose rollouts made no search reads 0.00
searches per trajectory (hand-computed means), and a step at which no rollout finished, whose mean is
empty, says so (it printed `searches/traj nan`)."""
from sonar.cluster.driver.reports import rollout_metrics, step_log_line
from sonar.cluster.wire import metrics as K


def _rollout(searches: int, reward: float = 1.0) -> dict:
    return {"reward": reward, "parts": {"em": reward}, "finish": "answered", "searches": searches,
            "failed_searches": 0, "latency_ms": [2.0] * searches, "model_tokens": 10}


def _step(recent: list[dict]) -> dict:
    return {K.LEARNER_REWARD_MEAN: 0.25, K.LEARNER_POLICY_LAG_MAX: 1, K.REPLAY_DROPPED_STALE: 3,
            **rollout_metrics(recent)}


def test_a_step_whose_rollouts_made_no_search_reports_zero_searches():
    m = _step([_rollout(0), _rollout(0, reward=0.0)])
    assert m[K.ROLLOUT_SEARCH_CALLS_MEAN] == 0.0 and m[K.ROLLOUT_TRAJECTORIES] == 2.0
    assert step_log_line(5, 10, m) == "rl step 5/10 reward 0.250 lag max 1 searches/traj 0.00 dropped 3"


def test_searches_per_trajectory_is_the_mean_of_the_rollouts_reported():
    m = _step([_rollout(1), _rollout(2), _rollout(0), _rollout(4)])  # (1 + 2 + 0 + 4) / 4 = 1.75
    assert m[K.ROLLOUT_SEARCH_CALLS_MEAN] == 1.75
    assert "searches/traj 1.75 " in step_log_line(10, 10, m)


def test_a_step_at_which_no_rollout_finished_says_so_instead_of_nan():
    m = _step([])  # no worker finished a group since the previous step: no rollout metrics at all
    assert K.ROLLOUT_SEARCH_CALLS_MEAN not in m and K.ROLLOUT_TRAJECTORIES not in m
    line = step_log_line(15, 20, m)
    assert "nan" not in line.lower()
    assert line == ("rl step 15/20 reward 0.250 lag max 1 searches/traj - (no rollout finished since the previous "
                    "step) dropped 3")
    # a row without the learner's or the replay's numbers prints "-" for them, never nan
    assert step_log_line(1, 2, {}) == ("rl step 1/2 reward - lag max - searches/traj - (no rollout finished since "
                                       "the previous step) dropped -")


def test_stage_progress_gives_the_rate_and_eta_of_this_processes_steps():
    from sonar.cluster.driver.reports import StageProgress, fmt_duration

    now = [100.0]
    p = StageProgress(500, start_step=100, clock=lambda: now[0], bar=False)  # resumed at step 100
    assert p.text(100) == "20%"                       # nothing done yet: no rate to extrapolate
    now[0] += 40.0
    assert p.text(120) == "24% 0.50 steps/s ETA 12m40s"  # 20 steps in 40 s; 380 left at 0.5/s = 760 s
    now[0] += 7200.0
    assert p.text(121) == "24% 0.00 steps/s ETA 36h17m"  # 379 x 7240 / 21 s: a stall shows as a long ETA
    assert [fmt_duration(x) for x in (0, 59.9, 60, 3599, 3600, 3725)] == ["0s", "59s", "1m00s", "59m59s", "1h00m", "1h02m"]
    p.update(), p.close()  # without a bar (not a terminal) both are no-ops


def test_stage_progress_draws_a_bar_only_on_a_terminal(monkeypatch):
    import io

    from sonar.cluster.driver import reports

    monkeypatch.setattr(reports.sys, "stderr", io.StringIO())  # a file: no bar
    assert reports.StageProgress(10).bar is None
    fake_tty = io.StringIO()
    fake_tty.isatty = lambda: True
    monkeypatch.setattr(reports.sys, "stderr", fake_tty)
    p = reports.StageProgress(10, desc="stage 1 rl")
    p.update(3)
    assert p.bar is not None and p.bar.n == 3
    p.close()
    assert p.bar is None and "stage 1 rl" in fake_tty.getvalue()


def test_a_startup_phase_is_logged_when_it_begins_and_when_it_is_done(caplog):
    import logging

    import pytest

    from sonar.cluster.driver.reports import startup_phase

    with caplog.at_level(logging.INFO, logger="sonar"):
        with startup_phase("ray"):
            pass
        with pytest.raises(ValueError):
            with startup_phase("policy"):
                raise ValueError("no config.json")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "start-up: ray ..." and msgs[1].startswith("start-up: ray done in ") and msgs[1].endswith(" s")
    assert msgs[2:] == ["start-up: policy ..."]  # a phase that failed is not reported done
