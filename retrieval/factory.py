"""``build_retriever(cfg, corpus_path, index_root) -> Retriever``: one place that composes the stack.

Composition, innermost first::

    backend            TantivyRetriever (index built if needed) | ElasticRetriever (imported lazily)
                       | DenseIndexRetriever (vectors from `sonar index --dense`, never built here)
                       | HTTPRetriever (a Search-R1 retrieval server; no index, no corpus) | a plug-in
    [resilient]        ResilientRetriever around every backend but tantivy (retries, breaker)
    [wrap_backend]     a hook for code outside production, e.g. the benchmarks' latency simulator
    [reranker]         DenseReranker (candidates encoded at query time) | CrossEncoderReranker
    [cache]            CachedRetriever when cfg.cache_size > 0

Index location: ``cfg.index_dir`` when set, else ``<index_root>/<corpus fingerprint>``. The dense reranker
encodes only its candidates, at query time; a passage-vector store that ``sonar index --dense`` wrote in
that directory (same corpus fingerprint, same encoder) is read first when present.
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


@RETRIEVERS.register("dense")
def make_dense(cfg, corpus_path, index_root, *, report=None) -> Retriever:
    """Exact inner product over the passage vectors ``sonar index --dense`` built (``retrieval.dense``),
    the passages' text from the BM25 index beside them (built if missing, like tantivy's); the vectors are
    never encoded here (``retrieval/dense_index.py``)."""
    from sonar.retrieval.dense_index import open_dense_index
    from sonar.retrieval.indexer import ensure_index
    from sonar.retrieval.tantivy_index import TantivyRetriever

    report = report or ensure_index(cfg, corpus_path, index_root, resume=False)
    docs = TantivyRetriever(report.index_dir, max_query_chars=cfg.max_query_chars)
    return open_dense_index(cfg, report.index_dir, docs)


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
        r = RETRIEVERS.get(cfg.backend, "retrieval.backend")(cfg, corpus_path, index_root)
        check_retriever(r)
        if not isinstance(getattr(r, "name", None), str):
            raise TypeError(f"retrieval.backend={cfg.backend!r} made {r!r}, which has no str name (the cache key)")
        if resilient:
            from sonar.retrieval.resilient import ResilientRetriever

            r = ResilientRetriever(r, cfg.max_retries, cfg.backoff_s, cfg.breaker_failures, cfg.breaker_reset_s)
        return _above_backend(cfg, r, _encoder(cfg), None, False, wrap_backend)
    from sonar.retrieval.indexer import ensure_index

    server_dense = cfg.backend == "elasticsearch" and cfg.rerank == "dense" and cfg.elastic.store_vectors
    encoder = _encoder(cfg)
    # BM25 only: no passage is encoded here (the reranker encodes its candidates at query time); the
    # vectors stored in Elasticsearch with store_vectors are written by the bulk load, `sonar index`'s work
    report = ensure_index(cfg, corpus_path, index_root, resume=False, progress=progress,
                          encoder=encoder if server_dense else None)

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


class SearchServiceDown(RuntimeError):
    """The search service a run needs does not answer (or answers with an error) at start-up: names the
    backend, its address and what failed, before any learner or rollout worker starts."""


PROBE_QUERY = "sonar start-up check"


def probe_retriever(r: Retriever, cfg) -> None:
    """Send one query through ``r`` (built with ``resilient=False``: no retries, so a dead service is found
    at once) within ``cfg.timeout_s`` seconds; raise ``SearchServiceDown`` naming ``r.name`` (the backend and
    its address: ``elasticsearch:<host>/<index>``, ``http:<url>``, the index path) when it fails or is late.
    Answering with no hits is fine: an index that holds documents was checked by ``ensure_index``."""
    import concurrent.futures as cf

    pool = cf.ThreadPoolExecutor(1, thread_name_prefix="search-probe")
    try:
        pool.submit(r.batch_search, [PROBE_QUERY], cfg.k).result(timeout=cfg.timeout_s)  # the run's own request
    except cf.TimeoutError:
        raise SearchServiceDown(f"retrieval.backend={cfg.backend!r}: the search service {r.name} did not answer a "
                                f"query within retrieval.timeout_s={cfg.timeout_s} s; start it (or fix its address) "
                                "before training") from None
    except Exception as e:  # noqa: BLE001 - any failure of the service is the one refusal, with its cause
        raise SearchServiceDown(f"retrieval.backend={cfg.backend!r}: the search service {r.name} failed a query: "
                                f"{' '.join(str(e).split())}; start it (or fix its address) before training") from None
    finally:
        pool.shutdown(wait=False)  # a hung call is abandoned, not waited for


def _encoder(cfg):
    """The dense reranker's query and passage encoder (``retrieval.rerank_model``), or None without one."""
    if cfg.rerank != "dense":
        return None
    from sonar.retrieval.rerank import DenseEncoder

    return DenseEncoder(cfg.rerank_model)


def _stored_vectors(report, encoder):
    """A finished passage-vector store of this index's corpus and this encoder (``sonar index --dense``
    writes it beside the index), which the reranker reads before encoding; None when there is none."""
    import json

    from sonar.retrieval.rerank import PassageVectors, vectors_dir
    from sonar.retrieval.tantivy_index import MARKER

    if report is None or not report.index_dir:
        return None
    d = vectors_dir(report.index_dir, encoder.tag)
    try:
        vectors = PassageVectors(d)
    except FileNotFoundError:
        return None
    try:
        want = json.loads((Path(report.index_dir) / MARKER).read_text()).get("fingerprint")
    except (OSError, ValueError):
        want = None
    if want is not None and vectors.fingerprint != want:
        log.warning("%s: passage vectors of corpus %s, the index is of %s; encoding candidates instead", d,
                    vectors.fingerprint, want)
        return None
    return vectors


def _above_backend(cfg, r: Retriever, encoder, report, server_dense: bool,
                   wrap_backend: RetrieverWrap | None) -> Retriever:
    """The layers above any backend: the hook, the reranker, the cache."""
    if wrap_backend is not None:
        r = wrap_backend(r)

    rerank_tag = "none"
    if server_dense:
        rerank_tag = f"dense-server:{encoder.tag}@{cfg.rerank_candidates}"
    elif cfg.rerank == "dense":
        from sonar.retrieval.rerank import DenseReranker

        r = DenseReranker(r, encoder, n=cfg.rerank_candidates, cache_size=cfg.rerank_cache,
                          vectors=_stored_vectors(report, encoder))
        rerank_tag = f"dense:{encoder.tag}@{cfg.rerank_candidates}"
    elif cfg.rerank == "cross":
        from sonar.retrieval.rerank import CrossEncoderReranker

        r = CrossEncoderReranker(r, cfg.rerank_model, n=cfg.rerank_candidates)
        rerank_tag = f"cross:{Path(cfg.rerank_model).resolve().name}@{cfg.rerank_candidates}"

    if cfg.cache_size > 0:
        from sonar.retrieval.cache import CachedRetriever

        r = CachedRetriever(r, cfg.cache_size, rerank_tag, max_query_chars=cfg.max_query_chars)
    return r

