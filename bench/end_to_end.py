"""end-to-end: what does the default training run cost -- throughput, where a learner step goes, peak memory?

Question (issue 6, item 6): run the default config (``configs/tiny.yaml``, what ``sonar train`` runs:
SFT, evaluation before RL, async GRPO, evaluation after, export) through the production driver
functions and report tokens/s, trajectories/s, the time per RL learner step split into generate,
retrieve, train and sync, and the peak memory of all processes together.

How it runs: ``bench.driver_harness.run_training`` calls the driver's own functions in
``train()``'s order (start_run, start_roles, run_sft_stage / run_rl_stage, verify_weights, evaluate,
export_model) and reads the rollout workers' cumulative stats before and after each stage.

The per-step split, RL stage only (``steps`` learner steps in ``loop_s`` seconds; per step means):

- learner view (adds up to the step's wall-clock): ``train_s`` (``learner/step_time_s``: collate,
  forward, backward, optimizer), ``sync_s`` (``weights/sync_s``: the learner's bucketed broadcast),
  ``learner_wait_s`` (``learner/wait_s``: blocked on the replay queue for a full batch) and
  ``driver_other_s`` (the rest: health checks, replay stats, logging, Ray round trips);
- rollout view, per worker (runs concurrently with the learner in async mode, so it does not add to
  the learner's view): ``generate_s`` and ``retrieve_s`` (the workers' ``gen_s`` / ``retrieve_s``
  divided by workers and steps), ``rollout_other_s`` (the rest of the worker's time: parsing,
  rewards, codec, replay put incl. backpressure).

Critical path (issue 11): ``rl/critical/*`` are the driver's own per-step seconds split into the phases
it runs in sequence (sync generation, health checks, queue wait, learner compute, learner RPC, weight
broadcast, engine load, logging, other; ``cluster/driver/critical_path.py``): unlike the rollout view,
they add up to ``rl/critical/wall_s`` (``rl/critical/parts_over_wall`` is 1 by construction; the test
checks it on the quick run).

Throughput: ``rl/generated_tokens_per_s`` (model tokens written by all workers / RL loop seconds),
``rl/learner_tokens_per_s`` (the learner's own ``learner/tokens_per_s`` while stepping, padded
batch tokens), ``rl/trajectories_per_s`` (trajectories consumed by the learner / RL loop seconds),
``sft/tokens_per_s``.

Peak memory (``bench.driver_harness.ProcessTreeSampler``): every 0.5 s (less often where a sample costs
more than 5 % of a core: the interval used is in the result) a background thread sums the
memory of the driver and all its descendants -- with a local cluster started by this process, the
GCS, raylet and (through the raylet) every actor -- plus any process whose command line names this
Ray session's directory (covers a cluster that was joined, not started). PSS (shared pages split
among their users) is the footprint; the RSS sum over-counts shared libraries and the object store
and is reported too. A sampler can miss a peak shorter than its interval.

``--quick`` (CI smoke test, < 1 minute): ``configs/smoke.yaml`` with 5 SFT steps, 3 RL steps and 8
held-out questions -- it checks the plumbing and the JSON, not the numbers.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from sonar.bench.common import REPO_ROOT, bench_settings, driver_bench_parser, setup_env, summarise, write_result
from sonar.cluster.wire import metrics as K

setup_env()

NAME = "end-to-end"
FULL = {"config": "configs/tiny.yaml", "overrides": [], "repeats": 1}
QUICK = {"config": "configs/smoke.yaml", "repeats": 1,
         "overrides": ["stages.0.steps=5", "stages.1.steps=3", "world.num_heldout_eval=8", "eval.no_search=false",
                       "eval.batch_size=8"]}
log = logging.getLogger("sonar.bench")
CRITICAL_KEYS = (K.CRIT_WALL, K.CRIT_GENERATE_SYNC, K.CRIT_HEALTH, K.CRIT_SWITCH, K.CRIT_QUEUE_WAIT,
                 K.CRIT_LEARNER_COMPUTE, K.CRIT_LEARNER_RPC, K.CRIT_BROADCAST, K.CRIT_ENGINE_LOAD, K.CRIT_LOG,
                 K.CRIT_OTHER)
"""The driver's per-step critical-path split (``learner/critical/*``), reported as ``rl/critical/<part>``."""


def measure(res: dict, sampler: dict, cfg) -> dict:
    from sonar.bench.driver_harness import series

    m: dict[str, float] = {"wall_s": res["total_s"], "startup_s": res["startup_s"]}
    for st in res["stages"]:
        h = st["history"]
        if st["kind"] == "sft":
            m["sft/seconds"] = st["seconds"]
            m["sft/seconds_per_step"] = st["seconds"] / max(1, st["steps"])
            if series(h, K.LEARNER_TOKENS_PER_S):
                m["sft/tokens_per_s"] = float(np.mean(series(h, K.LEARNER_TOKENS_PER_S)))
            continue
        loop = float(st["loop_seconds"])
        steps = max(1, len(series(h, K.LEARNER_VERSION)))
        w = st["workers"]
        n_w = max(1, len(w))
        step = loop / steps
        train = float(np.mean(series(h, K.LEARNER_STEP_TIME) or [0.0]))
        sync = float(np.sum(series(h, K.WEIGHTS_SYNC_S))) / steps
        wait = float(np.mean(series(h, K.LEARNER_WAIT_S) or [0.0]))
        gen = sum(x.get("gen_s", 0.0) for x in w) / n_w / steps
        ret = sum(x.get("retrieve_s", 0.0) for x in w) / n_w / steps
        m.update({
            "rl/seconds": st["seconds"], "rl/loop_seconds": loop, "rl/steps": float(steps),
            "rl/step_wall_s": step,
            "rl/step/train_s": train, "rl/step/sync_s": sync, "rl/step/learner_wait_s": wait,
            "rl/step/driver_other_s": max(0.0, step - train - sync - wait),
            "rl/step/generate_s": gen, "rl/step/retrieve_s": ret,
            "rl/step/rollout_other_s": max(0.0, step - gen - ret),
            "rl/generated_tokens_per_s": sum(x.get("model_tokens", 0) for x in w) / loop,
            "rl/trajectories_per_s": float(res["replay"]["consumed"]) / loop,
            "rl/produced_trajectories_per_s": sum(x.get("trajectories", 0) for x in w) / loop,
            "rl/searches_per_s": sum(x.get("searches", 0) for x in w) / loop,
        })
        # Steps whose groups all had equal rewards are skipped (dynamic sampling) and report no tokens/s;
        # 0.0 then means "no step trained", as in an untrained --quick policy.
        m["rl/learner_tokens_per_s"] = float(np.mean(series(h, K.LEARNER_TOKENS_PER_S) or [0.0]))
        m["rl/learner_skipped_steps"] = float(sum(series(h, K.LEARNER_SKIPPED_STEP)))
        # The critical path (cluster/driver/critical_path.py): the driver's own clock per trained step, cut
        # into the phases it ran in sequence; the parts add up to rl/critical/wall_s (unlike the rollout
        # view above, which sums lanes).
        crit = {k: series(h, k) for k in CRITICAL_KEYS}
        if crit[K.CRIT_WALL]:
            for k, xs in crit.items():
                m["rl/critical/" + k.rsplit("/", 1)[1]] = float(np.mean(xs or [0.0]))
            parts = sum(m["rl/critical/" + k.rsplit("/", 1)[1]] for k in CRITICAL_KEYS if k != K.CRIT_WALL)
            m["rl/critical/parts_over_wall"] = parts / max(m["rl/critical/wall_s"], 1e-12)
        if series(h, K.ROLLOUT_REWARD_MEAN):
            m["rl/reward_last"] = float(np.mean(series(h, K.ROLLOUT_REWARD_MEAN)[-max(1, steps // 5):]))
    m["eval_and_export_s"] = max(0.0, res["total_s"] - res["startup_s"] - sum(s["seconds"] for s in res["stages"]))
    if res.get("eval"):
        m["eval/after_search_em"] = float(res["eval"]["search"]["em"])
    m["memory/peak_pss_gb"] = sampler["peak_pss_gb"]
    m["memory/peak_rss_gb"] = sampler["peak_rss_gb"]
    return m


def run(bcfg: dict, run_root: str | None) -> tuple[dict, dict]:
    from sonar.bench.driver_harness import (ProcessTreeSampler, device_info, load_cfg, load_note, loadavg,
                                             run_training, start_ray)

    ov = list(bcfg["overrides"]) + ([f"run.root={run_root}"] if run_root else [])
    reps, mems, extras = [], [], []
    load = {"start": loadavg()}
    for rep in range(bcfg["repeats"]):
        cfg, sim = load_cfg([REPO_ROOT / bcfg["config"]], ov + [f"run.name={NAME}-r{rep}"])
        import ray

        owns = start_ray(cfg)
        try:
            with ProcessTreeSampler(interval_s=0.5) as sampler:
                res = run_training(cfg, sim, evaluate_after=True, export=True)
            mem = sampler.result()
            t_origin = sampler.t0
            series_ = [(round(t, 2), round(p / 2**30, 3)) for t, _, p in sampler.series]
        finally:
            if owns:
                ray.shutdown()
        m = measure(res, mem, cfg)
        reps.append(m)
        mems.append(mem)
        extras.append({"run_dir": res["run_dir"], "eval": res["eval"], "replay": res["replay"],
                       "stages": [{k: v for k, v in s.items() if k != "history"} | {
                           "t_start_rel": s["t_start"] - t_origin, "t_end_rel": s["t_end"] - t_origin}
                           for s in res["stages"]],
                       "memory": mem, "memory_series_gb": series_, "device": device_info(cfg, sim)})
        log.info("%s rep %d: %s", NAME, rep, json.dumps({k: round(v, 3) for k, v in m.items()}))
    load["end"] = loadavg()
    keys = sorted({k for m in reps for k in m})
    metrics = {k: summarise([m[k] for m in reps if k in m]) for k in keys}
    extra = {"repeats": extras, "loadavg": load,
             "note": load_note(load),
             "split_note": "learner view adds up to rl/step_wall_s; the rollout view is per worker and overlaps the "
                           "learner in async mode"}
    return metrics, extra


def plot(metrics: dict, extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    med = lambda k: metrics.get(k, {}).get("median", 0.0)  # noqa: E731
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1, 1, 1.6]})
    learner = [("rl/step/train_s", "train"), ("rl/step/sync_s", "sync (broadcast)"),
               ("rl/step/learner_wait_s", "learner waits for data"), ("rl/step/driver_other_s", "driver/other")]
    rollout = [("rl/step/generate_s", "generate"), ("rl/step/retrieve_s", "retrieve"),
               ("rl/step/rollout_other_s", "rollout other")]
    for col, parts in ((0, learner), (1, rollout)):
        bottom = 0.0
        for k, label in parts:
            v = med(k)
            ax[0].bar([col], [v], bottom=bottom, label=label)
            bottom += v
    ax[0].set_xticks([0, 1], ["learner view", "rollout view\n(per worker)"])
    ax[0].set_ylabel("seconds per RL learner step")
    ax[0].set_title(f"RL step split (wall {med('rl/step_wall_s'):.2f} s/step)")
    ax[0].set_ylim(0, 1.7 * max(med("rl/step_wall_s"), 1e-6))
    ax[0].legend(fontsize=7, loc="upper center", ncol=2)
    names = [("rl/generated_tokens_per_s", "gen tok/s"), ("rl/learner_tokens_per_s", "learner tok/s"),
             ("sft/tokens_per_s", "SFT tok/s")]
    ax[1].bar([n for _, n in names], [med(k) for k, _ in names], color=["tab:green", "tab:blue", "tab:gray"])
    ax[1].set_ylabel("tokens/s")
    ax[1].set_title(f"throughput ({med('rl/trajectories_per_s'):.1f} traj/s trained)")
    rep = extra["repeats"][-1]
    ts = rep["memory_series_gb"]
    if ts:
        ax[2].plot([t for t, _ in ts], [p for _, p in ts], color="tab:red", label="PSS sum, all processes")
    for s in rep["stages"]:
        ax[2].axvspan(s["t_start_rel"], s["t_end_rel"], alpha=0.12, color="tab:blue" if s["kind"] == "rl" else "tab:gray")
        ax[2].annotate(s["kind"], (s["t_start_rel"], 0.03), xycoords=("data", "axes fraction"), fontsize=8)
    ax[2].set_xlabel("seconds since start")
    ax[2].set_ylabel("GiB")
    ax[2].set_title(f"memory (peak PSS {med('memory/peak_pss_gb'):.2f} GiB, RSS sum {med('memory/peak_rss_gb'):.2f} GiB)")
    ax[2].legend(fontsize=8)
    dev = rep["device"]
    fig.suptitle(f"end to end -- {extra['config_file']}, engine={dev['rollout_engine']} on {dev['rollout_device']}, "
                 f"learner on {dev['learner_device']} ({dev['broadcast_backend']}); wall {med('wall_s'):.0f} s; "
                 f"{extra['note']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# bench/README.md's rendering of a result (pure: no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)

CRITICAL_ROWS = (("generation in sync mode (the step's batch, before training)", (K.CRIT_GENERATE_SYNC,)),
                 ("learner compute (collate, forward, backward, optimizer)", (K.CRIT_LEARNER_COMPUTE,)),
                 ("queue wait (the rollout side's cost not hidden by async)", (K.CRIT_QUEUE_WAIT,)),
                 ("health checks (workers and retrieval replicas)", (K.CRIT_HEALTH,)),
                 ("learner RPC (group decode, Ray round trip, version)", (K.CRIT_LEARNER_RPC,)),
                 ("weight broadcast (bucketed send)", (K.CRIT_BROADCAST,)),
                 ("engine load (workers receive and stage)", (K.CRIT_ENGINE_LOAD,)),
                 ("phase switch (colocated: engines asleep and awake, learner states moved)", (K.CRIT_SWITCH,)),
                 ("logging, other", (K.CRIT_LOG, K.CRIT_OTHER)))
"""The critical-path table's rows: label and the parts it adds (a row whose parts are all 0 is left out)."""


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's critical-path table: an RL step's parts (``rl/critical/*``, each the mean over the
    steps) in seconds and as a share of the step's wall time."""
    from sonar.bench.common import readme_block

    m = doc["metrics"]

    def part(key: str) -> float:  # a result written before a part existed lacks it: 0
        return m.get("rl/critical/" + key.rsplit("/", 1)[1], {"median": 0.0})["median"]

    wall = part(K.CRIT_WALL)
    lines = ["| part | s per step | share |", "|---|---|---|"]
    for label, keys in CRITICAL_ROWS:
        s = sum(part(k) for k in keys)
        if s > 0:
            lines.append(f"| {label} | {s:.3f} | {100 * s / wall:.0f} % |")
    lines.append(f"| **wall** | **{wall:.3f}** | 100 % |")
    return readme_block(NAME, json_name, lines)


def main(argv: list[str] | None = None) -> int:
    p = driver_bench_parser(NAME, __doc__.splitlines()[0], "the config")
    p.add_argument("--config", help="config file (default configs/tiny.yaml; quick: configs/smoke.yaml)")
    p.add_argument("--run-root", help="where run directories go (default: the config's run.root)")
    args = p.parse_args(argv)
    bcfg = bench_settings(args, QUICK, FULL)
    if args.config:
        bcfg["config"] = args.config
    bcfg["overrides"] += args.overrides
    from sonar.bench.driver_harness import load_cfg
    from sonar.cluster.wire.config import to_dict

    resolved, sim = load_cfg([REPO_ROOT / bcfg["config"]], bcfg["overrides"])
    bcfg.update(quick=args.quick, resolved=to_dict(resolved), sim=sim.to_dict())
    t0 = time.time()
    metrics, extra = run(bcfg, args.run_root)
    extra["wall_s"] = round(time.time() - t0, 1)
    extra["config_file"] = bcfg["config"]
    path = write_result(NAME, bcfg, metrics, lambda png: plot(metrics, extra, png), args.out, extra=extra)
    print(f"[{NAME}] wrote {path} and {path.with_suffix('.png').name} in {extra['wall_s']} s")
    for k in ("rl/step_wall_s", "rl/step/train_s", "rl/step/sync_s", "rl/step/learner_wait_s", "rl/step/generate_s",
              "rl/step/retrieve_s", "rl/generated_tokens_per_s", "rl/trajectories_per_s", "memory/peak_pss_gb"):
        if k in metrics:
            print(f"[{NAME}] {k}: {metrics[k]['median']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
