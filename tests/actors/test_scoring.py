"""actors.scoring: prediction files -> ACC_R / EM / F1 (and R1-Searcher's EM / F1) and the Markdown table."""
import json

import pytest

from sonar.actors.scoring import ScoreError, ScoreReport, main, markdown_table, score_predictions


def write_jsonl(path, recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


SONAR = [
    {"prediction": "Paris", "golden_answers": ["Paris"]},                 # em 1, f1 1, cover 1
    {"prediction": "Paris France", "golden_answers": ["Paris"]},          # em 0, f1 2/3, cover 1
    {"prediction": None, "golden_answers": ["Rome"]},                     # no answer: 0
    {"prediction": "yes", "golden_answers": "no"},                        # gold as a string: 0
]


def test_score_sonar_file(tmp_path):
    r = score_predictions(write_jsonl(tmp_path / "hotpotqa.jsonl", SONAR))
    assert r.n == 4
    assert r.em == pytest.approx(1 / 4)
    assert r.f1 == pytest.approx((1 + 2 / 3) / 4)
    assert r.acc_r == pytest.approx(2 / 4)


def test_nested_fields_and_json_list(tmp_path):
    # FlashRAG's intermediate_data.json: a JSON list, prediction under output.pred
    recs = [{"golden_answers": ["Paris"], "output": {"pred": "the Paris"}},
            {"golden_answers": ["Rome", "Roma"], "output": {"pred": "roma"}},
            {"golden_answers": ["Oslo"], "output": {"pred": "Bergen"}}]
    p = tmp_path / "intermediate_data.json"
    p.write_text(json.dumps(recs))
    r = score_predictions(p, pred_field="output.pred")
    assert (r.n, r.em, r.f1, r.acc_r) == (3, pytest.approx(2 / 3), pytest.approx(2 / 3), pytest.approx(2 / 3))


def test_other_field_names_and_list_index(tmp_path):
    recs = [{"pred_ans": "4", "answers": [{"text": "4"}]}, {"pred_ans": 5, "answers": [{"text": "6"}]}]
    r = score_predictions(write_jsonl(tmp_path / "x.jsonl", recs), pred_field="pred_ans", gold_field="answers.0.text")
    assert r.em == pytest.approx(0.5)


def test_literal_dotted_key_wins(tmp_path):
    recs = [{"a.b": "x", "a": {"b": "y"}, "g": "x"}]
    assert score_predictions(write_jsonl(tmp_path / "x.jsonl", recs), pred_field="a.b", gold_field="g").em == 1.0


BAD = [
    ([{"prediction": "a", "golden_answers": ["a"]}, {"pred": "a", "golden_answers": ["a"]}], {},
     ["line 2", "'prediction'", "missing"]),
    ([{"prediction": "a", "golden_answers": ["a"]}, {"prediction": "a"}], {}, ["line 2", "'golden_answers'", "missing"]),
    ([{"prediction": "a", "golden_answers": []}], {}, ["line 1", "'golden_answers'", "empty list"]),
    ([{"prediction": "a", "golden_answers": [None]}], {}, ["line 1", "'golden_answers[0]'", "got NoneType"]),
    ([{"prediction": ["a"], "golden_answers": ["a"]}], {}, ["line 1", "'prediction'", "got list"]),
    (["{not json", {"prediction": "a", "golden_answers": ["a"]}], {}, ["line 1", "invalid JSON"]),
    ([{"out": {"p": "a"}, "golden_answers": ["a"]}], {"pred_field": "out.q"}, ["line 1", "'out.q'", "missing"]),
    ([[1, 2]], {}, ["line 1", "expected a JSON object"]),
]


@pytest.mark.parametrize("recs,kw,parts", BAD)
def test_score_errors(tmp_path, recs, kw, parts):
    p = write_jsonl(tmp_path / "preds.jsonl", recs)
    with pytest.raises(ScoreError) as e:
        score_predictions(p, **kw)
    assert str(p) in str(e.value)
    for s in parts:
        assert s in str(e.value), (s, str(e.value))


def test_markdown_table():
    table = markdown_table({"hotpotqa": ScoreReport(4, 0.25, 0.41666, 0.5),
                            "bamboogle": ScoreReport(2, 0.75, 0.8, 1.0)})
    assert table.splitlines() == [
        "| dataset | n | acc_r | em | f1 |",
        "|---|---:|---:|---:|---:|",
        "| hotpotqa | 4 | 50.0 | 25.0 | 41.7 |",
        "| bamboogle | 2 | 100.0 | 75.0 | 80.0 |",
        "| average (macro) | 6 | 75.0 | 50.0 | 60.8 |",
    ]
    assert "average" not in markdown_table({"x": ScoreReport(1, 1.0, 1.0, 1.0)})
    assert markdown_table({"x": ScoreReport(1, 1.0, 0.5, 0.0, em_r1=0.25, f1_r1=0.125)}, ["f1_r1", "em_r1"]) \
        .splitlines()[2] == "| x | 1 | 12.5 | 25.0 |"
    with pytest.raises(ValueError, match="cover_em"):
        markdown_table({"x": ScoreReport(1, 1.0, 1.0, 1.0)}, ["cover_em"])


# R1-Searcher's own result-file fields (pred_ans, answer) and the cases where the two normalisations part:
# (pred, gold) -> em, f1 (HotpotQA) / acc_r, em_r1, f1_r1 (R1-Searcher), by hand:
R1_FILE = [
    {"pred_ans": "Saint Denis", "answer": "Saint-Denis"},        # 0 0 / 1 1 1
    {"pred_ans": "1000", "answer": "1,000"},                     # 1 1 / 0 0 0
    {"pred_ans": "True", "answer": ["no", "yes"]},               # 0 0 / 1 1 1   (True -> yes)
    {"pred_ans": "New_York City", "answer": "New York"},         # 0 0 / 1 0 0.8 (P 2/3, R 1)
    {"pred_ans": "O’Brien", "answer": "O'Brien"},                # 0 0 / 1 1 1
    {"pred_ans": "the", "answer": "a"},                          # 1 0 / 1 1 0   (both empty: F1 0 in both)
]


def test_r1_searcher_file_scores_as_its_metric_calc_rule(tmp_path, capsys):
    r = score_predictions(write_jsonl(tmp_path / "hotpotqa_500.jsonl", R1_FILE))
    assert (r.n, r.em, r.f1) == (6, pytest.approx(2 / 6), pytest.approx(1 / 6))
    assert (r.acc_r, r.em_r1, r.f1_r1) == (pytest.approx(5 / 6), pytest.approx(4 / 6), pytest.approx(3.8 / 6))
    assert main([str(tmp_path / "hotpotqa_500.jsonl"), "--metrics", "acc_r,em_r1,f1_r1,em,f1"]) == 0
    # metric_calc_rule prints str(round(100 * mean, 1)): 83.3 / 66.7 / 63.3 / 33.3 / 16.7
    assert "| hotpotqa_500 | 6 | 83.3 | 66.7 | 63.3 | 33.3 | 16.7 |" in capsys.readouterr().out


def test_paper_flag_prints_that_papers_columns_in_its_order(tmp_path, capsys):
    """--paper r1_searcher: EM, Cover-EM, F1 under R1-Searcher's normalisation, the order its
    metric_calc_rule.py:200-205 prints them; search_r1: qa_em.py's EM (SQuAD normalisation)."""
    path = write_jsonl(tmp_path / "hotpotqa_500.jsonl", R1_FILE)
    assert main([str(path), "--paper", "r1_searcher"]) == 0
    out = capsys.readouterr().out
    assert "| em_r1 | acc_r | f1_r1 |" in out and "| hotpotqa_500 | 6 | 66.7 | 83.3 | 63.3 |" in out
    assert main([str(path), "--paper", "search_r1"]) == 0
    assert "| hotpotqa_500 | 6 | 33.3 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([str(path), "--paper", "r1_searcher", "--metrics", "em"])
    assert e.value.code == 2 and "--paper r1_searcher chooses the columns" in capsys.readouterr().err


def test_percent_rounds_as_upstream(tmp_path):
    # 1 covered of 16: 6.25 -> round(6.25, 1) == 6.2 (the binary 6.25 is exact; Python rounds half to even)
    recs = [{"prediction": "x", "golden_answers": ["x" if i == 0 else "y"]} for i in range(16)]
    r = score_predictions(write_jsonl(tmp_path / "p.jsonl", recs))
    assert r.acc_r == 1 / 16 and r.percent("acc_r") == 6.2
    assert markdown_table({"p": r}).splitlines()[2] == "| p | 16 | 6.2 | 6.2 | 6.2 |"


def test_main_prints_table(tmp_path, capsys):
    a = write_jsonl(tmp_path / "hotpotqa" / "test.jsonl", SONAR)
    b = write_jsonl(tmp_path / "bamboogle.jsonl", [{"ans": "x", "gold": "x"}, {"ans": "x", "gold": ["y"]}])
    assert main([str(a)]) == 0
    assert "| hotpotqa/test | 4 | 50.0 | 25.0 | 41.7 |" in capsys.readouterr().out
    assert main([str(b), "--pred-field", "ans", "--gold-field", "gold"]) == 0
    assert "| bamboogle | 2 | 50.0 | 50.0 | 50.0 |" in capsys.readouterr().out


def test_main_error_exit(tmp_path, capsys):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prediction": "a"}])
    assert main([str(p)]) == 2
    err = capsys.readouterr().err
    assert "sonar score: error:" in err and "line 1" in err and "'golden_answers'" in err
    with pytest.raises(SystemExit) as e:
        main([str(p), "--metrics", "acc_r,cover_em"])
    assert e.value.code == 2 and "cover_em" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
