"""bench/stats.py: the t quantile and the seed confidence intervals, pinned on closed forms and on
published table values (not on scipy, which computes them)."""
from __future__ import annotations

import math

import pytest

from sonar.bench.stats import mean_ci, t_quantile, tost_paired, within


@pytest.mark.parametrize("level", [0.1, 0.5, 0.9, 0.95, 0.999])
def test_quantile_solves_the_closed_form_cdfs_for_df_1_2_3(level):
    # P(|T| <= t) for df=1 (Cauchy): 2 atan(t)/pi; df=2: t / sqrt(2 + t^2);
    # df=3: (2/pi) (atan(t/sqrt3) + sqrt3 t / (3 + t^2))
    r3 = math.sqrt(3)
    cdf = {1: lambda t: 2 * math.atan(t) / math.pi, 2: lambda t: t / math.sqrt(2 + t * t),
           3: lambda t: 2 / math.pi * (math.atan(t / r3) + r3 * t / (3 + t * t))}
    for df, f in cdf.items():
        assert f(t_quantile(level, df)) == pytest.approx(level, abs=1e-12)


@pytest.mark.parametrize("df,expected", [(1, 12.7062047), (2, 4.3026527), (3, 3.1824463), (4, 2.7764451),
                                         (5, 2.5705818), (9, 2.2621572), (10, 2.2281389), (30, 2.0422725)])
def test_quantile_matches_the_t_table(df, expected):
    assert t_quantile(0.95, df) == pytest.approx(expected, abs=1e-6)


def test_quantile_inverts_the_closed_forms():
    # df=1: tan(pi * level / 2); df=2: sqrt(2 level^2 / (1 - level^2))
    for level in (0.5, 0.9, 0.95, 0.99):
        assert t_quantile(level, 1) == pytest.approx(math.tan(math.pi * level / 2), rel=1e-10)
        assert t_quantile(level, 2) == pytest.approx(math.sqrt(2 * level ** 2 / (1 - level ** 2)), rel=1e-10)
    assert t_quantile(0.95, 10_000) == pytest.approx(1.959964, abs=1e-3)  # tends to the normal quantile


def test_mean_ci_on_known_numbers():
    ci = mean_ci([1.0, 2.0, 3.0])  # mean 2, sd 1, half = 4.3026527 / sqrt(3)
    assert ci["mean"] == 2.0 and ci["sd"] == pytest.approx(1.0) and ci["n"] == 3
    assert ci["half"] == pytest.approx(4.3026527 / math.sqrt(3), abs=1e-6)
    assert (ci["lo"], ci["hi"]) == pytest.approx((2 - 2.4841377, 2 + 2.4841377), abs=1e-6)
    assert within(4.4, ci) is True and within(4.5, ci) is False and within(-0.49, ci) is False
    two = mean_ci([0.80, 0.84])  # sd = 0.04 / sqrt 2, half = 12.7062047 * 0.02
    assert two["half"] == pytest.approx(12.7062047 * 0.02, abs=1e-7)


def test_one_seed_has_no_interval():
    ci = mean_ci([0.7])
    assert ci["mean"] == 0.7 and math.isnan(ci["lo"]) and math.isnan(ci["half"]) and within(0.7, ci) is None
    with pytest.raises(ValueError, match="no samples"):
        mean_ci([])
    with pytest.raises(ValueError, match="df=0"):
        t_quantile(0.95, 0)


def _run(wall: float, em: float, stale: float, trained: float = 640.0) -> dict:
    keys = ("trained_traj_per_s", "generated_traj_per_s", "generated_tokens_per_s", "generated_per_trained",
            "generated_tokens_per_trained_traj", "decode_row_steps_per_trained_traj", "reward_last")
    m = {k: 1.0 for k in keys}
    m.update(wall_s=wall, wall_with_startup_s=wall + 10, command_s=wall + 20, heldout_em=em, stale_share=stale)
    m["trained_traj_per_s"] = trained / wall  # every run trains the same trajectories unless told otherwise
    return {"metrics": m}


def test_async_vs_sync_compare_pairs_seeds_and_checks_equal_reward():
    from sonar.bench.async_vs_sync import compare

    per = {"sync": [_run(60, 0.80, 0.0), _run(61, 0.81, 0.0), _run(62, 0.82, 0.0)],
           "async_lag2": [_run(30, 0.81, 0.05), _run(31, 0.81, 0.05), _run(32, 0.81, 0.05)],
           "async_lag1": [_run(30, 0.90, 0.2), _run(31, 0.90, 0.2), _run(32, 0.90, 0.2)]}
    out = compare(per, [1, 2])
    sp = out["2"]["speedup_rl_loop"]
    assert sp["values"] == pytest.approx([2.0, 61 / 31, 62 / 32]) and sp["n"] == 3
    assert sp["half"] == pytest.approx(mean_ci([2.0, 61 / 31, 62 / 32])["half"])
    assert out["2"]["speedup_with_startup"]["values"][0] == pytest.approx(70 / 40)
    er = out["2"]["equal_reward"]["heldout_em"]  # sync EM 0.80/0.81/0.82: 0.81 +- 4.3027 * 0.01 / sqrt 3
    assert er["sync_ci95"] == pytest.approx([0.81 - 0.0248414, 0.81 + 0.0248414], abs=1e-6)
    assert er["async_within_sync_ci95"] is True
    assert out["1"]["equal_reward"]["heldout_em"]["async_within_sync_ci95"] is False
    # TOST on the paired differences: lag 2 EM - sync EM = [0.01, 0, -0.01]: mean 0, se 0.01 / sqrt 3, 90 %
    # interval 0 +- 2.9199856 * 0.00577 = +-0.0169, inside +-0.03; lag 1: [0.10, 0.09, 0.08], outside
    t2 = er["tost"]
    assert er["paired_differences"] == pytest.approx([0.01, 0.0, -0.01])
    assert t2["hi"] == pytest.approx(2.9199856 * 0.01 / math.sqrt(3), rel=1e-5) and t2["equivalent"] is True
    assert t2["margin"] == 0.03 and t2["alpha"] == 0.05
    assert out["1"]["equal_reward"]["heldout_em"]["tost"]["equivalent"] is False
    # the reward is 1.0 in every run: differences all 0, equivalent by the mean alone
    assert out["2"]["equal_reward"]["reward_last"]["tost"]["equivalent"] is True
    assert out["2"]["goal"] == {"speedup_ge_2": False, "equal_heldout_em": True, "equal_reward_last": True,
                                "stale_le_10pct": True}
    assert out["1"]["goal"]["stale_le_10pct"] is False and out["1"]["goal"]["equal_heldout_em"] is False
    # a tighter margin than the lag-2 interval's half-width: not shown equivalent
    assert compare(per, [2], {"heldout_em": 0.015})["2"]["goal"]["equal_heldout_em"] is False


def test_speedups_are_per_trained_trajectory():
    """A baseline that trained twice the trajectories in twice the time is as fast: speedup 1 on every clock
    whose extra seconds scale too; the wall ratio alone would say 2."""
    from sonar.bench.async_vs_sync import speedup

    base, run = _run(100, 0.8, 0.0, trained=1280.0), _run(50, 0.8, 0.0)
    assert speedup(base, run, "wall_s") == pytest.approx(1.0)
    assert speedup(base, run, "command_s") == pytest.approx((120 / 1280) / (70 / 640))
    assert speedup(_run(60, 0.8, 0.0), _run(30, 0.8, 0.0), "wall_s") == pytest.approx(2.0)


def test_async_vs_sync_rotates_the_run_order_per_seed():
    from sonar.bench.async_vs_sync import run_order

    settings = ["sync", "lag1", "lag2"]
    orders = [run_order(settings, i) for i in range(6)]
    assert orders[:3] == [["sync", "lag1", "lag2"], ["lag1", "lag2", "sync"], ["lag2", "sync", "lag1"]]
    assert orders[3:] == orders[:3]
    for pos in range(3):  # over 3 seeds, every setting runs once in every position (a Latin square)
        assert sorted(o[pos] for o in orders[:3]) == sorted(settings)
    assert run_order([], 4) == []


def test_results_default_to_the_checkouts_bench_results_else_the_current_directory(tmp_path):
    from pathlib import Path

    from sonar.bench.common import default_out

    root = Path(__file__).resolve().parents[2]
    assert default_out(root) == root / "bench" / "results"
    assert default_out(tmp_path) == tmp_path / "sonar-bench-results"  # e.g. a wheel install run from anywhere


# ------------------------------------------------------------------ TOST (two one-sided tests)
def _cdf_df2(t: float) -> float:  # Student's t with 2 degrees of freedom, closed form
    return 0.5 + t / (2.0 * math.sqrt(2.0 + t * t))


def test_tost_on_three_differences_matches_the_closed_form():
    d = [0.01, -0.02, 0.0]
    mean = -0.01 / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    se = sd / math.sqrt(3)
    r = tost_paired(d, margin=0.05, alpha=0.05)
    assert r["mean"] == pytest.approx(mean) and r["sd"] == pytest.approx(sd) and r["df"] == 2
    assert r["t_lower"] == pytest.approx((mean + 0.05) / se) and r["t_upper"] == pytest.approx((mean - 0.05) / se)
    assert r["p_lower"] == pytest.approx(1 - _cdf_df2((mean + 0.05) / se), abs=1e-12)
    assert r["p_upper"] == pytest.approx(_cdf_df2((mean - 0.05) / se), abs=1e-12)
    assert r["p"] == max(r["p_lower"], r["p_upper"])
    # the 90 % interval: mean +- t(0.95, 2) se, t(0.95, 2) = 2.9199856 (table)
    assert r["hi"] - r["mean"] == pytest.approx(2.9199856 * se, rel=1e-6) and r["level"] == pytest.approx(0.90)
    assert r["equivalent"] is (r["p"] < 0.05)


@pytest.mark.parametrize("seed", range(40))
def test_tost_decides_as_the_90_percent_interval_inside_the_margins(seed):
    import random

    rng = random.Random(seed)
    n = rng.randint(2, 8)
    d = [rng.gauss(rng.uniform(-0.05, 0.05), rng.uniform(0.001, 0.05)) for _ in range(n)]
    r = tost_paired(d, margin=0.04)
    assert r["equivalent"] == (-0.04 < r["lo"] and r["hi"] < 0.04)
    assert r["n"] == n


def test_tost_is_a_level_alpha_test_at_the_margin():
    """Normal differences whose true mean sits on the margin: equivalence is (wrongly) shown in at most
    alpha of the experiments (TOST's size is alpha at the boundary, less inside it for small n)."""
    import numpy as np

    rng = np.random.default_rng(0)
    hits = sum(bool(tost_paired(rng.normal(0.03, 0.02, 5), margin=0.03)["equivalent"]) for _ in range(4000))
    assert hits / 4000 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 4000)
    # and it has power: true mean 0, small spread, shown equivalent almost always
    power = sum(bool(tost_paired(rng.normal(0.0, 0.01, 5), margin=0.03)["equivalent"]) for _ in range(1000))
    assert power / 1000 > 0.95


def test_tost_edge_cases_and_bad_input():
    assert tost_paired([0.01], 0.05)["equivalent"] is None
    assert tost_paired([], 0.05)["equivalent"] is None
    same = tost_paired([0.01, 0.01, 0.01], 0.05)
    assert same["equivalent"] is True and same["p"] == 0.0 and same["lo"] == same["hi"] == pytest.approx(0.01)
    assert tost_paired([0.07, 0.07], 0.05)["equivalent"] is False
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="margin"):
            tost_paired([0.0, 0.1], bad)
    with pytest.raises(ValueError, match="alpha"):
        tost_paired([0.0, 0.1], 0.05, alpha=0.5)
    with pytest.raises(ValueError, match="non-finite"):
        tost_paired([0.0, float("nan")], 0.05)
