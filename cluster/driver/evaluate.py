"""``sonar eval``: greedy evaluation of a policy over dataset files, with retrieval in the loop.

It runs the evaluation path of training (``actors/evaluation.py``: greedy ``rollout_groups``, one
sample per question, the same records and the same summary), in-process, over each dataset, and
reports EM, F1, cover-EM, searches, tokens and latency per question. It writes
``predictions-<dataset>.jsonl`` (question, golden answers, prediction, its scores, full decoded
trace) and ``eval.md`` (a Markdown table), and logs the summaries to MLflow as
``eval/<dataset>/...``.

The policy is a Hugging Face model directory, a Sonar checkpoint (its ``hf/`` export), or a run
directory (its final ``model/``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from sonar.cluster.wire.config import Config, flatten, to_dict, to_yaml

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


def run_eval(cfg: Config, checkpoint: str, data_files: list[str], out_dir: str | None = None,
             fmt: str = "auto") -> dict:
    """Evaluate the policy at ``checkpoint`` on each of ``data_files``; returns {dataset: summary}.

    ``fmt``: the files' format (``actors.datasets.FORMATS`` or an alias; ``--format``), for files whose
    format detection cannot tell; "auto" detects per file. Every file is loaded (and a malformed one
    refused, naming file, line and field) before the policy is."""
    from tqdm import tqdm

    from sonar.actors.datasets import load_dataset
    from sonar.actors.engine import HFEngine
    from sonar.actors.evaluation import eval_metrics, greedy_records, markdown, summarize
    from sonar.actors.model import load_policy
    from sonar.actors.prompts import get_protocol
    from sonar.actors.rollout import PromptItem
    from sonar.cluster.driver import tracking
    from sonar.retrieval.factory import build_retriever

    datasets = [(path, load_dataset(path, fmt=fmt)) for path in data_files]
    model_dir = resolve_model_dir(checkpoint)
    model, tokenizer = load_policy(model_dir)
    engine = HFEngine(model, eos_token_id=tokenizer.eos_token_id)
    tags = get_protocol(cfg.protocol.name)
    corpus = cfg.retrieval.corpus or _default_corpus(cfg)
    retriever = build_retriever(cfg.retrieval, corpus, str(Path(cfg.run.root).resolve() / "index"))
    out = Path(out_dir or Path(cfg.run.root) / f"eval-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    sink = tracking.make_sink(cfg.tracking.enabled, out, cfg.tracking.uri, cfg.tracking.experiment, f"eval-{out.name}")
    sink.log_params({**flatten(to_dict(cfg)), "eval.checkpoint": str(model_dir)})
    table: dict[str, dict] = {}
    for path, items in datasets:
        name = Path(path).stem
        prompts = [PromptItem(prompt_id=it.qid, question=it.question, golds=list(it.golds)) for it in items]
        with tqdm(total=len(prompts), desc=f"eval {name}", unit="q") as bar:
            records = asyncio.run(greedy_records(
                prompts, engine=engine, retriever=retriever, tokenizer=tokenizer, tags=tags, proto=cfg.protocol,
                k=cfg.retrieval.k, reward=cfg.stages[-1].reward, batch_size=cfg.eval.batch_size,
                progress=bar.update))
        with open(out / f"predictions-{name}.jsonl", "w") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")
        table[name] = summarize(records)
        sink.log_metrics(eval_metrics(name, table[name]), step=0)
        sink.log_artifact(str(out / f"predictions-{name}.jsonl"))
    md = markdown(table)
    (out / "eval.md").write_text(md)
    sink.log_artifact(str(out / "eval.md"))
    sink.finish("FINISHED")
    print("\n" + md + f"\npredictions and table in {out} (MLflow run {sink.run_id})\n", flush=True)
    return table
