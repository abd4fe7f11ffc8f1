"""Tools a trajectory calls: one interface, one path through the rollout; search, visit and plug-ins alike.

A tool (``Tool``) says how a call is written (``open_tag`` args ``close_tag``: the rollout stops a turn on
``close_tag`` and parses the body with ``parse``), what calls do (``call``, a coroutine per call, or
``call_batch``, one coroutine for every call of a turn across trajectories; either returns
``ToolOutput``s: documents, text or token ids, appended as a RETRIEVAL segment, so never trained) and
its own limits (``max_calls`` per trajectory, ``timeout_s`` per call or batch). ``protocol.tools`` lists
the tools of a run; ``TOOLS`` (``cluster/wire/plugins.py``'s registry) makes each from the config, a
built-in or a user's ``make(config) -> Tool`` alike, and the rollout runs them all through one path
(``actors/rollout.py``: one budget rule, one runner, one inject). A tool may also say how its output is
recorded (``record``; default: a ``ToolCall`` in ``Trajectory.tool_calls``).

* **search** is the protocol's own tool: its calls are written in the protocol's query tags and read by
  the protocol's turn parser (which decides between a search and an answer under ``protocol.rules``, so
  the papers' protocols keep their exact text), so its ``open_tag`` is None. Its budget is
  ``protocol.max_turns`` (an invalid action answered with a message spends a turn of it too), its
  ``call_batch`` sends every query of the turn in ONE retriever call (identical queries once), keeps
  ``docs_per_query`` per query (de-duplicated across a step's queries, not under the papers' own rules)
  and its record is a ``SearchCall`` (``Trajectory.searches``: what the rewards and the papers' metrics
  count).
* **visit** (``<visit>`` id or title ``</visit>``) opens one document of the corpus in full, up to
  ``protocol.visit_max_tokens`` (a search shows each document cut to ``max_doc_tokens``), as ASearcher
  and the web agents pair search with page visits. A document that an earlier search of the trajectory
  showed is opened by its id or title from those results; any other title is looked up through the
  retriever (a title search; the hit whose title matches). Its budget is ``protocol.visit_max_calls``,
  and it is reward-neutral: a visit is a ``ToolCall``, not a ``SearchCall``, so no reward counts it.

Pure: ``actors.prompts`` (the tags), ``actors.multiquery``, the wires and ``retrieval.base``.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from sonar.actors.multiquery import dedupe_step
from sonar.actors.prompts import TOOL_TAGS, cap_chars, neutralise, render_documents, special_strings
from sonar.cluster.wire.plugins import Registry
from sonar.cluster.wire.protocol import SearchCall, ToolCall, Trajectory
from sonar.retrieval.base import Hit, RetrievalError, search_async


@dataclass
class ToolOutput:
    """What a call returns; the first of ``groups``, ``documents``, ``text``, ``token_ids`` that is set is
    appended.

    ``groups``: the hits shown for each argument (search: per query), rendered as the protocol's documents
    block with each argument echoed where the format echoes queries; what they show is what a later visit
    of the trajectory opens by id or title. ``documents``: (title, text) pairs, rendered as the protocol's
    documents block (neutralised, each cut to the tool's token limit); ``text``: rendered inside the
    documents tags, neutralised; ``token_ids``: appended as they are (the tool owns their format).
    ``refs``: what the call touched (document ids), recorded in the trajectory's ``ToolCall``; ``error``:
    None or the tool's word for a failure (its output, if any, is still appended)."""

    groups: list[list[Hit]] | None = None
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
        """Run the call. (Or, instead, ``call_batch(args: list[list[str]], contexts: list[ToolContext])
        -> list[ToolOutput]``: every call of a turn, across trajectories, in one coroutine, one output per
        call in order, ``timeout_s`` bounding the batch; a ``RetrievalError`` fails them all with its kind.)"""

    # Optional: ``record(traj, turn, args, out, latency_ms, dropped, output_tokens)``, which appends the
    # call's record to the trajectory (default: ``record_call``, a ``ToolCall``; search's is a ``SearchCall``).
    # Optional: ``demonstration(hits: list[Hit]) -> list[str] | None``, the arguments an SFT demonstration
    # calls the tool with after its last search (whose hits it is given); None: no call. The driver's
    # demonstrations (``actors/demos.py``) then teach the call's format as they teach the search's.


TOOLS = Registry("tool")
"""``protocol.tools`` entries -> ``make(config) -> Tool``; built-ins and plug-ins through ``TOOLS.get``."""


class SearchTool:
    """The protocol's search (module docstring): its calls come from the protocol's turn parser, so it
    has no tags or ``parse`` of its own; ``call_batch`` searches a whole turn at once."""

    name = "search"
    open_tag = close_tag = None

    def __init__(self, config, retrieval_timeout_s: float | None = None):
        """``config``: the run's ``Config`` (``TOOLS``' ``make(config)``) or its ``ProtocolConfig`` alone (a
        rollout given no search of its own, ``rollout_groups``)."""
        proto = config.protocol if hasattr(config, "protocol") else config
        self.max_calls = proto.max_turns
        self.max_tokens = proto.max_doc_tokens
        self.docs_per_query = proto.docs_per_query
        self.distinct = proto.rules != "upstream"  # RAG-R1's code shows each query its own top documents
        self.retrieval_timeout_s = retrieval_timeout_s
        """Bound on the batched retriever call (None: the retriever bounds its own calls, as the workers'
        client does with ``retrieval.timeout_s``; held-out evaluation must not time out under load)."""

    timeout_s = None
    """Search bounds and fails its batch itself (``call_batch``), so a failed batch still shows every query
    its "no results" group."""

    async def call_batch(self, args: list[list[str]], contexts: list[ToolContext]) -> list[ToolOutput]:
        """ONE ``batch_search`` over the unique queries of every call (search disabled, no retriever: no
        call, no documents); then per call ``docs_per_query`` hits per query, de-duplicated across its
        queries (``multiquery.dedupe_step``; later hits backfill). A failure of the batched call -- a
        ``RetrievalError`` (its kind), the timeout, any exception (``internal``) -- fails every search of
        the batch, which shared it: failed searches are data, not crashes."""
        retriever, k = contexts[0].retriever, contexts[0].k
        uniq = list(dict.fromkeys(q for qs in args for q in qs))
        results: dict[str, list[Hit]] = {}
        error: str | None = None
        if retriever is not None and uniq:
            try:
                coro = search_async(retriever, uniq, k)
                t = self.retrieval_timeout_s
                hits = await (asyncio.wait_for(coro, t) if t is not None else coro)
                if len(hits) != len(uniq):
                    raise RetrievalError("internal", f"retriever returned {len(hits)} result lists for {len(uniq)} queries")
                results = dict(zip(uniq, hits))
            except asyncio.TimeoutError:
                error = "timeout"
            except RetrievalError as e:
                error = e.kind
            except Exception:  # any backend bug is still data for the rollout, counted as internal
                error = "internal"
        return [ToolOutput(groups=dedupe_step([results.get(q, []) for q in qs], self.docs_per_query,
                                              distinct=self.distinct), error=error) for qs in args]

    def record(self, traj: Trajectory, turn: int, args: list[str], out: ToolOutput, latency_ms: float,
               dropped: int, output_tokens: int) -> None:
        traj.searches.append(SearchCall(turn=turn, queries=list(args),
                                        doc_ids=[[h.doc_id for h in g] for g in out.groups or [[] for _ in args]],
                                        latency_ms=latency_ms, error=out.error, dropped_queries=dropped))


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
    """The run's tools, search included, in ``protocol.tools`` order, each checked against ``Tool``."""
    out = []
    for j, name in enumerate(config.protocol.tools):
        tool = TOOLS.get(name, f"protocol.tools[{j}]")(config)
        missing = [a for a in ("name", "open_tag", "close_tag", "max_calls", "timeout_s", "max_tokens")
                   if not hasattr(tool, a)]
        missing += [] if hasattr(tool, "call") or hasattr(tool, "call_batch") else ["call (or call_batch)"]
        missing += [] if getattr(tool, "open_tag", None) is None or hasattr(tool, "parse") else ["parse"]
        if missing:
            raise TypeError(f"protocol.tools[{j}]={name!r} made {tool!r}, which lacks {missing} of the Tool interface "
                            "(actors/tools.py)")
        out.append(tool)
    names = [t.name for t in out]
    unused = sorted(set(config.protocol.tool_options) - set(names))
    if unused:  # a typo in a tool's name would otherwise leave its settings silently unread
        raise ValueError(f"protocol.tool_options has settings for {unused}, which are not tools of this run "
                         f"(protocol.tools={list(config.protocol.tools)!r}, tool names {names})")
    if len(set(names)) != len(names) or names.count("search") != 1:
        raise ValueError(f"protocol.tools={list(config.protocol.tools)!r}: tool names {names} must be distinct, "
                         "search among them")
    return out


def tool_tags(config) -> list[str]:
    """The call tags of the run's tools other than search (whose are the protocol's), built-in or plug-in
    (what the tiny word-level tokenizer adds as special tokens, ``actors.model.materialise_policy``)."""
    return [tag for tool in build_tools(config) if tool.open_tag is not None for tag in (tool.open_tag, tool.close_tag)]


def record_call(traj: Trajectory, tool, turn: int, args: list[str], out: ToolOutput, latency_ms: float,
                output_tokens: int) -> None:
    """The record of a call of a tool without its own ``record``: a ``ToolCall`` in ``traj.tool_calls``."""
    traj.tool_calls.append(ToolCall(turn=turn, tool=tool.name, args=list(args), refs=[str(r) for r in out.refs],
                                    latency_ms=latency_ms, error=out.error, output_tokens=output_tokens))


def render_output(tool, out: ToolOutput, tokenizer, tags, proto, args: list[str] = (), lead: str = "") -> list[int]:
    """A tool's output as token ids, the one rendering rollouts and demonstrations share: groups as the
    protocol's documents block with each argument echoed where the format echoes queries (a search's
    block), documents as that block without echo (``prompts.render_documents``: neutralised, each cut to
    ``tool.max_tokens``; none: the block's "no results"), text neutralised inside the documents tags and
    cut to ``tool.max_tokens``, token ids as they are. ``lead``: what the turn's last token already wrote
    (``protocol.rules=upstream``)."""
    if out.groups is not None:
        return list(render_documents(tags, [[(h.title, h.text) for h in g] for g in out.groups], tokenizer,
                                     tool.max_tokens, error=out.error, queries=list(args), style=proto.prompt,
                                     rules=proto.rules, lead=lead))
    if out.documents is not None or (out.text is None and out.token_ids is None):
        return list(render_documents(tags, [list(out.documents or [])], tokenizer, tool.max_tokens,
                                     style=proto.prompt, rules=proto.rules, lead=lead))
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
    for tool in (t for t in tools if t.open_tag is not None):  # search's calls: the protocol's turn parser
        i = text.find(tool.open_tag)
        if 0 <= i < cut:
            j = text.find(tool.close_tag, i + len(tool.open_tag))
            if j >= 0 and (best is None or i < best[0]):
                best = (i, tool, text[i + len(tool.open_tag):j])
    return None if best is None else (best[1], best[2])
