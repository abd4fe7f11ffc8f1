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
    assert table["heldout"]["n"] == 12 and table[f"{tmp.name}-train"]["n"] == 5  # a split-named file: dir-split
    for row in table.values():
        assert 0.0 <= row["em"] <= row["f1"] + 1e-9  # EM=1 implies F1=1, so mean EM <= mean F1
        assert row["tokens_per_q"] > 0 and row["latency_s_per_q"] > 0
    recs = [json.loads(l) for l in open(tmp / "out" / "predictions-heldout.jsonl")]
    assert len(recs) == 12 and {"question", "golden_answers", "prediction", "trace", "searches"} <= set(recs[0])
    assert recs[0]["trace"].startswith("question :")
    assert "| heldout |" in (tmp / "out" / "eval.md").read_text()
    assert (tmp / "mlflow.db").exists() and not (tmp / "out" / "mlflow.db").exists()  # the project's one store


@pytest.mark.slow
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


def test_an_evaluation_is_logged_at_the_training_step_its_policy_is_from(tmp_path):
    """Issue 55: eval metrics logged at step 0 drew a false line back to the start in MLflow's charts. A
    checkpoint's step is its run_step; a run's final model/ its last logged step; any other policy 0."""
    from sonar.cluster.driver.evaluate import checkpoint_step

    run = tmp_path / "run"
    tag = run / "checkpoints" / "step-12"
    (tag / "hf").mkdir(parents=True)
    (tag / "state.json").write_text(json.dumps({"version": 12, "run_step": 31}))
    (run / "model").mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (0, 5, 40)))
    assert checkpoint_step(tag / "hf", run) == 31
    assert checkpoint_step(run / "model", run) == 40
    assert checkpoint_step(tmp_path / "elsewhere", None) == 0
    (run / "metrics.jsonl").write_text("{not json\n")
    assert checkpoint_step(run / "model", run) == 0  # unreadable records: unknown, and the evaluation still runs


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
def test_training_eval_and_sonar_eval_give_the_same_numbers(setup, tmp_path, shared_ray):
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
    from sonar.cluster.driver.roles import init_ray, prepare_corpus, start_retrieval
    from sonar.cluster.driver.rollout_pool import RolloutPool, start_worker
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
        handles = start_retrieval(cfg, run, prepare_corpus(cfg, run)).handles
        worker = start_worker(cfg, 0, handles, policy=str(policy))
        training = reports.evaluate(cfg, SimpleNamespace(pool=RolloutPool(cfg, workers=[worker])), run,
                                    split="parity")["search"]
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


@pytest.mark.slow
def test_eval_cli_names_the_format_flag_when_detection_cannot_tell(setup, tmp_path):
    _, tmp = setup
    path, _ = _ambiguous_file(setup, tmp_path / "qa.jsonl")
    out = subprocess.run([sys.executable, "-m", "sonar", "eval", "--config", "configs/smoke.yaml", "--checkpoint",
                          str(tmp / "hf"), "--data", str(path), f"run.root={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "sonar: data error" in out.stderr and "qa.jsonl" in out.stderr and "--format" in out.stderr
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------- keeps what it measured, refuses early

def test_dataset_names_are_unique_and_name_dataset_and_split(tmp_path):
    from sonar.actors.datasets import DatasetError
    from sonar.cluster.driver.evaluate import dataset_names

    p = lambda rel: tmp_path / rel  # noqa: E731
    # FlashRAG's <dataset>/<split>.jsonl: the directory names the dataset
    assert dataset_names([p("hotpotqa/dev.jsonl"), p("nq/dev.jsonl"), p("nq/test.jsonl.gz")]) == \
        ["hotpotqa-dev", "nq-dev", "nq-test"]
    # a stem that is a dataset name stays alone; a clash takes in the directory, then more of the path
    assert dataset_names([p("bamboogle.jsonl"), p("a/qa.jsonl"), p("b/qa.jsonl")]) == ["bamboogle", "a-qa", "b-qa"]
    assert dataset_names([p("x/hotpotqa/dev.jsonl"), p("y/hotpotqa/dev.jsonl")]) == ["x-hotpotqa-dev", "y-hotpotqa-dev"]
    # characters MLflow keys refuse, and full paths that sanitise alike
    assert dataset_names([p("a b/dev.jsonl"), p("a_b/dev.jsonl")]) == ["a_b-dev", "a_b-dev-2"]
    with pytest.raises(DatasetError, match="given twice"):
        dataset_names([p("nq/dev.jsonl"), p("nq/../nq/dev.jsonl")])


@pytest.fixture
def flashrag_layout(setup, tmp_path):
    """Two datasets in FlashRAG's <dataset>/dev.jsonl layout (4 and 3 held-out questions)."""
    _, tmp = setup
    lines = (tmp / "heldout.jsonl").read_text().splitlines(keepends=True)
    for name, part in (("hotpotqa", lines[:4]), ("nq", lines[4:7])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "dev.jsonl").write_text("".join(part))
    return [str(tmp_path / "hotpotqa" / "dev.jsonl"), str(tmp_path / "nq" / "dev.jsonl")]


def test_flashrag_layout_keeps_one_predictions_file_and_row_per_dataset(setup, flashrag_layout, tmp_path):
    from sonar.cluster.driver.evaluate import run_eval

    cfg, tmp = setup
    table = run_eval(cfg, str(tmp / "hf"), flashrag_layout, str(tmp_path / "out"))
    assert {k: v["n"] for k, v in table.items()} == {"hotpotqa-dev": 4, "nq-dev": 3}
    for name, n in (("hotpotqa-dev", 4), ("nq-dev", 3)):
        assert len((tmp_path / "out" / f"predictions-{name}.jsonl").read_text().splitlines()) == n
    md = (tmp_path / "out" / "eval.md").read_text()
    assert "| hotpotqa-dev | 4 |" in md and "| nq-dev | 3 |" in md


def _mlflow_runs(out: Path, experiment: str):
    from mlflow.tracking import MlflowClient

    from sonar.cluster.driver.tracking import run_file

    info = run_file(out)  # the project's store (shared with other runs), recorded beside the output
    client = MlflowClient(info["tracking_uri"])
    assert client.get_experiment_by_name(experiment).experiment_id == info["experiment_id"]
    return [client.get_run(info["run_id"])]


def test_a_failure_after_the_first_dataset_marks_failed_and_keeps_it(setup, flashrag_layout, tmp_path, monkeypatch):
    """The second dataset's evaluation raises (an injected fault in the one evaluation path): the first
    dataset's predictions and table row stay, the MLflow run is FAILED with the first dataset's metrics,
    and the error names the dataset that failed and where the traceback went."""
    from sonar.actors import evaluation
    from sonar.cluster.driver.evaluate import EvalFailed, run_eval

    cfg, tmp = setup
    real, calls = evaluation.greedy_records, []

    async def failing_second(prompts, **kw):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RuntimeError("search service went away")
        return await real(prompts, **kw)

    monkeypatch.setattr(evaluation, "greedy_records", failing_second)
    out = tmp_path / "out"
    with pytest.raises(EvalFailed, match=r"dataset nq-dev \(.*nq/dev.jsonl\): RuntimeError: search service went away") as ei:
        run_eval(cfg, str(tmp / "hf"), flashrag_layout, str(out))
    assert calls == [4, 3] and list(ei.value.finished) == ["hotpotqa-dev"]
    assert "1 finished dataset(s) kept" in str(ei.value)
    assert len((out / "predictions-hotpotqa-dev.jsonl").read_text().splitlines()) == 4
    assert not (out / "predictions-nq-dev.jsonl").exists()
    md = (out / "eval.md").read_text()
    assert "| hotpotqa-dev | 4 |" in md and "nq-dev" not in md
    assert "search service went away" in (out / "error.log").read_text()
    (run,) = _mlflow_runs(out, "sonar")
    assert run.info.status == "FAILED"
    assert run.data.metrics and all(k.startswith("eval/hotpotqa-dev/") for k in run.data.metrics)
    assert run.data.params["eval.data.nq-dev"] == flashrag_layout[1]


def test_every_data_file_is_validated_before_any_model_work(setup, flashrag_layout, tmp_path, monkeypatch):
    """A malformed third file is refused before the policy is loaded and before anything is written."""
    from sonar.actors.datasets import DatasetError
    from sonar.cluster.driver import evaluate

    cfg, tmp = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q?", "golden_answers": ["a"]}\n{not json\n')
    monkeypatch.setattr(evaluate, "_load_policy", lambda d: pytest.fail("the policy was loaded"))
    with pytest.raises(DatasetError, match="bad.jsonl"):
        evaluate.run_eval(cfg, str(tmp / "hf"), [*flashrag_layout, str(bad)], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _truncated_policy(setup, dst: Path, keep: float) -> Path:
    import shutil

    _, tmp = setup
    shutil.copytree(tmp / "hf", dst)
    w = dst / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[:int(len(data) * keep)])
    return w


@pytest.mark.parametrize("keep", [0.001, 0.9])  # a broken header; a valid header, data cut short
def test_a_corrupt_weights_file_is_named(setup, tmp_path, keep):
    from sonar.cluster.driver.evaluate import EvalError, check_policy_files

    w = _truncated_policy(setup, tmp_path / "hf", keep)
    with pytest.raises(EvalError, match=f"{w}: corrupt weights file"):
        check_policy_files(tmp_path / "hf")


@pytest.mark.slow  # spawns processes (ranks / a CLI): `make test` runs it, `make test-fast` does not
def test_eval_cli_user_errors_are_one_line_naming_the_file_exit_2(setup, flashrag_layout, tmp_path):
    """Corrupt weights, a checkpoint without a model and the same file twice: exit 2, one line each,
    naming the file, no traceback, nothing written."""
    _, tmp = setup
    w = _truncated_policy(setup, tmp_path / "bad_hf", 0.5)
    cases = [([str(tmp_path / "bad_hf")] + ["--data", flashrag_layout[0]], str(w)),
             ([str(tmp_path / "nothing")] + ["--data", flashrag_layout[0]], "nothing"),
             ([str(tmp / "hf")] + ["--data", flashrag_layout[0], "--data", flashrag_layout[0]], "given twice")]
    # The three refusals run side by side (each is mostly the CLI's start-up); none may write anything.
    procs = [subprocess.Popen([sys.executable, "-m", "sonar", "eval", "--config", "configs/smoke.yaml",
                               "--out", str(tmp_path / "out"), "--checkpoint", *args, f"run.root={tmp_path}"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, _ in cases]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, stderr), (_, named) in zip(procs, outs, cases):
        assert p.returncode == 2, stderr[-2000:]
        errors = [l for l in stderr.splitlines() if l.startswith("sonar:")]
        assert len(errors) == 1 and named in errors[0], stderr[-2000:]
        assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists()


def test_the_eval_run_is_named_after_its_directory_without_a_doubled_prefix(setup, flashrag_layout, tmp_path):
    from sonar.cluster.driver.evaluate import run_eval

    cfg, tmp = setup
    for name, expected in (("eval-20261202-000000", "eval-20261202-000000"), ("out", "eval-out")):
        run_eval(cfg, str(tmp / "hf"), flashrag_layout[:1], str(tmp_path / name))
        (run,) = _mlflow_runs(tmp_path / name, "sonar")
        assert run.info.run_name == expected


def test_a_dataset_the_policy_cannot_read_is_warned_about_with_its_unknown_share(setup, tmp_path, caplog):
    import logging

    from sonar.cluster.driver.evaluate import _load_policy, run_eval, unknown_share

    cfg, tmp = setup
    _, tok = _load_policy(tmp / "hf")
    assert unknown_share(tok, ["question : zzqx wvut"]) == pytest.approx(2 / 4)  # 2 of 4 words unknown
    path = tmp_path / "foreign.jsonl"
    path.write_text(json.dumps({"question": "zzqx wvut", "golden_answers": ["a"]}) + "\n")
    with caplog.at_level(logging.INFO, logger="sonar.eval"):
        run_eval(cfg, str(tmp / "hf"), [str(path)], str(tmp_path / "out"))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("dataset foreign: 100.0 % of its question tokens are unknown" in m for m in msgs), msgs
    assert any(m.startswith(f"sonar eval: writing predictions and the table to {tmp_path / 'out'}") for m in msgs)


@pytest.mark.slow  # spawns a CLI
def test_eval_cli_of_a_training_run_writes_beside_it_nests_in_its_store_and_logs_one_format(setup, tmp_path):
    """``sonar eval --checkpoint <training run>`` from a project with another run.root: the results go to
    <run>/eval-<stamp> (the path printed), the MLflow run into the training run's store nested under it
    (no store where the command ran), the scores print in percent, and the log lines -- Sonar's and
    MLflow's -- carry cluster/wire/logs.py's one date format."""
    import re
    import shutil

    from mlflow.tracking import MlflowClient

    from sonar.cluster.driver import tracking
    from sonar.cluster.wire.config import load_config

    cfg, tmp = setup
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    train_dir = project / "train-run"
    shutil.copytree(tmp / "hf", train_dir / "model")
    train = tracking.make_sink(load_config([], [f"run.root={project}", "tracking.system_metrics=false"]),
                               train_dir, "train-run")
    train.finish()
    out = subprocess.run([sys.executable, "-m", "sonar", "eval", "--config", "configs/smoke.yaml",
                          "--checkpoint", str(train_dir), "--data", str(tmp / "heldout.jsonl"),
                          f"run.root={elsewhere}", "eval.batch_size=8", "tracking.system_metrics=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (ev_dir,) = sorted(train_dir.glob("eval-*"))
    assert re.fullmatch(r"eval-\d{8}-\d{6}", ev_dir.name)  # logs.RUN_STAMP
    assert f"predictions and table in {ev_dir}" in out.stdout and (ev_dir / "eval.md").is_file()
    assert not (elsewhere / "mlflow.db").exists()
    (run,) = [r for r in MlflowClient(tracking_uri=train.uri).search_runs([train.experiment_id])
              if r.info.run_id != train.run_id]
    assert run.info.run_name == ev_dir.name and run.data.tags["mlflow.parentRunId"] == train.run_id
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("| heldout |")]
    cells = row.strip("| ").split(" | ")
    assert all(re.fullmatch(r"\d{1,3}\.\d", c) for c in cells[2:7]), row  # em..f1_r1 in percent
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"  # logs.LOG_DATEFMT
    (where,) = [line for line in out.stderr.splitlines() if "sonar eval: writing predictions" in line]
    assert re.match(rf"{stamp} INFO sonar\.eval: sonar eval: writing predictions and the table to {re.escape(str(ev_dir))}",
                    where), where
    dated = [line for line in out.stderr.splitlines() if re.match(r"\d{2,4}[-/]\d\d[-/ ]", line)]
    assert dated and all(re.match(rf"{stamp} [A-Z]+ \S+: ", line) for line in dated), dated
