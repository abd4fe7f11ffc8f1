"""The one evaluation path: per-question scores, records from greedy rollouts, the summary and its
metric keys. (That training's sharded evaluation and ``sonar eval`` give the same numbers on the same
questions is checked end to end in tests/test_eval_cli.py.)"""
from __future__ import annotations

import asyncio

import pytest

from sonar.actors.evaluation import (SCORES, SUMMARY_FIELDS, eval_metrics, greedy_records, markdown, percent,
                                     question_scores, summarize)
from sonar.actors.rollout import PromptItem
from sonar.cluster.wire.config import ProtocolConfig, RewardConfig

from .test_rollout import TAGS, TOK, FakeRetriever, ScriptedEngine, question_of, tid


def test_question_scores_name_each_normalisation():
    # "the capital paris" vs gold "paris": EM 0; F1 over normalised tokens {capital, paris} vs {paris} = 2/3;
    # ACC_R 1 (every gold token is in the prediction); the same under R1-Searcher's normalisation
    assert question_scores("the capital Paris", ["paris"]) == pytest.approx(
        {"em": 0.0, "f1": 2 / 3, "acc_r": 1.0, "em_r1": 0.0, "f1_r1": 2 / 3})
    assert question_scores("Paris.", ["berlin", "paris"]) == {"em": 1.0, "f1": 1.0, "acc_r": 1.0, "em_r1": 1.0, "f1_r1": 1.0}
    # the cases: HotpotQA deletes the hyphen and the comma, R1-Searcher makes them spaces
    assert question_scores("Saint Denis", ["Saint-Denis"]) == {"em": 0.0, "f1": 0.0, "acc_r": 1.0, "em_r1": 1.0, "f1_r1": 1.0}
    assert question_scores("1000", ["1,000"]) == {"em": 1.0, "f1": 1.0, "acc_r": 0.0, "em_r1": 0.0, "f1_r1": 0.0}
    assert question_scores(None, ["paris"]) == {m: 0.0 for m in SCORES}


def _rec(pred, golds, searches, tokens, latency):
    return {"prediction": pred, "golden_answers": golds, "num_searches": searches, "model_tokens": tokens,
            "latency_s": latency}


def test_summarize_is_the_mean_of_the_question_scores():
    recs = [_rec("paris", ["paris"], 1, 10, 0.5), _rec("the capital paris", ["paris"], 2, 20, 1.5),
            _rec(None, ["berlin"], 0, 30, 1.0), _rec("Saint Denis", ["Saint-Denis"], 0, 20, 1.0)]
    s = summarize(recs)
    assert list(s) == list(SUMMARY_FIELDS)
    assert s["n"] == 4
    assert s["em"] == pytest.approx(1 / 4) and s["f1"] == pytest.approx((1 + 2 / 3) / 4)
    assert s["acc_r"] == pytest.approx(3 / 4) and s["em_r1"] == pytest.approx(2 / 4)
    assert s["f1_r1"] == pytest.approx((1 + 2 / 3 + 1) / 4)
    assert (s["searches_per_q"], s["tokens_per_q"], s["latency_s_per_q"]) == pytest.approx((0.75, 20.0, 1.0))
    assert summarize([]) == {"n": 0, **{f: 0.0 for f in SUMMARY_FIELDS[1:]}}


def test_eval_metrics_use_the_wire_keys():
    from sonar.cluster.wire import metrics as K

    s = summarize([_rec("paris", ["paris"], 1, 10, 0.5)])
    m = eval_metrics("after_search", s)
    assert m[K.EVAL_EM.format(split="after_search")] == 1.0 == m["eval/after_search/em"]
    assert m["eval/after_search/acc_r"] == m["eval/after_search/em_r1"] == m["eval/after_search/f1_r1"] == 1.0
    assert m["eval/after_search/searches_per_question"] == 1.0
    assert len(m) == len(SUMMARY_FIELDS) and all(k.startswith("eval/after_search/") for k in m)
    # the scores in percent (as sonar score prints them), the per-question means as they are
    assert "| a | 1 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 1.000 | 10.000 |" in markdown({"a": s})


def test_one_percent_format_for_eval_and_score():
    from sonar.actors.scoring import ScoreReport, markdown_table

    assert [percent(x) for x in (0.0, 1.0, 0.8667, 1 / 16, 0.00049)] == ["0.0", "100.0", "86.7", "6.2", "0.0"]
    row = {"n": 16, "em": 1 / 16, "f1": 0.8667, "acc_r": 0.5, "em_r1": 0.25, "f1_r1": 0.125,
           "searches_per_q": 1.5, "tokens_per_q": 20.0, "latency_s_per_q": 0.25}
    eval_cells = markdown({"d": row}).splitlines()[2].strip("| ").split(" | ")
    score_cells = markdown_table({"d": ScoreReport(16, 1 / 16, 0.8667, 0.5, 0.25, 0.125)},
                                 ["em", "f1", "acc_r", "em_r1", "f1_r1"]).splitlines()[2].strip("| ").split(" | ")
    assert eval_cells[2:7] == score_cells[2:7] == ["6.2", "86.7", "50.0", "25.0", "12.5"]


def test_greedy_records_batches_in_order_with_scores_and_traces():
    def script(ctx, turn):  # france is answered right after one search, germany wrongly without one
        if question_of(ctx) == "germany":
            return "<answer> paris </answer>"
        searched = tid("<information>") in ctx  # the engine's turn counter spans batches: read the context
        return "<answer> paris </answer>" if searched else "<search> capital of france </search>"

    items = [PromptItem(f"q{i}", f"what is the capital of {c}", [g])
             for i, (c, g) in enumerate([("france", "paris"), ("germany", "berlin"), ("france", "paris")])]
    eng, ret = ScriptedEngine(script), FakeRetriever()
    done = []
    recs = asyncio.run(greedy_records(items, engine=eng, retriever=ret, tokenizer=TOK, tags=TAGS,
                                      proto=ProtocolConfig(), k=3, reward=RewardConfig(name="answer_em"),
                                      batch_size=2, progress=done.append))
    assert done == [2, 1]  # two batches
    assert all(c["params"].temperature == 0.0 for c in eng.calls)  # greedy
    assert [r["id"] for r in recs] == ["q0", "q1", "q2"]
    assert [(r["em"], r["num_searches"], r["finish_reason"]) for r in recs] == [
        (1.0, 1, "answered"), (0.0, 0, "answered"), (1.0, 1, "answered")]
    assert recs[0]["reward"] == pytest.approx(1.0 + RewardConfig().format_weight)
    assert recs[0]["trace"].startswith("question :")
    assert summarize(recs)["em"] == pytest.approx(2 / 3)
    no_search = asyncio.run(greedy_records(items[:1], engine=ScriptedEngine(script), retriever=None, tokenizer=TOK,
                                           tags=TAGS, proto=ProtocolConfig(), k=3, reward=RewardConfig(),
                                           batch_size=4, search_enabled=False))
    assert no_search[0]["searches"][0]["doc_ids"] == [[]]
    with pytest.raises(ValueError, match="eval.batch_size=0"):
        asyncio.run(greedy_records(items, engine=eng, retriever=ret, tokenizer=TOK, tags=TAGS, proto=ProtocolConfig(),
                                   k=3, reward=RewardConfig(), batch_size=0))
