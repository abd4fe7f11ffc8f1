"""The pieces of fault handling that need no cluster: which failed searches are infrastructure
failures, the client's bounded wait for a healthy replica, the rollback of a run's records to a
checkpoint, the chaos schedule and the chaos accounting (hand-computed values)."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from sonar.cluster.wire.protocol import SearchCall, Trajectory


def _traj(*errors):
    return Trajectory("t", "g", "p", 0, [], searches=[SearchCall(0, ["q"], [[]], 1.0, error=e) for e in errors])


@pytest.mark.parametrize("errors, infra", [
    ((), False), ((None,), False), (("bad_request",), False), ((None, "timeout"), True),
    (("connection",), True), (("internal",), True), (("breaker_open",), True), (("http_5xx",), True)])
def test_infra_failed_is_any_search_failed_by_the_infrastructure(errors, infra):
    from sonar.actors.worker import infra_failed

    assert infra_failed([_traj(), _traj(*errors)]) is infra


class _Flaky:
    """Stands in for RetrievalClient's one-attempt search: fails with ``kind`` ``n`` times, then answers."""

    def __init__(self, n, kind="connection"):
        self.n, self.kind, self.calls = n, kind, 0

    def __call__(self, queries, k):
        from sonar.retrieval.base import RetrievalError

        self.calls += 1
        if self.calls <= self.n:
            raise RetrievalError(self.kind, "no healthy retrieval replica")
        return [["hit"]]


def _client(wait_s, flaky):
    from sonar.retrieval.client import RetrievalClient

    c = RetrievalClient([object()], timeout_s=1.0, recheck_s=0.004, wait_healthy_s=wait_s)
    c._batch_search_once = flaky

    async def once(q, k):
        return flaky(q, k)

    c._abatch_search_once = once
    return c


def test_client_waits_for_a_healthy_replica_blocking_and_awaited():
    c = _client(60.0, _Flaky(3))
    assert c.batch_search(["q"], 1) == [["hit"]] and c._batch_search_once.calls == 4
    c = _client(60.0, _Flaky(2))
    assert asyncio.run(c.abatch_search(["q"], 1)) == [["hit"]] and c._batch_search_once.calls == 3
    assert c.stats()["waits_for_replica"] == 2


def test_client_does_not_wait_for_other_errors_or_without_a_budget():
    from sonar.retrieval.base import RetrievalError

    c = _client(60.0, _Flaky(1, kind="bad_request"))
    with pytest.raises(RetrievalError, match="bad_request"):
        c.batch_search(["q"], 1)
    c = _client(0.0, _Flaky(1))
    with pytest.raises(RetrievalError, match="connection"):
        c.batch_search(["q"], 1)
    assert c._batch_search_once.calls == 1


def test_client_pickles_its_wait_budget():
    import pickle

    from sonar.retrieval.client import RetrievalClient

    c = pickle.loads(pickle.dumps(RetrievalClient([1], timeout_s=2.0, wait_healthy_s=7.5)))
    assert c.wait_healthy_s == 7.5


def test_rollback_keeps_records_up_to_the_checkpoint(tmp_path):
    from collections import deque

    from sonar.cluster.driver.faults import ROLLED_BACK, rollback_records

    recs = [{"version": v, "trained": [v * 10], "dropped": []} for v in (1, 2, 3, 4)]
    (tmp_path / "trained_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = SimpleNamespace(dir=tmp_path, history=deque([{"step": s} for s in range(1, 8)], maxlen=100))
    assert rollback_records(run, version=2, run_step=5) == 2
    kept = [json.loads(l) for l in (tmp_path / "trained_prompts.jsonl").read_text().splitlines()]
    moved = [json.loads(l) for l in (tmp_path / ROLLED_BACK).read_text().splitlines()]
    assert [r["version"] for r in kept] == [1, 2] and [r["version"] for r in moved] == [3, 4]
    assert [h["step"] for h in run.history] == [1, 2, 3, 4, 5]
    assert rollback_records(run, version=-1, run_step=0) == 2  # no checkpoint: everything goes
    assert (tmp_path / "trained_prompts.jsonl").read_text() == "" and list(run.history) == []


def _replay(**kw):
    r = {"produced": 40, "consumed": 24, "dropped_stale": 4, "requeued": 8, "queued": 4, "consumed_groups": 6,
         "requeued_prompts": 5, "outstanding_claims": 0, "balanced": True}
    r.update(kw)
    return r


def test_accounting_counts_lost_and_trained_twice(tmp_path):
    from sonar.cluster.driver.chaos import accounting

    recs = [{"version": 1, "trained": [3, 5, 7], "dropped": [9]}, {"version": 2, "trained": [1, 2, 4], "dropped": []}]
    (tmp_path / "trained_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    a = accounting(tmp_path, _replay(), num_prompts=100)
    assert (a["produced"], a["trained"], a["dropped_stale"], a["requeued"], a["lost"], a["trained_twice"]) == \
        (40, 24, 4, 8, 0, 0)
    # 4 unbalanced trajectories + 2 prompts still claimed + 1 group handed out that no step recorded
    a = accounting(tmp_path, _replay(produced=44, outstanding_claims=2, consumed_groups=7), num_prompts=100)
    assert a["lost"] == 4 + 2 + 1
    recs.append({"version": 3, "trained": [3, 5], "dropped": [1]})
    (tmp_path / "trained_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert accounting(tmp_path, _replay(consumed_groups=8), num_prompts=100)["trained_twice"] == 3
    # 10 prompts seen over 7 questions: two epochs, so a prompt may come twice, not three times
    assert accounting(tmp_path, _replay(consumed_groups=8), num_prompts=7)["trained_twice"] == 0


class _Handle:
    def __init__(self, pid):
        self.pid = pid


def _chaos_roles():
    return SimpleNamespace(workers=[SimpleNamespace(ready=None), SimpleNamespace(ready=None)],
                           pool=SimpleNamespace(pid=lambda i: 1000 + i),
                           retrieval=[SimpleNamespace(health=None)], learner=SimpleNamespace(ping=None))


def _drive(c, run, versions, checkpoint_at=None):
    """Call the hook as the loop does: the step's row (its learner version) logged first. The
    run's first checkpoint appears when the version ``checkpoint_at`` is logged."""
    out = []
    for v in versions:
        from sonar.cluster.wire import metrics as K

        run.history.append({"step": len(run.history), K.LEARNER_VERSION: v})
        if v == checkpoint_at:
            (run.dir / "checkpoints").mkdir(exist_ok=True)
            (run.dir / "checkpoints" / "latest").write_text("step1")
        out.append(c(_chaos_roles(), run, 1, len(out) + 1))
    return out


def _fake_kills(monkeypatch, chaos_mod):
    killed = []

    def fake(self, what, method, step, version, elapsed):
        killed.append((step, what))
        self.events.append({"rl_step": step, "version": version, "t_s": elapsed, "killed": what, "pid": 0})
    monkeypatch.setattr(chaos_mod.Chaos, "_kill", fake)
    return killed


def test_chaos_schedule_counts_rl_learner_steps_not_seconds(tmp_path, monkeypatch):
    """N=12 RL steps, a worker kill every 3, the replica at 12 // 4 = 3, the learner at 12 // 2 = 6
    but only once a checkpoint exists (it appears at RL step 8). SFT ended at version 20, so RL step
    s is version 20 + s. The clock is frozen: time plays no part."""
    from collections import deque

    from sonar.cluster.driver import chaos as chaos_mod

    killed = _fake_kills(monkeypatch, chaos_mod)
    c = chaos_mod.Chaos(steps=12, kill_every=3, seed=3, clock=lambda: 0.0)
    assert c.schedule == {"rollout worker": [3, 6, 9], "retrieval replica": [3], "learner": [6], "rollout worker mid-push": [], "paused rollout worker": [], "paused retrieval replica": []}
    run = SimpleNamespace(dir=tmp_path, history=deque())
    out = _drive(c, run, range(21, 33), checkpoint_at=28)
    assert [s for s, w in killed if w.startswith("rollout worker")] == [3, 6, 9]
    assert [s for s, w in killed if w == "retrieval replica 0"] == [3]
    assert [s for s, w in killed if w == "learner"] == [8]  # due at 6, waits for the checkpoint
    assert out[-1] is True and not any(out[:-1]) and c.ended_by == "steps"  # version 32 = RL step 12
    assert c.kills() == {"rollout worker": 3, "retrieval replica": 1, "learner": 1, "mid-push": 0}
    assert (c.reached, c.calls) == (12, 12)


def test_chaos_schedule_after_a_learner_resume_repeats_no_fault(tmp_path, monkeypatch):
    """The learner is killed at RL step 5 and resumes from its checkpoint at step 3: steps 4 and 5 are
    trained again (versions 4, 5 logged twice) and kill nothing twice; the run ends at step 8, after
    10 logged steps."""
    from collections import deque

    from sonar.cluster.driver import chaos as chaos_mod

    killed = _fake_kills(monkeypatch, chaos_mod)
    c = chaos_mod.Chaos(steps=8, kill_every=4, seed=0, replica_at=2, learner_at=5, clock=lambda: 0.0)
    run = SimpleNamespace(dir=tmp_path, history=deque())
    versions = [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]  # SFT-less: version 0 before RL
    out = _drive(c, run, versions, checkpoint_at=3)
    kinds = [(s, w.rstrip("0123456789").strip()) for s, w in killed]  # which worker is the seed's choice
    assert kinds == [(2, "retrieval replica"), (4, "rollout worker"), (5, "learner")]
    assert out == [False] * 9 + [True] and (c.reached, c.calls) == (8, 10)


def test_chaos_minutes_bound_ends_training_first(tmp_path, monkeypatch):
    """--minutes with --steps: whichever comes first; here 60 s pass at the third RL step of 100."""
    from collections import deque

    from sonar.cluster.driver import chaos as chaos_mod

    _fake_kills(monkeypatch, chaos_mod)
    now = [0.0]
    c = chaos_mod.Chaos(steps=100, kill_every=0, replica_at=0, learner_at=0, minutes=1.0, clock=lambda: now[0])
    assert c.schedule == {"rollout worker": [], "retrieval replica": [], "learner": [], "rollout worker mid-push": [], "paused rollout worker": [], "paused retrieval replica": []}
    run = SimpleNamespace(dir=tmp_path, history=deque())
    out = []
    for v, t in ((1, 0.0), (2, 30.0), (3, 60.0)):
        now[0] = t
        out += _drive(c, run, [v])
    assert out == [False, False, True] and c.ended_by == "minutes" and c.events == []
    with pytest.raises(ValueError, match="steps=0"):
        chaos_mod.Chaos(steps=0, kill_every=3)


def test_chaos_restart_budgets_cover_the_kill_schedule():
    """100 RL steps with a kill every 10 may hit one worker 9 times (steps 10..90): the budget must not
    end the run (it did, at the third kill, with the default cluster.max_worker_restarts=2)."""
    from sonar.cluster.driver.chaos import UNBOUNDED_STEPS, Chaos, chaos_config
    from sonar.cluster.wire.config import load_config

    cfg = load_config([], ["cluster.max_worker_restarts=2", "cluster.auto_resume=0"])
    out = chaos_config(cfg, Chaos(steps=100, kill_every=10))
    assert out.cluster.max_worker_restarts == 10 and out.cluster.auto_resume == 1
    assert all(s.steps == UNBOUNDED_STEPS for s in out.stages if s.kind == "rl")
    big = load_config([], ["cluster.max_worker_restarts=50", "cluster.auto_resume=3"])
    kept = chaos_config(big, Chaos(steps=10, kill_every=3))
    assert (kept.cluster.max_worker_restarts, kept.cluster.auto_resume) == (50, 3)  # never lowered
    no_learner = chaos_config(cfg, Chaos(steps=10, kill_every=0, learner_at=0))
    assert (no_learner.cluster.max_worker_restarts, no_learner.cluster.auto_resume) == (2, 0)


def test_a_starved_learner_fails_past_the_step_deadline_naming_the_replay():
    from types import SimpleNamespace

    from sonar.cluster.driver.faults import LearnerStarved, check_starved, starved_message
    from sonar.cluster.wire.config import load_config

    cfg = load_config([], ["cluster.step_timeout_s=60"])
    check_starved(cfg, SimpleNamespace(replay=None), 60.0)  # at the deadline: still waiting, no call made
    msg = starved_message(cfg, 75.0, {"depth_groups": 7, "outstanding_claims": 0})
    assert "waited 75 s (> cluster.step_timeout_s=60)" in msg and "learner.groups_per_step=8" in msg
    assert "'depth_groups': 7" in msg
    assert issubclass(LearnerStarved, RuntimeError)


def test_chaos_kills_mid_push_at_each_rank_position_in_turn_and_pauses(tmp_path, monkeypatch):
    """A mid-push kill every 2 RL steps of 7 (due after steps 2, 4, 6): each is done at the next push of
    an RL stage (``Hooks.on_pool``'s ``"push_sent"``), on the worker at rank position 0, 1, 2 of three in
    turn; a push outside an RL stage, or with none due, kills nothing. A worker is paused (SIGSTOP) at
    step 3, the replica at 5."""
    from collections import deque

    from sonar.cluster.driver import chaos as chaos_mod

    killed = _fake_kills(monkeypatch, chaos_mod)
    signalled = []
    monkeypatch.setattr(chaos_mod.Chaos, "_signal",
                        lambda self, what, method, step, version, elapsed, sig: signalled.append((step, what, sig)))
    handles = []
    monkeypatch.setattr(chaos_mod.Chaos, "_kill_handle", staticmethod(lambda h: handles.append(h)))
    c = chaos_mod.Chaos(steps=7, kill_every=0, replica_at=0, learner_at=0, push_kill_every=2, pause_at=3,
                        replica_pause_at=5, clock=lambda: 0.0)
    assert c.schedule["rollout worker mid-push"] == [2, 4, 6]
    pool = SimpleNamespace(active=(1, None), workers=["w0", "w1", "w2"])
    run = SimpleNamespace(dir=tmp_path, history=deque())
    for v in range(1, 8):
        _drive(c, run, [v])
        c.pool_event("group_open", pool)  # not a push: nothing
        c.pool_event("push_sent", pool)
    assert handles == ["w0", "w1", "w2"]
    assert [e["killed"] for e in c.events] == [f"rollout worker {i} mid-push" for i in range(3)]
    assert [e["rl_step"] for e in c.events] == [2, 4, 6]
    c.armed = 1
    c.pool_event("push_sent", SimpleNamespace(active=None, workers=["w0"]))  # between stages: not now
    assert handles == ["w0", "w1", "w2"] and c.armed == 1
    import signal
    assert [(s, w.rstrip("0123456789").strip(), sig) for s, w, sig in signalled] == \
        [(3, "rollout worker", signal.SIGSTOP), (5, "retrieval replica", signal.SIGSTOP)]
    assert c.kills()["mid-push"] == 3 and killed == []
