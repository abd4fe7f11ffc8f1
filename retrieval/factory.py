"""``build_retriever(cfg, corpus_path, index_root) -> Retriever``: one place that composes the stack.

Composition, innermost first::

    backend            TantivyRetriever (index built if needed) | ElasticRetriever (imported lazily)
                       | HTTPRetriever (a Search-R1 retrieval server; no index, no corpus) | a plug-in
    [resilient]        ResilientRetriever around every backend but tantivy (retries, breaker)
    [wrap_backend]     a hook for code outside production, e.g. the benchmarks' latency simulator
    [reranker]         DenseReranker (passage vectors built if needed) | CrossEncoderReranker
    [cache]            CachedRetriever when cfg.cache_size > 0

Index location: ``cfg.index_dir`` when set, else ``<index_root>/<corpus fingerprint>``; the passage
vectors of the dense reranker live in the same directory (also for the Elasticsearch backend).
The tantivy title boost is ``cfg.elastic.title_boost`` so both backends weigh titles alike.

Every index goes through ``indexer.ensure_index`` (the builder ``sonar index`` runs) with
``resume=False``: a missing index is built, a complete one is used (the corpus file is then not
needed), an interrupted one is refused (``PartialIndexError``: ``sonar index --resume`` finishes it).
With ``elastic.store_vectors`` and ``rerank=dense`` the reranking runs inside Elasticsearch
(``elastic.ServerDenseReranker``, below the resilience layer) and no client-side vectors are loaded.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from sonar.cluster.wire.plugins import INDEXED_RETRIEVERS, Registry, is_plugin, remember
from sonar.retrieval.base import Retriever, check_retriever

log = logging.getLogger(__name__)

RetrieverWrap = Callable[[Retriever], Retriever]
"""``wrap_backend(backend) -> Retriever``: see ``build_retriever``."""

RETRIEVERS = Registry("retriever")
"""``retrieval.backend`` -> ``make(config: RetrievalConfig, corpus: str | None, index_root: str) -> Retriever``:
the built-in backends below and a user's plug-in (``module:attr`` / ``file.py:attr``) alike. ``INDEXED``
backends own an index that ``ensure_index`` builds from the corpus; any other backend is the user's
service or code, and only the layers above the backend (resilience, reranker, cache) are Sonar's."""
INDEXED = INDEXED_RETRIEVERS


@RETRIEVERS.register("tantivy")
def make_tantivy(cfg, corpus_path, index_root, *, report=None) -> Retriever:
    """Embedded BM25 over the index of ``corpus_path`` (built if missing, ``indexer.ensure_index``)."""
    from sonar.retrieval.indexer import ensure_index
    from sonar.retrieval.tantivy_index import TantivyRetriever

    report = report or ensure_index(cfg, corpus_path, index_root, resume=False)
    return TantivyRetriever(report.index_dir, title_boost=cfg.elastic.title_boost, max_query_chars=cfg.max_query_chars)


@RETRIEVERS.register("elasticsearch")
def make_elasticsearch(cfg, corpus_path, index_root, *, report=None) -> Retriever:
    """Elasticsearch BM25 (``retrieval.elastic``); the index is created and filled by ``ensure_index``."""
    from sonar.retrieval.elastic import ElasticRetriever

    if report is None:
        from sonar.retrieval.indexer import ensure_index

        ensure_index(cfg, corpus_path, index_root, resume=False)
    return ElasticRetriever.from_config(cfg.elastic)


@RETRIEVERS.register("http")
def make_http(cfg, corpus_path, index_root) -> Retriever:
    """A retrieval server with Search-R1's ``/retrieve`` API (``retrieval.http``, ``retrieval/http_backend.py``);
    the corpus lives behind it, so ``corpus_path`` and ``index_root`` are not read."""
    from sonar.retrieval.http_backend import HTTPRetriever

    return HTTPRetriever.from_config(cfg)


def build_retriever(cfg, corpus_path: str | None, index_root: str, *, progress: bool = False,
                    resilient: bool = True, wrap_backend: RetrieverWrap | None = None,
                    plugins: dict | None = None) -> Retriever:
    """Build the retriever ``cfg`` (a ``RetrievalConfig``) describes over ``corpus_path``.

    ``progress``: tqdm bars while building indexes/vectors. ``resilient``: wrap the Elasticsearch
    backend in ``ResilientRetriever`` with ``cfg.max_retries / backoff_s / breaker_*`` (the in-process
    tantivy backend has no transient failures to retry). ``wrap_backend``: the hook through which
    code outside production changes the backend (the benchmarks inject a remote cluster's latency):
    called once with the (resilient) backend, it returns the retriever the reranker and the cache are
    built on, so cache hits never reach it. It must keep the backend's ``name`` (cache keys) and, when
    the factory runs inside a Ray actor, be picklable. ``plugins``: ``Config.plugins`` (the sources of
    file plug-ins), for a process that has not seen the config (a retrieval replica).

    The backend comes from ``RETRIEVERS`` (a built-in name or a plug-in). A backend that is not
    ``INDEXED`` (a plug-in, the HTTP client) is wrapped in ``ResilientRetriever`` like Elasticsearch:
    it is someone's service or code, with transient failures to retry.
    """
    if plugins:
        remember(plugins)
    if not is_plugin(cfg.backend) and cfg.backend not in RETRIEVERS.names():
        raise ValueError(f"retrieval.backend={cfg.backend!r} is not one of {list(RETRIEVERS.names())} nor a plug-in")
    if cfg.rerank not in ("none", "dense", "cross"):
        raise ValueError(f"retrieval.rerank={cfg.rerank!r} is not one of ['none', 'dense', 'cross']")
    if cfg.rerank == "cross" and not cfg.rerank_model:
        raise ValueError("retrieval.rerank='cross' needs retrieval.rerank_model (a local sequence-classification "
                         "model directory); retrieval.rerank_model=None")
    if cfg.backend not in INDEXED:
        if cfg.rerank == "dense":
            raise ValueError(f"retrieval.rerank='dense' with retrieval.backend={cfg.backend!r}: the dense reranker "
                             "reads passage vectors of a local index (tantivy or elasticsearch); use rerank=cross "
                             "or none with another backend")
        r = RETRIEVERS.get(cfg.backend, "retrieval.backend")(cfg, corpus_path, index_root)
        check_retriever(r)
        if not isinstance(getattr(r, "name", None), str):
            raise TypeError(f"retrieval.backend={cfg.backend!r} made {r!r}, which has no str name (the cache key)")
        if resilient:
            from sonar.retrieval.resilient import ResilientRetriever

            r = ResilientRetriever(r, cfg.max_retries, cfg.backoff_s, cfg.breaker_failures, cfg.breaker_reset_s)
        return _above_backend(cfg, r, None, None, False, wrap_backend)
    from sonar.retrieval.indexer import ensure_index

    server_dense = cfg.backend == "elasticsearch" and cfg.rerank == "dense" and cfg.elastic.store_vectors
    encoder = None
    if cfg.rerank == "dense":
        from sonar.retrieval.rerank import DenseEncoder

        encoder = DenseEncoder(cfg.rerank_model)
    report = ensure_index(cfg, corpus_path, index_root, resume=False, progress=progress, encoder=encoder)

    r: Retriever = RETRIEVERS.get(cfg.backend, "retrieval.backend")(cfg, corpus_path, index_root, report=report)
    if cfg.backend == "elasticsearch":
        if server_dense:
            from sonar.retrieval.corpus import normalise_query
            from sonar.retrieval.elastic import ServerDenseReranker

            r = ServerDenseReranker(r, encoder, n=cfg.rerank_candidates,
                                    normalise=lambda q: normalise_query(q, None)[0])
        if resilient:
            from sonar.retrieval.resilient import ResilientRetriever

            r = ResilientRetriever(r, cfg.max_retries, cfg.backoff_s, cfg.breaker_failures, cfg.breaker_reset_s)

    return _above_backend(cfg, r, encoder, report, server_dense, wrap_backend)


def _above_backend(cfg, r: Retriever, encoder, report, server_dense: bool,
                   wrap_backend: RetrieverWrap | None) -> Retriever:
    """The layers above any backend: the hook, the reranker, the cache."""
    if wrap_backend is not None:
        r = wrap_backend(r)

    rerank_tag = "none"
    if server_dense:
        rerank_tag = f"dense-server:{encoder.tag}@{cfg.rerank_candidates}"
    elif cfg.rerank == "dense":
        from sonar.retrieval.rerank import DenseReranker, PassageVectors

        r = DenseReranker(r, PassageVectors(report.vectors_dir), encoder, n=cfg.rerank_candidates)
        rerank_tag = f"dense:{encoder.tag}@{cfg.rerank_candidates}"
    elif cfg.rerank == "cross":
        from sonar.retrieval.rerank import CrossEncoderReranker

        r = CrossEncoderReranker(r, cfg.rerank_model, n=cfg.rerank_candidates)
        rerank_tag = f"cross:{Path(cfg.rerank_model).resolve().name}@{cfg.rerank_candidates}"

    if cfg.cache_size > 0:
        from sonar.retrieval.cache import CachedRetriever

        r = CachedRetriever(r, cfg.cache_size, rerank_tag, max_query_chars=cfg.max_query_chars)
    return r

