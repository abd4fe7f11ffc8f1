"""A corpus past the interpreter's limits, or a cut-short ``.gz``, is a CorpusError naming the file and
the line (issue 14): never a raw ValueError, RecursionError, EOFError or zlib.error."""
from __future__ import annotations

import gzip
import json

import pytest

from sonar.retrieval.corpus import CorpusError, CorpusReader

HUGE_INT = "1" * 5000
DEEP = "[" * 100_000 + "]" * 100_000


def _line(i: int) -> str:
    return json.dumps({"id": f"d{i}", "title": f"Title {i}", "text": f"passage {i} " + "word " * 40}) + "\n"


@pytest.mark.parametrize("bad, why", [('{"id": ' + HUGE_INT + ', "text": "t"}', "digits"),
                                      (DEEP, "nested too deeply")])
def test_a_line_past_a_limit_is_a_corpus_error_naming_file_and_line(tmp_path, bad, why):
    p = tmp_path / "corpus.jsonl"
    p.write_text(_line(0) + bad + "\n" + _line(2))
    with pytest.raises(CorpusError) as e:
        list(CorpusReader(p))
    assert (e.value.path, e.value.line) == (str(p), 2) and why in e.value.reason
    skipping = CorpusReader(p, on_error="skip")  # skip mode: a per-line error, skipped and counted
    assert [x.doc_id for x in skipping] == ["d0", "d2"] and skipping.stats.skipped == 1


def _gz(path, n: int = 4000):
    path.write_bytes(gzip.compress("".join(_line(i) for i in range(n)).encode()))
    return path


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_truncated_gz_corpus_is_a_corpus_error_naming_file_and_line(tmp_path, on_error):
    p = _gz(tmp_path / "corpus.jsonl.gz")
    assert sum(1 for _ in CorpusReader(p)) == 4000
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    reader = CorpusReader(p, on_error=on_error)
    seen = []
    with pytest.raises(CorpusError, match="truncated or corrupt gzip archive") as e:
        for passage in reader:
            seen.append(passage)
    # the error names the line being read when the archive ran out: the one after the last passage read
    assert e.value.path == str(p) and 1 < e.value.line == len(seen) + 1 < 4000


def test_a_corrupt_gz_corpus_is_a_corpus_error(tmp_path):
    p = _gz(tmp_path / "corpus.jsonl.gz")
    raw = bytearray(p.read_bytes())
    for i in range(len(raw) // 3, len(raw) // 3 + 64):
        raw[i] ^= 0xA5
    p.write_bytes(bytes(raw))
    with pytest.raises(CorpusError) as e:
        list(CorpusReader(p))
    assert e.value.path == str(p) and e.value.line >= 1


def test_a_file_that_is_not_gzip_is_a_corpus_error(tmp_path):
    p = tmp_path / "corpus.jsonl.gz"
    p.write_text(_line(0))
    with pytest.raises(CorpusError) as e:
        list(CorpusReader(p))
    assert (e.value.path, e.value.line) == (str(p), 1)
