"""multi-query: does searching several queries per step cut inference time per question at equal EM?

Question (issue 11; RAG-R1's headline: multi-query parallelism, up to 3 comma-separated queries
answered by one batched retrieval call per search step, cut inference time by 11.1 %): per question,
how do wall time, turns, retrieval calls, queries, generated tokens and EM of RAG-R1's multi-query
protocol (``protocol.name=rag_r1_multi``) compare with its single-query protocol (``rag_r1``), at equal
held-out EM, on the embedded world?

Design (the cheapest faithful one, and what it leaves out): for each protocol and seed, a fresh tiny
policy is trained by SFT on *that protocol's own* demonstrations (``actors.demos``: a parallel
question's two lookups are one search step under ``rag_r1_multi`` and two consecutive steps under
``rag_r1``), with the same steps, batch, lr and seed for both; then held-out questions (entity split)
are answered greedily one at a time through the production rollout loop (``actors.rollout.
rollout_groups``, ``HFEngine``, the in-process tantivy retriever of ``build_retriever``, cache off),
the two policies of a seed alternating question by question so machine load hits both alike.
**SFT only, no RL**: RL on top costs minutes per run on 2 cores and is not what differs between the
protocols; the EMs each policy reaches are reported with their seed intervals, and the timing is
also compared on the questions both policies of a seed answered right (equal EM by construction).

Per question: ``wall_s`` (the rollout of that one question: prefill, decode, parse, retrieval),
``turns`` (MODEL segments), ``retrieval_calls`` (search steps), ``queries``, ``gen_tokens``, ``em``.
Questions are split into *parallel* ones (a gold plan step with several lookups: where multi-query
can save a turn) and *sequential* ones (chains, one lookup per step: both protocols act alike).

Decode cost, two models, each labelled in the result:

- ``flat_cpu``: the real engine on this CPU, measured wall time (``wall_s``). On the tiny model a
  decode step costs about the same for any context, so this is close to a flat per-token cost.
- ``gpu_calibrated``: each question's turns replayed through the calibrated GPU decode-time model of
  ``bench/sim/gpu_cost.py`` (the one place that model lives; its source is cited there and copied into
  the JSON): per turn, the prefill of the tokens added since the last turn plus one decode step per
  generated token at the running context, at batch 1, plus the measured retrieval time of each call.
  Skipped, and said so in the JSON, when that module is not importable.

Oracle: the gold demonstrations of the same questions under each protocol (what a policy that follows
the protocol exactly would do) are replayed through the GPU model too (``oracle/*``,
``oracle_time_saving/*``): the protocol's own saving, apart from how well the SFT policies learned it.

The world's question mix: today's embedded world has ~3 % parallel held-out questions (its "yes" pairs
are scarce), far fewer than the sets RAG-R1 evaluates on. By default the benchmark builds the world
with ``world.parallel_share`` = HotpotQA's comparison share (``HOTPOT_SHARE``: 1,487 of the 7,405
distractor dev questions, 20.1 %; the source in ``SHARE_SOURCE`` and in the JSON), in training and
held-out questions alike, so SFT sees parallel questions at that rate and ``natural`` reweights to it;
``--parallel-share`` sets another share, ``--parallel-share none`` gives today's world.

Statistics: ``--seeds`` (default 3) independent SFT runs per protocol; every metric is a summary over
seeds (``median/min/max/n`` plus ``mean`` and ``ci95``, the t-interval half-width over seeds), and the
headline ``time_saving`` = 1 - multi/single time per question is computed per seed, then summarised.

``--quick`` (CI, well under a minute): a small world, 2 seeds, a few SFT steps, a dozen questions;
it checks the plumbing and the JSON, not the numbers.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np

from sonar.actors.evaluation import percent  # the one score format (issue 25)
from sonar.bench.common import REPO_ROOT, base_parser, bench_settings, setup_env, summarise, write_result
from sonar.cluster.wire import metrics as K

setup_env()

NAME = "multi-query"
PROTOCOLS = {"single": "rag_r1", "multi": "rag_r1_multi"}
"""Label -> protocol.name: RAG-R1's single-query and multi-query protocols."""
HOTPOT_SHARE = 1487 / 7405
"""Comparison questions in HotpotQA's distractor dev set (the ``type`` field): 1,487 of 7,405 (20.08 %),
5,918 are bridge questions. Comparison questions look up two entities independently: RAG-R1's
parallel case."""
SHARE_SOURCE = {
    "dataset": "HotpotQA distractor dev (validation) set, the 'type' field: 5,918 bridge / 1,487 comparison of 7,405",
    "paper": "Yang et al., HotpotQA, EMNLP 2018, arXiv:1809.09600 (comparison questions: its fourth feature)",
    "split_size": "7,405 validation questions: tensorflow/datasets docs/community_catalog/huggingface/hotpot_qa.md",
    "type_counts": "5,918 / 1,487 as counted by several public data notes on the HF hotpot_qa validation split "
                   "(found with the search tool; not recounted here: no dataset download on this machine)",
    "share": "1487 / 7405 = 0.2008",
}
FULL = {"config": "configs/rag_r1_tiny.yaml", "seeds": 3, "sft_steps": 300, "batch_size": 64, "lr": 3e-3,
        "warmup_steps": 30, "questions": 200, "parallel_share": HOTPOT_SHARE,
        "overrides": ["retrieval.cache_size=0", "retrieval.backend=tantivy"]}
QUICK = {"config": "configs/rag_r1_tiny.yaml", "seeds": 2, "sft_steps": 3, "batch_size": 8, "lr": 3e-3,
         "warmup_steps": 1, "questions": 4, "parallel_share": HOTPOT_SHARE,
         # an untrained policy writes until the token caps: small caps keep the smoke test short
         # (4 turns: a two-step comparison takes 4 single-query steps)
         "overrides": ["retrieval.cache_size=0", "retrieval.backend=tantivy", "world.num_entities=120",
                       "protocol.max_new_tokens_per_turn=12", "protocol.max_turns=4"]}
PER_QUESTION = ("wall_s", "turns", "retrieval_calls", "queries", "gen_tokens", "em")
log = logging.getLogger("sonar.bench")


# ------------------------------------------------------------------------------------ statistics
def ci95(xs) -> float:
    """Half-width of the 95 % t-interval of the mean of ``xs`` (one value per seed; ``bench/stats.py``);
    0 for one sample (the interval is unknown, and the JSON says n = 1)."""
    from sonar.bench.stats import mean_ci

    half = mean_ci(xs)["half"]
    return 0.0 if not math.isfinite(half) else float(half)


def seed_summary(xs) -> dict:
    """``summarise`` plus the mean and the 95 % interval half-width over seeds."""
    return {**summarise(xs), "mean": float(np.mean(xs)), "ci95": ci95(xs)}


# ------------------------------------------------------------------------------------ per question
def is_parallel(q) -> bool:
    """A question whose gold plan has a step with several lookups (multi-query can do them in one turn)."""
    return any(len(step) > 1 for step in q.plan)


def turn_shapes(traj) -> list[tuple[int, int, int]]:
    """``[(context, new_tokens, generated_tokens)]`` per MODEL segment of a trajectory: the tokens already
    processed at the previous turn's end, the prompt/documents tokens added since (to prefill), and the
    tokens the turn generated; what a decode-cost model needs to replay the question."""
    from sonar.cluster.wire.protocol import SegmentKind

    out, done, pending = [], 0, 0
    for seg in traj.segments:
        n = len(seg.token_ids)
        if seg.kind == SegmentKind.MODEL:
            out.append((done, pending, n))
            done += pending + n
            pending = 0
        else:
            pending += n
    return out


def pick_questions(heldout: list, n: int) -> list:
    """Every parallel held-out question (few in the world's natural mix, and the only ones where the
    protocols can differ in turns), then sequential ones in held-out order, ``n`` in all. The natural
    mix is restored by reweighting (``natural_share``), not by sampling."""
    par = [q for q in heldout if is_parallel(q)]
    seq = [q for q in heldout if not is_parallel(q)]
    return (par + seq)[:n] if len(par) < n else par[: n // 2] + seq[: n - n // 2]


def share_arg(text: str) -> float | None:
    """``--parallel-share``: a share in [0, 1), or ``none`` for today's world (unset ``world.parallel_share``)."""
    import argparse

    if text.strip().lower() in ("none", "null", "natural"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--parallel-share={text!r}: a number in [0, 1) or 'none'") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"--parallel-share={text!r} must be in [0, 1) or 'none'")
    return v


def share_setting(share: float | None) -> tuple[list[str], dict]:
    """The config override and the JSON's description of the world's parallel share."""
    if share is None:
        return [], {"value": None, "source": "today's embedded world (world.parallel_share unset)"}
    src = SHARE_SOURCE if share == HOTPOT_SHARE else "set with --parallel-share"
    return [f"world.parallel_share={share!r}"], {"value": share, "source": src}


def natural_share(heldout: list) -> float:
    """Share of parallel questions among the world's held-out questions."""
    return sum(map(is_parallel, heldout)) / max(1, len(heldout))


def question_record(traj, q, wall_s: float) -> dict:
    from sonar.actors.evaluation import question_scores

    shapes = turn_shapes(traj)
    return {"qid": q.qid, "parallel": is_parallel(q), "wall_s": wall_s, "turns": len(shapes),
            "retrieval_calls": len(traj.searches), "queries": sum(len(s.queries) for s in traj.searches),
            "gen_tokens": int(traj.num_model_tokens()), "em": question_scores(traj.prediction, q.golds)["em"],
            "retrieval_s": sum(s.latency_ms for s in traj.searches) / 1e3, "shapes": shapes}


# ------------------------------------------------------------------------------------ cost models
def gpu_cost_model() -> tuple[Callable[[dict], float] | None, dict]:
    """``(seconds(record), label)``: a question replayed through ``bench/sim/gpu_cost.Gpu7BCost`` (the one
    place the calibrated GPU model lives: ``t(rows, ctx)`` ms per decode step of a 7B model on one H100
    under vLLM, its source in its label), at batch 1; ``(None, why)`` when the module is missing.

    Per turn: one decode step per generated token at the running context, plus the turn's prefill
    charged as one more step at the context after it (the model has no prefill term: a short prefill
    on a GPU costs about one step; RAG-R1's documents blocks are a few hundred tokens); plus the
    measured time of each retrieval call (retrieval runs on CPU either way)."""
    try:
        from sonar.bench.sim.gpu_cost import Gpu7BCost
    except ImportError as e:
        return None, {"available": False, "why": f"bench/sim/gpu_cost.py not importable ({e})"}
    cost = Gpu7BCost()

    def seconds(rec: dict) -> float:
        ms = 0.0
        for ctx, new, gen in rec["shapes"]:
            ms += cost(1, ctx + new)  # the turn's prefill, as one step
            ms += sum(cost(1, ctx + new + i) for i in range(gen))
        return rec["retrieval_s"] + ms / 1e3

    return seconds, {"available": True, "module": "bench/sim/gpu_cost.py", "rows": 1,
                     "prefill": "one decode step per turn at the context after the turn's new tokens",
                     "retrieval": "measured (in-process tantivy on this CPU)", **cost.label()}


# ------------------------------------------------------------------------------------ one run
def _cfg(bcfg: dict, protocol: str, seed: int, run_root: str):
    from sonar.bench.driver_harness import load_cfg

    ov = list(bcfg["overrides"]) + [f"protocol.name={protocol}", f"model.seed={seed}", f"run.root={run_root}"]
    cfg, _ = load_cfg([REPO_ROOT / bcfg["config"]], ov)
    return cfg


def sft_policy(cfg, world, retriever, bcfg: dict, seed: int):
    """A fresh tiny policy trained by SFT on ``cfg.protocol``'s demonstrations (in process, plain torch)."""
    import torch

    from sonar.actors.demos import make_demonstrations
    from sonar.actors.model import policy_and_tokenizer
    from sonar.actors.prompts import get_protocol
    from sonar.learner.train_step import TorchStepper, sft_step

    torch.manual_seed(seed)
    model, tok = policy_and_tokenizer(cfg.model, world)
    demos = make_demonstrations(world.train, get_protocol(cfg.protocol.name), tok, retriever, cfg.protocol,
                                cfg.retrieval.k)
    opt = torch.optim.AdamW(model.parameters(), lr=bcfg["lr"], betas=tuple(cfg.learner.betas),
                            weight_decay=cfg.learner.weight_decay)
    stepper = TorchStepper(model, opt, cfg.learner.grad_clip)
    rng = np.random.default_rng(seed)
    order, pos, losses = rng.permutation(len(demos)), 0, []
    t0 = time.perf_counter()
    for step in range(bcfg["sft_steps"]):
        for g in opt.param_groups:
            g["lr"] = bcfg["lr"] * min(1.0, (step + 1) / max(1, bcfg["warmup_steps"]))
        if pos + bcfg["batch_size"] > len(order):
            order, pos = rng.permutation(len(demos)), 0
        batch = [demos[i] for i in order[pos:pos + bcfg["batch_size"]]]
        pos += bcfg["batch_size"]
        losses.append(sft_step(stepper, batch, cfg.learner, pad_id=tok.pad_token_id)[K.LEARNER_LOSS])
    model.eval()
    return model, tok, {"sft_s": time.perf_counter() - t0, "sft_loss_last": float(np.mean(losses[-5:])),
                        "demos": len(demos), "demo_turns_mean": float(np.mean(
                            [sum(1 for s in d.segments if s.kind.name == "MODEL") for d in demos]))}


def answer_one(cfg, engine, tok, retriever, q) -> dict:
    """One held-out question, greedy, through the production rollout loop; its record."""
    from sonar.actors.prompts import get_protocol
    from sonar.actors.rewards import make_reward_fn
    from sonar.actors.rollout import PromptItem, rollout_groups

    tags = get_protocol(cfg.protocol.name)
    item = PromptItem(prompt_id=q.qid, question=q.question, golds=list(q.golds))
    t0 = time.perf_counter()
    groups, _ = asyncio.run(rollout_groups([item], engine=engine, retriever=retriever, tokenizer=tok, tags=tags,
                                           proto=cfg.protocol, temperature=0.0, group_size=1, k=cfg.retrieval.k,
                                           reward_fn=make_reward_fn(cfg.stages[-1].reward, tok, tags), stage=-1))
    return question_record(groups[0][0], q, time.perf_counter() - t0)


def oracle_records(cfg, tok, retriever, questions) -> list[dict]:
    """Records of the gold demonstrations (``actors.demos``) of ``questions`` under ``cfg.protocol``: the
    turns, retrieval calls and tokens of a policy that follows the protocol exactly (no wall time: not
    generated). Under the GPU model they give the protocol's own saving, whatever the SFT reached."""
    from sonar.actors.demos import make_demonstration
    from sonar.actors.prompts import get_protocol

    tags = get_protocol(cfg.protocol.name)
    out = []
    for q in questions:
        d = make_demonstration(q, tags, tok, retriever, cfg.protocol, cfg.retrieval.k)
        d.prediction = q.golds[0]
        out.append(question_record(d, q, float("nan")))
    return out


def run_seed(bcfg: dict, seed: int, run_root: str) -> list[dict]:
    """Both protocols' policies for one seed, then the held-out questions answered by the two in turn,
    question by question (which goes first alternates), so a change of machine load hits both alike:
    the CPU wall times are paired per question."""
    from sonar.actors.engine import HFEngine
    from sonar.cluster.driver.roles import indexes_dir, prepare_corpus
    from sonar.cluster.driver.run import world_of
    from sonar.retrieval.factory import build_retriever

    runs = []
    for label in PROTOCOLS:
        cfg = _cfg(bcfg, PROTOCOLS[label], seed, run_root)
        world = world_of(cfg)
        retriever = build_retriever(cfg.retrieval, prepare_corpus(cfg, None), indexes_dir(cfg))
        model, tok, info = sft_policy(cfg, world, retriever, bcfg, seed)
        runs.append({"label": label, "protocol": PROTOCOLS[label], "seed": seed, "records": [], **info,
                     "_eval": (cfg, HFEngine(model, eos_token_id=tok.eos_token_id), tok, retriever)})
    questions = pick_questions(world.heldout, bcfg["questions"])
    for i, q in enumerate(questions):
        for r in (runs if i % 2 == 0 else runs[::-1]):
            r["records"].append(answer_one(*r["_eval"], q))
    for r in runs:  # the gold demonstrations of the same questions: what a policy that follows the protocol costs
        cfg, _, tok, retriever = r["_eval"]
        r["oracle"] = oracle_records(cfg, tok, retriever, questions)
    for r in runs:
        del r["_eval"]
        recs = r["records"]
        log.info("%s %s seed %d: EM %s %%, %.4f s/question, %.2f turns (SFT %.0f s)", NAME, r["label"], seed,
                 percent(np.mean([x["em"] for x in recs])), np.mean([x["wall_s"] for x in recs]),
                 np.mean([x["turns"] for x in recs]), r["sft_s"])
    return runs


# ------------------------------------------------------------------------------------ aggregation
def _mean(recs: list[dict], key: str, where: Callable[[dict], bool] = lambda r: True) -> float | None:
    xs = [r[key] for r in recs if where(r)]
    return float(np.mean(xs)) if xs else None


def aggregate(runs: list[dict], gpu_seconds: Callable[[dict], float] | None,
              p_parallel: float) -> tuple[dict, dict]:
    """Metrics (summaries over seeds) and the per-seed table from the runs of both protocols.

    Subsets: ``all`` (the questions as evaluated: every parallel one, enriched), ``parallel``,
    ``sequential``, ``natural`` (reweighted to the world's parallel share ``p_parallel``) and, for the
    time saving, ``both_correct`` (the questions both policies of a seed answered right)."""
    if gpu_seconds is not None:
        for r in runs:
            for rec in r["records"]:
                rec["gpu_s"] = gpu_seconds(rec)
    time_keys = ["wall_s"] + (["gpu_s"] if gpu_seconds is not None else [])
    seeds = sorted({r["seed"] for r in runs})
    by = {(r["label"], r["seed"]): r["records"] for r in runs}
    per_seed: dict[str, list[float]] = {}

    def add(k: str, v: float | None) -> None:
        if v is not None:
            per_seed.setdefault(k, []).append(v)

    subsets = {"all": lambda r: True, "parallel": lambda r: r["parallel"], "sequential": lambda r: not r["parallel"]}

    def natural(recs: list[dict], k: str) -> float | None:
        """The mean at the world's natural parallel share ``p``: p * parallel + (1 - p) * sequential."""
        par, seq = _mean(recs, k, subsets["parallel"]), _mean(recs, k, subsets["sequential"])
        if par is None or seq is None:
            return _mean(recs, k)
        return p_parallel * par + (1.0 - p_parallel) * seq

    for seed in seeds:
        single, multi = by[("single", seed)], by[("multi", seed)]
        for label, recs in (("single", single), ("multi", multi)):
            for sub, where in subsets.items():
                for k in PER_QUESTION + tuple(time_keys[1:]):
                    add(f"{label}/{sub}/{k}", _mean(recs, k, where))
            for k in PER_QUESTION + tuple(time_keys[1:]):
                add(f"{label}/natural/{k}", natural(recs, k))
        add("em_diff", _mean(multi, "em") - _mean(single, "em"))
        add("em_diff_natural", natural(multi, "em") - natural(single, "em"))
        both = {r["qid"] for r in single if r["em"] == 1.0} & {r["qid"] for r in multi if r["em"] == 1.0}
        add("both_correct/questions", float(len(both)))
        for tk in time_keys:
            for sub, where in subsets.items():
                s, m = _mean(single, tk, where), _mean(multi, tk, where)
                if s and m is not None:
                    add(f"time_saving/{tk}/{sub}", 1.0 - m / s)
            s, m = natural(single, tk), natural(multi, tk)
            if s and m is not None:
                add(f"time_saving/{tk}/natural", 1.0 - m / s)
            s = _mean(single, tk, lambda r: r["qid"] in both)
            m = _mean(multi, tk, lambda r: r["qid"] in both)
            if s and m is not None:  # equal EM by construction: the questions both policies answered
                add(f"time_saving/{tk}/both_correct", 1.0 - m / s)
        if gpu_seconds is not None and all("oracle" in r for r in runs):
            osingle = next(r["oracle"] for r in runs if r["label"] == "single" and r["seed"] == seed)
            omulti = next(r["oracle"] for r in runs if r["label"] == "multi" and r["seed"] == seed)
            for label, recs in (("single", osingle), ("multi", omulti)):
                for rec in recs:
                    rec["gpu_s"] = gpu_seconds(rec)
                for k in ("turns", "retrieval_calls", "gen_tokens", "gpu_s"):
                    add(f"oracle/{label}/parallel/{k}", _mean(recs, k, subsets["parallel"]))
                    add(f"oracle/{label}/natural/{k}", natural(recs, k))
            for sub in ("parallel", "natural"):
                s_ = (_mean(osingle, "gpu_s", subsets["parallel"]) if sub == "parallel" else natural(osingle, "gpu_s"))
                m_ = (_mean(omulti, "gpu_s", subsets["parallel"]) if sub == "parallel" else natural(omulti, "gpu_s"))
                if s_ and m_ is not None:
                    add(f"oracle_time_saving/gpu_s/{sub}", 1.0 - m_ / s_)
    metrics = {k: seed_summary(v) for k, v in sorted(per_seed.items())}
    return metrics, per_seed


def verdict(metrics: dict, gpu: bool) -> dict:
    """The headline in words and numbers: saving per cost model, EMs with intervals, equal-EM check."""
    def mc(k):
        m = metrics.get(k)
        return None if m is None else {"mean": round(m["mean"], 4), "ci95": round(m["ci95"], 4), "n": m["n"]}

    d = metrics.get("em_diff")
    out = {"em_single": mc("single/all/em"), "em_multi": mc("multi/all/em"), "em_diff": mc("em_diff"),
           "equal_em_within_ci": None if d is None else bool(abs(d["mean"]) <= d["ci95"]),
           "goal": "multi-query at least 11 % less wall time per question than single-query at equal EM (RAG-R1: 11.1 %)"}
    for tk in ("wall_s",) + (("gpu_s",) if gpu else ()):
        out[f"time_saving_{tk}"] = mc(f"time_saving/{tk}/all")
        out[f"time_saving_{tk}_both_correct"] = mc(f"time_saving/{tk}/both_correct")
        out[f"time_saving_{tk}_parallel"] = mc(f"time_saving/{tk}/parallel")
        out[f"time_saving_{tk}_natural_mix"] = mc(f"time_saving/{tk}/natural")
    out["oracle_time_saving_gpu_s_parallel"] = mc("oracle_time_saving/gpu_s/parallel")
    out["oracle_time_saving_gpu_s_natural_mix"] = mc("oracle_time_saving/gpu_s/natural")
    return out


# ------------------------------------------------------------------------------------ plot + main
def plot(metrics: dict, extra: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    keys = [("turns", "turns"), ("retrieval_calls", "retrieval calls"), ("gen_tokens", "generated tokens / 10"),
            ("wall_s", "wall ms (CPU)")] + ([("gpu_s", "GPU-model ms")] if extra["gpu_cost"]["available"] else [])
    scale = {"gen_tokens": 0.1, "wall_s": 1e3, "gpu_s": 1e3}
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.6))
    x = np.arange(len(keys))
    for i, label in enumerate(("single", "multi")):
        vals = [metrics.get(f"{label}/all/{k}", {"mean": 0.0})["mean"] * scale.get(k, 1.0) for k, _ in keys]
        errs = [metrics.get(f"{label}/all/{k}", {"ci95": 0.0})["ci95"] * scale.get(k, 1.0) for k, _ in keys]
        ax[0].bar(x + (i - 0.5) * 0.38, vals, 0.38, yerr=errs, capsize=3, label=f"{label} ({PROTOCOLS[label]})")
    ax[0].set_xticks(x, [n for _, n in keys], fontsize=8)
    ax[0].set_title("per question, mean over seeds (95 % CI)")
    ax[0].legend(fontsize=8)
    subs = ["all", "parallel", "sequential", "natural", "both_correct"]
    for j, tk in enumerate(["wall_s"] + (["gpu_s"] if extra["gpu_cost"]["available"] else [])):
        v = [metrics.get(f"time_saving/{tk}/{s}", {"mean": 0.0})["mean"] * 100 for s in subs]
        e = [metrics.get(f"time_saving/{tk}/{s}", {"ci95": 0.0})["ci95"] * 100 for s in subs]
        ax[1].bar(np.arange(len(subs)) + (j - 0.5) * 0.38, v, 0.38, yerr=e, capsize=3,
                  label="CPU wall (flat)" if tk == "wall_s" else "GPU model")
    ax[1].axhline(11.1, color="k", ls="--", lw=1, label="RAG-R1: 11.1 %")
    ax[1].set_xticks(np.arange(len(subs)), subs)
    ax[1].set_ylabel("time saved by multi-query (%)")
    ax[1].legend(fontsize=8)
    v = extra["verdict"]
    share = extra["parallel_share"]["value"]
    fig.suptitle(f"multi-query vs single-query (SFT-only policies, {extra['seeds']} seeds, {extra['questions']} held-out "
                 f"questions, world parallel share {'natural' if share is None else f'{share:.3f}'}): EM single {percent(v['em_single']['mean'])} %, "
                 f"multi {percent(v['em_multi']['mean'])} %", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# bench/README.md's rendering of a result (pure: no runs; `sonar bench readme`, tests/bench/test_readme_blocks.py)

def render_table(doc: dict, json_name: str) -> str:
    """bench/README.md's per-question table: each protocol's held-out EM (mean ± 95 % half-width over
    seeds), turns, retrieval calls, queries, generated tokens and time per question (means over seeds)."""
    from sonar.bench.common import readme_block

    m = doc["metrics"]

    def mean(side: str, keys: str, what: str, form: str, scale: float = 1.0) -> str:
        return " / ".join(form.format(scale * m[f"{side}/{k}/{what}"]["mean"]) for k in keys.split())

    rows = (("held-out EM, all", lambda s: f"{m[f'{s}/all/em']['mean']:.3f} ± {m[f'{s}/all/em']['ci95']:.3f}"),
            ("turns, all / parallel / sequential", lambda s: mean(s, "all parallel sequential", "turns", "{:.2f}")),
            ("retrieval calls, all / parallel", lambda s: mean(s, "all parallel", "retrieval_calls", "{:.2f}")),
            ("queries, all / parallel", lambda s: mean(s, "all parallel", "queries", "{:.2f}")),
            ("generated tokens, all / parallel", lambda s: mean(s, "all parallel", "gen_tokens", "{:.1f}")),
            ("wall time, flat CPU (real HFEngine, batch 1), all / parallel",
             lambda s: mean(s, "all parallel", "wall_s", "{:.1f}", 1e3) + " ms"),
            ("time, GPU-calibrated (`gpu_7b`), all / parallel",
             lambda s: mean(s, "all parallel", "gpu_s", "{:.0f}", 1e3) + " ms"))
    lines = ["| per question | " + " | ".join(f"{side}-query (`{p}`)" for side, p in PROTOCOLS.items()) + " |",
             "|---|---|---|"]
    lines += [f"| {label} | {cell('single')} | {cell('multi')} |" for label, cell in rows
              if "gpu_7b" not in label or "single/all/gpu_s" in m]  # no GPU-calibrated times without the model
    return readme_block(NAME, json_name, lines)


def render_saving_table(doc: dict, json_name: str) -> str:
    """bench/README.md's time-saving table: 1 − multi/single per seed, mean ± 95 % half-width over seeds, on
    the flat-CPU wall and the GPU-calibrated time, per question set; the oracle's saving beside them."""
    from sonar.bench.common import readme_block

    m, ex = doc["metrics"], doc["extra"]

    def saving(clock: str, where: str) -> str:
        s = m.get(f"time_saving/{clock}/{where}")
        return "–" if s is None else f"{100 * s['mean']:.1f} % ± {100 * s['ci95']:.1f}"

    def oracle(where: str) -> str:
        s = m.get(f"oracle_time_saving/gpu_s/{where}")
        return "–" if s is None else f"{100 * s['mean']:.1f} %"

    share = 100 * ex["parallel_questions"] / ex["questions"]
    sets = ((f"all {ex['questions']} questions ({share:.0f} % parallel)", "all"),
            (f"HotpotQA mix ({100 * ex['natural_parallel_share']:.1f} % parallel)", "natural"),
            ("parallel questions", "parallel"), ("questions both policies answered right", "both_correct"))
    lines = ["| | flat CPU | GPU-calibrated | oracle (gold demonstrations, GPU model) |", "|---|---|---|---|"]
    lines += [f"| {label} | {saving('wall_s', w)} | {saving('gpu_s', w)} | {oracle(w)} |" for label, w in sets]
    return readme_block(f"{NAME} saving", json_name, lines)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, help="SFT runs per protocol (default 3; quick 2)")
    p.add_argument("--sft-steps", type=int, help="SFT steps per run (default 300, as configs/rag_r1_tiny.yaml)")
    p.add_argument("--questions", type=int, help="held-out questions per run (default 200)")
    p.add_argument("--run-root", default=str(REPO_ROOT / "runs" / "bench-multi-query"),
                   help="where the corpus and index go")
    p.add_argument("--parallel-share", type=share_arg, default=..., metavar="SHARE|none",
                   help=f"world.parallel_share: the parallel share of training and held-out questions "
                        f"(default {HOTPOT_SHARE:.4f}, HotpotQA dev's comparison share; none: today's world)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides on top of configs/rag_r1_tiny.yaml (repeatable)")
    args = p.parse_args(argv)
    bcfg = bench_settings(args, QUICK, FULL)
    for k in ("seeds", "sft_steps", "questions"):
        if getattr(args, k):
            bcfg[k] = getattr(args, k)
    if args.parallel_share is not ...:
        bcfg["parallel_share"] = args.parallel_share
    share_ov, share_desc = share_setting(bcfg["parallel_share"])
    bcfg["overrides"] = list(bcfg["overrides"]) + share_ov + args.overrides
    bcfg["quick"] = args.quick
    gpu_seconds, gpu_desc = gpu_cost_model()
    t0 = time.time()
    runs = [r for seed in range(bcfg["seeds"]) for r in run_seed(bcfg, seed, args.run_root)]
    from sonar.cluster.driver.run import world_of

    world0 = world_of(_cfg(bcfg, PROTOCOLS["single"], 0, args.run_root))
    p_par = natural_share(world0.heldout)
    metrics, per_seed = aggregate(runs, gpu_seconds, p_par)
    from sonar.cluster.wire.config import to_dict

    bcfg["resolved"] = {label: to_dict(_cfg(bcfg, proto, 0, args.run_root)) for label, proto in PROTOCOLS.items()}
    extra = {"seeds": bcfg["seeds"], "questions": len(runs[0]["records"]),
             "parallel_questions": sum(r["parallel"] for r in runs[0]["records"]),
             "natural_parallel_share": p_par,
             "parallel_share": {**share_desc, "measured_heldout": p_par,
                                "measured_train": natural_share(world0.train), "world": world0.parallel},
             "cost_models": {"flat_cpu": "measured wall time of the real HFEngine on this CPU, batch 1",
                             "gpu_calibrated": gpu_desc},
             "gpu_cost": gpu_desc, "design": "SFT-only policies per protocol (same steps, batch, lr, seed); greedy, "
             "one question at a time; retrieval cache off", "per_seed": per_seed,
             "runs": [{k: v for k, v in r.items() if k not in ("records", "oracle")} for r in runs],
             "wall_s": round(time.time() - t0, 1)}
    extra["verdict"] = verdict(metrics, gpu_seconds is not None)
    path = write_result(NAME, bcfg, metrics, lambda png: plot(metrics, extra, png), args.out, extra=extra)
    print(f"[{NAME}] wrote {path} in {extra['wall_s']} s")
    for k, v in extra["verdict"].items():
        print(f"[{NAME}] {k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
