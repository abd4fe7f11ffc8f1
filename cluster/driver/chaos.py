"""``sonar chaos``: train while processes die, then account for every prompt.

    sonar chaos --config C --steps N [--kill-every K] [--replica-at R] [--learner-at L] [--push-kill-every P]
                [--pause-at S] [--replica-pause-at T] [--minutes M] [--seed S] [--compare] [key=value ...]

The run is the driver's own (``loop.train``); ``Chaos`` is its ``Hooks.on_step``, so every fault lands
between two learner steps of an RL stage while the rollout loops run. The schedule is in **RL learner
steps**, read from the learner version the step just logged (counted from the first RL step; SFT before
it is not counted), not in seconds: a loaded machine runs it more slowly, never differently. Over N RL
learner steps it SIGKILLs a random rollout worker's process every K steps (K, 2K, ... below N), kills the
retrieval replica's process once at step R (default N/4: the search service is down until Ray restarts
it, and searches wait) and the learner's process once at step L (default N/2, or the first step after
it once a checkpoint of this run exists: ``cluster.auto_resume`` resumes from it). Every P RL steps it
kills a rollout worker *during the next weight push* (``Hooks.on_pool``'s ``"push_sent"``: the learner has
started sending, no worker has received), at each rank position in turn (worker 0, 1, ..., then 0
again): the pool calls the push off for every rank and replaces the worker. At step S it pauses a random
rollout worker (SIGSTOP: alive, silent; the pool replaces it once it misses ``cluster.health_timeout_s``)
and at step T the retrieval replica (replaced after ``replica_pool.SILENT_CHECKS`` silent health check; meanwhile the
searches fail, the replay pauses the learner for the outage, and the first search that works again
ends it). A resumed learner
continues from its checkpoint's version, so the steps it trains again count again, and a fault already
done is not done twice. At step N it ends training; the run then finishes as usual (final push,
checksums, evaluation, export). ``--minutes`` optionally bounds the RL wall time as well (training ends
at whichever comes first; the report says which).

The accounting is computed from the run's own records: ``trained_prompts.jsonl`` (every learner step's
trained and stale-dropped prompts, rolled back to the checkpoint on a resume) and the replay's
counters in ``summary.json``:

- produced / trained / dropped stale / requeued: the replay's trajectory counters;
- lost: trajectories the balance ``produced == consumed + dropped_stale + requeued + queued`` misses,
  plus prompts still claimed at the end, plus groups the replay handed out that no learner step
  recorded (``consumed_groups`` minus trained prompts);
- trained twice: prompts recorded more often than the epochs the cursor walked allow.

``--compare`` then runs the same config and seed without faults for as many RL learner steps and prints
the two reward curves side by side.
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
"""RL stages run this many steps in a chaos run: the schedule (``--steps``) ends them."""

KINDS = ("rollout worker", "retrieval replica", "learner")
"""What a chaos run kills; ``Chaos.events``' ``killed`` starts with one of these (a mid-push kill is a
rollout worker's, named ``rollout worker <i> mid-push``)."""
PAUSED = ("rollout worker", "retrieval replica")
"""What a chaos run pauses (SIGSTOP); ``Chaos.events``' ``paused`` starts with one of these."""


class Chaos:
    """The fault schedule, as a driver ``on_step`` hook (see the module docstring). ``steps``: RL learner
    steps under faults (N); ``kill_every``: RL steps between two worker kills (0: none); ``replica_at`` /
    ``learner_at``: the RL step of the replica's and the learner's kill (None: N/4 and N/2; 0: never);
    ``minutes``: an optional wall-clock bound on the RL phase. ``clock`` is injectable for tests;
    ``events`` records every fault (RL step, learner version, elapsed seconds, what, pid)."""

    def __init__(self, steps: int, kill_every: int, seed: int = 0, replica_at: int | None = None,
                 learner_at: int | None = None, minutes: float | None = None, clock=time.monotonic,
                 push_kill_every: int = 0, pause_at: int = 0, replica_pause_at: int = 0):
        if steps < 1 or kill_every < 0 or push_kill_every < 0 or pause_at < 0 or replica_pause_at < 0:
            raise ValueError(f"chaos: steps={steps} must be >= 1, kill_every={kill_every}, push_kill_every="
                             f"{push_kill_every}, pause_at={pause_at} and replica_pause_at={replica_pause_at} >= 0")
        self.total = steps
        self.kill_every = kill_every
        self.push_kill_every = push_kill_every
        self.pause_at, self.replica_pause_at = pause_at, replica_pause_at
        self.armed = 0
        """Mid-push kills due (their RL step passed) and not yet done: the next pushes do them."""
        self.push_kills = 0
        """Mid-push kills done; the next one kills the worker at rank position ``push_kills % workers``."""
        self.step = 0
        self.replica_at = max(1, steps // 4) if replica_at is None else replica_at
        self.learner_at = max(1, steps // 2) if learner_at is None else learner_at
        self.duration_s = None if minutes is None else minutes * 60.0
        self.rng = random.Random(seed)
        self.clock = clock
        self.t0: float | None = None
        self.base: int | None = None
        """The learner version before the first RL step: RL step = version - base."""
        self.done: set = set()
        """Faults already done, as (kind, RL step): a step trained again after a resume repeats none."""
        self.events: list[dict] = []
        self.calls = 0
        """``on_step`` calls (RL steps logged, the ones a resumed learner trained again included)."""
        self.reached = 0
        """The highest RL step reached."""
        self.ended_by: str | None = None
        """"steps" or "minutes": what ended training (None: the run ended otherwise)."""

    @property
    def schedule(self) -> dict:
        """The planned faults: {kind: [RL steps]} (the learner's waits for a checkpoint)."""
        workers = list(range(self.kill_every, self.total, self.kill_every)) if self.kill_every else []
        pushes = list(range(self.push_kill_every, self.total, self.push_kill_every)) if self.push_kill_every else []
        return {"rollout worker": workers,
                "retrieval replica": [self.replica_at] if 0 < self.replica_at < self.total else [],
                "learner": [self.learner_at] if 0 < self.learner_at < self.total else [],
                "rollout worker mid-push": pushes,
                "paused rollout worker": [self.pause_at] if 0 < self.pause_at < self.total else [],
                "paused retrieval replica": [self.replica_pause_at] if 0 < self.replica_pause_at < self.total else []}

    def __call__(self, roles, run, stage_index: int, steps: int) -> bool:
        now = self.clock()
        if self.t0 is None:
            self.t0 = now
        self.calls += 1
        # The row the loop logged for this step holds the learner version it reached.
        version = next((int(r[K.LEARNER_VERSION]) for r in reversed(run.history) if K.LEARNER_VERSION in r), None)
        if version is None:  # no learner row (a harness's own loop): count the calls
            version = (self.base or 0) + self.calls
        if self.base is None:
            self.base = version - 1
        step = version - self.base
        self.reached = max(self.reached, step)
        elapsed = now - self.t0
        if step >= self.total:
            self.ended_by = "steps"
            return True
        if self.duration_s is not None and elapsed >= self.duration_s:
            self.ended_by = "minutes"
            return True
        plan = self.schedule
        self.step = step
        for at in plan["rollout worker mid-push"]:
            if at <= step and ("mid-push", at) not in self.done:
                self.done.add(("mid-push", at))
                self.armed += 1  # done by the next push (pool_event)
        for at in plan["paused rollout worker"]:
            if at <= step and ("pause worker", at) not in self.done:
                self.done.add(("pause worker", at))
                i = self.rng.randrange(len(roles.workers))
                self._signal(f"rollout worker {i}", roles.pool.pid(i), step, version, elapsed, signal.SIGSTOP)
        for at in plan["paused retrieval replica"]:
            if at <= step and ("pause replica", at) not in self.done:
                self.done.add(("pause replica", at))
                self._signal("retrieval replica 0", roles.retrieval[0].health, step, version, elapsed, signal.SIGSTOP)
        for at in plan["rollout worker"]:
            if at <= step and ("rollout worker", at) not in self.done:
                self.done.add(("rollout worker", at))
                i = self.rng.randrange(len(roles.workers))
                self._kill(f"rollout worker {i}", roles.pool.pid(i), step, version, elapsed)  # asked through the pool
        for at in plan["retrieval replica"]:
            if at <= step and ("retrieval replica", at) not in self.done:
                self.done.add(("retrieval replica", at))
                self._kill("retrieval replica 0", roles.retrieval[0].health, step, version, elapsed)
        for at in plan["learner"]:
            if (at <= step and ("learner", at) not in self.done
                    and (run.dir / "checkpoints" / "latest").exists()):
                self.done.add(("learner", at))
                self._kill("learner", roles.learner.ping, step, version, elapsed)
        return False

    def pool_event(self, event: str, pool) -> None:
        """``Hooks.on_pool``: at a push of an RL stage with a mid-push kill due, kill the worker at the next
        rank position by the handle the pool holds (``ray.kill``: its receive then fails, and the pool
        calls the push off for the others)."""
        if event != "push_sent" or not self.armed or pool.active is None or not pool.workers:
            return
        self.armed -= 1
        i = self.push_kills % len(pool.workers)
        self.push_kills += 1
        self._kill_handle(pool.workers[i])
        elapsed = self.clock() - (self.t0 or self.clock())
        self.events.append({"rl_step": self.step, "version": None, "t_s": round(elapsed, 1),
                            "killed": f"rollout worker {i} mid-push", "pid": None})
        log.warning("chaos: kill rollout worker %d (rank position %d) mid-push after RL step %d", i, i, self.step)

    @staticmethod
    def _kill_handle(handle, deadline_s: float = 60.0) -> None:
        """Kill the actor and return once Ray reports it dead (a call to it fails), so the push's receive,
        issued next, always meets a dead worker: ``ray.kill`` is asynchronous, and on a loaded machine a
        receive could otherwise run to its end before the kill lands, leaving no push to call off. Raises
        when it is still answering after ``deadline_s``."""
        import ray

        ray.kill(handle, no_restart=True)
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                ray.get(handle.health.remote(), timeout=max(0.1, end - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return
            time.sleep(0.05)  # answered: the kill has not landed yet; ask again
        raise RuntimeError(f"chaos: the killed rollout worker still answers after {deadline_s:g} s")

    def _kill(self, what: str, info_method, step: int, version: int, elapsed: float) -> None:
        self._signal(what, info_method, step, version, elapsed, signal.SIGKILL)

    def _signal(self, what: str, info_method, step: int, version: int, elapsed: float, sig) -> None:
        """``info_method``: a handle's method answering {"pid": ...}, or the pid itself. SIGKILL is recorded
        as ``killed``, SIGSTOP as ``paused`` (the process stays stopped: the run replaces it)."""
        import ray

        pid = info_method if isinstance(info_method, int) else int(ray.get(info_method.remote(), timeout=60)["pid"])
        os.kill(pid, sig)
        key = "killed" if sig == signal.SIGKILL else "paused"
        self.events.append({"rl_step": step, "version": version, "t_s": round(elapsed, 1), key: what, "pid": pid})
        log.warning("chaos: %s %s (pid %d) at RL step %d (learner version %d, %.0f s)", signal.Signals(sig).name,
                    what, pid, step, version, elapsed)

    def kills(self) -> dict:
        """{kind: how many times it was killed} (every kind of ``KINDS``, 0 included; mid-push kills also
        apart, under ``mid-push``)."""
        out = {k: sum(e.get("killed", "").startswith(k) for e in self.events) for k in KINDS}
        out["mid-push"] = sum(e.get("killed", "").endswith("mid-push") for e in self.events)
        return out

    def pauses(self) -> dict:
        """{kind: how many times it was paused} (every kind of ``PAUSED``)."""
        return {k: sum(e.get("paused", "").startswith(k) for e in self.events) for k in PAUSED}


class StopAfter:
    """``on_step`` hook of the clean comparison run: end training after ``steps`` RL steps."""

    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0

    def __call__(self, roles, run, stage_index: int, steps: int) -> bool:
        self.seen += 1
        return self.seen >= self.steps


def chaos_config(cfg: Config, chaos: Chaos | None = None) -> Config:
    """RL stages unbounded (the schedule ends them); a checkpoint every 5 RL steps unless the config has
    its own (the learner resumes from it). Given the schedule ``chaos``, the restart budgets cover it:
    every scheduled worker kill may hit the same worker (``cluster.max_worker_restarts`` at least the
    number of kills + 1), and a scheduled learner kill needs ``cluster.auto_resume`` >= 1. A budget the
    schedule exhausts would end the run by design, which is not what a chaos run measures."""
    stages = [dataclasses.replace(s, steps=UNBOUNDED_STEPS) if s.kind == "rl" else s for s in cfg.stages]
    run = cfg.run if cfg.run.checkpoint_every else dataclasses.replace(cfg.run, checkpoint_every=5)
    cluster = cfg.cluster
    if chaos is not None:
        plan = chaos.schedule
        worker_faults = len(plan["rollout worker"]) + len(plan["rollout worker mid-push"]) + len(plan["paused rollout worker"])
        cluster = dataclasses.replace(
            cluster, max_worker_restarts=max(cluster.max_worker_restarts, worker_faults + 1),
            auto_resume=max(cluster.auto_resume, len(plan["learner"])),
            max_replica_replacements=max(cluster.max_replica_replacements, len(plan["paused retrieval replica"]) + 1))
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


def max_step_gap(run_dir: Path) -> float | None:
    """The longest wall time of one RL step in ``metrics.jsonl`` (``learner/critical/wall_s``: from the
    previous step's end to this one's, the learner's waits for a batch included), seconds: the stall a
    fault cost. None without RL steps."""
    walls = [float(r[K.CRIT_WALL]) for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if K.CRIT_WALL in r]
    return round(max(walls), 1) if walls else None


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


def run_chaos(cfg: Config, steps: int, kill_every: int, seed: int = 0, compare: bool = False,
              replica_at: int | None = None, learner_at: int | None = None, minutes: float | None = None,
              push_kill_every: int = 0, pause_at: int = 0, replica_pause_at: int = 0) -> dict:
    """One chaos run (and with ``compare`` a clean one of the same seed); returns the report, also
    written to ``<run>/chaos.json`` and printed."""
    from sonar.cluster.driver.loop import train
    from sonar.cluster.driver.roles import Hooks
    from sonar.cluster.driver.run import world_of

    chaos = Chaos(steps, kill_every, seed, replica_at=replica_at, learner_at=learner_at, minutes=minutes,
                  push_kill_every=push_kill_every, pause_at=pause_at, replica_pause_at=replica_pause_at)
    cfg = chaos_config(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed)), chaos)
    t0 = time.monotonic()
    summary = train(cfg, Hooks(on_step=chaos, on_pool=chaos.pool_event))
    run_dir = Path(summary["run_dir"])
    rl_stage = next(s for s in cfg.stages if s.kind == "rl")
    num_prompts = (len(read_jsonl(run_dir / f"prompts-stage{cfg.stages.index(rl_stage)}.jsonl"))
                   or len(world_of(cfg).train))
    report = {"run_dir": str(run_dir), "wall_s": round(time.monotonic() - t0, 1), "schedule": chaos.schedule,
              "events": chaos.events, "kills": chaos.kills(), "pauses": chaos.pauses(),
              "faults": summary.get("faults", {}), "max_step_gap_s": max_step_gap(run_dir),
              "rl_steps": chaos.reached, "rl_steps_logged": chaos.calls, "ended_by": chaos.ended_by,
              "accounting": accounting(run_dir, summary["replay"], num_prompts)}
    curves = {"chaos": reward_curve(run_dir)}
    if compare:
        clean_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=None, name=cfg.run.name + "-clean"))
        clean = train(clean_cfg, Hooks(on_step=StopAfter(max(1, chaos.reached))))
        curves["clean"] = reward_curve(Path(clean["run_dir"]))
        report["clean_run_dir"] = clean["run_dir"]
    report["reward_curve"] = {k: {str(s): v for s, v in c.items()} for k, c in curves.items()}
    (run_dir / "chaos.json").write_text(json.dumps(report, indent=2))
    a = report["accounting"]
    print(f"\nchaos run: {report['rl_steps']} of {steps} RL steps ({chaos.calls} logged, ended by "
          f"{chaos.ended_by or 'the run'}) in {report['wall_s']:.0f} s, kills {report['kills']}, pauses "
          f"{report['pauses']}, faults {report['faults']}, longest gap between two RL steps "
          f"{report['max_step_gap_s']} s", flush=True)
    for e in chaos.events:
        what = f"SIGKILL {e['killed']}" if "killed" in e else f"SIGSTOP {e['paused']}"
        print(f"  RL step {e['rl_step']:>5} (v{e['version']}, {e['t_s']:>7.1f} s)  {what} (pid {e['pid']})")
    print("  " + "  ".join(f"{k} {a[k]}" for k in ("produced", "trained", "dropped_stale", "requeued",
                                                  "requeued_prompts", "requeued_infra", "lost", "trained_twice",
                                                  "balanced")))
    print(format_curves(curves["chaos"], curves.get("clean")), flush=True)
    return report


def build_parser() -> argparse.ArgumentParser:
    """The ``sonar chaos`` command line (its own: ``sonar`` hands it the arguments after ``chaos``)."""
    from sonar.cluster.wire.paths import CONFIG_HELP

    p = argparse.ArgumentParser(prog="sonar chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", help=CONFIG_HELP)
    p.add_argument("--steps", type=int, required=True, help="RL learner steps under faults (the schedule's length)")
    p.add_argument("--kill-every", type=int, default=30, help="RL learner steps between two rollout-worker kills (0: none)")
    p.add_argument("--replica-at", type=int, default=None, help="RL step of the retrieval replica's kill (default steps/4; 0: none)")
    p.add_argument("--learner-at", type=int, default=None,
                   help="RL step of the learner's kill, once a checkpoint exists (default steps/2; 0: none)")
    p.add_argument("--push-kill-every", type=int, default=0,
                   help="RL learner steps between two kills of a rollout worker mid-push, each rank position in turn (0: none)")
    p.add_argument("--pause-at", type=int, default=0, help="RL step of a rollout worker's SIGSTOP (0: none)")
    p.add_argument("--replica-pause-at", type=int, default=0, help="RL step of the retrieval replica's SIGSTOP (0: none)")
    p.add_argument("--minutes", type=float, default=None, help="also end training after this many minutes of RL")
    p.add_argument("--seed", type=int, default=0, help="run.seed, and the choice of the worker killed")
    p.add_argument("--compare", action="store_true", help="also run a clean run of the same seed and steps")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    return p


def main(argv: list[str]) -> int:
    from sonar.cluster.wire.config import DEFAULT_CONFIG, ConfigError, load_config

    p = build_parser()
    args = p.parse_args(argv)
    bad = [f"--{n}={v}" for n, v, ok in (("steps", args.steps, args.steps >= 1),
                                        ("kill-every", args.kill_every, args.kill_every >= 0),
                                        ("replica-at", args.replica_at, args.replica_at is None or args.replica_at >= 0),
                                        ("learner-at", args.learner_at, args.learner_at is None or args.learner_at >= 0),
                                        ("push-kill-every", args.push_kill_every, args.push_kill_every >= 0),
                                        ("pause-at", args.pause_at, args.pause_at >= 0),
                                        ("replica-pause-at", args.replica_pause_at, args.replica_pause_at >= 0),
                                        ("minutes", args.minutes, args.minutes is None or args.minutes > 0)) if not ok]
    if bad:
        print(f"sonar chaos: {', '.join(bad)}: --steps must be >= 1, --kill-every, --replica-at, --learner-at, "
              f"--push-kill-every, --pause-at and --replica-pause-at >= 0, --minutes > 0", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config or [DEFAULT_CONFIG], args.overrides)
    except (ConfigError, ValueError) as e:
        print(f"sonar: config error: {e}", file=sys.stderr)
        return 2
    report = run_chaos(cfg, args.steps, args.kill_every, args.seed, args.compare, replica_at=args.replica_at,
                       learner_at=args.learner_at, minutes=args.minutes, push_kill_every=args.push_kill_every,
                       pause_at=args.pause_at, replica_pause_at=args.replica_pause_at)
    a = report["accounting"]
    return 0 if a["lost"] == 0 and a["trained_twice"] == 0 and a["balanced"] else 1
