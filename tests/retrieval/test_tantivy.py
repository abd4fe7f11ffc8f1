"""tantivy index: search semantics, nasty queries, idempotent and resumable builds, failure explanations."""
import json
import threading

import pytest
import tantivy

import sonar.retrieval.tantivy_index as ti
from sonar.retrieval.base import Hit, Retriever
from sonar.retrieval.corpus import CorpusReader, write_synthetic_corpus
from sonar.retrieval.tantivy_index import IndexBuildError, TantivyRetriever, build_index, index_is_complete

DOCS = [
    {"id": "paris", "title": "Paris", "text": "Paris is the capital and largest city of France."},
    {"id": "lyon", "title": "Lyon", "text": "Lyon is a city in France, known for its cuisine."},
    {"id": "berlin", "title": "Berlin", "text": "Berlin is the capital of Germany. Paris is mentioned here once."},
    {"id": "rome", "title": "Rome", "text": "Rome is the capital city of Italy."},
    {"id": "colon", "title": "Title: with colon", "text": "AND OR NOT are words here; C++ and f(x) too."},
]

NASTY = [
    'title:paris', 'text:"unterminated', '"quoted phrase"', "AND", "OR OR AND NOT", "NOT paris", "paris AND",
    "(", ")", "[a TO b]", "{x}", "a^2", "paris^", "-paris", "+paris", "paris~2", "*", "?", "\\", "f(x) = y",
    "C++", "ünïcödé 北京 🙂", "a:b:c", "IN [1, 2]", "title:", ":", "''", "'; DROP TABLE docs; --", "\x00\x01",
    "word " * 300, "&&||!", "/regex.*/", "paris" * 100,
]


def write_corpus(path, docs):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    return path


@pytest.fixture
def small(tmp_path):
    c = write_corpus(tmp_path / "c.jsonl", DOCS)
    build_index(c, tmp_path / "idx", progress=False)
    return TantivyRetriever(tmp_path / "idx")


def test_is_a_retriever_with_results_in_input_order(small):
    assert isinstance(small, Retriever)
    assert small.name.startswith("tantivy:")
    res = small.batch_search(["capital of Italy", "Lyon cuisine", "capital Germany"], k=2)
    assert [r[0].doc_id for r in res] == ["rome", "lyon", "berlin"]
    assert all(isinstance(h, Hit) for r in res for h in r)
    assert all(len(r) <= 2 for r in res)
    assert all(r[i].score >= r[i + 1].score for r in res for i in range(len(r) - 1))
    h = res[1][0]
    assert (h.title, h.text) == ("Lyon", DOCS[1]["text"])


def test_title_boost_and_stemming(small):
    (hits,) = small.batch_search(["paris"], k=3)
    assert hits[0].doc_id == "paris"  # title match outranks the passing mention in Berlin's text
    (hits,) = small.batch_search(["capitals cities"], k=5)  # stemmed: capital/city
    assert {"paris", "rome"} <= {h.doc_id for h in hits}


@pytest.mark.parametrize("stopwords, q", [(True, "capital city France"), (True, "Lyon city cuisine"),
                                         (False, "the capital city of France")])
def test_scores_equal_tantivy_query_parser(small, stopwords, q):
    """The programmatic query scores exactly like the parser's ``title^2 text`` query."""
    r = TantivyRetriever(small.index_dir, stopwords=stopwords)
    searcher = r._index.searcher()
    parsed = r._index.parse_query(q, ["title", "text"], field_boosts={"title": 2.0})
    ref = [(round(s, 4), searcher.doc(a).get_first("id")) for s, a in searcher.search(parsed, 5).hits]
    ours = [(round(h.score, 4), h.doc_id) for h in r.batch_search([q], 5)[0]]
    assert ours == ref and len(ref) >= 2


@pytest.mark.parametrize("q", NASTY)
def test_nasty_queries_never_raise(small, q):
    (hits,) = small.batch_search([q], k=3)
    assert isinstance(hits, list)


def test_nasty_batch_and_colon_title(small):
    res = small.batch_search(NASTY + ["Title: with colon"], k=2)
    assert len(res) == len(NASTY) + 1
    assert res[-1][0].doc_id == "colon"
    assert small.batch_search(["NOT paris"], 1)[0][0].doc_id == "paris"  # NOT is a word, not an operator


def test_empty_and_truncated_queries_are_counted(tmp_path):
    c = write_corpus(tmp_path / "c.jsonl", DOCS)
    build_index(c, tmp_path / "idx", progress=False)
    r = TantivyRetriever(tmp_path / "idx", max_query_chars=100)
    res = r.batch_search(["", "   \n\t", "\x00", "paris " + "x" * 100_000, "the of a"], k=3)
    assert res[:3] == [[], [], []]
    assert res[3][0].doc_id == "paris"
    assert res[4] != []  # stop words only: searched without the stop-word filter
    s = r.stats()
    assert s["empty_queries"] == 3 and s["truncated"] == 1 and s["queries"] == 5 and s["num_docs"] == len(DOCS)


def test_bad_arguments(small):
    with pytest.raises(ValueError):
        small.batch_search(["x"], k=0)
    with pytest.raises(TypeError):
        small.batch_search("paris", k=1)  # type: ignore[arg-type]
    assert small.batch_search([], k=3) == []


def test_build_is_idempotent(tmp_path):
    c = write_corpus(tmp_path / "c.jsonl", DOCS)
    info = build_index(c, tmp_path / "idx", progress=False)
    assert not info.reused and info.num_docs == len(DOCS)
    again = build_index(c, tmp_path / "idx", progress=True)
    assert again.reused and again.num_docs == len(DOCS) and again.fingerprint == info.fingerprint
    assert index_is_complete(tmp_path / "idx", c)


class Crash(RuntimeError):
    pass


def crashing_reader(after_n):
    class CrashingReader(CorpusReader):
        def records(self, after_line=0):
            for i, rec in enumerate(super().records(after_line)):
                if i == after_n:
                    raise Crash(f"simulated crash after {after_n} documents")
                yield rec
    return CrashingReader


def all_ids(index_dir):
    r = TantivyRetriever(index_dir)
    s = r._index.searcher()
    hits = s.search(tantivy.Query.all_query(), limit=10_000).hits
    return sorted(s.doc(a).get_first("id") for _, a in hits)


def test_crash_then_resume_from_marker(tmp_path, monkeypatch):
    c = write_synthetic_corpus(tmp_path / "c.jsonl", 120, words_per_passage=8)
    idx = tmp_path / "idx"
    monkeypatch.setattr(ti, "CorpusReader", crashing_reader(55))
    with pytest.raises(Crash):
        build_index(c, idx, batch_size=20, progress=False)
    marker = json.loads((idx / ti.MARKER).read_text())
    assert marker["status"] == "building" and marker["committed_docs"] == 40 and marker["committed_line"] == 40
    with pytest.raises(IndexBuildError, match="not a finished index"):
        TantivyRetriever(idx)
    monkeypatch.setattr(ti, "CorpusReader", CorpusReader)
    info = build_index(c, idx, batch_size=20, progress=False)
    assert info.resumed_after_line == 40 and info.num_docs == 120 and not info.reused
    assert all_ids(idx) == sorted(str(i) for i in range(120))  # no duplicates, nothing lost


def test_crash_between_commit_and_marker_write(tmp_path, monkeypatch):
    c = write_synthetic_corpus(tmp_path / "c.jsonl", 60, words_per_passage=8)
    idx = tmp_path / "idx"
    monkeypatch.setattr(ti, "CorpusReader", crashing_reader(45))
    with pytest.raises(Crash):
        build_index(c, idx, batch_size=20, progress=False)
    # Pretend the marker write after the second commit never happened.
    m = json.loads((idx / ti.MARKER).read_text())
    m.update(committed_line=20, committed_docs=20)
    (idx / ti.MARKER).write_text(json.dumps(m))
    monkeypatch.setattr(ti, "CorpusReader", CorpusReader)
    info = build_index(c, idx, batch_size=20, progress=False)
    assert info.resumed_after_line == 40  # the index itself, not the stale marker, decides
    assert all_ids(idx) == sorted(str(i) for i in range(60))


def test_marker_for_another_corpus_is_explained(tmp_path):
    a = write_corpus(tmp_path / "a.jsonl", DOCS)
    b = write_corpus(tmp_path / "b.jsonl", DOCS[:2])
    build_index(a, tmp_path / "idx", progress=False)
    with pytest.raises(IndexBuildError, match="fingerprint") as ei:
        build_index(b, tmp_path / "idx", progress=False)
    assert "overwrite=True" in str(ei.value)
    info = build_index(b, tmp_path / "idx", progress=False, overwrite=True)
    assert info.num_docs == 2 and not info.reused


def test_foreign_or_damaged_index_is_explained(tmp_path):
    c = write_corpus(tmp_path / "c.jsonl", DOCS)
    idx = tmp_path / "idx"
    build_index(c, idx, progress=False)
    marker = json.loads((idx / ti.MARKER).read_text())
    (idx / ti.MARKER).unlink()
    with pytest.raises(IndexBuildError, match="sonar_index.json is missing"):
        build_index(c, idx, progress=False)
    marker["committed_docs"] = 999  # marker says more than the index holds
    (idx / ti.MARKER).write_text(json.dumps(marker))
    with pytest.raises(IndexBuildError, match="holds 5"):
        build_index(c, idx, progress=False)
    marker.update(status="building", committed_docs=999)
    (idx / ti.MARKER).write_text(json.dumps(marker))
    with pytest.raises(IndexBuildError, match="partial or damaged"):
        build_index(c, idx, progress=False)
    (idx / ti.MARKER).write_text("{broken")
    with pytest.raises(IndexBuildError, match="unreadable marker"):
        build_index(c, idx, progress=False)


def test_corpus_error_during_build_names_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps(DOCS[0]) + "\n{bad\n")
    with pytest.raises(Exception, match=r"c\.jsonl:2: not valid JSON"):
        build_index(p, tmp_path / "idx", progress=False)
    info = build_index(p, tmp_path / "idx2", progress=False, on_error="skip")
    assert info.num_docs == 1 and info.corpus_stats["skipped"] == 1


def test_concurrent_builders_share_one_build(tmp_path):
    c = write_synthetic_corpus(tmp_path / "c.jsonl", 200, words_per_passage=8)
    infos, errors = [], []

    def run():
        try:
            infos.append(build_index(c, tmp_path / "idx", batch_size=50, progress=False))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(i.reused for i in infos) == [False, True, True]
    assert all(i.num_docs == 200 for i in infos)


def test_query_terms_match_index_terms(small):
    """The query analyzer produces the index's terms (same en_stem pipeline)."""
    s = small._index.searcher()
    for d in DOCS:
        for t in small._analyzer_all.analyze(d["text"]):
            assert s.doc_freq("text", t) > 0, t


def test_duplicate_ids_are_not_indexed_twice_and_a_rerun_still_refuses(tmp_path):
    from sonar.retrieval.corpus import CorpusError

    corpus = tmp_path / "dup.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i % 5 if i == 7 else i}", "text": f"passage {i}"}) + "\n"
                              for i in range(10)))  # line 8 repeats d2
    for _ in range(2):  # batch_size 3: lines 1-6 were committed; the rerun resumes and still refuses
        with pytest.raises(CorpusError, match="duplicate id 'd2', first at line 3") as e:
            build_index(corpus, tmp_path / "idx", batch_size=3, progress=False)
        assert e.value.line == 8
        assert not index_is_complete(tmp_path / "idx", corpus)


def test_an_empty_corpus_is_not_indexed(tmp_path):
    from sonar.retrieval.corpus import CorpusError

    corpus = tmp_path / "empty.jsonl"
    corpus.write_text("\n")
    with pytest.raises(CorpusError, match="no passages") as e:
        build_index(corpus, tmp_path / "idx", progress=False)
    assert str(corpus) in str(e.value)
    assert not index_is_complete(tmp_path / "idx", corpus)
