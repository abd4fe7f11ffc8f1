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
