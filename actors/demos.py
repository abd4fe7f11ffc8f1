"""SFT demonstrations as typed trajectories, token for token what the rollout loop would produce.

Why trajectories and not text: SFT and RL then share one batching path, and the loss mask comes from
segment kinds (MODEL -> 1, PROMPT/RETRIEVAL -> 0), so retrieved tokens are never trained, exactly as
in rollouts. The PROMPT comes from ``actors.prompts.render_prompt`` and every RETRIEVAL block from
``actors.prompts.render_documents`` (documents neutralised and truncated), the two functions the
rollout loop calls, so the policy sees the same tokens in SFT as when it searches on its own.

Layout of one demonstration (T = tags of the protocol)::

    PROMPT     render_prompt(question)        (protocol.template / protocol.prompt, as the rollout)
    MODEL      T.think_open <step thought> T.think_close T.query_open q1 [, q2 ...] T.query_close
    RETRIEVAL  render_documents(top docs_per_query hits of each query, each query echoed when multi-query)
    ...        one MODEL + RETRIEVAL pair per search step
    MODEL      T.think_open <final thought> T.think_close T.answer_open <gold> T.answer_close

Thoughts come from ``Question.thoughts`` (see ``actors.world``): the relation keyword before the
first search, then after each retrieval a short quote of the evidence read there ("native of tul
stes"), which is what made held-out reading learnable for the tiny policy. Questions without
thoughts get "search" / "answer". Parallel queries split into consecutive steps (single-query tag
sets) repeat the step's thought.

Who builds them: the driver (``cluster/driver/roles.prepare_demonstrations``, with an in-process
retriever), which sends them to the learner as encoded groups; the learner builds no data itself.

Prompt styles that prefill ``<think>`` (R1-Searcher's) drop the first MODEL segment's ``think_open``:
the prompt already opened the block. Multi-query steps join the queries with the protocol's plain-text
separator (RAG-R1's comma): ``" , "`` in the ``short`` style (word-level tokens), ``", "`` otherwise.

Invariants: every MODEL segment ends with the ids of query_close or answer_close (the rollout engine
stops on them and includes them: the tag's one id, or the last token of the tag as text); MODEL logprobs are float32 zeros and version
-1 (a demonstration was not sampled). Multi-query steps exist only for tag sets with a query_sep
(rag_r1_multi); r1_searcher and search_r1 search parallel entities in consecutive steps.
MODEL segments are built from ids (each tag encoded alone: its special id, or its text with
``model.tags='text'``), and the words inside them are neutralised, so only the frame itself can emit
a tag.
"""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

import numpy as np

from sonar.actors.prompts import (TagSet, neutralise, prefills_think, render_documents, render_prompt,
                                  special_strings)
from sonar.actors.tools import ToolContext, render_output
from sonar.cluster.wire.protocol import FinishReason, SearchCall, Segment, SegmentKind, ToolCall, Trajectory

DEFAULT_STEP_THOUGHT = "search"
DEFAULT_FINAL_THOUGHT = "answer"


def search_steps(q, tags: TagSet, proto) -> list[tuple[list[str], str]]:
    """The gold plan as the protocol can execute it: ``[(queries, thought), ...]``.

    Multi-query tag sets keep a plan step's queries together (chunked to max_queries_per_step);
    single-query tag sets run each query as its own step with the step's thought.
    Raises ValueError if the plan needs more steps than ``proto.max_turns``.
    """
    thoughts = list(getattr(q, "thoughts", None) or [])
    steps: list[tuple[list[str], str]] = []
    for i, queries in enumerate(q.plan):
        thought = thoughts[i] if i < len(thoughts) - 1 else DEFAULT_STEP_THOUGHT
        width = max(1, proto.max_queries_per_step) if tags.multi_query else 1
        for j in range(0, len(queries), width):
            steps.append((list(queries[j:j + width]), thought))
    if len(steps) > proto.max_turns:
        raise ValueError(f"question {q.qid!r} needs {len(steps)} search steps with protocol.name={proto.name!r} "
                         f"but protocol.max_turns={proto.max_turns}")
    return steps


def final_thought(q) -> str:
    thoughts = list(getattr(q, "thoughts", None) or [])
    return thoughts[-1] if len(thoughts) == len(q.plan) + 1 else DEFAULT_FINAL_THOUGHT


class _Ids:
    """Tag ids and neutralised word encoding for one (tags, tokenizer) pair."""

    def __init__(self, tags: TagSet, tokenizer, style: str = "short"):
        self.tags, self.tok = tags, tokenizer
        self.specials = special_strings(tokenizer)
        # Each tag's ids: its one special id, or its text encoded alone (``model.tags='text'``).
        self.id = {t: list(tokenizer.encode(t, add_special_tokens=False)) for t in tags.special_tokens()}
        self.joiner = f" {tags.query_sep} " if style == "short" else f"{tags.query_sep} "

    def words(self, text: str) -> list[int]:
        return list(self.tok.encode(neutralise(text, self.specials), add_special_tokens=False))

    def _think(self, thought: str, opened: bool = False) -> list[int]:
        if not self.tags.think_open:
            return []
        head = [] if opened else self.id[self.tags.think_open]
        return [*head, *self.words(thought), *self.id[self.tags.think_close]]

    def search(self, queries: Sequence[str], thought: str, opened: bool = False) -> list[int]:
        t = self.tags
        body = self.joiner.join(queries) if t.multi_query else " ".join(queries)
        return self._think(thought, opened) + [*self.id[t.query_open], *self.words(body), *self.id[t.query_close]]

    def tool_call(self, tool, args: Sequence[str]) -> list[int]:
        """``open_tag args close_tag`` of a tool (one id each for the tiny model's tags, text otherwise);
        several arguments are written comma-separated."""
        open_, close = (list(self.tok.encode(t, add_special_tokens=False)) for t in (tool.open_tag, tool.close_tag))
        return [*open_, *self.words(", ".join(args)), *close]

    def answer(self, text: str, thought: str, opened: bool = False) -> list[int]:
        t = self.tags
        return self._think(thought, opened) + [*self.id[t.answer_open], *self.words(text), *self.id[t.answer_close]]


def _model_segment(ids: list[int]) -> Segment:
    return Segment(SegmentKind.MODEL, np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), -1)


def make_demonstrations(questions: Sequence, tags: TagSet, tokenizer, retriever, proto, k: int,
                        tools: Sequence = ()) -> list[Trajectory]:
    """Demonstrations of many questions; step s of every question is retrieved in ONE batch_search call.

    ``k`` is the search depth asked of the retriever; the top ``proto.docs_per_query`` hits of each
    query are injected (as in rollouts). Retrieval errors propagate: demonstrations are training data,
    never built from failed searches, and a broken index must fail loudly. ``tools``: the run's tools
    (``actors.tools.build_tools``; search's steps are the plan's); each that has ``demonstration(hits)`` is called
    after the last search with the arguments it returns for that search's hits (visit: the first
    document's title), its output rendered as rollouts render it (``tools.render_output``) and recorded as
    a ``ToolCall``, before the answer: SFT teaches the call's format as it teaches the search's.
    """
    if k < proto.docs_per_query:
        raise ValueError(f"k={k} < protocol.docs_per_query={proto.docs_per_query}")
    style = getattr(proto, "prompt", "short")
    enc = _Ids(tags, tokenizer, style)
    prefilled = prefills_think(style)
    plans = [search_steps(q, tags, proto) for q in questions]
    segments: list[list[Segment]] = [
        [Segment(SegmentKind.PROMPT, np.asarray(render_prompt(tags, q.question, tokenizer, proto.template, style, proto.rules),
                                                np.int32))]
        for q in questions]
    searches: list[list[SearchCall]] = [[] for _ in questions]
    last_hits: dict[int, list] = {}
    for s in range(max((len(p) for p in plans), default=0)):
        active = [i for i, p in enumerate(plans) if s < len(p)]
        flat = [query for i in active for query in plans[i][s][0]]
        t0 = time.perf_counter()
        results = retriever.batch_search(flat, k)
        latency_ms = (time.perf_counter() - t0) * 1000.0
        if len(results) != len(flat):
            raise ValueError(f"retriever {getattr(retriever, 'name', retriever)!r} returned {len(results)} "
                             f"result lists for {len(flat)} queries")
        pos = 0
        for i in active:
            queries, thought = plans[i][s]
            hits = [list(r)[:proto.docs_per_query] for r in results[pos:pos + len(queries)]]
            pos += len(queries)
            segments[i].append(_model_segment(enc.search(queries, thought, opened=prefilled and s == 0)))
            docs = render_documents(tags, [[(h.title, h.text) for h in hs] for hs in hits], tokenizer,
                                    proto.max_doc_tokens, queries=list(queries), style=style, rules=proto.rules)
            segments[i].append(Segment(SegmentKind.RETRIEVAL, np.asarray(docs, np.int32)))
            last_hits[i] = [h for hs in hits for h in hs]
            searches[i].append(SearchCall(turn=s, queries=list(queries),
                                          doc_ids=[[h.doc_id for h in hs] for hs in hits],
                                          latency_ms=latency_ms / len(active)))
    tool_calls: list[list[ToolCall]] = [[] for _ in questions]
    for tool in tools:
        demo = getattr(tool, "demonstration", None)
        calls = [(i, hits, demo(hits)) for i, hits in last_hits.items()] if callable(demo) else []
        calls = [(i, hits, list(args)) for i, hits, args in calls if args]

        async def run_all(tool=tool, calls=calls):  # one event loop for the tool's calls of every demonstration
            return await asyncio.gather(*(tool.call(args, ToolContext(retriever, {h.doc_id: h for h in hits},
                                                                      tokenizer, tags, k)) for _, hits, args in calls))
        for (i, _, args), out in zip(calls, asyncio.run(run_all()) if calls else []):
            block = render_output(tool, out, tokenizer, tags, proto)
            segments[i].append(_model_segment(enc.tool_call(tool, args)))
            segments[i].append(Segment(SegmentKind.RETRIEVAL, np.asarray(block, np.int32)))
            tool_calls[i].append(ToolCall(turn=len(plans[i]) + len(tool_calls[i]), tool=tool.name, args=args,
                                          refs=list(out.refs), error=out.error, output_tokens=len(block)))
    out = []
    for i, q in enumerate(questions):
        gold = q.golds[0]
        segments[i].append(_model_segment(enc.answer(gold, final_thought(q), opened=prefilled and not plans[i])))
        out.append(Trajectory(
            traj_id=f"demo-{q.qid}", group_id=f"demo-{q.qid}", prompt_id=q.qid, actor_id=-1,
            segments=segments[i], reward=1.0, searches=searches[i], finish_reason=FinishReason.ANSWERED,
            question=q.question, golds=list(q.golds), prediction=gold, tool_calls=tool_calls[i]))
    return out


def make_demonstration(q, tags: TagSet, tokenizer, retriever, proto, k: int) -> Trajectory:
    """One demonstration (see the module docstring for its segments)."""
    return make_demonstrations([q], tags, tokenizer, retriever, proto, k)[0]
