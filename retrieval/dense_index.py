"""The ``dense`` backend: exact inner-product search over the passage vectors ``sonar index --dense`` built.

Search-R1's retriever (e5 embeddings in a flat FAISS index) as a config choice instead of another server::

    retrieval.backend=dense retrieval.dense.model=<e5 dir> retrieval.dense.query_prefix="query: "
    retrieval.dense.passage_prefix="passage: "

The vectors are ``rerank.build_passage_vectors``'s store (float16, L2-normalised, memory-mapped, one row per
passage in corpus order; resumable, checksummed shards) under ``<index_dir>/vectors-<encoder tag>``; the
passages' text comes from the BM25 index beside it (``TantivyRetriever.fetch``, by doc id), so serving needs
neither the corpus file nor a second copy of the text.

Search is exact, what FAISS's ``IndexFlatIP`` computes: per batch of B queries, one encoder pass, then the
(B, D) query matrix against the store in blocks of ``search_block_rows`` rows (a float32 copy of one block
at a time: rows x D x 4 bytes), keeping each query's top k across blocks with ``argpartition``. Cost per
batch: P x D x B multiply-adds (21 M MiniLM rows: 8 GFLOP per query on CPU, milliseconds on a GPU; an
approximate index is the next step at that size). The store is never built here: a missing or unfinished
one is refused, naming the directory and the command that builds it.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from sonar.retrieval.base import Hit, check_search_args
from sonar.retrieval.corpus import normalise_query


class DenseIndexRetriever:
    """A Retriever over ``vectors`` (a finished ``PassageVectors``) and ``docs`` (an object with
    ``fetch(doc_ids) -> list[Hit | None]``, the BM25 index of the same corpus)."""

    def __init__(self, vectors, encoder, docs, *, query_prefix: str = "", block_rows: int = 262_144,
                 max_query_chars: int = 512):
        if vectors.dim != encoder.dim or vectors.model != encoder.tag:
            raise ValueError(f"vectors of {vectors.model} (dim {vectors.dim}) do not match encoder "
                             f"{encoder.tag} (dim {encoder.dim})")
        if block_rows < 1:
            raise ValueError(f"block_rows={block_rows} must be >= 1")
        self.vectors, self.encoder, self.docs = vectors, encoder, docs
        self.query_prefix = query_prefix
        self.block_rows = block_rows
        self.max_query_chars = max_query_chars
        self._id_of_row = self._ids_by_row(vectors)
        self.name = f"dense:{encoder.tag}:{Path(vectors.directory).resolve()}"
        self._lock = threading.Lock()
        self._c = {"queries": 0, "batches": 0, "empty_queries": 0, "search_s": 0.0, "encode_s": 0.0}

    @staticmethod
    def _ids_by_row(vectors) -> list[str]:
        out = [""] * len(vectors)
        for doc_id, row in vectors.row_of.items():
            out[row] = doc_id
        return out

    def top_rows(self, qv: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, k') rows and scores of the best inner products of each query row of ``qv`` (B, D), best first;
        k' = min(k, P). Duplicate-id rows (all but a duplicate's first row) never win."""
        m = self.vectors.matrix
        P, B = m.shape[0], qv.shape[0]
        k = min(k, P)
        best_s = np.full((B, 0), -np.inf, dtype=np.float32)
        best_r = np.zeros((B, 0), dtype=np.int64)
        for start in range(0, P, self.block_rows):
            block = np.asarray(m[start:start + self.block_rows], dtype=np.float32)  # (b, D)
            s = qv @ block.T  # (B, b)
            kk = min(k, s.shape[1])
            part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
            best_s = np.concatenate([best_s, np.take_along_axis(s, part, axis=1)], axis=1)
            best_r = np.concatenate([best_r, part + start], axis=1)
            if best_s.shape[1] > k:
                keep = np.argpartition(-best_s, k - 1, axis=1)[:, :k]
                best_s, best_r = np.take_along_axis(best_s, keep, axis=1), np.take_along_axis(best_r, keep, axis=1)
        order = np.argsort(-best_s, axis=1, kind="stable")
        return np.take_along_axis(best_r, order, axis=1), np.take_along_axis(best_s, order, axis=1)

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        check_search_args(queries, k)
        t0 = time.perf_counter()
        texts = [normalise_query(q, self.max_query_chars)[0] for q in queries]
        live = [i for i, t in enumerate(texts) if t]
        out: list[list[Hit]] = [[] for _ in queries]
        enc_s = 0.0
        if live:
            t1 = time.perf_counter()
            qv = self.encoder.encode([self.query_prefix + texts[i] for i in live], batch_size=max(len(live), 1))
            enc_s = time.perf_counter() - t1
            rows, scores = self.top_rows(qv, k)
            for j, i in enumerate(live):
                ids = [self._id_of_row[r] for r in rows[j]]
                found = self.docs.fetch(ids)
                out[i] = [Hit(h.doc_id, h.title, h.text, float(sc)) for h, sc in zip(found, scores[j])
                          if h is not None]
        with self._lock:
            self._c["queries"] += len(queries)
            self._c["batches"] += 1
            self._c["empty_queries"] += len(queries) - len(live)
            self._c["search_s"] += time.perf_counter() - t0
            self._c["encode_s"] += enc_s
        return out

    def stats(self) -> dict:
        with self._lock:
            return dict(self._c, num_vectors=len(self.vectors))


def open_dense_index(cfg, index_dir: str | Path, docs):
    """The ``dense`` backend over ``index_dir`` (a finished BM25 index ``docs`` of the same corpus):
    refuses, naming the directory and ``sonar index --dense``, when its vectors are missing, unfinished,
    of another corpus or of another passage prefix."""
    from sonar.retrieval.rerank import DenseEncoder, PassageVectors, _read_meta, vectors_dir

    encoder = DenseEncoder(cfg.dense.model)
    d = vectors_dir(index_dir, encoder.tag)
    meta = _read_meta(d)
    how = ("build them with `sonar index --dense` (resumable: a build killed part-way keeps its finished shards); "
           "a run never encodes a corpus on its start-up path")
    if meta is None or meta.get("status") != "complete":
        state = "none" if meta is None else f"{meta.get('rows_done')} of {meta.get('count')} rows"
        raise FileNotFoundError(f"retrieval.backend='dense': no finished passage vectors of {encoder.tag} in {d} "
                                f"({state}): {how}")
    if meta.get("fingerprint") != docs.fingerprint:
        raise FileNotFoundError(f"retrieval.backend='dense': the vectors in {d} are of corpus {meta.get('fingerprint')}, "
                                f"the index of {docs.fingerprint}: {how}")
    if meta.get("passage_prefix", "") != cfg.dense.passage_prefix:
        raise FileNotFoundError(f"retrieval.backend='dense': the vectors in {d} were encoded with passage_prefix="
                                f"{meta.get('passage_prefix', '')!r}, retrieval.dense.passage_prefix="
                                f"{cfg.dense.passage_prefix!r}: {how}")
    return DenseIndexRetriever(PassageVectors(d), encoder, docs, query_prefix=cfg.dense.query_prefix,
                               block_rows=cfg.dense.search_block_rows, max_query_chars=cfg.max_query_chars)
