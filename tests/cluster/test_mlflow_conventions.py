"""MLflow by its conventions (``cluster/driver/tracking.py``), against sqlite: the standard environment
variables, one store per project, a resume continuing its MLflow run, ``sonar eval`` nested under the
training run, tags, the stage as a tag, async logging that loses nothing at KILLED / FAILED, the final
policy with the transformers flavour and registered; and the Ray dashboard gauges (a stand-in with
``ray.util.metrics``'s interface, and one real local Ray check). The same sink against a local
``mlflow server`` is in ``test_mlflow_server.py``."""
from __future__ import annotations

import json
import os

import pytest

from sonar.cluster.driver import tracking
from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import load_config
from tests.ray_job import ray_for_module


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "RAY_JOB_CONFIG_JSON_ENV_VAR",
                "RAY_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    yield
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()


def _cfg(root, *overrides):
    return load_config([], [f"run.root={root}", "tracking.system_metrics=false", *overrides])


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_config_then_standard_env_vars_then_the_project_store(tmp_path, monkeypatch):
    assert tracking.resolve_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tracking.resolve_experiment(None) == "sonar"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "nightly")
    assert tracking.resolve_uri(None, tmp_path) == "http://127.0.0.1:5999"  # env beats the default
    assert tracking.resolve_experiment(None) == "nightly"
    assert tracking.resolve_uri("sqlite:///x.db", tmp_path) == "sqlite:///x.db"  # an explicit config beats env
    assert tracking.resolve_experiment("mine") == "mine"


def test_env_vars_choose_the_store_and_experiment_of_a_run(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    (tmp_path / "r").mkdir()
    sink = tracking.make_sink(_cfg(tmp_path / "root"), tmp_path / "r", "r")
    sink.finish()
    run = _client(uri).get_run(sink.run_id)
    assert _client(uri).get_experiment(run.info.experiment_id).name == "from-env"
    assert not (tmp_path / "root" / "mlflow.db").exists()


def test_bad_tracking_values_name_the_field():
    with pytest.raises(ValueError, match="tracking.registered_model_name='a/b'"):
        load_config([], ["tracking.registered_model_name=a/b"])
    with pytest.raises(ValueError, match="tracking.registered_model_name='m'.*tracking.log_model"):
        load_config([], ["tracking.registered_model_name=m", "tracking.log_model=false"])
    with pytest.raises(ValueError, match="tracking.experiment=' '"):
        load_config([], ["tracking.experiment=' '"])


def test_runs_share_the_project_store_and_a_resume_continues_the_killed_run(tmp_path):
    """Two runs and a resume under one run.root: one sqlite file, runs side by side; the resume (a new
    run directory) continues the MLflow run it resumes: same id, steps continue, a changed param kept
    as a tag, status FINISHED; async metrics logged before KILLED are all there."""
    root = tmp_path / "runs"
    a, b, c = (root / n for n in ("a", "b", "c"))
    for d in (a, b, c):
        d.mkdir(parents=True)
    cfg = _cfg(root)
    first = tracking.make_sink(cfg, a, "a")
    first.log_params({"run.resume": "", "stages.0.steps": "10"})
    for step in range(1, 4):
        first.log_metrics({K.LEARNER_LOSS: 1.0 / step, "stage": 0}, step=step)
    first.finish("KILLED")
    other = tracking.make_sink(cfg, b, "b")
    other.finish()
    resumed = tracking.make_sink(load_config([], [f"run.root={root}", "tracking.system_metrics=false",
                                                   "run.resume=latest"]), c, "c", resume_dir=a)
    assert resumed.run_id == first.run_id and resumed.resumed
    resumed.log_params({"run.resume": "latest", "stages.0.steps": "10", "run.resumed_from": "x"})
    for step in range(4, 6):
        resumed.log_metrics({K.LEARNER_LOSS: 1.0 / step, "stage": 1}, step=step)
    resumed.finish("FINISHED")

    assert sorted(p.name for p in root.iterdir()) == ["a", "b", "c", "mlflow.db"]  # one store for the project
    info = tracking.run_file(c)
    assert info["run_id"] == first.run_id and info["tracking_uri"] == f"sqlite:///{root.resolve()}/mlflow.db"
    client = _client(info["tracking_uri"])
    assert {r.info.run_id for r in client.search_runs([info["experiment_id"]])} == {first.run_id, other.run_id}
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    hist = client.get_metric_history(first.run_id, K.LEARNER_LOSS)
    assert sorted(m.step for m in hist) == [1, 2, 3, 4, 5]
    assert "stage" not in run.data.metrics and run.data.tags[tracking.STAGE_TAG] == "1"
    assert run.data.params["run.resume"] == "" and run.data.tags["sonar.param_changed.run.resume"] == "latest"
    assert run.data.params["run.resumed_from"] == "x"


def test_a_resume_from_another_store_starts_a_new_run(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first = tracking.make_sink(_cfg(tmp_path / "one"), tmp_path / "a", "a")
    first.finish("KILLED")
    again = tracking.make_sink(_cfg(tmp_path / "two"), tmp_path / "b", "b", resume_dir=tmp_path / "a")
    assert again.run_id != first.run_id and not again.resumed
    again.finish()


def test_async_logging_loses_nothing_when_the_run_fails(tmp_path):
    """45 keys a step for 40 steps, enqueued on the async logger, then FAILED at once: every value is in the store."""
    (tmp_path / "r").mkdir()
    sink = tracking.make_sink(_cfg(tmp_path), tmp_path / "r", "r")
    assert sink.inner.async_logging
    keys = [f"learner/k{i}" for i in range(45)]
    for step in range(40):
        sink.log_metrics({k: step + i / 100 for i, k in enumerate(keys)}, step=step)
    sink.finish("FAILED")
    client = _client(sink.uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FAILED" and len(run.data.metrics) == 45
    for i in (0, 44):
        hist = client.get_metric_history(sink.run_id, keys[i])
        assert sorted((m.step, m.value) for m in hist) == [(s, s + i / 100) for s in range(40)]


def test_an_async_sink_buffers_mlflows_logging_unless_the_user_set_it(tmp_path, monkeypatch):
    """Buffered, MLflow's logging thread waits on its stop event instead of a 1 s ``queue.get``, so a run's
    end does not wait out that poll; every value still reaches the store (the test above runs buffered)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    monkeypatch.delenv(tracking.ASYNC_BUFFER_ENV, raising=False)
    sink = tracking.make_sink(_cfg(tmp_path / "one"), tmp_path / "a", "a")
    assert os.environ[tracking.ASYNC_BUFFER_ENV] == tracking.ASYNC_BUFFER_S == "1"
    sink.log_metrics({"learner/x": 1.0}, step=0)
    sink.finish()
    assert [m.value for m in _client(sink.uri).get_metric_history(sink.run_id, "learner/x")] == [1.0]
    monkeypatch.setenv(tracking.ASYNC_BUFFER_ENV, "5")
    tracking.make_sink(_cfg(tmp_path / "two"), tmp_path / "b", "b").finish()
    assert os.environ[tracking.ASYNC_BUFFER_ENV] == "5"


def test_tags_name_commit_preset_version_and_ray_job(tmp_path, monkeypatch):
    from sonar import __version__

    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_X1"}}))
    (tmp_path / "r").mkdir()
    sink = tracking.make_sink(_cfg(tmp_path, "run.name=smoke"), tmp_path / "r", "r")
    sink.finish()
    tags = _client(sink.uri).get_run(sink.run_id).data.tags
    assert tags["sonar.preset"] == "smoke" and tags["sonar.version"] == __version__
    assert tags["ray.job_submission_id"] == "raysubmit_X1"
    assert len(tags["mlflow.source.git.commit"]) == 40 and tags["sonar.git.dirty"] in ("true", "false")
    assert tags[tracking.PID_TAG] == str(os.getpid())
    # the code's fingerprint, what a job's uploaded working dir (no .git) still records
    from sonar.cluster.wire.paths import code_origin

    assert tags["sonar.code"] == code_origin().split("(")[1].split(")")[0]


def test_git_tags_outside_a_checkout_are_empty(tmp_path):
    assert tracking.git_tags(tmp_path) == {}


def test_eval_is_nested_under_the_training_run_in_the_same_store(tmp_path):
    root = tmp_path / "runs"
    (root / "train" / "model").mkdir(parents=True), (root / "eval").mkdir()
    train = tracking.make_sink(_cfg(root), root / "train", "train")
    train.finish()
    ev = tracking.make_sink(_cfg(root), root / "eval", "eval", parent_of=root / "train" / "model")
    ev.finish()
    tags = _client(ev.uri).get_run(ev.run_id).data.tags
    assert tags["sonar.train_run_id"] == train.run_id and tags["mlflow.parentRunId"] == train.run_id


def test_eval_of_a_run_elsewhere_goes_to_that_runs_store_and_experiment(tmp_path, monkeypatch):
    # sonar eval started from another directory (another run.root): no new store there, the training
    # run's store and experiment instead, nested under it.
    train_root, here = tmp_path / "project" / "runs", tmp_path / "elsewhere" / "runs"
    (train_root / "train" / "model").mkdir(parents=True)
    train = tracking.make_sink(_cfg(train_root, "tracking.experiment=mine"), train_root / "train", "train")
    train.finish()
    (here / "eval").mkdir(parents=True)
    ev = tracking.make_sink(_cfg(here), here / "eval", "eval", parent_of=train_root / "train" / "model")
    ev.finish()
    assert ev.uri == train.uri and not (here / "mlflow.db").exists()
    run = _client(ev.uri).get_run(ev.run_id)
    assert run.info.experiment_id == train.experiment_id
    assert run.data.tags["mlflow.parentRunId"] == train.run_id
    # a store the user names wins: then the run is only tagged, not moved
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'named.db'}")
    named = tracking.make_sink(_cfg(here), here / "eval", "eval", parent_of=train_root / "train" / "model")
    named.finish()
    assert named.uri == f"sqlite:///{tmp_path / 'named.db'}" and "mlflow.parentRunId" not in \
        _client(named.uri).get_run(named.run_id).data.tags

def test_system_metrics_are_sampled_beside_the_run(tmp_path, monkeypatch):
    import mlflow

    mlflow.set_system_metrics_sampling_interval(0.2)
    mlflow.set_system_metrics_samples_before_logging(1)
    try:
        (tmp_path / "r").mkdir()
        sink = tracking.make_sink(_cfg(tmp_path, "tracking.system_metrics=true"), tmp_path / "r", "r")
        client = _client(sink.uri)
        from tests.waiting import wait_until

        wait_until(lambda: any(k.startswith("system/") for k in client.get_run(sink.run_id).data.metrics), 30.0,
                   lambda: f"no system/* metric in {sorted(client.get_run(sink.run_id).data.metrics)}", poll_s=0.1)
        sink.finish()
    finally:
        mlflow.set_system_metrics_sampling_interval(None)
        mlflow.set_system_metrics_samples_before_logging(None)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from sonar.actors.model import materialise_policy
    from sonar.actors.world import build_world

    cfg = load_config([], [])
    return materialise_policy(cfg.model, build_world(cfg.world), tmp_path_factory.mktemp("policy"))


def test_final_policy_is_a_registered_transformers_model_with_eval_and_config(tmp_path, policy_dir, caplog):
    import logging

    import mlflow

    (tmp_path / "r").mkdir()
    sink = tracking.make_sink(_cfg(tmp_path, "tracking.registered_model_name=sonar-policy"), tmp_path / "r", "r")
    table = {"after_search": {"n": 12, "em": 0.75, "f1": 0.8}}
    mlflow_said: list[str] = []
    seen = logging.Handler(logging.DEBUG)  # MLflow's loggers do not propagate: listen on the logger itself
    seen.emit = lambda record: mlflow_said.append(record.getMessage())
    logging.getLogger("mlflow.transformers").addHandler(seen)
    try:
        with caplog.at_level(logging.INFO):
            uri = sink.log_model(policy_dir, eval_table=table, config={"run": {"name": "tiny"}})
    finally:
        logging.getLogger("mlflow.transformers").removeHandler(seen)
    # MLflow's Hub lookup of a local folder (model card, license) warns about nothing real: dropped, and
    # Sonar's one line says what the model carries
    assert not [m for m in mlflow_said if m.startswith(tracking.HUB_LOOKUP_WARNINGS)], mlflow_said
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("final policy logged as a local folder: no Hugging Face model card") for m in said)
    assert not logging.getLogger("mlflow.transformers").filters  # the filter is gone afterwards
    sink.finish()
    assert uri == "models:/sonar-policy/1"
    client = _client(sink.uri)
    mv = client.get_model_version("sonar-policy", "1")
    assert mv.run_id == sink.run_id and mv.tags["sonar.run_id"] == sink.run_id
    assert "| after_search | 0.75 | 0.8 | 12 |" in mv.description
    mlflow.set_tracking_uri(sink.uri)
    info = mlflow.models.get_model_info(uri)
    assert set(info.flavors) >= {"transformers", "python_function"}
    assert info.flavors["transformers"]["task"] == "text-generation"
    assert info.metadata == {"sonar_eval": table, "sonar_config": {"run": {"name": "tiny"}}}
    # the logged model's metrics are the evaluation, not system samples
    got = {m.key: m.value for m in client.get_logged_model(info.model_id).metrics}
    assert got == {"eval/after_search/questions": 12.0, "eval/after_search/em": 0.75, "eval/after_search/f1": 0.8}


def test_an_empty_registered_name_logs_without_registering(tmp_path, policy_dir):
    (tmp_path / "r").mkdir()
    sink = tracking.make_sink(_cfg(tmp_path), tmp_path / "r", "r")
    uri = sink.log_model(policy_dir)
    sink.finish()
    assert uri.startswith("models:/m-") and _client(sink.uri).search_registered_models() == []


# -- Ray's dashboard -----------------------------------------------------------------------------------

class FakeMetric:
    made: list = []

    def __init__(self, name, description="", tag_keys=None):
        self.name, self.values = name, []
        FakeMetric.made.append(self)

    def set(self, value, tags=None):
        self.values.append(value)

    def inc(self, value=1.0, tags=None):
        self.values.append(value)


class FakeMetrics:
    Gauge = Counter = FakeMetric


def test_key_metrics_reach_ray_gauges_once_ray_is_up():
    FakeMetric.made = []
    up = []
    sink = tracking.RayDashboardSink(tracking.NullSink(), FakeMetrics, ray_ready=lambda: bool(up))
    sink.log_metrics({K.LEARNER_REWARD_MEAN: 0.5}, step=1)  # before ray.init: nothing made
    assert FakeMetric.made == []
    up.append(True)
    sink.log_metrics({K.LEARNER_REWARD_MEAN: 0.25, K.REPLAY_DEPTH: 3, K.LEARNER_POLICY_LAG_MAX: 2,
                      K.LEARNER_TOKENS_PER_S: 900.0, K.LEARNER_VERSION: 7, "stage": 1, K.LEARNER_LOSS: 9.0}, step=2)
    sink.log_metrics({K.LEARNER_REWARD_MEAN: float("nan")}, step=3)  # NaN is not exported
    by_name = {m.name: m.values for m in FakeMetric.made}
    assert by_name == {"sonar_reward_mean": [0.25], "sonar_replay_depth": [3.0], "sonar_policy_lag_max": [2.0],
                       "sonar_learner_tokens_per_s": [900.0], "sonar_learner_version": [7.0],
                       "sonar_rollout_tokens_per_s": [], "sonar_step": [2.0, 3.0], "sonar_rows_logged": [1.0, 1.0]}


def test_a_failing_metrics_backend_never_stops_the_run():
    class Broken:
        def Gauge(*a, **k):
            raise RuntimeError("no metrics agent")

        Counter = Gauge

    sink = tracking.RayDashboardSink(tracking.NullSink(), Broken)
    sink.log_metrics({K.LEARNER_REWARD_MEAN: 1.0}, step=1)
    sink.log_metrics({K.LEARNER_REWARD_MEAN: 1.0}, step=2)
    assert sink._broken


@pytest.mark.ray
def test_real_ray_gauges_are_created_and_set_in_a_local_driver(shared_ray):
    """This process as a Ray driver: a job on the session's cluster (tests/ray_job.py)."""
    with ray_for_module(__name__, shared_ray) as ray:
        tags = {}

        class Tags(tracking.NullSink):
            def set_tags(self, t):
                tags.update(t)

        sink = tracking.RayDashboardSink(Tags())
        sink.log_metrics({K.REPLAY_DEPTH: 4, K.LEARNER_REWARD_MEAN: 0.5}, step=3)
        import ray.util.metrics as M

        assert not sink._broken and isinstance(sink.gauges[K.REPLAY_DEPTH], M.Gauge)
        assert sink.gauges[K.REPLAY_DEPTH].info["name"] == "sonar_replay_depth"
        assert isinstance(sink.counter, M.Counter)
        assert tags["ray.job_id"] == ray.get_runtime_context().get_job_id()


def test_the_training_and_evaluation_files_are_the_runs_mlflow_inputs(tmp_path):
    """Issue 55: the dataset files a run reads are listed on its MLflow page (inputs, with their context and a
    content digest), not only buried in its params."""
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text('{"question": "q", "golds": ["a"]}\n')
    dev.write_text('{"question": "r", "golds": ["b"]}\n')
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "d1", "title": "a", "text": "a is the answer"}\n')
    cfg = _cfg(tmp_path, f"stages.0.data={train}", f"eval.data=[{dev}]", f"retrieval.corpus={corpus}")
    files = tracking.data_files(cfg)
    assert [(f.name, f.context) for f in files] == [("stages[0].data[0]", "training"), ("eval.data[0]", "evaluation")]
    (tmp_path / "r").mkdir()
    sink = tracking.make_sink(cfg, tmp_path / "r", "r")
    sink.log_inputs(files)
    sink.finish()
    inputs = _client(sink.uri).get_run(sink.run_id).inputs.dataset_inputs
    got = {(i.dataset.name, [t.value for t in i.tags if t.key == "mlflow.data.context"][0], i.dataset.digest,
            json.loads(i.dataset.source)["uri"]) for i in inputs}
    assert got == {("stages[0].data[0]", "training", tracking.file_digest(str(train)), str(train)),
                   ("eval.data[0]", "evaluation", tracking.file_digest(str(dev)), str(dev))}
    assert len(tracking.file_digest(str(train))) == 16 and tracking.file_digest(str(tmp_path / "gone")) == ""
