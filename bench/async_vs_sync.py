"""async-vs-sync: how much faster is asynchronous RL than lockstep RL on the same workload?

Question (issue 6, item 1): the same training workload (same checkpoint, prompts, seed, steps, group
size, workers, CPUs, engine) run synchronously -- generate one batch with the current weights, then
train, then broadcast, in lockstep (``cluster.mode=sync``, the driver's ``generate_in_lockstep``) --
and asynchronously (``cluster.mode=async``) with ``replay.max_policy_lag`` 1, 2 and 4. Reported per
setting: wall-clock of the RL loop, trajectories/s, learner idle fraction, rollout idle fraction,
the policy-lag histogram, the engine's mean batch occupancy, the final rollout reward and the
held-out EM after the stage; per async setting, the speedup over sync (``metrics["speedup"]["<lag>"]``,
medians also under ``extra.speedup``).

The workload (``configs/bench.yaml``, read its header): the 0.5M-parameter policy after a short SFT
(so it searches and answers in the protocol: 1-4 search turns per trajectory), real transformers
generation on CPU in the continuous-batching engine (``actors/engine_continuous.py``), the real
tantivy index behind the Ray retrieval service, the real DeepSpeed learner and gloo broadcast, plus
the two long tails the issue asks for, each drawn from a configurable distribution (the ``sim:``
section of bench.yaml, ``bench/sim/``, put into the production driver through its hooks):

- retrieval latency of a remote cluster, injected below the cache (``sim.retrieval_latency_*``,
  ``bench/sim/retrieval_latency.py``): lognormal per batched call, median 100 ms, sigma 0.8;
- generation lengths of a real-size policy (``sim.decode_*``, ``bench/sim/paced_engine.py``): each
  decode step of the engine lasts 10 ms, and each turn of each trajectory reasons for lognormal(16 tokens, sigma 0.7)
  extra steps (clipped at 256) holding a batch slot. The visible tokens are the tiny policy's own,
  sampled, rewarded and trained for real, so the final reward is a real learning outcome.

The SFT checkpoint is trained once and cached under ``<run.root>/bench-sft/<hash of the config parts
and the code it depends on>``; SFT is not what is measured.

Issue 11 and 24 (statistics and the fair baseline): one run per seed and setting (``--seeds``, default 0-4
over sync, lag 1 and lag 2, the order rotated per seed), 95 % t-intervals over seeds (``bench/stats.py``),
speedups paired per seed on the RL-loop clock, with start-up, and on the whole command; beside each:
trained and generated throughput, stale share, decode work per trained trajectory, and the equal-reward
test: two one-sided t-tests (TOST, 90 % interval of the paired difference inside ``MARGINS``: 3 points of
held-out EM, 0.05 of reward; ``--margin-em``, ``--margin-reward``), all under ``extra.comparison``; ``extra.cost_model``
names the decode cost model. Sync is the fair baseline: its whole share submitted at once, one
coroutine per trajectory in both modes (``rollout.per_trajectory``; ``actors/worker.py:generate_groups``).
Older text below that speaks of repeats and 2 lanes predates this.

What makes the comparison fair:

- Both modes run the same code path (``run_rl_stage``) from the same exported checkpoint, with the
  same seed (hence the same prompt order), steps, group size, workers, Ray CPUs, engine and engine
  capacity (``rollout.max_batch_rows`` slots per worker), one torch thread per process; settings are
  interleaved within each seed, in an order rotated per seed (``run_order``: sync, lag 1, lag 2; then
  lag 1, lag 2, sync; ...) so background load and its drift hit them alike; speedups are paired per seed.
- The timed span is the driver's RL loop (``run.results["rl"][i]["seconds"]``): from the workers'
  start to the end of ``RolloutPool.end_stage``. Actor start-up, SFT and evaluation are outside it. Async is
  charged for stopping: ``RolloutPool.end_stage`` waits for each worker's in-flight batches.
- Sync uses ``max_policy_lag=0`` (its data is always on-policy). Async lag L uses
  ``capacity_groups = L * groups_per_step`` and ``broadcast_every=1``; its admission budget is
  ``(L + 1) * groups_per_step`` groups claimed or queued (``replay.max_inflight_groups=-1``), and
  a claim must fit in the groups the learner takes while the claiming worker's weights are fresh
  (version-aware admission, ``cluster/replay/queue.py``).
  Stale groups are dropped and counted (``dropped_stale``); the learner still takes exactly
  ``steps`` steps of ``groups_per_step`` groups, so async pays for its waste in wall-clock.
- On 2 cores, async is *handicapped*: two workers decoding and a learner training want three cores.

Where the gain comes from (and what each part is worth: see the ablation in ``bench/README.md``).
Sync generates one step's batch (8 groups: 2 lanes of 2 groups per worker, 32 rows of the 64 slots)
and waits for its longest trajectory, while its batch drains to a few rows, then trains while the
engines idle. Async (1) overlaps training and the broadcast with generation, (2) removes the per-step
barrier, and (3) keeps the engine full: within the staleness budget, a worker's lanes claim new
prompts while the stragglers of older batches finish (AReaL's staleness-aware admission; the
continuous engine lets those rows share decode steps instead of queueing behind a static batch).
With a static-batch engine (``rollout.continuous_batching=false``), (3) is impossible: lanes queue
for the engine and long tails make the worker, not the learner, the bottleneck. ``extra.analysis``
reports the sync decomposition (generate phase G, learner stage T) and the two-stage pipeline bound
(G + T) / max(G, T), i.e. what (1) alone could give, next to the measured speedup.

Metrics that are derived, not measured directly (the driver and workers do not expose them):

- learner idle fraction = 1 - (sum of ``learner/step_time_s`` + sum of ``weights/sync_s``) / wall:
  the learner is busy training or sending weights, idle otherwise (in sync mode it idles during
  generation although its ``learner/wait_s`` is ~0, because the driver calls it only once the batch
  is queued; ``learner_wait_fraction`` = sum of ``learner/wait_s`` / wall is reported too);
- rollout idle fraction = 1 - sum over workers of (``gen_s`` + ``retrieve_s``) / (workers x wall),
  clipped at 0: with several lanes per worker the lanes' generate and retrieve times overlap, so
  it saturates at 0 and ``engine_mean_live_rows`` (mean rows holding a slot per decode step, out of
  ``max_batch_rows``) is the better measure of how busy the rollout side is.

``--quick`` (CI smoke test, < 1 minute): the 120-entity world, no SFT (the untrained policy: it
checks the plumbing and the JSON, not the workload), 2 RL steps, sync vs async lag 2 only.
``--engine vllm`` runs the rollout workers on vLLM (``actors/engine_vllm.py``: AsyncLLM, one request per
trajectory turn, weights pushed into vLLM's workers) with vLLM's real decode cost and no simulated decode
tail (only the retrieval latency is simulated).
``--engine bench`` swaps in the BENCHMARK engine (``bench/sim/bench_engine.py``: long-tailed lognormal
turn lengths, sleeps per token, no model, static batches): rewards are meaningless.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from sonar.bench.common import REPO_ROOT, bench_settings, driver_bench_parser, setup_env, summarise, write_result
from sonar.bench.stats import mean_ci, tost_paired, within
from sonar.cluster.wire import metrics as K

try:  # the cost-model label (bench/sim/gpu_cost.py); a tree without it labels the flat model itself
    from sonar.bench.sim.gpu_cost import sim_cost_label
except ImportError:  # pragma: no cover - only on a tree that predates gpu_cost.py
    def sim_cost_label(sim) -> dict:
        if sim.decode_ms_per_token <= 0:
            return {"decode_cost": "real", "form": "the engine's own decode time on this machine, nothing simulated"}
        return {"decode_cost": "flat", "form": "decode_ms_per_token per step whatever the batch (assumed)",
                "decode_ms_per_token": sim.decode_ms_per_token,
                "tail": {"median_tokens": sim.decode_median_tokens, "sigma": sim.decode_sigma,
                         "max_tokens": sim.decode_max_tokens}}

setup_env()

NAME = "async-vs-sync"
CONFIG = REPO_ROOT / "configs" / "bench.yaml"
FULL = {"lags": [1, 2], "seeds": [0, 1, 2, 3, 4], "overrides": []}
QUICK = {"lags": [2], "seeds": [0],
         "overrides": ["world.num_entities=120", "world.num_heldout_eval=8", "rollout.group_size=4",
                       "rollout.groups_per_request=2", "learner.groups_per_step=4", "replay.capacity_groups=8",
                       "protocol.max_total_tokens=256", "sim.retrieval_latency_ms=20.0",
                       "sim.decode_ms_per_token=2.0",
                       "stages.0.steps=0", "stages.1.steps=2"]}
log = logging.getLogger("sonar.bench")
MARGINS = {"heldout_em": 0.03, "reward_last": 0.05}
"""Equivalence margins (absolute) for async minus sync, paired per seed: 3 points of held-out EM and 0.05 of
final rollout reward. What "equal" means here, stated before the runs: differences smaller than the gaps the
papers report between methods (several EM points) and about the seed-to-seed spread of one setting."""
ALPHA = 0.05
"""Level of each one-sided test of the equivalence (TOST): a 90 % interval inside the margins."""


def run_order(settings: list, index: int) -> list:
    """The settings in the order seed number ``index`` runs them: rotated by one per seed (sync, lag 1,
    lag 2; then lag 1, lag 2, sync; ...), so over as many seeds as settings each setting runs once in every
    position and a drift of the machine's load over the benchmark does not favour one setting."""
    k = index % len(settings) if settings else 0
    return list(settings[k:]) + list(settings[:k])


# ------------------------------------------------------------------------------------ settings
BASELINES = ("sync", "sync_full", "colocated")
"""The synchronous baselines (``--baselines``):

- ``sync``: lockstep on the disaggregated layout, one step's batch (``learner.groups_per_step``) at a time;
- ``sync_full``: the same at matched concurrency, the batch that fills every engine slot (``rollout.
  num_workers x rollout.max_batch_rows`` rows, so as many rows per engine as async can hold) with the
  steps cut so that the same number of groups is trained;
- ``colocated``: the layout veRL's and OpenRLHF's hybrid engines run, what veRL compares async against:
  generation on every GPU (the rollout workers plus the learner's ``sim.learner_gpus``), then training
  on every GPU, with ``sim.colocated_switch_s`` per step for the switch (needs ``sim.learner_cost``).

Async is compared with each, and its headline with the better one (the higher mean trained
trajectories/s)."""


def setting_name(mode: str, lag: int | None) -> str:
    return f"async_lag{lag}" if mode == "async" else mode


def rl_stage_index(cfg) -> int:
    return next(i for i, st in enumerate(cfg.stages) if st.kind == "rl")


def setting_overrides(mode: str, lag: int | None, cfg0, sim0=None) -> list[str]:
    """The overrides that make ``mode`` (``BASELINES`` or ``async`` at ``lag``) of the base config ``cfg0``
    (its ``sim0`` for the colocated layout)."""
    gps = cfg0.learner.groups_per_step
    lockstep = ["cluster.mode=sync", "replay.max_policy_lag=0", "learner.broadcast_every=1"]
    if mode == "sync":
        return lockstep + [f"replay.capacity_groups={gps}"]
    if mode == "sync_full":
        return lockstep + full_batch(cfg0, cfg0.rollout.num_workers)
    if mode == "colocated":
        # veRL's default layout, as a peer runs it: every GPU generates the full batch its engines hold, then
        # every GPU trains it. Sonar's real colocated placement (the engines sleep, the learner steps, the
        # weights are handed over on the device, the engines wake: cluster/driver/colocate.py), with the
        # GPUs' switch cost simulated (sim.colocated_switch_s) since a CPU sleep frees nothing.
        if sim0 is None or sim0.learner_cost == "none":
            raise ValueError("the colocated baseline needs a simulated learner (sim.learner_cost=flops_7b, e.g. "
                             "--workload reference-7b): the CPU learner cannot be spread over the rollout GPUs")
        gpus = cfg0.rollout.num_workers + sim0.learner_gpus
        return lockstep + full_batch(cfg0, gpus) + [
            "cluster.placement=colocated", f"rollout.num_workers={gpus}", f"sim.learner_gpus={gpus}",
            "sim.colocated=true"]
    if mode != "async":
        raise ValueError(f"setting {mode!r} is not one of {[*BASELINES, 'async']}")
    return ["cluster.mode=async", f"replay.max_policy_lag={lag}",
            f"replay.capacity_groups={max(1, lag) * gps}", "learner.broadcast_every=1"]


def full_batch(cfg0, workers: int) -> list[str]:
    """Overrides for a lockstep batch that fills ``workers`` engines (``rollout.max_batch_rows`` rows each),
    with the RL steps cut so the same groups are trained (matched data: fewer, larger learner steps; each
    takes ``algo.mini_batches`` optimizer steps as async's do)."""
    gps = cfg0.learner.groups_per_step
    full = max(gps, workers * cfg0.rollout.max_batch_rows // cfg0.rollout.group_size)
    i = rl_stage_index(cfg0)
    steps = math.ceil(cfg0.stages[i].steps * gps / full)
    return [f"learner.groups_per_step={full}", f"replay.capacity_groups={full}", f"stages.{i}.steps={steps}"]


def split_stages(cfg):
    """(the SFT stage or None, the RL stage): bench.yaml has at most one of each, SFT first."""
    sft = [s for s in cfg.stages if s.kind == "sft"]
    rl = [s for s in cfg.stages if s.kind == "rl"]
    if len(rl) != 1 or len(sft) > 1:
        raise ValueError(f"{NAME}: the config needs exactly one rl stage and at most one sft stage, got "
                         f"{[s.kind for s in cfg.stages]}")
    return (sft[0] if sft and sft[0].steps > 0 else None), rl[0]


SFT_CODE = ("actors/world.py", "actors/demos.py", "actors/tokenizer.py", "actors/model.py", "actors/prompts.py",
            "learner/train_step.py", "learner/sft_data.py", "cluster/wire/policy.py")
"""The code an SFT checkpoint depends on: the cache key hashes it, so an edited world is never served
a policy (and tokenizer) trained on the old one."""


def code_fingerprint() -> str:
    h = hashlib.sha256()
    for rel in SFT_CODE:
        p = REPO_ROOT / rel
        h.update(rel.encode() + (p.read_bytes() if p.is_file() else b"<missing>"))
    return h.hexdigest()[:16]


def sft_checkpoint(cfg, sim, sft_stage) -> tuple[str | None, dict]:
    """Train (once) and cache the SFT policy every setting starts from; returns (model dir, info).
    ``sim`` is simulated during the run too (it shapes only its closing evaluation, not the weights)."""
    from sonar.cluster.wire.config import to_dict

    from sonar.bench.driver_harness import run_training

    if sft_stage is None or cfg.model.path or sim.engine == "bench":
        return cfg.model.path, {"sft": "skipped"}
    d = to_dict(cfg)
    key_parts = {k: d[k] for k in ("world", "model", "protocol")}
    key_parts.update(retrieval={k: d["retrieval"][k] for k in ("backend", "corpus", "k", "rerank")},
                     sft=to_dict(sft_stage), learner={k: d["learner"][k] for k in ("betas", "warmup_steps",
                                                                                  "grad_clip", "weight_decay")},
                     seed=cfg.run.seed, code=code_fingerprint())
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    cache = Path(cfg.run.root).resolve() / "bench-sft" / key
    info_path = cache / "sft.json"
    if (cache / "model" / "config.json").is_file() and info_path.is_file():
        info = json.loads(info_path.read_text())
        info["cached"] = True
        return str(cache / "model"), info
    run_dir = cache.with_name(key + ".tmp")
    shutil.rmtree(run_dir, ignore_errors=True)
    scfg = dataclasses.replace(cfg, stages=[sft_stage], run=dataclasses.replace(cfg.run, run_dir=str(run_dir)))
    log.info("%s: training the SFT checkpoint (%d steps), cached at %s", NAME, sft_stage.steps, cache)
    res = run_training(scfg, sim, evaluate_after=True, export=True)
    info = {"steps": sft_stage.steps, "seconds": res["stages"][0]["seconds"], "eval": res["eval"], "key": key,
            "cached": False}
    (run_dir / "sft.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(cache, ignore_errors=True)
    run_dir.replace(cache)
    return str(cache / "model"), info


# ------------------------------------------------------------------------------------ one setting
def measure(res: dict, cfg, sim=None) -> dict:
    """Per-setting numbers from one ``run_training`` result (see the module docstring for definitions).
    With a simulated real-size learner (``sim.learner_cost``), also tokens/s per GPU and the MFU of the
    simulated job (``per_gpu``)."""
    from sonar.bench.driver_harness import lag_histogram, off_policy_by_lag, rl_stage, series

    st = rl_stage(res)
    h = st["history"]
    wall = float(st["loop_seconds"])
    steps = len(series(h, K.LEARNER_VERSION))
    train_s = sum(series(h, K.LEARNER_STEP_TIME))
    sync_s = sum(series(h, K.WEIGHTS_SYNC_S))
    wait_s = sum(series(h, K.LEARNER_WAIT_S))
    workers = st["workers"]
    busy = sum(w.get("gen_s", 0.0) + w.get("retrieve_s", 0.0) for w in workers)
    gen = sum(w.get("gen_s", 0.0) for w in workers)
    ret = sum(w.get("retrieve_s", 0.0) for w in workers)
    n_w = max(1, len(workers))
    consumed = float(res["replay"]["consumed"])
    rewards = series(h, K.ROLLOUT_REWARD_MEAN)
    lreward = series(h, K.LEARNER_REWARD_MEAN)
    tail = max(1, len(rewards) // 3)
    ltail = max(1, len(lreward) // 3)
    m = {
        "wall_s": wall, "steps": steps, "seconds_per_step": wall / max(1, steps),
        "trajectories_per_s": consumed / wall, "produced_per_s": float(res["replay"]["produced"]) / wall,
        "learner_idle_fraction": max(0.0, 1.0 - (train_s + sync_s) / wall),
        "learner_wait_fraction": wait_s / wall,
        "rollout_idle_fraction": max(0.0, 1.0 - busy / (n_w * wall)),
        "train_s_per_step": train_s / max(1, steps), "sync_s_per_step": sync_s / max(1, steps),
        "gen_s_per_step": gen / n_w / max(1, steps), "retrieve_s_per_step": ret / n_w / max(1, steps),
        "dropped_stale": float(res["replay"]["dropped_stale"]),
        "reward_last": float(np.mean(rewards[-tail:])) if rewards else float("nan"),
        "reward_last_se": (float(np.std(rewards[-tail:], ddof=1) / np.sqrt(tail)) if tail > 1 else float("nan")),
        "learner_reward_last": float(np.mean(lreward[-ltail:])) if lreward else float("nan"),
        "searches_per_traj": float(np.mean(series(h, K.ROLLOUT_SEARCH_CALLS_MEAN) or [float("nan")])),
        "model_tokens_per_traj": float(np.mean(series(h, K.ROLLOUT_TOKENS_MEAN) or [float("nan")])),
        "policy_lag_max": max(series(h, K.LEARNER_POLICY_LAG_MAX) or [0.0]),
        # continuous engine only: mean rows holding a batch slot per decode step (real + simulated)
        "engine_mean_live_rows": (sum(w.get("engine_live_row_steps", 0.0) for w in workers)
                                  / max(1.0, sum(w.get("engine_steps", 0.0) for w in workers))
                                  if any("engine_steps" in w for w in workers) else float("nan")),
    }
    produced = float(res["replay"]["produced"])
    gen_tokens = float(sum(w.get("model_tokens", 0.0) for w in workers))
    row_steps = sum(w.get("engine_live_row_steps", 0.0) for w in workers)
    startup = float(res["startup_s"])
    m.update({
        # the clocks: the RL loop alone, and the command as a user waits for it (start-up included)
        "startup_s": startup, "wall_with_startup_s": startup + wall, "command_s": float(res["total_s"]),
        # throughput: trained (what the learner consumed) and generated (what the workers produced,
        # stale groups included), per second of the RL loop
        "trained_traj_per_s": consumed / wall, "generated_traj_per_s": produced / wall,
        "generated_tokens_per_s": gen_tokens / wall,
        # waste: the share of generated trajectories dropped as stale, and decode work per trained one
        "stale_share": float(res["replay"]["dropped_stale"]) / max(1.0, produced),
        "generated_per_trained": produced / max(1.0, consumed),
        "generated_tokens_per_trained_traj": gen_tokens / max(1.0, consumed),
    })
    if any("engine_live_row_steps" in w for w in workers):  # decode row-steps, simulated tails included
        m["decode_row_steps_per_trained_traj"] = row_steps / max(1.0, consumed)
    if any("engine_simulated_s" in w for w in workers):  # the paced engine: where the simulated time went
        eng_steps = max(1.0, sum(w.get("engine_steps", 0.0) for w in workers))
        admitted = sum(w.get("engine_ctx_admitted_n", 0.0) for w in workers)
        m.update({
            "sim_prefill_s": sum(w.get("engine_prefill_s", 0.0) for w in workers),
            "sim_recompute_s": sum(w.get("engine_recompute_s", 0.0) for w in workers),
            "sim_recomputes": sum(w.get("engine_sim_recomputes", 0.0) for w in workers),
            "sim_decode_s": sum(w.get("engine_simulated_s", 0.0) for w in workers),
            # steps where the real work (the tiny model) outlasted the simulated step: the clock fell behind
            "sim_overrun_step_share": sum(w.get("engine_overrun_steps", 0.0) for w in workers) / eng_steps,
            "sim_overrun_s": sum(w.get("engine_overrun_s", 0.0) for w in workers),
            "ctx_admitted_mean": (sum(w.get("engine_ctx_admitted_tokens", 0.0) for w in workers) / admitted
                                  if admitted else float("nan")),
        })
    if sim is not None and getattr(sim, "learner_cost", "none") != "none":
        from sonar.bench.sim import reference as R

        rollout_gpus = cfg.rollout.num_workers
        gpus = rollout_gpus if sim.colocated else rollout_gpus + sim.learner_gpus
        trained_tokens = float(sum(series(h, "sim/learner_tokens")))  # real-job tokens the learner was charged for
        flops = (row_steps * R.FORWARD_FLOPS_PER_PARAM * R.MODEL_PARAMS
                 + R.learner_flops(trained_tokens, max(0, sim.learner_updates), max(0, sim.learner_forwards)))
        m.update({
            "gpus": float(gpus),
            "generated_tokens_per_s_per_gpu": row_steps / wall / gpus,  # decode tokens, simulated tails included
            "trained_tokens_per_s_per_gpu": trained_tokens / wall / gpus,
            "trained_traj_per_s_per_gpu": consumed / wall / gpus,
            # the simulated job's model-FLOPs utilisation over all its GPUs and the whole RL loop: decode at
            # 2N FLOP per token, training as the learner was charged (reference.learner_flops); prefill and
            # recompute not counted
            "mfu": flops / (wall * gpus * R.PEAK_BF16_FLOPS),
            "sim_learner_s": sum(series(h, "sim/learner_s")),
        })
    m.update(steady_state(res, series(h, K.LEARNER_GROUPS), cfg.rollout.group_size, wall))
    groups = sum(series(h, K.LEARNER_GROUPS))
    m["zero_signal_share"] = sum(series(h, K.LEARNER_GROUPS_ZERO_SIGNAL)) / groups if groups else float("nan")
    if any("engine_steps" in w for w in workers):
        m["decode_steps_per_worker"] = sum(w.get("engine_steps", 0.0) for w in workers) / n_w
    if res.get("eval"):
        m["heldout_em"] = float(res["eval"]["search"]["em"])
    return {"metrics": m, "realised": realised(res, cfg, sim), "lag_hist": lag_histogram(h),
            "off_policy_by_lag": off_policy_by_lag(h), "rewards": rewards,
            "curve": reward_curve(h, res),
            "timeline": timeline(h, res, cfg.rollout.max_batch_rows),
            "replay": res["replay"], "workers": workers, "startup_s": startup}


def turn_distribution(marker_rows: dict[int, float]) -> dict:
    """Turns per trajectory from the paced engines' admitted rows by documents-tag count in their prompt
    (``paced_engine.py``): a trajectory's turn k holds k-1 more tags than its first turn, so with c0 the fewest
    tags, the rows with c0 + k - 1 tags are the turn-k rows, one per trajectory that reached turn k (``n_k``),
    and P(turns = k) = (n_k - n_(k+1)) / n_1. Returns {mean, p90, max} (None for each when nothing was counted)."""
    rows = {int(c): float(n) for c, n in marker_rows.items() if n > 0}
    if not rows:
        return {"mean": None, "p90": None, "max": None}
    c0, top = min(rows), max(rows)
    reached = [rows.get(c, 0.0) for c in range(c0, top + 1)]  # n_1, n_2, ...
    first = reached[0]
    cum, p90 = 0.0, None
    for k, n_k in enumerate(reached, start=1):
        cum += (n_k - (reached[k] if k < len(reached) else 0.0)) / first
        if p90 is None and cum >= 0.9 - 1e-12:
            p90 = float(k)
    return {"mean": sum(reached) / first, "p90": p90, "max": float(len(reached))}


def realised(res: dict, cfg, sim=None) -> dict:
    """What one run realised of its workload, in the units of ``reference.REALISED`` (None where this run
    cannot measure it): turns per trajectory (mean, p90, max: ``turn_distribution`` of the paced engines'
    rows), searches per trajectory (the workers' searches / trajectories), the row-weighted mean decode
    context in real-job tokens (context tokens / rows the decode cost was charged for, over every step),
    hidden tokens per generated trajectory (the engines' draws), learner tokens per trained trajectory (real-job
    tokens the simulated learner was charged, ``sim/learner_tokens``) and the learner's share of GPU time
    (its FLOP seconds x its GPUs over the RL loop x all the layout's GPUs)."""
    from sonar.bench.driver_harness import rl_stage, series

    st = rl_stage(res)
    h, workers, wall = st["history"], st["workers"], float(st["loop_seconds"])
    tot = lambda key: sum(float(w.get(key, 0.0)) for w in workers)  # noqa: E731
    trajs = tot("trajectories")
    marks: dict[int, float] = {}
    for w in workers:
        for k, v in w.items():
            if k.startswith("engine_turn_marker_rows_"):
                c = int(k.rsplit("_", 1)[1])
                marks[c] = marks.get(c, 0.0) + float(v)
    turns = turn_distribution(marks)
    if turns["mean"] is None and trajs and any("engine_rows" in w for w in workers):
        turns["mean"] = tot("engine_rows") / trajs  # one engine row per turn: the mean without the spread
    out = {"turns_mean": turns["mean"], "turns_p90": turns["p90"], "turns_max": turns["max"],
           "searches_mean": tot("searches") / trajs if trajs else None,
           "decode_context_mean": (tot("engine_charged_ctx_tokens") / tot("engine_charged_rows")
                                   if tot("engine_charged_rows") else None),
           "hidden_tokens_per_traj": tot("engine_tail_tokens") / trajs if trajs and any(
               "engine_tail_tokens" in w for w in workers) else None,
           "learner_tokens_per_traj": None, "learner_gpu_share": None}
    if sim is not None and getattr(sim, "learner_cost", "none") != "none":
        trained = float(sum(series(h, K.LEARNER_TRAJECTORIES)))
        gpus = cfg.rollout.num_workers + (0 if sim.colocated else sim.learner_gpus)
        out["learner_tokens_per_traj"] = float(sum(series(h, "sim/learner_tokens"))) / trained if trained else None
        out["learner_gpu_share"] = (float(sum(series(h, "sim/learner_compute_s"))) * sim.learner_gpus / (wall * gpus)
                                    if wall > 0 else None)
    return out


def realised_of_setting(runs: list[dict]) -> dict:
    """One setting's realised workload over its seeds: the mean of each figure (the largest for ``turns_max``),
    and the per-seed values under ``per_seed``."""
    fields = list(runs[0]["realised"]) if runs else []
    out: dict = {}
    for f in fields:
        vals = [r["realised"][f] for r in runs if r["realised"].get(f) is not None]
        out[f] = None if not vals else (max(vals) if f == "turns_max" else float(np.mean(vals)))
    out["per_seed"] = [r["realised"] for r in runs]
    return out


def workload_check(label: dict, realised_by_setting: dict, quick: bool) -> dict:
    """``extra.workload_check``: the label's realised ranges against every setting's realised workload
    (``reference.realised_vs_label``); ``mismatches`` names the setting in each message. Quick runs (the
    untrained policy, a smaller world) and workloads that state no ranges are skipped, and say why."""
    from sonar.bench.sim.reference import TOLERANCE, realised_vs_label

    if quick:
        return {"skipped": "quick: plumbing only (the untrained policy on a smaller world cannot realise the label)"}
    if not label.get("realised"):
        return {"skipped": f"workload {label.get('workload')!r} states no realised ranges"}
    mismatches = [f"{name}: {msg}" for name, r in realised_by_setting.items() for msg in realised_vs_label(label, r)]
    return {"tolerance": TOLERANCE, "label": label["realised"], "mismatches": mismatches, "passed": not mismatches}


TIMELINE_PHASES = (("generate_sync", K.CRIT_GENERATE_SYNC), ("queue_wait", K.CRIT_QUEUE_WAIT),
                   ("train", K.CRIT_LEARNER_COMPUTE), ("push", K.CRIT_BROADCAST), ("engine_load", K.CRIT_ENGINE_LOAD),
                   ("other", K.CRIT_OTHER))
"""The driver's critical path per RL step (``cluster/driver/critical_path.py``), in the timeline's order:
what the learner side spent each step on (sync: generating the batch first; async: waiting for groups)."""


def steady_state(res: dict, groups_per_step: list[float], group_size: int, wall: float) -> dict:
    """Throughput in steady state, with the start and the end reported apart (issue 52): the trajectories
    handed to the learner in steps 2..N over the time from the end of step 1 to the end of step N
    (``steady_trained_traj_per_s``), the first step's seconds from the stage's start (``first_step_s``:
    the pipeline filling, the first weights) and the seconds after the last step until the stage ended
    (``drain_s``: in-flight work stopped, the replay drained). Needs 3 steps or more."""
    from sonar.bench.driver_harness import rl_stage

    t0 = rl_stage(res)["t_start"]
    ends = [t - t0 for t in res.get("step_times", [])]
    out: dict = {}
    if ends:
        out["first_step_s"], out["drain_s"] = ends[0], max(0.0, wall - ends[-1])
    n = min(len(ends), len(groups_per_step))
    if n >= 3 and ends[n - 1] > ends[0]:
        out["steady_trained_traj_per_s"] = sum(groups_per_step[1:n]) * group_size / (ends[n - 1] - ends[0])
    return out


def timeline(history: list[dict], res: dict, slots: int) -> dict:
    """One run's timeline, per RL step: when it ended (seconds into the RL stage, the driver's ``on_step``
    times), the learner side's critical-path phases in seconds (``TIMELINE_PHASES``), and per rollout
    worker the engine's occupancy over the step (live rows per decode step / ``slots``, from the
    engines' counters at each step's end; None for the first step and where the pool changed size)."""
    from sonar.bench.driver_harness import rl_stage

    t0 = rl_stage(res)["t_start"]
    ends = [t - t0 for t in res.get("step_times", [])]
    rows = [r for r in history if K.CRIT_WALL in r]
    n = min(len(ends), len(rows))
    marks = res.get("engine_marks") or []
    occ: list[list[float | None]] = []
    prev = None
    for i in range(min(n, len(marks))):
        cur = marks[i]
        if prev is None or len(prev) != len(cur):
            occ.append([None] * len(cur))
        else:
            # an engine that took no step over the interval held no rows: occupancy 0
            occ.append([max(0.0, c[1] - p[1]) / (c[0] - p[0]) / slots if c[0] > p[0] else 0.0
                        for p, c in zip(prev, cur)])
        prev = cur
    return {"t_end": ends[:n], "phases": {name: [float(r.get(key, 0.0)) for r in rows[:n]]
                                          for name, key in TIMELINE_PHASES},
            "occupancy": occ, "slots": slots}


def reward_curve(history: list[dict], res: dict) -> dict:
    """Per learner step: seconds into the RL stage (the driver's ``on_step`` times, ``res["step_times"]``),
    trajectories generated so far (the replay's counter) and generated tokens so far (an estimate: each
    step's new trajectories times that step's mean model tokens), and the rollout reward."""
    from sonar.bench.driver_harness import rl_stage

    rows = [r for r in history if K.ROLLOUT_REWARD_MEAN in r and K.REPLAY_PRODUCED in r]
    t0 = rl_stage(res)["t_start"]
    times = [t - t0 for t in res.get("step_times", [])]
    gen_tokens, total, prev = [], 0.0, 0.0
    for r in rows:
        produced = float(r[K.REPLAY_PRODUCED])
        total += (produced - prev) * float(r.get(K.ROLLOUT_TOKENS_MEAN, 0.0))
        prev = produced
        gen_tokens.append(total)
    n = min(len(rows), len(times)) if times else len(rows)
    return {"t": times[:n], "generated_traj": [float(r[K.REPLAY_PRODUCED]) for r in rows][:n],
            "generated_tokens": gen_tokens[:n], "reward": [float(r[K.ROLLOUT_REWARD_MEAN]) for r in rows][:n]}


def run_setting(base_overrides: list[str], mode: str, lag: int | None, model_path: str | None, run_root: Path,
                tag: str, seed: int | None = None) -> dict:
    """One run of one setting from the SFT checkpoint; ``seed`` sets ``run.seed`` (the RL stage's prompt
    order and sampling; None: the config's). Returns ``measure``'s dict plus the overrides used."""
    from sonar.bench.driver_harness import load_cfg, run_training

    cfg0, sim0 = load_cfg([CONFIG], base_overrides)
    ov = list(base_overrides) + setting_overrides(mode, lag, cfg0, sim0)
    ov += [f"run.root={run_root}", f"run.name={NAME}-{tag}"]
    if seed is not None:
        ov.append(f"run.seed={seed}")
    if model_path:
        ov.append(f"model.path={model_path}")
    cfg, sim = load_cfg([CONFIG], ov)
    _, rl = split_stages(cfg)
    cfg = dataclasses.replace(cfg, stages=[rl])
    step_times: list[float] = []
    engine_marks: list[list[tuple[float, float]]] = []

    def on_step(roles, run, index, steps) -> bool:  # the driver calls it after logging each RL step
        import ray

        step_times.append(time.monotonic())
        # For the timeline: each engine's (steps, live row-steps) so far; workers serve it concurrently
        # (max_concurrency 4), and both modes pay the same small call.
        engs = ray.get([w.engine_stats.remote() for w in roles.workers], timeout=cfg.cluster.step_timeout_s)
        engine_marks.append([(float(e.get("steps", 0)), float(e.get("live_row_steps", 0))) for e in engs])
        return False

    res = run_training(cfg, sim, evaluate_after=True, on_step=on_step)
    res["step_times"] = step_times
    res["engine_marks"] = engine_marks
    out = measure(res, cfg, sim)
    out["seed"] = seed
    out["overrides"] = ov
    return out


# ------------------------------------------------------------------------------------ the benchmark
REPORTED = ("trained_traj_per_s", "steady_trained_traj_per_s", "first_step_s", "drain_s", "generated_traj_per_s", "generated_tokens_per_s", "stale_share",
            "generated_per_trained", "generated_tokens_per_trained_traj", "decode_row_steps_per_trained_traj",
            "decode_steps_per_worker", "engine_mean_live_rows", "zero_signal_share", "sim_overrun_step_share",
            "ctx_admitted_mean", "generated_tokens_per_s_per_gpu", "trained_tokens_per_s_per_gpu", "mfu",
            "wall_s", "wall_with_startup_s", "command_s", "heldout_em", "reward_last")
"""The per-setting numbers reported with a seed interval (``extra.ci``) beside every speedup."""


def _ci(values: list[float]) -> dict:
    """``stats.mean_ci`` of the finite values, NaN as None (JSON); the per-seed values kept."""
    vals = [float(v) for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return {"mean": None, "n": 0, "values": []}
    ci = mean_ci(vals)
    return {**{k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in ci.items()},
            "values": vals}


def speedup(base: dict, run: dict, clock: str) -> float:
    """``base``'s seconds per trained trajectory on ``clock`` over ``run``'s: the wall-clock ratio when both
    trained the same trajectories (sync and async do), and still a fair one when a baseline's batch
    rounding made it train a few more (``sync_full``)."""
    def per_traj(r: dict) -> float:
        m = r["metrics"]
        trained = m["trained_traj_per_s"] * m["wall_s"]
        return m[clock] / trained if trained > 0 else float("nan")
    return per_traj(base) / per_traj(run)


def _ratio(a: float | None, b: float | None) -> float:
    """a / b, NaN where either is missing or b is not positive."""
    return float(a) / float(b) if a is not None and b is not None and b > 0 else float("nan")


def compare(per: dict[str, list[dict]], lags: list[int], margins: dict | None = None, alpha: float = ALPHA,
            baseline: str = "sync") -> dict:
    """Per lag, from the seeds (paired per seed: run i of sync against run i of the async setting):
    the speedup on both clocks with its 95 % t-interval over seeds, and beside it every figure a reader
    needs to weigh it (throughputs, stale share, decode work per trained trajectory), and the
    equal-reward checks for final held-out EM and rollout reward: the equivalence test (TOST at level
    ``alpha`` on the paired differences async - sync, ``margins`` per metric, default ``MARGINS``), which is
    what the goal reads, and the older, weaker check beside it (async's mean inside sync's seed interval)."""
    margins = {**MARGINS, **(margins or {})}
    sync = per[baseline]
    out = {}
    for lag in lags:
        a = per[setting_name("async", lag)]
        pairs = list(zip(sync, a))
        row: dict = {
            "speedup_rl_loop": _ci([speedup(s, x, "wall_s") for s, x in pairs]),
            # the steady-state ratio, start-up of the pipeline and the stage-end drain left out
            "speedup_steady": _ci([_ratio(x["metrics"].get("steady_trained_traj_per_s"),
                                          s["metrics"].get("steady_trained_traj_per_s")) for s, x in pairs]),
            "speedup_with_startup": _ci([speedup(s, x, "wall_with_startup_s") for s, x in pairs]),
            "speedup_command": _ci([speedup(s, x, "command_s") for s, x in pairs]),
        }
        for k in REPORTED:
            row[k] = {"sync": _ci([r["metrics"].get(k) for r in sync]), "async": _ci([r["metrics"].get(k) for r in a])}
        checks = {}
        for k in ("heldout_em", "reward_last"):
            sy, asy = row[k]["sync"], row[k]["async"]
            inside = None
            if asy["mean"] is not None and sy.get("lo") is not None:
                inside = within(asy["mean"], {"lo": sy["lo"], "hi": sy["hi"]})
            diffs = [x["metrics"].get(k) - s["metrics"].get(k) for s, x in pairs
                     if s["metrics"].get(k) is not None and x["metrics"].get(k) is not None
                     and np.isfinite(s["metrics"][k]) and np.isfinite(x["metrics"][k])]
            tost = tost_paired(diffs, margins[k], alpha)
            checks[k] = {"async_mean": asy["mean"], "sync_mean": sy["mean"], "sync_ci95": [sy.get("lo"), sy.get("hi")],
                         "async_within_sync_ci95": inside,
                         "tost": {kk: (None if isinstance(v, float) and not np.isfinite(v) else v)
                                  for kk, v in tost.items()}, "paired_differences": diffs}
        row["equal_reward"] = checks
        stale = row["stale_share"]["async"]["mean"]
        row["goal"] = {"speedup_ge_2": (row["speedup_rl_loop"]["mean"] or 0) >= 2.0,
                       "equal_heldout_em": checks["heldout_em"]["tost"]["equivalent"],
                       "equal_reward_last": checks["reward_last"]["tost"]["equivalent"],
                       "stale_le_10pct": None if stale is None else stale <= 0.10}
        out[str(lag)] = row
    return out


def better_baseline(per: dict[str, list[dict]], baselines: list[str]) -> str:
    """The baseline with the higher mean trained trajectories/s over its seeds (the first on a tie)."""
    def mean_tps(b: str) -> float:
        vals = [r["metrics"].get("trained_traj_per_s") for r in per[b]]
        vals = [float(v) for v in vals if v is not None and np.isfinite(v)]
        return sum(vals) / len(vals) if vals else float("-inf")
    return max(baselines, key=lambda b: (mean_tps(b), -baselines.index(b)))


def settings_of(cfg_bench: dict) -> list[tuple[str, int | None]]:
    """The (mode, lag) of every setting a benchmark run compares: its baselines, then async at each lag."""
    return [(b, None) for b in cfg_bench.get("baselines", ["sync"])] + [("async", lag) for lag in cfg_bench["lags"]]


def ray_sizing(base, sim, cfg_bench: dict):
    """``base`` with ``cluster.num_cpus`` large enough for every setting's roles (the colocated baseline
    runs more rollout workers than the others), unless the config fixes it: one Ray cluster serves every
    run, and a setting whose actors do not fit would wait for CPUs that never come."""
    from sonar.bench.driver_harness import load_cfg

    if base.cluster.num_cpus:
        return base
    settings = settings_of(cfg_bench)
    need = 0.0
    for mode, lag in settings:
        c, _ = load_cfg([CONFIG], list(cfg_bench["overrides"]) + setting_overrides(mode, lag, base, sim))
        need = max(need, c.learner.num_cpus * c.learner.num_ranks + c.rollout.num_workers * c.rollout.num_cpus_per_worker
                   + c.retrieval.replicas * c.retrieval.num_cpus_per_replica)
    return dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, num_cpus=max(4, int(math.ceil(need)))))


def run(cfg_bench: dict) -> tuple[dict, dict]:
    from sonar.bench.driver_harness import device_info, load_cfg, load_note, loadavg, start_ray

    overrides = list(cfg_bench["overrides"])
    base, sim = load_cfg([CONFIG], overrides)
    sft_stage, rl_stage_cfg = split_stages(base)
    owns = start_ray(ray_sizing(base, sim, cfg_bench))
    import ray

    seeds = list(cfg_bench["seeds"])
    try:
        model_path, sft_info = sft_checkpoint(base, sim, sft_stage)
        run_root = Path(base.run.root).resolve() / "bench-async-vs-sync"
        settings = settings_of(cfg_bench)
        per: dict[str, list[dict]] = {setting_name(m, l): [] for m, l in settings}
        load = {"start": loadavg()}
        order: dict[str, list[str]] = {}
        for i, seed in enumerate(seeds):  # settings interleaved within each seed, their order rotated per seed
            order[str(seed)] = [setting_name(m, l) for m, l in run_order(settings, i)]
            for mode, lag in run_order(settings, i):
                name = setting_name(mode, lag)
                t0 = time.time()
                r = run_setting(overrides, mode, lag, model_path, run_root, f"{name}-s{seed}", seed=seed)
                r["loadavg_after"] = loadavg()
                per[name].append(r)
                m = r["metrics"]
                log.info("%s seed %d: RL loop %.1f s (%.2f s/step), %.1f trained traj/s, %.1f generated, stale %.2f, "
                         "learner idle %.2f, reward %.3f, held-out EM %s, lag hist %s (%.0f s incl. start-up)", name,
                         seed, m["wall_s"], m["seconds_per_step"], m["trained_traj_per_s"], m["generated_traj_per_s"],
                         m["stale_share"], m["learner_idle_fraction"], m["reward_last"], m.get("heldout_em"),
                         r["lag_hist"], time.time() - t0)
        load["end"] = loadavg()
    finally:
        if owns:
            ray.shutdown()

    metrics: dict[str, dict] = {}
    for name, reps in per.items():
        for key in reps[0]["metrics"]:
            vals = [r["metrics"][key] for r in reps if np.isfinite(r["metrics"].get(key, float("nan")))]
            if vals:
                metrics[f"{name}/{key}"] = summarise(vals)
        hist_keys = sorted({k for r in reps for k in r["lag_hist"]},
                           key=lambda k: (k.startswith("ge"), int(k.lstrip("ge"))))
        for k in hist_keys:
            metrics[f"{name}/policy_lag_hist/{k}"] = summarise([r["lag_hist"].get(k, 0.0) for r in reps])
    # speedups paired per seed against the better baseline: metrics.speedup (RL loop), .speedup_with_startup,
    # .speedup_command, keyed by lag (every baseline's under extra.comparison_by_baseline)
    baselines = cfg_bench.get("baselines", ["sync"])
    best = better_baseline(per, baselines)
    groups = {"speedup": "wall_s", "speedup_with_startup": "wall_with_startup_s", "speedup_command": "command_s"}
    for group, key in groups.items():
        g = {str(lag): summarise([speedup(s, a, key)
                                  for s, a in zip(per[best], per[setting_name("async", lag)])])
             for lag in cfg_bench["lags"]}
        if g:  # validate_result rejects an empty group
            metrics[group] = g
    speedup_medians = {lag: sm["median"] for lag, sm in metrics.get("speedup", {}).items()}

    # Reading the result: the sync decomposition and the two-stage pipeline bound.
    s = {k: float(np.median([r["metrics"][k] for r in per["sync"]])) for k in per["sync"][0]["metrics"]}
    gen_phase = max(0.0, s["seconds_per_step"] - s["train_s_per_step"] - s["sync_s_per_step"])
    learner_stage = s["train_s_per_step"] + s["sync_s_per_step"]
    bound = s["seconds_per_step"] / max(gen_phase, learner_stage, 1e-9)
    by_baseline = {b: compare(per, cfg_bench["lags"], cfg_bench.get("margins"), baseline=b) for b in baselines}
    comparison = by_baseline[best]
    cost_model = sim_cost_label(sim)
    extra = {
        "speedup": speedup_medians,
        "seeds": seeds,
        "run_order": order,
        "baselines": baselines,
        "baseline": best,
        "baseline_note": "speedups and equivalence under `comparison` are against `baseline`, the synchronous "
                         "baseline with the higher mean trained trajectories/s; `comparison_by_baseline` has each",
        "comparison_by_baseline": by_baseline,
        "equivalence": {"test": "TOST (two one-sided t-tests) on paired per-seed differences async - sync",
                        "alpha": ALPHA, "margins": {**MARGINS, **(cfg_bench.get("margins") or {})}},
        "cost_model": cost_model,
        "target": "async at lag <= 2 against the better synchronous baseline: >= 2x its trained trajectories/s, "
                  "final held-out EM and final rollout reward equivalent (TOST on the paired differences, the "
                  "margins under `equivalence`), stale waste <= 10 % of generated trajectories",
        "comparison": comparison,
        "ci_note": "95 % t-intervals over seeds (one run per seed and setting; bench/stats.py), never over the steps "
                   "of one run; speedups are paired per seed. With one seed (--quick) the interval is unknown (None).",
        "analysis": {
            "sync_seconds_per_step": s["seconds_per_step"],
            "sync_generate_phase_s_per_step": gen_phase,
            "sync_train_plus_sync_s_per_step": s["train_s_per_step"] + s["sync_s_per_step"],
            "sync_worker_gen_s_per_step": s["gen_s_per_step"],
            "sync_worker_retrieve_s_per_step": s["retrieve_s_per_step"],
            "pipeline_bound_speedup": bound,
            "sync_engine_mean_live_rows": s.get("engine_mean_live_rows", float("nan")),
            "engine_slots_per_worker": base.rollout.max_batch_rows,
            "fair_baseline": {"per_trajectory": base.rollout.per_trajectory,
                              "sync_rows_per_worker": base.learner.groups_per_step * base.rollout.group_size
                              / base.rollout.num_workers,
                              "note": "sync submits each worker's whole share of the step at once (no lane cap); "
                                      "with rollout.per_trajectory every trajectory is its own coroutine in both "
                                      "modes. Both modes are bounded by the same engine slots (max_batch_rows); "
                                      "async has more rows in flight only by running ahead within its staleness "
                                      "bound."},
            "note": "pipeline bound = sync step / max(generate phase, train + broadcast): what overlapping the two "
                    "stages alone could give, with unchanged stage times. Async also removes the per-step barrier "
                    "and keeps the engine fuller (engine_mean_live_rows per setting), which is how it goes past "
                    "the bound. CPU contention, which async adds on 2 cores, is ignored.",
        },
        "sft": sft_info,
        "loadavg": load,
        "realised": {name: realised_of_setting(reps) for name, reps in per.items()},
        "settings": {name: [{"seed": r["seed"], "metrics": r["metrics"], "lag_hist": r["lag_hist"],
                             "replay": r["replay"], "workers": r["workers"], "startup_s": r["startup_s"],
                             "loadavg_after": r["loadavg_after"], "overrides": r["overrides"]} for r in reps]
                     for name, reps in per.items()},
        "reward_curves": {name: [r["curve"] for r in reps] for name, reps in per.items()},
        "timelines": {name: reps[0]["timeline"] for name, reps in per.items() if reps},
        "timelines_note": "the first seed's run of each setting: per RL step its end time, the learner side's "
                          "critical-path phases and each engine's occupancy (bench/async_vs_sync.py: timeline)",
        "device": device_info(base, sim),
        "machine_note": load_note(load),
    }
    return metrics, extra


def plot(metrics: dict, extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    names = list(extra["settings"])
    fig, ax = plt.subplots(2, 3, figsize=(18, 8.5))
    med = lambda n, k: metrics.get(f"{n}/{k}", {}).get("median", float("nan"))  # noqa: E731
    palette = ["tab:gray", "tab:brown", "tab:olive", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:red"]
    colors = [palette[i % len(palette)] for i in range(len(names))]
    comp = extra.get("comparison", {})
    by_base = extra.get("comparison_by_baseline") or {"sync": comp}

    def ci_of(n: str, k: str) -> tuple[float, float]:  # (mean, half-width) over seeds, NaN when unknown
        if n in by_base:  # a baseline: its own interval is the "sync" side of its comparison
            row = next(iter(by_base[n].values()), {})
        else:
            row = comp.get(n.replace("async_lag", ""), {})
        c = row.get(k, {}).get("sync" if n in by_base else "async", {})
        return (c.get("mean") if c.get("mean") is not None else float("nan"),
                c.get("half") if c.get("half") is not None else 0.0)

    walls = [ci_of(n, "wall_s")[0] for n in names]
    b = ax[0, 0].bar(names, walls, color=colors, yerr=[ci_of(n, "wall_s")[1] for n in names], capsize=4)
    for rect, n in zip(b, names):
        lag = n.replace("async_lag", "")
        sp = comp.get(lag, {}).get("speedup_rl_loop", {})
        half = f" +-{sp['half']:.2f}" if sp.get("half") is not None else ""
        label = ("baseline" if n == extra.get("baseline", "sync") else "") if n in by_base else \
            f"{sp.get('mean', float('nan')):.2f}x{half}"
        ax[0, 0].annotate(label, (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom")
    ax[0, 0].set_ylabel("RL loop wall-clock (s), mean and 95 % CI over seeds")
    an = extra["analysis"]
    ax[0, 0].set_title(f"wall-clock, same steps (overlap-only pipeline bound {an['pipeline_bound_speedup']:.2f}x)",
                       fontsize=10)

    x = np.arange(len(names))
    for j, (k, lab) in enumerate([("trained_traj_per_s", "trained traj/s"),
                                  ("generated_traj_per_s", "generated traj/s")]):
        ax[0, 2].bar(x + (j - 0.5) * 0.4, [ci_of(n, k)[0] for n in names], 0.4,
                     yerr=[ci_of(n, k)[1] for n in names], capsize=3, label=lab)
    for i, n in enumerate(names):
        ax[0, 2].annotate(f"stale {ci_of(n, 'stale_share')[0]:.0%}", (i, 0), ha="center", va="bottom", fontsize=8)
    ax[0, 2].set_xticks(x, names)
    ax[0, 2].set_ylabel("trajectories / s of RL loop")
    ax[0, 2].legend(fontsize=8)
    ax[0, 2].set_title("trained vs generated throughput (stale share at the foot)", fontsize=10)

    x = np.arange(len(names))
    slots = float(an.get("engine_slots_per_worker") or 0)
    ax[0, 1].bar(x - 0.27, [med(n, "learner_idle_fraction") for n in names], 0.27, label="learner idle")
    ax[0, 1].bar(x, [med(n, "rollout_idle_fraction") for n in names], 0.27, label="rollout idle")
    if slots > 0:
        ax[0, 1].bar(x + 0.27, [med(n, "engine_mean_live_rows") / slots for n in names], 0.27,
                     label=f"engine occupancy (live rows / {slots:.0f} slots)")
    ax[0, 1].set_xticks(x, names)
    ax[0, 1].set_ylim(0, 1)
    ax[0, 1].set_ylabel("fraction")
    ax[0, 1].legend(fontsize=8)
    ax[0, 1].set_title("idle fractions and engine occupancy (derived, see docstring)")

    # Each setting's histogram has its own overflow bin ("ge<max_lag+2>"); plot on a common integer axis
    # where an overflow count sits at its threshold (the last tick is labelled "k+" when one does).
    hists, overflow_at = {}, set()
    for n in names:
        h = {}
        for k in [k.rsplit("/", 1)[1] for k in metrics if k.startswith(f"{n}/policy_lag_hist/")]:
            i = int(k.lstrip("ge"))
            if k.startswith("ge"):
                overflow_at.add(i)
            h[i] = h.get(i, 0.0) + med(n, f"policy_lag_hist/{k}")
        hists[n] = h
    xs = sorted({i for h in hists.values() for i in h})
    w = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        counts = np.array([hists[n].get(x, 0.0) for x in xs])
        tot = counts.sum() or 1.0
        ax[1, 0].bar(np.arange(len(xs)) + i * w - 0.4 + w / 2, counts / tot, w, label=n, color=colors[i])
    ax[1, 0].set_xticks(np.arange(len(xs)), [f"{x}+" if x == max(xs) and x in overflow_at else str(x) for x in xs])
    ax[1, 0].set_xlabel("policy lag of trained groups (learner steps)")
    ax[1, 0].set_ylabel("fraction of trained groups")
    ax[1, 0].legend()
    ax[1, 0].set_title("policy-lag histogram")

    for col, xkey, xlabel in ((1, "t", "seconds into the RL stage"), (2, "generated_tokens",
                                                                     "generated model tokens (estimate)")):
        a_ = ax[1, col]
        for i, n in enumerate(names):
            for j, c in enumerate(extra["reward_curves"].get(n) or []):
                xs_, r = np.asarray(c.get(xkey) or [], float), np.asarray(c.get("reward") or [], float)
                m_ = min(len(xs_), len(r))
                if not m_:
                    continue
                a_.plot(xs_[:m_], r[:m_], ".", alpha=0.25, color=colors[i])
                k = min(5, m_)
                smooth = np.convolve(r[:m_], np.ones(k) / k, mode="valid")
                a_.plot(xs_[k - 1:m_], smooth, color=colors[i], alpha=0.8,
                        label=f"{n} ({k}-step mean, each seed)" if j == 0 else None)
        a_.set_xlabel(xlabel)
        a_.set_ylabel(K.ROLLOUT_REWARD_MEAN)
        a_.legend(fontsize=8)
        a_.set_title(f"rollout reward against {'wall-clock' if col == 1 else 'generated tokens'}", fontsize=10)
    dev = extra["device"]
    dec = (f", decode {dev['decode_ms_per_token']:.0f} ms/step + lognormal({dev['decode_median_tokens']:.0f} tok, "
           f"sigma {dev['decode_sigma']}) per turn" if dev.get("decode_ms_per_token") else "")
    engine = "bench (BENCHMARK engine)" if dev["sim_engine"] == "bench" else dev["rollout_engine"]
    cm = extra.get("cost_model", {})
    fig.suptitle(f"async vs sync ({len(extra.get('seeds', []))} seeds; decode cost model: {cm.get('decode_cost')}) "
                 f"-- engine={engine}"
                 f"{' (continuous batching)' if dev.get('continuous_batching') else ''} on {dev['rollout_device']}, "
                 f"learner on {dev['learner_device']}, retrieval +{dev['retrieval_latency_ms']:.0f} ms median "
                 f"(sigma {dev['retrieval_latency_sigma']}){dec}\n{extra['machine_note']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    if extra.get("timelines"):
        plot_timeline(extra["timelines"], png.with_name(png.stem + "-timeline.png"))


PHASE_COLORS = {"generate_sync": "tab:gray", "queue_wait": "tab:olive", "train": "tab:red", "push": "tab:purple",
                "engine_load": "tab:pink", "other": "lightgray"}


def plot_timeline(timelines: dict, png: Path) -> None:
    """One panel per setting (its first seed): the learner side's critical-path phases of every RL step as
    bars along the clock (top band), and each rollout engine's occupancy per step (lines, 0-1). Sync trains
    while its engines empty; async keeps them occupied while it trains."""
    import matplotlib.pyplot as plt

    names = list(timelines)
    fig, axes = plt.subplots(len(names), 1, figsize=(16, 2.2 * len(names) + 1), sharex=True, squeeze=False)
    for ax, n in zip(axes[:, 0], names):
        tl = timelines[n]
        ends = tl["t_end"]
        start = 0.0
        for i, end in enumerate(ends):
            t = start
            for name in PHASE_COLORS:
                d = tl["phases"].get(name, [0.0] * len(ends))[i]
                if d > 0:
                    ax.broken_barh([(t, d)], (1.1, 0.3), color=PHASE_COLORS[name])
                    t += d
            start = end
        occ = tl["occupancy"]
        for w in range(max((len(o) for o in occ), default=0)):
            xs = [ends[i] for i in range(len(occ)) if w < len(occ[i]) and occ[i][w] is not None]
            ys = [occ[i][w] for i in range(len(occ)) if w < len(occ[i]) and occ[i][w] is not None]
            ax.step(xs, ys, where="pre", lw=1, label=f"worker {w} engine occupancy" if w < 2 else None)
        ax.set_ylim(0, 1.5)
        ax.set_yticks([0, 0.5, 1.0, 1.25], ["0", "0.5", "1 (all slots)", "learner"])
        ax.set_title(f"{n}: learner critical path per step (top) and engine occupancy (live rows / {tl['slots']} "
                     "slots, per step)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    axes[0, 0].legend(handles + axes[0, 0].get_legend_handles_labels()[0],
                      list(PHASE_COLORS) + axes[0, 0].get_legend_handles_labels()[1], fontsize=7, ncol=4,
                      loc="upper right")
    axes[-1, 0].set_xlabel("seconds into the RL stage")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# The README's rendering of a result (pure: no runs; tests/bench/test_async_vs_sync_readme.py)

README = REPO_ROOT / "bench" / "README.md"
TABLE_BEGIN = "<!-- async-vs-sync table: "
TABLE_END = "<!-- /async-vs-sync table -->"
SETTING_ROWS = (
    ("trained traj/s", "trained_traj_per_s", "{:.2f}"),
    ("generated traj/s", "generated_traj_per_s", "{:.2f}"),
    ("stale share of generated", "stale_share", "pct"),
    ("decode steps per worker", "decode_steps_per_worker", "{:,.0f}"),
    ("mean rows per decode step", "engine_mean_live_rows", "{:.1f}"),
    ("decode row-steps per trained traj", "decode_row_steps_per_trained_traj", "{:,.0f}"),
    ("zero-signal share of groups", "zero_signal_share", "pct"),
    ("steps where real work overran the simulated one", "sim_overrun_step_share", "pct"),
    ("context charged per admitted prompt (tokens)", "ctx_admitted_mean", "{:,.0f}"),
    ("generated tokens/s per GPU", "generated_tokens_per_s_per_gpu", "{:,.0f}"),
    ("trained tokens/s per GPU", "trained_tokens_per_s_per_gpu", "{:,.0f}"),
    ("MFU of the simulated job", "mfu", "pct"),
    ("RL loop wall (s)", "wall_s", "{:,.0f}"),
    ("final rollout reward", "reward_last", "{:.3f}"),
    ("final held-out EM", "heldout_em", "pct"),
)
"""The per-setting rows of the table: label, metric key (``measure``), format (``pct``: a percentage)."""


def _fmt(v: float, form: str) -> str:
    """``pct``: a share in percent; ``pt``: a difference of shares in percentage points; else a format string."""
    if form in ("pct", "pt"):
        return f"{100 * v:.1f} {'%' if form == 'pct' else 'pt'}"
    return form.format(v)


def _cell(values: list, form: str) -> str:
    """Mean ± the 95 % half-width over seeds of the finite ``values`` (n/a when there are none)."""
    ci = _ci(values)
    if ci["mean"] is None:
        return "n/a"
    half = ci.get("half")
    return _fmt(ci["mean"], form) + ("" if half is None else " ± " + _fmt(half, form).replace(" %", " pt"))


def _interval(ci: dict, form: str = "{:.2f}") -> str:
    if ci.get("mean") is None:
        return "n/a"
    if ci.get("lo") is None:
        return _fmt(ci["mean"], form) + " (one seed)"
    return f"{_fmt(ci['mean'], form)} [{_fmt(ci['lo'], form)}, {_fmt(ci['hi'], form)}]"


def _tost(check: dict, form: str) -> str:
    t = check["tost"]
    if t.get("mean") is None:
        return "n/a"
    verdict = {True: "**equivalent**", False: "not shown", None: "untested"}[t.get("equivalent")]
    lo, hi = ("?", "?") if t.get("lo") is None else (_fmt(t["lo"], form), _fmt(t["hi"], form))
    return f"{_fmt(t['mean'], form)} [{lo}, {hi}] ±{_fmt(t['margin'], form)}: {verdict}"


VARIANT_KIND = "async-vs-sync variant"
"""A second result in the same form (one setting of the workload changed, e.g. the learner's GPUs), shown
beside the main block: a ``common.readme_block`` that ``sonar bench readme`` renders from the JSON it names."""
VARIANT_BEGIN, VARIANT_END = f"<!-- {VARIANT_KIND} table: ", f"<!-- /{VARIANT_KIND} table -->"


def render_variant_table(doc: dict, json_name: str) -> str:
    """``render_table``'s rows of ``doc`` in a variant block."""
    from sonar.bench.common import readme_block

    return readme_block(VARIANT_KIND, json_name, _table_lines(doc))


def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's async-vs-sync block for ``doc`` (an async-vs-sync result), markers included: the
    per-setting figures over seeds, then per lag and baseline the speedup and the equivalence tests."""
    return "\n".join([f"{TABLE_BEGIN}bench/results/{json_name} (`sonar bench async-vs-sync --readme` writes this "
                      f"block; tests/bench/test_async_vs_sync_readme.py checks it) -->", *_table_lines(doc), TABLE_END])


def _table_lines(doc: dict) -> list[str]:
    """The rows of an async-vs-sync block, between its markers."""
    ex, cfg = doc["extra"], doc["config"]
    settings = list(ex["settings"])
    lines = ["Per setting, mean ± 95 % half-width over the seeds (pt: percentage points):", "",
             "| | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for label, key, form in SETTING_ROWS:
        lines.append(f"| {label} | " + " | ".join(
            _cell([r["metrics"].get(key) for r in ex["settings"][n]], form) for n in settings) + " |")
    best = ex.get("baseline", "sync")
    by = ex.get("comparison_by_baseline") or {best: ex["comparison"]}
    alpha = ex.get("equivalence", {}).get("alpha", ALPHA)
    lines += ["", "Async against each baseline, paired per seed: speedup in seconds per trained trajectory on the RL "
                  f"loop (mean [95 % interval]); final held-out EM and rollout reward, async − baseline (mean "
                  f"[{100 * (1 - 2 * alpha):.0f} % interval] ± margin: TOST at level {alpha:g}); the goal's marks "
                  "(≥ 2×, both equivalent, stale ≤ 10 %):",
              "", "| async | baseline | speedup | held-out EM difference | reward difference | goal met |",
              "|---|---|---|---|---|---|"]
    for lag in cfg["lags"]:
        for b, comp in by.items():
            row = comp[str(lag)]
            g = row["goal"]
            met = "yes" if all(v is True for v in g.values()) else "no: " + ", ".join(
                k for k, v in g.items() if v is not True)
            lines.append(f"| lag {lag} | {b}{' (better)' if b == best else ''} | "
                         f"{_interval(row['speedup_rl_loop'])}× | {_tost(row['equal_reward']['heldout_em'], 'pt')} | "
                         f"{_tost(row['equal_reward']['reward_last'], '{:.3f}')} | {met} |")
    mismatches = (ex.get("workload_check") or {}).get("mismatches")
    if mismatches:
        lines += ["", f"**The run did not realise its workload's label** (accepted with `--accept-mismatch`; "
                      f"tolerance {ex['workload_check']['tolerance']:.0%}):", ""] + [f"- {m}" for m in mismatches]
    hw = doc["hardware"]
    wl = cfg.get("workload", {}).get("workload", "bench")
    lines += ["", f"Measured by `{' '.join(doc['argv'])}` on commit {doc['commit'][:10]} ({doc['timestamp'][:10]}; "
                  f"{hw.get('cpu_model') or 'CPU'}; {ex.get('machine_note', '')}): workload "
                  f"`{wl}`, seeds {', '.join(map(str, ex['seeds']))} (each seed's order rotated), "
                  f"{doc['config']['resolved']['stages'][-1]['steps']} RL steps per run, "
                  f"{ex['wall_s'] / 60:.0f} min in all."]
    return lines


def _pm(ci: dict, form: str = "{:.1f}", scale: float = 1.0) -> str:
    """mean ± the 95 % half-width of an interval over seeds (``_ci``)."""
    return f"{form.format(scale * ci['mean'])} ± {form.format(scale * ci['half'])}"


def _lag_hist(runs: list[dict], upto: int) -> str:
    """Trained groups by policy lag 0..upto (``ge<k>``: k or more), the mean over seeds; ~ where seeds differ."""
    cells = []
    for k in range(upto + 1):
        vals = [r["lag_hist"].get(str(k), r["lag_hist"].get(f"ge{k}", 0.0)) for r in runs]
        cells.append(("~" if len(set(vals)) > 1 else "") + f"{np.mean(vals):.0f}")
    return " / ".join(cells)


def render_lags_table(doc: dict, json_name: str) -> str:
    """bench/README.md's table of an async-vs-sync result against plain sync at each lag (the older
    layout: ``extra.comparison`` per lag, one baseline): mean ± 95 % half-width over seeds, the speedups paired
    per seed, the per-seed held-out EM and the policy lags of the trained groups."""
    from sonar.bench.common import readme_block

    lags, ex = doc["config"]["lags"], doc["extra"]
    comps = [ex["comparison"][str(lag)] for lag in lags]
    sync = {k: v["sync"] for k, v in comps[0].items() if isinstance(v, dict) and "sync" in v}
    n_q = doc["config"]["resolved"]["world"]["num_heldout_eval"]

    def both(key: str, cell) -> list[str]:
        return [cell(sync[key], None)] + [cell(c[key]["async"], sync[key]) for c in comps]

    def ratio(form: str):
        return lambda a, s: form.format(a["mean"]) + ("" if s is None else f" ({a['mean'] / s['mean']:.2f}×)")

    rows = [("RL-loop wall (s)", both("wall_s", lambda a, s: _pm(a))),
            ("**speedup, RL loop**", ["–"] + [f"**{_pm(c['speedup_rl_loop'], '{:.2f}')}×** "
                                             f"({c['speedup_rl_loop']['lo']:.2f}–{c['speedup_rl_loop']['hi']:.2f})"
                                             for c in comps]),
            ("speedup, start-up included / whole command",
             ["–"] + [f"{c['speedup_with_startup']['mean']:.2f}× / {c['speedup_command']['mean']:.2f}×"
                      for c in comps]),
            ("trained trajectories/s", both("trained_traj_per_s", lambda a, s: _pm(a))),
            ("generated trajectories/s", both("generated_traj_per_s", lambda a, s: _pm(a))),
            ("generated tokens/s (visible)", both("generated_tokens_per_s", lambda a, s: f"{a['mean']:,.0f}")),
            ("**stale share** of generated trajectories",
             both("stale_share", lambda a, s: f"{_pm(a, scale=100)} %" if s is None else f"**{_pm(a, scale=100)} %**")),
            ("tokens decoded per trained trajectory", both("generated_tokens_per_trained_traj", ratio("{:.1f}"))),
            ("decode row-steps per trained trajectory (simulated reasoning included)",
             both("decode_row_steps_per_trained_traj", lambda a, s: f"{a['mean'] / (s or a)['mean']:.2f}×")),
            ("rollout reward, last steps", both("reward_last", lambda a, s: _pm(a, "{:.3f}"))),
            (f"held-out EM after RL ({n_q} questions)",
             both("heldout_em", lambda a, s: f"{_pm(a, '{:.2f}')} ({', '.join(f'{v:.2f}' for v in a['values'])})")),
            (f"policy lag of trained groups ({' / '.join(map(str, range(max(lags) + 1)))})",
             [_lag_hist(ex["settings"]["sync"], max(lags))]
             + [_lag_hist(ex["settings"][f"async_lag{lag}"], max(lags)) for lag in lags])]
    lines = ["| | sync | " + " | ".join(f"async, lag {lag}" for lag in lags) + " |", "|---|---|" + "---|" * len(lags)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return readme_block("async-vs-sync lags", json_name, lines)


def render_ablation_table(named: list[tuple[str, dict]]) -> str:
    """bench/README.md's ablation table: one async-vs-sync result per setting (``bench/results/ablation/<label>/``,
    the default's at the top of bench/results), each with its engine, lanes per worker, admission budget and
    decode tail as its resolved config says, and its lag-2 speedup, RL walls, stale drops and live rows."""
    from sonar.bench.common import readme_block

    lag = 2
    lines = ["| label | engine | lanes per worker | admission budget | decode tail | speedup at lag 2 | "
             "sync → async wall | stale dropped | rows live, sync → async |", "|---|" + "---|" * 8]
    for name, doc in named:
        r, m = doc["config"]["resolved"], doc["metrics"]
        label = f"`{Path(name).parent.name}`" if Path(name).parent.name else "default"
        budget = r["replay"]["max_inflight_groups"]
        budget = "none" if budget == 0 else "(lag+1)·B" if budget < 0 else budget  # -1: auto, (lag + 1) x a step
        sim = doc["config"].get("sim") or {}  # the decode tail: rollout.inject_* before bench/sim/ had it
        tail = r["rollout"].get("inject_decode_ms_per_token", sim.get("decode_ms_per_token"))
        sp = m["speedup"][str(lag)]
        repeats = f" ({sp['n']} repeats)" if sp["n"] > 1 else ""
        live = [m.get(f"{s}/engine_mean_live_rows") for s in ("sync", f"async_lag{lag}")]
        lines.append(
            f"| {label} | {'continuous' if r['rollout']['continuous_batching'] else 'static'} | "
            f"{r['rollout']['batches_in_flight']} | {budget} | "
            f"{'yes' if tail else 'none'} | {sp['median']:.2f}×{repeats} | "
            f"{m['sync/wall_s']['median']:.1f} → {m[f'async_lag{lag}/wall_s']['median']:.1f} s | "
            f"{m[f'async_lag{lag}/dropped_stale']['median']:.0f} | "
            + (" → ".join(f"{x['median']:.1f}" for x in live) if all(live) else "–") + " |")
    return readme_block("async-vs-sync ablation", [name for name, _ in named], lines)


def readme_json(text: str) -> str | None:
    """The result the README's async-vs-sync block names, or None when it has none."""
    from sonar.bench.common import block_result

    return block_result(text, TABLE_BEGIN)


def write_readme(json_path: Path, readme: Path = README) -> None:
    from sonar.bench.common import load_full_result, splice

    doc = load_full_result(json_path, NAME)
    text = readme.read_text()
    readme.write_text(splice(text, TABLE_BEGIN, TABLE_END, render_table(doc, json_path.name), "results block"))
    print(f"[{NAME}] {readme} now shows {json_path.name} (it showed {readme_json(text)})")


def main(argv: list[str] | None = None) -> int:
    p = driver_bench_parser(NAME, __doc__.splitlines()[0], "configs/bench.yaml")
    p.add_argument("--lags", type=int, nargs="+", help="async max_policy_lag values (default 1 2; quick: 2)")
    p.add_argument("--seeds", type=int, nargs="+",
                   help="run.seed values, one run per seed and setting (default 0 1 2 3 4; quick: 0), each seed "
                        "running the settings in a rotated order; the confidence "
                        "intervals are over seeds. --repeats N means seeds 0..N-1")
    p.add_argument("--steps", type=int, help="RL steps per setting (default: the config's)")
    p.add_argument("--baselines", nargs="+", choices=BASELINES[1:], default=None,
                   help="synchronous baselines besides plain sync (always run): sync_full (matched concurrency), "
                        "colocated (generation, then training, on every GPU; needs a simulated learner). Default: "
                        "sync_full, and colocated too with --workload reference-7b; quick: none")
    p.add_argument("--workload", choices=["bench", "reference-7b"], default="bench",
                   help="bench: configs/bench.yaml as it is; reference-7b: the reference 7B job on H100s simulated "
                        "around the tiny policy (bench/sim/reference.py: prefill, KV recompute, a search cluster's "
                        "queueing, a FLOP-costed learner)")
    p.add_argument("--accept-mismatch", action="store_true",
                   help="write the result even when the run did not realise its workload's label (bench/sim/"
                        "reference.py: realised_vs_label); the mismatches are recorded in extra.workload_check and "
                        "shown by the README block. Without it such a run exits 3 and writes nothing")
    p.add_argument("--margin-em", type=float, default=MARGINS["heldout_em"],
                   help="equivalence margin of final held-out EM, async - sync, absolute (default %(default)s)")
    p.add_argument("--margin-reward", type=float, default=MARGINS["reward_last"],
                   help="equivalence margin of final rollout reward, async - sync, absolute (default %(default)s)")
    p.add_argument("--engine", choices=["hf", "vllm", "bench"],
                   help="hf: the config's transformers engine (default); vllm: vLLM's AsyncLLM engine, real decode "
                        "cost, no simulated decode pacing; bench: the BENCHMARK engine (sim.engine=bench)")
    p.add_argument("--readme", metavar="JSON",
                   help="run nothing: rewrite bench/README.md's async-vs-sync block from JSON (a full result)")
    p.renders_only = "readme"  # --readme writes bench/README.md from a committed JSON: any tree may do that
    args = p.parse_args(argv)
    if args.readme is not None:
        write_readme(Path(args.readme))
        return 0
    cfg = bench_settings(args, QUICK, FULL)
    if args.seeds:
        cfg["seeds"] = list(args.seeds)
    elif args.repeats:
        cfg["seeds"] = list(range(args.repeats))
    cfg.pop("repeats", None)
    if args.lags:
        cfg["lags"] = args.lags
    for name, v in (("--margin-em", args.margin_em), ("--margin-reward", args.margin_reward)):
        if not (np.isfinite(v) and v > 0):
            p.error(f"{name}={v} must be a finite number > 0")
    cfg["margins"] = {"heldout_em": args.margin_em, "reward_last": args.margin_reward}
    if args.workload == "reference-7b":
        from sonar.bench.sim import reference

        cfg["overrides"] += reference.overrides()
        cfg["workload"] = reference.label()
    else:
        cfg["workload"] = {"workload": "bench", "config": "configs/bench.yaml"}
    extra_baselines = args.baselines if args.baselines is not None else (
        [] if args.quick else ["sync_full"] + (["colocated"] if args.workload == "reference-7b" else []))
    cfg["baselines"] = ["sync"] + [b for b in extra_baselines if b != "sync"]
    if args.steps:
        cfg["overrides"].append(f"stages.1.steps={args.steps}")
    if args.engine == "bench":  # it simulates decode time itself and serialises its calls
        cfg["overrides"] += ["sim.engine=bench", "rollout.continuous_batching=false", "rollout.per_trajectory=false",
                             "sim.decode_ms_per_token=0.0"]
    elif args.engine == "vllm":
        # vLLM's decode cost is real and grows with the batch (measured: 4 ms/step for 1 row, 11 ms for
        # 64 on this CPU), so nothing is simulated on the decode side: the paced wrapper would serialise
        # vLLM's concurrent requests. Retrieval latency stays simulated as in the other settings.
        cfg["overrides"] += ["rollout.engine=vllm", "rollout.continuous_batching=false", "sim.engine=real",
                             "sim.decode_ms_per_token=0.0"]
    elif args.engine:
        cfg["overrides"] += [f"rollout.engine={args.engine}", "sim.engine=real"]
    cfg["overrides"] += args.overrides
    from sonar.bench.driver_harness import load_cfg
    from sonar.cluster.wire.config import to_dict

    resolved, sim = load_cfg([CONFIG], cfg["overrides"])
    cfg.update(quick=args.quick, config_file=str(CONFIG.relative_to(REPO_ROOT)), resolved=to_dict(resolved),
               sim=sim.to_dict(),
               timed_span="driver RL loop: workers' start to the end of RolloutPool.end_stage")
    t0 = time.time()
    metrics, extra = run(cfg)
    extra["wall_s"] = round(time.time() - t0, 1)
    extra["workload_check"] = check = workload_check(cfg["workload"], extra["realised"], args.quick)
    if check.get("mismatches"):
        print(f"[{NAME}] the run did not realise its workload's label ({cfg['workload']['workload']}, tolerance "
              f"{check['tolerance']:.0%}):", file=sys.stderr)
        for msg in check["mismatches"]:
            print(f"[{NAME}]   {msg}", file=sys.stderr)
        if not args.accept_mismatch:
            print(f"[{NAME}] no result written; --accept-mismatch writes it with the mismatches recorded "
                  "(extra.workload_check.mismatches)", file=sys.stderr)
            return 3
        check["accepted"] = True
    path = write_result(NAME, cfg, metrics, lambda png: plot(metrics, extra, png), args.out, extra=extra)
    print(f"[{NAME}] wrote {path} and {path.with_suffix('.png').name} in {extra['wall_s']} s")
    fmt = lambda c: "n/a" if c.get("mean") is None else (  # noqa: E731
        f"{c['mean']:.3g}" + (f" +-{c['half']:.2g}" if c.get("half") is not None else ""))
    print(f"[{NAME}] {len(extra['seeds'])} seed(s), decode cost model {extra['cost_model'].get('decode_cost')}")
    for lag, row in extra["comparison"].items():
        print(f"[{NAME}] lag {lag}: speedup RL loop {fmt(row['speedup_rl_loop'])}x, with start-up "
              f"{fmt(row['speedup_with_startup'])}x, whole command {fmt(row['speedup_command'])}x; trained traj/s "
              f"{fmt(row['trained_traj_per_s']['async'])} vs sync {fmt(row['trained_traj_per_s']['sync'])}; generated "
              f"{fmt(row['generated_traj_per_s']['async'])}; stale share {fmt(row['stale_share']['async'])}; decode "
              f"tokens per trained traj {fmt(row['generated_tokens_per_trained_traj']['async'])} vs sync "
              f"{fmt(row['generated_tokens_per_trained_traj']['sync'])}; equal reward {row['equal_reward']['heldout_em']}")
    print(f"[{NAME}] overlap-only pipeline bound from the sync decomposition: "
          f"{extra['analysis']['pipeline_bound_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
