"""Pure helpers for one RAG-R1 multi-query search step.

A step is the list of queries the model wrote inside one search call. :func:`plan_step` decides
which of them are searched; the kept queries are sent together in one ``batch_search`` with
``k = step_depth(per_query, len(kept))``; :func:`dedupe_step` then assigns documents so that a
document shown for an earlier query of the step is not shown again for a later one (each later
query takes its next best hits instead). Fetching ``per_query * len(kept)`` hits per query
guarantees every query can fill its ``per_query`` slots whenever the corpus can.

Pure module: standard library only.
"""
from __future__ import annotations

import re
from typing import Sequence

from sonar.retrieval.base import Hit

_WS = re.compile(r"\s+")


def plan_step(queries: Sequence[str], budget: int) -> tuple[list[str], list[str]]:
    """Split a step's queries into ``(kept, dropped)``, both in input order.

    Dropped: empty (whitespace-only) queries, repeats of an earlier query of the step (compared
    case-insensitively after whitespace collapsing), and everything beyond the first ``budget``
    distinct queries. Kept queries are returned as written (the retriever normalises them).
    The caller counts ``len(dropped)`` (over-budget and duplicate queries are model behaviour
    worth logging).
    """
    if budget < 1:
        raise ValueError(f"budget={budget} must be >= 1")
    kept: list[str] = []
    dropped: list[str] = []
    seen: set[str] = set()
    for q in queries:
        norm = _WS.sub(" ", q).strip().casefold()
        if not norm or norm in seen or len(kept) >= budget:
            dropped.append(q)
            continue
        seen.add(norm)
        kept.append(q)
    return kept, dropped


def step_depth(per_query: int, n_queries: int) -> int:
    """The ``k`` to fetch for each query so that :func:`dedupe_step` can always fill ``per_query``."""
    if per_query < 1 or n_queries < 0:
        raise ValueError(f"per_query={per_query} must be >= 1 and n_queries={n_queries} >= 0")
    return per_query * max(n_queries, 1)


def dedupe_step(results: Sequence[Sequence[Hit]], per_query: int) -> list[list[Hit]]:
    """Up to ``per_query`` hits per query, with no document repeated across the step.

    Queries are served in order; each takes its best hits whose ``doc_id`` no earlier query of
    the step (and no earlier hit of its own list) has taken. A query whose list runs out gets fewer
    than ``per_query`` hits.
    """
    if per_query < 1:
        raise ValueError(f"per_query={per_query} must be >= 1")
    shown: set[str] = set()
    out: list[list[Hit]] = []
    for hits in results:
        mine: list[Hit] = []
        for h in hits:
            if len(mine) == per_query:
                break
            if h.doc_id in shown:
                continue
            shown.add(h.doc_id)
            mine.append(h)
        out.append(mine)
    return out
