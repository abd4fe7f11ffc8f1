"""The one index builder (retrieval/indexer.py) and `sonar index`: manifests, partial index refused and
resumed, training without the corpus file, parquet corpora, progress output, Elasticsearch options and
the server-side dense rerank."""
import base64
import dataclasses
import io
import json

import pytest

from sonar.cluster.wire.config import ElasticConfig, RetrievalConfig
from sonar.retrieval import tantivy_index
from sonar.retrieval.corpus import CorpusReader, count_records
from sonar.retrieval.factory import build_retriever
from sonar.retrieval.indexer import PartialIndexError, ensure_index
from sonar.retrieval.progress import PlainProgress

DOCS = [{"id": f"e{i}", "title": f"Entity {i}", "text": f"Entity {i} lives in city{i} and owns item{i}."}
        for i in range(7)]


def cfg(**kw):
    return dataclasses.replace(RetrievalConfig(), cache_size=0, **kw)


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return str(p)


_BUILD = tantivy_index.build_index


class _Crash(Exception):
    pass


def _crash_after(monkeypatch, module, n: int):
    """Make ``module.CorpusReader`` raise after yielding ``n`` records (a build killed part-way)."""
    class Crashing(CorpusReader):
        def records(self, after_line=0):
            for i, rec in enumerate(super().records(after_line)):
                if i == n:
                    raise _Crash("killed")
                yield rec
    monkeypatch.setattr(module, "CorpusReader", Crashing)


def test_tantivy_partial_index_is_refused_by_training_and_finished_by_resume(tmp_path, corpus, monkeypatch):
    root = str(tmp_path / "ix")
    _crash_after(monkeypatch, tantivy_index, 3)
    monkeypatch.setattr(tantivy_index, "build_index", lambda *a, **kw: _BUILD(*a, **{**kw, "batch_size": 2}))
    with pytest.raises(_Crash):
        ensure_index(cfg(), corpus, root)  # commits 2 documents (one batch), dies in the second
    monkeypatch.undo()
    with pytest.raises(PartialIndexError) as e:
        build_retriever(cfg(), corpus, root)  # the training side
    msg = str(e.value)
    assert "holds 2 documents, the corpus has 7" in msg and "--resume" in msg and root in msg
    rep = ensure_index(cfg(), corpus, root, resume=True)  # `sonar index --resume`
    assert (rep.num_docs, rep.expected_docs, rep.resumed, rep.reused) == (7, 7, True, False)
    r = build_retriever(cfg(), corpus, root)
    assert r.batch_search(["Entity 6 city6"], 1)[0][0].doc_id == "e6"


def test_training_opens_a_complete_index_without_the_corpus_file(tmp_path, corpus):
    root = str(tmp_path / "ix")
    first = ensure_index(cfg(), corpus, root)
    assert not first.reused and first.num_docs == 7
    (tmp_path / "corpus.jsonl").unlink()
    r = build_retriever(cfg(), corpus, root)
    assert r.batch_search(["item4"], 1)[0][0].doc_id == "e4"
    with pytest.raises(FileNotFoundError, match="no complete index"):
        build_retriever(cfg(), str(tmp_path / "other.jsonl"), root)


def test_parquet_corpus_indexes_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "wiki.parquet"
    rows = [dict(d, contents=None) for d in DOCS[:4]]  # FlashRAG's `contents` beside {title, text}
    rows.append({"id": "c1", "title": None, "text": None, "contents": '"Zebra"\nA zebra is striped.'})
    pq.write_table(pa.Table.from_pylist(rows), p, row_group_size=2)
    assert count_records(p) == 5
    recs = list(CorpusReader(p).records())
    assert [ln for ln, _ in recs] == [1, 2, 3, 4, 5] and recs[4][1].title == "Zebra"
    r = build_retriever(cfg(), str(p), str(tmp_path / "ix"))
    assert r.batch_search(["striped zebra"], 1)[0][0].doc_id == "c1"
    assert r.batch_search(["city2"], 1)[0][0].doc_id == "e2"


def test_plain_progress_prints_every_twentieth_and_at_close():
    out = io.StringIO()
    bar = PlainProgress(100, "indexing c", "doc", file=out)
    for _ in range(10):
        bar.update(10)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "indexing c: 10/100 doc (10%)" and lines[-1] == "indexing c: 100/100 doc (100%)"
    assert len(lines) == 11  # 10 updates crossing a step + close


def test_build_progress_without_tqdm_goes_to_stderr(tmp_path, corpus, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` raises ImportError
    ensure_index(cfg(), corpus, str(tmp_path / "ix"), progress=True)
    cap = capsys.readouterr()
    assert "indexing corpus.jsonl: 7/7 doc (100%)" in cap.err and "indexing" not in cap.out


def test_sonar_index_cli_builds_refuses_partial_and_resumes(tmp_path, corpus, monkeypatch, capsys):
    from sonar.cluster.driver.cli import main

    args = ["index", "--config", "smoke", f"run.root={tmp_path / 'runs'}", f"retrieval.corpus={corpus}"]
    _crash_after(monkeypatch, tantivy_index, 0)
    with pytest.raises(_Crash):
        main(args)
    monkeypatch.undo()
    # the crash left a marker with 0 committed documents: refused, then finished with --resume
    assert main(args) == 2
    assert "holds 0 documents, the corpus has 7" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    assert "resumed and completed: 7 documents of 7 expected" in capsys.readouterr().out
    assert main(args) == 0
    assert "complete, reused: 7 documents" in capsys.readouterr().out


# --------------------------------------------------------------------------------------- config

def test_elastic_config_validation():
    from sonar.cluster.wire.config import load_config

    for override, field in (("retrieval.elastic.shards=0", "shards"), ("retrieval.elastic.replicas=-1", "replicas"),
                            ("retrieval.elastic.cloud_id=nocolon", "cloud_id"),
                            ("retrieval.elastic.bulk_batch_size=0", "bulk_batch_size"),
                            ("retrieval.elastic.store_vectors=true", "store_vectors")):
        with pytest.raises(ValueError, match=f"retrieval.elastic.{field}"):
            load_config(["smoke"], [override])


def test_cloud_id_replaces_hosts_and_no_secret_is_shown():
    from sonar.retrieval.elastic import ElasticRetriever

    raw = base64.b64encode(b"us-east-1.aws.found.io:443$abc123$def456").decode()
    ec = ElasticConfig(cloud_id=f"my-deploy:{raw}", shards=3, replicas=1)
    r = ElasticRetriever.from_config(ec, env={"SONAR_ES_API_KEY": "s3cr3t-key"})
    node = r.client.transport.node_pool.all()[0].config
    assert node.host == "abc123.us-east-1.aws.found.io" and node.scheme == "https"
    shown = repr(r) + json.dumps(r.params())
    assert "s3cr3t" not in shown and r.params()["hosts"] == ["cloud:my-deploy"]
    assert (r.params()["shards"], r.params()["replicas"]) == (3, 1)


def test_server_dense_reranker_encodes_once_and_asks_for_the_candidates():
    from sonar.retrieval.elastic import ServerDenseReranker

    calls = {}

    class Enc:
        tag = "fake"

        def encode(self, texts, batch_size=None):
            calls.setdefault("encode", []).append(list(texts))
            return [[float(len(t)), 0.0] for t in texts]

    class Es:
        name = "elasticsearch:x/i"

        def batch_search_vectors(self, queries, vectors, k, candidates):
            calls["search"] = (list(queries), vectors, k, candidates)
            return [[] for _ in queries]

    r = ServerDenseReranker(Es(), Enc(), n=5, normalise=lambda q: q.strip())
    assert r.batch_search([" ab ", "xyz"], 8) == [[], []]
    assert calls["encode"] == [["ab", "xyz"]]
    assert calls["search"] == ([" ab ", "xyz"], [[2.0, 0.0], [3.0, 0.0]], 8, 8)  # candidates = max(n, k)


# ---------------------------------------------------------------------------------- elasticsearch

@pytest.mark.es
def test_elastic_index_partial_refused_resume_and_settings(tmp_path, corpus, es_url, make_es_config, monkeypatch):
    from sonar.retrieval import elastic, indexer

    ec = dataclasses.replace(make_es_config(es_url), shards=2, replicas=0, bulk_batch_size=2)
    c = cfg(backend="elasticsearch", elastic=ec)
    _crash_after(monkeypatch, indexer, 3)
    with pytest.raises(_Crash):
        ensure_index(c, corpus, str(tmp_path))
    monkeypatch.undo()
    with pytest.raises(PartialIndexError) as e:
        build_retriever(c, corpus, str(tmp_path))
    assert f"/{ec.index} is incomplete: it holds 2 documents, the corpus has 7" in str(e.value)
    rep = ensure_index(c, corpus, str(tmp_path), resume=True)
    assert (rep.num_docs, rep.resumed) == (7, True)
    r = elastic.ElasticRetriever.from_config(ec)
    man = elastic.read_manifest(r.client, ec.index)
    assert man["status"] == "complete" and man["committed_docs"] == 7 and man["expected_docs"] == 7
    settings = r.client.indices.get_settings(index=ec.index)[ec.index]["settings"]["index"]
    assert (settings["number_of_shards"], settings["number_of_replicas"]) == ("2", "0")
    (tmp_path / "corpus.jsonl").unlink()  # complete: training needs no corpus file
    got = build_retriever(c, corpus, str(tmp_path)).batch_search(["Entity 5 city5"], 1)
    assert got[0][0].doc_id == "e5"


@pytest.mark.es
def test_store_vectors_server_side_matches_client_side_rerank(tmp_path, corpus, es_url, make_es_config):
    queries = ["Entity lives in a city", "who owns item3", "Entity 5", "city1 item2 Entity"]
    server = cfg(backend="elasticsearch", rerank="dense", rerank_candidates=7, k=3,
                 elastic=dataclasses.replace(make_es_config(es_url), store_vectors=True))
    client = cfg(backend="elasticsearch", rerank="dense", rerank_candidates=7, k=3, elastic=make_es_config(es_url))
    rs = build_retriever(server, corpus, str(tmp_path / "s"))
    rc = build_retriever(client, corpus, str(tmp_path / "c"))
    assert type(rs.inner).__name__ == "ServerDenseReranker" and type(rc).__name__ == "DenseReranker"
    assert not (tmp_path / "s").exists()  # no client-side vectors for the server-side path
    a, b = rs.batch_search(queries, 3), rc.batch_search(queries, 3)
    assert [[h.doc_id for h in hs] for hs in a] == [[h.doc_id for h in hs] for hs in b]
    for hs_a, hs_b in zip(a, b):  # server score = cosine + 1; client score = cosine (float16 vectors)
        for x, y in zip(hs_a, hs_b):
            assert x.score - 1.0 == pytest.approx(y.score, abs=2e-3)

