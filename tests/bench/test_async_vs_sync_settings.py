"""The settings ``sonar bench async-vs-sync`` compares (bench/async_vs_sync.py): the synchronous baselines
a peer would choose (matched concurrency, colocated), async, and which baseline the headline uses. The
configs are loaded as the benchmark loads them; no Ray, no runs."""
from __future__ import annotations

import pytest

from sonar.bench import async_vs_sync as A
from sonar.bench.driver_harness import load_cfg
from sonar.bench.sim import reference as R
from sonar.bench.sim.hooks import sim_hooks
from sonar.cluster.wire import metrics as K


def _load(base: list[str], mode: str, lag=None):
    cfg0, sim0 = load_cfg([A.CONFIG], base)
    return load_cfg([A.CONFIG], base + A.setting_overrides(mode, lag, cfg0, sim0))


def test_matched_concurrency_fills_every_slot_and_trains_the_same_groups():
    base_cfg, _ = load_cfg([A.CONFIG], [])
    cfg, _ = _load([], "sync_full")
    i = A.rl_stage_index(cfg)
    rows = cfg.learner.groups_per_step * cfg.rollout.group_size
    assert cfg.cluster.mode == "sync" and cfg.replay.max_policy_lag == 0
    assert rows == cfg.rollout.num_workers * cfg.rollout.max_batch_rows  # the step fills every engine slot
    assert rows > base_cfg.learner.groups_per_step * base_cfg.rollout.group_size
    assert (cfg.stages[i].steps * cfg.learner.groups_per_step
            == base_cfg.stages[i].steps * base_cfg.learner.groups_per_step)  # 40 x 16 = 80 x 8 groups


def test_plain_sync_and_async_keep_the_configs_batch():
    sync, _ = _load([], "sync")
    a2, _ = _load([], "async", 2)
    assert sync.learner.groups_per_step == a2.learner.groups_per_step == 8
    assert (sync.cluster.mode, a2.cluster.mode, a2.replay.max_policy_lag, a2.replay.capacity_groups) == \
        ("sync", "async", 2, 16)


def test_colocated_generates_and_trains_on_every_gpu_and_pays_the_switch():
    base, _ = load_cfg([A.CONFIG], R.overrides())
    cfg, sim = _load(R.overrides(), "colocated")
    gpus = R.ROLLOUT_GPUS + R.LEARNER_GPUS
    assert cfg.cluster.mode == "sync" and cfg.rollout.num_workers == gpus
    # Sonar's real colocated placement, at the full batch every engine holds, the same groups trained
    assert cfg.cluster.placement == "colocated"
    assert cfg.learner.groups_per_step * cfg.rollout.group_size == gpus * cfg.rollout.max_batch_rows
    i = A.rl_stage_index(cfg)
    assert (cfg.stages[i].steps * cfg.learner.groups_per_step
            >= base.stages[i].steps * base.learner.groups_per_step)
    assert sim.learner_gpus == gpus and sim.colocated and sim.colocated_switch_s == R.COLOCATED_SWITCH_S
    lt = sim_hooks(sim).on_learner_step
    assert lt.switch_s == R.COLOCATED_SWITCH_S
    assert lt.gpus == gpus and lt.compute_s(1000.0) == pytest.approx(1000.0 / R.learner_tokens_per_s(gpus))
    # the disaggregated async run of the same workload: its own GPUs, no switch
    _, sim_async = _load(R.overrides(), "async", 2)
    assert sim_hooks(sim_async).on_learner_step.switch_s == 0.0 and sim_async.learner_gpus == R.LEARNER_GPUS


def test_colocated_needs_a_simulated_learner():
    with pytest.raises(ValueError, match="colocated"):
        _load([], "colocated")
    with pytest.raises(ValueError, match="not one of"):
        _load([], "lockstep")


def _run(tps: float) -> dict:
    return {"metrics": {"trained_traj_per_s": tps}}


def test_the_headline_baseline_is_the_faster_one():
    per = {"sync": [_run(10), _run(12)], "sync_full": [_run(14), _run(15)], "colocated": [_run(13), _run(13)]}
    assert A.better_baseline(per, ["sync", "sync_full", "colocated"]) == "sync_full"
    assert A.better_baseline(per, ["sync", "colocated"]) == "colocated"
    tie = {"sync": [_run(10)], "sync_full": [_run(10)]}
    assert A.better_baseline(tie, ["sync", "sync_full"]) == "sync"  # a tie keeps the first


def test_compare_against_another_baseline_pairs_its_seeds():
    from tests.bench.test_bench_stats import _run as full_run

    per = {"sync": [full_run(60, 0.8, 0.0), full_run(60, 0.8, 0.0)],
           "sync_full": [full_run(40, 0.8, 0.0), full_run(44, 0.8, 0.0)],
           "async_lag2": [full_run(20, 0.8, 0.05), full_run(22, 0.8, 0.05)]}
    out = A.compare(per, [2], baseline="sync_full")
    assert out["2"]["speedup_rl_loop"]["values"] == pytest.approx([2.0, 2.0])
    assert A.compare(per, [2])["2"]["speedup_rl_loop"]["values"] == pytest.approx([3.0, 60 / 22])


def _res(colocated: bool) -> dict:
    """A two-step RL stage of two workers, as run_training reports it (only what measure reads)."""
    h = [{K.LEARNER_VERSION: v, K.LEARNER_STEP_TIME: 1.0, K.LEARNER_TRAJECTORIES: 32.0, K.LEARNER_GROUPS: 8.0,
          K.LEARNER_GROUPS_ZERO_SIGNAL: 4.0, K.ROLLOUT_REWARD_MEAN: 0.5, K.REPLAY_PRODUCED: 64.0 * v,
          "sim/learner_s": 0.75, "sim/learner_compute_s": 0.5, "sim/learner_tokens": 32 * 3000.0} for v in (1, 2)]
    w = {"gen_s": 5.0, "retrieve_s": 1.0, "model_tokens": 1000.0, "engine_steps": 100.0,
         "engine_live_row_steps": 4000.0, "engine_simulated_s": 8.0, "engine_prefill_s": 1.0,
         "engine_recompute_s": 0.5, "engine_sim_recomputes": 2.0, "engine_overrun_steps": 10.0,
         "engine_overrun_s": 0.2, "engine_ctx_admitted_n": 50.0, "engine_ctx_admitted_tokens": 100_000.0}
    return {"stages": [{"kind": "rl", "history": h, "loop_seconds": 10.0, "workers": [w, dict(w)], "t_start": 0.0}],
            "replay": {"consumed": 128.0, "produced": 128.0, "dropped_stale": 0.0}, "startup_s": 5.0,
            "total_s": 20.0, "eval": None}


@pytest.mark.parametrize("colocated", [False, True])
def test_measure_reports_per_gpu_throughput_mfu_and_where_simulated_time_went(colocated):
    import dataclasses

    from sonar.bench.sim.config import SimConfig

    cfg, _ = load_cfg([A.CONFIG], ["rollout.num_workers=2"])
    sim = SimConfig(decode_cost="gpu_7b", learner_cost="flops_7b", learner_gpus=2 if colocated else 1,
                    learner_updates=1, learner_forwards=1, colocated=colocated)
    m = A.measure(_res(colocated), cfg, dataclasses.replace(sim))["metrics"]
    gpus = 2 if colocated else 3  # colocated: the learner trains on the two rollout GPUs
    assert m["gpus"] == gpus
    assert m["generated_tokens_per_s_per_gpu"] == pytest.approx(8000 / 10 / gpus)
    assert m["trained_tokens_per_s_per_gpu"] == pytest.approx(64 * 3000 / 10 / gpus)
    flops = 8000 * 2 * R.MODEL_PARAMS + 64 * 3000 * (6 + 2) * R.MODEL_PARAMS  # 1 update + 1 forward
    assert m["mfu"] == pytest.approx(flops / (10 * gpus * R.PEAK_BF16_FLOPS))
    assert m["sim_learner_s"] == pytest.approx(1.5) and m["zero_signal_share"] == pytest.approx(0.5)
    assert m["sim_overrun_step_share"] == pytest.approx(20 / 200) and m["ctx_admitted_mean"] == pytest.approx(2000)
    assert (m["sim_prefill_s"], m["sim_recompute_s"], m["sim_recomputes"]) == (2.0, 1.0, 4.0)
    assert m["decode_steps_per_worker"] == 100.0
    # without a simulated learner: no per-GPU figures (the CPU learner is not a GPU)
    assert "mfu" not in A.measure(_res(colocated), cfg)["metrics"]


def test_the_gpu_preset_rolls_out_as_the_benchmark_measured():
    """The settings that won async-vs-sync (bench.yaml) are the GPU preset's: one coroutine per trajectory
    on an engine that batches concurrent calls, and enough batches in flight to fill every engine slot."""
    from sonar.cluster.wire.config import load_config

    bench, _ = load_cfg([A.CONFIG], [])
    gpu = load_config(["gpu"], [], notes=[])  # notes: the cluster's model and data paths are not checked here
    for cfg in (bench, gpu):
        r = cfg.rollout
        assert r.per_trajectory and (r.continuous_batching or r.engine == "vllm")
        assert r.batches_in_flight > 1
        assert r.batches_in_flight * r.groups_per_request * r.group_size >= r.max_batch_rows


def test_the_timeline_lays_out_each_steps_phases_and_engine_occupancy(tmp_path):
    h = [{K.CRIT_WALL: 2.0, K.CRIT_GENERATE_SYNC: 1.5, K.CRIT_LEARNER_COMPUTE: 0.4, K.CRIT_BROADCAST: 0.1},
         {K.CRIT_WALL: 3.0, K.CRIT_GENERATE_SYNC: 2.0, K.CRIT_LEARNER_COMPUTE: 0.8, K.CRIT_BROADCAST: 0.2}]
    res = {"stages": [{"kind": "rl", "t_start": 100.0}], "step_times": [102.0, 105.0],
           # per step end, per worker: (engine steps, live row-steps) so far
           "engine_marks": [[(10.0, 100.0), (10.0, 50.0)], [(30.0, 740.0), (20.0, 50.0)]]}
    tl = A.timeline(h, res, slots=64)
    assert tl["t_end"] == [2.0, 5.0] and tl["phases"]["generate_sync"] == [1.5, 2.0]
    assert tl["phases"]["train"] == [0.4, 0.8] and tl["phases"]["queue_wait"] == [0.0, 0.0]
    # step 2: worker 0 ran 20 steps with 640 live row-steps: 32 rows of 64 slots; worker 1 held no rows
    assert tl["occupancy"] == [[None, None], [pytest.approx(0.5), 0.0]]
    res["engine_marks"][1][1] = (10.0, 50.0)  # worker 1 took no engine step at all over step 2: idle, 0
    assert A.timeline(h, res, 64)["occupancy"][1][1] == 0.0
    # a worker replaced mid-run (the count changes): that step's occupancy is unknown
    res["engine_marks"][1].append((1.0, 1.0))
    assert A.timeline(h, res, 64)["occupancy"][1] == [None, None, None]
    png = tmp_path / "t.png"
    A.plot_timeline({"sync": tl, "async_lag2": tl}, png)
    assert png.stat().st_size > 10_000


def test_ray_is_sized_for_the_largest_settings_roles():
    base, sim = load_cfg([A.CONFIG], R.overrides())
    cfg = A.ray_sizing(base, sim, {"baselines": ["sync", "colocated"], "lags": [2], "overrides": R.overrides()})
    colocated, _ = _load(R.overrides(), "colocated")
    need = (colocated.learner.num_cpus * colocated.learner.num_ranks
            + colocated.rollout.num_workers * colocated.rollout.num_cpus_per_worker
            + colocated.retrieval.replicas * colocated.retrieval.num_cpus_per_replica)
    assert colocated.rollout.num_workers == 6 and cfg.cluster.num_cpus >= need
    fixed, _ = load_cfg([A.CONFIG], ["cluster.num_cpus=3"])
    assert A.ray_sizing(fixed, sim, {"baselines": ["sync"], "lags": [2], "overrides": []}).cluster.num_cpus == 3


def test_steady_state_throughput_leaves_out_the_first_step_and_the_drain():
    # steps end at 10, 12, 14, 16 s into the stage, which ends at 25 s; 8, 8, 8, 8 groups of 4
    res = {"stages": [{"kind": "rl", "history": [], "loop_seconds": 25.0, "workers": [], "t_start": 100.0}],
           "step_times": [110.0, 112.0, 114.0, 116.0]}
    out = A.steady_state(res, [8.0, 8.0, 8.0, 8.0], 4, 25.0)
    assert out["steady_trained_traj_per_s"] == pytest.approx(3 * 8 * 4 / 6.0)
    assert (out["first_step_s"], out["drain_s"]) == (10.0, 9.0)
    assert "steady_trained_traj_per_s" not in A.steady_state(res, [8.0, 8.0], 4, 25.0)  # under 3 steps
    assert A._ratio(2.0, 0.0) != A._ratio(2.0, 0.0)  # NaN, not a ZeroDivisionError


def test_off_policy_by_lag_sums_the_histograms_and_weights_the_shares_by_tokens():
    from sonar.bench.driver_harness import off_policy_by_lag

    hist = K.LEARNER_IS_WEIGHT_LAG_HIST
    h = [{hist.format(lag=0, bin="0.95-1.05"): 90.0, hist.format(lag=0, bin="ge2.0"): 10.0,
          K.LEARNER_IS_BEYOND_CAP_LAG.format(lag=0): 0.1, K.LEARNER_SAMPLING_KL_LAG.format(lag=0): 0.01},
         {hist.format(lag=0, bin="0.95-1.05"): 100.0, hist.format(lag=1, bin="ge2.0"): 50.0,
          hist.format(lag=1, bin="0.95-1.05"): 50.0, K.LEARNER_IS_BEYOND_CAP_LAG.format(lag=0): 0.0,
          K.LEARNER_IS_BEYOND_CAP_LAG.format(lag=1): 0.5}]
    out = off_policy_by_lag(h)
    assert list(out) == ["0", "1"]
    assert out["0"]["hist"] == {"0.95-1.05": 190.0, "ge2.0": 10.0} and out["0"]["tokens"] == 200.0
    assert out["0"]["beyond_cap_share"] == pytest.approx(10 / 200)  # 0.1 of 100, 0 of 100
    assert out["0"]["sampling_kl"] == pytest.approx(0.01)  # only the step that logged it
    assert out["1"]["beyond_cap_share"] == 0.5 and out["1"]["sampling_kl"] is None
