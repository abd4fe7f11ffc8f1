"""A retrieval backend over HTTP, compatible with Search-R1's retrieval server (``retrieval.backend=http``).

Search-R1, RAG-R1 and most of this field serve retrieval from a server (Search-R1's
``search_r1/search/retrieval_server.py``: e5 + FAISS, or BM25, behind FastAPI). A user's server plugs in
unchanged. The wire, as that server and its client (``search_r1/llm_agent/generation.py``) have it
(line numbers: Search-R1 at commit a14dc3a):

* request: ``POST <url>`` with JSON ``{"queries": [...], "topk": k, "return_scores": true}``
  (the body model ``QueryRequest``, ``retrieval_server.py:318-321``; the endpoint ``/retrieve``,
  ``retrieval_server.py:326-327``; the client's payload, ``generation.py:450-458``, always with scores);
* answer: ``{"result": [hits of query 0, hits of query 1, ...]}`` (``retrieval_server.py:347-358``):
  with ``return_scores`` each hit is ``{"document": <record>, "score": s}``, without it the record
  itself. The record is a corpus line (``load_docs``, ``retrieval_server.py:34-36``: wiki-18's
  ``{"id", "contents"}``), or, from the BM25 server over an index that stores its documents,
  ``{"title", "text", "contents"}`` with no id (``retrieval_server.py:174-186``);
* a document's title is the first line of ``contents`` and its text the rest (the client,
  ``generation.py:464-466``); the BM25 server also strips the title's quotes (``retrieval_server.py:181``),
  and so does Sonar (``retrieval/corpus.py:split_contents``), so ``"Paris"`` and ``Paris`` are one title.
  A record with ``title``/``text`` and no ``contents`` is read as it is. A record without ``id``
  (or ``doc_id``) is named by a hash of its title and text: the same document, the same id, every call.
* order: the server's. Search-R1's client renders the hits in the order they come
  (``generation.py:462``), and a FAISS index over L2 distance scores its best hit lowest, so Sonar does
  not re-sort by score. Without scores (``retrieval.http.return_scores=false``) every hit scores 0.0.

One call sends at most ``retrieval.http.max_batch`` queries per request; a larger call is split into
several requests, sent one after another, and the results are joined in input order. Failures are
``RetrievalError`` kinds, so the layers above (``ResilientRetriever``'s retries and breaker, the cache,
the service's batching; ``retrieval/factory.py``) treat this backend like any other:

=====================================  ==============================================================
timeout (no answer in ``timeout_s``),  ``timeout``, retried
HTTP 408
HTTP 5xx / 429                         ``http_5xx`` / ``http_429``, retried
refused, reset, DNS                    ``connection``, retried
HTTP 401/403 (token), 404/405 (URL)    ``connection``, not retried: the endpoint is misconfigured; the
                                       search failed for the infrastructure, not for the query (the
                                       rollout's ``INFRA_ERRORS``, ``actors/worker.py``)
another 4xx (400, 422, ...)            ``bad_request``, not retried: the server refused the request
an answer that is not the shape above  ``internal``, not retried; the message names the field that
(not JSON, no ``result``, ...)         is missing or wrong (``result[0][2].contents``, ...)
=====================================  ==============================================================

A bearer token is read from the environment variable ``retrieval.http.token_env`` names, at
construction; it is sent as ``Authorization: Bearer`` and never logged, shown or part of the name (the
name, ``http:<url>``, keys caches and logs). A URL with ``user:password@`` in it is refused.

``batch_search`` blocks (``urllib``, standard library); ``abatch_search`` is a coroutine over aiohttp
(which Ray's default install brings), so the retrieval service awaits requests without a thread each;
without aiohttp it runs the blocking search in a thread. Both open a connection per request, as
Search-R1's client (``requests.post``, no session) does.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from sonar.cluster.wire.text import clean_text
from sonar.cluster.wire.redact import has_userinfo, redact
from sonar.retrieval.base import Hit, RetrievalError, check_search_args
from sonar.retrieval.corpus import split_contents

try:  # Ray's default install brings aiohttp; without it abatch_search runs batch_search in a thread
    import aiohttp
except ImportError:  # pragma: no cover - exercised where aiohttp is absent
    aiohttp = None

log = logging.getLogger(__name__)

_CONFIG_STATUSES = {401: "the server refused the credentials: check the token in retrieval.http.token_env",
                    403: "the server refused the credentials: check the token in retrieval.http.token_env",
                    404: "no such endpoint: check retrieval.http.url (Search-R1 serves POST /retrieve)",
                    405: "the endpoint does not take POST: check retrieval.http.url (Search-R1 serves POST /retrieve)"}


def status_error(url: str, status: int, reason: str = "") -> RetrievalError:
    """The ``RetrievalError`` of an HTTP error status (the table in the module docstring)."""
    what = f"{url}: HTTP {status} {reason}".rstrip()
    if status == 429:
        return RetrievalError("http_429", what)
    if status == 408:
        return RetrievalError("timeout", what)
    if status >= 500:
        return RetrievalError("http_5xx", what)
    if status in _CONFIG_STATUSES:
        return RetrievalError("connection", f"{what}: {_CONFIG_STATUSES[status]}", retryable=False)
    if status >= 400:
        return RetrievalError("bad_request", what)
    return RetrievalError("internal", f"{what}: not an answer", retryable=False)


class HTTPRetriever:
    """``batch_search`` / ``abatch_search`` against a Search-R1-compatible ``/retrieve`` endpoint (module
    docstring). ``token``: the bearer token itself (``from_config`` reads it from the environment)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, max_batch: int = 64, token: str | None = None,
                 return_scores: bool = True, token_env: str | None = None, max_response_bytes: int = 64 << 20):
        if has_userinfo(url):
            raise ValueError(f"retrieval.http.url={redact(url)!r} holds credentials: put a token in an env var and "
                             "name it in retrieval.http.token_env")
        if max_batch < 1:
            raise ValueError(f"retrieval.http.max_batch={max_batch} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"retrieval.http.timeout_s={timeout_s} must be > 0")
        self.url, self.timeout_s, self.max_batch = url, float(timeout_s), int(max_batch)
        self.max_response_bytes = int(max_response_bytes)
        self.return_scores = bool(return_scores)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        # What may be shown about the credentials: the variable's name, never its value.
        self.auth = (f"bearer(env:{token_env})" if token_env else "bearer") if token else "none"
        self.name = f"http:{redact(url)}"  # the cache key and what logs and errors show: no query secret
        self.requests = 0

    @classmethod
    def from_config(cls, cfg, env=None) -> "HTTPRetriever":
        """From a ``RetrievalConfig`` (its ``http``); the token from the environment variable it names (an
        unset or empty variable: no header)."""
        h = cfg.http
        env = os.environ if env is None else env
        token = (env.get(h.token_env) or None) if h.token_env else None
        if h.token_env and token is None:  # the name only: the value is the secret
            log.warning("retrieval.http.token_env=%r: the variable is unset or empty; requests carry no token",
                        h.token_env)
        return cls(h.url, timeout_s=h.timeout_s, max_batch=h.max_batch, token=token,
                   return_scores=getattr(h, "return_scores", True), token_env=h.token_env,
                   max_response_bytes=int(h.max_response_mb * (1 << 20)))

    def __repr__(self) -> str:
        return (f"HTTPRetriever(url={self.url!r}, timeout_s={self.timeout_s}, max_batch={self.max_batch}, "
                f"return_scores={self.return_scores}, auth={self.auth!r})")

    __str__ = __repr__

    def params(self) -> dict[str, Any]:
        """What to log: no secret, only the variable's name."""
        return {"backend": "http", "url": self.url, "timeout_s": self.timeout_s, "max_batch": self.max_batch,
                "return_scores": self.return_scores, "auth": self.auth}

    def body(self, queries: Sequence[str], k: int) -> bytes:
        """The request body, Search-R1's ``QueryRequest`` (``retrieval_server.py:318-321``)."""
        return json.dumps({"queries": list(queries), "topk": int(k), "return_scores": self.return_scores}).encode()

    def _chunks(self, queries: Sequence[str], k: int) -> list[list[str]]:
        check_search_args(queries, k)
        queries = list(queries)
        return [queries[i:i + self.max_batch] for i in range(0, len(queries), self.max_batch)]

    # ------------------------------------------------------------------------------ blocking
    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        out: list[list[Hit]] = []
        for chunk in self._chunks(queries, k):
            out.extend(self._post(chunk, k))
        return out

    def _read_body(self, resp, deadline: float) -> bytes:
        """The answer's body within ``timeout_s`` of the request's start, whatever the pace: the socket's own
        timeout bounds one read only, so a server dripping a byte a second would hold it without end. Each
        read waits at most what is left of the deadline; past it the search fails as a timeout."""
        sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
        buf = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RetrievalError("timeout", f"{self.url}: no complete answer within {self.timeout_s} s "
                                                f"({len(buf)} bytes so far)")
            if sock is not None:
                sock.settimeout(left)
            chunk = resp.read1(1 << 16)
            if not chunk:
                return bytes(buf)
            buf += chunk
            self._check_size(len(buf))

    def _check_size(self, n: int) -> None:
        if n > self.max_response_bytes:
            raise RetrievalError("internal", f"{self.name}: the answer is larger than retrieval.http.max_response_mb="
                                             f"{self.max_response_bytes / (1 << 20):g} MiB; refused unread")

    def _post(self, queries: list[str], k: int) -> list[list[Hit]]:
        req = urllib.request.Request(self.url, data=self.body(queries, k), headers=self._headers, method="POST")
        self.requests += 1
        try:
            deadline = time.monotonic() + self.timeout_s
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = self._read_body(resp, deadline)
        except urllib.error.HTTPError as e:
            e.close()  # the error is the response: its socket, closed now rather than when collected
            raise status_error(self.url, e.code, str(e.reason)) from None
        except (socket.timeout, TimeoutError) as e:
            raise RetrievalError("timeout", f"{self.url}: no answer within {self.timeout_s} s ({e})") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise RetrievalError("timeout", f"{self.url}: no answer within {self.timeout_s} s") from None
            raise RetrievalError("connection", f"{self.url}: {e.reason}") from None
        except (ConnectionError, OSError, ValueError) as e:  # reset mid-read, http.client's protocol errors
            raise RetrievalError("connection", f"{self.url}: {type(e).__name__}: {e}") from None
        return parse_answer(raw, len(queries), k, self.url)

    # ------------------------------------------------------------------------------ awaited
    async def abatch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """:meth:`batch_search` awaited: the same bodies, parsing and errors, over aiohttp."""
        chunks = self._chunks(queries, k)
        if aiohttp is None:
            return await asyncio.to_thread(self.batch_search, queries, k)
        out: list[list[Hit]] = []
        if not chunks:
            return out
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._headers) as session:
            for chunk in chunks:
                out.extend(await self._apost(session, chunk, k))
        return out

    async def _apost(self, session, queries: list[str], k: int) -> list[list[Hit]]:
        self.requests += 1
        try:
            async with session.post(self.url, data=self.body(queries, k)) as resp:
                if resp.status >= 300:
                    raise status_error(self.url, resp.status, resp.reason or "")
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    raw += chunk
                    self._check_size(len(raw))  # stops reading past the cap: the rest is never buffered
                raw = bytes(raw)
        except RetrievalError:
            raise
        except asyncio.TimeoutError:
            raise RetrievalError("timeout", f"{self.url}: no answer within {self.timeout_s} s") from None
        except (aiohttp.ClientError, OSError, ValueError) as e:
            raise RetrievalError("connection", f"{self.url}: {type(e).__name__}: {e}") from None
        return parse_answer(raw, len(queries), k, self.url)


def _hit(item: Any, where: str) -> Hit:
    if isinstance(item, dict) and "document" in item:  # with return_scores (retrieval_server.py:353-354)
        doc, score, where_doc = item["document"], item.get("score", 0.0), f"{where}.document"
    else:
        doc, score, where_doc = item, 0.0, where
    if not isinstance(doc, dict):
        raise RetrievalError("internal", f"{where_doc}: expected a document object, got {type(doc).__name__}")
    if "contents" in doc:  # what Search-R1's client reads (generation.py:464)
        if not isinstance(doc["contents"], str):
            raise RetrievalError("internal", f"{where_doc}.contents: expected a string, got "
                                             f"{type(doc['contents']).__name__}")
        title, text = split_contents(doc["contents"])
    elif isinstance(doc.get("text"), str):
        title, text = str(doc.get("title") or ""), doc["text"]
    else:
        raise RetrievalError("internal", f"{where_doc}: the document has neither 'contents' nor 'text' "
                                         f"(keys: {sorted(doc)[:8]})")
    doc_id = doc.get("id", doc.get("doc_id"))
    if doc_id is None:  # the BM25 server's stored documents have no id: the content names them, every call alike
        doc_id = "sha1:" + hashlib.sha1(f"{title}\n{text}".encode()).hexdigest()[:16]
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise RetrievalError("internal", f"{where}.score: expected a number, got {type(score).__name__}")
    return Hit(clean_text(str(doc_id)), clean_text(title), clean_text(text), float(score))


def parse_answer(raw: bytes, n_queries: int, k: int, url: str = "server") -> list[list[Hit]]:
    """The server's JSON answer -> one hit list per query, in the server's order, at most ``k`` each.
    Raises ``RetrievalError('internal')`` naming the field that is missing or wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        head = raw[:80].decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)[:80]
        raise RetrievalError("internal", f"{url}: the answer is not JSON ({e}; it starts {head!r})") from None
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list):
        got = f"keys: {sorted(data)[:8]}" if isinstance(data, dict) else f"a {type(data).__name__}"
        raise RetrievalError("internal", f"{url}: the answer has no 'result' list ({got}); a Search-R1 "
                                         "server answers {\"result\": [[hit, ...], ...]}")
    if len(result) != n_queries:
        raise RetrievalError("internal", f"{url}: 'result' holds {len(result)} hit lists for {n_queries} queries")
    out = []
    for qi, hits in enumerate(result):
        if not isinstance(hits, list):
            raise RetrievalError("internal", f"{url}: result[{qi}]: expected a list of hits, got "
                                             f"{type(hits).__name__}")
        out.append([_hit(h, f"{url}: result[{qi}][{j}]") for j, h in enumerate(hits[:k])])
    return out
