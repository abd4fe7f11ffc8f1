"""`sonar eval` of a training run's checkpoint searches the run's own world (issue 53): the run's saved
config.yaml is the base, `--config` files cannot change the world, corpus, model or tag set, an override
that cannot fit the checkpoint is refused, and a checkpoint outside a run uses `--config` as before.

The "run" is a run directory as the driver leaves it (config.yaml, metrics.jsonl, model/) holding a scripted
policy (``tests/test_eval_cli.py:scripted_policy``) whose tokenizer knows the user's corpus, as the driver
widens the tiny policy's vocabulary to it (``cluster/driver/data.py:extra_vocab``): it searches
"glorbington", then answers "zaxxor quimbly", which only the user's corpus says."""
import json
import logging
import shutil

import pytest

from tests.test_eval_cli import scripted_policy

USER_DOCS = [{"id": "mine-0", "title": "glorbington", "text": "glorbington was founded by zaxxor quimbly"},
             {"id": "mine-1", "title": "frobnitz", "text": "frobnitz is a river far from the city"}]
QUESTIONS = [{"question": "who founded glorbington ?", "golden_answers": ["zaxxor quimbly"]},
             {"question": "which person founded glorbington ?", "golden_answers": ["zaxxor quimbly"]}]
CHAIN = {"<search>": "glorbington", "glorbington": "</search>", "</information>": "<answer>",
         "<answer>": "zaxxor", "zaxxor": "quimbly", "quimbly": "</answer>"}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    from sonar.actors.model import save_policy
    from sonar.actors.tokenizer import build_tokenizer
    from sonar.actors.world import build_world, words_of
    from sonar.cluster.wire.config import load_config, to_yaml

    tmp = tmp_path_factory.mktemp("user-run")
    corpus = _jsonl(tmp / "mine.jsonl", USER_DOCS)
    dev = _jsonl(tmp / "dev.jsonl", QUESTIONS)
    cfg = load_config(["smoke"], [f"run.root={tmp / 'runs'}", f"retrieval.corpus={corpus}", "world.force=true",
                                  "tracking.enabled=false", "eval.batch_size=8"])
    texts = [d["title"] + " " + d["text"] for d in USER_DOCS] + [q["question"] for q in QUESTIONS]
    tok = build_tokenizer([*build_world(cfg.world).vocab(), *(w for t in texts for w in words_of(t))])
    run = tmp / "runs" / "mine-20260101-000000-1"
    save_policy(scripted_policy(tok, CHAIN, default="<search>"), tok, run / "model")
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    return {"run": run, "corpus": corpus, "dev": dev, "cfg": cfg, "tmp": tmp}


def _predictions(out):
    (pred,) = out.glob("predictions-*.jsonl")
    return [json.loads(line) for line in pred.read_text().splitlines()]


def test_eval_of_a_run_searches_the_runs_own_corpus(user_run, tmp_path, capsys):
    """No --config: the run's saved config, so the user's corpus (whose answer the toy world cannot give)."""
    from sonar.cluster.driver.cli import main

    run, out = user_run["run"], tmp_path / "out"
    assert main(["eval", "--checkpoint", str(run / "model"), "--data", str(user_run["dev"]), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    (line,) = [l for l in stdout.splitlines() if l.startswith("sonar eval: searching ")]
    assert line == f"sonar eval: searching {user_run['corpus']} (tantivy, from the run's config {run / 'config.yaml'})"
    recs = _predictions(out)
    assert len(recs) == 2
    for r in recs:
        assert r["searches"][0]["doc_ids"] == [["mine-0"]]  # the user's document (one query, k=1), no toy-world one
        assert "founded by zaxxor quimbly" in r["trace"]  # its text, read back by the policy
        assert r["prediction"] == "zaxxor quimbly" and r["em"] == 1.0
    assert "retrieval:\n" in (out / "config.yaml").read_text() and str(user_run["corpus"]) in (out / "config.yaml").read_text()


def test_a_config_file_sets_evaluation_settings_but_not_the_runs_world(user_run, tmp_path, caplog):
    """--config beside a run's checkpoint: the file's evaluation settings apply (retrieval.k, turn budget,
    batch size), the world, model, tag set and retriever stay the run's (logged), and key=value overrides
    win over both."""
    from sonar.cluster.driver.evaluate import eval_config

    run = user_run["run"]
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("world: {num_entities: 300}\nmodel: {hidden_size: 64}\nprotocol: {name: search_r1, max_turns: 2}\n"
                       "retrieval: {corpus: null, k: 3, cache_size: 7}\neval: {batch_size: 4}\n")
    with caplog.at_level(logging.INFO, logger="sonar.eval"):
        cfg, source = eval_config(run / "model", [str(overlay)], [])
    assert source == f"the run's config {run / 'config.yaml'}, evaluation settings from --config {overlay}"
    assert (cfg.world.num_entities, cfg.model.hidden_size, cfg.protocol.name) == (120, 128, "rag_r1_multi")
    assert (cfg.retrieval.corpus, cfg.retrieval.cache_size) == (str(user_run["corpus"]), 4096)
    assert (cfg.retrieval.k, cfg.protocol.max_turns, cfg.eval.batch_size) == (3, 2, 4)
    (kept,) = [r.getMessage() for r in caplog.records if "the run's world kept over --config" in r.getMessage()]
    assert "world.num_entities=120 (--config: 300)" in kept and "protocol.name='rag_r1_multi' (--config: 'search_r1')" in kept
    assert f"retrieval.corpus={str(user_run['corpus'])!r} (--config: None)" in kept

    other = _jsonl(tmp_path / "other.jsonl", USER_DOCS[1:])
    cfg, _ = eval_config(run / "model", [str(overlay)], [f"retrieval.corpus={other}", "world.num_entities=200"])
    assert (cfg.retrieval.corpus, cfg.world.num_entities) == (str(other), 200)  # overrides win
    cfg, _ = eval_config(run / "model", [], ["retrieval.k=2", "eval.batch_size=3"])  # no --config: the run's + overrides
    assert (cfg.retrieval.corpus, cfg.retrieval.k, cfg.eval.batch_size, cfg.run.root) == \
        (str(user_run["corpus"]), 2, 3, user_run["cfg"].run.root)


@pytest.mark.parametrize("override, ran, same", [("protocol.name=search_r1", "'rag_r1_multi'", "protocol.name=rag_r1_multi"),
                                                 ("model.path=/models/Qwen2.5-3B", "None", "model.path=null")])
@pytest.mark.parametrize("files", [[], ["smoke"]])
def test_an_override_that_cannot_fit_the_checkpoint_is_refused(user_run, override, ran, same, files):
    from sonar.cluster.driver.evaluate import EvalError, eval_config

    field, _, value = override.partition("=")
    with pytest.raises(EvalError) as ei:  # notes=[] as the CLI passes: a model.path not here is noted, not refused
        eval_config(user_run["run"] / "model", files, [override], notes=[])
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{field}={value!r} does not fit the checkpoint ")
    assert f"its run trained with {field}={ran}" in msg and str(user_run["run"] / "config.yaml") in msg
    eval_config(user_run["run"] / "model", files, [same])  # the run's own value fits


def test_the_cli_refuses_it_in_one_line_before_anything_is_written(user_run, tmp_path, capsys):
    from sonar.cluster.driver.cli import main

    out = tmp_path / "out"
    assert main(["eval", "--checkpoint", str(user_run["run"]), "--data", str(user_run["dev"]), "--out", str(out),
                 "protocol.name=search_r1"]) == 2
    errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("sonar:")]
    assert len(errors) == 1 and errors[0].startswith("sonar: eval error: protocol.name='search_r1' does not fit")
    assert "protocol.name='rag_r1_multi'" in errors[0]
    assert not out.exists()


def test_the_run_config_is_found_from_any_checkpoint_of_the_run(user_run, tmp_path):
    from sonar.cluster.driver.evaluate import run_config_file

    run = user_run["run"]
    for where in (run, run / "model", run / "checkpoints" / "step-00001" / "hf"):
        where.mkdir(parents=True, exist_ok=True)
        assert run_config_file(where) == run / "config.yaml"
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "config.yaml").write_text("run: {name: x}\n")  # a config.yaml alone does not make a run
    assert run_config_file(lone) is None


def test_a_checkpoint_outside_a_run_uses_config_as_before(user_run, tmp_path, capsys):
    """The same policy copied out of its run: --config's world (the toy world's corpus) is searched."""
    from sonar.cluster.driver.cli import main
    from sonar.cluster.driver.evaluate import eval_config
    from sonar.cluster.wire.config import load_config

    loose = tmp_path / "loose"
    shutil.copytree(user_run["run"] / "model", loose)
    cfg, source = eval_config(loose, ["smoke"], [f"run.root={tmp_path}"])
    assert source == "--config smoke" and cfg == load_config(["smoke"], [f"run.root={tmp_path}", "world.force=true"])
    out = tmp_path / "out"
    assert main(["eval", "--config", "smoke", "--checkpoint", str(loose), "--data", str(user_run["dev"]), "--out", str(out),
                 f"run.root={tmp_path}", "tracking.enabled=false", "eval.batch_size=8"]) == 0
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("sonar eval: searching ")]
    assert line.startswith(f"sonar eval: searching the synthetic world's corpus {tmp_path / 'corpus'}/world-")
    assert line.endswith("(tantivy, from --config smoke)")
    for r in _predictions(out):
        assert r["searches"] and not any(d.startswith("mine-") for s in r["searches"] for q in s["doc_ids"] for d in q)
        assert "zaxxor quimbly" not in r["trace"].split("</information>")[0]  # no document of the user's came back
