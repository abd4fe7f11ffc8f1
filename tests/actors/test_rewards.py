"""Closed-form tests of actors.rewards: normalisation, EM / F1 / cover-EM, trajectory rewards."""
import pytest

from sonar.actors.rewards import (PARTS, RewardBreakdown, cover_em, cover_em_substring, exact_match, f1,
                            normalize_answer, trajectory_reward)
from sonar.cluster.wire.config import RewardConfig
from sonar.cluster.wire.protocol import FinishReason, SearchCall, Trajectory

NORMALISE = [
    ("The Beatles", "beatles"),
    ("  a  Tale of   Two Cities. ", "tale of two cities"),
    ("An apple, a day!", "apple day"),
    ("abacus theatre anthem", "abacus theatre anthem"),   # articles only as whole words
    ("1,000", "1000"),
    ("U.S.A.", "usa"),
    ("Zürich", "zürich"),                                 # accents kept
    ("ÉCOLE", "école"),
    ("“Paris”", "“paris”"),                               # non-ASCII punctuation kept (as SQuAD)
    ("rock'n'roll", "rocknroll"),
    ("", ""),
    ("The", ""),
]


@pytest.mark.parametrize("raw,norm", NORMALISE)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


# (pred, golds, em, f1, cover_em)
METRICS = [
    ("Paris", ["paris"], 1.0, 1.0, 1.0),
    ("the Beatles", ["Beatles"], 1.0, 1.0, 1.0),
    ("1,000", ["1000"], 1.0, 1.0, 1.0),
    ("1 000", ["1000"], 0.0, 0.0, 0.0),
    ("Zurich", ["Zürich"], 0.0, 0.0, 0.0),
    ("ZÜRICH", ["Zürich"], 1.0, 1.0, 1.0),
    ("“Paris”", ["Paris"], 0.0, 0.0, 0.0),
    ("Paris France", ["Paris"], 0.0, 2 / 3, 1.0),            # P=1/2, R=1
    ("Paris", ["Paris France"], 0.0, 2 / 3, 0.0),            # P=1, R=1/2
    ("france paris", ["Paris, France"], 0.0, 1.0, 1.0),      # order-free token containment
    ("new york new york", ["New York"], 0.0, 2 / 3, 1.0),    # Counter overlap: 2 of 4 / 2 of 2
    ("London", ["Paris", "london", "the city of London"], 1.0, 1.0, 1.0),  # max over golds
    ("city of london", ["Paris", "the city of London"], 1.0, 1.0, 1.0),
    ("yes", ["no"], 0.0, 0.0, 0.0),
    ("yes", ["yes"], 1.0, 1.0, 1.0),
    ("yes indeed", ["yes"], 0.0, 0.0, 1.0),                  # HotpotQA: gold yes/no and different -> F1 0
    ("no", ["no way"], 0.0, 0.0, 0.0),                       # HotpotQA: prediction yes/no -> F1 0
    ("noanswer", ["no answer"], 0.0, 0.0, 0.0),
    ("", ["Paris"], 0.0, 0.0, 0.0),
    (None, ["Paris"], 0.0, 0.0, 0.0),
    ("Paris", [], 0.0, 0.0, 0.0),
    ("the", ["a"], 1.0, 1.0, 0.0),                           # both normalise to nothing; cover needs a token
    ("party", ["art"], 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize("pred,golds,em,f,cem", METRICS)
def test_metrics(pred, golds, em, f, cem):
    assert exact_match(pred, golds) == em
    assert f1(pred, golds) == pytest.approx(f)
    assert cover_em(pred, golds) == cem


def test_single_gold_string_accepted():
    assert exact_match("Paris", "paris") == 1.0 and f1("Paris", "paris") == 1.0


@pytest.mark.parametrize("pred,gold,token,substring", [
    ("party", "art", 0.0, 1.0),
    ("france paris", "paris france", 1.0, 0.0),
    ("it is paris france", "Paris, France", 1.0, 1.0),
    ("rome", "paris", 0.0, 0.0),
])
def test_cover_em_readings(pred, gold, token, substring):
    assert cover_em(pred, [gold]) == token
    assert cover_em_substring(pred, [gold]) == substring


# ---------------------------------------------------------------- trajectory rewards

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
    ("cover_em", {"prediction": "Paris France"}, 1.0 + W, {"cover_em": 1.0}),
    ("cover_em", {"prediction": None, "finish": FinishReason.MAX_TOKENS}, 0.0, {"cover_em": 0.0}),
    # R1-Searcher stage 1: 0.5 retrieval (>=1 search call) + 0.5 format; correctness ignored
    ("r1_stage1", {"prediction": "Rome"}, 1.0, {"retrieval": 1.0, "format": 1.0}),
    ("r1_stage1", {"prediction": "Paris", "searches": 0}, 0.5, {"retrieval": 0.0, "format": 1.0}),
    ("r1_stage1", {"prediction": None, "finish": FinishReason.MAX_TURNS, "searches": 3}, 0.5, {"retrieval": 1.0, "format": 0.0}),
    ("r1_stage1", {"prediction": None, "finish": FinishReason.MALFORMED, "searches": 0}, 0.0, {}),
    ("r1_stage1", {"searches": 0, "failed": 1}, 1.0, {"retrieval": 1.0, "num_searches": 1.0, "failed_searches": 1.0}),
    # R1-Searcher stage 2: F1 + (format_penalty if broken else 0)
    ("r1_stage2", {"prediction": "Paris France"}, 2 / 3, {"penalty": 0.0}),
    ("r1_stage2", {"prediction": None, "finish": FinishReason.MALFORMED}, -1.0, {"penalty": -1.0, "f1": 0.0}),
    ("r1_stage2", {"prediction": None, "finish": FinishReason.MAX_TURNS}, -1.0, {"penalty": -1.0}),
    ("r1_stage2", {"prediction": None, "finish": FinishReason.MAX_TOKENS}, -1.0, {"penalty": -1.0}),
    ("r1_stage2", {"prediction": "Paris", "finish": FinishReason.MALFORMED}, 0.0, {"f1": 1.0, "penalty": -1.0}),
    ("r1_stage2", {"prediction": None, "finish": FinishReason.RETRIEVAL_ERROR}, 0.0, {"penalty": 0.0, "format": 0.0}),
    # RAG-R1: EM, only for a well-formed answer
    ("rag_r1", {}, 1.0, {"em": 1.0}),
    ("rag_r1", {"prediction": "Paris France"}, 0.0, {"f1": 2 / 3}),
    ("rag_r1", {"prediction": "Paris", "finish": FinishReason.MALFORMED}, 0.0, {"em": 1.0, "format": 0.0}),
    ("rag_r1", {"golds": ("Lyon", "paris")}, 1.0, {"em": 1.0}),
]


@pytest.mark.parametrize("name,kw,total,parts", REWARDS, ids=[f"{r[0]}-{i}" for i, r in enumerate(REWARDS)])
def test_trajectory_reward(name, kw, total, parts):
    out = trajectory_reward(RewardConfig(name=name, format_weight=W, format_penalty=-1.0), traj(**kw))
    assert isinstance(out, RewardBreakdown)
    assert out.total == pytest.approx(total)
    assert set(out.parts) == set(PARTS)
    for k, v in parts.items():
        assert out.parts[k] == pytest.approx(v), k


def test_paper_penalty_minus_two():
    cfg = RewardConfig(name="r1_stage2", format_penalty=-2.0)
    assert trajectory_reward(cfg, traj(prediction=None, finish=FinishReason.MALFORMED)).total == -2.0


def test_search_counts_logged():
    out = trajectory_reward(RewardConfig(name="answer_em"), traj(searches=2, failed=1))
    assert out.parts["num_searches"] == 3.0 and out.parts["failed_searches"] == 1.0


@pytest.mark.parametrize("cfg_name,kw,match", [
    ("nope", {}, "reward.name='nope'"),
    ("answer_em", {"finish": "weird"}, "finish_reason='weird'"),
    ("answer_em", {"prediction": None}, "prediction is None"),
])
def test_trajectory_reward_errors(cfg_name, kw, match):
    with pytest.raises(ValueError, match=match):
        trajectory_reward(RewardConfig(name=cfg_name), traj(**kw))
