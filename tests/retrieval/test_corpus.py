"""Corpus reading (formats, bad input naming file:line), fingerprints, query normalisation."""
import gzip
import json
import logging
import os

import pytest

from sonar.retrieval.corpus import (CorpusError, CorpusReader, Passage, corpus_fingerprint, iter_corpus, normalise_query,
                              split_contents, write_synthetic_corpus)


def write_lines(path, lines, mode="w"):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return path


def test_reads_both_formats_and_int_ids(tmp_path):
    p = write_lines(tmp_path / "c.jsonl", [
        json.dumps({"id": "a", "title": "Paris", "text": "Paris is the capital of France."}),
        json.dumps({"id": 7, "contents": '"Lyon"\nLyon is a city.\nSecond line.'}),
        json.dumps({"id": "c", "contents": "No newline here"}),
        json.dumps({"id": "d", "text": "untitled"}),
    ])
    got = list(iter_corpus(p))
    assert got == [
        Passage("a", "Paris", "Paris is the capital of France."),
        Passage("7", "Lyon", "Lyon is a city.\nSecond line."),
        Passage("c", "No newline here", ""),
        Passage("d", "", "untitled"),
    ]


def test_split_contents_quotes():
    assert split_contents('"A "B" C"\ntext') == ('A "B" C', "text")
    assert split_contents("Plain\ntext\nmore") == ("Plain", "text\nmore")


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    (json.dumps({"title": "t", "text": "x"}), "missing 'id'"),
    (json.dumps({"id": "", "text": "x"}), "empty 'id'"),
    (json.dumps({"id": "   ", "text": "x"}), "empty 'id'"),
    (json.dumps({"id": None, "text": "x"}), "missing 'id'"),
    (json.dumps({"id": [1], "text": "x"}), "'id' must be a string or integer"),
    (json.dumps({"id": "z"}), "neither 'text' nor 'contents'"),
    (json.dumps({"id": "z", "text": 5}), "must be strings"),
])
def test_bad_line_names_file_and_line(tmp_path, line, reason):
    p = write_lines(tmp_path / "bad.jsonl", [json.dumps({"id": "ok", "text": "fine"}), "", line])
    with pytest.raises(CorpusError) as ei:
        list(CorpusReader(p))
    msg = str(ei.value)
    assert f"{p}:3:" in msg and reason in msg
    assert ei.value.line == 3


def test_skip_mode_counts_and_warns(tmp_path, caplog):
    p = write_lines(tmp_path / "c.jsonl", [json.dumps({"id": "a", "text": "x"}), "{oops", json.dumps({"id": "b", "text": "y"})])
    r = CorpusReader(p, on_error="skip")
    with caplog.at_level(logging.WARNING):
        assert [x.doc_id for x in r] == ["a", "b"]
    assert r.stats.skipped == 1 and r.stats.passages == 2
    assert f"{p}:2" in caplog.text


def test_invalid_utf8_replaced_counted_and_warned(tmp_path, caplog):
    good = json.dumps({"id": "a", "text": "caf"}).encode()
    bad = b'{"id": "b", "text": "caf\xe9 \xff"}'
    p = write_lines(tmp_path / "c.jsonl", [good, bad])
    r = CorpusReader(p)
    with caplog.at_level(logging.WARNING):
        got = list(r)
    assert got[1].text == "caf\ufffd \ufffd"
    assert r.stats.bad_utf8 == 1 and r.stats.bad_utf8_lines == [2]
    assert f"{p}:2: invalid UTF-8" in caplog.text


def test_control_characters_stripped_blank_lines_skipped(tmp_path):
    p = write_lines(tmp_path / "c.jsonl", [
        json.dumps({"id": "a\x00", "title": "T\x1bi\x7ftle", "text": "keep\ttab\nand newline\x07\x9b"}),
        "   ",
        "",
    ])
    r = CorpusReader(p)
    (x,) = list(r)
    assert x == Passage("a", "Title", "keep\ttab\nand newline")
    assert r.stats.control_stripped == 1 and r.stats.blank == 2 and r.stats.lines == 3


def test_gzip_and_records_after_line(tmp_path):
    raw = "".join(json.dumps({"id": str(i), "text": f"t{i}"}) + "\n" for i in range(5))
    p = tmp_path / "c.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(raw)
    recs = list(CorpusReader(p).records(after_line=3))
    assert [(n, x.doc_id) for n, x in recs] == [(4, "3"), (5, "4")]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        CorpusReader(tmp_path / "nope.jsonl")


def test_fingerprint_stable_and_sensitive(tmp_path):
    p = write_lines(tmp_path / "c.jsonl", [json.dumps({"id": "a", "text": "x"})])
    f1 = corpus_fingerprint(p)
    assert f1 == corpus_fingerprint(p) and len(f1) == 16
    write_lines(p, [json.dumps({"id": "a", "text": "y"})])
    os.utime(p, ns=(1, 1))
    f2 = corpus_fingerprint(p)
    assert f2 != f1
    os.utime(p, ns=(2, 2))  # same bytes, new mtime: a new name (a rebuild, never a wrong index)
    assert corpus_fingerprint(p) != f2


def test_normalise_query():
    assert normalise_query("  who\twrote \n\n the\x00 book?\x1b ") == ("who wrote the book?", False)
    assert normalise_query("\x00\x01 \n\t") == ("", False)
    assert normalise_query("") == ("", False)
    q, cut = normalise_query("word " * 30, max_chars=22)
    assert cut and q == "word word word word" and len(q) <= 22
    q, cut = normalise_query("x" * 50, max_chars=10)  # no space to back off to: hard cut
    assert cut and q == "x" * 10
    assert normalise_query("abc", max_chars=None) == ("abc", False)


def test_normalise_huge_query_is_fast_and_bounded():
    big = ("lorem ipsum " * 10_000)[:100_000]
    q, cut = normalise_query(big, max_chars=512)
    assert cut and len(q) <= 512
    q, cut = normalise_query(big, max_chars=200_000)
    assert not cut and len(q) == len(big.strip())
    with pytest.raises(TypeError):
        normalise_query(None)  # type: ignore[arg-type]


def test_synthetic_corpus_is_deterministic(tmp_path):
    a = write_synthetic_corpus(tmp_path / "a.jsonl", 50, seed=3, words_per_passage=20)
    b = write_synthetic_corpus(tmp_path / "b.jsonl", 50, seed=3, words_per_passage=20)
    assert a.read_bytes() == b.read_bytes()
    ps = list(iter_corpus(a))
    assert len(ps) == 50 and len({p.doc_id for p in ps}) == 50
    assert all(len(p.text.split()) >= 20 for p in ps)


# -- duplicate ids and empty corpora are refused ---------------------------------------------------

def _write(path, lines):
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_duplicate_ids_are_refused_naming_both_lines(tmp_path, on_error):
    from sonar.retrieval.corpus import CorpusError, CorpusReader

    p = _write(tmp_path / "c.jsonl", ['{"id": "a", "text": "x"}\n', '{"id": 7, "text": "y"}\n', "\n",
                                      '{"id": "b", "text": "z"}\n', '{"id": "7", "text": "w"}\n'])
    with pytest.raises(CorpusError) as e:
        list(CorpusReader(p, on_error=on_error))
    assert e.value.path == str(p) and e.value.line == 5
    assert "duplicate id '7', first at line 2" in str(e.value)


def test_a_resumed_pass_still_sees_duplicates_before_its_start(tmp_path):
    from sonar.retrieval.corpus import CorpusError, CorpusReader

    p = _write(tmp_path / "c.jsonl", ['{"id": "a", "text": "x"}\n', '{"id": "b", "text": "y"}\n',
                                      '{"id": "a", "text": "z"}\n'])
    with pytest.raises(CorpusError, match="duplicate id 'a', first at line 1"):
        list(CorpusReader(p).records(after_line=2))
    with pytest.raises(CorpusError, match="duplicate id 'a'"):  # every line before the start
        list(CorpusReader(p).records(after_line=3))


def test_unique_ids_pass_and_count(tmp_path):
    from sonar.retrieval.corpus import CorpusReader

    p = _write(tmp_path / "c.jsonl", [f'{{"id": "{i}", "text": "t{i}"}}\n' for i in range(300)])
    r = CorpusReader(p)
    assert [x.doc_id for x in r] == [str(i) for i in range(300)] and r.stats.passages == 300


@pytest.mark.parametrize("content", ["", "\n\n  \n", '{"id": "", "text": "x"}\n'])
def test_an_empty_corpus_is_refused_naming_the_file(tmp_path, content):
    from sonar.retrieval.corpus import CorpusError, CorpusReader

    p = _write(tmp_path / "empty.jsonl", [content])
    with pytest.raises(CorpusError, match="no passages") as e:
        list(CorpusReader(p, on_error="skip"))
    assert str(p) in str(e.value)
