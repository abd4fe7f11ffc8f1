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


def scripted_policy(tokenizer, chain: dict[str, str], default: str):
    """A Llama whose greedy next token depends only on the current one (a bigram table): ``chain[t]``
    after ``t``, else ``default``. Every layer writes zero into the residual stream (o_proj and
    down_proj are zero), so the last hidden state is RMSNorm(embedding of the current token); the
    chain tokens get one-hot embedding directions of their own, every other token a random direction
    orthogonal to them, all share a constant first coordinate, and the untied lm_head reads it off:
    logit 8 * 10 for the chained successor, 8 * 3 for ``default``, 0 for the rest."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, ids = 128, {t: tokenizer.convert_tokens_to_ids(t) for t in [*chain, *chain.values(), default]}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=512, tie_word_embeddings=False,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(len(tokenizer), hidden)
        rest = torch.randn(len(tokenizer), hidden - 1 - len(chain), generator=gen)
        emb[:, 1 + len(chain):] = rest / rest.norm(dim=1, keepdim=True)  # |r| = 1
        emb[:, 0] = 1.0  # RMSNorm then scales every embedding by sqrt(128 / 2) = 8
        head = torch.zeros(len(tokenizer), hidden)
        head[ids[default], 0] = 3.0
        for d, (cur, nxt) in enumerate(chain.items(), start=1):
            emb[ids[cur], 1 + len(chain):] = 0.0
            emb[ids[cur], d] = 1.0
            head[ids[nxt], d] = 10.0
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.fill_(1.0)
    return model.eval()


@pytest.mark.ray
def test_training_eval_and_sonar_eval_give_the_same_numbers(setup, tmp_path):
    """One evaluation path: the same held-out questions through training's evaluation (a Ray rollout
    worker searching through the retrieval service, sharded and summarised by ``reports.evaluate``)
    and through ``sonar eval`` (in-process, ``run_eval``) give the same records and the same summary.
    One worker with the same batch size, so both paths decode exactly the same batches. The policy
    searches "dran mor", then answers "zom trur" (gold of 3 of the 12 questions), so the numbers,
    the searches and the documents they bring back are all non-trivial."""
    from types import SimpleNamespace

    import ray

    from sonar.cluster.driver import reports
    from sonar.cluster.driver.evaluate import run_eval
    from sonar.cluster.driver.roles import init_ray, prepare_corpus, start_retrieval, start_worker
    from sonar.cluster.driver.run import start_run
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    from sonar.actors.model import load_policy, save_policy

    _, tmp = setup
    _, tok = load_policy(tmp / "hf")
    policy = save_policy(scripted_policy(tok, {"<search>": "dran", "dran": "mor", "mor": "</search>",
                                               "</information>": "<answer>", "<answer>": "zom", "zom": "trur",
                                               "trur": "</answer>"}, default="<search>"), tok, tmp_path / "policy")
    cfg = load_config([CONFIG_DIR / "smoke.yaml"], [f"run.root={tmp}", "eval.batch_size=8", "tracking.enabled=false",
                                                    "rollout.num_workers=1", "world.num_heldout_eval=12"])
    sonar_eval = run_eval(cfg, str(policy), [str(tmp / "heldout.jsonl")], str(tmp_path / "eval"))["heldout"]
    owns = init_ray(cfg)
    try:
        run = start_run(cfg)
        handles = start_retrieval(cfg, run, prepare_corpus(cfg, run))
        worker = start_worker(cfg, 0, handles, policy=str(policy))
        training = reports.evaluate(cfg, SimpleNamespace(workers=[worker]), run, split="parity")["search"]
        for h in [worker, *handles]:
            ray.kill(h, no_restart=True)
    finally:
        if owns:
            ray.shutdown()

    timing = "latency_s_per_q"
    assert {k: v for k, v in training.items() if k != timing} == {k: v for k, v in sonar_eval.items() if k != timing}
    assert training["n"] == 12 and training["searches_per_q"] == 1.0
    assert training["em"] == training["acc_r"] == training["em_r1"] == pytest.approx(3 / 12)  # the three "zom trur" questions
    assert training["em"] < training["f1"] < 1.0  # "zom tek" and the like score half a point of F1

    def by_id(path):
        return {r["id"]: r for r in map(json.loads, open(path))}

    a, b = by_id(run.dir / "predictions-parity_search.jsonl"), by_id(tmp_path / "eval" / "predictions-heldout.jsonl")
    assert a.keys() == b.keys()
    for qid in a:
        for field in ("prediction", "em", "f1", "acc_r", "em_r1", "f1_r1", "searches", "model_tokens", "finish_reason", "trace"):
            if field == "searches":  # the same queries brought the same documents back (latency aside)
                a[qid][field] = [{**c, "latency_ms": 0} for c in a[qid][field]]
                b[qid][field] = [{**c, "latency_ms": 0} for c in b[qid][field]]
            assert a[qid][field] == b[qid][field], (qid, field)
        assert a[qid]["prediction"] == "zom trur" and a[qid]["searches"][0]["doc_ids"][0]


def _ambiguous_file(setup, path):
    """The world's first 5 training questions as ``{question, answer}`` lines: no ``idx`` (so not
    detectably R1-Searcher's layout), and nothing else that names a format."""
    from sonar.actors.datasets import load_dataset

    _, tmp = setup
    items = load_dataset(tmp / "train.jsonl")
    path.write_text("".join(json.dumps({"question": i.question, "answer": i.golds[0]}) + "\n" for i in items))
    return path, items


def test_eval_format_reads_a_file_detection_cannot_tell(setup, tmp_path):
    from sonar.actors.datasets import DatasetError
    from sonar.cluster.driver.evaluate import run_eval

    cfg, tmp = setup
    path, items = _ambiguous_file(setup, tmp_path / "qa.jsonl")
    with pytest.raises(DatasetError, match="cannot detect the format"):
        run_eval(cfg, str(tmp / "hf"), [str(path)], str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()  # refused before the policy was loaded or anything written
    table = run_eval(cfg, str(tmp / "hf"), [str(path)], str(tmp_path / "out"), fmt="r1_searcher")
    assert table["qa"]["n"] == 5
    recs = [json.loads(l) for l in open(tmp_path / "out" / "predictions-qa.jsonl")]
    assert [r["question"] for r in recs] == [i.question for i in items]
    assert [r["golden_answers"] for r in recs] == [[i.golds[0]] for i in items]


def test_eval_cli_names_the_format_flag_when_detection_cannot_tell(setup, tmp_path):
    _, tmp = setup
    path, _ = _ambiguous_file(setup, tmp_path / "qa.jsonl")
    out = subprocess.run([sys.executable, "-m", "sonar", "eval", "--config", "configs/smoke.yaml", "--checkpoint",
                          str(tmp / "hf"), "--data", str(path), f"run.root={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "sonar: data error" in out.stderr and "qa.jsonl" in out.stderr and "--format" in out.stderr
    assert "Traceback" not in out.stderr
