"""actors.rewards pinned against hand-computed values: both normalisations (HotpotQA's official script and
R1-Searcher's metric_calc_rule.py), their metrics, and every trajectory reward and variant.

The metric values were computed by hand from the upstream rules (noted per row) and cross-checked by
running the upstream functions (hotpot_evaluate_v1.py, R1-Searcher evaluation/metric_calc_rule.py) on the
same strings in a scratch script: 0 mismatches on these rows and on 20,000 random strings over the
characters the two normalisations treat differently."""
import asyncio
import re

import pytest

from sonar.actors.prompts import get_protocol
from sonar.actors.rewards import (BUILTIN_REWARDS, PARTS, R1_MAX_ANSWER_WORDS, RewardBreakdown, ResponseText, acc_r, bool_mapping,
                                  exact_match, exact_match_r1, f1, f1_r1, make_reward_fn,
                                  normalize_answer, normalize_answer_r1, r1_format_failures, trajectory_reward)
from sonar.cluster.wire.config import ProtocolConfig, RewardConfig
from sonar.cluster.wire.protocol import FinishReason, SearchCall, Segment, SegmentKind, Trajectory

NORMALISE = [  # (raw, SQuAD/HotpotQA, R1-Searcher)
    ("The Beatles", "beatles", "beatles"),
    ("  a  Tale of   Two Cities. ", "tale of two cities", "tale of two cities"),
    ("An apple, a day!", "apple day", "apple day"),
    ("abacus theatre anthem", "abacus theatre anthem", "abacus theatre anthem"),  # articles only as words
    ("1,000", "1000", "1 000"),                    # deleted vs space
    ("U.S.A.", "usa", "u s"),                      # R1: "u s a" then the article "a" goes
    ("Saint-Denis", "saintdenis", "saint denis"),
    ("New_York", "newyork", "new york"),           # "_" is ASCII punctuation; R1 makes it a space first
    ("O’Brien", "o’brien", "o brien"),             # curly apostrophe: kept by SQuAD, a space in R1
    ("rock`n´roll", "rockn´roll", "rock n roll"),  # ` is ASCII punctuation; ´ is not (SQuAD keeps it)
    ("rock'n'roll", "rocknroll", "rock n roll"),
    ("the-end", "theend", "end"),                  # R1 splits first, so "the" becomes an article
    ("“Paris”", "“paris”", "“paris”"),             # curly double quotes: in neither set
    ("Zürich", "zürich", "zürich"),                # accents kept by both
    ("ÉCOLE", "école", "école"),
    ("True", "true", "true"),                      # bool_mapping is separate (below)
    ("", "", ""),
    ("The", "", ""),
]


@pytest.mark.parametrize("raw,squad,r1", NORMALISE)
def test_normalisations(raw, squad, r1):
    assert normalize_answer(raw) == squad
    assert normalize_answer_r1(raw) == r1


def test_bool_mapping_is_exact_and_case_sensitive():
    assert [bool_mapping(s) for s in ("True", "False", "true", "TRUE", "True ", "yes")] == \
        ["yes", "no", "true", "TRUE", "True ", "yes"]


# (pred, golds, em, f1 (HotpotQA), acc_r, em_r1, f1_r1 (R1-Searcher))
METRICS = [
    ("Paris", ["paris"], 1, 1, 1, 1, 1),
    ("the Beatles", ["Beatles"], 1, 1, 1, 1, 1),
    # the cases: each normalisation wins one
    ("Saint Denis", ["Saint-Denis"], 0, 0, 1, 1, 1),           # SQuAD "saintdenis" != "saint denis"
    ("1000", ["1,000"], 1, 1, 0, 0, 0),                        # R1 gold tokens ["1", "000"] not in ["1000"]
    ("1,000 people", ["1000"], 0, 2 / 3, 0, 0, 0),             # SQuAD P=1/2 R=1; R1 "1 000 people" has no "1000"
    ("New_York", ["New York"], 0, 0, 1, 1, 1),
    ("O’Brien", ["O'Brien"], 0, 0, 1, 1, 1),                   # "o’brien" vs "obrien"; R1 "o brien" both
    ("“Paris”", ["Paris"], 0, 0, 0, 0, 0),                     # neither removes curly double quotes
    ("True", ["yes"], 0, 0, 1, 1, 1),                          # R1 maps True -> yes first
    ("yes", ["True"], 0, 0, 1, 1, 1),
    ("False", ["no"], 0, 0, 1, 1, 1),
    ("true", ["yes"], 0, 0, 0, 0, 0),                          # only the exact string "True"
    ("U.S.A.", ["usa"], 1, 1, 0, 0, 0),                        # R1 "u s" vs "usa"
    # formulas shared by both
    ("Paris France", ["Paris"], 0, 2 / 3, 1, 0, 2 / 3),        # P=1/2, R=1; gold covered
    ("Paris", ["Paris France"], 0, 2 / 3, 0, 0, 2 / 3),        # P=1, R=1/2; "france" missing
    ("france paris", ["Paris, France"], 0, 1, 1, 0, 1),        # order-free containment
    ("new york new york", ["New York"], 0, 2 / 3, 1, 0, 2 / 3),  # Counter overlap 2 of 4 / 2 of 2
    ("London", ["Paris", "london", "the city of London"], 1, 1, 1, 1, 1),  # max over golds
    ("yes", ["no"], 0, 0, 0, 0, 0),
    ("yes indeed", ["yes"], 0, 0, 1, 0, 0),                    # gold yes/no and different -> F1 0
    ("no", ["no way"], 0, 0, 0, 0, 0),                         # prediction yes/no and different -> F1 0
    ("noanswer", ["no answer"], 0, 0, 0, 0, 0),
    ("party", ["art"], 0, 0, 0, 0, 0),                         # tokens, not substrings
    ("", ["Paris"], 0, 0, 0, 0, 0),
    # both sides normalise to nothing: EM 1, F1 0 (no common token; hotpot_evaluate_v1.py returns 0),
    # cover 1 (str.split(" ") gives [""] on both sides)
    ("the", ["a"], 1, 0, 1, 1, 0),
    ("Paris", ["the"], 0, 0, 0, 0, 0),                         # an empty gold covers nothing else
    (None, ["Paris"], 0, 0, 0, 0, 0),                          # no prediction
    ("Paris", [], 0, 0, 0, 0, 0),                              # no gold
]


@pytest.mark.parametrize("pred,golds,em,f,cover,em1,f11", METRICS)
def test_metrics(pred, golds, em, f, cover, em1, f11):
    assert exact_match(pred, golds) == em
    assert f1(pred, golds) == pytest.approx(f)
    assert acc_r(pred, golds) == cover
    assert exact_match_r1(pred, golds) == em1
    assert f1_r1(pred, golds) == pytest.approx(f11)


def test_single_gold_string_accepted():
    assert exact_match("Paris", "paris") == 1.0 and f1("Paris", "paris") == 1.0 and acc_r("Paris", "paris") == 1.0


# ---------------------------------------------------------------- trajectory rewards (Sonar's format)

def traj(prediction="Paris", finish=FinishReason.ANSWERED, searches=1, failed=0, golds=("Paris",)):
    calls = [SearchCall(turn=i, queries=[f"q{i}"], doc_ids=[["d"]], latency_ms=1.0) for i in range(searches)]
    calls += [SearchCall(turn=searches + i, queries=["q"], doc_ids=[[]], latency_ms=1.0, error="timeout")
              for i in range(failed)]
    return Trajectory(traj_id="t", group_id="g", prompt_id="p", actor_id=0, segments=[], searches=calls,
                      finish_reason=finish, golds=list(golds), prediction=prediction)


W = 0.1
# (reward name, trajectory kwargs, expected total, expected parts subset)
REWARDS = [
    ("answer_em", {}, 1.0 + W, {"em": 1.0, "format": 1.0, "penalty": 0.0}),
    ("answer_em", {"prediction": "Rome"}, W, {"em": 0.0, "f1": 0.0, "format": 1.0}),
    ("answer_em", {"prediction": None, "finish": FinishReason.MAX_TURNS}, 0.0, {"format": 0.0}),
    ("answer_em", {"prediction": "Paris", "finish": FinishReason.MALFORMED}, 1.0, {"em": 1.0, "format": 0.0}),
    ("answer_f1", {"prediction": "Paris France"}, 2 / 3 + W, {"f1": 2 / 3, "em": 0.0}),
    ("cover_em", {"prediction": "Paris France"}, 1.0 + W, {"acc_r": 1.0}),
    ("cover_em", {"prediction": "Saint Denis", "golds": ("Saint-Denis",)}, 1.0 + W, {"acc_r": 1.0, "em": 0.0}),
    ("cover_em", {"prediction": None, "finish": FinishReason.MAX_TOKENS}, 0.0, {"acc_r": 0.0}),
    # Search-R1 and RAG-R1 (the same qa_em.py): EM of an answer, no format term at all
    ("search_r1", {}, 1.0, {"em": 1.0, "format": 1.0}),
    ("search_r1", {"prediction": "Rome"}, 0.0, {"em": 0.0, "format": 1.0}),
    ("search_r1", {"prediction": "Paris France"}, 0.0, {"f1": 2 / 3}),
    ("search_r1", {"prediction": "1,000", "golds": ("1000",)}, 1.0, {"em": 1.0, "acc_r": 0.0}),  # SQuAD rules
    ("search_r1", {"prediction": None, "finish": FinishReason.MALFORMED}, 0.0, {}),
    ("rag_r1", {}, 1.0, {"em": 1.0}),
    ("rag_r1", {"prediction": "Paris", "finish": FinishReason.MALFORMED}, 0.0, {"em": 1.0, "format": 0.0}),
    ("rag_r1", {"golds": ("Lyon", "paris")}, 1.0, {"em": 1.0}),
    # R1-Searcher stage 1, paper: 0.5 retrieval (>=1 search call) + 0.5 format; correctness ignored
    ("r1_stage1", {"prediction": "Rome"}, 1.0, {"retrieval": 1.0, "format": 1.0}),
    ("r1_stage1", {"prediction": "Paris", "searches": 0}, 0.5, {"retrieval": 0.0, "format": 1.0}),
    ("r1_stage1", {"prediction": None, "finish": FinishReason.MAX_TURNS, "searches": 3}, 0.5, {"retrieval": 1.0, "format": 0.0}),
    ("r1_stage1", {"prediction": None, "finish": FinishReason.MALFORMED, "searches": 0}, 0.0, {}),
    ("r1_stage1", {"searches": 0, "failed": 1}, 1.0, {"retrieval": 1.0, "num_searches": 1.0, "failed_searches": 1.0}),
    # R1-Searcher stage 2, paper: R1-Searcher's F1 + (format_penalty if broken else 0)
    ("r1_stage2", {"prediction": "Paris France"}, 2 / 3, {"penalty": 0.0, "f1_r1": 2 / 3}),
    ("r1_stage2", {"prediction": "Saint Denis", "golds": ("Saint-Denis",)}, 1.0, {"f1_r1": 1.0, "f1": 0.0}),
    ("r1_stage2", {"prediction": None, "finish": FinishReason.MALFORMED}, -1.0, {"penalty": -1.0, "f1": 0.0}),
    ("r1_stage2", {"prediction": None, "finish": FinishReason.MAX_TURNS}, -1.0, {"penalty": -1.0}),
    ("r1_stage2", {"prediction": None, "finish": FinishReason.MAX_TOKENS}, -1.0, {"penalty": -1.0}),
    ("r1_stage2", {"prediction": "Paris", "finish": FinishReason.MALFORMED}, 0.0, {"f1_r1": 1.0, "penalty": -1.0}),
    ("r1_stage2", {"prediction": None, "finish": FinishReason.RETRIEVAL_ERROR}, 0.0, {"penalty": 0.0, "format": 0.0}),
]


@pytest.mark.parametrize("name,kw,total,parts", REWARDS, ids=[f"{r[0]}-{i}" for i, r in enumerate(REWARDS)])
def test_trajectory_reward(name, kw, total, parts):
    out = trajectory_reward(RewardConfig(name=name, format_weight=W, format_penalty=-1.0), traj(**kw))
    assert isinstance(out, RewardBreakdown)
    assert out.total == pytest.approx(total)
    assert set(out.parts) == set(PARTS)
    for k, v in parts.items():
        assert out.parts[k] == pytest.approx(v), k


def test_default_penalty_is_the_papers_minus_two():
    cfg = RewardConfig(name="r1_stage2")
    assert cfg.format_penalty == -2.0 and cfg.variant == "paper"
    assert trajectory_reward(cfg, traj(prediction=None, finish=FinishReason.MALFORMED)).total == -2.0


def test_search_counts_logged():
    out = trajectory_reward(RewardConfig(name="answer_em"), traj(searches=2, failed=1))
    assert out.parts["num_searches"] == 3.0 and out.parts["failed_searches"] == 1.0


@pytest.mark.parametrize("cfg,kw,match", [
    (RewardConfig(name="nope"), {}, "reward.name='nope'"),
    (RewardConfig(variant="nope"), {}, "reward.variant='nope'"),
    (RewardConfig(name="answer_em"), {"finish": "weird"}, "finish_reason='weird'"),
    (RewardConfig(name="answer_em"), {"prediction": None}, "prediction is None"),
    (RewardConfig(name="r1_stage2", variant="code_qwen"), {}, "pass text= and tags="),
])
def test_trajectory_reward_errors(cfg, kw, match):
    with pytest.raises(ValueError, match=match):
        trajectory_reward(cfg, traj(**kw))


# ---------------------------------------------------------------- R1-Searcher's released reward servers
T = get_protocol("r1_searcher")
Q = f"{T.query_open} capital of france {T.query_close}"
DOCS = f"{T.docs_open} (1) Paris is the capital {T.docs_close}"


def solution(model_before="", answer="Paris", docs=DOCS, model_after=f" {T.think_close} ", query=Q):
    """(full, model) as the servers see the solution after ``Assistant: <think>``: one search, its
    documents, the think close, the answer."""
    parts = [model_before + query, docs, model_after + f"{T.answer_open} {answer} {T.answer_close}"]
    return ResponseText(full="".join(parts), model=parts[0] + parts[2], think_prefilled=True)


def code(variant, name="r1_stage2", penalty=-2.0):
    return RewardConfig(name=name, variant=variant, format_penalty=penalty)


def r(cfg, text, **kw):
    return trajectory_reward(cfg, traj(**kw), text, T)


def test_qwen_server_well_formed_scores_f1():
    out = r(code("code_qwen"), solution(answer="Paris France"), prediction="Paris France")
    assert out.total == pytest.approx(2 / 3) and out.parts["penalty"] == 0.0 and out.parts["format"] == 1.0


LONG = " ".join(["word"] * (R1_MAX_ANSWER_WORDS + 1))
# (text, trajectory kwargs, failures under Qwen, failures under Llama stage 2)
SERVER_RULES = [
    (solution(), {}, [], []),
    (solution(docs=f"{T.docs_open} Assistant coach Paris {T.docs_close}"), {}, ["assistant"], []),  # even in a document
    (solution(model_after=" the assistant says " + T.think_close), {}, ["assistant"], []),
    (solution(answer=LONG), {"prediction": LONG}, ["long answer"], []),
    (solution(answer=" ".join(["w"] * R1_MAX_ANSWER_WORDS)), {"prediction": " ".join(["w"] * R1_MAX_ANSWER_WORDS)}, [], []),
    (solution(model_after=" 巴黎 " + T.think_close), {}, ["cjk"], ["cjk"]),
    (solution(docs=f"{T.docs_open} (1) 巴黎 {T.docs_close}"), {}, [], []),             # CJK only inside documents
    (solution(model_before=T.think_open), {}, ["think/answer tags"], ["think/answer tags"]),  # <think> after prefill
    (solution(model_after=" "), {}, ["think/answer tags"], ["think/answer tags"]),           # no </think>
    (solution(), {"searches": 0, "failed": 1}, ["documents"], ["documents"]),  # "no results": no "(1)" document
    (solution(docs=""), {}, ["documents"], ["documents"]),                     # a query left without documents
    (solution(docs="", query=""), {"searches": 0}, [], []),                    # no search at all is fine in stage 2
    # a query tag in the answer also unbalances the query count (as upstream: count_3 != count_4)
    (solution(answer=f"{T.query_open} x"), {"prediction": f"{T.query_open} x"}, ["documents", "tag in answer"],
     ["documents"]),
    # the Qwen server tests the plain substrings (reward_server_qwen_zero.py:233-237), tag delimiters or not
    (solution(answer="see begin_of_documents"), {"prediction": "see begin_of_documents"}, ["tag in answer"], []),
    (solution(answer="begin_of_query"), {"prediction": "begin_of_query"}, ["tag in answer"], []),
    # no answer anywhere: the answer counts fail; the Qwen server's answer_text is then the whole solution
    # (qwen_zero.py:233), which names begin_of_query; there is no separate finish-reason rule
    (ResponseText(full=Q + DOCS, model=Q), {"prediction": None, "finish": FinishReason.MAX_TOKENS},
     ["think/answer tags", "tag in answer", "long answer"], ["think/answer tags"]),
]


@pytest.mark.parametrize("text,kw,qwen,llama", SERVER_RULES)
def test_server_rules(text, kw, qwen, llama):
    assert r1_format_failures("code_qwen", traj(**kw), text, T) == qwen
    assert r1_format_failures("code_llama", traj(**kw), text, T) == llama
    pred_f1 = 1.0 if kw.get("prediction", "Paris") == "Paris" else 0.0
    answered = kw.get("finish", FinishReason.ANSWERED) == FinishReason.ANSWERED
    assert r(code("code_qwen"), text, **kw).total == pytest.approx(pred_f1 * answered - 2.0 * bool(qwen))
    assert r(code("code_llama", penalty=-1.0), text, **kw).total == pytest.approx(pred_f1 * answered - 1.0 * bool(llama))


def _server(kind: str, solution: str, gold: str) -> float:
    """R1-Searcher's reward servers on one solution (everything after the prompt), restated from the
    released code: qwen_zero.py:109-110 and 184-250, llama_stage2.py:108-109 and 183-227,
    llama_stage1.py:81-82 and 156-200 (one gold; R1-Searcher's normalisation, whose metrics
    test_metric_rows pins)."""
    pred = solution.split("<answer>")[-1].split("</answer>")[0].strip()
    has = "<answer>" in solution and "</answer>" in solution
    counts = {solution.count(t) for t in ("<|begin_of_documents|>\n", "<|end_of_documents|>\n\n", "<|begin_of_query|>",
                                          "<|end_of_query|>", "<|begin_of_documents|>", "<|end_of_documents|>",
                                          "<|begin_of_documents|>\n(1)")}
    think_answer = (solution.count("<think>") == 0 and solution.count("</think>") == 1
                    and solution.count("<answer>") == solution.count("</answer>") == 1)
    outside = re.sub(r"<\|begin_of_documents\|>.*?<\|end_of_documents\|>", "", solution, flags=re.DOTALL)
    cjk = any("\u4e00" <= c <= "\u9fff" for c in outside)
    if kind == "llama_stage1":
        score = 1.0 if has and acc_r(pred, gold) else -1.0
        return score + 0.5 * (len(counts) == 1 and solution.count("<|begin_of_query|>") >= 1) + 0.5 * think_answer
    score = f1_r1(pred, gold) if has else 0.0
    broken = len(counts) != 1 or not think_answer or cjk
    if kind == "qwen":
        broken |= ("Assistant" in solution or "assistant" in solution or "begin_of_query" in pred
                   or "begin_of_documents" in pred or len(pred.split()) > 10)
        return score - 2.0 * broken
    return score - 1.0 * broken


SEARCH = "<|begin_of_query|> capital of france<|end_of_query|>\n\n<|begin_of_documents|>\n(1)Paris   capital\n" \
         "<|end_of_documents|>\n\n"
# (solution, search calls that brought documents back): what the servers score, whichever turn answered
SOLUTIONS = [
    (" so </think>\n\n<answer> Paris </answer>", 0),
    (" first " + SEARCH + " so </think>\n\n<answer> Paris </answer>", 1),
    # the answer written in the turn that then searched; the last turn has none (Sonar scored the last turn only)
    (" </think>\n\n<answer> Paris </answer> to check " + SEARCH + " it holds.", 1),
    (" <answer> Paris </answer> " + SEARCH + " </think>\n\n<answer> Rome </answer>", 1),  # two answers: the last
    (" </think> guess " + SEARCH + " nothing", 1),                                         # no answer anywhere
    (" </think> </answer> x <answer> Paris", 0),                                           # both tags, out of order
    (" </think>\n\n<answer> Paris </answer> " + SEARCH.replace("(1)", ""), 1),           # a block without "(1)"
]


@pytest.mark.parametrize("solution,with_docs", SOLUTIONS)
@pytest.mark.parametrize("finish", [FinishReason.ANSWERED, FinishReason.MALFORMED, FinishReason.MAX_TURNS])
def test_code_variants_score_the_whole_response_as_the_servers_do(solution, with_docs, finish):
    """Side by side with the servers' own rules: the code variants read the answer where the servers do
    (the last <answer> of the whole response, any turn) and ignore the finish reason and the last
    turn's parse (``traj.prediction``, here None)."""
    text = ResponseText(full=solution, model=solution, think_prefilled=True)
    t = traj(prediction=None if finish != FinishReason.ANSWERED else "Paris", finish=finish, searches=with_docs)
    if "(1)" not in solution and "<|begin_of_query|>" in solution:  # the search brought nothing back
        t = traj(prediction=t.prediction, finish=finish, searches=0, failed=1)
    for kind, cfg in (("qwen", code("code_qwen")), ("llama_stage2", code("code_llama", penalty=-1.0)),
                      ("llama_stage1", code("code_llama", name="r1_stage1"))):
        assert trajectory_reward(cfg, t, text, T).total == pytest.approx(_server(kind, solution, "Paris")), kind


def test_an_answer_before_a_later_search_scores_through_the_rollout():
    """R1-Searcher's own rules through the rollout loop (the toy prompt does not prefill <think>, so the model
    opens it): the first turn answers, then searches (a turn that
    ends at <|end_of_query|> is a search, experience_maker.py:1142), the last turn writes no answer. The
    rollout ends malformed with no prediction, and the servers still read the earlier answer: F1 1, and
    the counts hold, so no penalty (Sonar scored only the last turn: 0 - 2)."""
    from sonar.actors.rollout import PromptItem, rollout_groups

    from .test_rollout import TOK, FakeRetriever, ScriptedEngine

    def script(ctx, turn):
        if turn == 0:
            return (f"{T.think_open} {T.think_close} {T.answer_open} paris {T.answer_close} "
                    f"{T.query_open} capital france {T.query_close}")
        return "france is a country [EOS]"

    proto = ProtocolConfig(name="r1_searcher", rules="upstream", on_invalid="end", max_turns=4, docs_per_query=1)
    groups, _ = asyncio.run(rollout_groups(
        [PromptItem("q", "what is the capital of france", ["paris"])], engine=ScriptedEngine(script),
        retriever=FakeRetriever(), tokenizer=TOK, tags=T, proto=proto, temperature=1.0, group_size=1, k=1,
        reward_fn=make_reward_fn(code("code_qwen"), TOK, T)))
    t = groups[0][0]
    assert (t.finish_reason, t.prediction, len(t.searches)) == (FinishReason.MALFORMED, None, 1)
    assert t.reward == pytest.approx(1.0) and t.reward_parts["f1_r1"] == 1.0 and t.reward_parts["penalty"] == 0.0


def test_think_rule_without_prefill_wants_one_think_open():
    base = solution(model_before=T.think_open)
    unfilled = ResponseText(full=base.full, model=base.model, think_prefilled=False)
    assert r1_format_failures("code_qwen", traj(), unfilled, T) == []
    assert r1_format_failures("code_qwen", traj(), ResponseText(solution().full, solution().model, False), T) == \
        ["think/answer tags"]


# Llama stage 1: (+1 if the answer covers the gold else -1) + 0.5 documents rule with >= 1 search + 0.5 think/answer
STAGE1 = [
    (solution(), {}, 2.0, {"retrieval": 1.0, "format": 1.0}),
    (solution(answer="Rome"), {"prediction": "Rome"}, 0.0, {"retrieval": 1.0, "format": 1.0}),
    (solution(answer="Saint Denis"), {"prediction": "Saint Denis", "golds": ("Saint-Denis",)}, 2.0, {"acc_r": 1.0}),
    (solution(docs="", query=""), {"searches": 0}, 1.5, {"retrieval": 0.0, "format": 1.0}),
    (solution(), {"searches": 0, "failed": 1}, 1.5, {"retrieval": 0.0}),
    (solution(model_after=" "), {}, 1.5, {"retrieval": 1.0, "format": 0.0}),
    (ResponseText(full=Q + DOCS, model=Q), {"prediction": None, "finish": FinishReason.MAX_TOKENS}, -0.5,
     {"retrieval": 1.0, "format": 0.0}),
    (ResponseText(full=Q + DOCS, model=Q), {"prediction": None, "finish": FinishReason.RETRIEVAL_ERROR}, 0.0, {}),
]


@pytest.mark.parametrize("text,kw,total,parts", STAGE1)
def test_llama_stage1_server(text, kw, total, parts):
    out = r(code("code_llama", name="r1_stage1"), text, **kw)
    assert out.total == pytest.approx(total) and out.parts["penalty"] == 0.0
    for k, v in parts.items():
        assert out.parts[k] == v, k


class NoDecode:
    def decode(self, ids, skip_special_tokens=False):
        raise AssertionError("decoded")


def test_only_the_r1_code_variants_decode_the_response():
    """Every built-in is a registered function of the sample; only R1-Searcher's released servers read the
    decoded response, so the others never pay for decoding it."""
    t = traj()
    t.segments = [Segment(SegmentKind.MODEL, [5, 6, 7], [0.0, 0.0, 0.0], 0)]
    for name in BUILTIN_REWARDS:
        make_reward_fn(RewardConfig(name=name), NoDecode(), T)(t)
    for cfg in (code("code_qwen"), code("code_llama", name="r1_stage1")):
        with pytest.raises(AssertionError, match="decoded"):
            make_reward_fn(cfg, NoDecode(), T)(t)
    with pytest.raises(ValueError, match="reads the decoded response: pass text= and tags="):
        trajectory_reward(code("code_qwen"), t)  # no text and no tokenizer to decode it with
    with pytest.raises(ValueError, match=r"reward.name='mine' is not one of \['answer_em'"):
        trajectory_reward(RewardConfig(name="mine"), t)


def test_make_reward_fn_decodes_the_rollout_as_the_server_reads_it():
    """Through the real rollout loop with the r1_searcher tags: the decoded response carries the tags
    (special tokens kept), the documents block and the model's think close; the prompt is not part of it."""
    from sonar.actors.rollout import PromptItem, rollout_groups

    from .test_rollout import TOK, FakeRetriever, ScriptedEngine

    def script(ctx, turn):
        if TOK.convert_tokens_to_ids(T.docs_close) not in ctx:
            return f"{T.think_open} {T.query_open} capital of france {T.query_close}"
        return f"{T.think_close} {T.answer_open} paris {T.answer_close}"

    def run(cfg, search_enabled=True):
        groups, _ = asyncio.run(rollout_groups(
            [PromptItem("q0", "what is the capital of france", ["Paris"])], engine=ScriptedEngine(script),
            retriever=FakeRetriever(), tokenizer=TOK, tags=T, proto=ProtocolConfig(),
            temperature=0.0, group_size=1, k=3, reward_fn=make_reward_fn(cfg, TOK, T), search_enabled=search_enabled))
        return groups[0][0]

    t = run(code("code_qwen"))  # the toy prompt does not prefill <think>: the model's own one is the one allowed
    assert t.finish_reason == FinishReason.ANSWERED and t.prediction == "paris"
    assert t.reward == 1.0 and t.reward_parts["format"] == 1.0
    t = run(code("code_qwen"), search_enabled=False)  # "no results": no first document, the -2 penalty
    assert t.reward == -1.0 and t.reward_parts["penalty"] == -2.0
    assert run(code("code_llama", name="r1_stage1")).reward == 2.0
    assert run(RewardConfig(name="r1_stage2")).reward == 1.0  # paper: no decoding needed


# ---------------------------------------------------------------- RewardConfig validation
@pytest.mark.parametrize("overrides,match", [
    (["stages.0.reward.name=r1_stage3"], "stages[0].reward.name='r1_stage3'"),
    (["stages.0.reward.name=r1_stage2", "stages.0.reward.variant=code_mistral"], "stages[0].reward.variant='code_mistral'"),
    (["stages.0.reward.name=answer_em", "stages.0.reward.variant=code_llama"],
     r"stages\[0\].reward.variant='code_llama'.*stages\[0\].reward.name='answer_em'"),
    (["stages.0.reward.name=r1_stage1", "stages.0.reward.variant=code_qwen"],
     r"stages\[0\].reward.variant='code_qwen'.*'r1_stage1'.*no Qwen stage-1"),
    (["stages.0.reward.format_penalty=2.0"], r"stages\[0\].reward.format_penalty=2.0 must be"),
    (["stages.0.reward.format_penalty=nan"], r"stages\[0\].reward.format_penalty=nan must be"),
    (["stages.0.reward.format_weight=-0.1"], r"stages\[0\].reward.format_weight=-0.1 must be"),
])
def test_reward_config_validation_names_field_and_value(overrides, match):
    from sonar.cluster.wire.config import load_config

    with pytest.raises(ValueError, match=match if "\\" in match else re.escape(match)):
        load_config([], overrides)


def test_reward_config_variants_load():
    from sonar.cluster.wire.config import load_config

    for name, variant in [("r1_stage1", "code_llama"), ("r1_stage2", "code_qwen"), ("r1_stage2", "code_llama"),
                          ("search_r1", "paper")]:
        cfg = load_config([], [f"stages.0.reward.name={name}", f"stages.0.reward.variant={variant}"])
        assert (cfg.stages[0].reward.name, cfg.stages[0].reward.variant) == (name, variant)


def test_presets_use_the_released_rewards():
    """search_r1.yaml: Search-R1's EM without a format term; r1_searcher.yaml: the paper's -2; rag_r1.yaml: qa_em."""
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    rl = {n: [s.reward for s in load_config([CONFIG_DIR / f"{n}.yaml"], notes=[]).stages if s.kind == "rl"]
          for n in ("search_r1", "r1_searcher", "rag_r1", "search_r1_tiny", "r1_searcher_tiny", "rag_r1_tiny")}
    for n in ("search_r1", "search_r1_tiny"):
        (sr1,) = rl[n]
        assert sr1.name == "search_r1"
        wrong = traj(prediction="Rome")  # answered, wrong: a format term would pay here; Search-R1 pays 0
        assert trajectory_reward(sr1, wrong).total == 0.0 and trajectory_reward(sr1, traj()).total == 1.0
    # the paper recipe: the Llama servers' rules (stage 2's -1); the tiny one: the paper's formulas and -2
    assert [(r.name, r.variant) for r in rl["r1_searcher"]] == [("r1_stage1", "code_llama"), ("r1_stage2", "code_llama")]
    assert rl["r1_searcher"][1].format_penalty == -1.0
    assert [(r.name, r.variant) for r in rl["r1_searcher_tiny"]] == [("r1_stage1", "paper"), ("r1_stage2", "paper")]
    assert rl["r1_searcher_tiny"][1].format_penalty == -2.0
    assert [r.name for r in rl["rag_r1"]] == [r.name for r in rl["rag_r1_tiny"]] == ["rag_r1"]
