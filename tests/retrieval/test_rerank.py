"""Dense (MiniLM) and cross-encoder reranking: only the candidates encoded, at query time, each once while
the cache holds it; a stored vector store read first; one query pass per batch."""
import json

import numpy as np
import pytest

from sonar.retrieval.base import Hit, Retriever
from sonar.retrieval.corpus import iter_corpus
from sonar.retrieval.rerank import (CrossEncoderReranker, DenseEncoder, DenseReranker, PassageVectors, VectorCache,
                                   build_passage_vectors, passage_text, vectors_dir)

DOCS = [
    ("paris", "Paris", "Paris is the capital and most populous city of France."),
    ("banana", "Banana", "A banana is an elongated, edible fruit produced by plants of the genus Musa."),
    ("python", "Python", "Python is a high-level programming language emphasising readability."),
    ("everest", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
    ("nile", "Nile", "The Nile is a major river in northeastern Africa flowing into the Mediterranean."),
    ("tokyo", "Tokyo", "Tokyo is the capital of Japan and its largest city."),
    ("violin", "Violin", "The violin is a wooden string instrument in the violin family."),
]


@pytest.fixture(scope="module")
def encoder():
    return DenseEncoder()


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in DOCS))
    return p


class FixedFirstStage:
    """Returns every document of DOCS in a fixed order (worst first), truncated to k."""

    name = "fixed"

    def __init__(self, ids=None):
        self.ids = ids or [d[0] for d in reversed(DOCS)]
        self.calls = []

    def batch_search(self, queries, k):
        self.calls.append((list(queries), k))
        by_id = {d[0]: d for d in DOCS}
        out = []
        for q in queries:
            if not q.strip():
                out.append([])
                continue
            out.append([Hit(i, by_id[i][1] if i in by_id else "?", by_id[i][2] if i in by_id else "?", 1.0 / (r + 1))
                        for r, i in enumerate(self.ids)][:k])
        return out


def test_encoder_shapes_normalised_and_semantic(encoder):
    assert encoder.dim == 384 and encoder.tag == "all-MiniLM-L6-v2"
    v = encoder.encode(["What is the capital of France?", passage_text(Hit(*DOCS[0], 0)), passage_text(Hit(*DOCS[1], 0))])
    assert v.shape == (3, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2
    # batching does not change the vectors (padding is masked out of the mean)
    np.testing.assert_allclose(encoder.encode(["a", "a much longer sentence here"])[0], encoder.encode(["a"])[0], atol=1e-5)


def test_vectors_built_once_and_reused(tmp_path, corpus, encoder):
    before = encoder.texts_encoded
    vecs = build_passage_vectors(corpus, tmp_path / "idx", encoder, batch_size=4, progress=False)
    assert encoder.texts_encoded - before == len(DOCS)
    assert vecs.matrix.shape == (len(DOCS), 384) and vecs.matrix.dtype == np.float16
    ref = encoder.encode([passage_text(p) for p in iter_corpus(corpus)])
    np.testing.assert_allclose(vecs.matrix.astype(np.float32), ref, atol=2e-3)
    assert vecs.rows(["tokyo", "nope", "paris"]).tolist() == [5, -1, 0]
    n = encoder.texts_encoded
    again = build_passage_vectors(corpus, tmp_path / "idx", encoder, progress=True)
    assert encoder.texts_encoded == n  # idempotent: nothing re-encoded
    assert again.directory == vectors_dir(tmp_path / "idx", encoder.tag)


def test_vector_build_resumes_after_crash(tmp_path, corpus, encoder, monkeypatch):
    real = encoder.encode
    seen = []

    def flaky(texts, batch_size=None):
        seen.append(len(texts))
        if len(seen) == 2:
            raise RuntimeError("simulated crash")
        return real(texts, batch_size=batch_size)

    monkeypatch.setattr(encoder, "encode", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        build_passage_vectors(corpus, tmp_path / "idx", encoder, chunk=3, progress=False)
    meta = json.loads((vectors_dir(tmp_path / "idx", encoder.tag) / "meta.json").read_text())
    assert meta["status"] == "building" and meta["rows_done"] == 3
    monkeypatch.setattr(encoder, "encode", real)
    before = encoder.texts_encoded
    vecs = build_passage_vectors(corpus, tmp_path / "idx", encoder, chunk=3, progress=False)
    assert encoder.texts_encoded - before == len(DOCS) - 3  # only the missing rows
    ref = real([passage_text(p) for p in iter_corpus(corpus)])
    np.testing.assert_allclose(vecs.matrix.astype(np.float32), ref, atol=2e-3)


def test_dense_rerank_encodes_only_the_candidates_once_each(encoder):
    first = FixedFirstStage(ids=["violin", "tokyo", "banana", "paris"])
    rr = DenseReranker(first, encoder, n=4, cache_size=100)
    assert isinstance(rr, Retriever) and rr.name == "fixed|dense:all-MiniLM-L6-v2@4"
    calls, texts = encoder.calls, encoder.texts_encoded
    qs = ["capital city of Japan", "", "a fruit that grows on plants", "stringed musical instrument",
          "capital city of Japan"]
    res = rr.batch_search(qs, k=2)
    # the batch's 4 distinct candidates in one pass (deduplicated across its queries), the 4 queries in another;
    # the other 3 passages of the corpus are never encoded
    assert encoder.calls - calls == 2 and encoder.texts_encoded - texts == 4 + 4
    assert first.calls == [(qs, 4)]  # first stage asked for N candidates
    assert [r[0].doc_id if r else None for r in res] == ["tokyo", None, "banana", "violin", "tokyo"]
    assert all(len(r) == 2 for i, r in enumerate(res) if i != 1)
    # scores are the cosines of query and passage, sorted
    by_id = {d[0]: d for d in DOCS}
    qv = encoder.encode(["capital city of Japan"])[0]
    for h in res[0]:
        pv = encoder.encode([passage_text(Hit(*by_id[h.doc_id], 0))])[0]
        assert h.score == pytest.approx(float(pv @ qv), abs=2e-3)  # the cache keeps float16
    assert res[0][0].score >= res[0][1].score
    st = rr.stats()
    assert (st["queries"], st["candidates"], st["encoded"], st["cache_hits"], st["cache_size"]) == (5, 16, 4, 0, 4)
    # again: every candidate comes from the cache, only the query is encoded
    texts = encoder.texts_encoded
    rr.batch_search(["capital city of Japan"], k=2)
    assert encoder.texts_encoded - texts == 1 and rr.stats()["cache_hits"] == 4


def test_the_cache_is_bounded_and_evicts_the_least_recently_used():
    c = VectorCache(2)
    c.put_many(["a", "b"], np.eye(2, 4, dtype=np.float32))
    assert c.get_many(["a"])[0] is not None  # a is now the most recent
    c.put_many(["c"], np.ones((1, 4), dtype=np.float32))
    assert len(c) == 2 and [v is not None for v in c.get_many(["a", "b", "c"])] == [True, False, True]
    off = VectorCache(0)
    off.put_many(["a"], np.ones((1, 4), dtype=np.float32))
    assert len(off) == 0 and off.get_many(["a"]) == [None]
    with pytest.raises(ValueError, match="max_items=-1"):
        VectorCache(-1)


def test_a_stored_vector_store_is_read_before_encoding(tmp_path, corpus, encoder):
    vecs = build_passage_vectors(corpus, tmp_path / "idx", encoder, progress=False)
    rr = DenseReranker(FixedFirstStage(ids=["ghost", "paris", "banana"]), encoder, n=3, vectors=vecs)
    texts = encoder.texts_encoded
    (hits,) = rr.batch_search(["capital of France"], k=3)
    # paris and banana from the store; "ghost" (not in this corpus) encoded from its hit's text
    assert encoder.texts_encoded - texts == 1 + 1
    assert hits[0].doc_id == "paris" and {h.doc_id for h in hits} == {"paris", "banana", "ghost"}
    st = rr.stats()
    assert (st["stored_hits"], st["encoded"]) == (2, 1)
    qv = encoder.encode(["capital of France"])[0]
    assert hits[0].score == pytest.approx(float(vecs.matrix[vecs.row_of["paris"]].astype(np.float32) @ qv), abs=1e-3)


def test_dense_rerank_candidates_only_and_k_above_n(encoder):
    first = FixedFirstStage(ids=["violin", "nile", "banana"])  # no Paris among the candidates
    rr = DenseReranker(first, encoder, n=2)
    (hits,) = rr.batch_search(["capital of France"], k=3)
    assert first.calls[-1][1] == 3  # k > n: fetch k
    assert {h.doc_id for h in hits} == {"violin", "nile", "banana"}


def test_mismatched_vectors_rejected(tmp_path, encoder):
    v = PassageVectors.write(tmp_path / "v", ["a", "b"], np.eye(2, 8, dtype=np.float32), model="other")
    with pytest.raises(ValueError, match="do not match"):
        DenseReranker(FixedFirstStage(), encoder, n=3, vectors=v)
    with pytest.raises(FileNotFoundError):
        PassageVectors(tmp_path / "nothing")


@pytest.fixture(scope="module")
def tiny_cross_dirs(tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from sonar.retrieval.rerank import packaged_minilm_dir

    tok = AutoTokenizer.from_pretrained(str(packaged_minilm_dir()))
    dirs = {}
    for labels in (1, 2):
        torch.manual_seed(labels)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=37, max_position_embeddings=128, num_labels=labels)
        d = tmp_path_factory.mktemp(f"cross{labels}")
        BertForSequenceClassification(cfg).eval().save_pretrained(d)
        tok.save_pretrained(d)
        dirs[labels] = d
    return dirs


@pytest.mark.parametrize("labels", [1, 2])
def test_cross_encoder_plumbing(tiny_cross_dirs, labels):
    first = FixedFirstStage()
    rr = CrossEncoderReranker(first, tiny_cross_dirs[labels], n=4, batch_size=3, max_length=64)
    assert isinstance(rr, Retriever) and rr.name.startswith("fixed|cross:")
    qs = ["capital of Japan", "", "fruit"]
    res = rr.batch_search(qs, k=3)
    assert first.calls == [(qs, 4)]
    assert [len(r) for r in res] == [3, 0, 3]
    assert rr.calls == 3  # 8 pairs in passes of 3
    for q, hits in zip(qs, res):
        if not hits:
            continue
        cands = FixedFirstStage().batch_search([q], 4)[0]
        ref = rr.score([(q, passage_text(h)) for h in cands])
        order = np.argsort(-ref, kind="stable")[:3]
        assert [h.doc_id for h in hits] == [cands[i].doc_id for i in order]
        np.testing.assert_allclose([h.score for h in hits], ref[order], atol=1e-4)
        if labels == 2:
            assert all(h.score <= 0 for h in hits)  # log-probabilities
    assert rr.stats()["candidates"] == 8


def test_concurrent_vector_builders_encode_once(tmp_path, corpus, encoder):
    import threading

    before = encoder.texts_encoded
    out = []
    threads = [threading.Thread(target=lambda: out.append(
        build_passage_vectors(corpus, tmp_path / "idx", encoder, progress=False))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 3 and encoder.texts_encoded - before == len(DOCS)


def test_the_packaged_minilm_is_the_published_one_and_a_tampered_copy_is_refused(tmp_path, monkeypatch):
    import hashlib

    from sonar.retrieval import rerank

    packaged = rerank.packaged_minilm_dir()
    rerank.verify_minilm_files(packaged)  # the installed wheel's files are the recorded ones
    copy = tmp_path / "minilm"
    copy.mkdir()
    for f in packaged.iterdir():
        if f.is_file():
            (copy / f.name).symlink_to(f)
    (copy / "vocab.txt").unlink()
    vocab = bytearray((packaged / "vocab.txt").read_bytes())
    vocab[100] ^= 1  # one bit: same size, another digest
    (copy / "vocab.txt").write_bytes(bytes(vocab))
    monkeypatch.setattr(rerank, "packaged_minilm_dir", lambda: copy)
    with pytest.raises(rerank.ModelFileError) as ei:
        rerank.DenseEncoder()  # the default encoder: checked before transformers loads it
    msg = str(ei.value)
    assert str(copy / "vocab.txt") in msg and hashlib.sha256(vocab).hexdigest() in msg
    assert rerank.MINILM_FILES["vocab.txt"][1] in msg
    (copy / "vocab.txt").write_bytes(bytes(vocab[:-1]))  # truncated: named by its size
    with pytest.raises(rerank.ModelFileError, match=r"vocab\.txt: 231507 bytes, expected 231508 bytes"):
        rerank.verify_minilm_files(copy)
    (copy / "vocab.txt").unlink()
    with pytest.raises(rerank.ModelFileError, match=r"vocab\.txt: missing"):
        rerank.verify_minilm_files(copy)


def test_the_rerank_cost_reaches_the_retrieval_metrics(encoder):
    """Each replica's stats chain (cache -> reranker) as the service returns it becomes the run's
    ``retrieval/rerank/*`` metrics: ms and passages encoded per query, and the vector hit rate."""
    from sonar.cluster.driver.reports import rerank_metrics
    from sonar.cluster.wire import metrics as K
    from sonar.retrieval.cache import CachedRetriever

    rr = DenseReranker(FixedFirstStage(ids=["paris", "banana"]), encoder, n=2)
    top = CachedRetriever(rr, 0, "dense")
    top.batch_search(["capital of France"], 1)
    top.batch_search(["a yellow fruit"], 1)  # both candidates cached now
    m = rerank_metrics([top.stats(), {"hit_rate": 0.0}])  # a replica without a reranker adds nothing
    assert m[K.RETRIEVAL_RERANK_ENCODED_PER_QUERY] == pytest.approx(2 / 2)
    assert m[K.RETRIEVAL_RERANK_VECTOR_HIT_RATE] == pytest.approx(2 / 4)
    st = rr.stats()
    assert m[K.RETRIEVAL_RERANK_MS_PER_QUERY] == pytest.approx(1000 * st["rerank_s"] / 2)
    assert rerank_metrics([{"hit_rate": 0.5}]) == {}
