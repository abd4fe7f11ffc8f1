"""actors.datasets on small invented fixtures (tests/fixtures/datasets), good and broken."""
import gzip
import shutil
from pathlib import Path

import pytest

from sonar.actors.datasets import DatasetError, QAItem, load_dataset

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "datasets"

# (file, fmt to pass, expected source, count, first qid, first golds)
GOOD = [
    ("flashrag_train.jsonl", "auto", "flashrag_train", 6, "train_0", ["Sarn River", "the Sarn"]),
    ("flashrag_train.jsonl", "search_r1", "flashrag_train", 6, "train_0", ["Sarn River", "the Sarn"]),
    ("flashrag/hotpotqa/dev.jsonl", "auto", "hotpotqa", 5, "dev_0", ["Mira Coss"]),
    ("hotpot_dev_distractor.json", "auto", "hotpotqa", 5, "h0001", ["Tin Lantern"]),
    ("2wiki_dev.json", "auto", "2wiki", 5, "w01", ["Ena Hask"]),
    ("2wikimultihop_min.json", "auto", "2wiki", 3, "w01", ["Ena Hask"]),
    ("2wikimultihop_min.json", "hotpotqa", "hotpotqa", 3, "w01", ["Ena Hask"]),
    ("musique_ans_dev.jsonl", "auto", "musique", 5, "2hop__101_202", ["Oskan", "the Oskan language", "Oskani"]),
    ("bamboogle.csv", "auto", "bamboogle", 5, "bamboogle-0", ["Odile Marr"]),
    ("bamboogle_test.json", "auto", "bamboogle", 5, "bamboogle-0", ["Odile Marr"]),
    ("bamboogle_test.jsonl", "auto", "bamboogle", 5, "bamboogle-0", ["Odile Marr"]),
]


@pytest.mark.parametrize("name,fmt,source,count,qid,golds", GOOD, ids=[f"{g[0]}-{g[1]}" for g in GOOD])
def test_load_good(name, fmt, source, count, qid, golds):
    items = load_dataset(FIX / name, fmt=fmt)
    assert len(items) == count
    assert all(isinstance(i, QAItem) and i.source == source and i.question and i.golds for i in items)
    assert items[0].qid == qid and items[0].golds == golds
    assert len({i.qid for i in items}) == count


def test_flashrag_details():
    items = load_dataset(FIX / "flashrag_train.jsonl")
    assert items[3].qid == "flashrag_train-3"           # no id -> <source>-<index>
    assert items[3].golds == ["teal"]                    # a single string gold
    assert items[0].meta == {"metadata.hops": 1, "metadata.note": "fixture"}
    assert items[4].meta == {"metadata.type": "comparison"}  # large metadata fields dropped


def test_hotpot_and_musique_meta():
    hot = load_dataset(FIX / "hotpot_dev_distractor.json")
    assert hot[0].meta == {"type": "comparison", "level": "easy"}   # context/supporting_facts dropped
    assert hot[4].golds == ["3"]                                     # numeric answer kept as text
    mus = load_dataset(FIX / "musique_ans_dev.jsonl")
    assert mus[2].golds == ["1912", "in 1912"]                       # aliases de-duplicated
    assert mus[3].meta == {"answerable": False}
    assert "paragraphs" not in mus[0].meta


def test_source_override_and_gzip(tmp_path):
    gz = tmp_path / "musique_ans_dev.jsonl.gz"
    with open(FIX / "musique_ans_dev.jsonl", "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    items = load_dataset(gz, source="mq")
    assert len(items) == 5 and items[0].source == "mq"


def test_jsonl_named_json(tmp_path):
    p = tmp_path / "nq_dev.json"
    shutil.copy(FIX / "flashrag_train.jsonl", p)
    assert len(load_dataset(p)) == 6


# (file, fmt, substrings the error message must contain: file, location, field)
BAD = [
    ("bad_missing_field.jsonl", "auto", ["bad_missing_field.jsonl", "line 3", "'golden_answers'", "missing"]),
    ("bad_json.jsonl", "auto", ["bad_json.jsonl", "line 2", "invalid JSON"]),
    ("bad_answer_type.jsonl", "auto", ["bad_answer_type.jsonl", "line 2", "'golden_answers[0]'", "got dict"]),
    ("bad_duplicate_id.jsonl", "auto", ["line 3", "'id'", "duplicate id 'a'", "first at line 1"]),
    ("bad_empty_question.jsonl", "auto", ["line 1", "'question'", "empty"]),
    ("bad_hotpot.json", "auto", ["bad_hotpot.json", "record 2", "'question'", "missing"]),
    ("bad_hotpot_answer_list.json", "auto", ["record 1", "'answer'", "got list"]),
    ("bad_musique_aliases.jsonl", "auto", ["line 2", "'answer_aliases'", "got dict"]),
    ("bad_bamboogle.csv", "auto", ["bad_bamboogle.csv", "line 4", "'Answer'", "empty"]),
    ("bad_bamboogle_columns.csv", "auto", ["line 2", "'Question'", "missing"]),
    ("unknown_format.jsonl", "auto", ["cannot detect the format", "fmt="]),
    ("flashrag_train.jsonl", "musique", ["line 1", "'answer'", "missing"]),
    ("flashrag_train.jsonl", "squad", ["fmt='squad'"]),
    ("does_not_exist.jsonl", "auto", ["does_not_exist.jsonl", "no such file"]),
]


@pytest.mark.parametrize("name,fmt,parts", BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_load_errors(name, fmt, parts):
    with pytest.raises(DatasetError) as e:
        load_dataset(FIX / name, fmt=fmt)
    for p in parts:
        assert p in str(e.value), (p, str(e.value))


def test_empty_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    with pytest.raises(DatasetError, match="no records"):
        load_dataset(p)


def test_dataset_error_is_value_error():
    assert issubclass(DatasetError, ValueError)
