"""The papers' own turn parsing (``protocol.rules=upstream``). Pure, standard library only.

Sonar's parser (``actors/parsing.py``) is strict: the first complete block decides, and nested tags,
model-written document tags, empty queries and empty answers are invalid actions. The released code of
each paper reads a turn differently, and a run that reproduces a paper, or evaluates its checkpoint, must
read it the same way. Both parsers return the same actions (``Search`` / ``Answer`` / ``Malformed``), so
the rollout loop is unchanged; what differs is where a turn stops (:func:`stop_tags`) and what it means.

R1-Searcher (``RUCAIBox/R1-Searcher@631167c``, ``OpenRLHF-RAG/openrlhf/trainer/ppo_utils/experience_maker.py``)
  * A turn stops only at ``<|end_of_query|>`` (its one stop string, line 1087), EOS or 512 tokens; it does
    not stop at ``</answer>``, so whatever the model writes after its answer stays in the response that
    the reward server scores (lines 1105, 1173-1180).
  * A turn that ends at ``<|end_of_query|>`` and contains ``<|begin_of_query|>`` is a search: the text after
    the *last* opener, double quotes removed, stripped, whitespace collapsed (lines 1142-1145). Nothing is
    left: the rollout ends without a search (lines 1161-1171: ``Malformed(EMPTY_QUERY)``, with the recipe's
    ``on_invalid: end``).
  * Any other turn ends the rollout. Its answer is the text between the turn's *last* ``<answer>`` and
    the next ``</answer>``, stripped (the servers' ``extract_answer_math``,
    ``train/reward_server_qwen_zero.py:109-110``), possibly empty; nested or model-written tags are the
    servers' business (their tag counts), not the parser's. Without an ``<answer> ... </answer>`` pair in
    the turn there is no answer (``Malformed``). The servers themselves read the whole response, not the
    last turn: an answer written in a turn that then searched still scores there, and the code reward
    variants read it the same way (``rewards.server_answer``); ``traj.prediction`` stays the last turn's.
  * Between turns upstream works on text: the next prompt is the previous one plus the search turn's text
    stripped of surrounding whitespace, then ``<|end_of_query|>\n\n`` and the documents (lines 1151, 1207),
    re-tokenised by the engine. Sonar never re-tokenises (token in, token out): a turn keeps the ids it
    sampled, a blank before ``<|end_of_query|>`` included; only the newlines a merged stop token (``|>\n\n``)
    already wrote are left out of the next block (``prompts.render_documents``' ``lead``), so the text
    differs from upstream's by the stripped whitespace, and by any other text a stop token carries past
    the tag (``>.`` keeps its ``.``, which upstream cuts away).

R1-Searcher's evaluation (``evaluation/eval_search_loacl.py``; ``protocol.prompt=r1_searcher_eval`` with
``rules=upstream``: :func:`parse_turn_r1_searcher_eval`)
  * A turn stops at ``<|end_of_query|>`` or ``</answer>`` (line 172); whichever closed it decides: the answer
    after the last ``<answer>``, or a search of the text after the last ``<|begin_of_query|>`` with ``"``,
    ``'`` and ``...`` removed (lines 215-228); nested answers, several query openers and a documents block
    the model wrote are accepted (Sonar's rules refuse them). Not followed: the script reads at most ten
    turns and ignores the tenth (line 203: "I don't know."), where ``max_turns=9`` lets a tenth turn answer.

Search-R1 (``PeterGriffinJin/Search-R1@a14dc3a``, ``search_r1/llm_agent/generation.py``) and RAG-R1
(``inclusionAI/AWorld-RL@4aeef7b``, ``RAG-R1/rag_r1/llm_agent/generation.py``)
  * The engine stops at no tag, only at EOS or the turn's token limit (``vllm_rollout.py:105-121``: no
    ``stop`` in the sampling parameters, ``detokenize=False``); the turn is then cut after the first
    ``</search>`` if there is one, else after the first ``</answer>`` (lines 61-66 / 64-69), and decoded
    with ``skip_special_tokens=True`` before being re-tokenised (lines 56-59 / 59-62), so no EOS stays.
    Here the engine stops at ``</search>`` only (:func:`stop_tags`: everything after it is cut away
    anyway), a turn without it is cut after the first ``</answer>`` once generated, its later tokens
    dropped (:func:`answer_cut`; a prefix of a sample is a sample), and a final EOS is dropped
    (:func:`drops_eos`). So ``<search> q <answer> a </answer> </search>`` is the search
    ``q <answer> a </answer>`` as upstream, where stopping at ``</answer>`` would make it an answer, and
    ``<answer> a </answer> <search> q </search>`` keeps its search text (the action is still the answer).
    Sonar never re-tokenises: the ids are the sampled ones up to the token that completes the tag; when
    that token carries text past the tag (``>\n\n``), the block that follows is rendered without the part
    it would repeat (``prompts.render_documents``' / ``render_invalid``'s ``lead``), so the text is upstream's
    (text that is not the start of the block, ``>.``'s ``.``, stays: upstream cuts it away).
  * The action is the *first* match of ``<(search|answer)>(.*?)</\\1>`` (non-greedy, across lines) in the
    cut turn, stripped (lines 422-429): the block that opens first *and* closes within the cut. Tags
    inside that block are its content (``<search> q <answer> a </answer> </search>`` searches
    ``q <answer> a </answer>``; ``<answer> a <answer> b </answer>`` answers ``a <answer> b``), but an
    ``<answer>`` still open at the first ``</search>`` is no block: ``<answer> a <search> q </search>``
    searches ``q``. An ``<information>`` tag the model wrote is ignored, and no quotes are stripped.
  * An answer ends the rollout even when empty (lines 385-389).
  * A search with no text is still a search step: Search-R1 sends the empty string to its retriever,
    RAG-R1 multi-query splits on commas, drops empty parts and sends what is left, possibly nothing
    (RAG-R1 line 474-475). Here an empty search retrieves nothing and injects an empty documents block.
  * RAG-R1 searches every comma-separated part; Sonar still stops at ``protocol.max_queries_per_step``
    (the recipe sets 16) and counts the rest as dropped.
  * No match is an invalid action: the "My previous action is invalid..." message (lines 395-401).
"""
from __future__ import annotations

import functools
import re

from sonar.actors.parsing import (EMPTY_QUERY, NO_ACTION, NO_TAGS, UNTERMINATED_ANSWER, Answer, Malformed,
                                  Search, parse_turn)
from sonar.actors.multiquery import plan_step
from sonar.actors.prompts import TagSet

RULES = ("sonar", "upstream")
"""``protocol.rules``: Sonar's strict parser (``actors.parsing.parse_turn``) or the paper's own (this module)."""


EVAL_PROMPT = "r1_searcher_eval"
"""The prompt style of R1-Searcher's evaluation script: with ``rules=upstream`` its turns are read as that
script reads them (:func:`parse_turn_r1_searcher_eval`), not as its training loop does."""


def reads_r1_searcher_eval(tags: TagSet, rules: str, prompt: str) -> bool:
    """``protocol.rules=upstream`` with R1-Searcher's evaluation prompt (``protocol.prompt=r1_searcher_eval``)."""
    return rules == "upstream" and tags.name == "r1_searcher" and prompt == EVAL_PROMPT


def turn_parser(tags: TagSet, rules: str, prompt: str = ""):
    """The parser of ``protocol.rules`` (and, for R1-Searcher's evaluation, ``protocol.prompt``):
    ``parsing.parse_turn``, :func:`parse_turn_upstream` or :func:`parse_turn_r1_searcher_eval`."""
    if rules != "upstream":
        return parse_turn
    return parse_turn_r1_searcher_eval if reads_r1_searcher_eval(tags, rules, prompt) else parse_turn_upstream


def stop_tags(tags: TagSet, rules: str, prompt: str = "") -> tuple[str, ...]:
    """The closing tags a turn stops at: both (query and answer) under Sonar's rules and under R1-Searcher's
    evaluation script (``eval_search_loacl.py:172``: ``<|end_of_query|>`` and ``</answer>``, beside the
    EOS strings); only the query's under every paper's own training rules. R1-Searcher's one stop string
    is ``<|end_of_query|>``; Search-R1's and RAG-R1's engines stop at none (EOS or the turn's token
    limit), and everything after the first ``</search>`` is cut away, so stopping there is the same;
    stopping at ``</answer>`` is not (a later ``</search>`` moves the cut: ``<search> q <answer> a
    </answer> </search>`` is a search), so the turn generates on and :func:`answer_cut` cuts it
    afterwards."""
    if rules == "upstream" and not reads_r1_searcher_eval(tags, rules, prompt):
        return (tags.query_close,)
    return tuple(dict.fromkeys((tags.query_close, tags.answer_close)))


def answer_cut(tags: TagSet, rules: str) -> str | None:
    """The tag after whose first occurrence a turn that holds no ``query_close`` is cut once generated,
    its later tokens dropped (Search-R1 / RAG-R1 under their own rules: ``answer_close``,
    ``_postprocess_responses``, Search-R1 ``generation.py:61-66``, RAG-R1 ``generation_mq.py:62-67``);
    None: nothing is cut (Sonar's rules stop there; R1-Searcher keeps the whole turn)."""
    if rules == "upstream" and tags.name != "r1_searcher":
        return tags.answer_close
    return None


def drops_eos(tags: TagSet, rules: str) -> bool:
    """Whether a turn's final EOS is dropped from the trajectory: Search-R1 and RAG-R1 decode each turn
    with ``skip_special_tokens=True`` and re-tokenise the text (Search-R1 ``generation.py:56-59``, RAG-R1
    ``generation_mq.py:57-60``), so no EOS stays in the response, in particular none before the
    invalid-action message that follows a turn without an action. R1-Searcher keeps the engine's ids
    (``experience_maker.py:1124-1125``), its EOS included."""
    return rules == "upstream" and tags.name != "r1_searcher"


def parse_turn_upstream(text: str, tags: TagSet, max_queries: int) -> Search | Answer | Malformed:
    """One model turn read as the paper's released code reads it (module docstring). ``text`` is the
    decoded turn, cut after the first stop string as the rollout does."""
    if max_queries < 1:
        raise ValueError(f"max_queries={max_queries} must be >= 1")
    if tags.name == "r1_searcher":
        return _r1_searcher(text, tags)
    return _search_r1(text, tags, max_queries)


def _r1_searcher(text: str, tags: TagSet) -> Search | Answer | Malformed:
    if text.rstrip().endswith(tags.query_close) and tags.query_open in text:
        body = text.rstrip()[: -len(tags.query_close)].split(tags.query_open)[-1]
        query = " ".join(body.replace('"', "").split())
        return Search([query]) if query else Malformed(EMPTY_QUERY)
    if tags.answer_open not in text:
        return Malformed(NO_ACTION if any(t in text for t in tags.special_tokens()) else NO_TAGS)
    last = text.split(tags.answer_open)[-1]
    if tags.answer_close not in last:
        return Malformed(UNTERMINATED_ANSWER)
    body, _, rest = last.partition(tags.answer_close)
    return Answer(body.strip(), trailing=bool(rest.strip()))


def parse_turn_r1_searcher_eval(text: str, tags: TagSet, max_queries: int) -> Search | Answer | Malformed:
    """One turn read as R1-Searcher's evaluation script reads it (``evaluation/eval_search_loacl.py:215-260``;
    the turn stops at ``</answer>`` or ``<|end_of_query|>``, whichever closes first): a turn that stopped at
    ``</answer>`` and holds ``<answer>`` is the answer after its *last* ``<answer>`` (stripped here; the
    metrics normalise whitespace); a turn that stopped at ``<|end_of_query|>`` and holds
    ``<|begin_of_query|>`` searches the text after the *last* opener with ``"``, ``'`` and ``...`` removed
    and tabs made spaces (line 228), whitespace then collapsed here (an all-blank query, which the script
    still sends, is an empty search step); nothing left is ``Malformed(EMPTY_QUERY)`` (its
    "query_inst_error"); anything else is ``Malformed`` (its "shot_down"). Nested tags, several openers
    and a documents block the model wrote are not checked, as there."""
    if max_queries < 1:
        raise ValueError(f"max_queries={max_queries} must be >= 1")
    body = text.rstrip()
    if body.endswith(tags.answer_close) and tags.answer_open in body:
        return Answer(body[: -len(tags.answer_close)].split(tags.answer_open)[-1].strip())
    if body.endswith(tags.query_close) and tags.query_open in body:
        raw = body[: -len(tags.query_close)].split(tags.query_open)[-1]
        raw = raw.replace('"', "").replace("'", "").replace("\t", " ").replace("...", "")
        if not raw:
            return Malformed(EMPTY_QUERY)
        query = " ".join(raw.split())
        return Search([query] if query else [])
    if tags.answer_open in body and tags.answer_close not in body:
        return Malformed(UNTERMINATED_ANSWER)
    return Malformed(NO_ACTION if any(t in body for t in tags.special_tokens()) else NO_TAGS)


@functools.lru_cache(maxsize=None)
def _action_pattern(tags: TagSet) -> re.Pattern:
    q, a = (re.escape(tags.query_open), re.escape(tags.query_close)), (re.escape(tags.answer_open),
                                                                       re.escape(tags.answer_close))
    return re.compile(f"{q[0]}(?P<search>.*?){q[1]}|{a[0]}(?P<answer>.*?){a[1]}", re.DOTALL)


def _search_r1(text: str, tags: TagSet, max_queries: int) -> Search | Answer | Malformed:
    if tags.query_close in text:
        text = text[: text.index(tags.query_close) + len(tags.query_close)]
    elif tags.answer_close in text:
        text = text[: text.index(tags.answer_close) + len(tags.answer_close)]
    m = _action_pattern(tags).search(text)
    if m is None:
        return Malformed(NO_ACTION if any(t in text for t in tags.special_tokens()) else NO_TAGS)
    if m.group("answer") is not None:
        return Answer(m.group("answer").strip())
    body = m.group("search").strip()
    # the same planning as Sonar's rules (actors/multiquery.py); an empty step stays a Search here
    queries, dropped = plan_step(body.split(tags.query_sep) if tags.query_sep else [body], max_queries)
    return Search(queries, dropped=dropped)
