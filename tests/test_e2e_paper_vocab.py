"""End to end (slow) with the papers' real vocabularies (issue 51): ``sonar train --config smoke model.path=<dir>
world.force=true``, shrunk to a few steps of a few sequences, where ``<dir>`` holds a random tiny model (hidden
64, 2 layers) of each real vocabulary saved with the real tokenizer (``tests/paper_tokenizers.py``):

- Qwen: a Qwen2 with tied embeddings of 151,936 rows (Qwen2.5-3B's padded embedding) for 151,669 tokenizer ids;
- Llama-3.1: a Llama with an untied ``lm_head`` of 128,256 rows, exactly its ids, and no pad id.

Each run trains end to end through every role (SFT, then asynchronous GRPO with search in the loop, held-out
evaluation): the learner stepped as configured, the replay accounting balances, every worker ends with the
learner's checksum, the policy is used as it is (tags as text: nothing materialised, the user's directory
untouched), and the exported policy keeps the real vocabulary: the embedding's rows (Qwen's padding rows
included, never shrunk to the tokenizer) and the tokenizer's ids. The vocabulary dominates on 2 CPU cores
(40-160 learner tokens/s), so the runs are a few sequences each.

What Qwen's padding rows do in a run: a random model puts about 267/151,936 of each step's mass on them, so a
run of this size usually samples a few; the engine samples over every row, such an id decodes to no text and
is trained like any sampled token (pinned deterministically in ``tests/actors/test_paper_tokenizers.py``);
here the run must simply complete with them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sonar.cluster.wire import metrics as K
from tests.paper_tokenizers import EMBEDDING_ROWS, LLAMA, QWEN, SIZES, load, tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SHRINK = [
    "world.force=true", "world.num_heldout_eval=2", "eval.batch_size=2", "tracking.enabled=false",
    # SFT of 2 steps of 4 demonstrations, then one RL stage of 2 steps of 2 groups of 2. A random policy earns
    # no reward, so every group has zero signal: kept (no dynamic sampling) and trained through the entropy
    # bonus, so the RL steps update the weights (the policy-gradient path over the whole vocabulary) and the
    # checksums compare new weights.
    "stages=[{name: sft, kind: sft, steps: 2, lr: 3.0e-3, batch_size: 4}, {name: grpo, kind: rl, steps: 2, lr: 3.0e-4,"
    " algo: {dynamic_sampling: false, entropy_coef: 0.01}}]",
    "rollout.num_workers=1", "rollout.group_size=2", "rollout.groups_per_request=1", "learner.groups_per_step=2",
    "replay.capacity_groups=4", "learner.warmup_steps=0",
    # a random policy rarely writes an action: short turns, two of them, small documents
    "protocol.max_turns=2", "protocol.max_new_tokens_per_turn=16", "protocol.max_total_tokens=160",
    "protocol.max_doc_tokens=24",
]
TIMES: dict[str, float] = {}
"""Seconds of each run's ``train`` call, also printed (``pytest -s`` shows them)."""


def _run(tmp_path_factory, name: str):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.wire.config import CONFIG_DIR, load_config
    from sonar.cluster.wire.policy import save_policy

    tok = load(name)  # before the clock: the tokenizer's load is not the run's
    root = tmp_path_factory.mktemp(f"vocab-{name}")
    user = save_policy(tiny_model(name), tok, root / "user")
    before = {p.name: p.stat().st_mtime_ns for p in user.iterdir()}
    cfg = load_config([CONFIG_DIR / "smoke.yaml"],
                      [f"model.path={user}", f"run.root={root}", f"run.run_dir={root / 'run'}", *SHRINK])
    t0 = time.perf_counter()
    summary = train(cfg)
    TIMES[name] = time.perf_counter() - t0
    print(f"paper vocabulary {name}: `sonar train --config smoke` took {TIMES[name]:.0f} s")
    return cfg, summary, user, before


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, shared_ray):
    return _run(tmp_path_factory, QWEN)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, shared_ray):
    return _run(tmp_path_factory, LLAMA)


def _check(name: str, run):
    from sonar.cluster.wire.policy import load_policy

    cfg, s, user, before = run
    assert s["learner_steps"] == sum(st.steps for st in cfg.stages) == 4
    r = s["replay"]
    assert r["balanced"] and r["produced"] == r["consumed"] + r["dropped_stale"] + r["requeued"] + r["queued"]
    assert r["consumed"] >= cfg.learner.groups_per_step * cfg.stages[1].steps
    rows = [json.loads(line) for line in open(Path(s["run_dir"]) / "metrics.jsonl")]
    steps = [x for x in rows if K.LEARNER_TRAINED_TOKENS in x]
    assert [x["stage"] for x in steps] == [0, 0, 1, 1]
    for x in steps:  # every step, SFT and RL, trained tokens with an optimizer step
        assert x[K.LEARNER_TRAINED_TOKENS] > 0 and not x.get(K.LEARNER_SKIPPED_STEP)
        assert x.get(K.LEARNER_OPTIMIZER_STEPS, 1) >= 1
    learner = s["weights"]["learner"]
    assert learner["version"] == 4 and len(s["weights"]["workers"]) == cfg.rollout.num_workers
    for w in s["weights"]["workers"]:
        assert w["version"] == learner["version"]
        assert w["checksum"] == pytest.approx(learner["checksum"], rel=1e-12)
    # tags as text: the user's directory is the policy, as it is, and nothing was written into it
    assert {p.name: p.stat().st_mtime_ns for p in user.iterdir()} == before
    assert not (Path(s["run_dir"]) / "policy").exists()
    # the held-out evaluation ran through the real tokenizer, one record per question
    (preds,) = Path(s["run_dir"]).glob("predictions-after_search.jsonl")
    records = [json.loads(line) for line in preds.read_text().splitlines()]
    assert len(records) == cfg.world.num_heldout_eval and all(isinstance(x["trace"], str) for x in records)
    # the export keeps the real vocabulary: every embedding row (Qwen's padding rows too), every tokenizer id
    model, tok = load_policy(Path(s["run_dir"]) / "model")
    assert model.get_input_embeddings().weight.shape[0] == model.config.vocab_size == EMBEDDING_ROWS[name]
    assert len(tok) == SIZES[name]


def test_a_qwen_vocabulary_policy_trains_end_to_end(qwen_run):
    _check(QWEN, qwen_run)


def test_a_llama_3_1_vocabulary_policy_trains_end_to_end(llama_run):
    _check(LLAMA, llama_run)
