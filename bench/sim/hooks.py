"""The simulators enter the production driver here, through the hooks production offers.

``sim_hooks(sim)`` -> ``sonar.cluster.driver.roles.Hooks``:

- ``engine_wrap = SimEngineWrap(sim)`` for ``build_engine`` (``actors/engines.py``) in every rollout
  worker: ``sim.engine=bench`` replaces the engine with ``BenchEngine``; ``sim.decode_ms_per_token`` > 0
  replaces a ``ContinuousHFEngine`` with ``PacedContinuousHFEngine`` and wraps any other engine in
  ``DecodeLatencyEngine``;
- ``retriever_wrap = SimRetrieverWrap(...)`` for ``build_retriever`` (``retrieval/factory.py``) in every
  retrieval replica: ``sim.retrieval_latency_ms`` > 0 wraps the backend in ``LatencyInjectingRetriever``;
- ``on_step = LearnerDelay(sim.learner_delay_ms)`` for the driver (``sim.learner_delay_ms`` > 0): a
  simulated longer learner step, after the weights went out;
- ``on_learner_step = LearnerTime(...)`` for the driver (``sim.learner_cost=flops_7b``): a real-size
  learner's step time for the trajectories it trained, before the weights go out (so the workers keep generating with the old ones
  meanwhile, as they would while a 7B learner trains).

A hook that would change nothing is None, so a ``SimConfig()`` runs production untouched. Both are
instances of top-level classes holding plain values: Ray pickles them into the actors.

Per-worker seeds (as before the move): the bench engine ``run.seed * 101 + worker``, the decode
lengths ``run.seed * 1009 + worker``.
"""
from __future__ import annotations

from sonar.bench.sim.config import SimConfig
from sonar.cluster.driver.roles import Hooks


class SimEngineWrap:
    """The engine hook: ``wrap(engine, *, cfg, model, tokenizer, worker_id) -> Engine``."""

    def __init__(self, sim: SimConfig):
        self.sim = sim.validate()

    def __call__(self, engine, *, cfg, model, tokenizer, worker_id: int):
        s = self.sim
        if s.engine == "bench":
            from sonar.actors.prompts import get_protocol
            from sonar.bench.sim.bench_engine import BenchEngine

            return BenchEngine(model, tokenizer, get_protocol(cfg.protocol.name), token_ms=s.token_ms,
                               seed=cfg.run.seed * 101 + worker_id)
        if not s.simulates_decode:
            return engine
        pacing = dict(median_tokens=s.decode_median_tokens, sigma=s.decode_sigma, max_tokens=s.decode_max_tokens,
                      seed=cfg.run.seed * 1009 + worker_id)
        # flat keeps the fixed step time (decode_ms_per_token); gpu_7b charges t(rows, ctx) (gpu_cost.py)
        from sonar.bench.sim.gpu_cost import make_cost

        cost = make_cost(s) if s.decode_cost != "flat" else None
        from sonar.actors.engine_continuous import ContinuousHFEngine

        if isinstance(engine, ContinuousHFEngine):  # concurrent calls: pace its steps, never serialise them
            from sonar.bench.sim.gpu_cost import Prefill7BCost
            from sonar.bench.sim.paced_engine import PacedContinuousHFEngine

            return PacedContinuousHFEngine.like(engine, step_ms=s.decode_ms_per_token if cost is None else None,
                                                cost=cost, prefill=Prefill7BCost() if s.prefill_cost == "gpu_7b" else None,
                                                context_scale=s.context_scale, turn_marker=turn_marker(cfg, tokenizer),
                                                **pacing)
        from sonar.bench.sim.decode_latency import DecodeLatencyEngine

        return DecodeLatencyEngine(engine, s.decode_ms_per_token if cost is None else None, cost=cost, **pacing)

    def __repr__(self) -> str:
        return f"SimEngineWrap({self.sim})"


def turn_marker(cfg, tokenizer) -> int | None:
    """The token id of the protocol's documents tag (``<information>``: the rollout appends it once per search
    step, so a prompt's count of it tells its turn), or None when the tokenizer splits it into several ids."""
    from sonar.actors.prompts import get_protocol

    try:
        ids = tokenizer.encode(get_protocol(cfg.protocol.name).docs_open, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a tokenizer without encode: the histogram is not counted
        return None
    return int(ids[0]) if len(ids) == 1 else None


class SimRetrieverWrap:
    """The retriever hook: ``wrap(backend) -> LatencyInjectingRetriever(backend, median_ms, sigma, servers=,
    per_query_ms=)``."""

    def __init__(self, median_ms: float, sigma: float, servers: int = 0, per_query_ms: float = 0.0):
        self.median_ms, self.sigma = float(median_ms), float(sigma)
        self.servers, self.per_query_ms = int(servers), float(per_query_ms)

    def __call__(self, backend):
        from sonar.bench.sim.retrieval_latency import LatencyInjectingRetriever

        return LatencyInjectingRetriever(backend, self.median_ms, self.sigma, servers=self.servers,
                                         per_query_ms=self.per_query_ms)

    def __repr__(self) -> str:
        return (f"SimRetrieverWrap(median_ms={self.median_ms}, sigma={self.sigma}, servers={self.servers}, "
                f"per_query_ms={self.per_query_ms})")


class LearnerDelay:
    """The driver's ``on_step`` hook for ``sim.learner_delay_ms``: after every logged RL step the driver
    waits ``delay_ms`` before it asks the learner for the next one (SIMULATED learner time). Never ends
    training; ``waited_s`` sums the waits."""

    def __init__(self, delay_ms: float):
        self.delay_ms = float(delay_ms)
        self.waited_s = 0.0

    def __call__(self, roles, run, stage_index, steps) -> bool:
        import time

        time.sleep(self.delay_ms / 1000.0)  # simulated work, not synchronisation: nothing waits on it
        self.waited_s += self.delay_ms / 1000.0
        return False

    def __repr__(self) -> str:
        return f"LearnerDelay(delay_ms={self.delay_ms})"


class LearnerTime:
    """The driver's ``on_learner_step`` hook for ``sim.learner_cost=flops_7b``: a real-size learner's step,
    charged for the trajectories that step actually trained.

    Tokens (real-job tokens, ``reference.real_tokens``): ``context_scale`` x the tiny-world sequence tokens of
    the trained batch (prompt, retrieved text and the policy's tokens of every trained trajectory: what the
    learner forwards and back-propagates; ``learner/tokens_per_s`` x ``learner/step_time_s`` of the step,
    which ``rl_step`` computes from the batch's ``lengths``) + ``hidden_per_traj`` for each trained trajectory
    (the paced engine's hidden reasoning, at its expectation: the learner never sees it). Seconds:
    ``reference.learner_step_s(tokens, gpus, mfu, updates, forwards)``. The driver waits out what the real
    CPU learner did not already spend, before the push. The step's ``learner/step_time_s`` becomes the
    simulated one (the critical-path split then counts it as learner compute); a real step that took longer
    is kept and counted (``sim/learner_overrun``). A skipped step (no trajectory trained) costs nothing. A
    step that trained trajectories without reporting its tokens (a PPO critic-warmup step) is charged the
    mean tiny tokens per trajectory of the steps before it. ``switch_s`` (the colocated layout): every step
    also switches the GPUs from generation to training and back.

    Reported per step: ``sim/learner_s`` (all the simulated time, switch included), ``sim/learner_compute_s``
    (the FLOP time alone: the learner's busy GPU time is that x ``gpus``) and ``sim/learner_tokens`` (real-job
    tokens charged)."""

    def __init__(self, gpus: int, mfu: float, *, updates: int, forwards: int, context_scale: float = 1.0,
                 hidden_per_traj: float = 0.0, switch_s: float = 0.0):
        from sonar.bench.sim.reference import learner_step_s

        if updates < 0 or forwards < 0:
            raise ValueError(f"LearnerTime: updates={updates}, forwards={forwards} must be >= 0 (sim.learner_updates "
                             "and sim.learner_forwards are derived from the RL stage's algo when the SimConfig is "
                             "validated with the production config)")
        self.gpus, self.mfu, self.updates, self.forwards = int(gpus), float(mfu), int(updates), int(forwards)
        self.context_scale, self.hidden_per_traj = float(context_scale), float(hidden_per_traj)
        self.switch_s = float(switch_s)
        learner_step_s(0.0, self.gpus, self.mfu, self.updates, self.forwards)  # validates before the first step
        self.simulated_s = 0.0
        self.overruns = 0
        self._tiny = [0.0, 0.0]  # (tiny tokens, trajectories) of the steps that reported their tokens

    def tokens(self, trajectories: float, tiny_tokens: float | None) -> float:
        """Real-job tokens of a step that trained ``trajectories`` trajectories of ``tiny_tokens`` tiny-world
        sequence tokens in all (None: unknown, the mean per trajectory so far)."""
        from sonar.bench.sim.reference import real_tokens

        n = max(0.0, float(trajectories))
        if tiny_tokens is None:
            tiny_tokens = n * self._tiny[0] / self._tiny[1] if self._tiny[1] else 0.0
        return real_tokens(tiny_tokens, self.context_scale, n * self.hidden_per_traj)

    def compute_s(self, tokens: float) -> float:
        """Simulated FLOP seconds of a learner step over ``tokens`` real-job tokens (no switch)."""
        from sonar.bench.sim.reference import learner_step_s

        return learner_step_s(tokens, self.gpus, self.mfu, self.updates, self.forwards)

    def __call__(self, metrics: dict) -> dict:
        import time

        from sonar.cluster.wire import metrics as K

        n = float(metrics.get(K.LEARNER_TRAJECTORIES, 0.0) or 0.0)
        real = float(metrics.get(K.LEARNER_STEP_TIME, 0.0) or 0.0)
        tps = metrics.get(K.LEARNER_TOKENS_PER_S)
        tiny = float(tps) * real if tps is not None and n > 0 else None  # = batch.lengths.sum(): both use its dt
        if tiny is not None:
            self._tiny[0] += tiny
            self._tiny[1] += n
        tokens = self.tokens(n, tiny) if n > 0 else 0.0
        compute = self.compute_s(tokens) if n > 0 else 0.0
        target = compute + self.switch_s if n > 0 else 0.0
        if target > real:
            time.sleep(target - real)  # simulated learner compute, not synchronisation: nothing waits on it
        self.simulated_s += target
        self.overruns += real > target > 0
        return {K.LEARNER_STEP_TIME: max(target, real), "sim/learner_s": target, "sim/learner_compute_s": compute,
                "sim/learner_tokens": tokens, "sim/learner_overrun": float(real > target > 0)}

    def __repr__(self) -> str:
        return (f"LearnerTime(gpus={self.gpus}, mfu={self.mfu}, updates={self.updates}, forwards={self.forwards}, "
                f"context_scale={self.context_scale}, hidden_per_traj={self.hidden_per_traj}, "
                f"switch_s={self.switch_s})")


def sim_hooks(sim: SimConfig) -> Hooks:
    """The production driver's ``Hooks`` that apply ``sim`` (None where it simulates nothing)."""
    sim.validate()
    engine = SimEngineWrap(sim) if sim.engine == "bench" or sim.simulates_decode else None
    retriever = (SimRetrieverWrap(sim.retrieval_latency_ms, sim.retrieval_latency_sigma, sim.retrieval_servers,
                                  sim.retrieval_per_query_ms)
                 if sim.retrieval_latency_ms > 0 or sim.retrieval_per_query_ms > 0 else None)
    on_step = LearnerDelay(sim.learner_delay_ms) if sim.learner_delay_ms > 0 else None
    learner = (LearnerTime(sim.learner_gpus, sim.learner_mfu, updates=sim.learner_updates,
                           forwards=sim.learner_forwards, context_scale=sim.context_scale,
                           hidden_per_traj=sim.learner_hidden_tokens_per_traj,
                           switch_s=sim.colocated_switch_s if sim.colocated else 0.0)
               if sim.learner_cost == "flops_7b" else None)
    return Hooks(engine_wrap=engine, retriever_wrap=retriever, on_step=on_step, on_learner_step=learner)
