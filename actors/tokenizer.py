"""Word-level tokenizer built from the synthetic world's closed vocabulary, and the tags for any
Hugging Face tokenizer (``missing_tags`` / ``add_tags``).

Tags with a stock tokenizer (``model.tags``): by default (``text``) nothing here runs: the tags stay
plain text, as upstream R1-Searcher, Search-R1 and RAG-R1 keep them; the tokenizer and the embeddings
are used unchanged and a turn stops on the tag strings (``actors.prompts.stop_plan``). With
``model.tags='special'`` ``add_tags`` adds every protocol tag as a *special* token (one id each,
matched before pre-tokenisation, never split or merged) and ``actors.model.add_tags_to_policy`` gives
the added ids rows at the mean of the trained ones, growing the embedding only when it is too small
(a padded vocabulary such as Qwen's already has rows past ``len(tokenizer)``; shrinking to
``len(tokenizer)`` would drop them and leave the tags on never-trained rows). The policy that every
role loads is then written into the run's policy directory by ``actors.model.materialise_policy``
(the user's model directory is never modified).

Why word level: every name syllable, year and template word is one id, so names are two tokens,
trajectories stay short (tokens cost time on 2 cores) and the vocabulary is tiny: the default world
gives ~200 ids (18 specials, 48 name syllables, 60 years, ~70 template words).

Invariants:
- ids are deterministic: ``<pad>``=0, ``<unk>``=1, ``<bos>``=2, ``<eos>``=3, then every tag of
  ``actors.prompts.all_special_tokens()`` in that order, then the fixed frame words (chat roles),
  then the sorted vocabulary. The same vocabulary always gives the same ids.
- every tag is a special (added) token: exactly one id, matched before pre-tokenisation, never split,
  so the rollout loop stops on the ids of query_close / answer_close (``model.tags`` resolves to
  ``special`` for this tokenizer).
- ``decode`` joins tokens with single spaces and keeps tags (``skip_special_tokens=False``), so
  decoded text is parseable: "<search> foo </search>" decodes to exactly that string.
- ``encode`` adds no BOS/EOS (no post-processor): prompts are built by ``actors.prompts``, which
  encodes with ``add_special_tokens=False`` anyway; the chat template writes ``<bos>`` itself.
"""
from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sonar.actors.prompts import all_special_tokens

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
FRAME_WORDS = ("system", "user", "assistant", ":")
"""Words the chat template writes, present whatever the vocabulary."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
"""Plain-word chat frame ("<bos> user : ... assistant :"): every word is in the vocabulary."""


def missing_tags(tokenizer, tags: Sequence[str] | None = None) -> list[str]:
    """The tags (default: every protocol's, ``prompts.all_special_tokens()``) that do not encode to
    exactly one id of ``tokenizer``, in order."""
    tags = all_special_tokens() if tags is None else list(tags)
    unk = getattr(tokenizer, "unk_token_id", None)
    out = []
    for t in tags:
        ids = list(tokenizer.encode(t, add_special_tokens=False))
        if len(ids) != 1 or (unk is not None and ids[0] == unk):
            out.append(t)
    return out


def add_tags(tokenizer, tags: Sequence[str] | None = None) -> list[str]:
    """Add the missing tags to ``tokenizer`` as special tokens (in place); returns those added.

    Each becomes one id (``len(tokenizer)`` grows by the number added); the caller gives those ids
    embedding rows (``actors.model.add_tags_to_policy``, ``model.tags='special'``). Special, so ``decode(skip_special_tokens=False)``
    keeps them and ``prompts.special_strings`` neutralises them in untrusted text.
    """
    from tokenizers import AddedToken

    missing = missing_tags(tokenizer, tags)
    if missing:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    still = missing_tags(tokenizer, missing)
    if still:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} still splits {still} after adding them as special tokens")
    return missing


def build_tokenizer(vocab: Sequence[str], extra_tags: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` over ``vocab`` (words as the pre-tokenizer splits them).

    Words are lowercased by the normaliser, so ``vocab`` should be lowercase. Unknown words map to
    ``<unk>`` (the world's own text never produces one). ``extra_tags``: more special tokens (the call
    tags of the run's tools, ``actors.tools.tool_tags``), given ids after every word, so the ids of
    a run without them are unchanged.
    """
    extra = [t for t in dict.fromkeys(extra_tags) if t not in all_special_tokens()]
    tags = all_special_tokens() + extra
    specials = [PAD, UNK, BOS, EOS] + all_special_tokens()
    words = [w for w in dict.fromkeys(list(FRAME_WORDS) + sorted(set(vocab))) if w not in specials + extra]
    table = {tok: i for i, tok in enumerate(specials + words + extra)}
    specials = specials + extra

    tok = Tokenizer(models.WordLevel(vocab=table, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # \w+|[^\w\s]+ : words and punctuation runs
    tok.decoder = decoders.WordPiece(prefix="\u0000", cleanup=False)  # space-join, no cleanup
    # Added tokens take the ids already in the table, in order (no new ids are created).
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS,
        extra_special_tokens=tags, chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=4096)
    for t in specials:
        assert fast.convert_tokens_to_ids(t) == table[t], t
    return fast
