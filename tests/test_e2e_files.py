"""End to end (slow): examples/own_data, the command its README gives, through the `sonar` command line and
the real driver: GRPO steps on a HotpotQA-format file (examples/own_data/hotpot_mini.json) with its
own passages as the corpus, held-out evaluation on a second file; the tiny word-level policy's
vocabulary is widened to the files and the corpus."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parent.parent
FIX = "examples/own_data"
# The command the example's README shows (relative paths: it runs from the repository root).
COMMAND = ["--config", f"{FIX}/config.yaml"]


def test_the_command_is_the_one_the_example_and_the_actors_readme_show():
    shown = "sonar train " + " ".join(COMMAND)
    assert shown in (ROOT / FIX / "README.md").read_text() and shown in (ROOT / "actors" / "README.md").read_text()


@pytest.fixture(scope="module")
def files_run(tmp_path_factory, shared_ray):
    """The command as a user types it; its driver joins the session's cluster (``shared_ray`` sets
    ``RAY_ADDRESS``, which the command inherits, as under `ray job submit`) instead of starting one: what
    is checked here is the data path, and the CLI's own cluster start is the other CLI tests' subject."""
    root = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "sonar", "train", *COMMAND, f"run.root={root}",
                          f"run.run_dir={root / 'files'}", "tracking.log_model=false", "rollout.num_workers=1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return root / "files"


def read_jsonl(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def test_the_stage_trained_on_the_files_questions(files_run):
    fixture = json.load(open(ROOT / FIX / "hotpot_mini.json"))
    listed = read_jsonl(files_run / "prompts-stage0.jsonl")
    assert [(r["qid"], r["question"], r["golds"]) for r in listed] == \
        [(r["_id"], r["question"], [r["answer"]]) for r in fixture]
    steps = read_jsonl(files_run / "trained_prompts.jsonl")
    trained = [i for s in steps for i in s["trained"]]
    # two learner steps of the example's learner.groups_per_step groups, every index one of the file's 8
    # questions (the synthetic world has far more training questions than that)
    assert len([s for s in steps if s["trained"]]) == 2 and len(trained) >= 2
    assert set(trained) <= set(range(len(fixture)))


def test_held_out_evaluation_ran_on_the_eval_file(files_run):
    dev = json.load(open(ROOT / FIX / "hotpot_mini_dev.json"))
    recs = read_jsonl(files_run / "predictions-after_search.jsonl")
    assert sorted(r["question"] for r in recs) == sorted(r["question"] for r in dev)
    assert sorted(tuple(r["golden_answers"]) for r in recs) == sorted((r["answer"],) for r in dev)


def test_the_policy_vocabulary_covers_the_files_and_the_corpus(files_run):
    from sonar.cluster.wire.policy import load_tokenizer

    tok = load_tokenizer(files_run / "policy")
    texts = [r["question"] for r in json.load(open(ROOT / FIX / "hotpot_mini.json"))]
    texts += [json.loads(l)["text"] for l in open(ROOT / FIX / "hotpot_mini_corpus.jsonl")]
    assert all(tok.unk_token_id not in tok.encode(t, add_special_tokens=False) for t in texts)
