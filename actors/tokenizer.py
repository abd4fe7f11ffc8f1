"""Word-level tokenizer built from the synthetic world's closed vocabulary.

Why word level: every name syllable, year and template word is one id, so names are two tokens,
trajectories stay short (tokens cost time on 2 cores) and the vocabulary is tiny: the default world
gives ~200 ids (18 specials, 48 name syllables, 60 years, ~70 template words).

Invariants:
- ids are deterministic: ``<pad>``=0, ``<unk>``=1, ``<bos>``=2, ``<eos>``=3, then every tag of
  ``actors.prompts.all_special_tokens()`` in that order, then the fixed frame words (chat roles),
  then the sorted vocabulary. The same vocabulary always gives the same ids.
- every tag is a special (added) token: exactly one id, matched before pre-tokenisation, never split,
  so the rollout loop can stop on the ids of query_close / answer_close.
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


def build_tokenizer(vocab: Sequence[str]) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` over ``vocab`` (words as the pre-tokenizer splits them).

    Words are lowercased by the normaliser, so ``vocab`` should be lowercase. Unknown words map to
    ``<unk>`` (the world's own text never produces one).
    """
    tags = all_special_tokens()
    specials = [PAD, UNK, BOS, EOS] + tags
    words = [w for w in dict.fromkeys(list(FRAME_WORDS) + sorted(set(vocab))) if w not in specials]
    table = {tok: i for i, tok in enumerate(specials + words)}

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
