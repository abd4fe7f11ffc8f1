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


def test_chaos_schedule_on_a_fake_clock(tmp_path, monkeypatch):
    from sonar.cluster.driver import chaos as chaos_mod

    killed = []
    monkeypatch.setattr(chaos_mod.Chaos, "_kill", lambda self, what, m, t: (killed.append((t, what)),
                                                                             self.events.append(what)))
    now = [0.0]
    c = chaos_mod.Chaos(minutes=1.0, kill_every_s=10.0, seed=3, clock=lambda: now[0])
    roles = SimpleNamespace(workers=[SimpleNamespace(ready=None), SimpleNamespace(ready=None)],
                            retrieval=[SimpleNamespace(health=None)], learner=SimpleNamespace(ping=None))
    run = SimpleNamespace(dir=tmp_path)
    out = []
    for t in range(0, 65, 5):
        now[0] = float(t)
        if t == 45:  # the first checkpoint of the run appears
            (tmp_path / "checkpoints").mkdir()
            (tmp_path / "checkpoints" / "latest").write_text("step1")
        out.append(c(roles, run, 1, t // 5 + 1))
    workers = [t for t, w in killed if w.startswith("rollout worker")]
    assert workers == [10.0, 20.0, 30.0, 40.0, 50.0]
    assert [t for t, w in killed if w == "retrieval replica 0"] == [15.0]
    assert [t for t, w in killed if w == "learner"] == [45.0]  # due at 30 s, waits for a checkpoint
    assert out[-1] is True and not any(out[:-1])  # 60 s: training ends


def test_chaos_restart_budgets_cover_the_kill_schedule():
    """Ten minutes of a kill every 60 s may hit one worker ten times: the budget must not end the run
    (it did, at the third kill, with the default cluster.max_worker_restarts=2)."""
    from sonar.cluster.driver.chaos import UNBOUNDED_STEPS, chaos_config
    from sonar.cluster.wire.config import load_config

    cfg = load_config([], ["cluster.max_worker_restarts=2", "cluster.auto_resume=0"])
    out = chaos_config(cfg, minutes=10, kill_every_s=60)
    assert out.cluster.max_worker_restarts == 11 and out.cluster.auto_resume == 1
    assert all(s.steps == UNBOUNDED_STEPS for s in out.stages if s.kind == "rl")
    big = load_config([], ["cluster.max_worker_restarts=50", "cluster.auto_resume=3"])
    kept = chaos_config(big, minutes=1, kill_every_s=30)
    assert (kept.cluster.max_worker_restarts, kept.cluster.auto_resume) == (50, 3)  # never lowered
