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
  learner's step time, before the weights go out (so the workers keep generating with the old ones
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
                                                context_scale=s.context_scale, **pacing)
        from sonar.bench.sim.decode_latency import DecodeLatencyEngine

        return DecodeLatencyEngine(engine, s.decode_ms_per_token if cost is None else None, cost=cost, **pacing)

    def __repr__(self) -> str:
        return f"SimEngineWrap({self.sim})"


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
    """The driver's ``on_learner_step`` hook for ``sim.learner_cost=flops_7b``: a real-size learner's step.

    A step that trained ``n`` trajectories lasts ``n x tokens_per_traj / tokens_per_s`` seconds, with
    ``tokens_per_s = gpus x mfu x PEAK_FLOPS / FLOPS_PER_TOKEN`` (``reference.py``: 8 x 7.25e9 FLOP per
    trained token, 989.4 TFLOPS); the driver waits out what the real CPU learner did not already spend,
    before the push. The step's ``learner/step_time_s`` becomes the simulated one (the critical-path split
    then counts it as learner compute); a real step that took longer is kept and counted
    (``sim/learner_overrun``). A skipped step (no trajectory trained) costs nothing. ``switch_s`` (the
    colocated layout): every step also switches the GPUs from generation to training and back."""

    def __init__(self, tokens_per_traj: float, gpus: int, mfu: float, switch_s: float = 0.0):
        from sonar.bench.sim.reference import learner_tokens_per_s

        self.tokens_per_traj, self.gpus, self.mfu = float(tokens_per_traj), int(gpus), float(mfu)
        self.switch_s = float(switch_s)
        self.tokens_per_s = learner_tokens_per_s(self.gpus, self.mfu)
        self.simulated_s = 0.0
        self.overruns = 0

    def step_s(self, trajectories: float) -> float:
        """Simulated seconds of a learner step that trained ``trajectories`` trajectories."""
        n = max(0.0, float(trajectories))
        return 0.0 if n == 0 else self.switch_s + n * self.tokens_per_traj / self.tokens_per_s

    def __call__(self, metrics: dict) -> dict:
        import time

        from sonar.cluster.wire import metrics as K

        target = self.step_s(metrics.get(K.LEARNER_TRAJECTORIES, 0.0) or 0.0)
        real = float(metrics.get(K.LEARNER_STEP_TIME, 0.0) or 0.0)
        if target > real:
            time.sleep(target - real)  # simulated learner compute, not synchronisation: nothing waits on it
        self.simulated_s += target
        self.overruns += real > target > 0
        return {K.LEARNER_STEP_TIME: max(target, real), "sim/learner_s": target, "sim/learner_overrun": float(real > target > 0)}

    def __repr__(self) -> str:
        return (f"LearnerTime(tokens_per_traj={self.tokens_per_traj}, gpus={self.gpus}, mfu={self.mfu}, "
                f"switch_s={self.switch_s})")


def sim_hooks(sim: SimConfig) -> Hooks:
    """The production driver's ``Hooks`` that apply ``sim`` (None where it simulates nothing)."""
    sim.validate()
    engine = SimEngineWrap(sim) if sim.engine == "bench" or sim.simulates_decode else None
    retriever = (SimRetrieverWrap(sim.retrieval_latency_ms, sim.retrieval_latency_sigma, sim.retrieval_servers,
                                  sim.retrieval_per_query_ms)
                 if sim.retrieval_latency_ms > 0 or sim.retrieval_per_query_ms > 0 else None)
    on_step = LearnerDelay(sim.learner_delay_ms) if sim.learner_delay_ms > 0 else None
    learner = (LearnerTime(sim.learner_tokens_per_traj, sim.learner_gpus, sim.learner_mfu,
                           sim.colocated_switch_s if sim.colocated else 0.0)
               if sim.learner_cost == "flops_7b" else None)
    return Hooks(engine_wrap=engine, retriever_wrap=retriever, on_step=on_step, on_learner_step=learner)
