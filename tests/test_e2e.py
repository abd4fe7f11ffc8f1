"""End to end (slow): configs/smoke.yaml through the real driver — Ray actors, DeepSpeed learner,
tantivy behind the Ray retrieval service, gloo weight broadcast, replay queue, MLflow (sqlite)."""
import json
import logging

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, shared_ray):
    from sonar.cluster.wire.config import CONFIG_DIR, load_config
    from sonar.cluster.driver.loop import train

    root = tmp_path_factory.mktemp("runs")
    cfg = load_config([CONFIG_DIR / "smoke.yaml"], [f"run.root={root}", f"run.run_dir={root / 'smoke'}"])
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("sonar")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        summary = train(cfg)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    SMOKE_LOG[:] = lines
    return cfg, summary


SMOKE_LOG: list[str] = []
"""The driver's log lines of the smoke run (the "sonar" logger)."""


def test_the_driver_logs_each_startup_phase_and_the_steps_eta(smoke_run):
    from sonar.cluster.driver.reports import STARTUP_PHASES

    done = [ln.split("start-up: ", 1)[1].rsplit(" done in ", 1)[0] for ln in SMOKE_LOG if " done in " in ln]
    assert done == list(STARTUP_PHASES)
    assert any(ln.startswith("rl step ") and " steps/s ETA " in ln for ln in SMOKE_LOG)


def test_every_worker_produced_and_the_learner_stepped(smoke_run):
    cfg, s = smoke_run
    produced = s["weights"]["worker_trajectories"]
    assert len(produced) == cfg.rollout.num_workers >= 2 and all(n > 0 for n in produced)
    total = sum(st.steps for st in cfg.stages)
    assert s["learner_steps"] == total
    assert s["weights"]["learner"]["version"] == total  # one version per step, carried across stages


def test_each_rl_stage_trains_only_its_own_data(smoke_run):
    """After a stage switch the workers roll out with the new stage's reward; leftovers of the previous
    stage are requeued, never trained under the new objective."""
    cfg, s = smoke_run
    rows = [json.loads(l) for l in open(f"{s['run_dir']}/metrics.jsonl")]
    rl_rows = [r for r in rows if "learner/data_stage/min" in r]
    stages = {r["stage"] for r in rl_rows}
    assert stages == {i for i, st in enumerate(cfg.stages) if st.kind == "rl"}
    for r in rl_rows:
        assert r["learner/data_stage/min"] == r["learner/data_stage/max"] == r["stage"]


def test_every_worker_holds_the_learners_latest_weights(smoke_run):
    _, s = smoke_run
    learner = s["weights"]["learner"]
    for w in s["weights"]["workers"]:
        assert w["version"] == learner["version"]
        assert w["checksum"] == pytest.approx(learner["checksum"], rel=1e-12)


def test_policy_lag_bound_held_and_accounting_balances(smoke_run):
    cfg, s = smoke_run
    assert s["policy_lag_max"] <= cfg.replay.max_policy_lag
    r = s["replay"]
    assert r["balanced"] and r["produced"] == r["consumed"] + r["dropped_stale"] + r["requeued"] + r["queued"]
    assert r["consumed"] > 0 and r["produced"] > 0


def test_mlflow_holds_params_metrics_config_and_model(smoke_run):
    from mlflow.tracking import MlflowClient

    cfg, s = smoke_run
    from sonar.cluster.driver.tracking import run_file

    info = run_file(s["run_dir"])  # the project's store (run.root/mlflow.db), recorded beside the run
    assert info["run_id"] == s["mlflow_run_id"] and info["tracking_uri"].endswith("/mlflow.db")
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    run = client.get_run(s["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["stages.1.lr"] and run.data.params["stages.1.kind"] == "rl"
    for key in ("learner/loss", "learner/grad_norm", "rollout/reward/mean", "replay/depth", "learner/policy_lag/max",
                "eval/after_search/em", "weights/sync_s", "rollout/search_calls/mean", "rollout/trajectories_per_s",
                "retrieval/qps", "retrieval/cache/hit_rate", "learner/is_weight/hist/0.95-1.05"):
        assert key in run.data.metrics, key
    assert len(client.get_metric_history(run.info.run_id, "learner/loss")) >= 2
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "eval_summary.json", "summary.json", "predictions"} <= artifacts
    assert "predictions/predictions-after_search.jsonl" in {a.path for a in client.list_artifacts(run.info.run_id, "predictions")}
    assert "stage" not in run.data.metrics and run.data.tags["sonar.stage"] == str(len(cfg.stages) - 1)  # a tag (the last stage trained), not a metric
    assert run.data.tags["sonar.preset"] == "smoke" and run.data.tags["ray.job_id"]
    # the final policy: a logged model with the transformers flavour, eval table and config attached
    import mlflow

    (model,) = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list",
                                           filter_string=f"source_run_id = '{run.info.run_id}'")
    mi = mlflow.models.get_model_info(f"models:/{model.model_id}")
    assert "transformers" in mi.flavors and mi.metadata["sonar_eval"]["after_search"]["n"] > 0
    assert mi.metadata["sonar_config"]["run"]["name"] == "smoke"


def test_final_model_loads_with_transformers(smoke_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, s = smoke_run
    model = AutoModelForCausalLM.from_pretrained(f"{s['run_dir']}/model", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(f"{s['run_dir']}/model", local_files_only=True)
    assert model.config.vocab_size == len(tok)


def test_predictions_and_summary_written(smoke_run):
    _, s = smoke_run
    recs = [json.loads(l) for l in open(f"{s['run_dir']}/predictions-after_search.jsonl")]
    assert recs and {"question", "golden_answers", "prediction", "trace", "searches"} <= set(recs[0])
    assert json.load(open(f"{s['run_dir']}/summary.json"))["mlflow_run_id"] == s["mlflow_run_id"]
