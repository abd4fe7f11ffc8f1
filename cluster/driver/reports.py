"""What the driver reports: per-step metric dicts from the roles, held-out evaluation, the summary.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
import time

import numpy as np

from sonar.cluster.driver.run import Run
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import Config
from sonar.cluster.wire.errors import RoleUnresponsive
from sonar.cluster.wire.protocol import StepResult

log = logging.getLogger("sonar")

def record_prompts(run: Run, res: StepResult) -> None:
    """Append which prompts this learner step trained or dropped as stale to trained_prompts.jsonl (a
    resume is checked against it: no prompt trained twice, none skipped)."""
    if res.trained_prompts or res.dropped_prompts:
        with open(run.dir / "trained_prompts.jsonl", "a") as fh:
            fh.write(json.dumps({"version": res.metrics.get(K.LEARNER_VERSION), "trained": res.trained_prompts,
                                 "dropped": res.dropped_prompts}) + "\n")


def rollout_metrics(recent: list[dict]) -> dict:
    if not recent:
        return {}
    m = {K.ROLLOUT_REWARD_MEAN: float(np.mean([r["reward"] for r in recent])),
         K.ROLLOUT_SEARCH_CALLS_MEAN: float(np.mean([r["searches"] for r in recent])),
         K.ROLLOUT_TOKENS_MEAN: float(np.mean([r["model_tokens"] for r in recent]))}
    for tool in sorted({name for r in recent for name in r.get("tool_calls", {})}):
        m[K.ROLLOUT_TOOL_CALLS_MEAN.format(tool=tool)] = float(np.mean([r.get("tool_calls", {}).get(tool, 0)
                                                                        for r in recent]))
    for part in recent[0]["parts"]:
        m[K.ROLLOUT_REWARD_PART.format(part=part)] = float(np.mean([r["parts"].get(part, 0.0) for r in recent]))
    for reason in ("answered", "max_turns", "max_tokens", "malformed", "retrieval_error"):
        m[K.ROLLOUT_FINISH.format(reason=reason)] = float(np.mean([r["finish"] == reason for r in recent]))
    lat = [x for r in recent for x in r["latency_ms"]]
    if lat:
        m[K.RETRIEVAL_LATENCY_P50] = float(np.percentile(lat, 50))
        m[K.RETRIEVAL_LATENCY_P99] = float(np.percentile(lat, 99))
    m[K.RETRIEVAL_ERRORS] = float(sum(r["failed_searches"] for r in recent))
    m[K.ROLLOUT_TRAJECTORIES] = float(len(recent))
    return m


STARTUP_PHASES = ("ray", "corpus and index", "retrieval service", "policy", "learner and rollout workers",
                  "weight transport")
"""What ``start_roles`` logs, in order, each as ``start-up: <phase> ...`` then ``... done in X s``."""


@contextlib.contextmanager
def startup_phase(name: str):
    """Log a start-up phase as it begins and when it is done, with its seconds: the minute before the first
    step is no longer silent (``STARTUP_PHASES``)."""
    t0 = time.monotonic()
    log.info("start-up: %s ...", name)
    yield
    log.info("start-up: %s done in %.1f s", name, time.monotonic() - t0)


def fmt_duration(seconds: float) -> str:
    """A duration for the log lines: 45s, 6m20s, 1h02m (rounded down to the shown unit)."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class StageProgress:
    """Where a stage stands: percentage, step rate and ETA from the steps done since the stage (re)started
    (``start_step``: a resumed stage's rate counts only the steps this process ran), for the log lines; and
    on a terminal (stderr a TTY) a tqdm bar updated every step, so a run can be watched between log lines.
    Files get only the log lines: no bar, no carriage returns."""

    def __init__(self, total: int, start_step: int = 0, desc: str = "", clock=time.monotonic, bar: bool | None = None):
        self.total, self.start_step, self.clock = total, start_step, clock
        self.t0 = clock()
        if bar is None:
            bar = sys.stderr.isatty()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start_step, desc=desc, unit="step", file=sys.stderr, leave=False,
                            dynamic_ncols=True, mininterval=0.5)

    def text(self, step: int) -> str:
        """``12% 0.85 steps/s ETA 9m48s`` at step ``step`` (1-based count of steps done)."""
        pct = 100.0 * step / self.total if self.total else 100.0
        done, dt = step - self.start_step, self.clock() - self.t0
        if done <= 0 or dt <= 0:
            return f"{pct:.0f}%"
        rate = done / dt
        return f"{pct:.0f}% {rate:.2f} steps/s ETA {fmt_duration((self.total - step) / rate)}"

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def step_log_line(steps: int, total: int, m: dict) -> str:
    """The driver's log line for RL step ``steps`` of ``total`` from the step's metrics ``m``.

    Searches per trajectory are the mean over the rollouts the workers finished since the previous step
    (``rollout_metrics``): a step with trajectories but no search reads 0.00. A step at which no rollout
    finished (every group still generating, or a worker just restarted) has no such mean, and the line
    says so rather than print the nan of an empty mean."""
    def num(key: str, fmt: str) -> str:
        v = m.get(key)
        return "-" if v is None else format(v, fmt)

    if K.ROLLOUT_SEARCH_CALLS_MEAN in m:
        searches = f"{m[K.ROLLOUT_SEARCH_CALLS_MEAN]:.2f}"
    else:
        searches = "- (no rollout finished since the previous step)"
    return (f"rl step {steps}/{total} reward {num(K.LEARNER_REWARD_MEAN, '.3f')} lag max "
            f"{num(K.LEARNER_POLICY_LAG_MAX, '')} searches/traj {searches} dropped {num(K.REPLAY_DROPPED_STALE, '')}")


class Throughput:
    """Rollout throughput between consecutive learner steps, from the replay's produced counter."""

    def __init__(self):
        self.t, self.produced = time.monotonic(), None

    def tick(self, m: dict) -> dict:
        now, produced = time.monotonic(), m.get(K.REPLAY_PRODUCED, 0)
        out = {}
        if self.produced is not None and now > self.t:
            out[K.ROLLOUT_TRAJ_PER_S] = (produced - self.produced) / (now - self.t)
            if K.ROLLOUT_TOKENS_MEAN in m:
                out[K.ROLLOUT_TOKENS_PER_S] = out[K.ROLLOUT_TRAJ_PER_S] * m[K.ROLLOUT_TOKENS_MEAN]
        self.t, self.produced = now, produced
        return out


def balanced_rollout_share(rollout_busy: float, rollout_units: float, learner_busy: float,
                           learner_units: float) -> float | None:
    """The share of the devices the rollout side would get if both sides' measured work were balanced
    (AReaL's allocation mode, veRL's rollout:trainer ratio, from measurement instead of a guess).

    ``*_busy``: each side's busy share of the wall time (0..1), ``*_units``: its devices. Its work is
    busy x units device-seconds per second; a split that gives each side devices in proportion to its
    work leaves neither idle waiting for the other (to first order: work that scales with devices).
    None when neither side did any work."""
    work_r, work_l = max(0.0, rollout_busy) * rollout_units, max(0.0, learner_busy) * learner_units
    if work_r + work_l <= 0:
        return None
    return work_r / (work_r + work_l)


class SplitMeter:
    """Each side's idle share between consecutive trained steps (split placement), and the split that would
    balance them. The rollout side's busy seconds come from the workers (``rollout/busy_s``, cumulative;
    a replaced worker restarts its count, so a negative difference counts as 0); the learner's are its step
    time and the weight push. Devices: ``per_worker`` per rollout worker (its GPUs; 1 on CPU) and
    ``learner`` for the learner (its ranks' GPUs; its ranks on CPU)."""

    def __init__(self, per_worker: float, learner: float, clock=time.monotonic):
        self.per_worker, self.learner, self.clock = per_worker, learner, clock
        self.t, self.busy = clock(), None

    def tick(self, m: dict, workers: int) -> dict:
        now, busy = self.clock(), m.get(K.ROLLOUT_BUSY_S)
        out = {}
        dt = now - self.t
        if self.busy is not None and busy is not None and dt > 0 and workers > 0:
            r_busy = min(1.0, max(0.0, busy - self.busy) / (workers * dt))
            l_busy = min(1.0, (m.get(K.LEARNER_STEP_TIME, 0.0) + m.get(K.WEIGHTS_SYNC_S, 0.0)) / dt)
            units = workers * self.per_worker
            out = {K.ROLLOUT_IDLE_SHARE: 1.0 - r_busy, K.LEARNER_IDLE_SHARE: 1.0 - l_busy,
                   K.ROLLOUT_DEVICE_SHARE: units / (units + self.learner)}
            share = balanced_rollout_share(r_busy, units, l_busy, self.learner)
            if share is not None:
                out[K.ROLLOUT_BALANCED_SHARE] = share
        self.t, self.busy = now, busy
        return out


def split_meter(cfg: Config) -> SplitMeter | None:
    """The stage's ``SplitMeter``; None in colocated placement (one pool of devices: nothing to split)."""
    if cfg.cluster.placement == "colocated":
        return None
    return SplitMeter(cfg.rollout.num_gpus_per_worker or 1.0,
                      cfg.learner.num_ranks * (min(1.0, cfg.learner.num_gpus) or 1.0))


def retrieval_metrics(roles: Roles) -> dict:
    """Service-side retrieval metrics (QPS, latency, batch size, cache hit rate, errors by kind)."""
    stats = [s for s in roles.replicas.stats() if s]  # a hung, dead or restarting replica: none this step
    if not stats:
        return {}
    m = {K.RETRIEVAL_QPS: sum(s["qps"] for s in stats),
         K.RETRIEVAL_SERVICE_LATENCY_P50: max(s["latency_ms"]["p50"] for s in stats),
         K.RETRIEVAL_SERVICE_LATENCY_P99: max(s["latency_ms"]["p99"] for s in stats),
         K.RETRIEVAL_BATCH_SIZE_MEAN: float(np.mean([s["mean_batch_size"] for s in stats]))}
    for s in stats:
        for kind, n in s["errors"].items():
            key = K.RETRIEVAL_ERRORS_KIND.format(kind=kind)
            m[key] = m.get(key, 0) + n
        cache = s.get("inner", {})
        if "hit_rate" in cache:
            m[K.RETRIEVAL_CACHE_HIT_RATE] = cache["hit_rate"]
    m.update(rerank_metrics([s.get("inner", {}) for s in stats]))
    return m


def rerank_metrics(inner: list[dict]) -> dict:
    """The reranker's cost per search from each replica's retriever stats (the reranker's dict is the first
    with ``rerank_s`` down the ``inner`` chain: cache -> resilience -> reranker)."""
    found = []
    for s in inner:
        while isinstance(s, dict) and "rerank_s" not in s:
            s = s.get("inner")
        if isinstance(s, dict) and s.get("queries"):
            found.append(s)
    if not found:
        return {}
    m = {K.RETRIEVAL_RERANK_MS_PER_QUERY: max(1000.0 * s["rerank_s"] / s["queries"] for s in found)}
    if all("encoded" in s for s in found):
        queries = sum(s["queries"] for s in found)
        cands = sum(s["encoded"] + s["cache_hits"] + s["stored_hits"] for s in found)
        m[K.RETRIEVAL_RERANK_ENCODED_PER_QUERY] = sum(s["encoded"] for s in found) / queries
        m[K.RETRIEVAL_RERANK_VECTOR_HIT_RATE] = (sum(s["cache_hits"] + s["stored_hits"] for s in found) / cands
                                                 if cands else 0.0)
    return m


def answer(cfg: Config, ref, role: str, what: str, timeout_s: float | None = None):
    """``ray.get(ref)`` within ``timeout_s`` (default ``cluster.health_timeout_s``: the replay's calls are
    quick), else ``RoleUnresponsive`` naming the role, the call and the deadline: no driver wait is
    without end (a stopped or deadlocked process would hold it)."""
    import ray

    t = cfg.cluster.health_timeout_s if timeout_s is None else timeout_s
    try:
        return ray.get(ref, timeout=t)
    except ray.exceptions.GetTimeoutError:
        raise RoleUnresponsive(f"the {role} did not answer {what} within {t:g} s (hung: a stopped or deadlocked "
                               "process); the run's checkpoints hold its state (`sonar train run.resume=latest`)") from None


def replay_stats(roles: Roles, asked=None) -> dict:
    """The replay queue's ``stats()`` (``asked``: the call's reference, sent earlier) within
    ``cluster.health_timeout_s`` (``answer``; a harness's roles without a config wait)."""
    import ray

    ref = asked if asked is not None else roles.replay.stats.remote()
    if roles.cfg is None:
        return ray.get(ref)
    return answer(roles.cfg, ref, "replay queue", "stats")


def replay_metrics(roles: Roles, asked=None) -> dict:
    """The replay's counters as metrics, and with ``asked`` (its ``report.remote()``, sent earlier: the
    driver sends it right after the learner step, answered during the push) the rollout metrics of the
    groups it accepted since the last report; else its counters, asked now."""
    s = replay_stats(roles, asked)
    rollouts = rollout_metrics(s["records"]) if "records" in s else {}
    return {K.REPLAY_DEPTH: s["depth_groups"], K.REPLAY_PRODUCED: s["produced"], K.REPLAY_CONSUMED: s["consumed"],
            K.REPLAY_DROPPED_STALE: s["dropped_stale"], K.REPLAY_REQUEUED: s["requeued_prompts"],
            K.REPLAY_REQUEUED_INFRA: s.get("requeued_infra", 0), K.REPLAY_REQUEUED_OUTAGE: s.get("requeued_outage", 0),
            K.REPLAY_OUTAGE_S: s.get("outage_s", 0.0), K.REPLAY_OUTAGE_NOW_S: (s.get("outage") or {}).get("seconds", 0.0),
            **rollouts}


def evaluate(cfg: Config, roles: Roles, run: Run, split: str) -> dict:
    """Greedy held-out evaluation through the one evaluation path (``actors/evaluation.py``), with
    search and (``eval.no_search``) without, sharded across the workers. Returns {mode: summary}
    (EM, F1, cover-EM, searches, tokens, latency), logs them as ``eval/<split>_<mode>/...`` and writes
    ``predictions-<split>_<mode>.jsonl``."""
    import ray

    from sonar.actors.evaluation import eval_metrics, summarize

    from sonar.cluster.driver.data import eval_questions

    questions = eval_questions(cfg)  # eval.data's questions, else the world's held-out ones
    stage = cfg.stages[-1]
    out = {}
    for mode in (["search", "no_search"] if cfg.eval.no_search else ["search"]):
        # Sync point: the summary is over every question, so wait for every worker's shard (a worker
        # that dies meanwhile is restarted and its shard evaluated again).
        recs = roles.pool.evaluate(questions, mode == "search", stage)
        row = out[mode] = summarize(recs)
        key = f"{split}_{mode}"
        run.log(eval_metrics(key, row))
        path = run.dir / f"predictions-{key}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        run.sink.log_artifact(str(path), "predictions")  # the predictions table, one row per question
        log.info("eval %s: EM %.3f F1 %.3f ACC_R %.3f searches/q %.2f (n=%d)", key, row["em"], row["f1"],
                 row["acc_r"], row["searches_per_q"], row["n"])
    return out


def eval_table(results: dict) -> dict:
    """{"<split>_<mode>": summary} of the run's held-out evaluations so far (``before_search``,
    ``after_search``, ``after_no_search``): the eval summary logged to MLflow and attached to the model."""
    return {f"{split}_{mode}": row for split, key in (("before", "before"), ("after", "final"))
            for mode, row in (results.get(key) or {}).items()}


def print_summary(cfg: Config, roles: Roles, run: Run) -> dict:
    before = run.results.get("before", {})
    after = run.results.get("final", {})
    stats = replay_stats(roles)
    wall = time.monotonic() - run.t0
    summary = {
        "run_dir": str(run.dir), "mlflow_run_id": run.sink.run_id, "wall_s": wall,
        "em_before_search": before.get("search", {}).get("em"), "em_after_search": after.get("search", {}).get("em"),
        "f1_before_search": before.get("search", {}).get("f1"), "f1_after_search": after.get("search", {}).get("f1"),
        "em_after_no_search": after.get("no_search", {}).get("em"),
        "acc_r_after_search": after.get("search", {}).get("acc_r"),
        "searches_per_question": after.get("search", {}).get("searches_per_q"),
        "trajectories_per_s": stats["consumed"] / max(1e-9, sum(v["seconds"] for v in run.results.get("rl", {}).values()) or wall),
        "tokens_per_s": run.totals.tokens_per_s_mean,  # running aggregates: the history is a window
        "policy_lag_max": run.totals.policy_lag_max, "replay": stats, "weights": run.results.get("weights"),
        "learner_steps": run.totals.learner_steps,
        "faults": {"worker_restarts": run.results.get("faults", {}).get("worker_restarts", 0)
                   + sum(getattr(roles, "restarts", {}).values()),
                   "replica_replacements": run.results.get("faults", {}).get("replica_replacements", 0)
                   + sum(roles.replicas.replacements.values()),
                   "learner_resumes": run.results.get("faults", {}).get("learner_resumes", 0),
                   "replay_resumes": run.results.get("faults", {}).get("replay_resumes", 0),
                   "push_call_offs": run.results.get("faults", {}).get("push_call_offs", 0)
                   + getattr(getattr(roles, "pool", None), "push_call_offs", 0)},
    }
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    # The eval summary ({"<split>_<mode>": EM, F1, ...}) and the run's summary, as MLflow artifacts.
    (run.dir / "eval_summary.json").write_text(json.dumps(eval_table(run.results), indent=2, default=str))
    run.sink.log_artifact(str(run.dir / "eval_summary.json"))
    run.sink.log_artifact(str(run.dir / "summary.json"))
    # Scores as `sonar eval` and `sonar score` print them (percent, one decimal); summary.json keeps fractions.
    pct = lambda key: _pct(summary[key])  # noqa: E731
    rows = [("held-out EM (search) before RL", pct("em_before_search")),
            ("held-out EM (search) after RL", pct("em_after_search")),
            ("held-out F1 (search) before / after", f"{pct('f1_before_search')} / {pct('f1_after_search')}"),
            ("held-out ACC_R, R1-Searcher cover-EM (search) after RL", pct("acc_r_after_search")),
            ("held-out EM (no search) after RL", pct("em_after_no_search")),
            ("searches per question", summary["searches_per_question"]),
            ("trajectories/s (RL)", summary["trajectories_per_s"]),
            ("learner tokens/s", summary["tokens_per_s"]), ("policy lag (max)", summary["policy_lag_max"]),
            ("bytes per weight push", (summary["weights"] or {}).get("push_bytes")),
            ("accounting balanced", stats["balanced"]), ("wall clock (s)", wall),
            ("MLflow run id", run.sink.run_id), ("run directory", run.dir)]
    width = max(len(r[0]) for r in rows)
    print("\n" + "\n".join(f"  {k.ljust(width)}  {_fmt(v)}" for k, v in rows) + "\n", flush=True)
    return summary


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _pct(v) -> str:
    """A score mean as a percentage (``actors.evaluation.percent``), "n/a" where the run has none."""
    from sonar.actors.evaluation import percent

    return f"{percent(v)} %" if isinstance(v, (int, float)) else "n/a" if v is None else str(v)

