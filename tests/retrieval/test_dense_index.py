"""The ``dense`` backend and ``sonar index --dense``: exact inner-product search equal to brute force, a run
refused (never encoding) when the vectors are missing, a build killed part-way resumed without redoing a
finished shard, a torn shard found by its checksum and encoded again."""
import dataclasses
import json

import numpy as np
import pytest

from sonar.cluster.wire.config import DenseIndexConfig, RetrievalConfig
from sonar.retrieval import rerank
from sonar.retrieval.factory import build_retriever
from sonar.retrieval.indexer import build_dense, ensure_index
from sonar.retrieval.rerank import build_passage_vectors, vectors_dir
from tests.retrieval.test_rerank import DOCS, encoder  # noqa: F401  (the same passages; the module's encoder)



def cfg(**kw):
    dense = kw.pop("dense", {})
    return dataclasses.replace(RetrievalConfig(), backend="dense", cache_size=0,
                               dense=dataclasses.replace(DenseIndexConfig(), **dense), **kw)


@pytest.fixture
def corpus(tmp_path):
    """DOCS as a JSONL corpus, its path as a string (what a config holds)."""
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in DOCS))
    return str(p)


def test_a_run_without_the_vectors_is_refused_and_encodes_nothing(tmp_path, corpus, monkeypatch):
    def no_encoding(*a, **k):
        raise AssertionError("a corpus-wide encode on the start-up path")

    monkeypatch.setattr(rerank, "build_passage_vectors", no_encoding)
    with pytest.raises(FileNotFoundError, match=r"no finished passage vectors .*sonar index --dense"):
        build_retriever(cfg(), corpus, str(tmp_path / "ix"))


def test_the_dense_backend_searches_end_to_end_and_equals_brute_force(tmp_path, corpus, encoder):
    c = cfg(dense={"shard_rows": 3, "search_block_rows": 2})  # blocks smaller than k: the merge across blocks
    rep = ensure_index(c, corpus, str(tmp_path / "ix"))
    vectors = build_dense(c, corpus, rep.index_dir)
    r = build_retriever(c, corpus, str(tmp_path / "ix"))
    assert type(r).__name__ == "DenseIndexRetriever" and r.name.startswith("dense:all-MiniLM-L6-v2:")
    qs = ["capital city of Japan", "", "a stringed musical instrument", "the tallest mountain"]
    res = r.batch_search(qs, k=3)
    assert [hs[0].doc_id if hs else None for hs in res] == ["tokyo", None, "violin", "everest"]
    m = np.asarray(vectors.matrix, dtype=np.float32)
    for q, hs in zip(qs, res):
        if not q:
            continue
        s = m @ encoder.encode([q])[0]
        want = [DOCS[i][0] for i in np.argsort(-s, kind="stable")[:3]]
        assert [h.doc_id for h in hs] == want
        np.testing.assert_allclose([h.score for h in hs], np.sort(s)[::-1][:3], atol=1e-4)
        assert all(h.text == dict((d[0], d[2]) for d in DOCS)[h.doc_id] for h in hs)  # text from the BM25 index
    assert r.stats()["queries"] == 4 and r.stats()["empty_queries"] == 1


def test_a_killed_build_resumes_from_its_last_shard_and_a_torn_shard_is_redone(tmp_path, corpus, encoder):
    class Killed(Exception):
        pass

    class Dying:
        """The real encoder, killed after ``calls`` encode calls (a build interrupted part-way)."""

        def __init__(self, calls):
            self.left, self.tag, self.dim = calls, encoder.tag, encoder.dim

        def encode(self, texts, batch_size=None):
            if self.left == 0:
                raise Killed()
            self.left -= 1
            return encoder.encode(texts, batch_size=batch_size)

    idx = tmp_path / "idx"
    with pytest.raises(Killed):
        build_passage_vectors(corpus, idx, Dying(2), chunk=2, progress=False)  # shards [0,2) and [2,4) done
    meta = json.loads((vectors_dir(idx, encoder.tag) / "meta.json").read_text())
    assert (meta["status"], meta["rows_done"], sorted(meta["shards"], key=int)) == ("building", 4, ["0", "2"])
    before = encoder.texts_encoded
    v = build_passage_vectors(corpus, idx, encoder, chunk=2, progress=False)
    assert encoder.texts_encoded - before == len(DOCS) - 4  # the finished shards are not encoded again
    full = build_passage_vectors(corpus, tmp_path / "fresh", encoder, chunk=2, progress=False)
    np.testing.assert_array_equal(np.asarray(v.matrix), np.asarray(full.matrix))
    # a torn write in the shard at rows 2-3 of an unfinished build: found by its checksum and encoded again
    d = vectors_dir(idx, encoder.tag)
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "status": "building", "rows_done": 6}))
    mm = np.load(d / "vectors.npy", mmap_mode="r+")
    mm[2] = 0
    mm.flush()
    del mm
    before = encoder.texts_encoded
    v = build_passage_vectors(corpus, idx, encoder, chunk=2, progress=False)
    assert encoder.texts_encoded - before == len(DOCS) - 2  # from row 2 on
    np.testing.assert_array_equal(np.asarray(v.matrix), np.asarray(full.matrix))


def test_a_passage_prefix_is_part_of_the_vectors_identity(tmp_path, corpus):
    e5 = cfg(dense={"passage_prefix": "passage: ", "query_prefix": "query: "})
    rep = ensure_index(e5, corpus, str(tmp_path / "ix"))
    build_dense(e5, corpus, rep.index_dir)
    assert build_retriever(e5, corpus, str(tmp_path / "ix")).query_prefix == "query: "
    with pytest.raises(FileNotFoundError, match=r"passage_prefix='passage: ', retrieval.dense.passage_prefix=''"):
        build_retriever(cfg(), corpus, str(tmp_path / "ix"))


def test_sonar_index_dense_builds_the_vectors_and_says_where(tmp_path, corpus, capsys):
    from sonar.cluster.driver.cli import main

    args = ["index", "--config", "smoke", f"run.root={tmp_path / 'runs'}", f"retrieval.corpus={corpus}", "--dense"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"{len(DOCS)} dense vectors (all-MiniLM-L6-v2)" in out
    assert main(args[:-1] + ["retrieval.backend=dense"]) == 0  # implied by the backend; complete: reused
    assert f"{len(DOCS)} dense vectors" in capsys.readouterr().out


@pytest.mark.ray
def test_a_build_spread_over_ray_actors_writes_the_same_vectors(tmp_path, corpus, encoder, shared_ray, monkeypatch):
    """``retrieval.dense.build_workers=2``: the shards are encoded by two Ray actors side by side and written
    in corpus order, the same store (rows, checksums, resume point) as the in-process build."""
    from sonar.cluster.driver.indexing import run_index
    from sonar.cluster.wire.config import load_config
    from sonar.retrieval.indexer import RayEncodePool

    sent, submit = [], RayEncodePool.submit
    monkeypatch.setattr(RayEncodePool, "submit", lambda self, texts: sent.append(len(texts)) or submit(self, texts))

    cfg = load_config(["smoke"], [f"run.root={tmp_path / 'runs'}", f"retrieval.corpus={corpus}",
                                  "world.force=true", "retrieval.dense.build_workers=2", "retrieval.dense.shard_rows=2"])
    _, spread = run_index(cfg, progress=False, dense=True)
    alone = build_passage_vectors(corpus, tmp_path / "alone", encoder, chunk=2, progress=False)
    # the same rows (an actor's torch may sum in another order: float16 rounding apart, the same vectors)
    np.testing.assert_allclose(np.asarray(spread.matrix, np.float32), np.asarray(alone.matrix, np.float32), atol=2e-3)
    shards = {k: v[0] for k, v in spread.meta["shards"].items()}
    assert shards == {k: v[0] for k, v in alone.meta["shards"].items()} and spread.meta["rows_done"] == len(DOCS)
    d = spread.directory  # each shard's checksum is of the rows written
    from sonar.retrieval.rerank import _shard_sha

    mm = np.load(d / "vectors.npy", mmap_mode="r")
    assert all(_shard_sha(mm, int(k), v[0]) == v[1] for k, v in spread.meta["shards"].items())
    assert sent == [2, 2, 2, 1]  # every shard went to the actors
