"""The multi-turn generate -> search -> inject loop. Async, no Ray: it takes an engine and a retriever.

Shape of one call (``rollout_groups``): every item becomes ``group_size`` trajectories
(``_prepare``), and all trajectories of the call advance *in lockstep, turn by turn*:

1. ``_generate``: one batched ``engine.generate`` over every active trajectory (run in a thread via
   ``asyncio.to_thread`` so the event loop stays free), stopping on ``tags.query_close``,
   ``tags.answer_close`` (not under the papers' own rules, ``protocol.rules=upstream``, which stop at
   ``query_close`` only: ``upstream.stop_tags``) and EOS: on the tags' ids when they are special tokens
   of the tokenizer, on their strings when they are plain text (``prompts.stop_plan``; ``model.tags``);
   each row is capped at ``min(max_new_tokens_per_turn, budget left)``;
2. ``_act``: each row's new ids become a MODEL segment (ids, sampling logprobs, engine version); ONLY
   those ids are decoded (special tokens kept), cut after the first stop string (the token that
   completed it may carry more text, as BPE merges ``"</search>\n"``; upstream cuts at the first
   ``</search>`` too), and parsed with ``actors.parsing.parse_turn`` (``actors.upstream.parse_turn_upstream``
   under ``protocol.rules=upstream``). Under Search-R1's / RAG-R1's own rules a turn without
   ``query_close`` first loses the ids after the token that completes its first ``answer_close``, and
   any turn a final EOS (``_upstream_cut``), as their loops cut and decode each turn;
3. ``_call_tools``: one path for every tool (``actors/tools.py``; the run's ``protocol.tools``, search
   among them). A turn's action is a tool call: another tool's (visit, a plug-in's: its tags opened
   before the protocol's query or answer tag, ``tools.first_tool_call``, its body read by the tool's
   ``parse``) or the protocol's search (``Search``, from the protocol's turn parser). One budget rule:
   a call past its tool's ``max_calls`` ends the trajectory (MAX_TURNS), search's being
   ``protocol.max_turns``. Each tool's calls of the turn run at once, the tools concurrently: a tool
   with ``call_batch`` gets them all in one coroutine (search: ONE retriever call over the turn's unique
   queries, ``docs_per_query`` per query, de-duplicated across a step's queries), others one ``call``
   each, bounded by the tool's ``timeout_s``; a failure is data (the call's ``error``, "no results"),
   not a crash. Then ``_inject``, per call: the tool's record (``SearchCall`` for search, ``ToolCall``
   otherwise) and its output rendered (``tools.render_output``, neutralised there, so a document can
   never produce a tag id or spell a tag; it is never parsed either way) and appended as a RETRIEVAL
   segment. Multi-query formats echo each query above its documents.

``_finish`` then labels and rewards each trajectory.

With ``per_trajectory=True`` (``rollout.per_trajectory``) the same three steps run per trajectory
instead, each trajectory its own coroutine (``_run_trajectory``): a one-row ``engine.generate``, then
its own search as soon as its turn ends, so a fast row never waits for a slow row of the same call
(veRL's agent loop). The engine must batch concurrent calls (continuous batching, vLLM).

Token in, token out: the next turn's context is the concatenation of the segments' ids; text is
decoded only to parse an action and is never re-tokenised. With tags as plain text too, a MODEL
segment holds exactly the ids the engine sampled, with their logprobs (the stop string's last token
included), so the loss mask is still born with the tokens.

Finish rules (``cluster.wire.protocol.FinishReason``), decided per trajectory:

- ``Answer`` -> ANSWERED, ``prediction`` = the answer text.
- A call of a tool whose ``max_calls`` calls were already made -> MAX_TURNS (not executed); for search,
  ``proto.max_turns`` turns (searches and invalid actions answered with a message).
- ``Malformed`` (an invalid action) -> with ``proto.on_invalid='message'`` and turns left, the
  upstream message (``prompts.render_invalid``, Search-R1 / RAG-R1) is appended as a RETRIEVAL
  segment (loss mask 0) and the trajectory continues, as Search-R1's and RAG-R1's loops do;
  otherwise (``'end'``, or no turn left) -> MALFORMED. Either way MAX_TOKENS instead when the context
  has reached ``proto.max_total_tokens`` (the turn was cut by the trajectory budget, not by the
  policy's own format).
- The prompt alone, or an injected documents block, would leave no room within
  ``proto.max_total_tokens`` -> MAX_TOKENS (the block is then not appended; its call's record is kept).
  The context never exceeds the budget: each turn's cap is the budget left.
- RETRIEVAL_ERROR: retrieval failures are data, not crashes -- a failed search records
  ``SearchCall(error=kind)``, injects the "no results" block and the trajectory continues. A
  trajectory is relabelled RETRIEVAL_ERROR only when it ended *without an answer* (MALFORMED,
  MAX_TURNS or MAX_TOKENS) and made at least one search and *every* one of its searches failed:
  then the infrastructure, not the policy, is the likely cause, and consumers can tell them apart.

The reward is always computed (``reward_fn(traj)``, its ``.total`` and ``.parts``), whatever the
finish reason. ``search_enabled=False`` is the no-search evaluation: every search "returns" no
documents without calling the retriever.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from sonar.actors.engine import Engine, Generation, SamplingParams, StopStrings, cut_at_stop
from sonar.actors.parsing import Answer, Malformed, Search
from sonar.actors.prompts import TagSet, render_invalid, render_prompt, stop_plan
from sonar.actors.tools import SearchTool, ToolContext, ToolOutput, first_tool_call, record_call, render_output
from sonar.actors.upstream import answer_cut, drops_eos, stop_tags, turn_parser
from sonar.cluster.wire.config import ProtocolConfig
from sonar.cluster.wire.protocol import FinishReason, Segment, SegmentKind, Trajectory
from sonar.retrieval.base import AsyncRetriever, Hit, RetrievalError, Retriever, check_retriever


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    question: str
    golds: list[str]
    meta: dict = field(default_factory=dict)
    """The example's metadata (``QAItem.meta``), carried into ``Trajectory.meta`` for reward plug-ins."""


@dataclass
class RolloutStats:
    """Accounting for one ``rollout_groups`` call. Times in seconds, latencies in milliseconds."""

    trajectories: int = 0
    generated_tokens: int = 0
    """MODEL tokens kept in trajectories (summed over trajectories)."""
    turns: int = 0
    """Model turns summed over trajectories (one MODEL segment each)."""
    engine_calls: int = 0
    """Batched ``engine.generate`` calls (one per lockstep turn)."""
    invalid_messages: int = 0
    """Invalid actions answered with the invalid-action message (``protocol.on_invalid='message'``)."""
    tool_calls: dict[str, int] = field(default_factory=dict)
    """Calls of each tool (``actors/tools.py``), by tool name, search included, failed ones included."""
    tool_args: dict[str, int] = field(default_factory=dict)
    """Their arguments (search: the queries, after the per-step budget)."""
    tool_errors: dict[str, int] = field(default_factory=dict)
    """Those of them that failed (not found, timeout, a retrieval error, an exception of the tool)."""
    tool_batches: dict[str, int] = field(default_factory=dict)
    """Coroutines run per tool: one per turn for a tool with ``call_batch`` (search: one retriever call
    per turn), one per call otherwise."""
    tool_latency_ms: dict[str, list[float]] = field(default_factory=dict)
    """Wall latency of each of those coroutines."""
    generate_s: float = 0.0
    retrieve_s: float = 0.0
    """Wall time of the turns' tool phases (all tools of a turn run concurrently)."""
    wall_s: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    # Search's numbers under the names the metrics and the papers' tables use.
    @property
    def searches(self) -> int:
        return self.tool_calls.get("search", 0)

    @property
    def queries(self) -> int:
        return self.tool_args.get("search", 0)

    @property
    def retriever_calls(self) -> int:
        return self.tool_batches.get("search", 0)

    @property
    def failed_searches(self) -> int:
        return self.tool_errors.get("search", 0)

    @property
    def retrieval_latency_ms(self) -> list[float]:
        return self.tool_latency_ms.get("search", [])

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.generate_s if self.generate_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat numbers for metric sinks (the latency list is summarised)."""
        lat = np.asarray(self.retrieval_latency_ms, dtype=np.float64)
        d: dict[str, float] = {
            "trajectories": self.trajectories, "generated_tokens": self.generated_tokens, "turns": self.turns,
            "engine_calls": self.engine_calls, "searches": self.searches, "queries": self.queries,
            "retriever_calls": self.retriever_calls, "failed_searches": self.failed_searches,
            "invalid_messages": self.invalid_messages,
            "generate_s": self.generate_s, "retrieve_s": self.retrieve_s, "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "retrieval_latency_ms_mean": float(lat.mean()) if lat.size else 0.0,
            "retrieval_latency_ms_p99": float(np.percentile(lat, 99)) if lat.size else 0.0,
        }
        for k, v in self.finish_reasons.items():
            d[f"finish/{k}"] = v
        for k, v in self.tool_calls.items():
            if k == "search":  # its own keys above
                continue
            d[f"tools/{k}/calls"] = v
            d[f"tools/{k}/errors"] = self.tool_errors.get(k, 0)
        return d


@dataclass
class _State:
    """Mutable per-trajectory bookkeeping; ``ctx`` mirrors the concatenated segment ids."""

    traj: Trajectory
    ctx: list[int]
    done: bool = False
    spent: dict[str, int] = field(default_factory=dict)
    """Calls made per tool, against its budget (``Tool.max_calls``); an invalid action answered with a
    message spends one of search's (``protocol.max_turns`` counts turns, searches and messages)."""
    seen: dict[str, Hit] = field(default_factory=dict)
    """Documents this trajectory's searches showed, by id (what a visit opens first)."""
    lead: str = ""
    """Under ``protocol.rules=upstream``: the text the last turn's final token carried past its stop string
    (BPE merges ``"</search>\\n\\n"``); the next block is rendered without it (``prompts.render_documents``)."""

    def finish(self, reason: str) -> None:
        self.traj.finish_reason = reason
        self.done = True


@dataclass
class _Call:
    """What every step of one ``rollout_groups`` call shares: its arguments, resolved once."""

    engine: Engine
    retriever: Retriever | AsyncRetriever | None
    """None when search is disabled (every search then gets no documents, without a call)."""
    tokenizer: Any
    tags: TagSet
    proto: ProtocolConfig
    temperature: float
    top_p: float
    k: int
    seed: int | None
    parse_fn: Callable[[str, TagSet, int], Any]
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    """The closing tags that are plain text for the tokenizer (``prompts.stop_plan``): a turn stops
    on their strings, and its text is parsed up to the first of them."""
    invalid_ids: tuple[int, ...]
    """The invalid-action message (``prompts.render_invalid``), rendered once per call."""
    caps_ok: bool
    """The engine takes per-prompt caps (``max_new_tokens_per_prompt``)."""
    stats: RolloutStats
    tools: tuple
    """The run's tools (``actors/tools.py``); those with tags are parsed before the protocol's actions."""
    search: Any
    """The search among them: the tool a ``Search`` action of the protocol's turn parser calls."""
    answer_cut: str | None = None
    """``upstream.answer_cut``: a turn without ``query_close`` is cut after this tag once generated."""
    eos_drop: int | None = None
    """The EOS id a turn's final token is dropped for (``upstream.drops_eos``), or None."""
    off_engine: "OffEngine | None" = None
    """Where the rows waiting on a tool are counted (``rollout_groups``), or None."""


class OffEngine:
    """Rows of a worker's rollouts off its engine now, over all its concurrent ``rollout_groups`` calls:
    waiting on a search or another tool, or (per trajectory) done while their group's others run, until the
    group is handed on. They hold no engine row; the replay's engine capacity counts only the rows on the
    engine (``cluster/replay/queue.py``). Read and written on the worker's one event loop."""
    __slots__ = ("rows",)

    def __init__(self):
        self.rows = 0


def _off(call: "_Call", rows: int) -> None:
    if call.off_engine is not None:
        call.off_engine.rows += rows


@dataclass
class _Ask:
    """One tool call a trajectory's turn asks for."""

    s: _State
    tool: Any
    args: list[str]
    dropped: int = 0
    """Search: the queries past the per-step budget (not sent)."""


async def _act_off_engine(call: "_Call", asks: list[_Ask], turn: int) -> None:
    """Run a turn's tool calls, counting their rows as off the engine meanwhile."""
    _off(call, len(asks))
    try:
        await _call_tools(call, asks, turn)
    finally:
        _off(call, -len(asks))


def _accepts_caps(engine: Engine) -> bool:
    try:
        ps = inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False
    return "max_new_tokens_per_prompt" in ps or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps.values())


def _stops(tokenizer, tags: TagSet, rules: str = "sonar", tools=(),
           prompt: str = "") -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Generation stops on the closing tags of ``protocol.rules`` (``upstream.stop_tags``: the query's and
    the answer's, or only the query's for R1-Searcher's own rules; their ids when they are special
    tokens, their strings when plain text: ``prompts.stop_plan``), on each other tool's closing tag
    and on EOS (duplicates removed)."""
    ids, texts = stop_plan(tokenizer, tags, (*stop_tags(tags, rules, prompt),
                                             *(t.close_tag for t in tools if t.close_tag is not None)))
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids = (*ids, int(eos))
    return tuple(dict.fromkeys(ids)), texts


async def rollout_groups(items: list[PromptItem], *, engine: Engine, retriever: Retriever | AsyncRetriever | None,
                         tokenizer, tags: TagSet, proto: ProtocolConfig, temperature: float, group_size: int,
                         k: int, reward_fn: Callable[[Trajectory], Any], actor_id: int = 0, stage: int = 0,
                         search_enabled: bool = True, seed: int | None = None,
                         parse_fn: Callable[[str, TagSet, int], Any] | None = None,
                         top_p: float = 1.0, per_trajectory: bool = False,
                         tools: list | None = None,
                         on_group: Callable[[int, list[Trajectory]], Awaitable[None]] | None = None,
                         off_engine: OffEngine | None = None,
                         ) -> tuple[list[list[Trajectory]], RolloutStats]:
    """Roll out ``group_size`` trajectories per item; returns (groups in item order, stats).

    ``retriever``: any retriever of ``retrieval.base`` (a blocking ``batch_search`` runs in a thread,
    a coroutine ``abatch_search`` is awaited; ``base.search_async``). It may be None only with
    ``search_enabled=False``.
    ``k``: hits requested per query (>= ``proto.docs_per_query``; extra hits backfill de-duplication).
    ``seed``: turn t samples with seed ``seed + t`` (None: unseeded).
    ``parse_fn``: defaults to ``actors.parsing.parse_turn(text, tags, max_queries)`` (``proto.rules=sonar``) or
    ``actors.upstream.parse_turn_upstream`` (``upstream``: the paper's released parsing; with R1-Searcher's
    evaluation prompt, its evaluation script's, ``upstream.turn_parser``); it returns ``actors.parsing``'s
    ``Search`` / ``Answer`` / ``Malformed``.
    ``reward_fn(traj)`` returns an object with ``.total`` (float) and ``.parts`` (dict[str, float]).
    ``per_trajectory`` (``rollout.per_trajectory``): every trajectory runs as its own coroutine
    (``_run_trajectory``: one single-row ``engine.generate`` and one search per turn of its own), so no
    row waits for another row's turn before it searches, as in veRL's agent loop; the engine must batch
    concurrent calls (the continuous or vLLM engine). ``tools``: the run's tools
    (``actors.tools.build_tools``); without a search among them (or None) the protocol's search
    (``tools.SearchTool``, no timeout of its own) is added. Per-trajectory, row r's turn t samples with its own seed
    (``row_seed(seed, r, t)``), since rows no longer share one call's generator. ``generate_s`` and
    ``retrieve_s`` are then summed over trajectories whose calls overlap: they can exceed ``wall_s``.
    ``on_group(index, group)`` (per-trajectory only): awaited as soon as each group's last trajectory
    ends, rewarded, so the caller hands that group on at once instead of holding it until the call's
    slowest group ends (the replay's claim on it is released then); the groups are returned as well.
    ``off_engine``: counts the rows waiting on a search or tool while they wait (``OffEngine``).
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if search_enabled and retriever is None:
        raise ValueError("retriever=None with search_enabled=True: pass a retriever or disable search")
    if search_enabled and k < proto.docs_per_query:
        raise ValueError(f"k={k} < protocol.docs_per_query={proto.docs_per_query}")
    if proto.max_total_tokens < 1 or proto.max_new_tokens_per_turn < 1:
        raise ValueError(f"protocol.max_total_tokens={proto.max_total_tokens} and "
                         f"protocol.max_new_tokens_per_turn={proto.max_new_tokens_per_turn} must be >= 1")
    if retriever is not None:
        check_retriever(retriever)
    if parse_fn is None:  # protocol.rules: Sonar's strict parser or the paper's own (actors/upstream.py)
        parse_fn = turn_parser(tags, proto.rules, proto.prompt)

    t_start = time.perf_counter()
    tools = tuple(tools or ())
    search = next((t for t in tools if t.name == "search"), None)
    if search is None:
        search = SearchTool(proto)
        tools = (search, *tools)
    eos = getattr(tokenizer, "eos_token_id", None)
    call = _Call(engine, retriever if search_enabled else None, tokenizer, tags, proto, temperature, top_p, k,
                 seed, parse_fn, *_stops(tokenizer, tags, proto.rules, tools, proto.prompt),
                 tuple(render_invalid(tags, tokenizer, proto.prompt)), _accepts_caps(engine), RolloutStats(), tools,
                 search, answer_cut(tags, proto.rules),
                 int(eos) if eos is not None and drops_eos(tags, proto.rules) else None, off_engine)
    groups, states = _prepare(items, group_size, call, actor_id, stage)
    handed: set[int] = set()  # groups already finished and given to on_group
    if per_trajectory:
        async def run_row(r: int, done: list) -> None:
            await _run_trajectory(call, states[r], r)
            _off(call, +1)  # done: its engine row is free while its group's others run
            done.append(r)

        async def run_group(gi: int) -> None:
            rows = range(gi * group_size, (gi + 1) * group_size)  # _prepare lays groups out contiguously
            done: list[int] = []
            try:
                await asyncio.gather(*(run_row(r, done) for r in rows if not states[r].done))
            finally:
                _off(call, -len(done))  # handed on (or failed): no longer claimed
            if on_group is not None:
                for r in rows:
                    _finish(call, states[r].traj, reward_fn)
                handed.add(gi)
                await on_group(gi, groups[gi])

        await asyncio.gather(*(run_group(gi) for gi in range(len(groups))))
    elif on_group is not None:
        raise ValueError("on_group needs per_trajectory=True (lockstep turns end every group together)")
    turn = 0
    while active := [s for s in states if not s.done]:
        gens, caps = await _generate(call, active, turn)
        asks = _act(call, active, gens, caps)
        if asks:
            await _act_off_engine(call, asks, turn)
        turn += 1
    for row, s in enumerate(states):
        if row // group_size not in handed:
            _finish(call, s.traj, reward_fn)
    call.stats.trajectories = len(states)
    call.stats.wall_s = time.perf_counter() - t_start
    return groups, call.stats


def _prepare(items: list[PromptItem], group_size: int, call: _Call, actor_id: int,
             stage: int) -> tuple[list[list[Trajectory]], list[_State]]:
    """Render each prompt once and open ``group_size`` trajectories on it (ids unique per call).
    A prompt that alone fills ``proto.max_total_tokens`` finishes at once with MAX_TOKENS."""
    call_uid = uuid.uuid4().hex[:10]
    groups: list[list[Trajectory]] = []
    states: list[_State] = []
    for gi, item in enumerate(items):
        prompt = [int(t) for t in render_prompt(call.tags, item.question, call.tokenizer,
                                                template=call.proto.template, style=call.proto.prompt,
                                                rules=call.proto.rules)]
        group_id = f"a{actor_id}-{call_uid}-g{gi}"
        group = []
        for j in range(group_size):
            traj = Trajectory(traj_id=f"{group_id}-{j}", group_id=group_id, prompt_id=item.prompt_id,
                              actor_id=actor_id, segments=[Segment(SegmentKind.PROMPT, np.asarray(prompt, np.int32))],
                              question=item.question, golds=list(item.golds), stage=stage, meta=dict(item.meta))
            st = _State(traj, list(prompt))
            if len(prompt) >= call.proto.max_total_tokens:
                st.finish(FinishReason.MAX_TOKENS)
            group.append(traj)
            states.append(st)
        groups.append(group)
    return groups, states


def row_seed(seed: int, row: int, turn: int) -> int:
    """The sampling seed of row ``row``'s turn ``turn`` of a per-trajectory rollout seeded ``seed``:
    distinct per (seed, row, turn) (a hash, not a sum, so neighbouring calls' rows never collide),
    in [0, 2**63)."""
    digest = hashlib.blake2b(f"{seed}/{row}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_ROW_POOL: ThreadPoolExecutor | None = None
_ROW_POOL_LOCK = threading.Lock()


def _row_pool() -> ThreadPoolExecutor:
    """Threads for per-trajectory engine calls. asyncio's default pool has min(32, cores + 4) threads,
    which would cap a worker's concurrent rows at 6 on a 2-core host; each waiting call holds one
    thread, so this pool is sized for a full engine of rows (threads start only when needed)."""
    global _ROW_POOL
    with _ROW_POOL_LOCK:
        if _ROW_POOL is None:
            _ROW_POOL = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="rollout-row")
        return _ROW_POOL


async def _run_trajectory(call: _Call, s: _State, row: int) -> None:
    """One trajectory on its own (``per_trajectory``): generate -> act -> search -> inject, turn by
    turn, sharing nothing with the other rows but the engine and the retriever."""
    turn = 0
    while not s.done:
        gens, caps = await _generate(call, [s], turn, row=row)
        asks = _act(call, [s], gens, caps)
        if asks:
            await _act_off_engine(call, asks, turn)
        turn += 1


async def _generate(call: _Call, active: list[_State], turn: int,
                    row: int | None = None) -> tuple[list[Generation], list[int]]:
    """One turn of generation: ONE batched ``engine.generate`` over every active trajectory, in a
    thread (the event loop stays free); each row capped at the budget it has left (>= 1 here).
    ``row``: the single trajectory's index in a per-trajectory rollout (its own seed and thread pool).
    Returns the generations and the caps, row for row."""
    proto = call.proto
    caps = [min(proto.max_new_tokens_per_turn, proto.max_total_tokens - len(s.ctx)) for s in active]
    seed = None if call.seed is None else (call.seed + turn if row is None else row_seed(call.seed, row, turn))
    params = SamplingParams(max_new_tokens=max(caps), temperature=call.temperature, top_p=call.top_p,
                            stop_token_ids=call.stop_ids, stop_strings=call.stop_strings, seed=seed)
    prompts = [np.asarray(s.ctx, dtype=np.int32) for s in active]
    kwargs = {"max_new_tokens_per_prompt": caps} if call.caps_ok and min(caps) < max(caps) else {}
    t0 = time.perf_counter()
    if row is None:
        gens: list[Generation] = await asyncio.to_thread(call.engine.generate, prompts, params, **kwargs)
    else:
        gens = await asyncio.get_running_loop().run_in_executor(
            _row_pool(), functools.partial(call.engine.generate, prompts, params, **kwargs))
    call.stats.generate_s += time.perf_counter() - t0
    call.stats.engine_calls += 1
    if len(gens) != len(active):
        raise RuntimeError(f"engine returned {len(gens)} generations for {len(active)} prompts")
    return gens, caps


def model_segments(ids: np.ndarray, lps: np.ndarray, version: int,
                   spans: tuple[tuple[int, int, int], ...] = ()) -> list[Segment]:
    """One turn's sampled ids as MODEL segments, one per weights version: a segment never mixes two
    versions. ``spans`` are ``Generation.version_spans`` ((version, start, end) token ranges, set only
    when an interrupting weight update resumed the row under newer weights); empty means all
    ``version``. Spans are clipped to ``len(ids)`` (the rollout may truncate to its cap) and empty
    pieces are skipped, so the pieces concatenate back to exactly ``ids``."""
    if not spans:
        return [Segment(SegmentKind.MODEL, ids, lps, version)]
    n, out, covered = len(ids), [], 0
    for v, start, end in spans:
        if start != covered:
            raise ValueError(f"Generation.version_spans {spans!r} are not contiguous from 0")
        covered = end
        lo, hi = min(start, n), min(end, n)
        if hi > lo:
            out.append(Segment(SegmentKind.MODEL, ids[lo:hi], lps[lo:hi], int(v)))
    if covered < n:
        raise ValueError(f"Generation.version_spans {spans!r} cover {covered} of {n} tokens")
    return out


def _act(call: _Call, active: list[_State], gens: list[Generation], caps: list[int]) -> list[_Ask]:
    """Each row's new ids become a MODEL segment; ONLY those ids are decoded (special tokens kept), cut
    after the first stop string, and parsed: a call of a tool with tags that opens before the protocol's
    query or answer tag is that tool's (its ``parse``; no arguments is an invalid action), else the
    protocol's turn parser decides (an answer, a search, an invalid action answered with the message,
    ``_invalid``). A call past its tool's budget finishes the trajectory (MAX_TURNS), as does an answer.
    Returns the tool calls of this turn."""
    asks: list[_Ask] = []
    for s, g, cap in zip(active, gens, caps):
        # Defensive truncation (an engine without per-prompt caps generated up to max(caps)): a
        # prefix of an autoregressive sample is itself a valid sample, logprobs unchanged.
        ids = np.asarray(g.token_ids, dtype=np.int32)[:cap]
        lps = np.asarray(g.logprobs, dtype=np.float32)[:cap]
        text = call.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        if call.answer_cut is not None or call.eos_drop is not None:
            ids, lps, text = _upstream_cut(call, ids, lps, text)
        if len(ids):
            s.traj.segments.extend(model_segments(ids, lps, int(g.version), g.version_spans))
            s.ctx.extend(int(t) for t in ids)
            call.stats.turns += 1
            call.stats.generated_tokens += len(ids)
        if call.stop_strings:
            full, text = text, cut_at_stop(text, call.stop_strings)
            s.lead = full[len(text):] if call.proto.rules == "upstream" else ""
        ask = _ask(call, s, text)
        if ask is None:
            continue
        if s.spent.get(ask.tool.name, 0) >= ask.tool.max_calls:
            s.finish(FinishReason.MAX_TURNS)
        else:
            asks.append(ask)
    return asks


def _ask(call: _Call, s: _State, text: str) -> _Ask | None:
    """The tool call a turn's text asks for, or None (an answer, or an invalid action, handled here)."""
    tc = first_tool_call(text, call.tools, (call.tags.query_open, call.tags.answer_open))
    if tc is not None:
        tool, body = tc
        args = list(tool.parse(body))
        if args:
            return _Ask(s, tool, args)
        _invalid(call, s)
        return None
    action = call.parse_fn(text, call.tags, call.proto.max_queries_per_step)
    if isinstance(action, Search):  # the actions of every turn parser (actors/parsing.py, actors/upstream.py)
        return _Ask(s, call.search, list(action.queries), action.dropped)
    if isinstance(action, Answer):
        s.traj.prediction = action.text
        s.finish(FinishReason.ANSWERED)
    elif isinstance(action, Malformed):
        _invalid(call, s)
    else:
        raise TypeError(f"parse_fn returned {action!r}; expected Search, Answer or Malformed")
    return None


def _upstream_cut(call: _Call, ids: np.ndarray, lps: np.ndarray, text: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Search-R1's / RAG-R1's cut of a generated turn (``protocol.rules=upstream``; ``upstream.answer_cut``,
    ``upstream.drops_eos``): a turn that holds no ``query_close`` but ``answer_close`` keeps its ids up to
    the token that completes the first ``answer_close`` (the rest was generated past the answer and is
    dropped, as upstream drops that text); otherwise a final EOS is dropped (upstream decodes without
    special tokens). The kept ids are a prefix of the sample, their logprobs unchanged."""
    k = len(ids)
    if call.answer_cut is not None and call.tags.query_close not in text and call.answer_cut in text:
        matcher = StopStrings(call.tokenizer, (call.answer_cut,))
        k = next((j + 1 for j, t in enumerate(ids.tolist()) if matcher.push(t) is not None), k)
    elif call.eos_drop is not None and k and int(ids[-1]) == call.eos_drop:
        k -= 1
    if k == len(ids):
        return ids, lps, text
    ids, lps = ids[:k], lps[:k]
    return ids, lps, call.tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def _invalid(call: _Call, s: _State) -> None:
    """An invalid action: MAX_TOKENS if the context is full; with ``on_invalid='message'`` and a turn
    left, the message as a RETRIEVAL segment (never trained) and the trajectory goes on; else MALFORMED.
    A message that would overflow ``max_total_tokens`` is not appended (MAX_TOKENS)."""
    proto = call.proto
    message = call.invalid_ids if not s.lead else tuple(render_invalid(call.tags, call.tokenizer, proto.prompt, s.lead))
    if len(s.ctx) >= proto.max_total_tokens:
        s.finish(FinishReason.MAX_TOKENS)
    elif proto.on_invalid != "message" or s.spent.get(call.search.name, 0) >= call.search.max_calls:
        s.finish(FinishReason.MALFORMED)
    elif len(s.ctx) + len(message) > proto.max_total_tokens:
        s.finish(FinishReason.MAX_TOKENS)
    else:
        s.traj.segments.append(Segment(SegmentKind.RETRIEVAL, np.asarray(message, np.int32)))
        s.ctx.extend(message)
        s.spent[call.search.name] = s.spent.get(call.search.name, 0) + 1
        call.stats.invalid_messages += 1
        if len(s.ctx) >= proto.max_total_tokens:
            s.finish(FinishReason.MAX_TOKENS)


async def _call_tools(call: _Call, asks: list[_Ask], turn: int) -> None:
    """This turn's tool calls, each tool's at once and the tools concurrently; then ``_inject`` per call."""
    t0 = time.perf_counter()
    by_tool: dict[str, list[int]] = {}
    for i, a in enumerate(asks):
        by_tool.setdefault(a.tool.name, []).append(i)
    done = await asyncio.gather(*(_run_tool(call, [asks[i] for i in idx]) for idx in by_tool.values()))
    results: list[tuple[ToolOutput, float]] = [None] * len(asks)  # type: ignore[list-item]
    for idx, outs in zip(by_tool.values(), done):
        for i, r in zip(idx, outs):
            results[i] = r
    call.stats.retrieve_s += time.perf_counter() - t0
    for a, (out, latency_ms) in zip(asks, results):
        _inject(call, a, out, latency_ms, turn)


async def _run_tool(call: _Call, asks: list[_Ask]) -> list[tuple[ToolOutput, float]]:
    """One tool's calls of a turn: (output, latency in ms) per call, in order. ``call_batch``: one
    coroutine for all, bounded by ``timeout_s`` as a whole; else one ``call`` each, concurrently, each
    bounded. A call that raises or times out is data: error ``internal`` / ``timeout`` (a
    ``RetrievalError``: its kind), no output but the empty documents block."""
    tool, stats = asks[0].tool, call.stats
    contexts = [ToolContext(call.retriever, a.s.seen, call.tokenizer, call.tags, call.k) for a in asks]

    async def bounded(coro, n: int, batch: bool) -> tuple[list[ToolOutput], float]:
        t0 = time.perf_counter()
        try:
            out = await (asyncio.wait_for(coro, tool.timeout_s) if tool.timeout_s else coro)
            outs = list(out) if batch else [out]
            if len(outs) != n or not all(isinstance(o, ToolOutput) for o in outs):
                raise TypeError(f"tool {tool.name!r} returned {out!r}, not {n} ToolOutput(s)")
        except asyncio.TimeoutError:
            outs = [ToolOutput(documents=[], error="timeout") for _ in range(n)]
        except RetrievalError as e:
            outs = [ToolOutput(documents=[], error=e.kind) for _ in range(n)]
        except Exception:  # a tool's bug is data for the rollout, as a retriever's is
            outs = [ToolOutput(documents=[], error="internal") for _ in range(n)]
        latency_ms = (time.perf_counter() - t0) * 1000.0
        stats.tool_batches[tool.name] = stats.tool_batches.get(tool.name, 0) + 1
        stats.tool_latency_ms.setdefault(tool.name, []).append(latency_ms)
        return outs, latency_ms

    if hasattr(tool, "call_batch"):
        outs, latency_ms = await bounded(tool.call_batch([a.args for a in asks], contexts), len(asks), True)
        return [(o, latency_ms) for o in outs]
    single = await asyncio.gather(*(bounded(tool.call(a.args, c), 1, False) for a, c in zip(asks, contexts)))
    return [(outs[0], latency_ms) for outs, latency_ms in single]


def _inject(call: _Call, a: _Ask, out: ToolOutput, latency_ms: float, turn: int) -> None:
    """One call's outcome: its budget spent, its record (the tool's ``record``, else a ``ToolCall``), and
    its output as a RETRIEVAL segment (``tools.render_output``). An output that would overflow
    ``max_total_tokens`` is not appended (MAX_TOKENS; the record is kept); one that exactly fills the
    budget finishes the trajectory too. What a call's groups showed, a later visit may open."""
    s, tool, name, stats = a.s, a.tool, a.tool.name, call.stats
    s.spent[name] = s.spent.get(name, 0) + 1
    stats.tool_calls[name] = stats.tool_calls.get(name, 0) + 1
    stats.tool_args[name] = stats.tool_args.get(name, 0) + len(a.args)
    if out.error is not None:
        stats.tool_errors[name] = stats.tool_errors.get(name, 0) + 1
    for group in out.groups or ():
        for h in group:
            s.seen[h.doc_id] = h
    block = render_output(tool, out, call.tokenizer, call.tags, call.proto, a.args, s.lead)
    fits = len(s.ctx) + len(block) <= call.proto.max_total_tokens
    record = getattr(tool, "record", None)
    if record is not None:
        record(s.traj, turn, a.args, out, latency_ms, a.dropped, len(block) if fits else 0)
    else:
        record_call(s.traj, tool, turn, a.args, out, latency_ms, len(block) if fits else 0)
    if not fits:
        s.finish(FinishReason.MAX_TOKENS)
        return
    s.traj.segments.append(Segment(SegmentKind.RETRIEVAL, np.asarray(block, np.int32)))
    s.ctx.extend(int(t) for t in block)
    if len(s.ctx) >= call.proto.max_total_tokens:
        s.finish(FinishReason.MAX_TOKENS)


def _finish(call: _Call, t: Trajectory, reward_fn: Callable[[Trajectory], Any]) -> None:
    """Finishing a trajectory: relabel an unanswered one whose every search failed as RETRIEVAL_ERROR
    (the infrastructure, not the policy, is the likely cause), then compute its reward whatever the
    finish reason, and count the finish reason."""
    if (t.finish_reason != FinishReason.ANSWERED and t.searches
            and all(c.error is not None for c in t.searches)):
        t.finish_reason = FinishReason.RETRIEVAL_ERROR
    rb = reward_fn(t)
    t.reward = float(rb.total)
    t.reward_parts = {str(n): float(v) for n, v in dict(rb.parts).items()}
    call.stats.finish_reasons[t.finish_reason] = call.stats.finish_reasons.get(t.finish_reason, 0) + 1
