"""``sonar chaos``: train while processes die, then account for every prompt.

    sonar chaos --config C --minutes N [--kill-every K] [--seed S] [--compare] [key=value ...]

The run is the driver's own (``loop.train``); ``Chaos`` is its ``Hooks.on_step``, so every fault lands
between two learner steps of an RL stage while the rollout loops run. Over the N minutes of RL (the
clock starts at the first RL step; SFT before it is not counted) it SIGKILLs a random rollout
worker's process every K seconds, kills the retrieval replica's process once (a quarter of the way
in: the search service is down until Ray restarts it, and searches wait), and kills the learner's
process once (half-way, once a checkpoint of this run exists: ``cluster.auto_resume`` resumes from
it). At N minutes it ends training; the run then finishes as usual (final push, checksums, evaluation,
export).

The accounting is computed from the run's own records: ``trained_prompts.jsonl`` (every learner step's
trained and stale-dropped prompts, rolled back to the checkpoint on a resume) and the replay's
counters in ``summary.json``:

- produced / trained / dropped stale / requeued: the replay's trajectory counters;
- lost: trajectories the balance ``produced == consumed + dropped_stale + requeued + queued`` misses,
  plus prompts still claimed at the end, plus groups the replay handed out that no learner step
  recorded (``consumed_groups`` minus trained prompts);
- trained twice: prompts recorded more often than the epochs the cursor walked allow.

``--compare`` then runs the same config and seed without faults for as many RL steps and prints the
two reward curves side by side.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config

log = logging.getLogger("sonar")

UNBOUNDED_STEPS = 1_000_000
"""RL stages run this many steps in a chaos run: the clock (``--minutes``) ends them."""


class Chaos:
    """The fault schedule, as a driver ``on_step`` hook (see the module docstring). ``clock`` is
    injectable for tests; ``events`` records every fault (elapsed seconds, what, pid)."""

    def __init__(self, minutes: float, kill_every_s: float, seed: int = 0, kill_replica: bool = True,
                 kill_learner: bool = True, clock=time.monotonic):
        self.duration_s = minutes * 60.0
        self.kill_every_s = kill_every_s
        self.rng = random.Random(seed)
        self.kill_replica, self.kill_learner = kill_replica, kill_learner
        self.clock = clock
        self.t0: float | None = None
        self.last_kill = 0.0
        self.events: list[dict] = []
        self.steps = 0

    def __call__(self, roles, run, stage_index: int, steps: int) -> bool:
        now = self.clock()
        if self.t0 is None:
            self.t0 = self.last_kill = now
        self.steps += 1
        elapsed = now - self.t0
        if elapsed >= self.duration_s:
            return True
        if self.kill_every_s > 0 and now - self.last_kill >= self.kill_every_s:
            i = self.rng.randrange(len(roles.workers))
            self._kill(f"rollout worker {i}", roles.workers[i].ready, elapsed)
            self.last_kill = now
        if self.kill_replica and elapsed >= self.duration_s / 4:
            self.kill_replica = False
            self._kill("retrieval replica 0", roles.retrieval[0].health, elapsed)
        if self.kill_learner and elapsed >= self.duration_s / 2 and (run.dir / "checkpoints" / "latest").exists():
            self.kill_learner = False
            self._kill("learner", roles.learner.ping, elapsed)
        return False

    def _kill(self, what: str, info_method, elapsed: float) -> None:
        import ray

        pid = int(ray.get(info_method.remote(), timeout=60)["pid"])
        os.kill(pid, signal.SIGKILL)
        self.events.append({"t_s": round(elapsed, 1), "killed": what, "pid": pid})
        log.warning("chaos: SIGKILL %s (pid %d) at %.0f s", what, pid, elapsed)


class StopAfter:
    """``on_step`` hook of the clean comparison run: end training after ``steps`` RL steps."""

    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0

    def __call__(self, roles, run, stage_index: int, steps: int) -> bool:
        self.seen += 1
        return self.seen >= self.steps


def chaos_config(cfg: Config, minutes: float | None = None, kill_every_s: float | None = None) -> Config:
    """RL stages unbounded (the clock ends them); a checkpoint every 5 RL steps unless the config has
    its own (the learner resumes from it). Given the schedule, the restart budgets cover it: every
    scheduled worker kill may hit the same worker (``cluster.max_worker_restarts`` at least the number of
    kills + 1), and the learner's one kill needs ``cluster.auto_resume`` >= 1. A budget the schedule
    exhausts would end the run by design, which is not what a chaos run measures."""
    stages = [dataclasses.replace(s, steps=UNBOUNDED_STEPS) if s.kind == "rl" else s for s in cfg.stages]
    run = cfg.run if cfg.run.checkpoint_every else dataclasses.replace(cfg.run, checkpoint_every=5)
    cluster = cfg.cluster
    if minutes is not None and kill_every_s:
        kills = int(math.ceil(minutes * 60.0 / kill_every_s))
        cluster = dataclasses.replace(cluster, max_worker_restarts=max(cluster.max_worker_restarts, kills + 1),
                                      auto_resume=max(cluster.auto_resume, 1))
    return dataclasses.replace(cfg, stages=stages, run=run, cluster=cluster)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def accounting(run_dir: Path, replay: dict, num_prompts: int) -> dict:
    """The accounting of a finished run (module docstring) from ``trained_prompts.jsonl`` and the
    replay's final stats ``replay`` (``ReplayCore.stats``); ``num_prompts``: the cursor's question count."""
    recs = read_jsonl(Path(run_dir) / "trained_prompts.jsonl")
    trained = [p for r in recs for p in r["trained"]]
    seen = trained + [p for r in recs for p in r["dropped"]]
    epochs = max(1, math.ceil(len(seen) / max(1, num_prompts)))
    twice = sum(max(0, c - epochs) for c in Counter(seen).values())
    unbalanced = replay["produced"] - (replay["consumed"] + replay["dropped_stale"] + replay["requeued"]
                                       + replay["queued"])
    unrecorded = replay["consumed_groups"] - len(trained)
    return {"produced": replay["produced"], "trained": replay["consumed"], "dropped_stale": replay["dropped_stale"],
            "requeued": replay["requeued"], "requeued_prompts": replay["requeued_prompts"],
            "requeued_infra": replay.get("requeued_infra", 0), "queued": replay["queued"],
            "trained_prompts": len(trained),
            "lost": abs(unbalanced) + replay.get("outstanding_claims", 0) + abs(unrecorded),
            "trained_twice": twice, "balanced": bool(replay["balanced"])}


def reward_curve(run_dir: Path) -> dict[int, float]:
    """Run step -> the learner's mean reward, from ``metrics.jsonl`` (a step logged again after a
    resume keeps its last value)."""
    out: dict[int, float] = {}
    for row in read_jsonl(Path(run_dir) / "metrics.jsonl"):
        if K.LEARNER_REWARD_MEAN in row:
            out[int(row["step"])] = float(row[K.LEARNER_REWARD_MEAN])
    return out


def format_curves(chaos: dict[int, float], clean: dict[int, float] | None, rows: int = 12) -> str:
    """The reward curves in ``rows`` buckets of RL steps (mean per bucket), side by side."""
    steps = sorted(set(chaos) | set(clean or {}))
    if not steps:
        return "  (no RL steps)"
    size = max(1, math.ceil(len(steps) / rows))
    lines = [f"  {'steps':>13}  {'chaos':>7}  {'clean':>7}"]
    for j in range(0, len(steps), size):
        chunk = steps[j:j + size]
        a = [chaos[s] for s in chunk if s in chaos]
        b = [clean[s] for s in chunk if clean and s in clean]
        fa = f"{sum(a) / len(a):7.3f}" if a else f"{'-':>7}"
        fb = f"{sum(b) / len(b):7.3f}" if b else f"{'-':>7}"
        lines.append(f"  {chunk[0]:>6}-{chunk[-1]:<6}  {fa}  {fb}")
    return "\n".join(lines)


def run_chaos(cfg: Config, minutes: float, kill_every_s: float, seed: int = 0, compare: bool = False,
              kill_replica: bool = True, kill_learner: bool = True) -> dict:
    """One chaos run (and with ``compare`` a clean one of the same seed); returns the report, also
    written to ``<run>/chaos.json`` and printed."""
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks
    from sonar.cluster.driver.run import world_of

    cfg = chaos_config(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed)), minutes, kill_every_s)
    chaos = Chaos(minutes, kill_every_s, seed, kill_replica=kill_replica, kill_learner=kill_learner)
    t0 = time.monotonic()
    summary = train(cfg, Hooks(on_step=chaos))
    run_dir = Path(summary["run_dir"])
    rl_stage = next(s for s in cfg.stages if s.kind == "rl")
    num_prompts = (len(read_jsonl(run_dir / f"prompts-stage{cfg.stages.index(rl_stage)}.jsonl"))
                   or len(world_of(cfg).train))
    report = {"run_dir": str(run_dir), "wall_s": round(time.monotonic() - t0, 1), "events": chaos.events,
              "faults": summary.get("faults", {}), "rl_steps": chaos.steps,
              "accounting": accounting(run_dir, summary["replay"], num_prompts)}
    curves = {"chaos": reward_curve(run_dir)}
    if compare:
        clean_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=None, name=cfg.run.name + "-clean"))
        clean = train(clean_cfg, Hooks(on_step=StopAfter(max(1, chaos.steps))))
        curves["clean"] = reward_curve(Path(clean["run_dir"]))
        report["clean_run_dir"] = clean["run_dir"]
    report["reward_curve"] = {k: {str(s): v for s, v in c.items()} for k, c in curves.items()}
    (run_dir / "chaos.json").write_text(json.dumps(report, indent=2))
    a = report["accounting"]
    print(f"\nchaos run: {report['rl_steps']} RL steps in {minutes:g} min, faults {report['faults']}, "
          f"events {len(chaos.events)}", flush=True)
    for e in chaos.events:
        print(f"  {e['t_s']:>7.1f} s  SIGKILL {e['killed']} (pid {e['pid']})")
    print("  " + "  ".join(f"{k} {a[k]}" for k in ("produced", "trained", "dropped_stale", "requeued",
                                                  "requeued_prompts", "requeued_infra", "lost", "trained_twice",
                                                  "balanced")))
    print(format_curves(curves["chaos"], curves.get("clean")), flush=True)
    return report


def main(argv: list[str]) -> int:
    from sonar.cluster.wire.config import DEFAULT_CONFIG, ConfigError, load_config

    p = argparse.ArgumentParser(prog="sonar chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", help="YAML override file(s), merged in order")
    p.add_argument("--minutes", type=float, required=True, help="minutes of RL under faults")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between two rollout-worker kills")
    p.add_argument("--seed", type=int, default=0, help="run.seed, and the choice of the worker killed")
    p.add_argument("--compare", action="store_true", help="also run a clean run of the same seed and steps")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    args = p.parse_args(argv)
    if not args.minutes > 0 or args.kill_every < 0:
        print(f"sonar chaos: --minutes={args.minutes} must be > 0 and --kill-every={args.kill_every} >= 0",
              file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config or [DEFAULT_CONFIG], args.overrides)
    except (ConfigError, ValueError) as e:
        print(f"sonar: config error: {e}", file=sys.stderr)
        return 2
    report = run_chaos(cfg, args.minutes, args.kill_every, args.seed, args.compare)
    a = report["accounting"]
    return 0 if a["lost"] == 0 and a["trained_twice"] == 0 and a["balanced"] else 1
