"""Elasticsearch BM25 backend: explicit index mapping, bulk indexing, one ``_msearch`` per batch.

- :func:`create_index` sends an explicit mapping: a custom BM25 similarity (``sonar_bm25``, with the
  configured ``k1``/``b``) on ``title`` and ``text``, ``id`` as keyword, and optionally a 384-d cosine
  ``dense_vector`` field (``vector``) for server-side reranking. It returns the body it sent.
- :func:`bulk_index` streams ``{id, title, text}`` documents (plus optional vectors) through
  ``helpers.streaming_bulk`` with a tqdm bar; ``_id`` is the document id, so re-indexing is
  idempotent. Failed documents raise :class:`BulkIndexError` naming their ids. Refreshes at the end.
- :class:`ElasticRetriever` sends a batch of queries as ONE ``_msearch`` request; the results come
  back in input order. Each query is a ``multi_match`` (best_fields) over ``title^title_boost`` and
  ``text``: the query text is analysed as plain text and no query syntax is parsed (there is no
  ``query_string``), so user or model text cannot inject operators; control characters are dropped.

Errors. Client exceptions map to :class:`RetrievalError` kinds (:func:`map_exception`):
ConnectionTimeout -> timeout, ConnectionError/SSLError -> connection, ApiError 429 -> http_429,
5xx -> http_5xx, other 4xx (auth failures, missing index, bad query) -> bad_request. Per-query
errors inside an ``_msearch`` response: when *some* queries of a batch fail, each failed query
returns ``[]`` and is counted in ``stats()['query_errors']`` (one bad query must not fail the
others); when *every* query fails, the batch raises the first error's kind, so the retry and
breaker layers (``resilient.py``) see a dead or overloaded server.

Transport retries are off by default (``max_retries=0`` in :meth:`ElasticRetriever.from_config`):
``ResilientRetriever`` owns retries and backoff, and two stacked retry loops would multiply.

Secrets. :meth:`ElasticRetriever.from_config` reads the API key or the username/password from the
environment variables *named* in :class:`ElasticConfig`; the values go straight into the client and
never appear in the config, ``repr``/``str``, :meth:`ElasticRetriever.params` (the dict logged to
MLflow) or log records. A host URL carrying user-info is refused (that would put a secret in the
config); hosts given directly to the constructor are shown without their user-info part.

Server-side rerank. With ``store_vectors`` the index holds passage vectors, and
:meth:`ElasticRetriever.batch_search_vectors` reranks the top ``candidates`` BM25 hits by cosine
similarity to a query vector in the same ``_msearch`` (a ``rescore`` with a ``script_score``
``cosineSimilarity`` query, ``query_weight`` 0): score = cosine + 1.
"""
from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from typing import Any, Iterable, Iterator, Mapping, Sequence

from sonar.cluster.wire.redact import redact
from sonar.cluster.wire.text import clean_text
from sonar.retrieval.base import Hit, RetrievalError, check_search_args

log = logging.getLogger(__name__)

SIMILARITY = "sonar_bm25"
VECTOR_FIELD = "vector"
SOURCE_FIELDS = ["id", "title", "text"]
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


# --------------------------------------------------------------------------------------- errors
def _kind_for_status(status: Any) -> str:
    try:
        status = int(status)
    except (TypeError, ValueError):
        return "internal"
    if status == 429:
        return "http_429"
    if status == 408:
        return "timeout"
    if status >= 500:
        return "http_5xx"
    if status >= 400:
        return "bad_request"
    return "internal"


def map_exception(e: BaseException) -> RetrievalError:
    """An elasticsearch/elastic-transport exception -> RetrievalError with the right kind.

    The message holds the exception type, the HTTP status and the server's error type/reason, never
    request headers (so never credentials)."""
    from elasticsearch import ApiError, ConnectionError, ConnectionTimeout, SSLError, TransportError

    if isinstance(e, RetrievalError):
        return e
    if isinstance(e, (ConnectionTimeout, TimeoutError)):
        return RetrievalError("timeout", f"{type(e).__name__}: {e}")
    if isinstance(e, SSLError):
        return RetrievalError("connection", f"SSLError (not retried; check ca_certs/verify_certs): {e}",
                              retryable=False)
    if isinstance(e, ConnectionError):
        return RetrievalError("connection", f"{type(e).__name__}: {e}")
    if isinstance(e, ApiError):
        status = getattr(e.meta, "status", None) if getattr(e, "meta", None) is not None else None
        kind = _kind_for_status(status)
        if status in (401, 403):
            return RetrievalError(kind, f"authentication/authorization failed (HTTP {status}): {e.message}")
        return RetrievalError(kind, f"{type(e).__name__} HTTP {status}: {e.message}")
    if isinstance(e, TransportError):
        return RetrievalError("connection", f"{type(e).__name__}: {e}")
    return RetrievalError("internal", f"{type(e).__name__}: {e}", retryable=False)


def _response_error(resp: Mapping[str, Any]) -> RetrievalError:
    """The error entry of one ``_msearch`` response item -> RetrievalError."""
    status = resp.get("status")
    err = resp.get("error")
    if isinstance(err, Mapping):
        reason = f"{err.get('type', '?')}: {err.get('reason', '')}"
    else:
        reason = str(err)
    return RetrievalError(_kind_for_status(status), f"msearch item HTTP {status}: {reason}")


def redact_url(url: str) -> str:
    """``https://user:pw@host:9200/x`` -> ``https://***@host:9200/x`` (``sonar.cluster.wire.redact``, the one
    redaction: an ``@``, a space or a ``/`` in the password is removed whole)."""
    return redact(url)


# --------------------------------------------------------------------------------------- index
def index_body(k1: float = 1.2, b: float = 0.75, store_vectors: bool = False, dims: int = 384,
               shards: int = 1, replicas: int = 0) -> dict[str, Any]:
    """The explicit settings + mappings :func:`create_index` sends."""
    if k1 < 0 or not 0.0 <= b <= 1.0:
        raise ValueError(f"bm25 k1={k1} must be >= 0 and b={b} in [0, 1]")
    properties: dict[str, Any] = {
        "id": {"type": "keyword"},
        "title": {"type": "text", "similarity": SIMILARITY},
        "text": {"type": "text", "similarity": SIMILARITY},
    }
    if store_vectors:
        if dims < 1:
            raise ValueError(f"dims={dims} must be >= 1 when store_vectors=True")
        properties[VECTOR_FIELD] = {"type": "dense_vector", "dims": dims, "index": True, "similarity": "cosine"}
    return {
        "settings": {
            "number_of_shards": shards,
            "number_of_replicas": replicas,
            "index": {"similarity": {SIMILARITY: {"type": "BM25", "k1": float(k1), "b": float(b)}}},
        },
        "mappings": {"dynamic": "strict", "properties": properties},
    }


def create_index(client: Any, index: str, k1: float = 1.2, b: float = 0.75, store_vectors: bool = False,
                 dims: int = 384, *, shards: int = 1, replicas: int = 0, recreate: bool = False) -> dict[str, Any]:
    """Create ``index`` with the explicit mapping of :func:`index_body`; returns the body sent.

    ``recreate=True`` deletes an existing index first; otherwise an existing index raises
    ``ValueError`` (silently reusing an index built with other k1/b would corrupt an experiment)."""
    body = index_body(k1, b, store_vectors, dims, shards, replicas)
    if client.indices.exists(index=index):
        if not recreate:
            raise ValueError(f"index {index!r} already exists (pass recreate=True to rebuild it)")
        client.indices.delete(index=index)
    client.indices.create(index=index, settings=body["settings"], mappings=body["mappings"])
    return body


class BulkIndexError(RuntimeError):
    """Some documents were not indexed. ``failures`` = [(doc_id, reason), ...]."""

    def __init__(self, index: str, failures: list[tuple[str, str]], indexed: int):
        self.failures = failures
        self.indexed = indexed
        shown = "; ".join(f"{i}: {r}" for i, r in failures[:5])
        more = f" (+{len(failures) - 5} more)" if len(failures) > 5 else ""
        super().__init__(f"bulk indexing into {index!r}: {len(failures)} document(s) failed, "
                         f"{indexed} indexed: {shown}{more}")


def _actions(index: str, docs: Iterable[Mapping[str, Any]],
             vectors: Iterable[Sequence[float]] | None) -> Iterator[dict[str, Any]]:
    vec_iter = iter(vectors) if vectors is not None else None
    for pos, doc in enumerate(docs):
        doc_id = doc.get("id")
        if doc_id is None or doc_id == "":
            raise ValueError(f"document #{pos} has no 'id' field (keys: {sorted(doc)})")
        source = {"id": str(doc_id), "title": str(doc.get("title") or ""), "text": str(doc.get("text") or "")}
        if vec_iter is not None:
            try:
                vec = next(vec_iter)
            except StopIteration:
                raise ValueError(f"vectors ran out at document #{pos} (id {doc_id!r}): "
                                 "need one vector per document") from None
            source[VECTOR_FIELD] = [float(x) for x in vec]
        yield {"_op_type": "index", "_index": index, "_id": str(doc_id), "_source": source}
    if vec_iter is not None and next(vec_iter, None) is not None:
        raise ValueError("more vectors than documents: need exactly one vector per document")


def bulk_index(client: Any, index: str, docs_iter: Iterable[Mapping[str, Any]], batch_size: int = 500,
               progress: bool = True, vectors: Iterable[Sequence[float]] | None = None, *,
               total: int | None = None, refresh: bool = True) -> int:
    """Index ``{id, title, text}`` dicts (``vectors``: one per doc, same order) with a tqdm bar.

    Returns the number of documents indexed; raises :class:`BulkIndexError` naming every failed
    doc id (after trying them all), ``ValueError`` for a doc without an id."""
    from elasticsearch import helpers
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if total is None and hasattr(docs_iter, "__len__"):
        total = len(docs_iter)  # type: ignore[arg-type]
    failures: list[tuple[str, str]] = []
    ok_count = 0
    bar = tqdm(total=total, disable=not progress, desc=f"index {index}", unit="doc")
    try:
        for ok, item in helpers.streaming_bulk(client, _actions(index, docs_iter, vectors),
                                               chunk_size=batch_size, raise_on_error=False,
                                               raise_on_exception=True, max_retries=2):
            if ok:
                ok_count += 1
            else:
                info = next(iter(item.values()), {}) if isinstance(item, Mapping) else {}
                err = info.get("error", item)
                reason = f"{err.get('type')}: {err.get('reason')}" if isinstance(err, Mapping) else str(err)
                failures.append((str(info.get("_id", "?")), reason))
            bar.update(1)
    finally:
        bar.close()
    if refresh:
        client.indices.refresh(index=index)
    if failures:
        raise BulkIndexError(index, failures, ok_count)
    return ok_count


# --------------------------------------------------------------------------------------- manifest
MANIFEST_KEY = "sonar_manifest"
"""Key under the index mapping's ``_meta`` where ``sonar index`` records its build (``retrieval/indexer.py``):
status (building | complete), expected and committed documents, the last committed corpus line, the
corpus fingerprint and whether vectors are stored. ``_meta`` is not searched and not returned as a hit."""


def read_manifest(client: Any, index: str) -> dict[str, Any] | None:
    """The manifest of ``index`` (None: an index Sonar did not build, or built before manifests)."""
    resp = client.indices.get_mapping(index=index)
    body = resp.body if hasattr(resp, "body") else resp
    mappings = (next(iter(body.values()), {}) or {}).get("mappings") or {}
    meta = mappings.get("_meta") or {}
    m = meta.get(MANIFEST_KEY)
    return dict(m) if isinstance(m, Mapping) else None


def write_manifest(client: Any, index: str, manifest: Mapping[str, Any]) -> None:
    """Replace the manifest of ``index`` (``PUT <index>/_mapping`` with ``_meta``)."""
    client.indices.put_mapping(index=index, meta={MANIFEST_KEY: dict(manifest)})


class ServerDenseReranker:
    """A Retriever: dense reranking inside Elasticsearch, for an index built with ``store_vectors``.

    Per batch: one ``encoder.encode`` of the (normalised) queries and one ``_msearch`` whose searches
    rescore their BM25 top ``n`` by ``cosineSimilarity`` to the query vector
    (:meth:`ElasticRetriever.batch_search_vectors`): score = cosine + 1. No passage vector is held by
    the client. ``normalise`` is ``corpus.normalise_query`` (passed in: this module imports no corpus code).
    """

    def __init__(self, elastic: "ElasticRetriever", encoder: Any, n: int = 20, normalise=None):
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        self.elastic = elastic
        self.encoder = encoder
        self.n = n
        self._normalise = normalise or (lambda q: clean_query(q))
        self.name = elastic.name

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        texts = [self._normalise(q) for q in queries]
        qv = self.encoder.encode(texts, batch_size=max(len(texts), 1))
        return self.elastic.batch_search_vectors(queries, [list(map(float, v)) for v in qv], k,
                                                 candidates=max(self.n, k))

    def stats(self) -> dict[str, Any]:
        return self.elastic.stats()

    def params(self) -> dict[str, Any]:
        return dict(self.elastic.params(), rerank=f"dense-server:{self.encoder.tag}@{self.n}")


# --------------------------------------------------------------------------------------- search
def clean_query(q: str) -> str:
    """Drop control characters and surrounding whitespace (multi_match parses no syntax)."""
    return _CONTROL.sub(" ", q).strip()


def _env_secret(var: str | None, env: Mapping[str, str]) -> str | None:
    if not var:
        return None
    value = env.get(var)
    return value if value else None


class ElasticRetriever:
    """BM25 over an Elasticsearch index, one ``_msearch`` per batch (see the module docstring).

    ``client``: an ``elasticsearch.Elasticsearch``; ``async_client``: an ``AsyncElasticsearch`` or a
    zero-arg factory for one (created lazily, inside the event loop that first awaits
    :meth:`abatch_search`). ``k1``/``b`` are what the index was built with (used by
    :meth:`create_index` and reported by :meth:`params`; searching does not depend on them).
    """

    def __init__(self, client: Any, index: str, k1: float = 1.2, b: float = 0.75, title_boost: float = 2.0,
                 *, store_vectors: bool = False, dims: int = 384, async_client: Any = None,
                 hosts: Sequence[str] | None = None, auth: str = "none", shards: int = 1, replicas: int = 0):
        if title_boost <= 0:
            raise ValueError(f"title_boost={title_boost} must be > 0")
        self.client = client
        self.index = index
        self.k1 = float(k1)
        self.b = float(b)
        self.title_boost = float(title_boost)
        self.store_vectors = store_vectors
        self.dims = dims
        self.shards = int(shards)
        self.replicas = int(replicas)
        self._async = async_client
        if hosts is None:
            try:
                hosts = [f"{n.config.scheme}://{n.config.host}:{n.config.port}" for n in client.transport.node_pool.all()]
            except AttributeError:
                hosts = []
        self.hosts = [redact_url(h) for h in hosts]
        self.auth = auth
        self.name = f"elasticsearch:{self.hosts[0] if self.hosts else '?'}/{index}"
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._query_errors: Counter[str] = Counter()

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: Any, *, max_retries: int = 0, retry_on_timeout: bool = False,
                    env: Mapping[str, str] | None = None, **client_kwargs: Any) -> "ElasticRetriever":
        """Build clients from an :class:`ElasticConfig`. Auth: the API key if ``cfg.api_key_env`` names
        a set env var, else basic auth if both ``username_env`` and ``password_env`` are set, else
        none. A host URL with user-info (``https://user:pw@host``) is refused with ``ValueError``: the
        config must hold no secret. ``max_retries``: transport-level retries (0: leave retries to
        ResilientRetriever); extra ``client_kwargs`` go to both clients."""
        import os

        from elasticsearch import AsyncElasticsearch, Elasticsearch

        env = os.environ if env is None else env
        cloud_id = cfg.cloud_id
        for i, h in enumerate([] if cloud_id else cfg.hosts):
            if redact_url(h) != h:
                raise ValueError(
                    f"elastic.hosts[{i}]={redact_url(h)!r} carries credentials in the URL; the config must not "
                    f"hold secrets: put them in the env vars named by api_key_env={cfg.api_key_env!r} or "
                    f"username_env={cfg.username_env!r}/password_env={cfg.password_env!r}")
        kwargs: dict[str, Any] = {
            **({"cloud_id": cloud_id} if cloud_id else {"hosts": list(cfg.hosts)}),
            "request_timeout": float(cfg.request_timeout_s),
            "verify_certs": bool(cfg.verify_certs),
            "max_retries": int(max_retries),
            "retry_on_timeout": bool(retry_on_timeout),
        }
        if cfg.ca_certs:
            kwargs["ca_certs"] = cfg.ca_certs
        if not cfg.verify_certs:
            kwargs["ssl_show_warn"] = False
        api_key = _env_secret(cfg.api_key_env, env)
        user, password = _env_secret(cfg.username_env, env), _env_secret(cfg.password_env, env)
        if api_key:
            kwargs["api_key"] = api_key
            auth = f"api_key(env:{cfg.api_key_env})"
        elif user and password:
            kwargs["basic_auth"] = (user, password)
            auth = f"basic(env:{cfg.username_env},{cfg.password_env})"
        else:
            auth = "none"
        kwargs.update(client_kwargs)
        client = Elasticsearch(**kwargs)

        def make_async() -> Any:  # closes over the secrets; never stored in a repr-able field
            return AsyncElasticsearch(**kwargs)

        # A cloud id names the deployment, not a secret; shown as the host (the id's name part only).
        hosts = [f"cloud:{cloud_id.split(':', 1)[0]}"] if cloud_id else list(cfg.hosts)
        return cls(client, cfg.index, cfg.bm25_k1, cfg.bm25_b, cfg.title_boost, store_vectors=cfg.store_vectors,
                   async_client=make_async, hosts=hosts, auth=auth, shards=cfg.shards,
                   replicas=cfg.replicas)

    def __repr__(self) -> str:
        return (f"ElasticRetriever(hosts={self.hosts}, index={self.index!r}, k1={self.k1}, b={self.b}, "
                f"title_boost={self.title_boost}, store_vectors={self.store_vectors}, auth={self.auth!r})")

    __str__ = __repr__

    def params(self) -> dict[str, Any]:
        """What to log (MLflow params): no secret values, only the names of the env vars."""
        return {"backend": "elasticsearch", "hosts": list(self.hosts), "index": self.index, "bm25_k1": self.k1,
                "bm25_b": self.b, "title_boost": self.title_boost, "store_vectors": self.store_vectors,
                "shards": self.shards, "replicas": self.replicas, "auth": self.auth}

    def create_index(self, recreate: bool = False) -> dict[str, Any]:
        """:func:`create_index` with this retriever's index, k1, b and vector settings."""
        return create_index(self.client, self.index, self.k1, self.b, self.store_vectors, self.dims,
                            shards=self.shards, replicas=self.replicas, recreate=recreate)

    def close(self) -> None:
        self.client.close()

    async def aclose(self) -> None:
        if self._async is not None and hasattr(self._async, "msearch"):
            await self._async.close()

    # ------------------------------------------------------------------------------ request bodies
    def _query(self, q: str) -> dict[str, Any]:
        boost = int(self.title_boost) if float(self.title_boost).is_integer() else self.title_boost
        return {"multi_match": {"query": q, "fields": [f"title^{boost}", "text"], "type": "best_fields"}}

    def msearch_body(self, queries: Sequence[str], k: int, vectors: Sequence[Sequence[float]] | None = None,
                     candidates: int | None = None) -> tuple[list[dict[str, Any]], list[int]]:
        """(``_msearch`` body, positions of the queries it contains). Empty queries are not sent."""
        body: list[dict[str, Any]] = []
        sent: list[int] = []
        for i, raw in enumerate(queries):
            q = clean_query(raw)
            if not q:
                continue
            search: dict[str, Any] = {"query": self._query(q), "size": k, "_source": SOURCE_FIELDS,
                                      "track_total_hits": False}
            if vectors is not None:
                window = max(k, candidates or k)
                search["rescore"] = {"window_size": window, "query": {
                    "query_weight": 0.0, "rescore_query_weight": 1.0,
                    "rescore_query": {"script_score": {
                        "query": {"match_all": {}},
                        "script": {"source": f"cosineSimilarity(params.qv, '{VECTOR_FIELD}') + 1.0",
                                   "params": {"qv": [float(x) for x in vectors[i]]}}}}}}
            body.append({"index": self.index})
            body.append(search)
            sent.append(i)
        return body, sent

    def _parse(self, n: int, k: int, sent: list[int], responses: Sequence[Mapping[str, Any]]) -> list[list[Hit]]:
        if len(responses) != len(sent):
            raise RetrievalError("internal", f"_msearch returned {len(responses)} responses for {len(sent)} searches")
        out: list[list[Hit]] = [[] for _ in range(n)]
        errors: list[tuple[int, RetrievalError]] = []
        for pos, resp in zip(sent, responses):
            if "error" in resp:
                errors.append((pos, _response_error(resp)))
                continue
            hits = []
            for h in resp["hits"]["hits"][:k]:
                src = h.get("_source") or {}
                hits.append(Hit(doc_id=clean_text(str(src.get("id", h.get("_id")))),
                                title=clean_text(str(src.get("title", ""))), text=clean_text(str(src.get("text", ""))),
                                score=float(h.get("_score") or 0.0)))
            out[pos] = hits
        if errors:
            with self._lock:
                for _, err in errors:
                    self._query_errors[err.kind] += 1
            if len(errors) == len(sent):
                raise RetrievalError(errors[0][1].kind, f"all {len(sent)} searches failed: {errors[0][1]}")
            log.warning("%s: %d of %d queries failed in _msearch (returned []); first: %s",
                        self.name, len(errors), len(sent), errors[0][1])
        return out

    def _count(self, n_sent: int) -> None:
        with self._lock:
            self._c["requests"] += 1
            self._c["queries"] += n_sent

    def _fail(self, e: BaseException) -> RetrievalError:
        err = map_exception(e)
        with self._lock:
            self._errors[err.kind] += 1
        return err

    # ------------------------------------------------------------------------------ search
    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        return self._search(queries, k, None, None)

    def batch_search_vectors(self, queries: Sequence[str], query_vectors: Sequence[Sequence[float]], k: int,
                             candidates: int = 20) -> list[list[Hit]]:
        """Server-side dense rerank: top ``candidates`` BM25 hits rescored by cosine to the query vector
        (score = cosine + 1). Needs an index built with ``store_vectors=True``."""
        if not self.store_vectors:
            raise ValueError(f"{self.name}: batch_search_vectors needs store_vectors=True")
        if len(query_vectors) != len(queries):
            raise ValueError(f"{len(queries)} queries but {len(query_vectors)} query vectors")
        return self._search(queries, k, query_vectors, candidates)

    def _search(self, queries, k, vectors, candidates) -> list[list[Hit]]:
        check_search_args(queries, k)
        body, sent = self.msearch_body(queries, k, vectors, candidates)
        if not sent:
            return [[] for _ in queries]
        self._count(len(sent))
        try:
            resp = self.client.msearch(searches=body)
        except Exception as e:  # noqa: BLE001
            raise self._fail(e) from e
        return self._parse_counted(len(queries), k, sent, resp)

    def _parse_counted(self, n: int, k: int, sent, resp) -> list[list[Hit]]:
        """Parse an _msearch response (sync and async paths alike); a failure is counted by kind."""
        try:
            return self._parse(n, k, sent, resp["responses"])
        except RetrievalError as e:
            with self._lock:
                self._errors[e.kind] += 1
            raise

    def _get_async(self) -> Any:
        if self._async is None:
            raise RuntimeError(f"{self.name}: no async client (build with from_config or pass async_client=)")
        if callable(self._async) and not hasattr(self._async, "msearch"):
            self._async = self._async()
        return self._async

    async def abatch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """:meth:`batch_search` over ``AsyncElasticsearch`` (aiohttp): same body, parsing and errors."""
        check_search_args(queries, k)
        body, sent = self.msearch_body(queries, k)
        if not sent:
            return [[] for _ in queries]
        client = self._get_async()
        self._count(len(sent))
        try:
            resp = await client.msearch(searches=body)
        except Exception as e:  # noqa: BLE001
            raise self._fail(e) from e
        return self._parse_counted(len(queries), k, sent, resp)

    def stats(self) -> dict[str, Any]:
        """``requests``: _msearch calls sent; ``queries``: searches in them; ``errors``: failed calls by
        kind; ``query_errors``: failed searches inside otherwise answered _msearch calls."""
        with self._lock:
            return {"requests": self._c["requests"], "queries": self._c["queries"], "errors": dict(self._errors),
                    "query_errors": dict(self._query_errors)}

