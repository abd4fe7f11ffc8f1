"""Where a run's questions come from: the synthetic world (the default) or dataset files.

``stages.N.data`` names the files an RL stage trains on and ``eval.data`` the held-out questions;
both need ``retrieval.corpus`` (checked at load; not with ``retrieval.backend=http``, whose server
holds it). Files are read by ``actors/datasets.py:load_datasets`` in every format it knows. The
driver counts a stage's questions (the replay's prompt cursor walks indices into them), writes them to
``<run>/prompts-stage<N>.jsonl`` (the indices of ``trained_prompts.jsonl`` point into that list) and
widens the tiny policy's word vocabulary to the files and the corpus; each rollout worker loads the
same files itself (``RolloutWorker._train_questions``), so only indices travel.

SFT stages cannot take files: a demonstration follows a gold search plan (``actors/demos.py``), which
the world has and dataset files do not (HotpotQA's supporting facts name paragraphs, not queries);
``validate`` refuses ``kind: sft`` with ``data``.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from sonar.cluster.driver.run import world_of
from sonar.cluster.wire.config import Config, StageConfig, data_paths


@functools.lru_cache(maxsize=8)
def _load(paths: tuple[str, ...], fmt: str, fields: tuple = ()) -> tuple:
    from sonar.actors.datasets import load_datasets

    return tuple(load_datasets(list(paths), fmt=fmt, fields=dict(fields)))


def stage_questions(cfg: Config, stage: StageConfig) -> list:
    """The questions an RL stage trains on (each has ``qid``, ``question``, ``golds``), in the order the
    workers index them: its data files, else the world's training questions."""
    if stage.data is None:
        return world_of(cfg).train
    return list(_load(tuple(data_paths(stage.data)), stage.format, tuple(sorted(stage.fields.items()))))


def eval_questions(cfg: Config) -> list[dict]:
    """Held-out questions ``{qid, question, golds, meta}``: ``eval.data``'s, else the world's first
    ``world.num_heldout_eval`` held-out questions."""
    if cfg.eval.data is not None:
        qs = _load(tuple(data_paths(cfg.eval.data)), cfg.eval.format, tuple(sorted(cfg.eval.fields.items())))
    else:
        qs = world_of(cfg).heldout[: cfg.world.num_heldout_eval or None]
    return [{"qid": q.qid, "question": q.question, "golds": list(q.golds), "meta": dict(q.meta)} for q in qs]


def cursor_prompts(cfg: Config, resume_stage: int, resume_step: int) -> int:
    """How many prompts the replay's cursor spanned when a checkpoint at (``resume_stage``,
    ``resume_step``) was saved: those of the last RL stage that had started (the resumed stage itself
    when it is an RL stage past step 0), else the world's training questions (no RL stage yet)."""
    last = [i for i, s in enumerate(cfg.stages)
            if s.kind == "rl" and (i < resume_stage or (i == resume_stage and resume_step > 0))]
    if not last:
        return len(world_of(cfg).train)
    return len(stage_questions(cfg, cfg.stages[last[-1]]))


def uses_files(cfg: Config) -> bool:
    return cfg.eval.data is not None or any(s.data is not None for s in cfg.stages)


def extra_vocab(cfg: Config) -> list[str]:
    """Words the tiny word-level policy needs beyond the world's (``actors/model.py:materialise_policy``'s
    ``extra_vocab``): those of every data file's questions and answers and of the corpus's titles and
    texts, split as its tokenizer splits them. Empty when the run reads no files or ``model.path``
    names a real model (its own tokenizer covers any text). The vocabulary grows with the corpus: the
    tiny policy is for small corpora; name a real model for Wikipedia-sized ones."""
    if cfg.model.path or not uses_files(cfg):
        return []
    from sonar.actors.world import words_of
    from sonar.retrieval.corpus import iter_corpus

    words: set[str] = set()
    sources = [(tuple(data_paths(s.data)), s.format, tuple(sorted(s.fields.items())))
               for s in cfg.stages if s.data is not None]
    if cfg.eval.data is not None:
        sources.append((tuple(data_paths(cfg.eval.data)), cfg.eval.format, tuple(sorted(cfg.eval.fields.items()))))
    for paths, fmt, fields in sources:
        for q in _load(paths, fmt, fields):
            words.update(words_of(q.question))
            for g in q.golds:
                words.update(words_of(g))
    if cfg.retrieval.corpus:
        for passage in iter_corpus(cfg.retrieval.corpus):
            words.update(words_of(passage.title))
            words.update(words_of(passage.text))
    return sorted(words)


def write_stage_prompts(run_dir: Path, index: int, questions: list) -> Path:
    """``<run>/prompts-stage<index>.jsonl``: one ``{index, qid, question, golds}`` line per training
    question of an RL stage (what the prompt indices of ``trained_prompts.jsonl`` refer to)."""
    path = Path(run_dir) / f"prompts-stage{index}.jsonl"
    with open(path, "w") as fh:
        for i, q in enumerate(questions):
            fh.write(json.dumps({"index": i, "qid": q.qid, "question": q.question, "golds": list(q.golds)}) + "\n")
    return path
