"""sonar bench multi-query (issue 11, RAG-R1's multi-query claim): the per-question bookkeeping and the
aggregation are pinned on hand-built records (fast); the ``--quick`` run checks the plumbing (slow)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sonar.bench import multi_query as M
from sonar.cluster.wire.protocol import Segment, SegmentKind, Trajectory


def _traj(lengths):
    segs = [Segment(kind, np.zeros(n, dtype=np.int32),
                    np.zeros(n, dtype=np.float32) if kind == SegmentKind.MODEL else None)
            for kind, n in lengths]
    return Trajectory("t", "g", "p", 0, segs)


def test_turn_shapes_replay_prefill_and_decode_per_turn():
    P, Mo, R = SegmentKind.PROMPT, SegmentKind.MODEL, SegmentKind.RETRIEVAL
    t = _traj([(P, 10), (Mo, 5), (R, 20), (Mo, 3), (R, 7), (Mo, 4)])
    # turn 1 prefills the 10 prompt tokens; turn 2 has 15 done and prefills 20 document tokens, ...
    assert M.turn_shapes(t) == [(0, 10, 5), (15, 20, 3), (38, 7, 4)]


def test_gpu_cost_replays_each_turn_through_the_calibrated_model():
    from sonar.bench.sim.gpu_cost import Gpu7BCost

    seconds, label = M.gpu_cost_model()
    assert label["available"] and label["decode_cost"] == "gpu_7b" and label["source"]["url"]
    c = Gpu7BCost()
    rec = {"shapes": [(0, 10, 2), (12, 5, 1)], "retrieval_s": 0.004}
    # per turn: one step at the context after the prefill, then one per generated token
    ms = (c(1, 10) + c(1, 10) + c(1, 11)) + (c(1, 17) + c(1, 17))
    assert seconds(rec) == pytest.approx(0.004 + ms / 1e3)
    # closed form of the line: t0 + a + b * ctx / 1000 at one row
    assert c(1, 10) == pytest.approx(c.t0_ms + c.ms_per_row + c.ms_per_1k_ctx * 0.01)


def _rec(qid, parallel, wall, em, turns=2):
    return {"qid": qid, "parallel": parallel, "wall_s": wall, "turns": turns, "retrieval_calls": turns - 1,
            "queries": 2 if parallel else 1, "gen_tokens": 10 * turns, "em": em, "retrieval_s": 0.0,
            "shapes": []}


def test_aggregate_time_saving_natural_mix_and_equal_em_subset():
    runs = []
    for seed, (par_m, seq_m) in enumerate([(2.0, 1.0), (3.0, 1.0)]):
        # single: parallel questions 4 s (3 turns), sequential 1 s; multi: parallel par_m s (2 turns), sequential seq_m
        runs.append({"label": "single", "seed": seed, "records": [
            _rec("p1", True, 4.0, 1.0, 3), _rec("p2", True, 4.0, 1.0, 3), _rec("s1", False, 1.0, 1.0), _rec("s2", False, 1.0, 0.0)]})
        runs.append({"label": "multi", "seed": seed, "records": [
            _rec("p1", True, par_m, 1.0), _rec("p2", True, par_m, 0.0), _rec("s1", False, seq_m, 1.0), _rec("s2", False, seq_m, 0.0)]})
    m, per_seed = M.aggregate(runs, None, p_parallel=0.1)
    # seed 0: all single 2.5 s, multi 1.5 s -> 0.4; seed 1: multi 2.0 s -> 0.2
    assert per_seed["time_saving/wall_s/all"] == pytest.approx([0.4, 0.2])
    assert m["time_saving/wall_s/all"]["mean"] == pytest.approx(0.3)
    assert m["time_saving/wall_s/all"]["ci95"] == pytest.approx(12.7062047 * 0.1414213562 / math.sqrt(2), rel=1e-6)
    assert per_seed["time_saving/wall_s/parallel"] == pytest.approx([0.5, 0.25])
    assert per_seed["time_saving/wall_s/sequential"] == pytest.approx([0.0, 0.0])
    # natural mix, 10 % parallel: single 0.1*4 + 0.9*1 = 1.3; multi 0.1*2 + 0.9 = 1.1 and 0.1*3 + 0.9 = 1.2
    assert per_seed["time_saving/wall_s/natural"] == pytest.approx([1 - 1.1 / 1.3, 1 - 1.2 / 1.3])
    # both right: p1 and s1 -> single (4 + 1) / 2, multi (2 + 1) / 2 and (3 + 1) / 2
    assert per_seed["both_correct/questions"] == [2.0, 2.0]
    assert per_seed["time_saving/wall_s/both_correct"] == pytest.approx([1 - 1.5 / 2.5, 1 - 2.0 / 2.5])
    assert per_seed["em_diff"] == pytest.approx([-0.25, -0.25])
    assert per_seed["single/parallel/turns"] == [3.0, 3.0] and per_seed["multi/parallel/turns"] == [2.0, 2.0]
    v = M.verdict(m, gpu=False)
    assert v["equal_em_within_ci"] is False  # -0.25 on every seed: a zero-width interval excludes 0
    assert v["time_saving_wall_s"]["mean"] == pytest.approx(0.3)


def test_pick_questions_takes_every_parallel_question_first():
    class Q:
        def __init__(self, i, plan):
            self.qid, self.plan = str(i), plan

    qs = [Q(i, [["a", "b"]] if i % 5 == 0 else [["a"], ["b"]]) for i in range(20)]  # 4 parallel
    picked = M.pick_questions(qs, 6)
    assert [q.qid for q in picked] == ["0", "5", "10", "15", "1", "2"]
    assert M.natural_share(qs) == pytest.approx(0.2)


def test_parallel_share_option_defaults_to_hotpotqa_and_is_cited():
    assert M.HOTPOT_SHARE == pytest.approx(0.2008, abs=1e-4)  # 1,487 comparison of 7,405 dev questions
    assert M.FULL["parallel_share"] == M.QUICK["parallel_share"] == M.HOTPOT_SHARE
    ov, desc = M.share_setting(M.HOTPOT_SHARE)
    assert ov == [f"world.parallel_share={M.HOTPOT_SHARE!r}"] and "1,487" in desc["source"]["dataset"]
    assert M.share_setting(None) == ([], {"value": None, "source": "today's embedded world (world.parallel_share unset)"})
    assert M.share_arg("0.5") == 0.5 and M.share_arg("none") is None
    import argparse

    for bad in ("1", "-0.1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--parallel-share"):
            M.share_arg(bad)


@pytest.mark.slow
def test_multi_query_quick(tmp_path):
    from sonar.bench import common, run

    assert run.main(["multi-query", "--quick", "--out", str(tmp_path), "--run-root", str(tmp_path / "runs")]) == 0
    files = sorted(tmp_path.glob("multi-query-*.json"))
    assert len(files) == 1 and files[0].with_suffix(".png").exists()
    doc = json.loads(files[0].read_text())
    common.validate_result(doc)
    m, extra = doc["metrics"], doc["extra"]
    assert doc["allow_dirty"] is True  # told so by tests/bench/conftest.py
    for label in ("single", "multi"):
        for k in M.PER_QUESTION:
            assert m[f"{label}/all/{k}"]["n"] == 2, (label, k)  # one value per seed
    assert extra["cost_models"]["gpu_calibrated"]["decode_cost"] == "gpu_7b"
    assert "multi/all/gpu_s" in m and "time_saving/gpu_s/all" in m and "time_saving/wall_s/all" in m
    assert {r["protocol"] for r in extra["runs"]} == {"rag_r1", "rag_r1_multi"}
    assert extra["verdict"]["em_single"]["n"] == 2
    # the gold demonstrations replayed through the GPU model: a parallel question is one search step
    # under rag_r1_multi and two under rag_r1, so the oracle multi-query policy takes fewer turns
    assert m["oracle/multi/parallel/retrieval_calls"]["mean"] < m["oracle/single/parallel/retrieval_calls"]["mean"]
    assert m["oracle/multi/parallel/turns"]["mean"] < m["oracle/single/parallel/turns"]["mean"]
    assert "oracle_time_saving/gpu_s/natural" in m
    # the world at HotpotQA's comparison share, in both splits, said in the JSON with its source
    share = extra["parallel_share"]
    assert share["value"] == pytest.approx(M.HOTPOT_SHARE) and "HotpotQA" in share["source"]["dataset"]
    assert abs(share["measured_heldout"] - M.HOTPOT_SHARE) < 0.03 and abs(share["measured_train"] - M.HOTPOT_SHARE) < 0.01
    assert extra["natural_parallel_share"] == share["measured_heldout"]
