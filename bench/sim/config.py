"""``SimConfig``: the benchmark-only settings of the simulators, and how a benchmark loads them.

A benchmark config file (``configs/bench.yaml``) is a production config plus a ``sim:`` section. The
production schema (``sonar.cluster.wire.config``) has no simulation knobs, so ``load_bench_config``
splits the two: the production part goes through ``load_config`` as it is (the ``sim:`` sections
removed), the ``sim:`` sections and the ``sim.KEY=VALUE`` overrides become a ``SimConfig``. A
benchmark's ``--set`` therefore takes both kinds of override (``--set sim.decode_ms_per_token=0``).

All defaults simulate nothing: a config without a ``sim:`` section runs production as it is.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

SECTION = "sim"
ENGINES = ("real", "bench")
DECODE_COSTS = ("flat", "gpu_7b")
PREFILL_COSTS = ("none", "gpu_7b")
LEARNER_COSTS = ("none", "flops_7b")


@dataclass(frozen=True)
class SimConfig:
    """What the benchmarks simulate around the real system (``sonar.bench.sim.hooks`` applies it)."""

    engine: str = "real"
    """real: the engine ``rollout.*`` describes generates (``decode_*`` below may add a larger model's
    decode time). bench: ``BenchEngine`` (``bench_engine.py``) replaces it: it sleeps ``token_ms`` per
    token of each call's longest row and writes protocol-shaped turns without running the model, so
    rewards and logprobs are meaningless. bench needs rollout.engine=hf and
    rollout.continuous_batching=false (it serialises its calls)."""
    token_ms: float = 2.0
    """engine=bench: simulated decode time per generated token, in ms (>= 0); the rows of one call
    decode together, so a call sleeps ``token_ms`` x its longest row."""
    decode_ms_per_token: float = 0.0
    """engine=real: one decode step of a real-size policy, in ms (>= 0; 0 simulates nothing). Every
    turn of every trajectory also reasons for a long-tailed number of hidden tokens (below), each one
    decode step, before it returns. A static engine is wrapped in ``DecodeLatencyEngine`` (a call
    sleeps for its longest row, ``decode_latency.py``); the continuous engine is replaced by
    ``PacedContinuousHFEngine`` (every step lasts this long, and a hidden token holds a batch slot,
    ``paced_engine.py``). The hidden tokens are not returned and not trained."""
    decode_cost: str = "flat"
    """What a simulated decode step costs. flat: ``decode_ms_per_token`` per step whatever the batch (an
    assumption, kept as the default so earlier results stay comparable). gpu_7b: ``t(rows, ctx) = t0 +
    a*rows + b*sum(ctx)/1000`` ms, fitted to published vLLM measurements of a 7B model on one H100
    (``gpu_cost.py``, which cites them); it turns the simulation on by itself and ignores
    ``decode_ms_per_token``. Every result names the model it ran under (``gpu_cost.sim_cost_label``)."""
    learner_delay_ms: float = 0.0
    """SIMULATED extra learner time per RL step, in ms (>= 0; 0 simulates nothing): the driver waits this
    long after every logged RL step (its ``on_step`` hook) before it asks for the next one, as if the
    learner's step took that much longer. ``sonar bench sensitivity`` varies it to change the learner's
    share of a step."""
    decode_median_tokens: float = 16.0
    """Median of the lognormal hidden reasoning length per turn, in tokens (1 <= median <= max)."""
    decode_sigma: float = 0.7
    """Lognormal sigma of the hidden reasoning length (>= 0; 0: always the median)."""
    decode_max_tokens: int = 256
    """Hidden reasoning lengths are clipped to this (the turn budget a real model would hit)."""
    retrieval_latency_ms: float = 0.0
    """Median extra latency of every backend search call, in ms (lognormal; >= 0, 0 simulates
    nothing): a remote search cluster in front of the local index (``retrieval_latency.py``). It sits
    below the reranker and the cache, so cache hits stay fast."""
    retrieval_latency_sigma: float = 0.0
    """Lognormal sigma of the extra search latency (>= 0; 0: always the median)."""
    retrieval_servers: int = 0
    """Requests the simulated search cluster serves at once (>= 0; 0: unbounded, latency never grows with
    load). A request beyond that queues for a free server (``retrieval_latency.py``)."""
    retrieval_per_query_ms: float = 0.0
    """Simulated service time per query of a batched request, in ms, on top of the lognormal draw (>= 0)."""
    prefill_cost: str = "none"
    """Prompt processing, with a simulated decode: none (not charged, as before) or gpu_7b (``gpu_cost.
    Prefill7BCost``, fitted to the same published run as the decode model): charged for every admitted
    prompt and for the KV recompute of the rows in flight after each weight swap (``paced_engine.py``)."""
    context_scale: float = 1.0
    """With a simulated decode, each real context token (prompt, retrieved text, the tiny policy's tokens)
    counts this many in the cost models (>= 1), so the tiny policy's short contexts stand for a real job's."""
    learner_cost: str = "none"
    """SIMULATED learner time, placed before the weights go out (the driver's ``on_learner_step`` hook):
    none (the real CPU learner's own time, as before), or flops_7b: a step lasts at least
    ``(6N x learner_updates + 2N x learner_forwards) x tokens / (learner_gpus x learner_mfu x 989.4 TFLOPS)``
    with N = 7.25e9 and tokens = ``context_scale`` x the tiny-world tokens of the trajectories it trained +
    ``learner_hidden_tokens_per_traj`` for each (``hooks.LearnerTime``; ``reference.learner_step_s``, which
    states the sources)."""
    learner_gpus: int = 1
    """flops_7b: the GPUs the simulated learner trains on (>= 1)."""
    learner_mfu: float = 0.4
    """flops_7b: the simulated learner's model-FLOPs utilisation (0 < mfu <= 1)."""
    colocated: bool = False
    """flops_7b: the colocated layout (the ``colocated`` baseline of async-vs-sync sets it): generation and
    training share the GPUs, so every learner step also pays ``colocated_switch_s`` to switch between them."""
    colocated_switch_s: float = 0.0
    """Seconds one switch between generation and training costs in the colocated layout (>= 0)."""
    learner_hidden_tokens_per_traj: float = 0.0
    """flops_7b: hidden reasoning tokens charged to the learner per trained trajectory (>= 0): the learner never
    sees the paced engine's hidden tokens, so they are charged at their expectation (``reference.py``
    derives it for its workload; results record the hidden tokens the engines drew beside it)."""
    learner_updates: int = -1
    """flops_7b: forward-and-backward passes over the batch per step (>= 0); -1: derived from the RL stage's
    ``algo`` when validated with the production config (``reference.learner_passes``)."""
    learner_forwards: int = -1
    """flops_7b: extra forward passes over the batch per step (>= 0: old-logprob recompute, KL reference, V_old);
    -1: derived like ``learner_updates``."""

    def validate(self, cfg: Any = None) -> "SimConfig":
        """Raise ValueError naming the ``sim.*`` field and its value; with ``cfg`` (the production
        ``Config``), also the combinations with ``rollout.*`` that cannot run. Returns the config, with
        ``cfg`` and a simulated learner the copy whose -1 (derived) learner passes are resolved from
        ``cfg``'s RL stage (``reference.learner_passes``)."""
        if self.engine not in ENGINES:
            raise ValueError(f"sim.engine={self.engine!r} is not one of {list(ENGINES)}")
        if self.decode_cost not in DECODE_COSTS:
            raise ValueError(f"sim.decode_cost={self.decode_cost!r} is not one of {list(DECODE_COSTS)}")
        if self.prefill_cost not in PREFILL_COSTS:
            raise ValueError(f"sim.prefill_cost={self.prefill_cost!r} is not one of {list(PREFILL_COSTS)}")
        if self.learner_cost not in LEARNER_COSTS:
            raise ValueError(f"sim.learner_cost={self.learner_cost!r} is not one of {list(LEARNER_COSTS)}")
        if not (isinstance(self.retrieval_servers, int) and self.retrieval_servers >= 0):
            raise ValueError(f"sim.retrieval_servers={self.retrieval_servers} must be an integer >= 0 (0: unbounded)")
        if not (math.isfinite(self.context_scale) and self.context_scale >= 1.0):
            raise ValueError(f"sim.context_scale={self.context_scale} must be a finite number >= 1")
        if self.learner_cost != "none":
            if not (isinstance(self.learner_gpus, int) and self.learner_gpus >= 1):
                raise ValueError(f"sim.learner_gpus={self.learner_gpus} must be an integer >= 1")
            if not (math.isfinite(self.learner_mfu) and 0 < self.learner_mfu <= 1):
                raise ValueError(f"sim.learner_mfu={self.learner_mfu} must be in (0, 1]")
            h = self.learner_hidden_tokens_per_traj
            if not (math.isfinite(h) and h >= 0):
                raise ValueError(f"sim.learner_hidden_tokens_per_traj={h} must be a finite number >= 0")
            for name in ("learner_updates", "learner_forwards"):
                v = getattr(self, name)
                if not (isinstance(v, int) and v >= -1):
                    raise ValueError(f"sim.{name}={v} must be an integer >= 0 (-1: derived from the RL stage's algo)")
        elif self.colocated:
            raise ValueError("sim.colocated=true needs sim.learner_cost='flops_7b' (the CPU learner cannot train on "
                             "the rollout GPUs)")
        if self.learner_cost != "none":
            if self.learner_delay_ms > 0:
                raise ValueError(f"sim.learner_delay_ms={self.learner_delay_ms} with sim.learner_cost="
                                 f"{self.learner_cost!r}: two learner-time models; use one")
        for name in ("token_ms", "decode_ms_per_token", "retrieval_latency_ms", "retrieval_latency_sigma",
                     "learner_delay_ms", "retrieval_per_query_ms", "colocated_switch_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"sim.{name}={v} must be a finite number >= 0")
        if self.simulates_decode:  # the length distribution is read only when decode time is simulated
            if self.engine == "bench":
                raise ValueError(f"sim.decode_ms_per_token={self.decode_ms_per_token} > 0 or sim.decode_cost="
                                 f"{self.decode_cost!r} with sim.engine='bench': the bench engine already simulates "
                                 "decode time (sim.token_ms); use one or the other")
            m, s, mx = self.decode_median_tokens, self.decode_sigma, self.decode_max_tokens
            if not (math.isfinite(m) and 1 <= m <= mx) or not (math.isfinite(s) and s >= 0):
                raise ValueError(f"sim.decode_median_tokens={m}, sim.decode_max_tokens={mx}, sim.decode_sigma={s}: "
                                 "need 1 <= median <= max and a finite sigma >= 0")
        if cfg is not None and (self.prefill_cost != "none" or self.context_scale != 1.0) and not (
                self.simulates_decode and cfg.rollout.continuous_batching and cfg.rollout.engine == "hf"):
            raise ValueError(f"sim.prefill_cost={self.prefill_cost!r}, sim.context_scale={self.context_scale}: charged by "
                             "the paced continuous engine only; they need a simulated decode (sim.decode_cost or "
                             "sim.decode_ms_per_token), rollout.engine='hf' and rollout.continuous_batching=true, got "
                             f"rollout.engine={cfg.rollout.engine!r}, rollout.continuous_batching="
                             f"{cfg.rollout.continuous_batching}")
        if cfg is not None and self.engine == "bench":
            r = cfg.rollout
            if r.engine != "hf" or r.continuous_batching:
                raise ValueError(f"sim.engine='bench' needs rollout.engine='hf' and rollout.continuous_batching=false, "
                                 f"got rollout.engine={r.engine!r}, rollout.continuous_batching={r.continuous_batching} "
                                 "(the bench engine is a static-batch transformers engine)")
        if cfg is not None and self.learner_cost != "none" and -1 in (self.learner_updates, self.learner_forwards):
            return dataclasses.replace(self, **self._passes_of(cfg)).validate()
        return self

    def _passes_of(self, cfg: Any) -> dict:
        """``learner_updates`` / ``learner_forwards`` of the production config's RL stages (-1 ones only)."""
        from sonar.bench.sim.reference import learner_passes

        mode = getattr(getattr(cfg, "critic", None), "mode", "separate")
        passes = {learner_passes(st.algo, mode) for st in cfg.stages if st.kind == "rl"}
        if len(passes) != 1:
            raise ValueError(f"sim.learner_updates={self.learner_updates}, sim.learner_forwards={self.learner_forwards}: "
                             f"derived from the RL stages' algo, which give {sorted(passes) or 'none'}; set both")
        (updates, forwards), = passes
        out = {}
        if self.learner_updates == -1:
            out["learner_updates"] = updates
        if self.learner_forwards == -1:
            out["learner_forwards"] = forwards
        return out

    @property
    def simulates_decode(self) -> bool:
        """True when the engine hook paces decode steps (flat ``decode_ms_per_token`` > 0, or gpu_7b)."""
        return self.decode_ms_per_token > 0 or self.decode_cost == "gpu_7b"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(production overrides, ``sim.*`` overrides with the ``sim.`` prefix removed)."""
    prod, sim = [], []
    for o in overrides:
        key = o.partition("=")[0].strip()
        if key == SECTION or key.startswith(SECTION + "."):
            sim.append(o.strip()[len(SECTION) + 1:])
        else:
            prod.append(o)
    return prod, sim


def load_sim(sections: Sequence[tuple[str, Any]], overrides: Sequence[str] = ()) -> SimConfig:
    """``SimConfig`` <- each ``(file name, sim: section)`` in order <- ``KEY=VALUE`` overrides (no prefix);
    unknown keys and wrong types raise ValueError naming the file or the override. Not validated."""
    merged = OmegaConf.structured(SimConfig)
    for name, section in sections:
        try:
            merged = OmegaConf.merge(merged, section)
        except OmegaConfBaseException as e:
            raise ValueError(f"{name}: sim.{getattr(e, 'full_key', '')}: {str(e).splitlines()[0]}") from None
    for o in overrides:
        key, eq, raw = o.partition("=")
        if not eq or not key.strip() or "." in key:
            raise ValueError(f"override 'sim.{o}' is not of the form sim.KEY=VALUE")
        try:
            merged = OmegaConf.merge(merged, {key.strip(): yaml.safe_load(raw) if raw != "" else ""})
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ValueError(f"override 'sim.{o}': {str(e).splitlines()[0]}") from None
    return OmegaConf.to_object(merged)


def load_bench_config(paths: Sequence[str | Path], overrides: Sequence[str] = ()):
    """``(Config, SimConfig)`` from config files that may hold a ``sim:`` section and overrides that may
    be ``sim.KEY=VALUE``; both validated, and checked together (``SimConfig.validate(cfg)``)."""
    from sonar.cluster.wire.config import ConfigError, load_config
    from sonar.cluster.wire.paths import find_config

    prod_overrides, sim_overrides = split_overrides(overrides)
    sections: list[tuple[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sonar-bench-config-") as tmp:
        prod_paths, copies = [], {}
        for i, x in enumerate(paths):
            try:
                p = find_config(x)  # a file, or a shipped preset by name
            except ValueError as e:
                raise ConfigError(str(e)) from None
            try:
                doc = OmegaConf.load(p)
            except (OmegaConfBaseException, yaml.YAMLError) as e:
                raise ConfigError(f"{p}: {str(e).splitlines()[0]}") from None
            if not (OmegaConf.is_dict(doc) and SECTION in doc):
                prod_paths.append(p)
                continue
            # load_config reads files: hand it a copy without the section (same name, so messages read alike)
            sections.append((str(p), doc.pop(SECTION)))
            copy = Path(tmp) / str(i) / p.name
            copy.parent.mkdir()
            OmegaConf.save(doc, copy)
            prod_paths.append(copy)
            copies[str(copy)] = str(p)
        try:
            cfg = load_config(prod_paths, prod_overrides)
        except ConfigError as e:
            msg = str(e)
            for copy, original in copies.items():
                msg = msg.replace(copy, original)
            raise ConfigError(msg) from None
    return cfg, load_sim(sections, sim_overrides).validate(cfg)
