"""Nucleus sampling (``rollout.top_p``) in the transformers engines, and the config reaching them.

What is pinned: with top_p < 1 every sampled token lies in its own row's nucleus at its own step (the
smallest set of most likely tokens whose probability under softmax(logits / T) reaches top_p); the
recorded logprob stays log_softmax(logits / T) over the full vocabulary (what the learner recomputes);
a top_p so small that the nucleus is one token gives exactly the greedy tokens; top_p = 1 is the
unchanged full-distribution sampler. And the rollout worker hands ``rollout.top_p`` to the engine.
"""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sonar.actors.engine import HFEngine, SamplingParams
from sonar.actors.engine_continuous import ContinuousHFEngine

from .test_engine import PROMPTS, teacher_forced_logprobs, tiny_model


def _step_logits(model, prompt: np.ndarray, gen: np.ndarray) -> torch.Tensor:
    """[n, V] float32 logits that produced each generated token (one unpadded forward)."""
    full = torch.tensor(np.concatenate([prompt, gen]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=full).logits[0].float()
    return logits[len(prompt) - 1:-1]


def _outside_nucleus(model, prompt, gen, T: float, top_p: float) -> int:
    """How many generated tokens fall outside their step's nucleus of mass top_p (closed form)."""
    if len(gen) == 0:
        return 0
    p = torch.softmax(_step_logits(model, prompt, gen) / T, dim=-1)          # [n, V]
    sp, si = p.sort(dim=-1, descending=True)
    keep_sorted = (sp.cumsum(-1) - sp) < top_p                               # the crossing token included
    keep = torch.zeros_like(keep_sorted).scatter(-1, si, keep_sorted)
    tok = torch.as_tensor(gen, dtype=torch.long)[:, None]
    return int((~keep.gather(-1, tok)).sum())


def _greedy(eng, n: int):
    return eng.generate(PROMPTS, SamplingParams(max_new_tokens=n, temperature=0.0))


@pytest.fixture(params=["static", "continuous"])
def engine_of(request):
    made: list = []

    def make(model):
        if request.param == "static":
            eng = HFEngine(model, eos_token_id=None, max_batch=3)  # 2 chunks
        else:
            eng = ContinuousHFEngine(model, eos_token_id=None, max_batch=3)  # rows queue and join
            made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def test_top_p_samples_only_from_each_rows_nucleus(engine_of):
    model = tiny_model(seed=3, init=0.5)
    eng = engine_of(model)
    T, top_p, n = 1.0, 0.5, 16
    outside_full = 0
    for seed in range(4):
        gens = eng.generate(PROMPTS, SamplingParams(max_new_tokens=n, temperature=T, top_p=top_p, seed=seed))
        for p, g in zip(PROMPTS, gens):
            assert _outside_nucleus(model, p, g.token_ids, T, top_p) == 0
            # the recorded logprob is the full temperature-scaled distribution's, not the nucleus's
            np.testing.assert_allclose(g.logprobs, teacher_forced_logprobs(model, p, g.token_ids, T), atol=1e-4)
        full = eng.generate(PROMPTS, SamplingParams(max_new_tokens=n, temperature=T, top_p=1.0, seed=seed))
        outside_full += sum(_outside_nucleus(model, p, g.token_ids, T, top_p) for p, g in zip(PROMPTS, full))
    # the check has teeth: the untruncated sampler does leave these nuclei
    assert outside_full > 0


def test_a_one_token_nucleus_is_greedy(engine_of):
    model = tiny_model(seed=4, init=0.5)
    eng = engine_of(model)
    greedy = _greedy(eng, 12)
    tiny = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.8, top_p=1e-6, seed=5))
    for p, g, s in zip(PROMPTS, greedy, tiny):
        assert s.token_ids.tolist() == g.token_ids.tolist()
        # greedy records the T = 1 logprob; the sampler at T = 0.8 records the T = 0.8 one
        np.testing.assert_allclose(s.logprobs, teacher_forced_logprobs(model, p, s.token_ids, 0.8), atol=1e-4)


def test_top_p_one_is_the_full_distribution_sampler(engine_of):
    """top_p = 1 takes no truncation branch: the same seed gives the same tokens as the default params,
    and a model whose nucleus at 0.999 would differ still samples tokens outside it."""
    model = tiny_model(seed=5, init=0.5)
    eng = engine_of(model)
    a = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.9, seed=11))
    b = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.9, top_p=1.0, seed=11))
    assert [g.token_ids.tolist() for g in a] == [g.token_ids.tolist() for g in b]
    if isinstance(eng, HFEngine) and not isinstance(eng, ContinuousHFEngine):  # alone: bit-reproducible
        np.testing.assert_array_equal(np.concatenate([g.logprobs for g in a]), np.concatenate([g.logprobs for g in b]))


def test_sampler_top_p_one_equals_the_exponential_race_over_the_full_distribution():
    """Closed form of ``_sample`` at top_p = 1: argmax_j p_j / E_j with E ~ Exp(1) from the same stream."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    tok, lp = HFEngine._sample(logits, 0.7, 1.0, torch.Generator().manual_seed(3))
    p = torch.softmax(logits / 0.7, -1)
    e = torch.empty_like(p).exponential_(generator=torch.Generator().manual_seed(3))
    assert torch.equal(tok, (p / e).argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1))


def test_concurrent_calls_keep_their_own_top_p():
    """Continuous engine: a call with a one-token nucleus shares decode steps with a full-distribution
    call and still gets exactly the greedy tokens; the other call's logprobs stay exact."""
    model = tiny_model(seed=6, init=0.5)
    ref = HFEngine(model, eos_token_id=None)
    greedy = _greedy(ref, 14)
    eng = ContinuousHFEngine(model, eos_token_id=None, max_batch=8)
    try:
        out: dict = {}
        start = threading.Barrier(2)

        def call(name, params):
            start.wait()
            out[name] = eng.generate(PROMPTS, params)

        ts = [threading.Thread(target=call, args=("nucleus", SamplingParams(14, temperature=1.0, top_p=1e-6, seed=1))),
              threading.Thread(target=call, args=("full", SamplingParams(14, temperature=1.0, top_p=1.0, seed=2)))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts)
        assert [g.token_ids.tolist() for g in out["nucleus"]] == [g.token_ids.tolist() for g in greedy]
        for p, g in zip(PROMPTS, out["full"]):
            np.testing.assert_allclose(g.logprobs, teacher_forced_logprobs(model, p, g.token_ids, 1.0), atol=1e-4)
    finally:
        eng.close()


# ---------------------------------------------------------------- the config reaches the engine

class _RecordingEngine:
    """Answers every prompt at once; records the SamplingParams of each call."""

    version = 0

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.params: list[SamplingParams] = []

    def generate(self, prompts, params, max_new_tokens_per_prompt=None):
        from sonar.actors.engine import Generation

        self.params.append(params)
        ids = self.tok.encode("<answer> paris </answer>", add_special_tokens=False)
        return [Generation(np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop", 0, ids[-1])
                for _ in prompts]


@pytest.mark.parametrize("top_p", [0.7, 1.0])
def test_rollout_worker_passes_rollout_top_p_to_the_engine(top_p):
    from sonar.actors.prompts import get_protocol
    from sonar.actors.rollout import PromptItem
    from sonar.actors.worker import _arollout
    from sonar.cluster.wire.config import load_config

    from .test_rollout import TOK

    cfg = load_config([], [f"rollout.top_p={top_p}", "rollout.group_size=2"])
    engine = _RecordingEngine(TOK)
    w = SimpleNamespace(engine=engine, retriever=None, tokenizer=TOK, tags=get_protocol(cfg.protocol.name),
                        cfg=cfg, worker_id=0, tools=[])
    items = [PromptItem("q0", "what is the capital of france", ["paris"])]
    groups, _ = asyncio.run(_arollout(w, items, 0, cfg.stages[0], cfg.rollout.temperature, search_enabled=False))
    assert len(groups[0]) == 2
    assert [p.top_p for p in engine.params] == [top_p]
    assert engine.params[0].temperature == cfg.rollout.temperature
