"""sensitivity: when does asynchronous RL pay? The async-vs-sync speedup as one knob at a time moves.

Question (issue 11, "Sensitivity"): the speedup of async (lag 2) over the synchronous baseline as (a)
the learner's share of a step, (b) the tail of the reasoning lengths and (c) the batch size vary, so a
reader sees when async pays and when it does not. One knob moves at a time from a base point (a
one-at-a-time sweep, not a grid):

- ``learner_delay_ms`` (SIMULATED learner time, ``sim.learner_delay_ms``: the driver waits this long
  after every RL step, ``bench/sim/hooks.py LearnerDelay``): a bigger learner share means more to
  overlap with generation;
- ``decode_sigma`` (``sim.decode_sigma``, the lognormal sigma of the hidden reasoning tokens per turn):
  a longer tail means sync waits longer for its slowest trajectory;
- ``groups_per_step`` (``learner.groups_per_step``): the batch of one learner step.

Every point runs sync and async lag 2 through async-vs-sync's own ``run_setting`` (one place below,
``_run_pair``), under the decode cost model named in ``config.cost_model`` (``sim.decode_cost``,
default here ``gpu_7b``: ``bench/sim/gpu_cost.py``, calibrated to published vLLM measurements) and
reports ``metrics["speedup"]["<knob>=<value>"]`` (sync RL-loop wall / async RL-loop wall, one seed
per point unless ``--seeds``), the stale share and the sync step's learner share beside it.

``--quick`` (CI smoke test): async-vs-sync's quick workload (120 entities, no SFT, 2 RL steps), the base
point and one learner-delay point: 4 runs.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from sonar.bench.common import REPO_ROOT, bench_settings, driver_bench_parser, setup_env, summarise, write_result

setup_env()

NAME = "sensitivity"
LAG = 2
FULL = {"axes": {"learner_delay_ms": [0, 250, 1000], "decode_sigma": [0.7, 0.3, 1.2], "groups_per_step": [8, 4, 16]},
        "seeds": [0], "overrides": ["sim.decode_cost=gpu_7b"]}
QUICK = {"axes": {"learner_delay_ms": [200]}, "seeds": [0], "overrides": ["sim.decode_cost=gpu_7b"]}
"""``--quick``: the base point only (one sync and one async run), with one knob set away from its default,
so the run checks the plumbing (a knob's override reaches the runs and the learner share counts it); the
one-at-a-time grid itself is pure (``points``) and tested without runs."""
KNOBS = {"learner_delay_ms": "sim.learner_delay_ms", "decode_sigma": "sim.decode_sigma",
         "groups_per_step": "learner.groups_per_step"}
"""Axis name -> the config key it sets."""
log = logging.getLogger("sonar.bench")


def knob(axis: str, value) -> list[str]:
    """The overrides that set ``axis`` to ``value``."""
    if axis not in KNOBS:
        raise ValueError(f"{NAME}: unknown axis {axis!r}; known: {list(KNOBS)}")
    out = [f"{KNOBS[axis]}={value}"]
    if axis == "groups_per_step":  # the replay must hold a step's groups (run_setting sizes it per mode too)
        out.append(f"replay.capacity_groups={max(1, LAG) * int(value)}")
    return out


def points(axes: dict[str, list]) -> list[tuple[str, list[str]]]:
    """(label, overrides) per point: ``base`` (every axis at its first value), then each further value of
    each axis with the others at their first."""
    base = [o for axis, values in axes.items() for o in knob(axis, values[0])]
    out = [("base", base)]
    for axis, values in axes.items():
        for v in values[1:]:
            out.append((f"{axis}={v}", [o for a, vals in axes.items() for o in knob(a, v if a == axis else vals[0])]))
    return out


def _run_pair(overrides: list[str], model_path, run_root: Path, tag: str, seed: int) -> dict:
    """sync and async lag LAG at one point; the one place this benchmark calls async-vs-sync."""
    from sonar.bench import async_vs_sync as A

    sync = A.run_setting(overrides, "sync", None, model_path, run_root, f"{tag}-sync", seed=seed)
    asyn = A.run_setting(overrides, "async", LAG, model_path, run_root, f"{tag}-async{LAG}", seed=seed)
    return {"sync": sync["metrics"], "async": asyn["metrics"]}


def learner_share(m: dict, delay_ms: float) -> float:
    """The sync step's learner share: (train + weight push + simulated delay) per step / seconds per step."""
    return (m["train_s_per_step"] + m["sync_s_per_step"] + delay_ms / 1000.0) / max(1e-9, m["seconds_per_step"])


def run(cfg_bench: dict) -> tuple[dict, dict]:
    from sonar.bench import async_vs_sync as A
    from sonar.bench.driver_harness import load_cfg, loadavg, start_ray
    from sonar.bench.sim.gpu_cost import sim_cost_label

    base_ov = list(cfg_bench["overrides"])
    base, sim = load_cfg([A.CONFIG], base_ov)
    sft_stage, _ = A.split_stages(base)
    owns = start_ray(base)
    import ray

    rows: dict[str, list[dict]] = {}
    try:
        model_path, sft_info = A.sft_checkpoint(base, sim, sft_stage)
        run_root = Path(base.run.root).resolve() / "bench-sensitivity"
        for label, ov in points(cfg_bench["axes"]):
            cfg_p, sim_p = load_cfg([A.CONFIG], base_ov + ov)
            for seed in cfg_bench["seeds"]:
                t0 = time.time()
                pair = _run_pair(base_ov + ov, model_path, run_root, f"{label.replace('=', '')}-s{seed}", seed)
                s, a = pair["sync"], pair["async"]
                row = {"speedup": s["wall_s"] / a["wall_s"], "sync_wall_s": s["wall_s"], "async_wall_s": a["wall_s"],
                       "sync_learner_share": learner_share(s, sim_p.learner_delay_ms),
                       "async_stale_share": a.get("stale_share", float("nan")),
                       "sync_trained_traj_per_s": s.get("trained_traj_per_s", s.get("trajectories_per_s")),
                       "async_trained_traj_per_s": a.get("trained_traj_per_s", a.get("trajectories_per_s")),
                       "seed": seed, "overrides": ov, "cost_model": sim_cost_label(sim_p)["decode_cost"],
                       "loadavg_after": loadavg()}
                rows.setdefault(label, []).append(row)
                log.info("%s seed %d: speedup %.2fx (sync %.1f s, async %.1f s), sync learner share %.2f, "
                         "stale share %.2f (%.0f s)", label, seed, row["speedup"], row["sync_wall_s"],
                         row["async_wall_s"], row["sync_learner_share"], row["async_stale_share"], time.time() - t0)
    finally:
        if owns:
            ray.shutdown()

    metrics: dict[str, dict] = {}
    for key in ("speedup", "sync_learner_share", "async_stale_share"):
        group = {label: summarise([r[key] for r in rs]) for label, rs in rows.items()
                 if all(np.isfinite(r[key]) for r in rs)}
        if group:
            metrics[key] = group
    extra = {"points": rows, "lag": LAG, "sft": sft_info, "cost_model": sim_cost_label(sim),
             "note": "one knob at a time from the base point; speedup = sync RL-loop wall / async lag-2 RL-loop wall "
                     "(same seed, same steps). learner_delay_ms is SIMULATED learner time (the driver waits after "
                     "each step)."}
    return metrics, extra


def plot(metrics: dict, extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    labels = list(metrics["speedup"])
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    vals = [metrics["speedup"][k]["median"] for k in labels]
    ax.bar(labels, vals, color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    for i, v in enumerate(vals):
        ax.annotate(f"{v:.2f}x", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"speedup (sync / async lag {extra['lag']})")
    ax.set_title(f"async speedup, one knob at a time; decode cost {extra['cost_model'].get('decode_cost')}",
                 fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's sensitivity table: per point, the median over its seeds of the speedup, the two RL
    walls and trained trajectories/s, the sync step's learner share and async's stale share (pure: no runs;
    `sonar bench readme`, tests/bench/test_readme_blocks.py)."""
    from sonar.bench.common import readme_block

    def med(rows: list[dict], key: str) -> float:
        return float(np.median([r[key] for r in rows]))

    lines = ["| point | speedup | sync → async RL wall | trained traj/s, sync → async | sync learner share | "
             "async stale |", "|---|---|---|---|---|---|"]
    for label, rows in doc["extra"]["points"].items():
        lines.append(f"| `{label}` | {med(rows, 'speedup'):.2f}× | {med(rows, 'sync_wall_s'):.1f} → "
                     f"{med(rows, 'async_wall_s'):.1f} s | {med(rows, 'sync_trained_traj_per_s'):.1f} → "
                     f"{med(rows, 'async_trained_traj_per_s'):.1f} | {med(rows, 'sync_learner_share'):.2f} | "
                     f"{100 * med(rows, 'async_stale_share'):.1f} % |")
    return readme_block(NAME, json_name, lines)


def main(argv: list[str] | None = None) -> int:
    from sonar.bench import async_vs_sync as A

    p = driver_bench_parser(NAME, __doc__.splitlines()[0], "configs/bench.yaml")
    p.add_argument("--seeds", type=int, nargs="+", help="run.seed values per point (default 0)")
    p.add_argument("--decode-cost", choices=["flat", "gpu_7b"], default=None,
                   help="sim.decode_cost for every point (default gpu_7b)")
    args = p.parse_args(argv)
    cfg = bench_settings(args, QUICK, FULL)
    cfg.pop("repeats", None)
    if args.quick:  # async-vs-sync's quick workload, then this benchmark's own overrides
        cfg["overrides"] = [o for o in A.QUICK["overrides"] if not o.startswith("sim.decode_ms_per_token")] \
            + cfg["overrides"]
    if args.seeds:
        cfg["seeds"] = list(args.seeds)
    if args.decode_cost:
        cfg["overrides"].append(f"sim.decode_cost={args.decode_cost}")
        if args.decode_cost == "flat" and not any(o.startswith("sim.decode_ms_per_token") for o in args.overrides):
            cfg["overrides"].append("sim.decode_ms_per_token=10.0")
    cfg["overrides"] += args.overrides
    from sonar.bench.driver_harness import load_cfg
    from sonar.bench.sim.gpu_cost import sim_cost_label

    _, sim = load_cfg([A.CONFIG], cfg["overrides"])
    cfg.update(quick=args.quick, config_file=str(A.CONFIG.relative_to(REPO_ROOT)), sim=sim.to_dict(),
               cost_model=sim_cost_label(sim), lag=LAG)
    t0 = time.time()
    metrics, extra = run(cfg)
    extra["wall_s"] = round(time.time() - t0, 1)
    path = write_result(NAME, cfg, metrics, lambda png: plot(metrics, extra, png), args.out, extra=extra)
    print(f"[{NAME}] wrote {path} in {extra['wall_s']} s (decode cost {extra['cost_model'].get('decode_cost')})")
    for label, sm in metrics.get("speedup", {}).items():
        print(f"[{NAME}] {label}: speedup {sm['median']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
