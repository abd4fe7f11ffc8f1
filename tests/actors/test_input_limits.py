"""Inputs past the interpreter's limits become the module's defined error, naming the file (and line):
integers over 4,300 digits, JSON nested 100,000 deep, and truncated or corrupt ``.gz`` archives
(issue 14, "defined errors leak"). Without the handling they escape as ValueError, RecursionError,
EOFError or zlib.error."""
from __future__ import annotations

import gzip
import json

import pytest

from sonar.actors.datasets import DatasetError, load_dataset
from sonar.actors.scoring import ScoreError, score_predictions

HUGE_INT = "1" * 5000  # over sys.get_int_max_str_digits() (4,300)
DEEP = "[" * 100_000 + "]" * 100_000
GOOD_FLASHRAG = json.dumps({"id": "q0", "question": "who?", "golden_answers": ["x"]})
GOOD_PRED = json.dumps({"prediction": "x", "golden_answers": ["x"]})


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("bad, why", [
    ('{"prediction": ' + HUGE_INT + ', "golden_answers": ["x"]}', "digits"),
    (DEEP, "nested too deeply"),
])
def test_score_jsonl_past_a_limit_is_a_score_error_naming_file_and_line(tmp_path, bad, why):
    p = _write(tmp_path / "preds.jsonl", GOOD_PRED + "\n" + bad + "\n")
    with pytest.raises(ScoreError) as e:
        score_predictions(p)
    assert str(e.value).startswith(f"{p}: line 2: invalid JSON") and why in str(e.value)


@pytest.mark.parametrize("bad, why", [(f"[{GOOD_PRED}, {HUGE_INT}]", "digits"), (DEEP, "nested too deeply")])
def test_score_json_list_past_a_limit_is_a_score_error_naming_the_file(tmp_path, bad, why):
    p = _write(tmp_path / "preds.json", bad)
    with pytest.raises(ScoreError) as e:
        score_predictions(p)
    assert str(e.value).startswith(f"{p}: invalid JSON") and why in str(e.value)


@pytest.mark.parametrize("name, text, where, why", [
    ("dev.jsonl", GOOD_FLASHRAG + "\n" + '{"id": "q1", "question": "a", "golden_answers": [' + HUGE_INT + "]}\n",
     "line 2: ", "digits"),
    ("dev.jsonl", GOOD_FLASHRAG + "\n" + DEEP + "\n", "line 2: ", "nested too deeply"),
    ("hotpot.json", "[" + json.dumps({"_id": "a", "question": "q", "answer": "x"}) + ", " + HUGE_INT + "]", "", "digits"),
    ("hotpot.json", DEEP, "", "nested too deeply"),
    ("wrapped.json", '{"data": ' + DEEP + "}", "", "nested too deeply"),
    ("wrapped.json", '{"data": [' + HUGE_INT + "]}", "", "digits"),
])
def test_dataset_past_a_limit_is_a_dataset_error_naming_the_file(tmp_path, name, text, where, why):
    p = _write(tmp_path / name, text)
    with pytest.raises(DatasetError) as e:
        load_dataset(p)
    assert str(e.value).startswith(f"{p}: {where}invalid JSON") and why in str(e.value), str(e.value)


def _gz_lines(path, n: int = 3000):
    data = "".join(json.dumps({"id": f"q{i}", "question": f"question number {i} about thing {i * 7}?",
                               "golden_answers": [f"answer {i}"]}) + "\n" for i in range(n)).encode()
    path.write_bytes(gzip.compress(data))
    return path


def test_a_truncated_gz_dataset_is_a_dataset_error_naming_the_file(tmp_path):
    p = _gz_lines(tmp_path / "dev.jsonl.gz")
    assert len(load_dataset(p)) == 3000  # intact, it loads
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with pytest.raises(DatasetError, match=r"truncated or corrupt gzip archive") as e:
        load_dataset(p)
    assert str(e.value).startswith(f"{p}: ")


def test_a_corrupt_gz_dataset_is_a_dataset_error_naming_the_file(tmp_path):
    p = _gz_lines(tmp_path / "dev.jsonl.gz")
    raw = bytearray(p.read_bytes())
    for i in range(len(raw) // 3, len(raw) // 3 + 64):  # scramble the deflate stream in the middle
        raw[i] ^= 0xA5
    p.write_bytes(bytes(raw))
    with pytest.raises(DatasetError) as e:
        load_dataset(p)
    assert str(e.value).startswith(f"{p}: ")
