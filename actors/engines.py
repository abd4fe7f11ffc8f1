"""``build_engine``: the one place that chooses and builds a rollout worker's generation engine.

Kinds (``rollout.engine``; the config schema lists the same choices):

    hf     ``HFEngine`` (static batches: one ``generate`` call at a time), or ``ContinuousHFEngine``
           when ``rollout.continuous_batching`` (concurrent calls share decode steps)
    vllm   ``VLLMEngine`` (needs ``model.path``, a Hugging Face directory)

A new kind is one branch in ``_production_engine`` plus its name in the schema's choices.

``wrap`` is the only way code outside production changes the engine (the benchmarks' simulators in
``sonar.bench.sim`` use it: a sleeping engine, long-tailed decode time). It is called once, after the
production engine is built, as ``wrap(engine, cfg=cfg, model=model, tokenizer=tokenizer,
worker_id=worker_id)`` and returns the engine the worker uses (the one it got, a wrapper around it,
or a replacement). It reaches the rollout worker through Ray, so it must be picklable: a top-level
function, or an instance of a top-level class.
"""
from __future__ import annotations

from typing import Any, Callable

from sonar.actors.engine import Engine
from sonar.cluster.wire.config import Config

EngineWrap = Callable[..., Engine]
"""``wrap(engine, *, cfg, model, tokenizer, worker_id) -> Engine`` (see the module docstring)."""


def build_engine(cfg: Config, model: Any, tokenizer: Any, *, worker_id: int = 0,
                 wrap: EngineWrap | None = None, policy_dir: str | None = None) -> Engine:
    """The engine ``cfg.rollout`` describes, around ``model`` (the worker's copy of the policy; the
    vLLM engine loads ``policy_dir``, the Hugging Face directory ``model`` came from, itself), passed
    through ``wrap`` when one is given.

    ``tokenizer`` supplies the EOS id, and decodes for stop strings (tags kept as plain text). ``worker_id`` is handed to ``wrap`` (to seed per-worker draws).
    """
    engine = _production_engine(cfg, model, tokenizer, policy_dir)
    if wrap is None:
        return engine
    return wrap(engine, cfg=cfg, model=model, tokenizer=tokenizer, worker_id=worker_id)


def _production_engine(cfg: Config, model: Any, tokenizer: Any, policy_dir: str | None = None) -> Engine:
    r = cfg.rollout
    if r.engine == "vllm":
        from sonar.actors.engine_vllm import VLLMEngine

        return VLLMEngine.from_model(model, tokenizer, cfg, policy_dir)
    if r.engine == "hf":
        if r.continuous_batching:
            from sonar.actors.engine_continuous import ContinuousHFEngine

            return ContinuousHFEngine(model, eos_token_id=tokenizer.eos_token_id, max_batch=r.max_batch_rows,
                                      tokenizer=tokenizer)
        from sonar.actors.engine import HFEngine

        return HFEngine(model, eos_token_id=tokenizer.eos_token_id, max_batch=r.max_batch_rows,
                        tokenizer=tokenizer)
    raise ValueError(f"rollout.engine={r.engine!r} is not one of ['hf', 'vllm']")
