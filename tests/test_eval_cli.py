"""`sonar eval` and `sonar score` end to end on the synthetic world with a tiny model (no Ray)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from sonar.actors.model import policy_and_tokenizer, save_policy
    from sonar.actors.world import build_world, write_questions_jsonl
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    tmp = tmp_path_factory.mktemp("eval")
    cfg = load_config([CONFIG_DIR / "smoke.yaml"], [f"run.root={tmp}", "eval.batch_size=8"])
    world = build_world(cfg.world)
    model, tok = policy_and_tokenizer(cfg.model, world)
    save_policy(model, tok, tmp / "hf")
    write_questions_jsonl(world.heldout[:12], tmp / "heldout.jsonl")
    write_questions_jsonl(world.train[:5], tmp / "train.jsonl")
    return cfg, tmp


def test_eval_writes_predictions_table_and_mlflow(setup):
    from sonar.cluster.driver.evaluate import run_eval

    cfg, tmp = setup
    table = run_eval(cfg, str(tmp / "hf"), [str(tmp / "heldout.jsonl"), str(tmp / "train.jsonl")], str(tmp / "out"))
    assert table["heldout"]["n"] == 12 and table["train"]["n"] == 5
    for row in table.values():
        assert 0.0 <= row["em"] <= row["f1"] + 1e-9  # EM=1 implies F1=1, so mean EM <= mean F1
        assert row["tokens_per_q"] > 0 and row["latency_s_per_q"] > 0
    recs = [json.loads(l) for l in open(tmp / "out" / "predictions-heldout.jsonl")]
    assert len(recs) == 12 and {"question", "golden_answers", "prediction", "trace", "searches"} <= set(recs[0])
    assert recs[0]["trace"].startswith("question :")
    assert "| heldout |" in (tmp / "out" / "eval.md").read_text()
    assert (tmp / "out" / "mlflow.db").exists()


def test_score_cli_rescoring_matches(setup):
    cfg, tmp = setup
    out = subprocess.run([sys.executable, "-m", "sonar", "score", str(tmp / "out" / "predictions-heldout.jsonl")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "predictions-heldout" in out.stdout and "EM" in out.stdout.upper()


def test_eval_refuses_a_directory_without_a_model(setup, tmp_path):
    from sonar.cluster.driver.evaluate import resolve_model_dir

    with pytest.raises(FileNotFoundError, match="no Hugging Face model directory"):
        resolve_model_dir(str(tmp_path))
