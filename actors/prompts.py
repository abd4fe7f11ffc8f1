"""Tag sets, prompt templates and the rendering of prompts, documents and messages to token ids:
the one place the tag strings and the protocols' fixed texts live.

Tags (``model.tags``, resolved by ``cluster.wire.config.model_tags``) are one of:

* **plain text** (``text``, the default with ``model.path``), as upstream R1-Searcher, Search-R1 and
  RAG-R1 keep them: a stock tokenizer and its embeddings are used unchanged, every tag here is
  tokenised as ordinary text wherever a prompt, a document block or a message is rendered, and a
  model turn ends at the first token whose decoded text completes a closing tag (stop *strings*,
  ``stop_plan``). An instruct model then emits the tags with ids it was trained on (a padded
  vocabulary such as Qwen's has never-trained rows where added tokens would land).
* **one special token each** (``special``: the tiny word-level model, whose vocabulary holds them,
  or a stock tokenizer given ``actors.tokenizer.add_tags`` with grown, mean-initialised embedding
  rows, ``actors.model.add_tags_to_policy``): a turn ends on the tag's id.

Either way the rollout is token in, token out: a MODEL segment holds exactly the ids the engine
sampled, the loss mask follows segment boundaries, and text is decoded only to parse an action.
``stop_plan`` reads the mode off the tokenizer (a closing tag that is one added token stops on its
id, any other on its string), so a policy directory carries its own mode. The texts below are
upstream's.

Untrusted text (questions, retrieved documents, queries echoed back) goes through ``neutralise``
with *every* tag and special token of the tokenizer (``special_strings``: the tags, ``<eos>``,
chat-role markers...), so it can never encode to a special id or spell a tag: it cannot open or close
a block, end the sequence, or forge a chat turn. (With tags as text only MODEL segments are ever
parsed, so a document could not act anyway; neutralised, it cannot even look like an action to the
model.)

Prompt styles (``ProtocolConfig.prompt``):

* ``short``: ``question : <q>`` only. The tiny random model learns the format by SFT, and every
  word is in the synthetic world's vocabulary.
* ``r1_searcher_base`` / ``r1_searcher_instruct``: R1-Searcher's base prompt (plain text, ends with
  ``Assistant: <think>``) and its instruct prompt (system + user through the tokenizer's chat
  template, then ``<think>`` prefilled).
* ``search_r1``: Search-R1's prompt (the question inside the instruction).
* ``rag_r1``: RAG-R1's prompt, single-query (protocol ``rag_r1``) or multi-query (``rag_r1_multi``:
  comma-separated queries, up to three per step).

Documents: ``short`` keeps Sonar's compact block (``<|doc|>`` between documents; multi-query groups
each echo ``query : <q>``); the upstream styles render the block as each paper's code does (see
``render_documents``). The invalid-action message (``render_invalid``) is Search-R1's / RAG-R1's.

Pure module: standard library only (the tokenizer is duck-typed).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from sonar.cluster.wire.text import clean_text


@dataclass(frozen=True)
class TagSet:
    name: str
    think_open: str
    think_close: str
    query_open: str
    query_close: str
    docs_open: str
    docs_close: str
    answer_open: str
    answer_close: str
    query_sep: str | None
    """Plain-text separator between several queries in one search step (multi-query protocols only;
    RAG-R1 splits on a comma). Not a tag and not a special token."""
    doc_sep: str
    """Separator between documents in the ``short`` documents block (a special token)."""

    @property
    def multi_query(self) -> bool:
        return self.query_sep is not None

    def special_tokens(self) -> list[str]:
        """The tags of this protocol (one special token each with ``model.tags='special'``, plain text
        with ``'text'``)."""
        toks = [self.think_open, self.think_close, self.query_open, self.query_close,
                self.docs_open, self.docs_close, self.answer_open, self.answer_close, self.doc_sep]
        return list(dict.fromkeys(toks))


PROTOCOLS: dict[str, TagSet] = {
    # R1-Searcher (arXiv 2503.05592): one query per step, documents in their own block.
    "r1_searcher": TagSet("r1_searcher", "<think>", "</think>",
                          "<|begin_of_query|>", "<|end_of_query|>",
                          "<|begin_of_documents|>", "<|end_of_documents|>",
                          "<answer>", "</answer>", None, "<|doc|>"),
    # Search-R1: <search>/<information>/<answer>, optional <think>.
    "search_r1": TagSet("search_r1", "<think>", "</think>", "<search>", "</search>",
                        "<information>", "</information>", "<answer>", "</answer>", None, "<|doc|>"),
    # RAG-R1 (arXiv 2507.02962) single-query: Search-R1's tags.
    "rag_r1": TagSet("rag_r1", "<think>", "</think>", "<search>", "</search>",
                     "<information>", "</information>", "<answer>", "</answer>", None, "<|doc|>"),
    # RAG-R1 multi-query: "<search> q1,q2 </search>", one batched retrieval, the documents of each
    # query grouped under that query in the injected block.
    "rag_r1_multi": TagSet("rag_r1_multi", "<think>", "</think>", "<search>", "</search>",
                           "<information>", "</information>", "<answer>", "</answer>", ",", "<|doc|>"),
}

PROMPT_STYLES = ("short", "r1_searcher_base", "r1_searcher_instruct", "r1_searcher_eval", "search_r1", "rag_r1")
PROMPT_PROTOCOLS = {
    "short": tuple(PROTOCOLS),
    "r1_searcher_base": ("r1_searcher",),
    "r1_searcher_instruct": ("r1_searcher",),
    "r1_searcher_eval": ("r1_searcher",),
    "search_r1": ("search_r1",),
    "rag_r1": ("rag_r1", "rag_r1_multi"),
}
"""Which protocols (tag sets) each prompt style describes. ``config.validate`` keeps a copy of this
table (the wire imports nothing of actors); ``tests/actors/test_prompts.py`` checks they agree."""


TOOL_TAGS = {"visit": ("<visit>", "</visit>")}
"""The built-in tools' call tags beside the protocols' (``actors/tools.py``). With the tiny word-level
model they become special tokens of its tokenizer only in runs that list the tool (appended after its
words, ``tokenizer.build_tokenizer(extra_tags=)``), so every other run's vocabulary, and its policy, is
the same as before; untrusted text can never spell them (``special_strings``)."""


def get_protocol(name: str) -> TagSet:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"protocol.name={name!r} is not one of {sorted(PROTOCOLS)}") from None


def all_special_tokens() -> list[str]:
    """Union of the tags over protocols, so one tokenizer (and one policy directory) serves every protocol."""
    out: list[str] = []
    for ts in PROTOCOLS.values():
        out.extend(ts.special_tokens())
    return list(dict.fromkeys(out))


def tag_id(tokenizer, tag: str) -> int | None:
    """The id of ``tag`` when the tokenizer holds it as one added token (matched before
    pre-tokenisation, never split: ``model.tags='special'`` or the tiny word tokenizer), else None
    (the tag is plain text for this tokenizer)."""
    added = getattr(tokenizer, "get_added_vocab", None)
    if callable(added):
        tid = added().get(tag)
        return None if tid is None else int(tid)
    ids = list(tokenizer.encode(tag, add_special_tokens=False))  # duck-typed tokenizers: one id, not unk
    unk = getattr(tokenizer, "unk_token_id", None)
    return int(ids[0]) if len(ids) == 1 and ids[0] != unk else None


def stop_plan(tokenizer, tags: TagSet, closing: tuple[str, ...] | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Where a model turn ends, as (stop ids, stop strings): each closing tag (``closing``; default
    ``query_close`` and ``answer_close``; ``actors.upstream.stop_tags`` for ``protocol.rules``) that is
    one added token of the tokenizer stops on its id, any other on its string (tags as plain text).
    The rollout adds EOS to the ids."""
    ids: list[int] = []
    texts: list[str] = []
    for tag in dict.fromkeys(closing if closing is not None else (tags.query_close, tags.answer_close)):
        tid = tag_id(tokenizer, tag)
        if tid is None:
            texts.append(tag)
        else:
            ids.append(tid)
    return tuple(ids), tuple(texts)


def special_strings(tokenizer=None) -> list[str]:
    """Every string that encodes to a special id: the tags, plus (given a tokenizer) its special tokens
    (``<eos>``, ``<pad>``...) and every added token (chat-role markers such as ``<|im_start|>``)."""
    out = list(all_special_tokens()) + [t for pair in TOOL_TAGS.values() for t in pair]
    if tokenizer is not None:
        out.extend(str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or []))
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        out.extend(str(getattr(t, "content", t)) for t in added.values())
    return [s for s in dict.fromkeys(out) if s]


# ---------------------------------------------------------------- texts
# The tokenizer is duck-typed: ``encode(text, add_special_tokens=False) -> list[int]``,
# ``get_added_vocab() -> dict[str, int]`` (optional: which tags are one token, ``tag_id``) and, for
# chat templates, ``apply_chat_template``.

INSTRUCTIONS = {
    "r1_searcher": "answer the question . search with {qo} query {qc} , read the documents , then answer in {ao} {ac} .",
    "search_r1": "answer the question . think in {to} {tc} , search with {qo} query {qc} , answer in {ao} {ac} .",
    "rag_r1": "answer the question . think in {to} {tc} , search with {qo} query {qc} , answer in {ao} {ac} .",
    "rag_r1_multi": ("answer the question . think in {to} {tc} , search with {qo} query {sep} query {qc} , "
                     "answer in {ao} {ac} ."),
}
"""Short instructions in the synthetic world's words (kept for the world's vocabulary)."""


def instruction(tags: TagSet) -> str:
    return INSTRUCTIONS[tags.name].format(
        to=tags.think_open, tc=tags.think_close, qo=tags.query_open, qc=tags.query_close,
        ao=tags.answer_open, ac=tags.answer_close, sep=tags.query_sep or "")


# R1-Searcher, OpenRLHF-RAG/openrlhf/datasets/prompts_dataset.py (preprocess_data), verbatim.
R1_SEARCHER_SYSTEM = """You are a helpful assistant.
Given a question, you should answer it by first thinking about the reasoning process in the mind and then providing the final answer.
The output format of reasoning process and final answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "<think> reasoning process here </think>\n\n<answer> final answer here </answer>".
During the thinking process, **you can perform searching for uncertain knowledge** if necessary with the format of "<|begin_of_query|> search query (only list keywords, such as **"keyword_1 keyword_2 ..."**)<|end_of_query|>". **A query must involve only a single triple**.
Then, the search system will provide you with the retrieval information with the format of "<|begin_of_documents|> ...search results... <|end_of_documents|>"."""

R1_SEARCHER_BASE = """The User asks a question, and the Assistant solves it.
The Assistant first thinks about the reasoning process in the mind and then provides the User with the final answer.
The output format of reasoning process and final answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "<think> reasoning process here </think>\n\n<answer> final answer here </answer>".
During the thinking process, **the Assistant can perform searching** for uncertain knowledge if necessary with the format of "<|begin_of_query|> search query (only list keywords, such as **"keyword_1 keyword_2 ..."**)<|end_of_query|>". **A query must involve only a single triple**.
Then, the search system will provide the Assistant with the retrieval information with the format of "<|begin_of_documents|> ...search results... <|end_of_documents|>".

User:{question}
Assistant: <think>"""

# R1-Searcher's evaluation prompt (evaluation/eval_search_loacl.py:58-62, base_prompt_v0, chosen by
# gen_search.sh's --prompt_type v0), verbatim: not the training prompt (the Assistant, not "you", searches;
# "(only keywords)"; "the system will provide ... helpful information").
R1_SEARCHER_EVAL = """The User asks a question, and the Assistant solves it.
The Assistant first thinks about the reasoning process in the mind and then provides the User with the final answer.
The output format of reasoning process and final answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "<think> reasoning process here </think>\n\n<answer> final answer here </answer>".
During the thinking process, the Assistant can perform searching for uncertain knowledge if necessary with the format of "<|begin_of_query|> search query (only keywords) here <|end_of_query|>". **A query must involve only a single triple**.
Then, the system will provide the Assistant with helpful information with the format of "<|begin_of_documents|> ...search results... <|end_of_documents|>".\n\nUser:{question}\nAssistant: <think>"""

# Search-R1, scripts/data_process/nq_search.py (make_prefix, template 'base'), verbatim.
SEARCH_R1 = ("Answer the given question. "
             "You must conduct reasoning inside <think> and </think> first every time you get new information. "
             "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
             "</search> and it will return the top searched results between <information> and </information>. "
             "You can search as many times as your want. "
             "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
             "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
             "Question: {question}\n")

# RAG-R1 (inclusionAI/AWorld-RL), RAG-R1/scripts/data_process/hotpotqa_search.py: Search-R1's text.
RAG_R1 = SEARCH_R1
# RAG-R1/scripts/data_process/hotpotqa_search_mq.py (make_prefix), verbatim.
RAG_R1_MULTI = ("Answer the given question. "
                "You must conduct reasoning inside <think> and </think> first every time you get new information. "
                "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> "
                "query_1,query_2 </search> and it will return the top searched results for each query between "
                "<information> and </information>. "
                "You can search as many times as you want, using up to three queries each time. "
                "If you find no further external knowledge needed, you can directly provide the answer inside "
                "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
                "Question: {question}\n")

# Search-R1 search_r1/llm_agent/generation.py and RAG-R1 rag_r1/llm_agent/generation_mq.py
# (execute_predictions), verbatim with the protocol's tags.
INVALID_MESSAGE = ("\nMy previous action is invalid. If I want to search, I should put the query between {qo} and "
                   "{qc}. If I want to give the final answer, I should put the answer between {ao} and {ac}. "
                   "Let me try again.\n")
INVALID_SHORT = "no query and no answer ."
"""The ``short`` style's message, in words of the synthetic world's vocabulary."""


def check_style(tags: TagSet, style: str, template: str) -> None:
    """Raise ``ValueError`` for a prompt style that does not describe ``tags`` or needs the other template."""
    if style not in PROMPT_PROTOCOLS:
        raise ValueError(f"protocol.prompt={style!r} is not one of {list(PROMPT_STYLES)}")
    if tags.name not in PROMPT_PROTOCOLS[style]:
        raise ValueError(f"protocol.prompt={style!r} describes protocol(s) {list(PROMPT_PROTOCOLS[style])}, "
                         f"not protocol.name={tags.name!r}")
    if style in ("r1_searcher_base", "r1_searcher_eval") and template != "base":
        raise ValueError(f"protocol.prompt={style!r} is a plain-text prompt; protocol.template={template!r} "
                         "must be 'base' (use r1_searcher_instruct with the chat template)")
    if style == "r1_searcher_instruct" and template != "chat":
        raise ValueError(f"protocol.prompt='r1_searcher_instruct' goes through the chat template; "
                         f"protocol.template={template!r} must be 'chat'")


def prefills_think(style: str) -> bool:
    """R1-Searcher's prompts end with ``<think>``: the model's first turn starts inside the think block."""
    return style in ("r1_searcher_base", "r1_searcher_instruct", "r1_searcher_eval")


def neutralise(text: str, specials: list[str]) -> str:
    """Break every special-token string inside untrusted text (retrieved documents, questions).

    With tags as special tokens an un-neutralised ``</information>`` inside a document would encode
    to the real closing tag and let retrieved text close (or open) a block; with tags as text it would
    spell the tag the model reads as the end of the block; an ``<eos>`` would end the sequence. Replacing ``<`` / ``>`` / ``|`` by look-alikes inside those strings keeps the text
    readable and makes it encode as plain text. Pass ``special_strings(tokenizer)``.
    """
    text = clean_text(text)  # lone surrogates (from a plug-in's hits or tool) would crash the tokenizer
    for tok in sorted(specials, key=len, reverse=True):
        if tok in text:
            text = text.replace(tok, _defang(tok))
    return text


def _defang(tok: str) -> str:
    out = tok.replace("<", "‹").replace(">", "›").replace("|", "¦").replace("[", "⁅").replace("]", "⁆")
    if out == tok:  # a special token without any of those characters: break it with a zero-width joiner
        out = tok[:1] + "\u2060" + tok[1:]
    return out


def _encode(tokenizer, text: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def _chat(tokenizer, messages: list[dict]) -> list[int]:
    # transformers 5 returns a BatchEncoding unless return_dict=False.
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(i) for i in ids]


def render_prompt(tags: TagSet, question: str, tokenizer, template: str = "base", style: str = "short",
                  rules: str = "sonar") -> list[int]:
    """Prompt token ids for one question (see the module docstring for the styles).

    ``rules='upstream'`` (``protocol.rules``): the Search-R1 and RAG-R1 styles get the question as their
    data scripts write it, stripped and ending in "?" (Search-R1 ``scripts/data_process/nq_search.py:61-63``,
    RAG-R1 ``scripts/data_process/hotpotqa_search_mq.py:63-65``; R1-Searcher's data is used as it is).

    ``template='chat'`` wraps the text in the tokenizer's chat template as the user's message
    (``r1_searcher_instruct``: R1-Searcher's system message, the question as the user's, ``<think>``
    appended after the generation prompt, as its ``prompts_dataset.py`` does). Tags in these texts
    are encoded as the tokenizer has them: one special id each, or plain text. The question is
    neutralised against every special token of the tokenizer.
    """
    check_style(tags, style, template)
    if rules == "upstream" and style in ("search_r1", "rag_r1"):
        question = question.strip()
        question += "" if question.endswith("?") else "?"
    question = neutralise(question, special_strings(tokenizer))
    if style == "r1_searcher_instruct":
        ids = _chat(tokenizer, [{"role": "system", "content": R1_SEARCHER_SYSTEM}, {"role": "user", "content": question}])
        return ids + _encode(tokenizer, tags.think_open)  # one special id, or the tag as text
    if style == "short":
        body = f"question : {question}"
    elif style == "r1_searcher_eval":
        body = R1_SEARCHER_EVAL.format(question=question)
    elif style == "r1_searcher_base":
        body = R1_SEARCHER_BASE.format(question=question)
    elif style == "search_r1":
        body = SEARCH_R1.format(question=question)
    else:  # rag_r1
        body = (RAG_R1_MULTI if tags.multi_query else RAG_R1).format(question=question)
    if template == "chat":
        return _chat(tokenizer, [{"role": "user", "content": body}])
    return _encode(tokenizer, body)


MAX_CHARS_PER_TOKEN = 32
"""Characters kept per token a document may use, before tokenizing: a 10 MB document is cut to
``max_doc_tokens x 32`` characters first (tokenizing it whole took 76 s and 1.2 GB). No tokenizer of the
papers' families spends more than 32 characters on a token of prose, so the cut never changes the first
``max_doc_tokens`` tokens."""


def cap_chars(text: str, max_tokens: int) -> str:
    """``text`` cut to what ``max_tokens`` tokens can hold (:data:`MAX_CHARS_PER_TOKEN` each), before tokenizing."""
    return text[: max(0, max_tokens) * MAX_CHARS_PER_TOKEN]


def _truncate(tokenizer, text: str, max_tokens: int) -> str:
    text = cap_chars(text, max_tokens)
    ids = _encode(tokenizer, text)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=False)


def render_documents(tags: TagSet, per_query_docs: list[list[tuple[str, str]]], tokenizer,
                     max_doc_tokens: int, error: str | None = None, queries: list[str] | None = None,
                     style: str = "short", rules: str = "sonar", lead: str = "") -> list[int]:
    """Token ids of one injected documents block.

    ``per_query_docs[i]`` is the (title, text) list of query i (``queries[i]``, echoed by the
    multi-query formats), so multi-query steps keep each query's documents grouped. Every title,
    text and echoed query is neutralised; each document is cut to ``max_doc_tokens`` tokens.
    Formats (tags in braces are the protocol's):

    * ``short``: ``{docs_open} <|doc|> title : text <|doc|> ... {docs_close}``; an empty or failed
      search gives ``<|doc|> no results``. Multi-query: each group starts ``query : <q>`` and an empty
      group reads ``<|doc|> no results``.
    * R1-Searcher (``r1_searcher_*``, its ``experience_maker.py:1197-1207``): ``\\n\\n{docs_open}\\n(1)title
      \\ntext\\n(2)...{docs_close}\\n\\n``; no documents: ``None``. With ``rules='upstream'`` each document is the
      line of R1-Searcher's training corpus, as its retrieval server returns it and the loop prints it after
      cutting the leading id (``train/wiki_corpus_load.py:12-16,36``, ``experience_maker.py:1200-1201``):
      ``(1)Title: t Text:  x`` (the HotpotQA abstracts its training mounts, ``wiki_corpus_load.py hotpotqa``;
      its released HotpotQA evaluation records show that line on every document). Its KILT corpus, mounted
      to evaluate 2Wiki, MuSiQue and Bamboogle, prints ``(1)t   x`` instead (``split_kilt_to_100.py:47``): not
      rendered here.
    * Search-R1 (``search_r1``, its ``generation.py``): ``\\n\\n{docs_open}Doc 1(Title: t) text\\nDoc 2
      ...{docs_close}\\n\\n``; with ``rules='upstream'`` the title keeps the double quotes of wiki-18's
      ``contents`` line, which upstream prints as it is (``generation.py:460-469``; Sonar's corpus reader
      strips them, ``retrieval/corpus.py:split_contents``).
    * RAG-R1 single-query (``generation_sq.py``): ``\\n{docs_open}\\nDoc 1: "t"\\ntext\\n...\\n{docs_close}\\n``;
      multi-query (``generation_mq.py``): the same frame around ``json.dumps({"query": [...],
      "documents": ["Doc 1: ...\\nDoc 2: ...", ...]}, indent=2)``, one documents string per query.

    Retrieval tokens are never trained (segment kind RETRIEVAL); demonstrations and rollouts both
    call this function, so the policy sees the same tokens in SFT and in RL.

    ``lead``: text the model's last token already carried past its closing tag (a BPE token such as
    ``">\\n\\n"`` completes ``</search>`` and brings the newlines along); an upstream style's block that starts
    with it is rendered without it, so the text reads as upstream's, where the turn is cut at the tag and
    the block brings its own newlines (``_trim_lead``; the rollout passes it under ``rules='upstream'``).
    """
    specials = special_strings(tokenizer)
    queries = list(queries) if queries is not None else [""] * len(per_query_docs)
    if len(queries) != len(per_query_docs):
        raise ValueError(f"{len(queries)} queries for {len(per_query_docs)} document groups")
    if style == "short":
        return _short_documents(tags, per_query_docs, queries, tokenizer, max_doc_tokens, specials)

    def doc(title: str, text: str) -> tuple[str, str]:
        return neutralise(title, specials), _truncate(tokenizer, neutralise(text, specials), max_doc_tokens)

    if style in ("r1_searcher_base", "r1_searcher_instruct", "r1_searcher_eval"):
        docs = [doc(t, x) for group in per_query_docs for t, x in group]
        # upstream prints its corpus line (id cut off): the training corpus's is "Title: t Text:  x"
        line = "({j})Title: {t} Text:  {x}\n" if rules == "upstream" else "({j}){t}\n{x}\n"
        body = "".join(line.format(j=j + 1, t=t, x=x) for j, (t, x) in enumerate(docs)) or "None"
        text = f"\n\n{tags.docs_open}\n{body}{tags.docs_close}\n\n"
    elif style == "search_r1":
        docs = [doc(t, x) for group in per_query_docs for t, x in group]
        q = '"' if rules == "upstream" else ""
        body = "".join(f"Doc {j + 1}(Title: {q}{t}{q}) {x}\n" for j, (t, x) in enumerate(docs))
        text = f"\n\n{tags.docs_open}{body.strip()}{tags.docs_close}\n\n"
    elif style == "rag_r1":
        groups = ["\n".join(f'Doc {j + 1}: "{t}"\n{x}' for j, (t, x) in enumerate(doc(*d) for d in group))
                  for group in per_query_docs]
        if tags.multi_query:
            body = json.dumps({"query": [neutralise(q, specials) for q in queries], "documents": groups}, indent=2)
        else:
            body = "\n".join(g for g in groups if g)
        text = f"\n{tags.docs_open}\n{body.strip()}\n{tags.docs_close}\n"
    else:
        raise ValueError(f"protocol.prompt={style!r} is not one of {list(PROMPT_STYLES)}")
    return _encode(tokenizer, _trim_lead(text, lead))


def _trim_lead(text: str, lead: str) -> str:
    """``text`` without ``lead`` when it starts with it (what the previous token already wrote)."""
    return text[len(lead):] if lead and text.startswith(lead) else text


def _short_documents(tags: TagSet, per_query_docs, queries, tokenizer, max_doc_tokens: int,
                     specials: list[str]) -> list[int]:
    # Each tag encoded alone: its one special id, or its text (tags as plain text).
    ids = _encode(tokenizer, tags.docs_open)
    sep = _encode(tokenizer, tags.doc_sep)
    no_results = _encode(tokenizer, "no results")
    if tags.multi_query:
        for q, docs in zip(queries, per_query_docs):
            ids.extend(_encode(tokenizer, neutralise(f"query : {q}", specials)))
            for title, text in docs or [(None, None)]:
                ids.extend(sep)
                ids.extend(no_results if title is None else _encode(
                    tokenizer, cap_chars(neutralise(f"{title} : {text}", specials), max_doc_tokens))[:max_doc_tokens])
    else:
        any_doc = False
        for docs in per_query_docs:
            for title, text in docs:
                any_doc = True
                ids.extend(sep)
                ids.extend(_encode(tokenizer, cap_chars(neutralise(f"{title} : {text}", specials),
                                                        max_doc_tokens))[:max_doc_tokens])
        if not any_doc:
            ids.extend(sep)
            ids.extend(no_results)
    ids.extend(_encode(tokenizer, tags.docs_close))
    return ids


def render_invalid(tags: TagSet, tokenizer, style: str = "short", lead: str = "") -> list[int]:
    """Token ids of the message injected after an invalid action (``protocol.on_invalid='message'``).

    Upstream styles: Search-R1's / RAG-R1's text with the protocol's tags (without ``lead``, as
    ``render_documents``). ``short``: a few words of the synthetic world. Injected as a RETRIEVAL segment:
    never trained (loss mask 0).
    """
    if style == "short":
        return _encode(tokenizer, INVALID_SHORT)
    return _encode(tokenizer, _trim_lead(INVALID_MESSAGE.format(qo=tags.query_open, qc=tags.query_close,
                                                                ao=tags.answer_open, ac=tags.answer_close), lead))
