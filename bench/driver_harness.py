"""Shared plumbing of the training benchmarks (async-vs-sync, rollout-scaling, end-to-end).

``run_training(cfg, sim)`` runs a config through the *production* driver functions of
``sonar.cluster.driver`` (``start_run``, ``start_roles``, ``run_sft_stage``, ``run_rl_stage``,
``evaluate``...) in the order ``train()`` calls them, with the simulators of ``sim`` (a
``sonar.bench.sim.SimConfig``) put in through the driver's hooks (``sonar.bench.sim.hooks``), and
adds only measurement around them: wall-clock per stage, the rollout
workers' cumulative stats (``gen_s``, ``retrieve_s``, trajectories, searches) read from ``health()``
before and after each stage, the replay accounting, the driver's per-step metric history, and the
held-out evaluation. Why not ``train()`` itself: it returns a summary without the workers' stats or
the per-stage seconds, and it stops the actors before anyone can ask them.

Ray: the caller starts Ray once (``start_ray``) and every run joins it, so setting after setting does
not pay a Ray start; each run kills its own actors at the end (``ray.kill`` on the handles it
created), so the next one starts on an empty cluster. Never ``ray stop``.

``ProcessTreeSampler`` samples the memory of every process of the Ray session in a background
thread (see its docstring for how the processes are found).

Not a benchmark itself (no ``main``), so ``sonar bench`` does not list it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from sonar.bench.common import REPO_ROOT, setup_env
from sonar.cluster.wire import metrics as K

setup_env()
log = logging.getLogger("sonar.bench")

CONFIG_DIR = REPO_ROOT / "configs"


def load_cfg(paths: Sequence[str | Path], overrides: Sequence[str] = ()):
    """``(Config, SimConfig)``: the files' production part and ``sim:`` sections, each with its overrides
    (``sim.KEY=VALUE`` ones go to the SimConfig; ``sonar.bench.sim.config.load_bench_config``)."""
    from sonar.bench.sim.config import load_bench_config

    return load_bench_config([Path(p) for p in paths], list(overrides))


def start_ray(cfg) -> bool:
    """Start Ray as the driver does (``sonar.cluster.driver.roles.init_ray``: a private local cluster on 127.0.0.1
    unless ``cluster.address`` / ``RAY_ADDRESS`` names one); True if this call started it."""
    from sonar.cluster.driver.roles import init_ray

    return init_ray(cfg)


def device_info(cfg, sim) -> dict:
    """What generated and what trained, and what was simulated: recorded in every result (the same
    command runs on a GPU box)."""
    import torch

    from sonar.learner.deepspeed_config import resolve_backend

    return {"rollout_engine": cfg.rollout.engine, "sim_engine": sim.engine,
            "rollout_device": "cuda" if cfg.rollout.num_gpus_per_worker > 0 and torch.cuda.is_available() else "cpu",
            "learner_device": "cuda" if cfg.learner.num_gpus > 0 and torch.cuda.is_available() else "cpu",
            "broadcast_backend": resolve_backend(cfg.learner, cfg.learner.num_gpus > 0),
            "cuda_available": torch.cuda.is_available(),
            "retrieval_backend": cfg.retrieval.backend,
            "retrieval_latency_ms": sim.retrieval_latency_ms,
            "retrieval_latency_sigma": sim.retrieval_latency_sigma,
            "continuous_batching": cfg.rollout.continuous_batching,
            "engine_slots_per_worker": cfg.rollout.max_batch_rows,
            "decode_ms_per_token": sim.decode_ms_per_token,
            "decode_median_tokens": sim.decode_median_tokens,
            "decode_sigma": sim.decode_sigma,
            "decode_max_tokens": sim.decode_max_tokens}


# ---------------------------------------------------------------------------------------- runs
def _worker_stats(roles) -> list[dict]:
    import ray

    health = ray.get([w.health.remote() for w in roles.workers])
    engine = ray.get([w.engine_stats.remote() for w in roles.workers])
    return [{**dict(h["stats"]), **{f"engine_{k}": v for k, v in e.items() if isinstance(v, (int, float))}}
            for h, e in zip(health, engine)]


def _diff(after: list[dict], before: list[dict]) -> list[dict]:
    return [{k: a[k] - b.get(k, 0) for k in a if isinstance(a[k], (int, float))} for a, b in zip(after, before)]


def _kill_roles(roles) -> None:
    """Kill every actor this run created (the driver's stop_roles only stops the rollout loops)."""
    import ray

    if roles is None or not ray.is_initialized():
        # stop_roles shut down the cluster this run owned, and with it every actor. A Ray call now
        # (ray.kill included) would silently start a new default cluster (os.cpu_count() CPUs, a
        # dashboard on 8265) in this process: the next run in it then joined that cluster and waited
        # 600 s for CPUs it did not have (the chaos test after the soak test in one pytest process).
        return
    for h in [roles.learner, roles.replay, *roles.workers, *roles.retrieval]:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # already dead
            pass


class _Chain:
    """Two ``on_step`` hooks in order; training ends if either says so (both still run)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, *args) -> bool:
        a = self.first(*args)
        b = self.second(*args)
        return bool(a or b)


def run_training(cfg, sim=None, *, evaluate_after: bool = True, export: bool = False,
                 on_roles: Callable[[Any], None] | None = None, on_step: Callable[..., bool] | None = None) -> dict:
    """Run ``cfg``'s stages through the driver's own functions, with ``sim``'s simulators (None: none);
    return measurements.

    Returns ``{"run_dir", "stages": [{"index", "kind", "steps", "seconds", "loop_seconds",
    "workers": [per-worker stat deltas]}], "history": [per-step metric dicts], "replay": stats,
    "eval": {...} or None, "startup_s", "total_s", "weights": final checksum check, "model_dir"}``.
    ``export``: save the final policy as a Hugging Face directory (``<run_dir>/model``), as ``train`` does.
    ``seconds`` is the stage function's wall clock; ``loop_seconds`` (RL only) is the driver loop's
    own timer (from the workers' start to the end of ``RolloutPool.end_stage``), which is what
    async-vs-sync compares.
    """
    import ray

    from sonar.bench.sim.config import SimConfig
    from sonar.bench.sim.hooks import sim_hooks
    from sonar.cluster.driver import loop as D_loop, reports as D_reports, roles as D_roles, run as D_run

    hooks = sim_hooks((sim or SimConfig()).validate(cfg))
    if on_step is not None:  # the driver's per-RL-step hook (roles.Hooks.on_step); truthy ends training
        import dataclasses

        # sim's own on_step (sim.learner_delay_ms) runs first, then the caller's
        hooks = dataclasses.replace(hooks, on_step=on_step if hooks.on_step is None else
                                    _Chain(hooks.on_step, on_step))
    t0 = time.monotonic()
    run = D_run.start_run(cfg)
    roles = None
    out: dict[str, Any] = {"run_dir": str(run.dir), "stages": []}
    try:
        roles = D_roles.start_roles(cfg, run, hooks)
        if on_roles is not None:
            on_roles(roles)
        out["startup_s"] = time.monotonic() - t0
        for index, stage in enumerate(cfg.stages):
            before = _worker_stats(roles)
            first_step = run.rows_logged  # the history is a window (Run.HISTORY_WINDOW rows)
            ts = time.monotonic()
            if stage.kind == "sft":
                D_loop.run_sft_stage(cfg, roles, run, index, stage)
            else:
                D_loop.run_rl_stage(cfg, roles, run, index, stage)
            seconds = time.monotonic() - ts
            rec = {"index": index, "kind": stage.kind, "steps": stage.steps, "seconds": seconds,
                   "t_start": ts, "t_end": ts + seconds,
                   "loop_seconds": run.results.get("rl", {}).get(index, {}).get("seconds", seconds),
                   "workers": _diff(_worker_stats(roles), before),
                   "history": [h for h in run.history_since(first_step) if h.get("stage") == index]}
            out["stages"].append(rec)
        out["replay"] = ray.get(roles.replay.stats.remote())
        out["weights"] = roles.pool.verify_weights()
        out["eval"] = D_reports.evaluate(cfg, roles, run, split="after") if evaluate_after else None
        out["model_dir"] = D_roles.export_model(cfg, roles, run) if export else None
        out["history"] = list(run.history)
        run.finish("FINISHED")
    except BaseException:
        run.finish("FAILED")
        raise
    finally:
        try:
            D_roles.stop_roles(roles)
        finally:
            _kill_roles(roles)
    out["total_s"] = time.monotonic() - t0
    return out


def rl_stage(result: dict) -> dict:
    """The last RL stage record of a ``run_training`` result."""
    rl = [s for s in result["stages"] if s["kind"] == "rl"]
    if not rl:
        raise ValueError("the run has no RL stage")
    return rl[-1]


def series(history: list[dict], key: str) -> list[float]:
    return [float(h[key]) for h in history if key in h and h[key] is not None and np.isfinite(h[key])]


def lag_histogram(history: list[dict]) -> dict[str, float]:
    """Sum of the per-step ``learner/policy_lag/hist/*`` counts (groups trained at each lag)."""
    prefix = K.LEARNER_POLICY_LAG_HIST.format(bin="")
    out: dict[str, float] = {}
    for h in history:
        for k, v in h.items():
            if k.startswith(prefix):
                out[k[len(prefix):]] = out.get(k[len(prefix):], 0.0) + float(v)
    return dict(sorted(out.items(), key=lambda kv: (kv[0].startswith("ge"), int(kv[0].lstrip("ge")))))


def off_policy_by_lag(history: list[dict]) -> dict[str, dict]:
    """What lag cost, per policy lag over the run (issue 52): the importance-weight histogram summed
    (``learner/is_weight/lag/L/hist/*``, trained tokens), the share of those tokens beyond ``algo.tis_cap``
    and, where the learner recomputed the batch's logprobs, the token-weighted sampling KL
    (``learner/sampling_kl/lag/L``, weighted by that step's tokens at lag L)."""
    hist_prefix = K.LEARNER_IS_WEIGHT_LAG_HIST.split("{lag}")[0]
    out: dict[str, dict] = {}
    for h in history:
        tokens: dict[str, float] = {}
        for k, v in h.items():
            if k.startswith(hist_prefix) and v is not None:
                lag, _, b = k[len(hist_prefix):].partition("/hist/")
                d = out.setdefault(lag, {"hist": {}, "tokens": 0.0, "beyond_cap_tokens": 0.0, "kl_tokens": 0.0,
                                         "kl_sum": 0.0})
                d["hist"][b] = d["hist"].get(b, 0.0) + float(v)
                tokens[lag] = tokens.get(lag, 0.0) + float(v)
        for lag, n in tokens.items():
            d = out[lag]
            d["tokens"] += n
            d["beyond_cap_tokens"] += n * float(h.get(K.LEARNER_IS_BEYOND_CAP_LAG.format(lag=lag), 0.0) or 0.0)
            kl = h.get(K.LEARNER_SAMPLING_KL_LAG.format(lag=lag))
            if kl is not None and np.isfinite(kl):
                d["kl_sum"] += n * float(kl)
                d["kl_tokens"] += n
    return {lag: {"tokens": d["tokens"], "hist": d["hist"],
                  "beyond_cap_share": d["beyond_cap_tokens"] / d["tokens"] if d["tokens"] else None,
                  "sampling_kl": d["kl_sum"] / d["kl_tokens"] if d["kl_tokens"] else None}
            for lag, d in sorted(out.items(), key=lambda kv: int(kv[0]))}


# ---------------------------------------------------------------------------------------- memory
class ProcessTreeSampler:
    """Samples the summed memory of the driver and every process of its Ray session, every ``interval_s``.

    Which processes: the driver itself, all its descendants (``psutil.Process.children(recursive=True)``:
    with a local cluster started by ``ray.init``, the GCS, the raylet, and through the raylet every
    worker and actor process, descend from the driver), plus, for a cluster the driver only joined,
    every process whose command line names this Ray session's directory (the raylet, GCS and workers
    are started with ``--session-dir``/``--session-name``-style arguments pointing there). The set is
    re-resolved at every sample, so actors created later are counted.

    What is summed: RSS (over-counts pages shared between processes: torch's libraries, the object
    store's shared memory) and, where readable, PSS (proportional set size: shared pages split among
    their users, so the sum is the real footprint). Peaks are of the sums, over the samples.
    A process that exits between listing and reading is skipped.

    Its own cost is bounded: one sample lists the machine's processes and reads every tree process's
    ``smaps_rollup`` (PSS), which took about 0.1 s of CPU per sample with a Ray session's 20-30 processes
    on a 2-core machine (py-spy over ``tests/bench/test_bench_e2e_quick.py``: 15 s of the pytest process's
    CPU in two 30-second runs, taken from the run it measures). So the wait after a sample is at least
    ``interval_s`` and at least that sample's CPU over ``cpu_budget`` (the share of one core the sampler may
    use): on a machine where sampling is cheap it samples every ``interval_s``, on a loaded one less often.
    ``result()`` reports the sampler's own CPU seconds and its mean interval.
    """

    def __init__(self, interval_s: float = 0.5, pss: bool = True, cpu_budget: float = 0.05):
        if not 0.0 < cpu_budget <= 1.0:
            raise ValueError(f"ProcessTreeSampler: cpu_budget {cpu_budget!r} must be in (0, 1] (a share of one core)")
        import psutil

        self._psutil = psutil
        self.interval_s = interval_s
        self.cpu_budget = cpu_budget
        self.cpu_s = 0.0
        self._started = 0.0
        """CPU seconds the samples took (this process's sampling thread: ``time.thread_time``)."""
        self.pss = pss
        self.root = psutil.Process(os.getpid())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_procs = 0
        self.peak_by_role: dict[str, int] = {}
        self.session_marker = self._session_marker()
        self.t0 = time.monotonic()
        self.series: list[tuple[float, int, int]] = []
        """(seconds since creation at the sample's start, summed RSS bytes, summed PSS bytes) per sample."""

    @staticmethod
    def _session_marker() -> str | None:
        try:
            import ray

            node = getattr(ray._private.worker, "_global_node", None)
            if node is not None:
                return os.path.basename(node.get_session_dir_path())
        except Exception:
            pass
        return None

    def processes(self) -> list:
        ps = self._psutil
        procs = {self.root.pid: self.root}
        try:
            for p in self.root.children(recursive=True):
                procs[p.pid] = p
        except ps.Error:
            pass
        if self.session_marker is None:
            self.session_marker = self._session_marker()
        if self.session_marker:
            for p in ps.process_iter(["pid", "cmdline"]):
                try:
                    if p.pid not in procs and any(self.session_marker in a for a in (p.info["cmdline"] or [])):
                        procs[p.pid] = p
                        for c in p.children(recursive=True):
                            procs.setdefault(c.pid, c)
                except ps.Error:
                    continue
        return list(procs.values())

    @staticmethod
    def _role(p) -> str:
        try:
            title = " ".join(p.cmdline()[:1]) or p.name()
        except Exception:
            return "?"
        if title.startswith("ray::"):
            return title.split()[0].split(".")[0]
        return os.path.basename(title.split()[0]) if title else "?"

    def sample(self) -> tuple[int, int]:
        self._started, c0 = time.monotonic(), time.thread_time()
        try:
            return self._sample()
        finally:
            self.cpu_s += time.thread_time() - c0

    def _sample(self) -> tuple[int, int]:
        rss = pss = 0
        by_role: dict[str, int] = {}
        procs = self.processes()
        for p in procs:
            try:
                if self.pss:
                    try:
                        mi = p.memory_full_info()
                        r, s = mi.rss, getattr(mi, "pss", mi.rss)
                    except (self._psutil.AccessDenied, AttributeError):
                        r = s = p.memory_info().rss
                else:
                    r = s = p.memory_info().rss
            except self._psutil.Error:
                continue
            rss += r
            pss += s
            role = self._role(p)
            by_role[role] = by_role.get(role, 0) + s
        self.samples += 1
        self.series.append((self._started - self.t0, rss, pss))  # when the sample began
        if pss > self.peak_pss:
            self.peak_pss, self.peak_by_role, self.peak_procs = pss, by_role, len(procs)
        self.peak_rss = max(self.peak_rss, rss)
        return rss, pss

    def _loop(self) -> None:
        while not self._stop.is_set():
            c0 = self.cpu_s
            self.sample()
            gap = max(self.interval_s, (self.cpu_s - c0) / self.cpu_budget)  # the CPU budget (class docstring)
            self._stop.wait(max(0.0, gap - (time.monotonic() - self._started)))  # start to start

    def __enter__(self) -> "ProcessTreeSampler":
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="mem-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def result(self) -> dict:
        return {"peak_rss_gb": self.peak_rss / 2**30, "peak_pss_gb": self.peak_pss / 2**30,
                "samples": self.samples, "interval_s": self.interval_s, "processes_at_peak": self.peak_procs,
                "mean_interval_s": (round((self.series[-1][0] - self.series[0][0]) / (len(self.series) - 1), 3)
                                    if len(self.series) > 1 else None),
                "sampler_cpu_s": round(self.cpu_s, 3), "cpu_budget": self.cpu_budget,
                "pss_by_role_at_peak_mb": {k: round(v / 2**20, 1) for k, v in
                                           sorted(self.peak_by_role.items(), key=lambda kv: -kv[1])}}


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def load_note(load: dict) -> str:
    """What a benchmark's plot says of the machine: its cores and the load averages recorded at the start
    and the end of the measurement (``loadavg``; the benchmark's own processes included), not a fixed claim."""
    fmt = lambda la: "/".join(f"{x:.1f}" for x in la) if la else "n/a"  # noqa: E731
    return (f"{os.cpu_count()}-core machine; load average (1/5/15 min) {fmt(load.get('start'))} at the start, "
            f"{fmt(load.get('end'))} at the end, this benchmark's own processes included")
