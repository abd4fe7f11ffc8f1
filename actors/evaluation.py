"""One evaluation path: greedy rollouts over questions -> one record per question -> one summary.

Every evaluation in Sonar goes through here, so every one reports the same numbers computed the same
way:

- the training evaluation (``RolloutWorker.evaluate`` on each worker's shard, gathered and summarised
  by ``cluster/driver/reports.evaluate``), which the benchmarks call too;
- ``sonar eval`` (``cluster/driver/evaluate.run_eval``, in-process over dataset files);
- ``sonar score`` (``actors/scoring.py``) re-scores prediction files with :func:`question_scores`.

Steps:

1. :func:`greedy_records`: the rollout loop of training (``actors.rollout.rollout_groups``), greedy
   (temperature 0), one trajectory per question, in batches of ``batch_size`` questions, with search
   or without (``search_enabled=False``: every search returns no documents);
2. :func:`trajectory_record`: one predictions-JSONL record per question (question, golds,
   prediction, its scores, searches, token counts, latency, the decoded trace);
3. :func:`summarize`: means over the records (``SUMMARY_FIELDS``), and :func:`eval_metrics` names
   them with the ``eval/{split}/...`` keys of ``cluster/wire/metrics.py``.

Metrics (``actors.rewards``), each named for its normalisation, max over golds, a missing prediction
scoring 0 on each: ``em`` and ``f1`` (HotpotQA's official script, SQuAD normalisation); ``acc_r``,
``em_r1`` and ``f1_r1`` (R1-Searcher's ``metric_calc_rule.py``: its normalisation and True/False
mapping; ``acc_r`` is its cover-EM, the ACC_R of its tables). Means are summed in record order and
divided by n, as ``metric_calc_rule.py`` does.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from sonar.actors.rewards import acc_r, exact_match, exact_match_r1, f1, f1_r1, make_reward_fn
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import ProtocolConfig, RewardConfig
from sonar.cluster.wire.protocol import Trajectory

if TYPE_CHECKING:  # the rollout loop (and torch with it) is imported only to roll out: scoring stays light
    from sonar.actors.rollout import PromptItem

SCORES = ("em", "f1", "acc_r", "em_r1", "f1_r1")
"""The per-question metrics of :func:`question_scores`, in table order."""
SUMMARY_FIELDS = ("n", *SCORES, "searches_per_q", "tokens_per_q", "latency_s_per_q")
"""Keys of :func:`summarize`'s dict, in table order. ``n`` is a count, the scores are means in [0, 1],
``searches_per_q`` and ``tokens_per_q`` (model tokens) are means per question, ``latency_s_per_q`` is
the wall time of a batch divided by its questions."""

_METRIC_KEYS = {"n": K.EVAL_QUESTIONS, "em": K.EVAL_EM, "f1": K.EVAL_F1, "acc_r": K.EVAL_ACC_R,
                "em_r1": K.EVAL_EM_R1, "f1_r1": K.EVAL_F1_R1,
                "searches_per_q": K.EVAL_SEARCHES, "tokens_per_q": K.EVAL_TOKENS,
                "latency_s_per_q": K.EVAL_LATENCY}


def question_scores(prediction: str | None, golds: list[str]) -> dict[str, float]:
    """``SCORES`` of one prediction against its golds (the only place they are combined)."""
    return {"em": exact_match(prediction, golds), "f1": f1(prediction, golds), "acc_r": acc_r(prediction, golds),
            "em_r1": exact_match_r1(prediction, golds), "f1_r1": f1_r1(prediction, golds)}


def trajectory_record(t: Trajectory, tokenizer: Any, latency_s: float) -> dict:
    """One predictions-JSONL record: question, golds, prediction, its scores, reward parts, searches,
    token counts, latency and the full decoded trace (special tokens kept)."""
    return {"id": t.prompt_id, "question": t.question, "golden_answers": t.golds, "prediction": t.prediction,
            **question_scores(t.prediction, t.golds),
            "finish_reason": t.finish_reason, "reward": t.reward, "reward_parts": t.reward_parts,
            "searches": [{"queries": s.queries, "doc_ids": s.doc_ids, "latency_ms": s.latency_ms, "error": s.error}
                         for s in t.searches],
            "tool_calls": [{"tool": c.tool, "args": c.args, "refs": c.refs, "error": c.error} for c in t.tool_calls],
            "num_searches": len(t.searches), "model_tokens": t.num_model_tokens(), "tokens": t.num_tokens(),
            "latency_s": latency_s,
            "trace": tokenizer.decode(t.token_ids().tolist(), skip_special_tokens=False)}


async def greedy_records(items: list[PromptItem], *, engine: Any, retriever: Any, tokenizer: Any, tags: Any,
                         proto: ProtocolConfig, k: int, reward: RewardConfig, batch_size: int,
                         search_enabled: bool = True, actor_id: int = 0,
                         progress: Callable[[int], None] | None = None, tools: list | None = None) -> list[dict]:
    """Greedy rollouts over ``items`` in batches of ``batch_size``; one record per item, in order.

    ``reward`` fills each record's ``reward``/``reward_parts`` (the metrics do not depend on it).
    ``retriever`` may be None only with ``search_enabled=False``. ``progress(n)`` is called after each
    batch with the number of questions it held. ``tools``: the run's tools
    (``actors.tools.build_tools``), as in training.
    """
    from sonar.actors.rollout import rollout_groups

    if batch_size < 1:
        raise ValueError(f"eval.batch_size={batch_size} must be >= 1")
    out: list[dict] = []
    for s in range(0, len(items), batch_size):
        chunk = items[s:s + batch_size]
        t0 = time.perf_counter()
        groups, _ = await rollout_groups(
            chunk, engine=engine, retriever=retriever, tokenizer=tokenizer, tags=tags, proto=proto,
            temperature=0.0, group_size=1, k=k, reward_fn=make_reward_fn(reward, tokenizer, tags),
            actor_id=actor_id, stage=-1, search_enabled=search_enabled, tools=tools)
        dt = (time.perf_counter() - t0) / max(1, len(groups))
        out.extend(trajectory_record(g[0], tokenizer, latency_s=dt) for g in groups)
        if progress is not None:
            progress(len(chunk))
    return out


def summarize(records: list[dict]) -> dict[str, float]:
    """Means over the records (``SUMMARY_FIELDS``); the scores are recomputed from each record's
    prediction and golds, so records from anywhere (a worker, a file) are scored alike, and summed in
    record order before dividing by n (``metric_calc_rule.py``'s arithmetic). No records: n = 0 and every
    mean 0.0."""
    if not records:
        return {name: 0 if name == "n" else 0.0 for name in SUMMARY_FIELDS}
    scores = [question_scores(r["prediction"], r["golden_answers"]) for r in records]
    return {"n": len(records),
            **{m: sum(s[m] for s in scores) / len(records) for m in SCORES},
            "searches_per_q": float(np.mean([r["num_searches"] for r in records])),
            "tokens_per_q": float(np.mean([r["model_tokens"] for r in records])),
            "latency_s_per_q": float(np.mean([r["latency_s"] for r in records]))}


def eval_metrics(split: str, summary: dict[str, float]) -> dict[str, float]:
    """The summary under its metric keys: ``eval/{split}/em`` and so on (``cluster/wire/metrics.py``); the
    fields of ``SUMMARY_FIELDS`` that ``summary`` holds."""
    return {_METRIC_KEYS[name].format(split=split): float(summary[name]) for name in SUMMARY_FIELDS if name in summary}


def percent(mean: float) -> str:
    """A score's mean in [0, 1] as every Sonar command prints it: a percentage with one decimal
    (``0.8667`` -> ``"86.7"``), as the papers' tables and ``metric_calc_rule.py`` report it. ``sonar eval``,
    ``sonar score`` and the end-of-run summary all print through this; the files and MLflow keep the
    fractions."""
    return f"{round(100 * float(mean), 1):.1f}"


def markdown(table: dict[str, dict[str, float]]) -> str:
    """One row per split or dataset, the columns of ``SUMMARY_FIELDS``: the scores as :func:`percent`
    (as ``sonar score`` prints them), the per-question means with three decimals."""
    lines = ["| dataset | " + " | ".join(SUMMARY_FIELDS) + " |", "|---" * (len(SUMMARY_FIELDS) + 1) + "|"]
    for name, row in table.items():
        cells = [str(row["n"])] + [percent(row[c]) if c in SCORES else f"{row[c]:.3f}" for c in SUMMARY_FIELDS[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
