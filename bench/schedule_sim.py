"""``sonar bench schedule-sim``: async against sync and colocated, on a discrete-event simulator that drives
Sonar's own scheduler (``bench/sim/scheduler_sim.py``), for a short and a long search workload.

Question (issue 52): at a fixed GPU budget, how much faster does async train than the best synchronous
layout, on a Search-R1-shaped and on an ASearcher-shaped job, how close does it come to what overlap can
give at all (Amdahl: the learner's share of GPU time), how does that carry to 64-1,024 GPUs, and what does
each of the scheduler's options buy? And does the simulator agree with the real system where both ran?

- **8 GPUs**: the rollout:learner split swept (async at lag 1 and 2, sync_split at each split; colocated on
  all 8 at the async settings' batch and at the full batch the engines hold, veRL's default layout as a peer
  would size it), ``--seeds`` seeds each; best async against the best synchronous layout, steady-state trained
  trajectories/s (the first version and the final drain left out, reported apart), 95 % intervals over
  seeds (``bench/stats.py: mean_ci``), the stale share, and the pipeline bound ``G / (g + l)`` (``g``, ``l``:
  rollout and learner GPU-seconds per trajectory at the run's loads: the best sync layout's, and async's own
  with the split in whole GPUs, ``max_r min(r / g, (G - r) / l)``).
- **Projection**: 8, 64, 512 and 1,024 GPUs, prompts per version scaled with the GPUs, the best of a
  coarse split sweep per size (at 512 and 1,024 the split fraction that was best at 64, one seed); colocated
  at both batches, the better one the baseline.
- **Ablation** at 8 GPUs (async, lag 2, the best async split): the pre-change scheduler (no engine
  capacity, no least-loaded first, no just in time, a request's groups put together) and each option on.
- **Validation**: the four settings of the real run ``workloads.VALIDATION_RESULT`` (async-vs-sync with slept
  GPU costs: colocated at full batch, async on the production scheduler) on the workload that run realised
  (``workloads.validation_workload``); DES trained traj/s over the whole run against the measured, relative
  error, goal within 10 %.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from sonar.bench.common import REPO_ROOT, base_parser, bench_settings, readme_block, summarise, write_result
from sonar.bench.sim import workloads as W
from sonar.bench.sim.scheduler_sim import Sim, simulate
from sonar.bench.stats import mean_ci

NAME = "schedule-sim"
GROUPS_PER_GPU = 4
"""Groups per version per GPU (32 groups of 8 = 256 trajectories per version at 8 GPUs; assumed, the
order of Search-R1's 512 prompts x 5 on 8 GPUs scaled down)."""
GROUPS_PER_GPU_LONG = 1
"""The long workload's: a trajectory is ~30x the tokens, so a version of 8 groups at 8 GPUs (assumed)."""
PROJECTION_VERSIONS = 6
"""Versions per projected run. Steady state leaves the first version out; with 3 versions (2 steady) the
async rate counted the work pipelined before the window: the long workload's async at 4 + 4 GPUs and the
default batch trained 1.20, 0.50 and 1.19 traj/s on 3 seeds over 3 versions and 0.24-0.25 over 6 or 10
(2.48x colocated at full batch against 0.61x). ``tests/bench/test_scheduler_sim.py`` holds the rate at
this many versions within 15 % of the 10-version rate."""
FULL = {"seeds": [0, 1, 2, 3, 4], "gpus": 8, "splits": [3, 4, 5, 6, 7], "lags": [1, 2], "versions": 10,
        "projection": [8, 64, 512, 1024], "projection_splits": [0.5, 0.625, 0.75, 0.875],
        "projection_versions": PROJECTION_VERSIONS,
        "projection_seeds_small": [0, 1, 2], "validation_seeds": [0, 1, 2, 3, 4]}
QUICK = {"seeds": [0, 1], "gpus": 8, "splits": [5, 6], "lags": [2], "versions": 4,
         "projection": [8, 16], "projection_splits": [0.75], "projection_versions": 3,
         "projection_seeds_small": [0], "validation_seeds": [0]}
VALIDATION_SETTINGS = {
    "sync": dict(mode="sync_split", rollout_gpus=4, learner_gpus=2, groups_per_step=8, versions=8),
    "sync_full": dict(mode="sync_split", rollout_gpus=4, learner_gpus=2, groups_per_step=32, versions=2),
    "colocated": dict(mode="colocated", rollout_gpus=5, learner_gpus=1, groups_per_step=48, versions=2),
    "async_lag2": dict(mode="async", rollout_gpus=4, learner_gpus=2, groups_per_step=8, versions=8, lag=2,
                       capacity_groups=16, lanes=8, groups_per_request=2, weight_update="interrupt",
                       decoding_rows=False, version_wait=False),
}
"""The validation run's settings (its overrides: 4 rollout workers, learner 2 GPUs, 8 groups of 8 per step,
8 steps; sync_full 32 groups x 2 steps; colocated on all 6 GPUs at the full batch, 48 groups x 2 steps;
async lag 2, replay capacity 16, 8 lanes of 2 groups, ``weight_update=auto`` = interrupt, the production
scheduler of that run: engine capacity in claimed groups' rows, a claim refused for its version returning)."""
REALISED_KEYS = ("searches_per_traj", "model_tokens_per_traj", "decode_row_steps_per_trained_traj",
                 "ctx_admitted_mean", "zero_signal_share")


def groups_per_step(w, gpus: int) -> int:
    return gpus * (GROUPS_PER_GPU_LONG if w.name == "long" else GROUPS_PER_GPU)


def runs(w, sims: list[Sim], jobs: int = 1) -> list[dict]:
    return run_batches(w, {"": sims}, jobs)[""]


def run_batches(w, plan: dict[str, list[Sim]], jobs: int = 1) -> dict[str, list[dict]]:
    """Every run of ``plan`` (setting -> its seeds' runs), in ``jobs`` processes at once: each run is a pure
    function of its workload and ``Sim`` (its seed included), so the results equal the serial ones, in order."""
    flat = [s for sims in plan.values() for s in sims]
    if jobs <= 1 or len(flat) <= 1:
        done = [simulate(w, s) for s in flat]
    else:
        import functools
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(jobs, len(flat)), mp_context=multiprocessing.get_context("fork")) as ex:
            done = list(ex.map(functools.partial(simulate, w), flat))
    out, i = {}, 0
    for k, sims in plan.items():
        out[k], i = done[i:i + len(sims)], i + len(sims)
    return out


def ci(rows: list[dict], key: str) -> dict:
    return mean_ci([r[key] for r in rows])


def light(r: dict) -> dict:
    """A run's result without its per-step lists (the JSON stays small)."""
    return {k: v for k, v in r.items() if k not in ("step_s", "step_end_s")}


def full_batch(w, gpus: int) -> int:
    """Groups per version that fill every engine of ``gpus`` GPUs: ``gpus x row_cap // group_size`` (64 rows of
    8 = 8 groups per GPU), never fewer than the default batch. The long workload's KV budget holds fewer
    rows than ``row_cap``; its surplus waits in the engine's queue, as it would in vLLM."""
    return max(groups_per_step(w, gpus), gpus * max(1, w.row_cap // w.group_size))


def batches(w, gpus: int) -> dict[str, int]:
    """The batches every layout runs at, by the suffix of its setting's name: the default batch (``""``) and
    the full one (``"_full"``, veRL's colocated default as a peer sizes it; one version of it is several
    optimizer steps of the default size, veRL's mini-batches), one entry when they agree."""
    b, f = groups_per_step(w, gpus), full_batch(w, gpus)
    return {"": b, **({"_full": f} if f != b else {})}


def _split(gr: int, G: int) -> str:
    return f"{gr}+{G - gr}"


# ------------------------------------------------------------------------------------ the 8-GPU comparison
def whole_gpu_bound(G: int, g: float, l: float) -> float:
    """Trajectories/s of ``G`` GPUs split in whole GPUs between rollout (``g`` GPU-seconds per trajectory) and
    learner (``l``), every GPU busy: ``max_r min(r / g, (G - r) / l)``, at most the overlap bound ``G / (g + l)``."""
    return max(min(r / g, (G - r) / l) for r in range(1, G))


def compare(w, cfg: dict) -> dict:
    """Every layout at every batch: async at each split and lag, sync_split at each split, colocated on all
    GPUs; the best async against the best of the rest, paired per seed."""
    G, seeds = cfg["gpus"], cfg["seeds"]
    plan: dict[str, list[Sim]] = {}
    params: dict[str, dict] = {}
    for suf, B in batches(w, G).items():
        for gr in cfg["splits"]:
            base = Sim(rollout_gpus=gr, learner_gpus=G - gr, groups_per_step=B, versions=cfg["versions"])
            for lag in cfg["lags"]:
                k = f"async_lag{lag}_{_split(gr, G)}{suf}"
                params[k] = {"mode": "async", "rollout_gpus": gr, "groups_per_step": B, "lag": lag}
                plan[k] = [replace(base, lag=lag, seed=s) for s in seeds]
            k = f"sync_split_{_split(gr, G)}{suf}"
            params[k] = {"mode": "sync_split", "rollout_gpus": gr, "groups_per_step": B}
            plan[k] = [replace(base, mode="sync_split", seed=s) for s in seeds]
        k = f"colocated_{G}{suf}"
        params[k] = {"mode": "colocated", "rollout_gpus": G, "groups_per_step": B}
        plan[k] = [Sim(mode="colocated", rollout_gpus=G - 1, learner_gpus=1, groups_per_step=B,
                       versions=cfg["versions"], seed=s) for s in seeds]
    settings = run_batches(w, plan, cfg.get("jobs", 1))
    table = {k: {"trained_traj_per_s": ci(v, "trained_traj_per_s"), "run_traj_per_s": ci(v, "run_traj_per_s"),
                 "first_version_s": ci(v, "first_version_s"), "stale_share": ci(v, "stale_share"),
                 "rollout_idle_share": ci(v, "rollout_idle_share"), "learner_idle_share": ci(v, "learner_idle_share"),
                 "balanced_rollout_gpus": ci(v, "balanced_rollout_gpus"),
                 "untrained_at_end": ci(v, "untrained_at_end"), "params": params[k],
                 "lag_hist": v[0]["lag_hist"], "workload": v[0]["workload"]} for k, v in settings.items()}
    best_async = max((k for k in table if k.startswith("async")), key=lambda k: table[k]["trained_traj_per_s"]["mean"])
    best_sync = max((k for k in table if not k.startswith("async")),
                    key=lambda k: table[k]["trained_traj_per_s"]["mean"])
    ratio = mean_ci([a["trained_traj_per_s"] / b["trained_traj_per_s"]
                     for a, b in zip(settings[best_async], settings[best_sync])])  # paired per seed
    # The overlap bound (Amdahl): every GPU busy, rollout and learner GPU-seconds per trajectory as the best
    # sync layout spent them (g, l): G / (g + l) trajectories/s. What async can gain over that layout is its
    # idle GPU time (a step's tail, the switch); it passes the bound only by keeping engines fuller.
    ref = settings[best_sync]
    g = statistics.mean(r["rollout_gpu_s_per_traj"] for r in ref)
    l_ = statistics.mean(r["learner_gpu_s_per_traj"] for r in ref)
    bound = G / (g + l_)
    # Async's own bound: its GPU-seconds per trajectory (engines as full as it kept them), every GPU busy, the
    # split in whole GPUs (r rollout GPUs train at most r / g_a trajectories/s, G - r learner GPUs (G - r) / l_a).
    ga = statistics.mean(r["rollout_gpu_s_per_traj"] for r in settings[best_async])
    la = statistics.mean(r["learner_gpu_s_per_traj"] for r in settings[best_async])
    whole = whole_gpu_bound(G, ga, la)
    sync_rate, async_rate = table[best_sync]["trained_traj_per_s"]["mean"], table[best_async]["trained_traj_per_s"]["mean"]
    return {"groups_per_step": batches(w, G), "table": table, "best_async": best_async, "best_sync": best_sync,
            "ratio": ratio, "bound_traj_per_s": bound,
            "bound_ratio": bound / sync_rate,
            "async_share_of_bound": async_rate / bound,
            "async_bound_ratio": G / (ga + la) / sync_rate, "async_whole_gpu_bound_ratio": whole / sync_rate,
            "async_share_of_whole_gpu_bound": async_rate / whole,
            "learner_gpu_share": l_ / (g + l_), "runs": {k: [light(r) for r in v] for k, v in settings.items()}}


def ablation(w, cfg: dict, best: dict) -> dict:
    """The scheduler's options one by one at the best async split (``best``: its ``params``), lag 2, at each
    batch (``batches``): at the full batch the engines have little room left, so the options show at the
    default one."""
    G, gr = cfg["gpus"], best["rollout_gpus"]
    plan, where = {}, {}
    for suf, B in batches(w, G).items():
        base = Sim(rollout_gpus=gr, learner_gpus=G - gr, groups_per_step=B, versions=cfg["versions"], lag=2)
        pre = base.pre_change()
        variants = {"pre-change": pre, "+ engine capacity, claimed rows": replace(pre, worker_capacity=True),
                    "+ engine capacity, rows on the engine": replace(pre, worker_capacity=True, decoding_rows=True),
                    "+ least loaded first": replace(pre, least_loaded=True),
                    "+ just in time": replace(pre, just_in_time=True),
                    "+ per-group put": replace(pre, per_group_put=True),
                    "+ version-blocked claims wait": replace(pre, version_wait=True),
                    "production, capacity in claimed rows": replace(base, decoding_rows=False),
                    "production, version-blocked claims return": replace(base, version_wait=False),
                    "production (all on)": base}
        for k, v in variants.items():
            plan[(suf, k)], where[(suf, k)] = [replace(v, seed=x) for x in cfg["seeds"]], B
    done = run_batches(w, plan, cfg.get("jobs", 1))
    out: dict[str, dict] = {}
    for (suf, k), rs in done.items():
        spread = [max(r["group_load"]) / max(1e-9, statistics.mean(r["group_load"])) for r in rs]
        at = out.setdefault(suf or "default", {"groups_per_step": where[(suf, k)], "variants": {}})
        at["variants"][k] = {"trained_traj_per_s": ci(rs, "trained_traj_per_s"), "stale_share": ci(rs, "stale_share"),
                             "max_over_mean_worker_groups": mean_ci(spread),
                             "learner_idle_share": ci(rs, "learner_idle_share"),
                             "rollout_idle_share": ci(rs, "rollout_idle_share")}
    return {"split": _split(gr, G), "lag": 2, "batches": out}


def projection(w, cfg: dict, progress=lambda what: None) -> dict:
    """Per GPU count, at both batches: async and sync_split over a coarse split sweep (at 512 and 1,024 the
    fraction best at 64, one seed), colocated on all GPUs; the best async against the best of the rest."""
    out, best_frac = {}, None
    for G in cfg["projection"]:
        seeds = cfg["projection_seeds_small"] if G <= 64 else [0]
        fracs = cfg["projection_splits"] if G <= 64 else [best_frac]
        plan: dict[str, list[Sim]] = {}
        where: dict[str, tuple] = {}  # setting -> (split fraction or None, groups per version)
        for suf, B in batches(w, G).items():
            for f in fracs:
                gr = min(G - 1, max(1, round(G * f)))
                base = Sim(rollout_gpus=gr, learner_gpus=G - gr, groups_per_step=B,
                           versions=cfg["projection_versions"])
                for name, s in (("async", base), ("sync_split", replace(base, mode="sync_split"))):
                    k = f"{name}_{_split(gr, G)}{suf}"
                    plan[k], where[k] = [replace(s, seed=x) for x in seeds], (f, B)
            k = f"colocated_{G}{suf}"
            plan[k] = [Sim(mode="colocated", rollout_gpus=G - 1, learner_gpus=1, groups_per_step=B,
                           versions=cfg["projection_versions"], seed=x) for x in seeds]
            where[k] = (None, B)
        done = run_batches(w, plan, cfg.get("jobs", 1))
        rows = {k: (*where[k], statistics.mean(r["trained_traj_per_s"] for r in rs)) for k, rs in done.items()}
        ba = max((k for k in rows if k.startswith("async")), key=lambda k: rows[k][2])
        bs = max((k for k in rows if not k.startswith("async")), key=lambda k: rows[k][2])
        if G <= 64:
            best_frac = rows[ba][0]
        # the same trajectories for both: the steady versions of the best async setting's batch
        trajs = rows[ba][1] * w.group_size * (cfg["projection_versions"] - 1)
        out[str(G)] = {"groups_per_step": batches(w, G), "seeds": seeds, "rates": {k: v[2] for k, v in rows.items()},
                       "best_async": ba, "best_sync": bs, "ratio": rows[ba][2] / rows[bs][2],
                       "trajs_steady": trajs, "async_s": trajs / rows[ba][2], "sync_s": trajs / rows[bs][2]}
        progress(f"{w.name}: {G}-GPU projection done")
    return out


# ------------------------------------------------------------------------------------ validation
def validation(cfg: dict, root: Path = REPO_ROOT) -> dict:
    doc = json.loads((root / "bench" / "results" / W.VALIDATION_RESULT).read_text())
    S = doc["extra"]["settings"]
    # The policy's turns follow from the lockstep settings' decode row-steps (every decoded row is trained
    # there); async's row-steps per trained trajectory also count the rows in flight when the stage ended.
    lockstep_rows = statistics.mean(r["metrics"]["decode_row_steps_per_trained_traj"]
                                    for k in ("sync", "sync_full", "colocated") for r in S[k])
    out = {}
    for name, kw in VALIDATION_SETTINGS.items():
        realised = {k: statistics.mean(r["metrics"][k] for r in S[name]) for k in REALISED_KEYS}
        realised["decode_row_steps_per_trained_traj"] = lockstep_rows
        realised["learner_tokens_per_traj"] = doc["extra"]["realised"][name]["learner_tokens_per_traj"]
        w = W.validation_workload(realised)
        # The paced engines' sleeps overran the cost model where the CPU could not keep pace; the simulator
        # charges the same engine seconds, and reports the error without that too.
        overrun = (sum(x["engine_overrun_s"] for r in S[name] for x in r["workers"])
                   / sum(x["engine_simulated_s"] for r in S[name] for x in r["workers"]))
        rs = runs(w, [Sim(seed=s, engine_time_scale=1.0 + overrun, **kw) for s in cfg["validation_seeds"]])
        raw = runs(w, [Sim(seed=s, **kw) for s in cfg["validation_seeds"]])
        measured = [r["metrics"]["trained_traj_per_s"] for r in S[name]]
        des = [r["run_traj_per_s"] for r in rs]
        m, d = statistics.mean(measured), statistics.mean(des)
        out[name] = {"measured": mean_ci(measured), "des": mean_ci(des), "rel_error": d / m - 1.0,
                     "within_10pct": abs(d / m - 1.0) <= 0.10, "engine_overrun_share": overrun,
                     "des_at_cost_model": mean_ci([r["run_traj_per_s"] for r in raw]),
                     "rel_error_at_cost_model": statistics.mean(r["run_traj_per_s"] for r in raw) / m - 1.0,
                     "measured_rows_per_step": statistics.mean(r["metrics"]["engine_mean_live_rows"] for r in S[name]),
                     "des_rows_per_step": statistics.mean(r["workload"]["rows_per_step_mean"] for r in rs),
                     "measured_wall_s": statistics.mean(r["metrics"]["wall_s"] for r in S[name]),
                     "des_wall_s": statistics.mean(r["wall_s"] for r in rs),
                     "measured_lag_hist": S[name][0]["lag_hist"], "des_lag_hist": rs[0]["lag_hist"],
                     "des_group_load": rs[0]["group_load"], "workload": w.note, "des_workload": rs[0]["workload"]}
    return out


# ------------------------------------------------------------------------------------ README block
def _ci(c: dict, fmt: str = "{:.2f}") -> str:
    if c["n"] < 2 or math.isnan(c["half"]):
        return fmt.format(c["mean"])
    return f"{fmt.format(c['mean'])} ± {fmt.format(c['half'])}"


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's schedule-sim block: validation, the 8-GPU comparison per workload, the ablation and
    the projection (pure: no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)."""
    e = doc["extra"]
    lines = ["Validation against the real system (`" + e["validation_result"] + "`, trained traj/s over the whole "
             "run, mean ± 95 % half-width over seeds):", "",
             "| setting | measured | simulated | error | engines' measured overrun | error without it | "
             "rows per decode step, measured → simulated |",
             "|---|---|---|---|---|---|---|"]
    for k, v in e["validation"].items():
        overrun = f"{100 * v['engine_overrun_share']:.1f} % | {100 * v['rel_error_at_cost_model']:+.1f} % | "
        lines.append(f"| {k} | {_ci(v['measured'])} | {_ci(v['des'])} | {100 * v['rel_error']:+.1f} % | {overrun}"
                     f"{v['measured_rows_per_step']:.1f} → {v['des_rows_per_step']:.1f} |")
    lines += ["", "8 GPUs, steady-state trained traj/s (mean ± 95 % half-width over seeds; split = rollout + learner GPUs):",
              "", "| workload | best async | best sync | async / sync | stale | overlap bound | async of bound | "
                  "async's own bound, whole GPUs | async of it | learner share | turns mean / p90 / max | tool calls | "
                  "decode ctx | learner tokens/traj |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for wn, c in e["compare"].items():
        a, s = c["table"][c["best_async"]], c["table"][c["best_sync"]]
        wl = a["workload"]
        lines.append(f"| {wn} | `{c['best_async']}` {_ci(a['trained_traj_per_s'], '{:.3g}')} | `{c['best_sync']}` "
                     f"{_ci(s['trained_traj_per_s'], '{:.3g}')} | {_ci(c['ratio'])}× | "
                     f"{100 * a['stale_share']['mean']:.1f} % | {c['bound_ratio']:.2f}× | "
                     f"{100 * c['async_share_of_bound']:.0f} % | {c['async_whole_gpu_bound_ratio']:.2f}× | "
                     f"{100 * c['async_share_of_whole_gpu_bound']:.0f} % | {100 * c['learner_gpu_share']:.0f} % | "
                     f"{wl['turns_mean']:.1f} / {wl['turns_p90']:.0f} / {wl['turns_max']} | {wl['tool_calls_mean']:.1f} | "
                     f"{wl['decode_context_mean']:,.0f} | {wl['learner_tokens_per_traj']:,.0f} |")
    abl = {wn: ab["batches"] for wn, ab in e["ablation"].items()}  # per batch: "default" and "_full"
    for at in dict.fromkeys(k for per in abl.values() for k in per):
        gps = ", ".join(f"{wn} {per[at]['groups_per_step']}" for wn, per in abl.items() if at in per)
        split = ", ".join(f"{wn} {ab['split']}" for wn, ab in e["ablation"].items())
        lines += ["", f"Ablation at 8 GPUs (async, lag 2, the best async split: {split}; "
                  f"{'the default batch' if at == 'default' else 'the full batch'}"
                  f", groups per version: {gps}), steady-state trained traj/s, the rollout GPUs' idle share and the "
                  "busiest worker's groups over the mean:", "",
                  "| variant | " + " | ".join(f"{wn} traj/s | {wn} rollout idle | {wn} busiest/mean" for wn in abl) + " |",
                  "|---|" + "---|---|---|" * len(abl)]
        names = list(dict.fromkeys(k for per in abl.values() if at in per for k in per[at]["variants"]))
        for k in names:
            cells = []
            for per in abl.values():
                v = per.get(at, {"variants": {}})["variants"].get(k)
                cells += ["—"] * 3 if v is None else [
                    _ci(v["trained_traj_per_s"], "{:.3g}"), f"{100 * v['rollout_idle_share']['mean']:.0f} %",
                    f"{v['max_over_mean_worker_groups']['mean']:.2f}"]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "Projection (best of a coarse split sweep per size; compute seconds for the same steady-state "
              "trajectories, async → best sync):", "",
              "| GPUs | " + " | ".join(f"{wn} async / best sync | {wn} seconds" for wn in e["projection"]) + " |",
              "|---|" + "---|---|" * len(e["projection"])]
    sizes = list(next(iter(e["projection"].values())))
    for G in sizes:
        cells = []
        for wn, pr in e["projection"].items():
            p = pr[G]
            cells += [f"{p['ratio']:.2f}× (`{p['best_async']}` / `{p['best_sync']}`)",
                      f"{p['async_s']:,.0f} → {p['sync_s']:,.0f} s"]
        lines.append(f"| {int(G):,} | " + " | ".join(cells) + " |")
    lines += ["", f"Simulated by `sonar bench schedule-sim` on commit {doc['commit']} ({len(e['seeds'])} seeds at 8 GPUs; "
              f"{e['wall_s']:.0f} s of CPU)."]
    return readme_block(NAME, json_name, lines)


# ------------------------------------------------------------------------------------ main
def run(cfg: dict) -> tuple[dict, dict]:
    t0 = time.time()

    def progress(what: str) -> None:  # a full run takes a while on a laptop: say where it is
        print(f"[{NAME}] {what} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    extra = {"seeds": cfg["seeds"], "validation_result": W.VALIDATION_RESULT, "validation": validation(cfg), "compare": {}, "ablation": {}, "projection": {},
             "workloads": {k: {f: (v if not isinstance(v, tuple) else list(v)) for f, v in asdict(w).items()}
                           for k, w in W.WORKLOADS.items()}}
    metrics = {"validation_rel_error": {k: summarise([v["rel_error"]]) for k, v in extra["validation"].items()}}
    progress("validation done")
    for name, w in W.WORKLOADS.items():
        c = compare(w, cfg)
        extra["compare"][name] = c
        progress(f"{name}: {cfg['gpus']}-GPU comparison done")
        extra["ablation"][name] = ablation(w, cfg, c["table"][c["best_async"]]["params"])
        progress(f"{name}: ablation done")
        extra["projection"][name] = projection(w, cfg, progress)
        metrics.setdefault("async_over_best_sync", {})[name] = summarise(
            [a["trained_traj_per_s"] / b["trained_traj_per_s"] for a, b in
             zip(c["runs"][c["best_async"]], c["runs"][c["best_sync"]])])
    return metrics, extra


def plot(extra: dict, png: Path) -> None:
    """The figure of a result, drawn from its ``extra`` (so a committed JSON redraws it): per workload, async
    over the best synchronous layout against the GPU count (projection), and the validation's simulated over
    measured trained traj/s per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, proj in extra["projection"].items():
        gpus = sorted(proj, key=int)
        ax.plot([int(g) for g in gpus], [proj[g]["ratio"] for g in gpus], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("async / best sync (trained traj/s)")
    ax.set_title("projection (simulated)")
    ax.legend()
    val = extra["validation"]
    names = list(val)
    bx.bar(names, [v["des"]["mean"] / v["measured"]["mean"] for v in val.values()])
    bx.axhline(1.0, color="grey", lw=0.8)
    for y in (0.9, 1.1):
        bx.axhline(y, color="grey", lw=0.6, ls="--")
    bx.set_ylabel("simulated / measured")
    bx.set_title("validation against the real run")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", help="seeds at 8 GPUs (default 0-4)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="simulations run at once, each in its own process (default: the CPUs; the results equal "
                        "a serial run's)")
    args = p.parse_args(argv)
    cfg = bench_settings(args, QUICK, FULL)
    cfg.pop("repeats", None)
    if args.seeds:
        cfg["seeds"] = list(args.seeds)
    cfg["jobs"] = max(1, args.jobs)
    cfg["quick"] = args.quick
    t0 = time.time()
    metrics, extra = run(cfg)
    extra["wall_s"] = round(time.time() - t0, 1)
    path = write_result(NAME, cfg, metrics, lambda png: plot(extra, png), args.out, extra=extra)
    print(f"[{NAME}] wrote {path} in {extra['wall_s']} s")
    for k, v in extra["validation"].items():
        print(f"[{NAME}] validation {k}: measured {v['measured']['mean']:.3f}, simulated {v['des']['mean']:.3f} "
              f"traj/s ({100 * v['rel_error']:+.1f} %)")
    for wn, c in extra["compare"].items():
        print(f"[{NAME}] {wn}: {c['best_async']} / {c['best_sync']} = {c['ratio']['mean']:.2f}x "
              f"[{c['ratio']['lo']:.2f}, {c['ratio']['hi']:.2f}], bound {c['bound_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
