"""``build_engine``: the engine ``rollout.*`` describes, and the ``wrap`` hook code outside production uses."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from sonar.actors.engine import HFEngine
from sonar.actors.engine_continuous import ContinuousHFEngine
from sonar.actors.engines import build_engine
from sonar.cluster.wire.config import load_config

TINY = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def policy():
    from sonar.actors.model import policy_and_tokenizer
    from sonar.actors.world import build_world
    from sonar.cluster.wire.config import ModelConfig, WorldConfig

    return policy_and_tokenizer(ModelConfig(), build_world(WorldConfig(num_entities=120)))


def test_hf_kinds_follow_rollout_config(policy):
    model, tok = policy
    static = build_engine(load_config([TINY], ["rollout.max_batch_rows=7"]), model, tok)
    assert type(static) is HFEngine and static.max_batch == 7 and static.eos_token_id == tok.eos_token_id
    cont = build_engine(load_config([TINY], ["rollout.continuous_batching=true", "rollout.max_batch_rows=5"]),
                        model, tok)
    try:
        assert type(cont) is ContinuousHFEngine and cont.max_batch == 5 and cont.eos_token_id == tok.eos_token_id
        assert cont.engine_stats()["engine"] == "hf-continuous"
    finally:
        cont.close()


def test_vllm_kind_is_routed_to_the_vllm_engine(policy, monkeypatch):
    """The branch hands model, tokenizer, config and the policy's directory (vLLM loads it itself) to
    ``VLLMEngine.from_model`` (replaced here: starting vLLM is the vLLM tests' business)."""
    from sonar.actors import engine_vllm

    model, tok = policy
    cfg = load_config([TINY])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm"))
    calls = []
    monkeypatch.setattr(engine_vllm.VLLMEngine, "from_model",
                        classmethod(lambda cls, *a: calls.append(a) or "a vllm engine"))
    assert build_engine(cfg, model, tok, policy_dir="/runs/x/policy") == "a vllm engine"
    assert calls == [(model, tok, cfg, "/runs/x/policy")]


def test_unknown_kind_names_the_field(policy):
    model, tok = policy
    cfg = load_config([TINY])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="bench"))
    with pytest.raises(ValueError, match=r"rollout\.engine='bench'"):
        build_engine(cfg, model, tok)


class Recorder:
    """A picklable wrap (top-level class) that records its call and returns a marker around the engine."""

    def __init__(self):
        self.calls = []

    def __call__(self, engine, **kw):
        self.calls.append((engine, kw))
        return ("wrapped", engine)


def test_wrap_gets_the_production_engine_and_its_context(policy):
    model, tok = policy
    cfg = load_config([TINY])
    wrap = Recorder()
    out = build_engine(cfg, model, tok, worker_id=3, wrap=wrap)
    (engine, kw), = wrap.calls
    assert out == ("wrapped", engine) and type(engine) is HFEngine
    assert kw == {"cfg": cfg, "model": model, "tokenizer": tok, "worker_id": 3}
    assert isinstance(pickle.loads(pickle.dumps(Recorder())), Recorder)  # what Ray will do with it
