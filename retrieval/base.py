"""The retriever protocol every backend implements.

``batch_search(queries, k) -> list[list[Hit]]``: one result list per input query, in input order,
each sorted by descending score, at most ``k`` long. One return type, no flags. A backend that fails
raises :class:`RetrievalError` with a ``kind``; retries, the circuit breaker and the conversion of a
failure into a "no results" document happen in layers above the backend (``resilient.py`` and the
rollout loop), so a failed search is data, not a crash.

Pure module: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Hit:
    doc_id: str
    title: str
    text: str
    score: float


class RetrievalError(RuntimeError):
    """A search that failed. ``kind`` is one of KINDS and is what ``retrieval/errors/<kind>`` counts."""

    KINDS = ("timeout", "http_5xx", "http_429", "connection", "breaker_open", "bad_request", "internal")

    def __init__(self, kind: str, message: str, retryable: bool | None = None):
        if kind not in self.KINDS:
            kind = "internal"
        super().__init__(f"[{kind}] {message}")
        self.kind = kind
        self.retryable = kind in ("timeout", "http_5xx", "http_429", "connection") if retryable is None else retryable


@runtime_checkable
class Retriever(Protocol):
    name: str
    """Identifies backend + index (part of the cache key), e.g. 'tantivy:/path/to/index'."""

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]: ...
