"""build_retriever: backend + reranker + cache composed from a RetrievalConfig."""
import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest

from sonar.cluster.wire.config import ElasticConfig, RetrievalConfig
from sonar.retrieval.base import Retriever
from sonar.retrieval.cache import CachedRetriever
from sonar.retrieval.corpus import corpus_fingerprint
from sonar.retrieval.factory import build_retriever
from sonar.retrieval.indexer import index_dir_for
from sonar.retrieval.tantivy_index import MARKER, TantivyRetriever

DOCS = [
    {"id": "paris", "title": "Paris", "text": "Paris is the capital and largest city of France."},
    {"id": "tokyo", "title": "Tokyo", "text": "Tokyo is the capital of Japan."},
    {"id": "banana", "title": "Banana", "text": "A banana is an edible fruit."},
    {"id": "nile", "title": "Nile", "text": "The Nile is a river in Africa."},
]


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return str(p)


def cfg(**kw):
    return dataclasses.replace(RetrievalConfig(), **kw)


def test_tantivy_with_cache_builds_under_fingerprint(tmp_path, corpus):
    r = build_retriever(cfg(k=2), corpus, str(tmp_path / "indexes"))
    assert isinstance(r, CachedRetriever) and isinstance(r.inner, TantivyRetriever)
    idx = tmp_path / "indexes" / corpus_fingerprint(corpus)
    assert (idx / MARKER).exists() and index_dir_for(cfg(), corpus, str(tmp_path / "indexes")) == idx
    assert r.batch_search(["capital of Japan", "capital of Japan"], 2)[0][0].doc_id == "tokyo"
    assert r.stats()["coalesced"] == 1
    r2 = build_retriever(cfg(cache_size=0), corpus, str(tmp_path / "indexes"))  # reuses the index
    assert isinstance(r2, TantivyRetriever) and r2.index_dir == idx


def test_explicit_index_dir_and_query_limit(tmp_path, corpus):
    r = build_retriever(cfg(index_dir=str(tmp_path / "mine"), cache_size=0, max_query_chars=20), corpus, "unused")
    assert (tmp_path / "mine" / MARKER).exists() and r.max_query_chars == 20


def test_dense_rerank_stack(tmp_path, corpus):
    r = build_retriever(cfg(rerank="dense", rerank_candidates=4, k=1), corpus, str(tmp_path / "ix"))
    assert isinstance(r, CachedRetriever) and r.rerank_tag == "dense:all-MiniLM-L6-v2@4"
    dense = r.inner
    assert type(dense).__name__ == "DenseReranker" and dense.n == 4
    assert dense.encoder.texts_encoded == 0 and dense.vectors is None  # nothing encoded before the first search
    (hits,) = r.batch_search(["which fruit is yellow"], 1)
    assert hits[0].doc_id == "banana"
    # the BM25 candidates (at most 4) and the query, at query time
    cands = dense.stats()["encoded"]
    assert 1 <= cands <= 4 and dense.encoder.texts_encoded == cands + 1


def test_a_stored_vector_store_of_the_same_corpus_is_used_and_another_corpus_ignored(tmp_path, corpus):
    from sonar.retrieval.rerank import DenseEncoder, build_passage_vectors

    r = build_retriever(cfg(rerank="dense", rerank_candidates=4, k=1, cache_size=0), corpus, str(tmp_path / "ix"))
    idx = Path(r.first_stage.index_dir)
    build_passage_vectors(corpus, idx, DenseEncoder(), progress=False)  # what `sonar index --dense` writes
    r2 = build_retriever(cfg(rerank="dense", rerank_candidates=4, k=1, cache_size=0), corpus, str(tmp_path / "ix"))
    assert r2.vectors is not None and len(r2.vectors) == len(DOCS)
    r2.batch_search(["which fruit is yellow"], 1)
    assert r2.stats()["encoded"] == 0 and r2.stats()["stored_hits"] >= 1
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x", "title": "X", "text": "something else entirely"}) + "\n")
    meta = idx / "vectors-all-MiniLM-L6-v2" / "meta.json"
    m = json.loads(meta.read_text())
    meta.write_text(json.dumps({**m, "fingerprint": "another-corpus"}))
    r3 = build_retriever(cfg(rerank="dense", rerank_candidates=4, k=1, cache_size=0), corpus, str(tmp_path / "ix"))
    assert r3.vectors is None


def test_bad_configs(tmp_path, corpus):
    with pytest.raises(ValueError, match="rerank_model"):
        build_retriever(cfg(rerank="cross"), corpus, str(tmp_path))
    with pytest.raises(ValueError, match="backend"):
        build_retriever(cfg(backend="solr"), corpus, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="corpus"):
        build_retriever(cfg(), str(tmp_path / "missing.jsonl"), str(tmp_path))


def test_elasticsearch_is_imported_lazily_and_indexed_when_missing(tmp_path, corpus, monkeypatch):
    seen = {}

    class FakeIndices:
        def exists(self, index):
            seen["exists"] = index
            return "created" in seen

        def refresh(self, index):
            seen["refreshed"] = index

    class FakeES:
        name = "elasticsearch:fake/sonar"

        def __init__(self, cfg):
            self.index = cfg.index
            self.hosts = cfg.hosts
            self.client = types.SimpleNamespace(indices=FakeIndices(),
                                                count=lambda index: {"count": len(seen.get("bulk", []))})
            self.shards, self.replicas = 1, 0

        @classmethod
        def from_config(cls, c):
            seen["cfg"] = c
            return cls(c)

        def create_index(self):
            seen["created"] = True

        def batch_search(self, queries, k):
            return [[] for _ in queries]

        def close(self):
            pass

    def bulk_index(client, index, docs, progress=True, **kw):
        seen.setdefault("bulk", []).extend(d["id"] for d in docs)
        return len(docs)

    def write_manifest(client, index, manifest):
        seen["manifest"] = dict(manifest)

    fake = types.ModuleType("sonar.retrieval.elastic")
    fake.ElasticRetriever, fake.bulk_index = FakeES, bulk_index
    fake.read_manifest = lambda client, index: seen.get("manifest")
    fake.write_manifest = write_manifest
    monkeypatch.setitem(sys.modules, "sonar.retrieval.elastic", fake)
    ec = ElasticConfig(hosts=["http://127.0.0.1:1"], index="sonar-x")
    r = build_retriever(cfg(backend="elasticsearch", elastic=ec), corpus, str(tmp_path))
    assert seen["cfg"] is ec and seen["exists"] == "sonar-x" and seen["created"]
    assert seen["bulk"] == [d["id"] for d in DOCS]
    assert seen["manifest"]["status"] == "complete" and seen["manifest"]["committed_docs"] == len(DOCS)
    assert isinstance(r, Retriever) and type(r.inner).__name__ == "ResilientRetriever"
    assert r.batch_search(["x"], 1) == [[]]


@pytest.mark.es
def test_elasticsearch_end_to_end(tmp_path, corpus, es_url, make_es_config):
    ec = make_es_config(es_url)
    r = build_retriever(cfg(backend="elasticsearch", elastic=ec, k=1), corpus, str(tmp_path))
    assert r.batch_search(["capital of Japan"], 1)[0][0].doc_id == "tokyo"
    r2 = build_retriever(cfg(backend="elasticsearch", elastic=ec, cache_size=0), corpus, str(tmp_path))  # exists
    assert r2.batch_search(["banana fruit"], 1)[0][0].doc_id == "banana"
