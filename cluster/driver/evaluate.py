"""``sonar eval``: greedy evaluation of a policy over dataset files, with retrieval in the loop.

It runs the same rollout loop as training (``actors.rollout.rollout_groups``), in-process, greedy,
one sample per question, over each dataset, and reports EM, F1, cover-EM, searches, tokens and
latency per question. It writes ``predictions-<dataset>.jsonl`` (question, golden answers,
prediction, full decoded trace) and ``eval.md`` (a Markdown table), and logs everything to MLflow.

The policy is a Hugging Face model directory, a Sonar checkpoint (its ``hf/`` export), or a run
directory (its final ``model/``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import numpy as np

from sonar.cluster.wire.config import Config, StageConfig, flatten, to_dict, to_yaml

log = logging.getLogger("sonar.eval")


def resolve_model_dir(checkpoint: str) -> Path:
    p = Path(checkpoint)
    for cand in (p, p / "hf", p / "model"):
        if (cand / "config.json").is_file():
            return cand
    if (p / "checkpoints" / "latest").is_file():
        return resolve_model_dir(str(p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()))
    raise FileNotFoundError(f"--checkpoint {checkpoint!r}: no Hugging Face model directory there "
                            "(looked for config.json in it, in hf/ and in model/)")


def _default_corpus(cfg: Config) -> str:
    from sonar.cluster.driver.roles import prepare_corpus

    return prepare_corpus(cfg, None)


def run_eval(cfg: Config, checkpoint: str, data_files: list[str], out_dir: str | None = None) -> dict:
    from tqdm import tqdm

    from sonar.actors.datasets import load_dataset
    from sonar.actors.engine import HFEngine
    from sonar.actors.model import load_policy
    from sonar.actors.prompts import get_protocol
    from sonar.actors.rewards import cover_em, exact_match, f1, trajectory_reward
    from sonar.actors.rollout import PromptItem, ThreadedRetriever, rollout_groups
    from sonar.actors.worker import trajectory_record
    from sonar.cluster.driver import tracking
    from sonar.retrieval.factory import build_retriever

    model_dir = resolve_model_dir(checkpoint)
    model, tokenizer = load_policy(model_dir)
    engine = HFEngine(model, eos_token_id=tokenizer.eos_token_id)
    tags = get_protocol(cfg.protocol.name)
    corpus = cfg.retrieval.corpus or _default_corpus(cfg)
    retriever = ThreadedRetriever(build_retriever(cfg.retrieval, corpus, str(Path(cfg.run.root).resolve() / "index")))
    out = Path(out_dir or Path(cfg.run.root) / f"eval-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    sink = tracking.make_sink(cfg.tracking.enabled, out, cfg.tracking.uri, cfg.tracking.experiment, f"eval-{out.name}")
    sink.log_params({**flatten(to_dict(cfg)), "eval.checkpoint": str(model_dir)})
    stage = StageConfig(reward=cfg.stages[-1].reward)
    table: dict[str, dict] = {}
    for path in data_files:
        items = load_dataset(path)
        name = Path(path).stem
        records = []
        for s in tqdm(range(0, len(items), cfg.eval.batch_size), desc=f"eval {name}", unit="batch"):
            chunk = items[s:s + cfg.eval.batch_size]
            prompts = [PromptItem(prompt_id=it.qid, question=it.question, golds=list(it.golds)) for it in chunk]
            t0 = time.perf_counter()
            groups, _ = asyncio.run(rollout_groups(
                prompts, engine=engine, retriever=retriever, tokenizer=tokenizer, tags=tags, proto=cfg.protocol,
                temperature=0.0, group_size=1, k=cfg.retrieval.k,
                reward_fn=lambda t: trajectory_reward(stage.reward, t), stage=-1))
            dt = (time.perf_counter() - t0) / max(1, len(groups))
            records.extend(trajectory_record(g[0], tokenizer, latency_s=dt) for g in groups)
        with open(out / f"predictions-{name}.jsonl", "w") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")
        preds = [r["prediction"] for r in records]
        golds = [r["golden_answers"] for r in records]
        row = {"n": len(records),
               "em": float(np.mean([exact_match(p, g) for p, g in zip(preds, golds)])) if records else 0.0,
               "f1": float(np.mean([f1(p, g) for p, g in zip(preds, golds)])) if records else 0.0,
               "cover_em": float(np.mean([cover_em(p, g) for p, g in zip(preds, golds)])) if records else 0.0,
               "searches_per_q": float(np.mean([r["num_searches"] for r in records])) if records else 0.0,
               "tokens_per_q": float(np.mean([r["model_tokens"] for r in records])) if records else 0.0,
               "latency_s_per_q": float(np.mean([r["latency_s"] for r in records])) if records else 0.0}
        table[name] = row
        sink.log_metrics({f"eval/{name}/{k}": v for k, v in row.items()}, step=0)
        sink.log_artifact(str(out / f"predictions-{name}.jsonl"))
    md = markdown(table)
    (out / "eval.md").write_text(md)
    sink.log_artifact(str(out / "eval.md"))
    sink.finish("FINISHED")
    print("\n" + md + f"\npredictions and table in {out} (MLflow run {sink.run_id})\n", flush=True)
    return table


def markdown(table: dict[str, dict]) -> str:
    cols = ["n", "em", "f1", "cover_em", "searches_per_q", "tokens_per_q", "latency_s_per_q"]
    lines = ["| dataset | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in table.items():
        cells = [str(row["n"])] + [f"{row[c]:.3f}" for c in cols[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
