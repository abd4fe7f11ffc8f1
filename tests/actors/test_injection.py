"""Injection-proof text: no question and no retrieved document can produce a special token.

For two tokenizers (the world's word-level one, whose tags, ``<eos>``, ``<bos>``, ``<pad>``, ``<unk>``
are special; GPT-2's byte-level BPE with the tags added, ChatML role markers and a chat template),
every special or added token string the tokenizer itself lists (not ``prompts.special_strings``,
which is what is under test) is put inside a question and inside a document title, text and query
echo, alone and glued to words, through ``render_prompt`` and ``render_documents`` in every prompt
style and template that is valid for a protocol. The special ids of the result must be exactly those
the template writes: the ones the same rendering gives for harmless text.
"""
import itertools

import pytest

from sonar.actors import prompts as P
from sonar.actors import world as W
from sonar.actors.tokenizer import add_tags, build_tokenizer
from sonar.cluster.wire import config as C
from tests.actors.test_real_tokenizer import CHATML, gpt2_tokenizer


@pytest.fixture(scope="module", params=["word", "gpt2_chatml"])
def tok(request, tmp_path_factory):
    if request.param == "word":
        return build_tokenizer(W.build_world(C.WorldConfig(seed=1, num_entities=60)).vocab())
    t = gpt2_tokenizer(tmp_path_factory.mktemp("bpe"), chat=True)
    add_tags(t)
    assert t.chat_template == CHATML
    return t


def special_tokens(tok) -> dict[str, int]:
    """Every special or added token of the tokenizer, as it lists them, with its id."""
    out = {str(t.content): int(i) for i, t in tok.added_tokens_decoder.items()}
    out.update({s: int(tok.convert_tokens_to_ids(s)) for s in tok.all_special_tokens})
    return out


def special_ids_in(tok, ids: list[int]) -> list[int]:
    special = set(special_tokens(tok).values())
    if tok.unk_token_id not in {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}:
        special.discard(tok.unk_token_id)  # the word tokenizer writes <unk> for any unknown word: benign
    return [i for i in ids if i in special]


def combos(tok):
    """(protocol, style, template) for every combination ``check_style`` accepts and the tokenizer can render."""
    for name, style, template in itertools.product(sorted(P.PROTOCOLS), P.PROMPT_STYLES, ("base", "chat")):
        if template == "chat" and not getattr(tok, "chat_template", None):
            continue
        try:
            P.check_style(P.get_protocol(name), style, template)
        except ValueError:
            continue
        yield P.get_protocol(name), style, template


def evil_texts(tok) -> list[str]:
    strings = list(special_tokens(tok))
    return [*strings, *(f"x{s}y" for s in strings), " ".join(strings), "".join(strings)]


def test_the_tokenizers_list_what_must_be_refused(tok):
    """Not vacuous: each listed string encodes to its special id when not neutralised."""
    specials = special_tokens(tok)
    assert set(P.all_special_tokens()) <= set(specials)
    assert {tok.eos_token} <= set(specials)
    if tok.chat_template == CHATML:
        assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(specials)
    for s, i in specials.items():
        assert tok.encode(s, add_special_tokens=False) == [i], s
    assert len(list(combos(tok))) >= 5


def test_no_question_produces_a_special_token(tok):
    for tags, style, template in combos(tok):
        frame = special_ids_in(tok, P.render_prompt(tags, "who founded it ?", tok, template, style))
        for evil in evil_texts(tok):
            got = special_ids_in(tok, P.render_prompt(tags, f"who {evil} founded it ?", tok, template, style))
            assert got == frame, (tags.name, style, template, evil)


def test_no_document_or_query_echo_produces_a_special_token(tok):
    for tags, style, _ in combos(tok):
        def block(text: str) -> list[int]:
            groups = [[(text, f"one {text} two"), ("title", text)], [(text, text)]] if tags.multi_query else \
                [[(text, f"one {text} two"), ("title", text)]]
            queries = [f"q {text}"] * len(groups)
            return P.render_documents(tags, groups, tok, 512, queries=queries, style=style)

        frame = special_ids_in(tok, block("plain"))
        assert frame, (tags.name, style)  # the frame's own tags are there (the check sees special ids)
        for evil in evil_texts(tok):
            assert special_ids_in(tok, block(evil)) == frame, (tags.name, style, evil)


def test_truncated_documents_cannot_rebuild_a_special_token(tok):
    """A document cut at every length: the cut (decode of a prefix) never yields a special id."""
    tags = P.get_protocol("search_r1")
    evil = " ".join(special_tokens(tok))
    frame = special_ids_in(tok, P.render_documents(tags, [[("t", "plain")]], tok, 64, style="search_r1"))
    for n in range(1, 40):
        ids = P.render_documents(tags, [[("t", evil)]], tok, n, style="search_r1")
        assert special_ids_in(tok, ids) == frame, n
