"""actors.scoring: prediction files -> EM / F1 / cover-EM and the Markdown table."""
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
    assert r.cover_em == pytest.approx(2 / 4)


def test_nested_fields_and_json_list(tmp_path):
    # FlashRAG's intermediate_data.json: a JSON list, prediction under output.pred
    recs = [{"golden_answers": ["Paris"], "output": {"pred": "the Paris"}},
            {"golden_answers": ["Rome", "Roma"], "output": {"pred": "roma"}},
            {"golden_answers": ["Oslo"], "output": {"pred": "Bergen"}}]
    p = tmp_path / "intermediate_data.json"
    p.write_text(json.dumps(recs))
    r = score_predictions(p, pred_field="output.pred")
    assert (r.n, r.em, r.f1, r.cover_em) == (3, pytest.approx(2 / 3), pytest.approx(2 / 3), pytest.approx(2 / 3))


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
        "| dataset | n | EM | F1 | cover-EM |",
        "|---|---:|---:|---:|---:|",
        "| hotpotqa | 4 | 25.0 | 41.7 | 50.0 |",
        "| bamboogle | 2 | 75.0 | 80.0 | 100.0 |",
        "| average (macro) | 6 | 50.0 | 60.8 | 75.0 |",
    ]
    assert "average" not in markdown_table({"x": ScoreReport(1, 1.0, 1.0, 1.0)})


def test_main_prints_table(tmp_path, capsys):
    a = write_jsonl(tmp_path / "hotpotqa" / "test.jsonl", SONAR)
    b = write_jsonl(tmp_path / "bamboogle.jsonl", [{"ans": "x", "gold": "x"}, {"ans": "x", "gold": ["y"]}])
    assert main([str(a)]) == 0
    assert "| hotpotqa/test | 4 | 25.0 | 41.7 | 50.0 |" in capsys.readouterr().out
    assert main([str(b), "--pred-field", "ans", "--gold-field", "gold"]) == 0
    assert "| bamboogle | 2 | 50.0 | 50.0 | 50.0 |" in capsys.readouterr().out


def test_main_error_exit(tmp_path, capsys):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prediction": "a"}])
    assert main([str(p)]) == 2
    err = capsys.readouterr().err
    assert "sonar score: error:" in err and "line 1" in err and "'golden_answers'" in err
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
