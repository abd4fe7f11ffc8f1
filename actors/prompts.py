"""Tag sets and prompt templates: the one place the tag strings live.

Every tag is a special token of the tokenizer (one id each), so the rollout loop stops on token ids
and retrieved text can never open or close a tag once it is neutralised (see ``neutralise``).

Pure module: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass


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
    """Separator between several queries in one search step (multi-query protocols only)."""
    doc_sep: str
    """Separator between documents inside one injected block."""

    @property
    def multi_query(self) -> bool:
        return self.query_sep is not None

    def special_tokens(self) -> list[str]:
        toks = [self.think_open, self.think_close, self.query_open, self.query_close,
                self.docs_open, self.docs_close, self.answer_open, self.answer_close, self.doc_sep]
        if self.query_sep:
            toks.append(self.query_sep)
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
    # RAG-R1 (arXiv 2507.02962) multi-query: several queries in one step, one batched retrieval,
    # the documents of each query grouped in the injected block.
    "rag_r1_multi": TagSet("rag_r1_multi", "<think>", "</think>", "<search>", "</search>",
                           "<information>", "</information>", "<answer>", "</answer>", "<|sep|>", "<|doc|>"),
}


def get_protocol(name: str) -> TagSet:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"protocol.name={name!r} is not one of {sorted(PROTOCOLS)}") from None


def all_special_tokens() -> list[str]:
    """Union over protocols, so one tokenizer serves every protocol."""
    out: list[str] = []
    for ts in PROTOCOLS.values():
        out.extend(ts.special_tokens())
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------- rendering to token ids
# The tokenizer is duck-typed: ``encode(text, add_special_tokens=False) -> list[int]`` and
# ``convert_tokens_to_ids(token) -> int`` (any Hugging Face tokenizer).

INSTRUCTIONS = {
    "r1_searcher": "answer the question . search with {qo} query {qc} , read the documents , then answer in {ao} {ac} .",
    "search_r1": "answer the question . think in {to} {tc} , search with {qo} query {qc} , answer in {ao} {ac} .",
    "rag_r1_multi": ("answer the question . think in {to} {tc} , search with {qo} query {sep} query {qc} , "
                     "answer in {ao} {ac} ."),
}


def instruction(tags: TagSet) -> str:
    return INSTRUCTIONS[tags.name].format(
        to=tags.think_open, tc=tags.think_close, qo=tags.query_open, qc=tags.query_close,
        ao=tags.answer_open, ac=tags.answer_close, sep=tags.query_sep or "")


def neutralise(text: str, specials: list[str]) -> str:
    """Break every special-token string inside untrusted text (retrieved documents, questions).

    Tags are special tokens, so an un-neutralised ``</information>`` inside a document would encode
    to the real closing tag and let retrieved text close (or open) a block. Replacing ``<`` / ``>``
    by look-alikes inside those strings keeps the text readable and makes it encode as plain words.
    """
    for tok in sorted(specials, key=len, reverse=True):
        if tok in text:
            text = text.replace(tok, tok.replace("<", "‹").replace(">", "›").replace("|", "¦"))
    return text


def render_prompt(tags: TagSet, question: str, tokenizer, template: str = "base", short: bool = True) -> list[int]:
    """Prompt token ids. ``short`` drops the instruction (tiny models learn the format by SFT)."""
    question = neutralise(question, all_special_tokens())
    body = f"question : {question}" if short else f"{instruction(tags)} question : {question}"
    if template == "chat":
        # transformers 5 returns a BatchEncoding unless return_dict=False.
        ids = tokenizer.apply_chat_template([{"role": "user", "content": body}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return [int(i) for i in ids]
    return list(tokenizer.encode(body, add_special_tokens=False))


def render_documents(tags: TagSet, per_query_docs: list[list[tuple[str, str]]], tokenizer,
                     max_doc_tokens: int, error: str | None = None) -> list[int]:
    """Token ids of one injected block: docs_open, per query its documents, docs_close.

    ``per_query_docs[i]`` is the (title, text) list of query i, so multi-query steps keep each query's
    documents grouped. A failed or empty search injects the text "no results".
    Retrieval tokens are never trained (segment kind RETRIEVAL), so their exact form only has to match
    between demonstrations and rollouts, which both call this function.
    """
    specials = all_special_tokens()
    ids = [tokenizer.convert_tokens_to_ids(tags.docs_open)]
    sep = tokenizer.convert_tokens_to_ids(tags.doc_sep)
    any_doc = False
    for docs in per_query_docs:
        for title, text in docs:
            any_doc = True
            body = tokenizer.encode(neutralise(f"{title} : {text}", specials), add_special_tokens=False)
            ids.append(sep)
            ids.extend(body[:max_doc_tokens])
    if not any_doc:
        ids.append(sep)
        ids.extend(tokenizer.encode("no results", add_special_tokens=False))
    ids.append(tokenizer.convert_tokens_to_ids(tags.docs_close))
    return ids
