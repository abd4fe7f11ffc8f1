"""How the simulators enter production: ``sim_hooks(SimConfig)`` -> the driver's ``Hooks``, applied by the
production factories (``build_engine``'s ``wrap``, ``build_retriever``'s ``wrap_backend``). Fast, no Ray."""
from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from sonar.actors.engine import HFEngine
from sonar.actors.engine_continuous import ContinuousHFEngine
from sonar.actors.engines import build_engine
from sonar.bench.sim.bench_engine import BenchEngine
from sonar.bench.sim.config import SimConfig, load_bench_config, split_overrides
from sonar.bench.sim.decode_latency import DecodeLatencyEngine
from sonar.bench.sim.hooks import SimEngineWrap, SimRetrieverWrap, sim_hooks
from sonar.bench.sim.paced_engine import PacedContinuousHFEngine
from sonar.bench.sim.retrieval_latency import LatencyInjectingRetriever
from sonar.cluster.driver.roles import Hooks
from sonar.cluster.wire.config import CONFIG_DIR, load_config

TINY = "configs/tiny.yaml"
DECODE = SimConfig(decode_ms_per_token=3.0, decode_median_tokens=5, decode_sigma=0.2, decode_max_tokens=40)


@pytest.fixture(scope="module")
def policy():
    from sonar.actors.model import policy_and_tokenizer
    from sonar.actors.world import build_world
    from sonar.cluster.wire.config import ModelConfig, WorldConfig

    return policy_and_tokenizer(ModelConfig(), build_world(WorldConfig(num_entities=120)))


def engine_for(policy, overrides, sim, worker_id=2):
    model, tok = policy
    cfg = load_config([TINY], overrides)
    return cfg, build_engine(cfg, model, tok, worker_id=worker_id, wrap=sim_hooks(sim).engine_wrap)


# ------------------------------------------------------------------------------------ hooks
def test_nothing_simulated_means_no_hooks():
    assert sim_hooks(SimConfig()) == Hooks()
    assert sim_hooks(SimConfig(retrieval_latency_sigma=0.5, decode_sigma=2.0)) == Hooks()  # shapes alone: nothing


def test_static_engine_gets_the_decode_latency_wrapper(policy):
    cfg, eng = engine_for(policy, [], DECODE)
    assert type(eng) is DecodeLatencyEngine and type(eng.inner) is HFEngine
    assert (eng.ms_per_token, eng.median_tokens, eng.sigma, eng.max_tokens) == (3.0, 5.0, 0.2, 40)
    # per-worker seed run.seed * 1009 + worker: the same draws as a wrapper built with it
    ref = DecodeLatencyEngine(HFEngine(policy[0], None), 3.0, 5, 0.2, 40, seed=cfg.run.seed * 1009 + 2)
    assert eng.draw_tokens(50).tolist() == ref.draw_tokens(50).tolist()


def test_continuous_engine_is_replaced_by_the_paced_one(policy):
    cfg, eng = engine_for(policy, ["rollout.continuous_batching=true", "rollout.max_batch_rows=9"], DECODE)
    try:
        assert type(eng) is PacedContinuousHFEngine and eng.max_batch == 9 and eng.step_ms == 3.0
        assert (eng.lengths.median_tokens, eng.lengths.sigma, eng.lengths.max_tokens) == (5.0, 0.2, 40)
    finally:
        eng.close()


def test_bench_engine_replaces_generation(policy):
    cfg, eng = engine_for(policy, [], SimConfig(engine="bench", token_ms=0.5), worker_id=1)
    assert type(eng) is BenchEngine and eng.token_ms == 0.5 and eng.seed == cfg.run.seed * 101 + 1
    assert eng.model is policy[0]  # the real policy: the weight path stays production's


def test_decode_off_leaves_the_production_engine(policy):
    wrap = SimEngineWrap(SimConfig(retrieval_latency_ms=5.0))
    model, tok = policy
    eng = build_engine(load_config([TINY]), model, tok, wrap=wrap)
    assert type(eng) is HFEngine


def test_hooks_survive_pickling(policy):
    """Ray pickles the hooks into the workers and retrieval replicas."""
    sim = dataclasses.replace(DECODE, retrieval_latency_ms=7.0, retrieval_latency_sigma=0.3)
    hooks = pickle.loads(pickle.dumps(sim_hooks(sim)))
    assert isinstance(hooks.engine_wrap, SimEngineWrap) and hooks.engine_wrap.sim == sim
    assert isinstance(hooks.retriever_wrap, SimRetrieverWrap)
    r = hooks.retriever_wrap(object())
    assert isinstance(r, LatencyInjectingRetriever) and (r.median_ms, r.sigma) == (7.0, 0.3)


# ------------------------------------------------------------------------------------ config
def test_bench_yaml_splits_into_production_and_sim():
    cfg, sim = load_bench_config([CONFIG_DIR / "bench.yaml"], ["sim.decode_sigma=0.5", "rollout.num_workers=3"])
    assert cfg.rollout.num_workers == 3 and cfg.rollout.continuous_batching
    assert sim == SimConfig(decode_ms_per_token=10.0, decode_median_tokens=16.0, decode_sigma=0.5,
                            decode_max_tokens=256, retrieval_latency_ms=100.0, retrieval_latency_sigma=0.8)
    with pytest.raises(Exception, match="sim"):
        load_config([CONFIG_DIR / "bench.yaml"])  # production alone refuses the section


def test_split_overrides():
    assert split_overrides(["a.b=1", "sim.token_ms=3", "simulate=1"]) == (["a.b=1", "simulate=1"], ["token_ms=3"])


@pytest.mark.parametrize("overrides, match", [
    (["sim.engine=fast"], r"sim\.engine='fast'"),
    (["sim.token_ms=-1"], r"sim\.token_ms=-1"),
    (["sim.retrieval_latency_ms=.nan"], r"sim\.retrieval_latency_ms=nan"),
    (["sim.retrieval_latency_sigma=-0.1"], r"sim\.retrieval_latency_sigma"),
    (["sim.tokn_ms=1"], r"tokn_ms"),
    (["sim.token_ms=fast"], r"sim\.token_ms=fast"),
    (["sim.engine=bench", "rollout.continuous_batching=true"], r"rollout\.continuous_batching"),
])
def test_bad_sim_settings_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_bench_config([TINY], overrides)


def test_bad_key_in_a_sim_section_names_the_file(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text(json.dumps({"sim": {"decode_ms": 1}}))
    with pytest.raises(ValueError, match=r"mine\.yaml.*decode_ms"):
        load_bench_config([p])
    p.write_text(json.dumps({"rollout": {"nope": 1}, "sim": {"token_ms": 1}}))
    with pytest.raises(ValueError, match=str(p).replace(".", r"\.")):  # the user's file, not the stripped copy
        load_bench_config([p])
