"""Model text -> typed action. Pure, standard library only.

Parsing is *total*: every string maps to exactly one of

* ``Search(queries, dropped)``  -- run these queries, inject the documents, continue;
* ``Answer(text, trailing)``     -- the final answer; the trajectory ends;
* ``Malformed(reason)``          -- the turn cannot be acted on; the trajectory ends.

``parse_turn`` sees the decoded text of ONE model turn. The rollout loop stops generating on
``query_close`` / ``answer_close`` (and EOS): on their ids when the tags are special tokens, on their
strings when they are plain text (``model.tags``; the text is then cut after the first of them), so a
turn normally ends with one of those closing tags, or with nothing at all when it hit the per-turn
token limit. Tag strings are matched exactly in the decoded text either way (a tag written as
several tokens decodes to the same string); every tag string comes from ``actors.prompts.TagSet``.

Rules, in order of precedence (the reason strings are module constants, ``REASONS`` lists them):

1. A documents tag (``docs_open``, ``docs_close`` or ``doc_sep``) anywhere in the turn:
   ``Malformed(DOCS_TAG)``. Only the rollout may inject documents; retrieved text is neutralised by
   ``prompts.neutralise`` before injection, so a documents tag here was *written by the model*
   (R1-Searcher's format rule: the model must not generate documents itself).
2. Tags are scanned left to right and the **first complete block decides**, i.e. the block whose
   closing tag comes first. This is exactly what the streaming loop does (it stops at the first
   closing tag), so ``parse_turn(text)`` does not depend on whether the engine honoured its stop
   tokens: a turn that contains both a query block and an answer block is decided by whichever
   closes first, and everything after the deciding closing tag is ignored, except that for an
   answer it sets ``Answer.trailing`` (non-whitespace text after ``answer_close``).
3. Inside a query or answer block, the only legal tag is that block's closing tag (plus
   ``query_sep`` inside a query of a multi-query protocol). Any opening tag or think tag there is
   ``Malformed(NESTED)``; the *other* block's closing tag is ``*_CLOSE_WITHOUT_OPEN``. Outside a
   block, ``query_close`` / ``answer_close`` is ``*_CLOSE_WITHOUT_OPEN``.
4. A complete query block: single-query protocols (``tags.query_sep is None``) take the stripped
   block as ONE query (a separator-looking string inside it is plain text). Multi-query protocols
   split on ``query_sep`` (RAG-R1's plain comma, as its ``generation_mq.py`` splits), strip, drop empty pieces, keep the first ``max_queries`` and count the
   rest in ``Search.dropped`` (empty pieces are not counted). No query left: ``Malformed(EMPTY_QUERY)``.
5. A complete answer block: the stripped text; empty is ``Malformed(EMPTY_ANSWER)``.
6. The turn ends without a complete block: inside a query -> ``UNTERMINATED_QUERY``, inside an
   answer -> ``UNTERMINATED_ANSWER`` (both: the turn hit the token limit), inside a think block
   -> ``THINK_OPEN``, some tag seen -> ``NO_ACTION``, no tag at all -> ``NO_TAGS``.

Think tags are advisory. A turn may start inside a think block opened in an earlier turn
(R1-Searcher writes its queries *inside* ``<think>``; the next turn continues that block), so a
stray ``think_close`` is accepted and a query or answer inside an open think block is acted on.
A second ``think_open`` inside an open think block is ``NESTED``.

Trajectory-level format (several turns) is the trajectory's finish reason, set by the rollout loop
(``answered``: zero or more searches, then an answer; ``actors/rewards.py`` reads it). An answer
without any search is a valid format; rewards that want a search (R1-Searcher stage 1) read the
number of search calls from the trajectory.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Union

from sonar.actors.multiquery import plan_step
from sonar.actors.prompts import TagSet

# ---------------------------------------------------------------- reasons (stable metric keys)
NO_TAGS = "no tags"
NO_ACTION = "no query or answer"
UNTERMINATED_QUERY = "unterminated query"
UNTERMINATED_ANSWER = "unterminated answer"
NESTED = "nested tags"
EMPTY_QUERY = "empty query"
EMPTY_ANSWER = "empty answer"
QUERY_CLOSE_WITHOUT_OPEN = "query_close without open"
ANSWER_CLOSE_WITHOUT_OPEN = "answer_close without open"
THINK_OPEN = "think block left open"
DOCS_TAG = "model wrote a documents tag"
REASONS = (NO_TAGS, NO_ACTION, UNTERMINATED_QUERY, UNTERMINATED_ANSWER, NESTED, EMPTY_QUERY,
           EMPTY_ANSWER, QUERY_CLOSE_WITHOUT_OPEN, ANSWER_CLOSE_WITHOUT_OPEN, THINK_OPEN, DOCS_TAG)


# ---------------------------------------------------------------- actions
@dataclass(frozen=True)
class Search:
    """Run ``queries`` (already stripped, non-empty, at most ``max_queries``)."""

    queries: list[str]
    dropped: int = 0
    """Queries beyond the per-step budget (not sent); goes to ``SearchCall.dropped_queries``."""


@dataclass(frozen=True)
class Answer:
    """The final answer, stripped: never empty from ``parse_turn``; ``actors.upstream`` (a paper's own
    rules) may return an empty one, which ends the rollout as upstream does."""

    text: str
    trailing: bool = False
    """Non-whitespace text after ``answer_close``: the answer is usable, the format is not."""


@dataclass(frozen=True)
class Malformed:
    reason: str
    """One of ``REASONS``."""


Action = Union[Search, Answer, Malformed]

# token kinds
_T_OPEN, _T_CLOSE, _Q_OPEN, _Q_CLOSE, _A_OPEN, _A_CLOSE, _DOCS, _SEP = range(8)


@functools.lru_cache(maxsize=None)
def _lexer(tags: TagSet) -> tuple[re.Pattern, dict[str, int]]:
    kinds: dict[str, int] = {}
    # Later assignments win if two roles share a string; documents tags are assigned last on
    # purpose so that a shared string can never hide a model-written documents tag.
    for s, k in ((tags.think_open, _T_OPEN), (tags.think_close, _T_CLOSE),
                 (tags.query_open, _Q_OPEN), (tags.query_close, _Q_CLOSE),
                 (tags.answer_open, _A_OPEN), (tags.answer_close, _A_CLOSE)):
        kinds[s] = k
    if tags.query_sep:
        kinds[tags.query_sep] = _SEP
    for s in (tags.docs_open, tags.docs_close, tags.doc_sep):
        kinds[s] = _DOCS
    pattern = re.compile("|".join(re.escape(s) for s in sorted(kinds, key=len, reverse=True)))
    return pattern, kinds


def parse_turn(text: str, tags: TagSet, max_queries: int) -> Search | Answer | Malformed:
    """Map the decoded text of one model turn to an action (see the module docstring for the rules).

    ``max_queries`` is the per-step query budget (``ProtocolConfig.max_queries_per_step``); it only
    matters for multi-query protocols. Raises ``ValueError`` only for ``max_queries < 1``.
    """
    if max_queries < 1:
        raise ValueError(f"max_queries={max_queries} must be >= 1")
    pattern, kinds = _lexer(tags)
    matches = [(m, kinds[m.group()]) for m in pattern.finditer(text)]
    if any(k == _DOCS for _, k in matches):
        return Malformed(DOCS_TAG)

    block: int | None = None  # _Q_OPEN or _A_OPEN while inside a block
    start = 0
    think_open = False
    for m, kind in matches:
        if block is None:
            if kind in (_Q_OPEN, _A_OPEN):
                block, start = kind, m.end()
            elif kind == _Q_CLOSE:
                return Malformed(QUERY_CLOSE_WITHOUT_OPEN)
            elif kind == _A_CLOSE:
                return Malformed(ANSWER_CLOSE_WITHOUT_OPEN)
            elif kind == _T_OPEN:
                if think_open:
                    return Malformed(NESTED)
                think_open = True
            elif kind == _T_CLOSE:
                think_open = False  # a stray close continues a think block opened in an earlier turn
            # _SEP outside a query block is plain text
        elif block == _Q_OPEN:
            if kind == _Q_CLOSE:
                return _search(text[start:m.start()], tags, max_queries)
            if kind == _SEP:
                continue
            if kind == _A_CLOSE:
                return Malformed(ANSWER_CLOSE_WITHOUT_OPEN)
            return Malformed(NESTED)
        else:  # inside an answer block
            if kind == _A_CLOSE:
                body = text[start:m.start()].strip()
                if not body:
                    return Malformed(EMPTY_ANSWER)
                return Answer(body, trailing=bool(text[m.end():].strip()))
            if kind == _SEP:
                continue
            if kind == _Q_CLOSE:
                return Malformed(QUERY_CLOSE_WITHOUT_OPEN)
            return Malformed(NESTED)

    if block == _Q_OPEN:
        return Malformed(UNTERMINATED_QUERY)
    if block == _A_OPEN:
        return Malformed(UNTERMINATED_ANSWER)
    if think_open:
        return Malformed(THINK_OPEN)
    return Malformed(NO_ACTION if matches else NO_TAGS)


def _search(body: str, tags: TagSet, max_queries: int) -> Search | Malformed:
    kept, dropped = plan_step(body.split(tags.query_sep) if tags.query_sep else [body], max_queries)
    if not kept:
        return Malformed(EMPTY_QUERY)
    return Search(kept, dropped=dropped)
