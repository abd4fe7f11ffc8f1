"""One multi-query search step (RAG-R1: several queries in one ``<search>``), the one place its queries
are planned and its documents de-duplicated: training's parser and rollout loop use these, and so does
the retrieval benchmark's ``multiquery`` workload, so what is measured is what training does.

:func:`plan_step` keeps a step's non-empty queries (stripped) up to the per-step budget and counts the
rest; the kept queries are searched together in one ``batch_search`` with ``retrieval.k`` hits each;
:func:`dedupe_step` then gives each query up to ``protocol.docs_per_query`` of them, in order, skipping a
document already shown for an earlier query of the step (a later query takes its next best hits, so
``k`` above ``docs_per_query`` is what lets it backfill). A query repeated in a step is kept and
searched once (the rollout's batch sends each distinct string once); de-duplication shows it new
documents. ``distinct=False`` is RAG-R1's released code (``protocol.rules=upstream``): each query its own
top hits, repeats included.

Pure module: standard library and ``retrieval.base.Hit`` only.
"""
from __future__ import annotations

from typing import Sequence

from sonar.retrieval.base import Hit


def plan_step(queries: Sequence[str], budget: int) -> tuple[list[str], int]:
    """``(kept, dropped)``: the stripped non-empty ``queries`` in order, the first ``budget`` of them
    kept, ``dropped`` the number beyond the budget (empty pieces are not counted: they were never
    queries). Raises ValueError for ``budget < 1``."""
    if budget < 1:
        raise ValueError(f"budget={budget} must be >= 1")
    pieces = [q.strip() for q in queries]
    pieces = [q for q in pieces if q]
    return pieces[:budget], max(0, len(pieces) - budget)


def dedupe_step(results: Sequence[Sequence[Hit]], per_query: int, *, distinct: bool = True) -> list[list[Hit]]:
    """Up to ``per_query`` hits per query of a step, queries served in order. ``distinct``: each query
    takes its best hits whose ``doc_id`` no earlier query of the step (and no earlier hit of its own
    list) has taken, so a query whose list runs out gets fewer; without it, each query's first
    ``per_query`` hits as they are."""
    if per_query < 1:
        raise ValueError(f"per_query={per_query} must be >= 1")
    shown: set[str] = set()
    out: list[list[Hit]] = []
    for hits in results:
        mine: list[Hit] = []
        for h in hits:
            if len(mine) == per_query:
                break
            if distinct and h.doc_id in shown:
                continue
            shown.add(h.doc_id)
            mine.append(h)
        out.append(mine)
    return out
