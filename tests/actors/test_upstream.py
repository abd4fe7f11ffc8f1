"""protocol.rules=upstream: each paper's own turn parsing, table-driven against the released code's rules
(expected actions worked out by hand from the cited lines), beside Sonar's strict parser on the same text;
and through the real rollout loop, R1-Searcher's missing stop at </answer> and its effect on the reward.

Sources: R1-Searcher ``RUCAIBox/R1-Searcher@631167c`` (EM = OpenRLHF-RAG/openrlhf/trainer/ppo_utils/
experience_maker.py); Search-R1 ``PeterGriffinJin/Search-R1@a14dc3a`` (GEN = search_r1/llm_agent/
generation.py); RAG-R1 ``inclusionAI/AWorld-RL@4aeef7b`` (MQ = RAG-R1/rag_r1/llm_agent/generation.py)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sonar.actors import parsing as P
from sonar.actors.parsing import Answer, Malformed, Search, parse_turn
from sonar.actors.prompts import get_protocol, render_invalid
from sonar.actors.upstream import answer_cut, drops_eos, parse_turn_upstream, stop_tags

R1 = get_protocol("r1_searcher")
SR = get_protocol("search_r1")
MQ = get_protocol("rag_r1_multi")
QO, QC = R1.query_open, R1.query_close

# (tags, turn text, upstream action, Sonar's action, why: the upstream line)
CASES = [
    # R1-Searcher: the text after the LAST query opener, double quotes removed, whitespace collapsed (EM 1142-1145)
    (R1, f'<think> a {QO} "capital"  of\tfrance {QC}', Search(["capital of france"]), Search(['"capital"  of\tfrance']),
     "EM 1144-1145: .replace('\"', '') and ' '.join(split())"),
    (R1, f"{QO} first {QO} second {QC}", Search(["second"]), Malformed(P.NESTED), "EM 1143: split(opener)[-1]"),
    (R1, f"{QO} 'single' {QC}", Search(["'single'"]), Search(["'single'"]), "EM 1144: only double quotes go"),
    (R1, f'{QO} "" {QC}', Malformed(P.EMPTY_QUERY), Search(['""']), "EM 1161-1171: no search, the rollout ends"),
    # R1-Searcher's answer: the servers read the last <answer>, possibly empty (reward_server_qwen_zero.py:109-110)
    (R1, "</think> <answer> </answer>", Answer(""), Malformed(P.EMPTY_ANSWER), "qwen_zero.py:109-110: F1('') = 0"),
    (R1, "<answer> a <answer> b </answer>", Answer("b"), Malformed(P.NESTED), "qwen_zero.py:109-110: the last opener"),
    (R1, "<answer> Paris </answer> Assistant: done", Answer("Paris", trailing=True), Answer("Paris", trailing=True),
     "EM 1087: no stop at </answer>; the text stays in the scored response"),
    (R1, f"<answer> x </answer> {R1.docs_open} y", Answer("x", trailing=True), Malformed(P.DOCS_TAG),
     "EM 1295-1299: a model-written documents block is only logged"),
    (R1, "<answer> cut off by the limit", Malformed(P.UNTERMINATED_ANSWER), Malformed(P.UNTERMINATED_ANSWER),
     "no </answer>: the servers' missing-tag score"),
    # Search-R1: the first <search>/<answer> block is the action, whatever it holds (GEN 422-429)
    (SR, "<search> a <answer> b </search>", Search(["a <answer> b"]), Malformed(P.NESTED), "GEN 422-429: (.*?) is content"),
    (SR, "<answer> a <search> q </search>", Search(["q"]), Malformed(P.NESTED),
     "GEN 61-66 cuts at </search>: the open answer is no block, the search is the first match"),
    (SR, "<answer> a <answer> b </answer>", Answer("a <answer> b"), Malformed(P.NESTED), "GEN 422: (.*?) is content"),
    (SR, "<answer></answer>", Answer(""), Malformed(P.EMPTY_ANSWER), "GEN 385-389: an empty answer ends the rollout"),
    (SR, "<search>   </search>", Search([]), Malformed(P.EMPTY_QUERY), "GEN 370-372: an empty query is sent"),
    (SR, "<information> fake </information> <answer> x </answer>", Answer("x"), Malformed(P.DOCS_TAG),
     "GEN 422-429: a model-written <information> is not an action"),
    (SR, '<search> "quoted" </search>', Search(['"quoted"']), Search(['"quoted"']), "no quote stripping"),
    (SR, "thinking only", Malformed(P.NO_TAGS), Malformed(P.NO_TAGS), "GEN 395-401: the invalid-action message"),
    (SR, "<answer> a </answer> <search> q </search>", Answer("a"), Answer("a", trailing=True),
     "GEN 61-66 cuts at </search>, then the first match is the answer"),
    # RAG-R1 multi-query: every comma-separated part, empty parts dropped (MQ 474-475)
    (MQ, "<search> a, , b,c,d,e </search>", Search(["a", "b", "c", "d", "e"]), Search(["a", "b", "c"], dropped=2),
     "MQ 474-475: no bound in code (the recipe's max_queries_per_step=16)"),
    (MQ, "<search> , </search>", Search([]), Malformed(P.EMPTY_QUERY), "MQ 474-475: queries: [] is posted"),
]


@pytest.mark.parametrize("tags,text,upstream,sonar,why", CASES, ids=[c[4][:40] for c in CASES])
def test_upstream_rules_beside_sonars(tags, text, upstream, sonar, why):
    assert parse_turn_upstream(text, tags, 16) == upstream, why
    assert parse_turn(text, tags, 3) == sonar


def test_rag_r1_upstream_still_counts_what_the_step_budget_drops():
    assert parse_turn_upstream("<search> a,b,c,d </search>", MQ, 3) == Search(["a", "b", "c"], dropped=1)


def test_upstream_turns_stop_only_at_the_query_close():
    """R1-Searcher's one stop string is <|end_of_query|> (EM 1087); Search-R1's and RAG-R1's engines stop
    at no tag (vllm_rollout.py:105-121) and cut after the first </search>, else the first </answer>, so
    Sonar stops at </search> only and cuts at </answer> afterwards (answer_cut); Sonar's rules stop at both."""
    assert stop_tags(R1, "upstream") == (R1.query_close,)
    assert stop_tags(R1, "sonar") == (R1.query_close, R1.answer_close)
    assert stop_tags(SR, "upstream") == stop_tags(MQ, "upstream") == ("</search>",)
    assert stop_tags(SR, "sonar") == ("</search>", "</answer>")
    assert (answer_cut(SR, "upstream"), answer_cut(MQ, "upstream")) == ("</answer>", "</answer>")
    assert answer_cut(R1, "upstream") is answer_cut(SR, "sonar") is None
    assert (drops_eos(SR, "upstream"), drops_eos(MQ, "upstream"), drops_eos(R1, "upstream"),
            drops_eos(SR, "sonar")) == (True, True, False, False)


def _search_r1_turn(generated: str) -> tuple[str, str | None, str]:
    """Search-R1's own handling of one generated turn, restated from the released code (GEN 56-66 and
    422-429; RAG-R1's generation.py:59-69 and 445-459 are the same): the engine ran to EOS, the text is
    decoded without special tokens, cut after the first </search> if any, else after the first
    </answer>, and the first <search>/<answer> block (non-greedy, across lines) is the action.
    Returns (kept text, action, content)."""
    import re

    text = generated.replace("[EOS]", "").strip()
    if "</search>" in text:
        text = text.split("</search>")[0] + "</search>"
    elif "</answer>" in text:
        text = text.split("</answer>")[0] + "</answer>"
    m = re.search(r"<(search|answer)>(.*?)</\1>", text, re.DOTALL)
    return text, (m.group(1) if m else None), (m.group(2).strip() if m else "")


# what the policy would write in one turn if nothing stopped it (the engine runs to EOS upstream)
GENERATED_TURNS = [
    "<search> capital <answer> paris </answer> france </search> city [EOS]",   # </answer> inside an open search
    "<answer> paris </answer> city <search> france </search> [EOS]",           # a search after the answer
    "<answer> paris </answer> and city [EOS]",                                 # text after the answer
    "<search> capital france </search> <answer> paris </answer> [EOS]",
    "<answer> paris <search> france </answer> [EOS]",
    "what is the capital [EOS]",                                                # no action: the message
]


@pytest.mark.parametrize("generated", GENERATED_TURNS)
def test_upstream_search_r1_turn_keeps_what_upstream_keeps_and_acts_as_it_does(generated):
    """Through the real rollout loop (search_r1 tags as special tokens of a word-level tokenizer, a
    scripted engine that honours the stop ids): under rules=upstream the first turn's MODEL segment
    decodes to exactly the text Search-R1 keeps of the same generation, and its action is upstream's
    (a search with that query, or the answer, or the invalid-action message). Under the old plan
    (stop at </answer> as well) the first case was an answer and the second lost its search text."""
    from sonar.actors.rollout import PromptItem, rollout_groups
    from sonar.cluster.wire.config import ProtocolConfig
    from sonar.cluster.wire.protocol import FinishReason, SegmentKind

    from .test_rollout import TOK, FakeRetriever, ScriptedEngine

    def script(ctx, turn):
        return generated if turn == 0 else "<answer> berlin </answer> [EOS]"

    proto = ProtocolConfig(name="search_r1", rules="upstream", on_invalid="message", max_turns=3, docs_per_query=1)
    retriever = FakeRetriever()
    engine = ScriptedEngine(script)
    groups, _ = asyncio.run(rollout_groups(
        [PromptItem("q", "what is the capital of france", ["paris"])], engine=engine, retriever=retriever,
        tokenizer=TOK, tags=SR, proto=proto, temperature=1.0, group_size=1, k=1,
        reward_fn=lambda t: type("R", (), {"total": 0.0, "parts": {}})()))
    traj = groups[0][0]
    assert engine.calls[0]["params"].stop_token_ids == (TOK.convert_tokens_to_ids("</search>"), TOK.eos_token_id)
    kept, action, content = _search_r1_turn(TOK.decode(TOK.encode(generated, add_special_tokens=False)))
    first = next(s for s in traj.segments if s.kind == SegmentKind.MODEL)
    assert TOK.decode(first.token_ids.tolist(), skip_special_tokens=False) == kept
    assert TOK.eos_token_id not in first.token_ids.tolist()
    if action == "search":
        assert [c.queries for c in traj.searches] == [[content]] and traj.prediction == "berlin"
    elif action == "answer":
        assert (traj.finish_reason, traj.prediction, traj.searches) == (FinishReason.ANSWERED, content, [])
    else:  # the message follows the turn directly: no EOS before it
        after = traj.segments[[id(s) for s in traj.segments].index(id(first)) + 1]
        assert after.kind == SegmentKind.RETRIEVAL
        assert after.token_ids.tolist() == render_invalid(SR, TOK, proto.prompt)
        assert (traj.prediction, traj.searches) == ("berlin", [])


def test_upstream_rules_through_the_rollout_loop_score_r1_searchers_trailing_text():
    """The r1_searcher tags as special tokens of a word-level tokenizer: the scripted model answers
    "paris", then goes on with a second answer, "berlin". Sonar's rules stop the turn at the first
    </answer>: the prediction is paris and the Qwen server's rules pass (F1 1). R1-Searcher's own rules
    do not stop there (EM 1087): the response holds both answers, the server reads the last one
    (qwen_zero.py:109-110: berlin, F1 0) and its one-answer rule fails (226-231): 0 - 2."""
    from sonar.actors.rewards import make_reward_fn
    from sonar.actors.rollout import PromptItem, rollout_groups
    from sonar.cluster.wire.config import ProtocolConfig, RewardConfig

    from .test_rollout import TOK, FakeRetriever, ScriptedEngine

    def script(ctx, turn):
        if turn == 0:
            return f"{R1.think_open} {R1.query_open} capital france {R1.query_close}"
        return (f"{R1.think_close} {R1.answer_open} paris {R1.answer_close} "
                f"{R1.answer_open} berlin {R1.answer_close} [EOS]")

    out = {}
    for rules in ("sonar", "upstream"):
        proto = ProtocolConfig(name="r1_searcher", rules=rules, on_invalid="end", max_turns=4, docs_per_query=1)
        reward = make_reward_fn(RewardConfig(name="r1_stage2", variant="code_qwen"), TOK, R1)
        engine = ScriptedEngine(script)
        groups, _ = asyncio.run(rollout_groups(
            [PromptItem("q", "what is the capital of france", ["paris"])], engine=engine,
            retriever=FakeRetriever(), tokenizer=TOK, tags=R1, proto=proto, temperature=1.0, group_size=1, k=1,
            reward_fn=reward))
        out[rules] = groups[0][0], engine.calls[0]["params"].stop_token_ids
    (sonar, sonar_stops), (upstream, upstream_stops) = out["sonar"], out["upstream"]
    assert TOK.convert_tokens_to_ids(R1.answer_close) in sonar_stops
    assert TOK.convert_tokens_to_ids(R1.answer_close) not in upstream_stops
    assert (sonar.prediction, upstream.prediction) == ("paris", "berlin")
    assert sonar.reward == pytest.approx(1.0)
    assert upstream.reward == pytest.approx(0.0 - 2.0)
    assert [c.queries for c in upstream.searches] == [["capital france"]]


def test_r1_searchers_evaluation_prompt_is_eval_search_loacl_py_base_prompt_v0():
    """evaluation/eval_search_loacl.py:58-62 (gen_search.sh: --prompt_type v0), pinned verbatim; the
    overlay configs/r1_searcher_eval.yaml applies it with top-5 documents and 9 retrievals (lines 230, 203)."""
    from sonar.actors.prompts import render_prompt
    from sonar.cluster.wire.config import load_config

    expected = (
        "The User asks a question, and the Assistant solves it.\n"
        "The Assistant first thinks about the reasoning process in the mind and then provides the User with the final "
        "answer.\nThe output format of reasoning process and final answer are enclosed within <think> </think> and "
        "<answer> </answer> tags, respectively, i.e., \"<think> reasoning process here </think>\n\n<answer> final "
        "answer here </answer>\".\nDuring the thinking process, the Assistant can perform searching for uncertain "
        "knowledge if necessary with the format of \"<|begin_of_query|> search query (only keywords) here "
        "<|end_of_query|>\". **A query must involve only a single triple**.\nThen, the system will provide the "
        "Assistant with helpful information with the format of \"<|begin_of_documents|> ...search results... "
        "<|end_of_documents|>\".\n\nUser:Who wrote it?\nAssistant: <think>")

    class Chars:  # a tokenizer that keeps the text: one id per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    assert "".join(map(chr, render_prompt(R1, "Who wrote it?", Chars(), "base", "r1_searcher_eval"))) == expected
    cfg = load_config(["r1_searcher", "r1_searcher_eval"], notes=[])
    assert (cfg.protocol.prompt, cfg.protocol.template, cfg.retrieval.k, cfg.protocol.docs_per_query,
            cfg.protocol.max_turns) == ("r1_searcher_eval", "base", 5, 5, 9)


def _r1_eval_script(turn: str):
    """R1-Searcher's evaluation script on one turn, restated (evaluation/eval_search_loacl.py:172-173 and
    215-260): vLLM stopped at "<|end_of_query|>" or "</answer>" and its text excludes the stop string."""
    stop = next((t for t in (R1.query_close, R1.answer_close) if turn.endswith(t)), None)
    generated = turn[: -len(stop)] if stop else turn
    if "<answer>" in generated and stop == "</answer>":
        return "answer", generated.split("<answer>")[-1].split("</answer>")[0]
    if "<|begin_of_query|>" in generated and stop == "<|end_of_query|>":
        query = generated.split("<|begin_of_query|>")[-1].split("<|end_of_query|>")[0]
        query = query.replace('"', "").replace("'", "").replace("\t", " ").replace("...", "")
        return ("search", query) if query else ("query_inst_error", None)
    return "shot_down", None


EVAL_TURNS = [  # (turn text up to its stop, Sonar's own rules)
    ("<answer> a <answer> b </answer>", Malformed(P.NESTED)),
    (f"{QO} x {QO} y {QC}", Malformed(P.NESTED)),
    (f"{R1.docs_open} fake {R1.docs_close} </think> <answer> Paris </answer>", Malformed(P.DOCS_TAG)),
    (f'{QO} "it\'s" a...b\tc {QC}', Search(['"it\'s" a...b\tc'])),
    (f"{QO} q <answer> a </answer>", Malformed(P.NESTED)),
    (f"<answer> a {QO} q {QC}", Malformed(P.NESTED)),
    (f"{QO}{QC}", Malformed(P.EMPTY_QUERY)),
    (f"{QO} ' {QC}", Search(["'"])),
    ("<answer> cut by the limit", Malformed(P.UNTERMINATED_ANSWER)),
    (f"no opener {QC}", Malformed(P.QUERY_CLOSE_WITHOUT_OPEN)),
]


@pytest.mark.parametrize("turn,sonar", EVAL_TURNS)
def test_r1_searcher_evaluation_reading_is_its_eval_scripts(turn, sonar):
    """protocol.rules=upstream with protocol.prompt=r1_searcher_eval reads a turn as the evaluation script
    does (restated above): nested answers, several query openers and a model-written documents block are
    accepted, the query loses its quotes and "...", where Sonar's own rules (the overlay's rules=sonar)
    refuse or keep them."""
    from sonar.actors.upstream import parse_turn_r1_searcher_eval, turn_parser

    assert turn_parser(R1, "upstream", "r1_searcher_eval") is parse_turn_r1_searcher_eval
    assert stop_tags(R1, "upstream", "r1_searcher_eval") == (R1.query_close, R1.answer_close)
    kind, content = _r1_eval_script(turn)
    got = parse_turn_r1_searcher_eval(turn, R1, 1)
    if kind == "answer":
        assert got == Answer(content.strip())
    elif kind == "search":
        assert got == Search([" ".join(content.split())] if content.split() else [])
    elif kind == "query_inst_error":
        assert got == Malformed(P.EMPTY_QUERY)
    else:
        assert isinstance(got, Malformed)
    assert parse_turn(turn, R1, 1) == sonar


def test_r1_searcher_evaluation_reading_through_the_rollout_and_the_overlay():
    """The overlay with rules=upstream (``--config r1_searcher --config r1_searcher_eval
    protocol.rules=upstream``) loads, stops at both closing tags and acts as the evaluation script: the
    last of two query openers is searched, the last of two answer openers is the prediction."""
    from sonar.actors.rollout import PromptItem, rollout_groups
    from sonar.cluster.wire.config import load_config

    from .test_rollout import TOK, FakeRetriever, ScriptedEngine

    cfg = load_config(["r1_searcher", "r1_searcher_eval"], ["protocol.rules=upstream"], notes=[])
    assert (cfg.protocol.rules, cfg.protocol.prompt) == ("upstream", "r1_searcher_eval")

    def script(ctx, turn):
        if turn == 0:
            return f"{QO} a {QO} capital france {QC}"
        return f"{R1.think_close} {R1.answer_open} berlin {R1.answer_open} paris {R1.answer_close} more [EOS]"

    engine = ScriptedEngine(script)
    groups, _ = asyncio.run(rollout_groups(
        [PromptItem("q", "what is the capital of france", ["paris"])], engine=engine, retriever=FakeRetriever(),
        tokenizer=TOK, tags=R1, proto=cfg.protocol, temperature=0.0, group_size=1, k=5,
        reward_fn=lambda t: type("R", (), {"total": 0.0, "parts": {}})()))
    t = groups[0][0]
    assert engine.calls[0]["params"].stop_token_ids[:2] == tuple(TOK.convert_tokens_to_ids([QC, R1.answer_close]))
    assert [c.queries for c in t.searches] == [["capital france"]] and t.prediction == "paris"


def test_search_r1_upstream_prompt_ends_the_question_with_a_mark_and_titles_keep_their_quotes():
    """nq_search.py:61-63 (strip, then '?' unless present) and generation.py:460-469 (the title is the
    corpus's first line as it is: wiki-18 quotes it)."""
    from sonar.actors.prompts import render_documents, render_prompt

    class Chars:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    text = lambda ids: "".join(map(chr, ids))  # noqa: E731
    assert text(render_prompt(SR, " who wrote it ", Chars(), "base", "search_r1", "upstream")).endswith(
        "Question: who wrote it?\n")
    assert text(render_prompt(SR, "who wrote it?", Chars(), "base", "search_r1", "upstream")).endswith(
        "Question: who wrote it?\n")
    assert text(render_prompt(SR, "who wrote it", Chars(), "base", "search_r1")).endswith("Question: who wrote it\n")
    docs = [[("Paris", "Paris is the capital.")]]
    assert text(render_documents(SR, docs, Chars(), 100, style="search_r1", rules="upstream")) == \
        '\n\n<information>Doc 1(Title: "Paris") Paris is the capital.</information>\n\n'
    assert text(render_documents(SR, docs, Chars(), 100, style="search_r1")) == \
        "\n\n<information>Doc 1(Title: Paris) Paris is the capital.</information>\n\n"


def test_r1_searcher_upstream_documents_are_its_corpus_lines():
    """R1-Searcher's loop prints each hit as its corpus line with the leading id cut (experience_maker.py:
    1200-1201: re.sub(r'^\\d+\\s+', '', doc), then "(j)" + line + "\\n"), and its training corpus lines read
    "<id>\\tTitle: <title> Text:  <text>" (wiki_corpus_index_bulid/samples/train_np_title_abs_sample_100.tsv,
    line 2, below; every document of data/eval_results/hotpotqa_*.jsonl has that layout). Sonar's own rules
    keep "(j)title\\ntext"."""
    import re

    from sonar.actors.prompts import render_documents

    class Chars:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    line = "1\tTitle: Lucy Mair Text:  Lucy Philip Mair (28 January 1901 – 1 April 1986) was a British anthropologist."
    title, text = "Lucy Mair", "Lucy Philip Mair (28 January 1901 – 1 April 1986) was a British anthropologist."
    printed = re.sub(r"^\d+\s+", "", line)
    upstream = f"\n\n{R1.docs_open}\n(1){printed}\n{R1.docs_close}\n\n"
    render = lambda rules, docs=[[(title, text)]]: "".join(map(chr, render_documents(  # noqa: E731
        R1, docs, Chars(), 1000, style="r1_searcher_base", rules=rules)))
    assert render("upstream") == upstream
    assert render("sonar") == f"\n\n{R1.docs_open}\n(1){title}\n{text}\n{R1.docs_close}\n\n"
    assert render("upstream", [[]]) == f"\n\n{R1.docs_open}\nNone{R1.docs_close}\n\n"  # no hit: "None" (1204)


def test_rag_r1_upstream_shows_each_query_its_own_documents_repeats_included():
    """generation_mq.py:492-507: every query gets its own top-k, a document already shown for an earlier
    query of the step included; Sonar's rules skip it and backfill."""
    from sonar.actors.rollout import PromptItem, rollout_groups
    from sonar.cluster.wire.config import ProtocolConfig
    from sonar.retrieval.base import Hit

    from .test_rollout import TOK, FakeRetriever, ScriptedEngine

    shared, other = Hit("d1", "paris", "paris is a city", 1.0), Hit("d2", "berlin", "berlin is a city", 0.5)
    table = {"france": [shared, other], "germany": [shared, other]}

    def script(ctx, turn):
        return "<search> france , germany </search>" if turn == 0 else "<answer> paris </answer>"

    ids = {}
    for rules in ("sonar", "upstream"):
        proto = ProtocolConfig(name="rag_r1_multi", rules=rules, docs_per_query=1, max_turns=2)
        groups, _ = asyncio.run(rollout_groups(
            [PromptItem("q", "what is the capital of france", ["paris"])], engine=ScriptedEngine(script),
            retriever=FakeRetriever(table), tokenizer=TOK, tags=MQ, proto=proto, temperature=1.0, group_size=1, k=2,
            reward_fn=lambda t: type("R", (), {"total": 0.0, "parts": {}})()))
        ids[rules] = groups[0][0].searches[0].doc_ids
    assert ids["sonar"] == [["d1"], ["d2"]]
    assert ids["upstream"] == [["d1"], ["d1"]]


class MergingTokenizer:
    """A duck-typed tokenizer whose vocabulary merges a closing tag's last character with the newlines
    after it, as Qwen's and Llama 3's BPE do (``">\\n\\n"``, ``"|>\\n\\n"``): greedy longest match over a few
    pieces, every other character its own id. The tags are text (no tag is one id)."""

    PIECES = [">\n\n", "|>\n\n", "</", "search", "<search>", " capital", " france", "[EOS]"]

    def __init__(self):
        chars = [chr(c) for c in range(32, 127)] + ["\n", "\t", "‹", "›", "¦", "\u2060"]
        self.vocab = self.PIECES + [c for c in chars if c not in self.PIECES]
        self.ids = {p: i for i, p in enumerate(self.vocab)}
        self.eos_token_id = self.ids["[EOS]"]

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            piece = max((p for p in self.PIECES if text.startswith(p, i)), key=len, default=text[i])
            out.append(self.ids[piece])
            i += len(piece)
        return out

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[int(i)] for i in ids)


@pytest.mark.parametrize("tags,style,turn,block_start", [
    (SR, "search_r1", "<search> capital france</search>\n\nSo[EOS]", "\n\n<information>"),
    (R1, "r1_searcher_base", f"<think> capital france{QO} capital france{QC}\n\nSo[EOS]",
     "\n\n<|begin_of_documents|>\n"),
])
def test_upstream_text_after_a_merged_stop_token_reads_as_upstreams(tags, style, turn, block_start):
    """The stop token ">\\n\\n" completes </search> (<|end_of_query|>) and carries the newlines. Upstream cuts
    the turn at the tag (Search-R1 GEN 61-66; R1-Searcher EM 1151 and 1207 append the tag and the block
    themselves) and the block brings its own "\\n\\n": under rules=upstream the documents block is rendered
    without the newlines the token already wrote, so the response reads exactly as upstream's (the
    tokens differ: Sonar never re-tokenises); Sonar's own rules keep both (four newlines)."""
    from sonar.actors.engine import Generation, StopStrings
    from sonar.actors.rollout import PromptItem, rollout_groups
    from sonar.cluster.wire.config import ProtocolConfig
    from sonar.cluster.wire.protocol import SegmentKind

    from .test_rollout import FakeRetriever

    tok = MergingTokenizer()

    class Engine:
        def __init__(self):
            self.turn = 0

        def generate(self, prompts, params, max_new_tokens_per_prompt=None):
            text = turn if self.turn == 0 else " </think><answer> paris </answer>[EOS]"
            self.turn += 1
            kept, m = [], StopStrings(tok, params.stop_strings)
            for t in tok.encode(text):
                kept.append(t)
                if t in params.stop_token_ids or m.push(t):
                    break
            return [Generation(np.asarray(kept, np.int32), np.full(len(kept), -0.5, np.float32), "stop", 0)
                    for _ in prompts]

    out = {}
    for rules in ("sonar", "upstream"):
        proto = ProtocolConfig(name=tags.name, prompt=style, rules=rules, docs_per_query=1, max_turns=2,
                               on_invalid="end", max_total_tokens=4096)
        groups, _ = asyncio.run(rollout_groups(
            [PromptItem("q", "capital of france", ["paris"])], engine=Engine(), retriever=FakeRetriever(),
            tokenizer=tok, tags=tags, proto=proto, temperature=1.0, group_size=1, k=1,
            reward_fn=lambda t: type("R", (), {"total": 0.0, "parts": {}})()))
        t = groups[0][0]
        first, block = t.segments[1], t.segments[2]
        assert (first.kind, block.kind) == (SegmentKind.MODEL, SegmentKind.RETRIEVAL)
        assert tok.decode(first.token_ids[-1:]) in (">\n\n", "|>\n\n")  # the merged stop token, kept
        out[rules] = tok.decode(first.token_ids) + tok.decode(block.token_ids)
    cut = turn[: turn.index(tags.query_close) + len(tags.query_close)]
    assert out["upstream"].startswith(cut + block_start)
    assert out["sonar"].startswith(cut + "\n\n" + block_start)
