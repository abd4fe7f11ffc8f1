"""Tools a trajectory calls: one interface, search one of them, visit a second built-in, plug-ins a third kind.

A tool (``Tool``) says how a call is written (``open_tag`` args ``close_tag``: the rollout stops a turn on
``close_tag`` and parses the body with ``parse``), what a call does (``call``, a coroutine that returns
a ``ToolOutput``: documents, text or token ids, appended as a RETRIEVAL segment, so never trained) and
its own limits (``max_calls`` per trajectory, ``timeout_s`` per call). ``protocol.tools`` lists the tools of
a run; ``TOOLS`` (``cluster/wire/plugins.py``'s registry) makes each from the config, a built-in or a
user's ``make(config) -> Tool`` alike.

* **search** is the protocol's own tool: its tags are the protocol's query tags, its budget
  ``protocol.max_turns``, and the rollout batches its calls across trajectories (one retriever call per
  turn); the papers' protocols keep their exact text because nothing about it changed.
* **visit** (``<visit>`` id or title ``</visit>``) opens one document of the corpus in full, up to
  ``protocol.visit_max_tokens`` (a search shows each document cut to ``max_doc_tokens``), as ASearcher
  and the web agents pair search with page visits. A document that an earlier search of the trajectory
  showed is opened by its id or title from those results; any other title is looked up through the
  retriever (a title search; the hit whose title matches). Its budget is ``protocol.visit_max_calls``,
  and it is reward-neutral: a visit is a ``ToolCall``, not a ``SearchCall``, so no reward counts it.

Pure: ``actors.prompts`` (the tags), the wires and ``retrieval.base``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from sonar.actors.prompts import TOOL_TAGS, cap_chars, neutralise, render_documents, special_strings
from sonar.cluster.wire.plugins import Registry
from sonar.retrieval.base import Hit, search_async


@dataclass
class ToolOutput:
    """What a call returns; the first of ``documents``, ``text``, ``token_ids`` that is set is appended.

    ``documents``: (title, text) pairs, rendered as the protocol's documents block (neutralised, each cut
    to the tool's token limit); ``text``: rendered inside the documents tags, neutralised; ``token_ids``:
    appended as they are (the tool owns their format). ``refs``: what the call touched (document ids),
    recorded in the trajectory's ``ToolCall``; ``error``: None or the tool's word for a failure (its
    output, if any, is still appended)."""

    documents: list[tuple[str, str]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    refs: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class ToolContext:
    """What a call may read about its trajectory and run: the retriever the rollout searches through
    (None with search disabled), the documents the trajectory's searches showed so far (by id), and
    the tokenizer and tags (to render token outputs)."""

    retriever: Any
    seen: dict[str, Hit]
    tokenizer: Any
    tags: Any
    k: int


@runtime_checkable
class Tool(Protocol):
    name: str
    open_tag: str
    close_tag: str
    max_calls: int
    """Calls one trajectory may make; a call past it ends the trajectory (finish reason max_turns)."""
    timeout_s: float | None
    """Bound on one call, in seconds (None: none); on expiry the call fails with error ``timeout``."""
    max_tokens: int
    """Each document or text output is cut to this many tokens."""

    def parse(self, body: str) -> list[str]:
        """The call's arguments from the text between the tags; [] is an invalid call."""

    async def call(self, args: list[str], context: ToolContext) -> ToolOutput:
        """Run the call."""

    # Optional: ``demonstration(hits: list[Hit]) -> list[str] | None``, the arguments an SFT demonstration
    # calls the tool with after its last search (whose hits it is given); None: no call. The driver's
    # demonstrations (``actors/demos.py``) then teach the call's format as they teach the search's.


TOOLS = Registry("tool")
"""``protocol.tools`` entries -> ``make(config) -> Tool``; built-ins and plug-ins through ``TOOLS.get``."""


class SearchTool:
    """The protocol's search (its tags, ``max_turns``); the rollout loop runs it batched (``rollout._search``),
    so it has no ``call`` of its own."""

    name = "search"

    def __init__(self, config):
        self.max_calls = config.protocol.max_turns
        self.timeout_s = config.retrieval.timeout_s
        self.max_tokens = config.protocol.max_doc_tokens


def _norm(s: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", s.lower()).split())


class VisitTool:
    """``<visit>`` id or title ``</visit>``: one document in full (module docstring)."""

    name = "visit"
    open_tag, close_tag = TOOL_TAGS["visit"]

    def __init__(self, config):
        self.max_calls = config.protocol.visit_max_calls
        self.max_tokens = config.protocol.visit_max_tokens
        self.timeout_s = config.retrieval.timeout_s

    def parse(self, body: str) -> list[str]:
        key = body.strip().strip('"').strip()
        return [key] if key else []

    def demonstration(self, hits: list[Hit]) -> list[str] | None:
        """SFT demonstrations open their last search's first document, by its title."""
        return [hits[0].title] if hits else None

    async def call(self, args: list[str], context: ToolContext) -> ToolOutput:
        key = args[0]
        hit = context.seen.get(key)
        if hit is None:
            want = _norm(key)
            hit = next((h for h in context.seen.values() if _norm(h.title) == want), None)
        if hit is None and context.retriever is not None:
            hits = (await search_async(context.retriever, [key], max(context.k, 5)))[0]
            want = _norm(key)
            hit = next((h for h in hits if h.doc_id == key or _norm(h.title) == want), None)
        if hit is None:
            return ToolOutput(documents=[], error="not_found")
        return ToolOutput(documents=[(hit.title, hit.text)], refs=[hit.doc_id])


TOOLS.register("search")(SearchTool)
TOOLS.register("visit")(VisitTool)


def build_tools(config) -> list:
    """The run's tools other than search, in ``protocol.tools`` order, each checked against ``Tool``."""
    out = []
    for j, name in enumerate(config.protocol.tools):
        if name == "search":
            continue
        tool = TOOLS.get(name, f"protocol.tools[{j}]")(config)
        missing = [a for a in ("name", "open_tag", "close_tag", "max_calls", "timeout_s", "max_tokens", "parse", "call")
                   if not hasattr(tool, a)]
        if missing:
            raise TypeError(f"protocol.tools[{j}]={name!r} made {tool!r}, which lacks {missing} of the Tool interface "
                            "(actors/tools.py)")
        out.append(tool)
    names = [t.name for t in out]
    unused = sorted(set(config.protocol.tool_options) - set(names))
    if unused:  # a typo in a tool's name would otherwise leave its settings silently unread
        raise ValueError(f"protocol.tool_options has settings for {unused}, which are not tools of this run "
                         f"(protocol.tools={list(config.protocol.tools)!r}, tool names {names})")
    if len(set(names)) != len(names) or "search" in names:
        raise ValueError(f"protocol.tools={list(config.protocol.tools)!r}: tool names {names} must be distinct and "
                         "not 'search'")
    return out


def tool_tags(config) -> list[str]:
    """The call tags of the run's tools other than search, built-in or plug-in (what the tiny word-level
    tokenizer adds as special tokens, ``actors.model.materialise_policy``)."""
    return [tag for tool in build_tools(config) for tag in (tool.open_tag, tool.close_tag)]


def render_output(tool, out: ToolOutput, tokenizer, tags, proto) -> list[int]:
    """A tool's output as token ids, the one rendering rollouts and demonstrations share: documents as the
    protocol's documents block (``prompts.render_documents``: neutralised, each cut to ``tool.max_tokens``;
    none: the block's "no results"), text neutralised inside the documents tags and cut to
    ``tool.max_tokens``, token ids as they are."""
    if out.documents is not None or (out.text is None and out.token_ids is None):
        return list(render_documents(tags, [list(out.documents or [])], tokenizer, tool.max_tokens,
                                     style=proto.prompt, rules=proto.rules))
    if out.text is not None:
        body = cap_chars(neutralise(out.text, special_strings(tokenizer)), tool.max_tokens)  # before tokenizing
        ids = list(tokenizer.encode(body, add_special_tokens=False))[: tool.max_tokens]
        frame = [list(tokenizer.encode(t, add_special_tokens=False)) for t in (tags.docs_open, tags.docs_close)]
        return [*frame[0], *ids, *frame[1]]
    return [int(t) for t in out.token_ids]


def first_tool_call(text: str, tools: list, before: tuple[str, ...]) -> tuple[Any, str] | None:
    """(tool, body) of the first complete tool call in ``text`` that opens before any of the tags in
    ``before`` (the protocol's query and answer openers: whichever action comes first decides), else None."""
    cut = min((p for p in (text.find(t) for t in before if t) if p >= 0), default=len(text))
    best = None
    for tool in tools:
        i = text.find(tool.open_tag)
        if 0 <= i < cut:
            j = text.find(tool.close_tag, i + len(tool.open_tag))
            if j >= 0 and (best is None or i < best[0]):
                best = (i, tool, text[i + len(tool.open_tag):j])
    return None if best is None else (best[1], best[2])
