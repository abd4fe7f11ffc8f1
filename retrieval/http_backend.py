"""A retrieval backend over HTTP, compatible with Search-R1's retrieval server (``retrieval.backend=http``).

Search-R1, RAG-R1 and most of this field serve retrieval from a server (Search-R1's
``search_r1/search/retrieval_server.py``: e5 + FAISS, or BM25, behind FastAPI). A user's server plugs in
unchanged. The wire, as that server and its client (``search_r1/llm_agent/generation.py``) have it:

* request: ``POST <url>`` with JSON ``{"queries": [...], "topk": k, "return_scores": true}``
  (``retrieval_server.py:318-321``, ``generation.py:450-458``);
* answer: ``{"result": [hits of query 0, hits of query 1, ...]}``, each hit ``{"document": {"id": ...,
  "contents": "\\"Title\\"\\ntext"}, "score": s}`` (``retrieval_server.py:348-358``); without scores a hit
  is the document itself; the document is a corpus record (``load_docs``, ``retrieval_server.py:34-36``);
* a document's title is the first line of ``contents`` and its text the rest (``generation.py:467-469``);
  Sonar also strips the title's quotes, as its corpus reader does (``retrieval/corpus.py:split_contents``).
  A record with ``title``/``text`` fields instead is read as it is.

One call sends at most ``retrieval.http.max_batch`` queries per request (a larger call is split, in
order). Failures are ``RetrievalError`` kinds (timeout, http_5xx, http_429, connection; bad_request for
another 4xx; internal for an answer that is not the shape above, naming what is missing), so the layers
above (``ResilientRetriever``'s retries and breaker, the cache, the service's batching;
``retrieval/factory.py``) treat it as any backend. A bearer token is read from the environment variable
``retrieval.http.token_env`` names, at construction, and never logged.

Standard library only (urllib): a blocking ``batch_search``; the rollout awaits it in a thread
(``base.search_async``).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import urllib.error
import urllib.request
from typing import Any, Sequence

from sonar.retrieval.base import Hit, RetrievalError
from sonar.retrieval.corpus import split_contents


class HTTPRetriever:
    """``batch_search`` against a Search-R1-compatible ``/retrieve`` endpoint (module docstring)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, max_batch: int = 64, token: str | None = None):
        if max_batch < 1:
            raise ValueError(f"retrieval.http.max_batch={max_batch} must be >= 1")
        self.url, self.timeout_s, self.max_batch = url, float(timeout_s), int(max_batch)
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.name = f"http:{url}"
        self.requests = 0

    @classmethod
    def from_config(cls, cfg) -> "HTTPRetriever":
        """From ``RetrievalConfig.http`` (the token from the environment variable it names)."""
        h = cfg.http
        return cls(h.url, timeout_s=h.timeout_s, max_batch=h.max_batch,
                   token=os.environ.get(h.token_env) if h.token_env else None)

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        out: list[list[Hit]] = []
        for i in range(0, len(queries), self.max_batch):
            out.extend(self._post(list(queries[i:i + self.max_batch]), k))
        return out

    def _post(self, queries: list[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        body = json.dumps({"queries": queries, "topk": int(k), "return_scores": True}).encode()
        req = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        self.requests += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            kind = "http_429" if e.code == 429 else "http_5xx" if e.code >= 500 else "bad_request"
            raise RetrievalError(kind, f"{self.url}: HTTP {e.code} {e.reason}") from None
        except (socket.timeout, TimeoutError) as e:
            raise RetrievalError("timeout", f"{self.url}: no answer within {self.timeout_s} s ({e})") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise RetrievalError("timeout", f"{self.url}: no answer within {self.timeout_s} s") from None
            raise RetrievalError("connection", f"{self.url}: {e.reason}") from None
        except (ConnectionError, OSError) as e:
            raise RetrievalError("connection", f"{self.url}: {e}") from None
        return parse_answer(raw, len(queries), k, self.url)


def _hit(item: Any, where: str) -> Hit:
    doc, score = (item.get("document"), item.get("score", 0.0)) if isinstance(item, dict) and "document" in item \
        else (item, 0.0)
    if not isinstance(doc, dict):
        raise RetrievalError("internal", f"{where}: a hit is a document object, got {type(doc).__name__}")
    if "contents" in doc:
        if not isinstance(doc["contents"], str):
            raise RetrievalError("internal", f"{where}.contents: expected a string")
        title, text = split_contents(doc["contents"])
    elif "text" in doc:
        title, text = str(doc.get("title", "")), str(doc["text"])
    else:
        raise RetrievalError("internal", f"{where}: the document has neither 'contents' nor 'text' "
                                         f"(keys: {sorted(doc)[:8]})")
    doc_id = doc.get("id", doc.get("doc_id"))
    if doc_id is None:  # a corpus without ids: the content names it, the same on every call
        doc_id = "sha1:" + hashlib.sha1(f"{title}\n{text}".encode()).hexdigest()[:16]
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise RetrievalError("internal", f"{where}.score: expected a number, got {type(score).__name__}")
    return Hit(str(doc_id), title, text, float(score))


def parse_answer(raw: bytes, n_queries: int, k: int, url: str = "server") -> list[list[Hit]]:
    """The server's JSON answer -> one hit list per query (at most ``k`` each, sorted by score when the
    server gave scores). Raises ``RetrievalError('internal')`` naming what is missing."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RetrievalError("internal", f"{url}: the answer is not JSON ({e})") from None
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list):
        raise RetrievalError("internal", f"{url}: the answer has no 'result' list "
                                         f"(keys: {sorted(data)[:8] if isinstance(data, dict) else type(data).__name__})")
    if len(result) != n_queries:
        raise RetrievalError("internal", f"{url}: 'result' holds {len(result)} hit lists for {n_queries} queries")
    out = []
    for qi, hits in enumerate(result):
        if not isinstance(hits, list):
            raise RetrievalError("internal", f"{url}: result[{qi}]: expected a list of hits")
        parsed = [_hit(h, f"{url}: result[{qi}][{j}]") for j, h in enumerate(hits)]
        if any(isinstance(h, dict) and "score" in h for h in hits):
            parsed.sort(key=lambda h: -h.score)  # stable: the server's order among equal scores
        out.append(parsed[:k])
    return out
