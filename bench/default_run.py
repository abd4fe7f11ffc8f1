"""default-run: what does ``make run`` (``sonar train`` on the default preset) give on this machine?

Question (issue 25: the README's results generated, one number per fact, measured on the commit): run
the command the README tells a newcomer to run, ``sonar train run.seed=S model.seed=S``, once per
training seed, as a separate process exactly as a user starts it (the CLI, its own local Ray), and
record what its end-of-run summary prints (``<run>/summary.json``): held-out EM / F1 / ACC_R with
search before and after RL, EM with search disabled, searches per question, RL trajectories/s,
learner tokens/s, the policy lag bound and the replay accounting; plus the command's wall clock and
the peak memory of all its processes (``bench.driver_harness.ProcessTreeSampler``, every 0.5 s or
less often within its CPU budget: the
command, its Ray cluster and actors, and this benchmark's own process, about 0.1 GiB).

The README's results table and its run-time sentence are rendered from the JSON by this module
(``sonar bench default-run --readme [JSON]`` rewrites them between their markers), and
``tests/bench/test_readme_results.py`` checks that the README says what the JSON it names says, that
the JSON comes from a clean commit of this history, and that ``configs/tiny.yaml``'s settings have not
changed since (the SHA-256 of its parsed YAML is recorded): change the preset and the test asks for a
new run.

Each seed's run gets a fresh ``run.root`` (its world, index and MLflow store are built as on a first
``make run``); ``--run-root DIR`` keeps them, else they go to a temporary folder removed afterwards.

``--quick`` (CI smoke test): ``configs/smoke.yaml`` cut to 5 SFT steps, 3 + 2 RL steps, 8 held-out
questions, one rollout worker, one seed; it checks the plumbing and the JSON, not the numbers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sonar.bench.common import (REPO_ROOT, bench_settings, block_result, driver_bench_parser, load_full_result, splice,
                                summarise, write_result)

NAME = "default-run"
FULL = {"config": "tiny", "seeds": [0, 1], "overrides": []}
QUICK = {"config": "smoke", "seeds": [0],
         "overrides": ["stages.0.steps=5", "stages.1.steps=3", "stages.2.steps=2", "world.num_heldout_eval=8",
                       "rollout.num_workers=1", "eval.batch_size=8"]}
SUMMARY_KEYS = ("em_before_search", "em_after_search", "f1_before_search", "f1_after_search", "acc_r_after_search",
                "em_after_no_search", "searches_per_question", "trajectories_per_s", "tokens_per_s", "policy_lag_max",
                "learner_steps", "wall_s")
"""The fields of ``summary.json`` (``cluster/driver/reports.py:print_summary``) this benchmark records."""
README = REPO_ROOT / "README.md"
TABLE_BEGIN = "<!-- default-run table: "
TABLE_END = "<!-- /default-run table -->"
TIME_BEGIN = "<!-- default-run time -->"
TIME_END = "<!-- /default-run time -->"
log = logging.getLogger("sonar.bench")


def preset_path(config: str) -> Path:
    """The file ``--config NAME`` resolves to (``cluster/wire/paths.py``: a path, else a preset name)."""
    from sonar.cluster.wire.paths import find_config

    return find_config(config)


def run_settings(args, quick: dict, full: dict) -> dict:
    """The benchmark's QUICK or FULL settings with ``--config``, ``--seeds`` and the KEY=VALUE overrides applied
    (the options of a benchmark that runs ``sonar train`` per seed: this one and ``lora``)."""
    bcfg = bench_settings(args, quick, full)
    if args.config:
        bcfg["config"] = args.config
    if args.seeds:
        bcfg["seeds"] = list(args.seeds)
    bcfg["overrides"] += args.overrides
    return bcfg


def command(config: str, seed: int, root: Path, overrides: list[str]) -> list[str]:
    """The README's command (``sonar train run.seed=S model.seed=S``) with its run root and extra overrides."""
    return [sys.executable, "-m", "sonar", "train", "--config", config, f"run.seed={seed}", f"model.seed={seed}",
            f"run.root={root}", *overrides]


def read_run(root: Path) -> dict:
    """The one finished run under ``root``: its summary fields, replay accounting and eval rows."""
    found = sorted(root.glob("*/summary.json"))
    if len(found) != 1:
        raise RuntimeError(f"default-run: expected one finished run (a summary.json) under {root}, found "
                           f"{[str(p) for p in found] or 'none'}")
    summary = json.loads(found[0].read_text())
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise RuntimeError(f"default-run: {found[0]} lacks {missing}")
    evals = json.loads((found[0].parent / "eval_summary.json").read_text())
    rec = {k: summary[k] for k in SUMMARY_KEYS}
    rec["balanced"] = bool(summary["replay"]["balanced"])
    rec["replay"] = {k: summary["replay"][k] for k in ("produced", "consumed", "dropped_stale", "requeued", "queued")
                     if k in summary["replay"]}
    rec["eval_n"] = {k: row.get("n") for k, row in evals.items()}
    rec["faults"] = summary.get("faults")
    import yaml

    resolved = yaml.safe_load((found[0].parent / "config.yaml").read_text()) or {}  # the run's saved config
    rec["max_policy_lag"] = resolved.get("replay", {}).get("max_policy_lag")
    sft = {i for i, st in enumerate(resolved.get("stages", [])) if st.get("kind") == "sft"}
    rec["curves"] = _curves(found[0].parent / "metrics.jsonl", sft)
    return rec


def _curves(metrics_jsonl: Path, sft_stages: set[int]) -> dict:
    """Per logged step (``metrics.jsonl``: one row per learner step): the SFT stages' loss and the RL
    rollout reward mean, as ``[step, value]`` pairs (every row; the default run logs about 800)."""
    from sonar.cluster.wire import metrics as K

    out: dict[str, list] = {"sft_loss": [], "rl_reward": []}
    for line in metrics_jsonl.read_text().splitlines():
        row = json.loads(line)
        if K.ROLLOUT_REWARD_MEAN in row:
            out["rl_reward"].append([row["step"], round(float(row[K.ROLLOUT_REWARD_MEAN]), 4)])
        elif K.LEARNER_LOSS in row and row.get("stage") in sft_stages:
            out["sft_loss"].append([row["step"], round(float(row[K.LEARNER_LOSS]), 4)])
    return out


def run_seed(cmd: list[str], root: Path) -> dict:
    """Run ``cmd`` (one ``sonar train``) to its end, sampling its process tree's memory; its summary."""
    from sonar.bench.driver_harness import ProcessTreeSampler, loadavg

    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "train.log"
    load_start, t0 = loadavg(), time.monotonic()
    with open(log_path, "w") as out, ProcessTreeSampler(interval_s=0.5) as sampler:
        # Waits for the whole command: the run is the measurement. Its output goes to a file, as a job's log.
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"default-run: `{' '.join(cmd)}` exited with {rc}; the last lines of {log_path}:\n{tail}")
    rec = read_run(root)
    mem = sampler.result()
    rec.update(command_wall_s=wall, peak_pss_gb=mem["peak_pss_gb"], peak_rss_gb=mem["peak_rss_gb"],
               loadavg={"start": load_start, "end": loadavg()})
    return rec


def measure(bcfg: dict, run_root: str | None) -> tuple[dict, dict]:
    keep = run_root is not None
    base = Path(run_root).resolve() if keep else Path(tempfile.mkdtemp(prefix="sonar-default-run-"))
    runs = []
    try:
        for seed in bcfg["seeds"]:
            cmd = command(bcfg["config"], seed, base / f"seed{seed}", bcfg["overrides"])
            log.info("%s seed %d: %s", NAME, seed, " ".join(cmd[1:]))
            rec = run_seed(cmd, base / f"seed{seed}")
            runs.append({"seed": seed, "argv": ["sonar", *cmd[3:]], **rec})
            log.info("%s seed %d: EM %s -> %s in %.0f s", NAME, seed, rec["em_before_search"], rec["em_after_search"],
                     rec["command_wall_s"])
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    keys = [k for k in (*SUMMARY_KEYS, "command_wall_s", "peak_pss_gb", "peak_rss_gb")
            if all(isinstance(r.get(k), (int, float)) for r in runs)]
    metrics = {k: summarise([r[k] for r in runs]) for k in keys}
    return metrics, {"runs": runs, "run_root": str(base) if keep else None}


def plot(extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    runs = extra["runs"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in runs:
        for key, a in (("sft_loss", ax[0]), ("rl_reward", ax[1])):
            xs = r["curves"][key]
            if xs:
                a.plot([x for x, _ in xs], [y for _, y in xs], lw=0.8, label=f"seed {r['seed']}")
    ax[0].set(title="SFT loss per learner step", xlabel="logged step")
    ax[1].set(title="RL: rollout reward mean per learner step", xlabel="logged step")
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        vals = [100 * (r[k] or 0.0) for k in ("em_before_search", "em_after_search", "em_after_no_search")]
        ax[2].bar([j + i * width for j in range(3)], vals, width, label=f"seed {r['seed']}")
    ax[2].set_xticks([j + 0.4 - width / 2 for j in range(3)], ["before RL", "after RL", "after RL, no search"])
    ax[2].set(title="held-out EM (%)", ylim=(0, 100))
    for a in ax:
        a.legend(fontsize=8)
    fig.suptitle("default run (`sonar train`), one process per seed", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ---------------------------------------------------------------------------------------------------------
# The README's rendering of a result (pure: no runs; tests/bench/test_readme_results.py)

def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def _minutes(s: float) -> str:
    return f"{int(s // 60)} min {int(round(s % 60)):02d} s" if s % 60 < 59.5 else f"{int(s // 60) + 1} min 00 s"


ROWS = (
    ("held-out EM with search, after SFT (before RL)", lambda r: _pct(r["em_before_search"])),
    ("held-out EM with search, after async GRPO", lambda r: f"**{_pct(r['em_after_search'])}**"),
    ("held-out F1 with search, before → after RL",
     lambda r: f"{_pct(r['f1_before_search'])} → {_pct(r['f1_after_search'])}"),
    ("held-out ACC_R (R1-Searcher's cover-EM) with search, after RL", lambda r: _pct(r["acc_r_after_search"])),
    ("held-out EM with search disabled, after RL", lambda r: _pct(r["em_after_no_search"])),
    ("searches per question (held-out, after RL)", lambda r: f"{r['searches_per_question']:.2f}"),
    ("trajectories/s during RL (consumed by the learner)", lambda r: f"{r['trajectories_per_s']:.0f}"),
    ("learner tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("policy lag, max (bound)", lambda r: f"{int(r['policy_lag_max'])} ({r['max_policy_lag']})"),
    ("accounting balanced (produced = consumed + stale + requeued + queued)",
     lambda r: "yes" if r["balanced"] else "**no**"),
    ("wall clock, whole command", lambda r: _minutes(r["command_wall_s"])),
    ("peak memory, all processes (PSS sum; RSS sum)", lambda r: f"{r['peak_pss_gb']:.1f} GiB; {r['peak_rss_gb']:.1f} GiB"),
)
"""The table's rows: label, and the cell of one seed's run record."""


def render_table(doc: dict, json_name: str) -> str:
    """The README's results block for ``doc`` (a default-run result), markers included."""
    runs = doc["extra"]["runs"]
    hw, load = doc["hardware"], [r["loadavg"]["start"] for r in runs]
    lines = [f"{TABLE_BEGIN}bench/results/{json_name} (`sonar bench default-run --readme` writes this block; "
             f"tests/bench/test_readme_results.py checks it) -->",
             "| | " + " | ".join(f"seed {r['seed']}" for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(cell(r) for r in runs) + " |" for label, cell in ROWS]
    n = sorted({v for r in runs for v in r["eval_n"].values() if v})
    lines += ["", f"Measured by `sonar bench default-run` on commit {doc['commit'][:10]} ({doc['timestamp'][:10]}; "
                  f"{hw.get('cpu_model') or 'CPU'}, {hw['cpu_usable']} cores, {hw['memory_gb']:.0f} GiB; load average "
                  f"{', '.join(f'{l[0]:.1f}' for l in load if l)} at the start of each run), one process per seed: "
                  + "; ".join(f"`{' '.join(a for a in r['argv'] if not a.startswith('run.root='))}`" for r in runs)
                  + f". Held-out: {', '.join(map(str, n))} questions.",
              TABLE_END]
    return "\n".join(lines)


PLACEMENTS_BEGIN = "<!-- default-run placements table: "
PLACEMENTS_END = "<!-- /default-run placements table -->"


def _setting(doc: dict) -> str:
    """A default-run result's setting as its overrides say it (placement and mode; the preset's own otherwise)."""
    over = dict(o.split("=", 1) for o in doc["config"]["overrides"] if "=" in o)
    res = doc["config"]["resolved"]["cluster"]
    return f"{over.get('cluster.placement', res['placement'])}, {over.get('cluster.mode', res['mode'])}"


def render_placements_table(results: list[tuple[str, dict]]) -> str:
    """README's colocated-placement block: the default preset's runs under each placement and mode (one
    default-run result each, the same seeds), held-out EM with search per seed after RL, and whether every
    colocated seed lies inside the spread (min..max over seeds) of each split setting. No throughput: the
    settings ran one after another, not side by side."""
    docs = [d for _, d in results]
    seeds = docs[0]["extra"]["runs"]
    lines = [PLACEMENTS_BEGIN + ", ".join(f"bench/results/{n}" for n, _ in results)
             + " (`sonar bench readme` renders this block) -->",
             "| placement, mode | " + " | ".join(f"EM seed {r['seed']}: SFT → RL" for r in seeds)
             + " | load average at each start |",
             "|---|" + "---|" * len(seeds) + "---|"]
    for d in docs:
        runs = {r["seed"]: r for r in d["extra"]["runs"]}
        cells = [f"{_pct(runs[r['seed']]['em_before_search'])} → **{_pct(runs[r['seed']]['em_after_search'])}**"
                 if r["seed"] in runs else "-" for r in seeds]
        load = ", ".join(f"{r['loadavg']['start'][0]:.1f}" for r in d["extra"]["runs"] if r.get("loadavg"))
        lines.append(f"| {_setting(d)} | " + " | ".join(cells) + f" | {load or '-'} |")
    colocated = [d for d in docs if _setting(d).startswith("colocated")]
    verdicts = []
    for split in (d for d in docs if not _setting(d).startswith("colocated")):
        lo = min(r["em_after_search"] for r in split["extra"]["runs"])
        hi = max(r["em_after_search"] for r in split["extra"]["runs"])
        ems = [r["em_after_search"] for c in colocated for r in c["extra"]["runs"]]
        where = ("inside" if all(lo <= e <= hi for e in ems) else
                 "at or above" if all(e >= lo for e in ems) else "at or below" if all(e <= hi for e in ems) else
                 "across")
        verdicts.append(f"{where} the spread of split {_setting(split).split(', ')[1]} ({_pct(lo)} to {_pct(hi)})")
    n_q = max((r["eval_n"].get("after_search", 0) for d in docs for r in d["extra"]["runs"]), default=0)
    if n_q:  # the binomial standard error of one seed's EM at the split's level, for scale
        p_hat = sum(r["em_after_search"] for d in docs for r in d["extra"]["runs"]) / sum(len(d["extra"]["runs"]) for d in docs)
        verdicts.append(f"one seed's EM has a binomial standard error of {100 * (p_hat * (1 - p_hat) / n_q) ** 0.5:.1f} pt "
                        f"at {n_q} questions")
    n = sorted({v for d in docs for r in d["extra"]["runs"] for v in r["eval_n"].values() if v})
    lines += ["", f"Colocated held-out EM after RL: {'; '.join(verdicts)}. Throughput is not compared here: the settings "
                  "ran one after another on a machine shared with other work (the load column). Measured by "
                  "`sonar bench default-run` with "
                  f"each setting's overrides, one process per seed, on commit {docs[0]['commit'][:10]} "
                  f"({docs[0]['timestamp'][:10]}); held-out: {', '.join(map(str, n))} questions.", PLACEMENTS_END]
    return "\n".join(lines)


def render_time(doc: dict) -> str:
    """The README's run-time phrase: the median whole-command wall clock over the seeds, in minutes."""
    m = doc["metrics"]["command_wall_s"]
    return (f"{TIME_BEGIN}in about {round(m['median'] / 60)} minutes ({_minutes(m['min'])} to {_minutes(m['max'])} "
            f"over {m['n']} seeds on {doc['commit'][:10]}){TIME_END}")


def readme_json(text: str) -> str:
    """The result file the README's table names (``bench/results/<name>.json``)."""
    name = block_result(text, TABLE_BEGIN)
    if name is None:
        raise ValueError(f"README.md: no results table marker {TABLE_BEGIN!r}")
    return name


def preset_sha256(path: Path) -> str:
    """SHA-256 of the preset's settings (the parsed YAML as canonical JSON): comments may change, values not."""
    import yaml

    settings = yaml.safe_load(Path(path).read_text())
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_readme(json_path: Path, readme: Path = README) -> None:
    doc = load_full_result(json_path, NAME)
    text = readme.read_text()
    before = readme_json(text)
    text = splice(text, TABLE_BEGIN, TABLE_END, render_table(doc, json_path.name), "results table")
    text = splice(text, TIME_BEGIN, TIME_END, render_time(doc), "run-time phrase")
    readme.write_text(text)
    print(f"[{NAME}] {readme} now shows {json_path.name} (it showed {before})")


def newest_result(out: Path) -> Path:
    found = sorted(out.glob(f"{NAME}-*.json"), key=lambda p: json.loads(p.read_text()).get("timestamp", ""))
    if not found:
        raise FileNotFoundError(f"no {NAME}-*.json under {out}: run `sonar bench default-run` first")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    p = driver_bench_parser(NAME, __doc__.splitlines()[0], "the preset")
    p.add_argument("--config", help="preset name or file (default tiny; quick: smoke)")
    p.add_argument("--seeds", type=int, nargs="+", help="training seeds (default 0 1; quick: 0)")
    p.add_argument("--run-root", help="keep each seed's run under DIR/seed<S> (default: a temporary folder)")
    p.add_argument("--readme", nargs="?", const="", metavar="JSON",
                   help="run nothing: rewrite README.md's results table and run time from JSON "
                        "(default: the newest default-run result under --out)")
    p.renders_only = "readme"  # --readme writes README.md from a committed JSON: any tree may do that
    args = p.parse_args(argv)
    if args.readme is not None:
        write_readme(Path(args.readme) if args.readme else newest_result(Path(args.out)))
        return 0
    bcfg = run_settings(args, QUICK, FULL)
    preset = preset_path(bcfg["config"])
    from sonar.bench.driver_harness import load_cfg
    from sonar.cluster.wire.config import to_dict

    # The resolved config as the command will load it (run.root and the seeds aside: each run saves its
    # own in <run>/config.yaml); no simulator runs in `sonar train`.
    resolved, sim = load_cfg([preset], bcfg["overrides"])
    bcfg.update(resolved=to_dict(resolved), sim=sim.to_dict())
    bcfg.update(quick=args.quick, preset_file=os.path.relpath(preset, REPO_ROOT) if preset.is_relative_to(REPO_ROOT)
                else str(preset), preset_sha256=preset_sha256(preset))
    t0 = time.time()
    metrics, extra = measure(bcfg, args.run_root)
    extra["wall_s"] = round(time.time() - t0, 1)
    path = write_result(NAME, bcfg, metrics, lambda png: plot(extra, png), args.out, extra=extra)
    print(f"[{NAME}] wrote {path} in {extra['wall_s']} s")
    print(render_table(json.loads(path.read_text()), path.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
