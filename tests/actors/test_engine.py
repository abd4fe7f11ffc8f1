"""HFEngine: sampled logprobs equal a teacher-forced recomputation, the KV-cached loop equals a
no-cache reference, stop/length handling with left padding, and the weight-swap contract."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from sonar.actors.engine import Engine, HFEngine, ParamSpec, SamplingParams
from tests.waiting import DEADLINE_S, WaiterCountingLock, wait_until

VOCAB = 50


def tiny_model(seed: int = 0, init: float = 0.2, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, initializer_range=init)
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [np.array([3, 4, 5, 6, 7, 8, 9], dtype=np.int32), np.array([10], dtype=np.int32),
           np.array([11, 12, 13], dtype=np.int32), np.array([20, 21, 22, 23, 24], dtype=np.int32)]


def teacher_forced_logprobs(model, prompt: np.ndarray, gen: np.ndarray, T: float) -> np.ndarray:
    """Full unpadded forward over prompt+generation: log_softmax(logits / T) of each generated token."""
    full = torch.tensor(np.concatenate([prompt, gen]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=full).logits[0].float()
    n = len(prompt)
    lp = torch.log_softmax(logits[n - 1:-1] / T, dim=-1)
    return lp.gather(-1, torch.as_tensor(gen, dtype=torch.long)[:, None]).squeeze(-1).numpy()


def test_hfengine_satisfies_protocol():
    eng = HFEngine(tiny_model(), eos_token_id=None)
    assert isinstance(eng.version, int)
    for name in ("generate", "load_weights", "parameter_specs", "state_checksum"):
        assert callable(getattr(eng, name)) and hasattr(Engine, name)


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_sampled_logprobs_match_teacher_forcing(T):
    model = tiny_model()
    eng = HFEngine(model, eos_token_id=None, max_batch=3)  # 2 chunks: chunking + sorting covered
    gens = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=T, seed=1))
    assert len(gens) == len(PROMPTS)
    for p, g in zip(PROMPTS, gens):
        assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
        assert g.token_ids.shape == g.logprobs.shape == (12,)
        ref = teacher_forced_logprobs(model, p, g.token_ids, T)
        np.testing.assert_allclose(g.logprobs, ref, atol=1e-5, rtol=0)


def test_greedy_logprobs_are_temperature_one():
    model = tiny_model()
    eng = HFEngine(model, eos_token_id=None)
    gens = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    for p, g in zip(PROMPTS, gens):
        np.testing.assert_allclose(g.logprobs, teacher_forced_logprobs(model, p, g.token_ids, 1.0), atol=1e-5)


def greedy_reference(model, prompt: np.ndarray, max_new: int, stop: set[int]) -> list[int]:
    """No cache, no padding: full forward each step."""
    ids = [int(t) for t in prompt]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor(ids)[None], use_cache=False).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if tok in stop:
                break
    return out


def test_kv_cached_greedy_equals_no_cache_reference():
    model = tiny_model(seed=1)
    eng = HFEngine(model, eos_token_id=None)
    gens = eng.generate(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0.0))
    for p, g in zip(PROMPTS, gens):
        assert g.token_ids.tolist() == greedy_reference(model, p, 20, set())
        assert g.finish == "length" and g.stop_token_id is None


def test_stop_tokens_length_and_left_padding():
    model = tiny_model(seed=2)
    eng = HFEngine(model, eos_token_id=None)
    stop = tuple(range(0, VOCAB, 3))  # a third of the vocabulary: most rows stop early, some do not
    gens = eng.generate(PROMPTS * 4, SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=stop, seed=3))
    finishes = {g.finish for g in gens}
    assert finishes == {"stop", "length"}, finishes
    for p, g in zip(PROMPTS * 4, gens):
        toks = g.token_ids.tolist()
        if g.finish == "stop":
            assert toks[-1] in stop and g.stop_token_id == toks[-1]
            assert not any(t in stop for t in toks[:-1])
            assert 1 <= len(toks) <= 8
        else:
            assert len(toks) == 8 and not any(t in stop for t in toks) and g.stop_token_id is None
        # the rows that stopped early left the batch; the rest still match teacher forcing
        np.testing.assert_allclose(g.logprobs, teacher_forced_logprobs(model, p, g.token_ids, 1.0), atol=1e-5)

    # greedy: stopping on the reference's 3rd token truncates exactly there (stop token included)
    for p in PROMPTS:
        ref = greedy_reference(model, p, 10, set())
        s = ref[2]
        g = eng.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(s,)))[0]
        assert g.token_ids.tolist() == ref[:ref.index(s) + 1] and g.finish == "stop"


def test_eos_from_constructor_stops():
    model = tiny_model(seed=2)
    first = greedy_reference(model, PROMPTS[0], 1, set())[0]
    eng = HFEngine(model, eos_token_id=first)
    g = eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
    assert g.token_ids.tolist() == [first] and g.finish == "stop" and g.stop_token_id == first


def test_per_prompt_caps_and_zero_tokens():
    model = tiny_model()
    eng = HFEngine(model, eos_token_id=None)
    gens = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0),
                        max_new_tokens_per_prompt=[0, 2, 9, 6])
    assert [len(g.token_ids) for g in gens] == [0, 2, 6, 6]
    assert gens[0].finish == "length" and gens[0].logprobs.shape == (0,)
    full = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert gens[1].token_ids.tolist() == full[1].token_ids[:2].tolist()
    with pytest.raises(ValueError):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=6), max_new_tokens_per_prompt=[1])
    with pytest.raises(ValueError, match="empty"):
        eng.generate([np.array([], dtype=np.int32)], SamplingParams(max_new_tokens=2))
    assert eng.generate([], SamplingParams(max_new_tokens=2)) == []


def test_seed_reproducible_and_top_p():
    model = tiny_model()
    eng = HFEngine(model, eos_token_id=None)
    a = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=7))
    b = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=7))
    c = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=8))
    assert all((x.token_ids == y.token_ids).all() for x, y in zip(a, b))
    assert any((x.token_ids != y.token_ids).any() for x, y in zip(a, c))
    # top_p truncates the sampler only: logprobs are still the full temperature-scaled distribution
    g = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.5, seed=7))
    for p, x in zip(PROMPTS, g):
        np.testing.assert_allclose(x.logprobs, teacher_forced_logprobs(model, p, x.token_ids, 0.7), atol=1e-5)
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=2, top_p=0.0))


def test_load_weights_changes_outputs_and_bumps_version():
    eng = HFEngine(tiny_model(seed=0), eos_token_id=None)
    other = tiny_model(seed=5)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = eng.generate(PROMPTS, params)
    assert all(g.version == 0 for g in before)
    assert eng.state_checksum() != pytest.approx(HFEngine(other, None).state_checksum(), rel=1e-9)

    eng.load_weights(other.named_parameters(), version=3)
    assert eng.version == 3
    after = eng.generate(PROMPTS, params)
    assert all(g.version == 3 for g in after)
    assert any(x.token_ids.tolist() != y.token_ids.tolist() for x, y in zip(before, after))
    assert eng.state_checksum() == pytest.approx(HFEngine(other, None).state_checksum(), rel=1e-9)
    assert [g.token_ids.tolist() for g in after] == [greedy_reference(other, p, 12, set()) for p in PROMPTS]


def test_load_weights_rejects_bad_names_and_shapes_atomically():
    eng = HFEngine(tiny_model(seed=0), eos_token_id=None)
    ck = eng.state_checksum()
    good = [(n, torch.zeros_like(p)) for n, p in eng.model.named_parameters()]
    with pytest.raises(ValueError, match="model.bogus.weight"):
        eng.load_weights(good + [("model.bogus.weight", torch.zeros(2))], version=1)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(32,\).*\(31,\)"):
        eng.load_weights(good[:-1] + [("model.norm.weight", torch.zeros(31))], version=1)
    assert eng.version == 0 and eng.state_checksum() == ck  # nothing was copied
    # a tied model accepts the alias lm_head.weight (same tensor as the embedding)
    emb = torch.randn(VOCAB, 32)
    eng.load_weights([("lm_head.weight", emb)], version=2)
    assert torch.equal(eng.model.model.embed_tokens.weight, emb) and eng.version == 2


def test_parameter_specs_order_and_tied_embeddings_once():
    model = tiny_model(tie=True)
    specs = HFEngine(model, None).parameter_specs()
    assert [s.name for s in specs] == [n for n, _ in model.named_parameters()]
    assert sum(s.name in ("lm_head.weight", "model.embed_tokens.weight") for s in specs) == 1
    assert all(isinstance(s, ParamSpec) and s.dtype == torch.float32 for s in specs)
    untied = HFEngine(tiny_model(tie=False), None).parameter_specs()
    assert "lm_head.weight" in [s.name for s in untied] and len(untied) == len(specs) + 1
    model.model.norm.weight.requires_grad_(False)
    assert "model.norm.weight" not in [s.name for s in HFEngine(model, None).parameter_specs()]


def test_weights_never_change_inside_generate():
    """load_weights waits for the lock that generate holds."""
    eng = HFEngine(tiny_model(), eos_token_id=None)
    new = [(n, torch.zeros_like(p)) for n, p in eng.model.named_parameters()]
    eng._lock = WaiterCountingLock()
    eng._lock.acquire()  # stands in for a generate call in progress
    t = threading.Thread(target=eng.load_weights, args=(new, 9))
    t.start()
    wait_until(lambda: eng._lock.waiting == 1 or eng.version != 0, what="load_weights to wait for the lock")
    assert t.is_alive() and eng.version == 0
    eng._lock.release()
    t.join(DEADLINE_S)
    assert not t.is_alive() and eng.version == 9


@pytest.mark.parametrize("T,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.6)])
def test_sampler_draws_from_the_temperature_scaled_distribution(T, top_p):
    """Frequencies of 40k draws match softmax(logits / T) (renormalised nucleus when top_p < 1)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(40_000, 1)
    g = torch.Generator().manual_seed(0)
    tok, lp = HFEngine._sample(logits, T, top_p, g)
    p = torch.softmax(logits[0] / T, -1)
    np.testing.assert_allclose(lp.numpy(), torch.log(p)[tok].numpy(), atol=1e-6)  # full-distribution logprob
    if top_p < 1.0:
        keep = (torch.cumsum(p, 0) - p) < top_p
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum()
    freq = torch.bincount(tok, minlength=6).double() / len(tok)
    np.testing.assert_allclose(freq.numpy(), p.double().numpy(), atol=0.01)
