"""soak: does any process of a long run grow? RSS of the driver, the learner and each rollout worker over time.

Question (issue 14, "a soak benchmark"): run training for ``--minutes N`` through the production driver
functions (``bench.driver_harness.run_training``, as end-to-end does) and sample, every ``--every``
seconds, the resident set size of the driver (this process), the learner and every rollout worker
(their pids from the actors' own ``ping`` / ``ready``; psutil reads the RSS). After a warm-up (the
first ``--warmup`` fraction of the samples: imports, allocator pools, the first batches, the
evaluation) each role's RSS must be flat: the benchmark reports the least-squares slope of RSS
against time after the warm-up, in MB per minute, per role (``rss_slope_mb_per_min/<role>``; the
workers' as a summary over the workers), and the RSS at the end of the warm-up and at the end.

How the run lasts N minutes: the last RL stage is given a very large number of steps, and the driver's
``on_step`` hook (``roles.Hooks``) ends training at the first RL step after N minutes have passed since
that stage's first step; the roles then stop as at the end of any run. The slope is measured in that
window only (issue 26: a window that straddled SFT and RL showed the switch, not a leak); the samples
before it are kept in the result and drawn. (An earlier version raised a
KeyboardInterrupt in the main thread from the sampler; it could land anywhere, inside the roles'
shutdown too, and left a Ray cluster with live actors behind in the test process.)

``--quick`` (CI smoke test, < 1 minute): ``configs/smoke.yaml`` with 5 SFT steps, 6 seconds (0.1 minute)
of RL, a sample every half second (about 12 in the window): it checks the plumbing and the JSON, not the
slope.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from sonar.bench.common import REPO_ROOT, bench_settings, driver_bench_parser, setup_env, summarise, write_result

setup_env()

NAME = "soak"
FULL = {"config": "configs/tiny.yaml", "minutes": 5.0, "every_s": 5.0, "warmup": 0.3,
        "overrides": ["eval.before=false", "world.num_heldout_eval=8"], "repeats": 1}
QUICK = {"config": "configs/smoke.yaml", "minutes": 0.1, "every_s": 0.5, "warmup": 0.3,
         "overrides": ["stages.0.steps=5", "eval.before=false", "world.num_heldout_eval=4", "eval.no_search=false",
                       "eval.batch_size=4"], "repeats": 1}
log = logging.getLogger("sonar.bench")


def rss_slope(t_s: list[float], rss_bytes: list[float]) -> float:
    """Least-squares slope of RSS against time, in MB (1e6 bytes) per minute."""
    if len(t_s) < 2:
        raise ValueError("rss_slope: need at least two samples")
    t_min = np.asarray(t_s, dtype=np.float64) / 60.0
    mb = np.asarray(rss_bytes, dtype=np.float64) / 1e6
    return float(np.polyfit(t_min - t_min.mean(), mb, 1)[0])


class RssSampler:
    """Every ``every_s`` seconds, the RSS of each named pid, from the moment the roles answer. The measured
    window opens at the first step of the RL stage ``rl_stage`` (``window_t0``: after the SFT -> RL switch,
    whose allocations (the rollout engines' first batches, the replay, the first pushes) are a change of
    regime, not a leak); after ``minutes`` of it, ``interrupted`` is set (the on_step hook ``done`` then
    ends training)."""

    def __init__(self, every_s: float, minutes: float, rl_stage: int = 0):
        self.every_s, self.minutes, self.rl_stage = every_s, minutes, rl_stage
        self.pids: dict[str, int] = {}
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self.t0 = None
        self.window_t0: float | None = None  # seconds after t0 of the RL stage's first step
        self.interrupted = False
        self._stop = threading.Event()
        self._window = threading.Event()
        self._thread = None

    def start(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.samples = {role: [] for role in pids}
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        t = time.monotonic() - self.t0
        for role, pid in self.pids.items():
            try:
                self.samples[role].append((t, psutil.Process(pid).memory_info().rss))
            except psutil.Error:  # the process is gone (the run is ending)
                pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            if self._window.is_set() and time.monotonic() - self.t0 >= self.window_t0 + 60.0 * self.minutes:
                self.interrupted = True  # read by the driver's on_step hook (``done``): it ends training
                return
            self._stop.wait(self.every_s)

    def done(self, roles, run, stage_index: int, steps: int) -> bool:
        """The driver's ``on_step`` hook: opens the window at the RL stage's first step, ends training once
        its N minutes have passed."""
        if stage_index == self.rl_stage and not self._window.is_set() and self.t0 is not None:
            self.window_t0 = time.monotonic() - self.t0
            self._window.set()
        return self.interrupted

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def role_pids(roles) -> dict[str, int]:
    """Pids of the driver, the learner and each worker, as the actors report them."""
    import ray

    pids = {"driver": os.getpid(), "learner": int(ray.get(roles.learner.ping.remote())["pid"])}
    for i, r in enumerate(ray.get([w.ready.remote() for w in roles.workers])):
        pids[f"worker{i}"] = int(r["pid"])
    return pids


def analyse(samples: dict[str, list[tuple[float, int]]], warmup: float, window_t0: float = 0.0) -> dict:
    """Per role: slope after the warm-up (MB/min) and the RSS (MB) at the warm-up's end and at the end.
    Only the samples from ``window_t0`` on (the RL stage's) count; the warm-up is the first ``warmup``
    fraction of those."""
    out = {}
    for role, ss in samples.items():
        ss = [s for s in ss if s[0] >= window_t0]
        if len(ss) < 3:
            continue
        cut = min(int(len(ss) * warmup), len(ss) - 2)
        t, rss = [s[0] for s in ss[cut:]], [s[1] for s in ss[cut:]]
        out[role] = {"slope_mb_per_min": rss_slope(t, rss), "rss_mb_after_warmup": rss[0] / 1e6,
                     "rss_mb_end": rss[-1] / 1e6, "samples": len(ss), "warmup_samples": cut,
                     "seconds_measured": t[-1] - t[0]}
    return out


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's soak table: per role, its RSS at the end of the warm-up and at the end of the run, and
    the least-squares slope after the warm-up (pure: no runs; `sonar bench readme`,
    tests/bench/test_readme_blocks.py)."""
    import re

    from sonar.bench.common import readme_block

    lines = ["| role | RSS at warm-up end → end | slope |", "|---|---|---|"]
    for role, r in doc["extra"]["roles"].items():
        name = re.sub(r"^worker(\d+)$", r"worker \1", role)  # worker0 -> worker 0
        slope = f"{r['slope_mb_per_min']:+.1f}" if round(r["slope_mb_per_min"], 1) else "0.0"  # no "-0.0"
        lines.append(f"| {name} | {r['rss_mb_after_warmup']:,.0f} → {r['rss_mb_end']:,.0f} MB | {slope} MB/min |")
    return readme_block(NAME, json_name, lines)


def main(argv: list[str] | None = None) -> int:
    p = driver_bench_parser(NAME, __doc__.splitlines()[0], "the run's config")
    p.add_argument("--minutes", type=float, default=None, help="how long to train in the last RL stage, from "
                                                               "its first step (default 5; quick 0.1)")
    p.add_argument("--every", type=float, default=None, help="seconds between samples (default 5; quick 0.5)")
    p.add_argument("--warmup", type=float, default=None, help="fraction of the samples taken as warm-up (0.3)")
    p.add_argument("--config", default=None, help="run config (default configs/tiny.yaml; quick: smoke.yaml)")
    args = p.parse_args(argv)
    bench = bench_settings(args, QUICK, FULL)
    for key, val in (("minutes", args.minutes), ("every_s", args.every), ("warmup", args.warmup),
                     ("config", args.config)):
        if val is not None:
            bench[key] = val
    from sonar.bench.driver_harness import run_training
    from sonar.cluster.wire.config import load_config, to_dict

    base = load_config([REPO_ROOT / bench["config"]], bench["overrides"] + args.overrides)
    last_rl = max(i for i, s in enumerate(base.stages) if s.kind == "rl")
    cfg = load_config([REPO_ROOT / bench["config"]],
                      bench["overrides"] + [f"stages.{last_rl}.steps=1000000"] + args.overrides)
    sampler = RssSampler(bench["every_s"], bench["minutes"], rl_stage=last_rl)
    t0 = time.monotonic()
    try:
        run_training(cfg, evaluate_after=False, on_roles=lambda roles: sampler.start(role_pids(roles)),
                     on_step=sampler.done)
    finally:
        sampler.stop()
    wall = time.monotonic() - t0
    if sampler.window_t0 is None:
        log.error("soak: the RL stage %d never logged a step", last_rl)
        return 1
    roles = analyse(sampler.samples, bench["warmup"], sampler.window_t0)
    if "driver" not in roles or "learner" not in roles:
        log.error("soak: too few samples (%s); run longer (--minutes)", {r: len(s) for r, s in sampler.samples.items()})
        return 1
    workers = [v for r, v in roles.items() if r.startswith("worker")]
    metrics = {}
    for name, group in (("driver", [roles["driver"]]), ("learner", [roles["learner"]]), ("worker", workers)):
        if group:
            metrics[f"rss_slope_mb_per_min/{name}"] = summarise(g["slope_mb_per_min"] for g in group)
            metrics[f"rss_mb_end/{name}"] = summarise(g["rss_mb_end"] for g in group)
            metrics[f"rss_mb_after_warmup/{name}"] = summarise(g["rss_mb_after_warmup"] for g in group)
    for role, v in roles.items():
        log.info("soak %-8s RSS %.1f -> %.1f MB over %.0f s of RL after warm-up: slope %+.3f MB/min (%d samples)",
                 role, v["rss_mb_after_warmup"], v["rss_mb_end"], v["seconds_measured"], v["slope_mb_per_min"],
                 v["samples"])
    samples = {r: [[round(t, 2), int(b)] for t, b in s] for r, s in sampler.samples.items()}

    def plot(png):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r, s in samples.items():
            if s:
                ax.plot([x[0] / 60 for x in s], [x[1] / 1e6 for x in s], label=r)
        ax.axvline(sampler.window_t0 / 60, color="grey", ls="--", lw=1, label="RL starts (window opens)")
        ax.set_xlabel("minutes since the roles answered")
        ax.set_ylabel("RSS (MB)")
        ax.set_title(f"soak: RSS per role ({bench['config']}, {bench['minutes']} min)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=100)

    config = {"quick": bool(args.quick), **bench, "cli_overrides": args.overrides, "resolved": to_dict(cfg)}
    path = write_result(NAME, config, metrics, plot, args.out,
                        extra={"roles": roles, "samples": samples, "wall_s": wall, "pids": sampler.pids,
                              "window_t0_s": sampler.window_t0, "rl_stage": last_rl})
    print(f"soak: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
