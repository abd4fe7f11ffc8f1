"""``build_retriever(cfg, corpus_path, index_root) -> Retriever``: one place that composes the stack.

Composition, innermost first::

    backend            TantivyRetriever (index built if needed) | ElasticRetriever (imported lazily)
    [resilient]        ResilientRetriever around the Elasticsearch backend (retries, breaker)
    [wrap_backend]     a hook for code outside production, e.g. the benchmarks' latency simulator
    [reranker]         DenseReranker (passage vectors built if needed) | CrossEncoderReranker
    [cache]            CachedRetriever when cfg.cache_size > 0

Index location: ``cfg.index_dir`` when set, else ``<index_root>/<corpus fingerprint>``; the passage
vectors of the dense reranker live in the same directory (also for the Elasticsearch backend).
The tantivy title boost is ``cfg.elastic.title_boost`` so both backends weigh titles alike.

Elasticsearch: a missing index is created and filled from the corpus (bulk, ``_id`` = doc id);
an existing index is used as it is (its name is the user's, there is no fingerprint to check).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from sonar.retrieval.base import Retriever
from sonar.retrieval.corpus import CorpusReader, corpus_fingerprint

log = logging.getLogger(__name__)

RetrieverWrap = Callable[[Retriever], Retriever]
"""``wrap_backend(backend) -> Retriever``: see ``build_retriever``."""


def index_dir_for(cfg, corpus_path: str, index_root: str) -> Path:
    """``cfg.index_dir`` or ``<index_root>/<fingerprint of corpus_path>``."""
    if cfg.index_dir:
        return Path(cfg.index_dir)
    return Path(index_root) / corpus_fingerprint(corpus_path)


def build_retriever(cfg, corpus_path: str, index_root: str, *, progress: bool = False,
                    resilient: bool = True, wrap_backend: RetrieverWrap | None = None) -> Retriever:
    """Build the retriever ``cfg`` (a ``RetrievalConfig``) describes over ``corpus_path``.

    ``progress``: tqdm bars while building indexes/vectors. ``resilient``: wrap the Elasticsearch
    backend in ``ResilientRetriever`` with ``cfg.max_retries / backoff_s / breaker_*`` (the in-process
    tantivy backend has no transient failures to retry). ``wrap_backend``: the hook through which
    code outside production changes the backend (the benchmarks inject a remote cluster's latency):
    called once with the (resilient) backend, it returns the retriever the reranker and the cache are
    built on, so cache hits never reach it. It must keep the backend's ``name`` (cache keys) and, when
    the factory runs inside a Ray actor, be picklable.
    """
    if cfg.backend not in ("tantivy", "elasticsearch"):
        raise ValueError(f"retrieval.backend={cfg.backend!r} is not one of ['tantivy', 'elasticsearch']")
    if cfg.rerank not in ("none", "dense", "cross"):
        raise ValueError(f"retrieval.rerank={cfg.rerank!r} is not one of ['none', 'dense', 'cross']")
    if cfg.rerank == "cross" and not cfg.rerank_model:
        raise ValueError("retrieval.rerank='cross' needs retrieval.rerank_model (a local sequence-classification "
                         "model directory); retrieval.rerank_model=None")
    if not Path(corpus_path).is_file():
        raise FileNotFoundError(f"corpus {corpus_path!r} does not exist (retrieval.corpus={cfg.corpus!r})")
    idx_dir = index_dir_for(cfg, corpus_path, index_root)

    if cfg.backend == "tantivy":
        from sonar.retrieval.tantivy_index import TantivyRetriever, build_index

        build_index(corpus_path, idx_dir, progress=progress)
        r: Retriever = TantivyRetriever(idx_dir, title_boost=cfg.elastic.title_boost,
                                        max_query_chars=cfg.max_query_chars)
    else:
        r = _elastic(cfg, corpus_path, progress)
        if resilient:
            from sonar.retrieval.resilient import ResilientRetriever

            r = ResilientRetriever(r, cfg.max_retries, cfg.backoff_s, cfg.breaker_failures, cfg.breaker_reset_s)

    if wrap_backend is not None:
        r = wrap_backend(r)

    rerank_tag = "none"
    if cfg.rerank == "dense":
        from sonar.retrieval.rerank import DenseEncoder, DenseReranker, build_passage_vectors

        encoder = DenseEncoder(cfg.rerank_model)
        vectors = build_passage_vectors(corpus_path, idx_dir, encoder, progress=progress)
        r = DenseReranker(r, vectors, encoder, n=cfg.rerank_candidates)
        rerank_tag = f"dense:{encoder.tag}@{cfg.rerank_candidates}"
    elif cfg.rerank == "cross":
        from sonar.retrieval.rerank import CrossEncoderReranker

        r = CrossEncoderReranker(r, cfg.rerank_model, n=cfg.rerank_candidates)
        rerank_tag = f"cross:{Path(cfg.rerank_model).resolve().name}@{cfg.rerank_candidates}"

    if cfg.cache_size > 0:
        from sonar.retrieval.cache import CachedRetriever

        r = CachedRetriever(r, cfg.cache_size, rerank_tag, max_query_chars=cfg.max_query_chars)
    return r


def _elastic(cfg, corpus_path: str, progress: bool) -> Retriever:
    from sonar.retrieval.elastic import ElasticRetriever, bulk_index  # lazy: the client is heavy

    r = ElasticRetriever.from_config(cfg.elastic)
    try:
        exists = bool(r.client.indices.exists(index=r.index))
    except Exception as e:  # noqa: BLE001 - report which server and index failed
        raise RuntimeError(f"cannot reach Elasticsearch {r.hosts} to check index {r.index!r}: {e}") from e
    if not exists:
        log.info("creating Elasticsearch index %s from %s", r.index, corpus_path)
        r.create_index()
        docs = ({"id": p.doc_id, "title": p.title, "text": p.text} for p in CorpusReader(corpus_path))
        bulk_index(r.client, r.index, docs, progress=progress)
    return r
