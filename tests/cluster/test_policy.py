"""The policy directory every role loads (cluster/wire/policy.py): an exact round trip, and the pad id
taken from the tokenizer or the model config, never from elsewhere."""
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sonar.actors import world as W
from sonar.actors.tokenizer import build_tokenizer
from sonar.cluster.wire.config import WorldConfig
from sonar.cluster.wire.policy import load_policy, load_tokenizer, pad_id, save_policy


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(W.build_world(WorldConfig(num_entities=40)).vocab())


def test_round_trip_is_bit_exact(tok, tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True))
    save_policy(model, tok, tmp_path / "p")
    loaded, t = load_policy(tmp_path / "p")
    assert not loaded.training and next(loaded.parameters()).dtype == torch.float32
    a, b = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert t.get_vocab() == tok.get_vocab() == load_tokenizer(tmp_path / "p").get_vocab()


def test_layout_only_load_gives_the_same_names_shapes_and_dtypes_without_weights(tok, tmp_path):
    """What a vLLM rollout worker loads: the layout the broadcast digests, on the meta device."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True))
    save_policy(model, tok, tmp_path / "p")
    full, _ = load_policy(tmp_path / "p")
    meta, t = load_policy(tmp_path / "p", weights=False)
    spec = lambda m: [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]  # noqa: E731
    assert spec(meta) == spec(full)
    assert all(p.is_meta for p in meta.parameters()) and not any(p.is_meta for p in full.parameters())
    assert t.get_vocab() == tok.get_vocab()


def test_not_a_model_directory_names_it(tmp_path):
    for load in (load_policy, load_tokenizer):
        with pytest.raises(ValueError, match=f"{tmp_path.name}.*no config.json"):
            load(tmp_path)


@pytest.mark.parametrize("tok_pad, cfg_pad, tok_eos, cfg_eos, expected", [
    (5, 6, 7, 8, 5),            # the tokenizer's pad first
    (None, 6, 7, 8, 6),         # then the model config's
    (None, None, 7, 8, 7),      # then EOS (tokenizer, config)
    (None, None, None, [9, 10], 9),  # a config may list several EOS ids
])
def test_pad_id_order(tok_pad, cfg_pad, tok_eos, cfg_eos, expected):
    model = SimpleNamespace(config=SimpleNamespace(pad_token_id=cfg_pad, eos_token_id=cfg_eos))
    assert pad_id(model, SimpleNamespace(pad_token_id=tok_pad, eos_token_id=tok_eos)) == expected


def test_no_pad_and_no_eos_is_an_error():
    none = SimpleNamespace(pad_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match="pad_token_id"):
        pad_id(SimpleNamespace(config=none), none)
