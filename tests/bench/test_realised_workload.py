"""The workload a result realised, beside its label (issue 52): the simulated learner's FLOP account
(``reference.learner_step_s``), the passes its configuration runs, the learner hook charging each step by
the tokens it trained, the realised figures of a run (``async_vs_sync.realised``), ``realised_vs_label`` and
``sonar bench async-vs-sync`` refusing a run that strays from its label. No Ray, no runs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from sonar.bench import async_vs_sync as A
from sonar.bench.sim import reference as R
from sonar.bench.sim.hooks import LearnerTime
from sonar.cluster.wire import metrics as K

N, PEAK = 7.25e9, 989.4e12


# ------------------------------------------------------------------------------------ the FLOP account
@pytest.mark.parametrize("tokens, gpus, mfu, forwards", [(1e6, 2, 0.4, 0), (3.5e5, 6, 0.4, 1), (1.0, 1, 1.0, 3)])
def test_learner_seconds_are_the_closed_form(tokens, gpus, mfu, forwards):
    closed = (6 * N * tokens + 2 * N * tokens * forwards) / (gpus * mfu * PEAK)
    assert R.learner_step_s(tokens, gpus, mfu, updates=1, forwards=forwards) == pytest.approx(closed, rel=1e-12)
    assert R.learner_flops(tokens, 1, forwards) == pytest.approx(6 * N * tokens + 2 * N * tokens * forwards)


def test_a_million_tokens_on_the_reference_learner():
    # 6 x 7.25e9 x 1e6 FLOP / (2 x 0.4 x 989.4e12 FLOP/s) = 54.96 s: 6N only (the old 8N charged 73.3 s)
    assert R.learner_step_s(1e6, R.LEARNER_GPUS, R.LEARNER_MFU) == pytest.approx(54.96, abs=0.01)
    assert R.learner_step_s(0.0, 2, 0.4) == 0.0
    for bad in [dict(gpus=0, mfu=0.4), dict(gpus=1, mfu=0.0), dict(gpus=1, mfu=0.4, forwards=-1)]:
        with pytest.raises(ValueError):
            R.learner_step_s(10.0, **bad)


@pytest.mark.parametrize("algo, critic_mode, train_policy, passes", [
    ({"name": "grpo", "off_policy": "tis"}, "separate", True, (1, 0)),                       # bench.yaml: 6N
    ({"name": "grpo", "off_policy": "tis", "mini_batches": 2}, "separate", True, (1, 1)),    # proximal recompute
    ({"name": "grpo", "off_policy": "decoupled", "ppo_epochs": 2}, "separate", True, (2, 1)),
    ({"name": "grpo", "off_policy": "none", "ppo_epochs": 2}, "separate", True, (2, 0)),     # clips on behaviour
    ({"name": "grpo", "off_policy": "none", "recompute_old_logprobs": True}, "separate", True, (1, 1)),
    ({"name": "grpo", "off_policy": "tis", "kl_coef": 0.001, "kl_mode": "loss", "ppo_epochs": 2}, "separate",
     True, (2, 1 + 2)),                                                                       # ref per epoch
    ({"name": "grpo", "off_policy": "tis", "kl_coef": 0.001, "kl_mode": "reward"}, "separate", True, (1, 2)),
    ({"name": "ppo", "off_policy": "none"}, "separate", True, (2, 1)),                       # critic update + V_old
    ({"name": "ppo", "off_policy": "none"}, "head", True, (1, 2)),
    ({"name": "ppo", "off_policy": "none"}, "separate", False, (1, 1)),                      # critic warm-up
])
def test_learner_passes_follow_rl_step(algo, critic_mode, train_policy, passes):
    assert R.learner_passes(algo, critic_mode, train_policy) == passes


def test_learner_passes_need_a_resolved_algo():
    with pytest.raises(ValueError, match="auto"):
        R.learner_passes({"off_policy": "auto"})


def test_hidden_tokens_per_turn_is_the_clipped_lognormal_mean():
    rng = np.random.default_rng(0)
    x = np.clip(np.exp(math.log(220) + 0.5 * rng.standard_normal(1_000_000)), 1, 1024)
    assert R.hidden_tokens_per_turn() == pytest.approx(x.mean(), rel=2e-3)
    tight = np.clip(np.exp(math.log(220) + 0.5 * rng.standard_normal(1_000_000)), 1, 150)  # clipped 78 % of the time
    assert R.hidden_tokens_per_turn(220, 0.5, 150) == pytest.approx(tight.mean(), rel=2e-3)
    assert R.hidden_tokens_per_turn(16, 0.0, 256) == 16.0


# ------------------------------------------------------------------------------------ the learner hook
def test_the_learner_hook_charges_a_step_by_its_trained_tokens(monkeypatch):
    import time

    monkeypatch.setattr(time, "sleep", lambda s: None)
    lt = LearnerTime(gpus=2, mfu=0.4, updates=1, forwards=0, context_scale=8.0)
    # learner/tokens_per_s x learner/step_time_s = the batch's tiny-world tokens
    a = lt({K.LEARNER_TRAJECTORIES: 64.0, K.LEARNER_STEP_TIME: 0.5, K.LEARNER_TOKENS_PER_S: 5000 / 0.5})
    b = lt({K.LEARNER_TRAJECTORIES: 64.0, K.LEARNER_STEP_TIME: 0.5, K.LEARNER_TOKENS_PER_S: 15000 / 0.5})
    assert a["sim/learner_tokens"] == pytest.approx(8 * 5000) and b["sim/learner_tokens"] == pytest.approx(8 * 15000)
    assert b["sim/learner_compute_s"] == pytest.approx(3 * a["sim/learner_compute_s"])  # same trajectories, 3x tokens
    assert a["sim/learner_compute_s"] == pytest.approx(6 * N * 8 * 5000 / (2 * 0.4 * PEAK))
    # hidden tokens: charged per trained trajectory; an extra forward: 8N instead of 6N
    lh = LearnerTime(gpus=2, mfu=0.4, updates=1, forwards=1, context_scale=8.0, hidden_per_traj=600.0)
    c = lh({K.LEARNER_TRAJECTORIES: 32.0, K.LEARNER_STEP_TIME: 0.5, K.LEARNER_TOKENS_PER_S: 5000 / 0.5})
    assert c["sim/learner_tokens"] == pytest.approx(8 * 5000 + 32 * 600)
    assert c["sim/learner_compute_s"] == pytest.approx(8 * N * (8 * 5000 + 32 * 600) / (2 * 0.4 * PEAK))


def test_the_colocated_switch_is_not_learner_compute(monkeypatch):
    import time

    monkeypatch.setattr(time, "sleep", lambda s: None)
    lt = LearnerTime(gpus=6, mfu=0.4, updates=1, forwards=0, switch_s=1.5)
    out = lt({K.LEARNER_TRAJECTORIES: 8.0, K.LEARNER_STEP_TIME: 0.0, K.LEARNER_TOKENS_PER_S: 1e12})
    assert out["sim/learner_s"] == pytest.approx(out["sim/learner_compute_s"] + 1.5)
    with pytest.raises(ValueError, match="learner_updates"):
        LearnerTime(gpus=1, mfu=0.4, updates=-1, forwards=0)  # an underived SimConfig


# ------------------------------------------------------------------------------------ realised figures
def test_turn_distribution_from_the_tag_counts():
    # 10 trajectories: 2 of one turn, 5 of two, 3 of three; their prompts hold 1 tag on the first turn
    # (the instructions), one more per search step
    rows = {1: 10, 2: 8, 3: 3}
    d = A.turn_distribution(rows)
    assert d["mean"] == pytest.approx((2 * 1 + 5 * 2 + 3 * 3) / 10)
    assert d["p90"] == 3.0 and d["max"] == 3.0
    assert A.turn_distribution({0: 10, 1: 1})["p90"] == 1.0  # 91 % answered at once
    assert A.turn_distribution({}) == {"mean": None, "p90": None, "max": None}


def _res(wall: float = 10.0) -> dict:
    h = [{K.LEARNER_TRAJECTORIES: 32.0, "sim/learner_tokens": 32 * 1200.0, "sim/learner_compute_s": 2.0}
         for _ in range(2)]
    w = {"trajectories": 32.0, "searches": 44.0, "engine_charged_rows": 1000.0, "engine_charged_ctx_tokens": 600_000.0,
         "engine_tail_tokens": 32 * 600.0, "engine_turn_marker_rows_0": 32.0, "engine_turn_marker_rows_1": 32.0,
         "engine_turn_marker_rows_2": 12.0}
    return {"stages": [{"kind": "rl", "history": h, "loop_seconds": wall, "workers": [w, dict(w)], "t_start": 0.0}]}


def test_a_run_reports_what_it_realised():
    from sonar.bench.driver_harness import load_cfg

    cfg, sim = load_cfg([A.CONFIG], R.overrides())
    r = A.realised(_res(), cfg, sim)
    assert r["turns_mean"] == pytest.approx((32 + 32 + 12) / 32) and r["turns_max"] == 3.0
    assert r["searches_mean"] == pytest.approx(44 / 32) and r["decode_context_mean"] == pytest.approx(600)
    assert r["hidden_tokens_per_traj"] == pytest.approx(600) and r["learner_tokens_per_traj"] == pytest.approx(1200)
    # 4 s of FLOP time on 2 learner GPUs over a 10 s loop of 4 + 2 GPUs
    assert r["learner_gpu_share"] == pytest.approx(4.0 * 2 / (10.0 * 6))
    assert R.realised_vs_label(R.label(), r) == []  # this run realised the reference label


# ------------------------------------------------------------------------------------ realised_vs_label
def _matching() -> dict:
    return {k: (lo + hi) / 2 for k, (lo, hi) in R.REALISED.items()}


def test_a_matching_workload_passes_and_the_tolerance_is_each_side():
    lab = R.label()
    assert R.realised_vs_label(lab, _matching()) == []
    edge = {k: hi * (1 + R.TOLERANCE * 0.99) for k, (lo, hi) in R.REALISED.items()}
    assert R.realised_vs_label(lab, edge) == []
    edge = {k: lo * (1 - R.TOLERANCE * 0.99) for k, (lo, hi) in R.REALISED.items()}
    assert R.realised_vs_label(lab, edge) == []


@pytest.mark.parametrize("field", list(R.REALISED))
@pytest.mark.parametrize("kind", ["low", "high", "missing", "nan"])
def test_each_mismatch_names_field_range_value_and_tolerance(field, kind):
    lo, hi = R.REALISED[field]
    r = _matching()
    r[field] = {"low": lo * (1 - 2 * R.TOLERANCE), "high": hi * (1 + 2 * R.TOLERANCE), "missing": None,
                "nan": float("nan")}[kind]
    msgs = R.realised_vs_label(R.label(), r)
    assert len(msgs) == 1
    msg = msgs[0]
    assert msg.startswith(field + ":") and f"{lo:g}-{hi:g}" in msg and f"{R.TOLERANCE:.0%}" in msg
    if kind in ("low", "high"):
        assert f"{r[field]:.4g}" in msg
    else:
        assert "not measured" in msg


def test_the_old_fixed_charge_is_caught():
    r = _matching()
    r["learner_tokens_per_traj"] = 3040.0  # what the learner used to be charged for, whatever was generated
    r["turns_mean"] = 4.0  # the 3-5 turns the label used to claim
    fields = [m.split(":")[0] for m in R.realised_vs_label(R.label(), r)]
    assert fields == ["turns_mean", "learner_tokens_per_traj"]


# ------------------------------------------------------------------------------------ the benchmark's check
def test_the_check_names_the_setting_and_skips_quick_runs_and_rangeless_workloads():
    lab = R.label()
    bad = dict(_matching(), searches_mean=5.0)
    check = A.workload_check(lab, {"sync": _matching(), "async_lag2": bad}, quick=False)
    assert check["passed"] is False and len(check["mismatches"]) == 1
    assert check["mismatches"][0].startswith("async_lag2: searches_mean:")
    assert A.workload_check(lab, {"sync": bad}, quick=True) == {
        "skipped": "quick: plumbing only (the untrained policy on a smaller world cannot realise the label)"}
    assert "skipped" in A.workload_check({"workload": "bench"}, {"sync": bad}, quick=False)
    assert A.workload_check(lab, {"sync": _matching()}, quick=False)["passed"] is True


def _main(monkeypatch, realised: dict, argv: list[str]):
    written = []

    def fake_run(cfg):
        return {}, {"realised": {"sync": realised}, "seeds": [0], "comparison": {}, "cost_model": {},
                    "analysis": {"pipeline_bound_speedup": 1.0}}

    monkeypatch.setattr(A, "run", fake_run)
    monkeypatch.setattr(A, "write_result", lambda name, cfg, metrics, plot, out, extra: written.append(extra) or
                        __import__("pathlib").Path("/nonexistent/x.json"))
    rc = A.main(["--workload", "reference-7b", "--baselines", "sync_full", *argv])
    return rc, written


def test_async_vs_sync_refuses_a_run_that_strays_from_its_label(monkeypatch, capsys):
    bad = dict(_matching(), learner_tokens_per_traj=3040.0)
    rc, written = _main(monkeypatch, bad, [])
    err = capsys.readouterr().err
    assert rc != 0 and written == []  # no result file
    assert "sync: learner_tokens_per_traj: label 800-2000, realised 3040" in err

    rc, written = _main(monkeypatch, bad, ["--accept-mismatch"])
    assert rc == 0 and len(written) == 1
    check = written[0]["workload_check"]
    assert check["accepted"] is True and check["mismatches"][0].startswith("sync: learner_tokens_per_traj:")
    assert written[0]["realised"] == {"sync": bad}

    rc, written = _main(monkeypatch, _matching(), [])
    assert rc == 0 and written[0]["workload_check"]["passed"] is True


def test_the_readme_block_shows_accepted_mismatches():
    import json

    doc = json.loads((A.REPO_ROOT / "bench" / "results" / "async-vs-sync-vm-9e6c75151e.json").read_text())
    plain = A._table_lines(doc)
    doc["extra"]["workload_check"] = {"tolerance": 0.1, "mismatches": ["sync: turns_mean: label 2-3, realised 4"],
                                      "accepted": True}
    lines = A._table_lines(doc)
    assert "- sync: turns_mean: label 2-3, realised 4" in lines and len(lines) > len(plain)


# ------------------------------------------------------------------------------------ the paced engine's counters
def test_the_paced_engine_reports_the_contexts_it_charged_and_the_turns_it_saw():
    from sonar.actors.engine import SamplingParams
    from sonar.bench.sim.paced_engine import PacedContinuousHFEngine
    from tests.actors.test_engine import tiny_model
    from tests.actors.test_engine_continuous import _wait_idle

    charged = []

    def cost(rows, ctx):  # the decode cost the engine charges, recorded
        charged.append((rows, ctx))
        return 0.1

    marker = 5
    prompts = [np.array([3, 4], dtype=np.int32), np.array([3, marker, 4], dtype=np.int32),
               np.array([3, marker, 4, marker, 6], dtype=np.int32), np.array([3, marker, 7], dtype=np.int32)]
    eng = PacedContinuousHFEngine(tiny_model(seed=1), None, max_batch=8, cost=cost, median_tokens=10, sigma=0.0,
                                  max_tokens=20, context_scale=8.0, turn_marker=marker)
    try:
        eng.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0))
        st = _wait_idle(eng)
    finally:
        eng.close()
    assert st["charged_rows"] == sum(r for r, _ in charged) == 4 * 15  # 5 real + 10 tail steps per row
    assert st["charged_ctx_tokens"] == sum(c for _, c in charged)
    assert st["tail_tokens"] == 4 * 10
    # tag counts 0, 1, 2, 1: one first turn, two second turns, one third
    assert {k: v for k, v in st.items() if k.startswith("turn_marker_rows_")} == {
        "turn_marker_rows_0": 1, "turn_marker_rows_1": 2, "turn_marker_rows_2": 1}
    # the first step charges the prompts scaled by 8
    assert charged[0] == (4, 8 * sum(len(p) for p in prompts))
