"""The scheduler simulator (``bench/sim/scheduler_sim.py``): it drives the real ``ReplayCore``, its lockstep
step is generation + training + push exactly, an async run is bounded by the slower pool, least-loaded first
spreads claims, and a seed fixes the result. No sleeps, no wall-clock assertions."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sonar.bench.sim import gpu_cost
from sonar.bench.sim.reference import PEAK_BF16_FLOPS
from sonar.bench.sim.scheduler_sim import Sim, Simulator, Tool, Workload, simulate
from sonar.bench.sim.workloads import LONG, SHORT, lognormal_pmf
from sonar.cluster.replay.queue import ReplayCore

# Deterministic: one turn of exactly 100 tokens (sigma 0), no tools, prompt 100 tokens.
FIXED = Workload(name="fixed", calls_pmf=(1.0,), turn_median=100.0, turn_sigma=0.0, turn_max=100,
                 prompt_tokens=100, tools=(Tool("search", 1.0, 0.0, 0.0, 0),), max_context=10_000,
                 group_size=4, row_cap=64, extra_forwards=0, push_s=0.25)


def train_s(w: Workload, trajs: int, tokens_per_traj: float, gpus: int) -> float:
    return 6.0 * w.params * trajs * tokens_per_traj / (gpus * w.mfu * PEAK_BF16_FLOPS)


def gen_s(rows: int, prompt: int, tokens: int) -> float:
    """One engine admitting ``rows`` rows of ``prompt`` tokens at once and decoding ``tokens`` steps."""
    c, p = gpu_cost.Gpu7BCost(), gpu_cost.Prefill7BCost()
    ms = p(rows * prompt) + sum(c(rows, rows * (prompt + k)) for k in range(tokens))
    return ms / 1000.0


def test_the_simulator_calls_replay_core_and_the_accounting_balances():
    calls = {"pool_refusal": 0, "worker_refusal": 0, "claim": 0, "add": 0, "take": 0}

    class Counting(ReplayCore):  # admission is may_claim's two halves, asked apart so a wake can keep one
        def pool_refusal(self, *a, **k):
            calls["pool_refusal"] += 1
            return super().pool_refusal(*a, **k)

        def worker_refusal(self, *a, **k):
            calls["worker_refusal"] += 1
            return super().worker_refusal(*a, **k)

        def claim(self, *a, **k):
            calls["claim"] += 1
            return super().claim(*a, **k)

        def add(self, *a, **k):
            calls["add"] += 1
            return super().add(*a, **k)

        def take(self, *a, **k):
            calls["take"] += 1
            return super().take(*a, **k)

    r = simulate(SHORT, Sim(rollout_gpus=3, learner_gpus=1, groups_per_step=4, versions=4), Counting)
    assert all(v > 0 for v in calls.values()), calls
    assert r["balance"]["balanced"], r["balance"]
    assert r["balance"]["consumed"] == r["trained_trajs"] == 4 * 4 * SHORT.group_size


def test_a_replay_core_that_refuses_every_claim_stops_the_run():
    class Refusing(ReplayCore):
        def pool_refusal(self, *a, **k):
            return "budget"

    with pytest.raises(RuntimeError, match="nothing left to do"):
        simulate(FIXED, Sim(rollout_gpus=1, learner_gpus=1, groups_per_step=1, versions=2), Refusing)


def test_sync_split_step_is_generation_plus_training_plus_push():
    rows = 8  # 2 groups of 4 on one engine
    r = simulate(FIXED, Sim(mode="sync_split", rollout_gpus=1, learner_gpus=2, groups_per_step=2, versions=3))
    expect = gen_s(rows, 100, 100) + train_s(FIXED, rows, 200, 2) + FIXED.push_s
    ends = [0.0] + r["step_end_s"]
    for a, b in zip(ends, ends[1:]):
        assert b - a == pytest.approx(expect, rel=1e-9)


def test_colocated_trains_on_every_gpu_and_pays_the_switch():
    w = replace(FIXED, switch_s=1.5)
    r = simulate(w, Sim(mode="colocated", rollout_gpus=1, learner_gpus=1, groups_per_step=2, versions=2))
    # 2 engines hold one group of 4 each; 2 GPUs train
    expect = gen_s(4, 100, 100) + train_s(w, 8, 200, 2) + 1.5
    assert r["step_end_s"][0] == pytest.approx(expect, rel=1e-9)


def test_the_engine_time_scale_stretches_generation_and_nothing_else():
    w = replace(FIXED, switch_s=1.5)
    r = simulate(w, Sim(mode="colocated", rollout_gpus=1, learner_gpus=1, groups_per_step=2, versions=2,
                        engine_time_scale=1.25))
    assert r["step_end_s"][0] == pytest.approx(1.25 * gen_s(4, 100, 100) + train_s(w, 8, 200, 2) + 1.5, rel=1e-9)


def test_a_learner_bound_async_run_trains_at_the_learner_rate():
    w = replace(FIXED, mfu=0.002, push_s=0.0)  # a learner ~200x slower than generation
    r = simulate(w, Sim(rollout_gpus=2, learner_gpus=1, groups_per_step=2, versions=6, lag=2))
    per_step = train_s(w, 8, 200, 1)
    assert r["trained_traj_per_s"] == pytest.approx(8 / per_step, rel=1e-6)
    assert r["learner_idle_share"] < 0.2


def test_a_rollout_bound_async_run_trains_at_the_engines_rate():
    # one engine, groups of 4 rows, a claim of 1 group at a time per lane, one lane: one group in flight
    w = replace(FIXED, push_s=0.0, mfu=1.0)
    # pause: the new weights apply when the group drains, so no KV recompute is charged in between
    s = Sim(rollout_gpus=1, learner_gpus=1, groups_per_step=1, versions=6, lag=2, lanes=1, groups_per_request=1,
            weight_update="pause")
    r = simulate(w, s)
    g = gen_s(4, 100, 100)
    # the learner's step (4 x 200 tokens at full MFU) hides behind the next group's generation
    assert train_s(w, 4, 200, 1) < g
    assert r["trained_traj_per_s"] == pytest.approx(4 / g, rel=1e-6)
    assert r["rollout_idle_share"] < 0.01


def test_least_loaded_first_spreads_groups_where_the_race_does_not():
    w = replace(FIXED, mfu=0.01, push_s=0.0)  # learner-bound: claims wait for room and race for it
    base = Sim(rollout_gpus=4, learner_gpus=1, groups_per_step=4, versions=8, lag=1, lanes=4,
               groups_per_request=1, just_in_time=False, per_group_put=True, worker_capacity=False)
    spread = simulate(w, replace(base, least_loaded=True))["group_load"]
    race = simulate(w, replace(base, least_loaded=False))["group_load"]
    # a claim goes to the waiting worker holding the fewest groups: every worker gets work; in the race the
    # lanes that waited first take every freed slot and one worker gets nothing
    assert min(spread) > 0 and max(spread) - min(spread) < max(race) - min(race), (spread, race)
    assert min(race) == 0, race


def test_engine_capacity_in_rows_on_the_engine_fills_the_rows_a_search_leaves():
    """Every trajectory makes one 2 s search between two 100-token turns; an engine holds 2 groups of 4 rows.
    Counting claimed groups, the engine idles through each search; counting the rows on it (the worker's
    report with each claim and put), groups start in that time and the engine trains more per second."""
    w = replace(FIXED, calls_pmf=(0.0, 1.0), tools=(Tool("search", 1.0, 2000.0, 0.0, 50),), row_cap=8,
                mfu=1.0, push_s=0.0)
    base = Sim(rollout_gpus=2, learner_gpus=1, groups_per_step=4, versions=8, lag=2, lanes=8, groups_per_request=1)
    claimed = simulate(w, replace(base, decoding_rows=False))
    on_engine = simulate(w, base)
    assert claimed["balance"]["balanced"] and on_engine["balance"]["balanced"]
    assert on_engine["trained_traj_per_s"] > 1.3 * claimed["trained_traj_per_s"], (on_engine, claimed)
    assert on_engine["rollout_idle_share"] < claimed["rollout_idle_share"] - 0.2, (on_engine, claimed)


def test_the_same_seed_gives_the_same_result_and_another_seed_another():
    s = Sim(rollout_gpus=3, learner_gpus=1, groups_per_step=4, versions=4)
    a, b = simulate(SHORT, s), simulate(SHORT, s)
    assert a == b
    assert simulate(SHORT, replace(s, seed=1))["wall_s"] != a["wall_s"]


def test_interrupt_and_pause_both_balance():
    s = Sim(rollout_gpus=3, learner_gpus=1, groups_per_step=4, versions=5, lag=2)
    p = simulate(SHORT, replace(s, weight_update="pause"))
    i = simulate(SHORT, replace(s, weight_update="interrupt"))
    assert p["balance"]["balanced"] and i["balance"]["balanced"]
    assert p["trained_trajs"] == i["trained_trajs"] == 5 * 4 * SHORT.group_size


def test_a_context_cap_ends_trajectories_and_the_kv_budget_bounds_rows():
    w = replace(SHORT, max_context=700, kv_tokens=4 * 700)
    r = simulate(w, Sim(rollout_gpus=2, learner_gpus=1, groups_per_step=2, versions=3))
    assert r["workload"]["final_context_mean"] <= 700
    assert r["workload"]["rows_per_step_mean"] <= 4 + 1e-9


def test_the_lognormal_pmf_sums_to_one_within_its_bounds():
    p = lognormal_pmf(12.0, 0.8, 4, 127)
    assert math.isclose(sum(p), 1.0, rel_tol=1e-9) and all(x == 0 for x in p[:4]) and len(p) == 128


def test_bad_settings_are_refused_with_their_values():
    with pytest.raises(ValueError, match="mode='lockstep'"):
        simulate(FIXED, Sim(mode="lockstep"))
    with pytest.raises(ValueError, match="weight_update='swap'"):
        simulate(FIXED, Sim(weight_update="swap"))
    with pytest.raises(ValueError, match="engine_time_scale=0"):
        simulate(FIXED, Sim(engine_time_scale=0))


def test_the_full_colocated_batch_fills_every_engine_row():
    from sonar.bench import schedule_sim as S

    # 8 GPUs x 64 rows / groups of 8 = 64 groups, twice the async settings' 32
    assert S.full_batch(SHORT, 8) == 64 and S.groups_per_step(SHORT, 8) == 32
    assert S.batches(SHORT, 8) == {"": 32, "_full": 64}
    w = replace(SHORT, tools=(Tool("search", 1.0, 0.0, 0.0, 0),), calls_pmf=(1.0,), turn_sigma=0.0)
    r = simulate(w, Sim(mode="colocated", rollout_gpus=1, learner_gpus=1, groups_per_step=S.full_batch(w, 2),
                        versions=2))
    assert r["workload"]["rows_per_step_mean"] == pytest.approx(64.0)  # one turn each: every row live to the end


def test_the_validation_workload_charges_the_realised_learner_tokens_at_6n():
    from sonar.bench.sim.workloads import validation_workload

    realised = {"searches_per_traj": 1.4, "model_tokens_per_traj": 40.0, "decode_row_steps_per_trained_traj": 620.0,
                "ctx_admitted_mean": 360.0, "zero_signal_share": 0.0, "learner_tokens_per_traj": 1270.0}
    w = validation_workload(realised)
    assert (w.learner_tokens_per_traj, w.extra_forwards) == (1270.0, 0)
    r = simulate(w, Sim(mode="sync_split", rollout_gpus=1, learner_gpus=2, groups_per_step=1, versions=1))
    assert r["learner_gpu_s_per_traj"] == pytest.approx(train_s(w, 1, 1270.0, 1), rel=1e-9)


def test_the_simulator_agrees_with_the_real_run_within_ten_percent():
    """The committed real run (``workloads.VALIDATION_RESULT``): each setting's simulated trained traj/s
    within 10 % of the measured, the engines charged what the real ones measured (five seeds, as the README's
    table)."""
    from sonar.bench import schedule_sim as S

    v = S.validation({"validation_seeds": [0, 1, 2, 3, 4]})
    assert set(v) == {"sync", "sync_full", "colocated", "async_lag2"}
    assert {k: round(x["rel_error"], 3) for k, x in v.items() if abs(x["rel_error"]) > 0.10} == {}


def test_projected_runs_are_long_enough_for_a_steady_state():
    """The projection's runs (``schedule_sim.PROJECTION_VERSIONS`` versions, the first left out) must not
    count work pipelined before their window: on the long workload, async at 4 + 4 GPUs and the default
    batch (8 groups of 8) trains within 15 % of its 10-version rate on each of 2 seeds. With 3 versions it
    trained up to 5x its steady rate, which made the projection's async look 2.5x colocated where it is 0.6x."""
    from sonar.bench import schedule_sim
    from sonar.bench.sim.workloads import LONG

    for seed in (0, 2):
        base = Sim(rollout_gpus=4, learner_gpus=4, groups_per_step=8, seed=seed)
        short_run = simulate(LONG, replace(base, versions=schedule_sim.PROJECTION_VERSIONS))["trained_traj_per_s"]
        steady = simulate(LONG, replace(base, versions=10))["trained_traj_per_s"]
        assert short_run == pytest.approx(steady, rel=0.15), (seed, short_run, steady)


def test_runs_in_several_processes_equal_the_serial_ones():
    """``sonar bench schedule-sim --jobs``: the runs are pure functions of workload and Sim, so spreading them
    over processes changes nothing but the wall clock, and each setting gets its own runs back in order."""
    from sonar.bench.schedule_sim import run_batches

    w = replace(FIXED, calls_pmf=(0.5, 0.5), turn_sigma=0.5, tools=(Tool("search", 1.0, 200.0, 0.5, 50),))
    plan = {"async": [Sim(rollout_gpus=2, learner_gpus=1, groups_per_step=4, versions=3, seed=s) for s in (0, 1)],
            "sync": [Sim(mode="sync_split", rollout_gpus=2, learner_gpus=1, groups_per_step=4, versions=3, seed=2)]}
    serial, forked = run_batches(w, plan, 1), run_batches(w, plan, 2)
    assert list(forked) == ["async", "sync"] and [len(v) for v in forked.values()] == [2, 1]
    assert forked == serial
    assert serial["async"][0] != serial["async"][1]  # two seeds, two runs: the order is kept, not merely the set


@pytest.mark.parametrize("w,sim", [
    (SHORT, Sim(rollout_gpus=6, learner_gpus=2, groups_per_step=32, versions=4)),
    (LONG, Sim(rollout_gpus=6, learner_gpus=2, groups_per_step=64, versions=3)),
    (LONG, Sim(rollout_gpus=6, learner_gpus=2, groups_per_step=64, versions=3, lag=1, weight_update="interrupt", seed=1)),
], ids=["short", "long", "long-lag1-interrupt"])
def test_a_wake_that_asks_only_the_candidates_decides_as_one_that_asks_every_lane(w, sim):
    """A wake leaves out the waiting workers their engine refused whose claims and report have not changed
    since (``Simulator.candidates``): asked, they would be refused again and report the same rows. Asking
    every waiting worker on every wake gives the very same run, and the pruning did leave some out."""
    pruned = []

    class AskEveryone(Simulator):
        @property
        def candidates(self):
            return set(self.waiting)  # a fresh set each time: additions and removals change nothing

        @candidates.setter
        def candidates(self, value):
            pass

    class Counting(Simulator):
        def _wake(self):
            pruned.append(len(self.waiting) - len(self.candidates))
            super()._wake()

    assert AskEveryone(w, sim).run() == Counting(w, sim).run()
    assert max(pruned) > 0


def test_version_blocked_claims_that_wait_keep_the_engines_busy_where_returning_ones_race():
    """The long workload at the default batch (8 groups a version on 6 + 2 GPUs): each push lifts a version
    block. Claims that waited in the queue are granted least loaded first; claims that returned (the rule
    before, ``version_wait=False``) are granted to whichever lane asks first, so one engine takes the
    version's groups while others idle: about half the throughput, the rollout GPUs idle over half the run."""
    s = Sim(rollout_gpus=6, learner_gpus=2, groups_per_step=8, versions=6)
    wait, ret = simulate(LONG, s), simulate(LONG, replace(s, version_wait=False))
    assert wait["balance"]["balanced"] and ret["balance"]["balanced"]
    assert wait["trained_traj_per_s"] > 1.5 * ret["trained_traj_per_s"], (wait, ret)
    assert wait["rollout_idle_share"] < ret["rollout_idle_share"] - 0.15, (wait, ret)


def test_the_whole_gpu_bound_is_the_best_integer_split_and_never_passes_the_overlap_bound():
    from sonar.bench.schedule_sim import whole_gpu_bound

    assert whole_gpu_bound(8, 1.0, 1.0) == 4.0 == 8 / (1.0 + 1.0)  # an even split loses nothing
    assert whole_gpu_bound(8, 3.0, 1.0) == 2.0 == 8 / (3.0 + 1.0)  # 6 + 2: both sides at 2 traj/s
    # g = 1.1 l: the ideal split is 4.19 + 3.81; 4 + 4 leaves the rollout side the bottleneck at 4 / 1.1
    assert whole_gpu_bound(8, 1.1, 1.0) == pytest.approx(4 / 1.1) and 4 / 1.1 < 8 / 2.1
    for g in (0.2, 0.7, 1.3, 5.0):
        assert whole_gpu_bound(16, g, 1.0) <= 16 / (g + 1.0) + 1e-12
