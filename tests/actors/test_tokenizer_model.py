"""Word-level tokenizer (tags are single ids, deterministic, save/load) and the tiny policy factory."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sonar.actors import world as W
from sonar.actors.model import build_policy, load_policy, policy_and_tokenizer, save_policy
from sonar.actors.prompts import PROTOCOLS, all_special_tokens
from sonar.actors.tokenizer import build_tokenizer
from sonar.cluster.wire.config import ModelConfig, WorldConfig


@pytest.fixture(scope="module")
def world():
    return W.build_world(WorldConfig())


@pytest.fixture(scope="module")
def tok(world):
    return build_tokenizer(world.vocab())


def test_size_and_fixed_ids(tok):
    assert 150 <= len(tok) <= 700, len(tok)  # default world: ~200 (syllable names, 60 years)
    assert [tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id] == [0, 1, 2, 3]
    tags = all_special_tokens()
    assert [tok.convert_tokens_to_ids(t) for t in tags] == list(range(4, 4 + len(tags)))


def test_deterministic_ids(world, tok):
    again = build_tokenizer(list(reversed(world.vocab())))
    assert again.get_vocab() == tok.get_vocab()


def test_tags_are_single_ids_never_split(tok):
    for t in all_special_tokens():
        ids = tok.encode(f"foo{t}bar {t}", add_special_tokens=False)
        assert ids.count(tok.convert_tokens_to_ids(t)) == 2, (t, ids)
        assert tok.encode(t, add_special_tokens=False) == [tok.convert_tokens_to_ids(t)]


def test_world_text_has_no_unk(world, tok):
    for d in world.corpus[:200]:
        assert tok.unk_token_id not in tok.encode(f"{d['title']} : {d['text']}", add_special_tokens=False)
    for q in world.train[:300]:
        assert tok.unk_token_id not in tok.encode(q.question, add_special_tokens=False)


def test_decode_is_parseable(world, tok):
    name = world.entities[0].name
    for ts in PROTOCOLS.values():
        text = f"{ts.think_open} birthplace {ts.think_close} {ts.query_open} {name} born {ts.query_close}"
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 8  # 4 tags + birthplace + two name syllables + born
        assert tok.decode(ids) == text
    assert tok.decode(tok.encode("Where was X born?", add_special_tokens=False)) == "where was <unk> born ?"


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "question : where was foo born ?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == "user : question : where was <unk> born ? assistant :"


def test_save_load_round_trip(world, tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(again) == len(tok)
    text = " ".join(all_special_tokens()) + " " + world.corpus[5]["text"] + " " + world.train[0].question
    assert again.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert again.decode(ids) == tok.decode(ids)
    msgs = [{"role": "user", "content": world.train[0].question}]
    kw = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
    assert again.apply_chat_template(msgs, **kw) == tok.apply_chat_template(msgs, **kw)


def _weights(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_policy_size_and_ids(tok):
    m = build_policy(ModelConfig(), tok)
    n = sum(p.numel() for p in m.parameters())
    assert 0.3e6 <= n <= 0.8e6, n
    assert m.config.vocab_size == len(tok)
    assert m.get_input_embeddings().weight.data_ptr() == m.get_output_embeddings().weight.data_ptr()
    assert (m.config.pad_token_id, m.config.bos_token_id, m.config.eos_token_id) == (0, 2, 3)
    assert m.generation_config.eos_token_id == 3


def test_policy_deterministic_and_rng_untouched(tok):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = build_policy(ModelConfig(seed=7), tok)
    after = torch.rand(3)
    assert torch.equal(before, after), "build_policy must not consume the caller's RNG"
    b = build_policy(ModelConfig(seed=7), tok)
    c = build_policy(ModelConfig(seed=8), tok)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_save_load_policy(world, tok, tmp_path):
    m = build_policy(ModelConfig(), tok)
    save_policy(m, tok, tmp_path / "p")
    m2, t2 = load_policy(tmp_path / "p")
    x = torch.tensor([tok.encode(world.train[0].question, add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)
    assert t2.encode(world.train[0].question, add_special_tokens=False) == x[0].tolist()
    m3, _ = policy_and_tokenizer(ModelConfig(path=str(tmp_path / "p")), world)
    wa, w3 = _weights(m), _weights(m3)
    assert all(torch.equal(wa[k], w3[k]) for k in wa)
    with pytest.raises(ValueError, match="model.path"):
        load_policy(tmp_path / "missing")


@pytest.mark.parametrize("bars", [True, False])
def test_save_policy_writes_no_progress_bar_and_leaves_the_setting_as_it_was(tok, tmp_path, capsys, bars):
    from transformers.utils import logging as hf_logging

    m = build_policy(ModelConfig(), tok)
    shown = hf_logging.is_progress_bar_enabled()
    try:
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        capsys.readouterr()
        save_policy(m, tok, tmp_path / "p")
        out = capsys.readouterr()
        assert "Writing model shards" not in out.err + out.out
        assert (tmp_path / "p" / "model.safetensors").exists()
        assert hf_logging.is_progress_bar_enabled() is bars
    finally:
        (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
    # the bar this removes is transformers' own (so the test would see it)
    hf_logging.enable_progress_bar()
    try:
        m.save_pretrained(tmp_path / "q")
        assert "Writing model shards" in capsys.readouterr().err
    finally:
        (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()


@pytest.mark.slow  # spawns processes (ranks / a CLI): `make test` runs it, `make test-fast` does not
def test_reload_offline_in_fresh_process(tok, tmp_path):
    save_policy(build_policy(ModelConfig(), tok), tok, tmp_path / "p")
    code = ("import os; os.environ['HF_HUB_OFFLINE']='1';"
            "from transformers import AutoModelForCausalLM, AutoTokenizer;"
            f"m=AutoModelForCausalLM.from_pretrained({str(tmp_path / 'p')!r});"
            f"t=AutoTokenizer.from_pretrained({str(tmp_path / 'p')!r});"
            "print(len(t), sum(p.numel() for p in m.parameters()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == str(len(tok))


def test_policy_and_tokenizer_builds(world):
    m, t = policy_and_tokenizer(ModelConfig(), world)
    assert m.config.vocab_size == len(t)
    ids = torch.tensor([t.encode(world.train[0].question, add_special_tokens=False)])
    with torch.no_grad():
        assert m(ids).logits.shape == (1, ids.shape[1], len(t))


def test_materialised_policy_is_what_every_role_loads(world, tok, tmp_path):
    """The driver writes the initial policy once; the directory reloads with plain transformers to the
    very weights ``build_policy`` gives, and its tokenizer and pad id are the world's."""
    from sonar.actors.model import materialise_policy
    from sonar.cluster.wire.policy import load_policy as wire_load, pad_id

    path = materialise_policy(ModelConfig(seed=3), world, tmp_path / "policy")
    model, t = wire_load(path)
    built = _weights(build_policy(ModelConfig(seed=3), tok))
    assert all(torch.equal(built[k], v) for k, v in _weights(model).items())
    assert t.get_vocab() == tok.get_vocab() and pad_id(model, t) == tok.pad_token_id == 0
    # model.path is used as it is: named, not copied
    assert materialise_policy(ModelConfig(path=path), world, tmp_path / "other") == path
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="model.path"):
        materialise_policy(ModelConfig(path=str(tmp_path / "missing")), world, tmp_path / "x")


def test_the_default_policys_size_is_the_one_the_documents_give():
    """One number per fact (issue 25): the default run's policy (configs/tiny.yaml's world and model) has
    the parameter count README.md gives in parentheses, and every document that rounds it (a size under
    1M: the 4.3M model in actors/model.py is another one) says 0.45M."""
    import re
    from pathlib import Path

    from sonar.cluster.wire.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(["tiny"], [])
    model, _ = policy_and_tokenizer(cfg.model, W.build_world(cfg.world))
    n = sum(p.numel() for p in model.parameters())
    readme = (root / "README.md").read_text()
    stated = re.search(r"a ([0-9.]+)M-parameter policy\s+\(([0-9,]+)\)", readme)
    assert stated, "README.md no longer states the default policy's size as 'a 0.45M-parameter policy (N)'"
    assert int(stated.group(2).replace(",", "")) == n, (stated.group(0), n)
    rounded = f"{n / 1e6:.2f}M"
    assert stated.group(1) + "M" == rounded
    for doc in ("README.md", "configs/tiny.yaml", "actors/model.py"):
        sizes = set(re.findall(r"(0\.[0-9]+)M[- ]param", (root / doc).read_text()))
        assert sizes == {rounded[:-1]}, (doc, sizes)
