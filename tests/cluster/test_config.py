import re
import pytest

from sonar.cluster.wire.config import DEFAULT_CONFIG, CONFIG_DIR, Config, ConfigError, flatten, inflight_budget, load_config, to_dict


def test_default_config_loads_and_is_frozen():
    cfg = load_config([DEFAULT_CONFIG])
    assert isinstance(cfg, Config)
    with pytest.raises(Exception):
        cfg.learner.grad_clip = 1.0  # frozen dataclasses travel, never a mutable DictConfig


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path, tmp_path):
    """A benchmark config (configs/bench.yaml) adds a ``sim:`` section that only the benchmarks read.
    A config naming a model directory this machine lacks (configs/gpu.yaml) is loaded with a stand-in
    directory: a vLLM config checks the directory at load."""
    import json

    import yaml

    raw = yaml.safe_load(path.read_text()) or {}
    overrides = []
    model_path = (raw.get("model") or {}).get("path")
    if model_path and not (Path(model_path) / "config.json").is_file():
        (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (tmp_path / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
        overrides = [f"model.path={tmp_path}"]
    if "sim" in raw:
        from sonar.bench.sim.config import load_bench_config

        load_bench_config([path], overrides)
    else:
        load_config([path], overrides, notes=[])  # gpu.yaml's dataset files live on the cluster's storage


def test_dotlist_overrides_apply():
    cfg = load_config([], ["stages.0.lr=0.001", "rollout.num_workers=3", "stages.0.steps=7"])
    assert cfg.stages[0].lr == 0.001 and cfg.rollout.num_workers == 3 and cfg.stages[0].steps == 7


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigError, match="lernr"):
        load_config([], ["lernr.lr=1"])


def test_wrong_type_names_the_key_and_value():
    with pytest.raises(ConfigError, match="learner.grad_clip"):
        load_config([], ["learner.grad_clip=fast"])


@pytest.mark.parametrize("where", ["cli", "yaml"])
def test_learner_lr_is_refused_naming_the_key(tmp_path, where):
    """A stage's ``lr`` is the one source of the learning rate; ``learner.lr`` (once a seed that every
    stage overwrote) must fail loudly rather than be silently ignored."""
    p = tmp_path / "old.yaml"
    p.write_text("learner:\n  lr: 3.0e-4\n")
    with pytest.raises(ConfigError, match="learner.lr"):
        load_config([], ["learner.lr=3e-4"]) if where == "cli" else load_config([p])


def test_stage_lr_must_be_positive():
    with pytest.raises(ValueError, match=r"stages\[1\]\.lr=0.0"):
        load_config([], ["stages=[{kind: sft}, {kind: rl, lr: 0.0}]"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config([tmp_path / "nope.yaml"])


def test_unknown_key_in_yaml_names_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("learner:\n  lrr: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*lrr"):
        load_config([p])


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        load_config([], ["learner.grad_clip"])


@pytest.mark.parametrize("overrides, fields", [
    (["replay.capacity_groups=2", "learner.groups_per_step=4"], ["replay.capacity_groups=2", "learner.groups_per_step=4"]),
    (["protocol.name=bogus"], ["protocol.name='bogus'"]),
    (["stages.0.algo.name=dr_grpo", "stages.0.algo.std_normalize=true"], ["dr_grpo", "std_normalize=True"]),
    (["rollout.group_size=1"], ["rollout.group_size", "1"]),
    (["learner.broadcast_every=5", "replay.max_policy_lag=1"], ["learner.broadcast_every=5", "replay.max_policy_lag+1=2"]),
    (["retrieval.rerank=dense", "retrieval.k=5", "retrieval.rerank_candidates=3"], ["rerank_candidates=3", "retrieval.k=5"]),
])
def test_impossible_combinations_name_both_fields(overrides, fields):
    with pytest.raises(ValueError) as e:
        load_config([], overrides)
    for f in fields:
        assert f in str(e.value)


def test_flatten_for_mlflow_params():
    flat = flatten(to_dict(load_config([])))
    assert flat["stages.0.lr"] == str(load_config([]).stages[0].lr)
    assert "stages.0.algo.name" in flat


def test_credentials_in_urls_never_reach_mlflow_params():
    cfg = load_config([], ["tracking.uri=https://alice:s3cret@mlflow.example:5000",
                           "retrieval.elastic.hosts=[https://bob:hunter2@es.example:9200]"])
    flat = flatten(to_dict(cfg))
    text = " ".join(flat.values())
    assert "s3cret" not in text and "hunter2" not in text and "alice" not in text
    assert flat["tracking.uri"] == "https://***@mlflow.example:5000"


def test_saved_config_redacts_url_credentials():
    from sonar.cluster.wire.config import to_yaml

    text = to_yaml(load_config([], ["tracking.uri=https://alice:s3cret@mlflow.example:5000"]))
    assert "s3cret" not in text and "https://***@mlflow.example:5000" in text


# -- replay.max_inflight_groups (async admission budget) ------------------------------------------

_BASE = ["replay.max_policy_lag=2", "learner.groups_per_step=3", "replay.capacity_groups=8",
         "rollout.groups_per_request=2"]


@pytest.mark.parametrize("overrides, budget", [
    (["cluster.mode=async"], 9),  # default -1: (max_policy_lag + 1) * groups_per_step
    (["cluster.mode=async", "replay.max_inflight_groups=-1"], 9),
    (["cluster.mode=async", "replay.max_policy_lag=0", "learner.broadcast_every=1"], 3),
    (["cluster.mode=async", "replay.max_policy_lag=4", "learner.groups_per_step=5"], 25),
    (["cluster.mode=async", "replay.max_inflight_groups=0"], 0),  # unlimited stays unlimited
    (["cluster.mode=async", "replay.max_inflight_groups=3"], 3),  # positive: as is
    (["cluster.mode=async", "replay.max_inflight_groups=40"], 40),
    (["cluster.mode=sync"], 0),  # sync mode is never gated
    (["cluster.mode=sync", "replay.max_inflight_groups=5"], 0),
    (["cluster.mode=sync", "replay.max_inflight_groups=0"], 0),
])
def test_inflight_budget_resolves(overrides, budget):
    cfg = load_config([], _BASE + overrides)
    assert inflight_budget(cfg) == budget


def test_inflight_budget_default_is_auto():
    cfg = load_config([DEFAULT_CONFIG])
    assert cfg.replay.max_inflight_groups == -1 and cfg.cluster.mode == "async"
    assert inflight_budget(cfg) == (cfg.replay.max_policy_lag + 1) * cfg.learner.groups_per_step


@pytest.mark.parametrize("value, others", [
    (-2, []),
    (-100, []),
    (1, []),  # < learner.groups_per_step=3
    (2, []),
    (3, ["rollout.groups_per_request=4"]),  # >= groups_per_step but < groups_per_request
    (-2, ["cluster.mode=sync"]),  # checked in sync mode too
])
def test_invalid_inflight_budget_names_the_key_and_value(value, others):
    with pytest.raises(ValueError) as e:
        load_config([], _BASE + others + [f"replay.max_inflight_groups={value}"])
    assert f"replay.max_inflight_groups={value}" in str(e.value)


@pytest.mark.parametrize("value, others", [
    (-1, []), (0, []), (3, []), (4, ["rollout.groups_per_request=4"]), (100, []),
])
def test_valid_inflight_budgets_load(value, others):
    cfg = load_config([], _BASE + others + [f"replay.max_inflight_groups={value}"])
    assert cfg.replay.max_inflight_groups == value


def test_invalid_inflight_budget_message_names_the_bound():
    with pytest.raises(ValueError) as e:
        load_config([], _BASE + ["rollout.groups_per_request=4", "replay.max_inflight_groups=3"])
    msg = str(e.value)
    assert "learner.groups_per_step=3" in msg and "rollout.groups_per_request=4" in msg


def test_auto_inflight_budget_is_never_below_one_request():
    from sonar.cluster.wire.config import inflight_budget

    ov = ["replay.max_policy_lag=0", "learner.groups_per_step=1", "replay.capacity_groups=1",
          "rollout.groups_per_request=4"]
    assert inflight_budget(load_config([], ov)) == 4
    assert inflight_budget(load_config([], ov + ["rollout.groups_per_request=1"])) == 1


# -- the schema itself: every field documented and read; one check per section -------------------

import ast  # noqa: E402
import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import sonar.cluster.wire.config as config_module  # noqa: E402

_CONFIG_SRC = Path(config_module.__file__)
_ROOT = _CONFIG_SRC.parents[2]
_PRODUCTION = ("actors", "learner", "retrieval", "cluster")


def _dataclass_fields(tree: ast.Module):
    """(class name, field name, docstring or None) for every field of every dataclass in the module."""
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            continue
        body = node.body
        for i, st in enumerate(body):
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = (nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                       and isinstance(nxt.value.value, str) else None)
                yield node.name, st.target.id, doc


def test_every_config_field_has_a_docstring():
    fields = list(_dataclass_fields(ast.parse(_CONFIG_SRC.read_text())))
    assert len(fields) > 100  # the parser found the schema
    missing = [f"{c}.{f}" for c, f, doc in fields if doc is None or not doc.strip()]
    assert not missing, f"config fields without a docstring (write one under each field): {missing}"


def test_the_docstring_check_sees_a_missing_docstring():
    src = "from dataclasses import dataclass\n@dataclass(frozen=True)\nclass A:\n    x: int = 1\n    y: int = 2\n    \"\"\"y.\"\"\"\n"
    assert [(f, d) for _, f, d in _dataclass_fields(ast.parse(src))] == [("x", None), ("y", "y.")]


def test_every_config_field_is_read_somewhere():
    """A field nobody reads is a setting that does nothing. Heuristic: some production module outside
    config.py accesses an attribute of that name (a common name such as ``seed`` can hide a dead field;
    a distinctive one cannot)."""
    read: set[str] = set()
    for pkg in _PRODUCTION:
        for path in (_ROOT / pkg).rglob("*.py"):
            if path != _CONFIG_SRC:
                read |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
    body = ast.parse(_CONFIG_SRC.read_text()).body
    methods = [m for c in body if isinstance(c, ast.ClassDef) for m in c.body]  # (ClusterConfig.broadcast_timeout)
    for fn in body + methods:  # config.py's own resolvers (inflight_budget) count;
        if isinstance(fn, ast.FunctionDef) and not (fn.name == "validate" or fn.name.startswith("_check")):
            read |= {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}  # its checks do not
    unread = [f"{c}.{f}" for c, f, _ in _dataclass_fields(ast.parse(_CONFIG_SRC.read_text())) if f not in read]
    assert not unread, f"config fields no production code reads: {unread}"


def test_validate_has_one_check_per_section_and_calls_each():
    tree = ast.parse(_CONFIG_SRC.read_text())
    validate = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "validate")
    called = {n.func.id for n in ast.walk(validate) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    # tracking: no constraint; world: only its fields' ranges (declared beside each field, checked by
    # _check_ranges), nothing that relates two values
    sections = [f.name for f in dataclasses.fields(Config) if f.name not in ("tracking", "world")]
    for name in sections:
        check = f"_check_{name}"
        assert callable(getattr(config_module, check, None)), f"no {check}()"
        assert check in called, f"validate() does not call {check}()"


@pytest.mark.parametrize("overrides, fields", [
    (["retrieval.replicas=0"], ["retrieval.replicas=0", ">= 1"]),
    (["retrieval.replicas=-1"], ["retrieval.replicas=-1"]),
    (["retrieval.timeout_s=0"], ["retrieval.timeout_s=0"]),
    (["rollout.top_p=0"], ["rollout.top_p=0"]),
    (["rollout.top_p=1.5"], ["rollout.top_p=1.5"]),
    (["rollout.temperature=0"], ["stages[0].kind='rl'", "rollout.temperature=0"]),
    (["model.hidden_size=130", "model.num_heads=4"], ["model.hidden_size=130", "model.num_heads=4"]),
    (["replay.stale_policy=downweight", "replay.stale_downweight=0"], ["replay.stale_downweight=0", "downweight"]),
    (["replay.stale_policy=downweight", "replay.stale_downweight=1.5"], ["replay.stale_downweight=1.5"]),
    (["eval.batch_size=0"], ["eval.batch_size=0"]),
    (["run.log_every=0"], ["run.log_every=0"]),
    (["run.checkpoint_every=-1"], ["run.checkpoint_every=-1"]),
])
def test_out_of_range_values_name_the_field_and_value(overrides, fields):
    with pytest.raises(ValueError) as e:
        load_config([], overrides)
    for f in fields:
        assert f in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["retrieval.replicas=1"], ["retrieval.replicas=3"], ["rollout.top_p=1.0"], ["rollout.top_p=0.9"],
    ["rollout.temperature=0", "stages.0.kind=sft"],  # greedy is fine without an RL stage
    ["rollout.temperature=0", "stages.0.steps=0"],
    ["model.hidden_size=130", "model.num_heads=4", "model.path=org/hf-model", "world.force=true"],  # the tiny-model shape is unused (a Hub id: read at start)
    ["replay.stale_downweight=0"],  # only read with stale_policy=downweight
])
def test_in_range_values_load(overrides):
    load_config([], overrides)


OWN = Path(__file__).resolve().parents[2] / "examples" / "own_data"
HOTPOT = str(OWN / "hotpot_mini.json")
CORPUS = str(OWN / "hotpot_mini_corpus.jsonl")


def test_stage_data_takes_one_path_or_a_list_in_yaml_and_on_the_command_line(tmp_path):
    """``stages.N.data`` is read now (it was removed last round as unread): one path or a list, from a
    YAML file or the command line, with its format."""
    one = load_config([], [f"stages.0.data={HOTPOT}", f"retrieval.corpus={CORPUS}", "stages.0.format=hotpotqa",
                           f"eval.data={HOTPOT}"])
    assert one.stages[0].data == HOTPOT and one.stages[0].format == "hotpotqa"
    many = load_config([], [f"stages.0.data=[{HOTPOT}, {OWN / 'hotpot_mini_dev.json'}]", f"retrieval.corpus={CORPUS}",
                            f"eval.data={HOTPOT}"])
    assert many.stages[0].data == [HOTPOT, str(OWN / "hotpot_mini_dev.json")]
    y = tmp_path / "files.yaml"
    y.write_text(f"retrieval:\n  corpus: {CORPUS}\neval:\n  data: {HOTPOT}\nstages:\n  - kind: rl\n    data: [{HOTPOT}]\n")
    cfg = load_config([y])
    assert cfg.stages[0].data == [HOTPOT] and cfg.eval.data == HOTPOT and cfg.eval.format == "auto"
    from sonar.cluster.wire.config import data_paths
    assert data_paths(cfg.stages[0].data) == data_paths(cfg.eval.data) == [HOTPOT] and data_paths(None) == []


@pytest.mark.parametrize("overrides, fields", [
    ([f"stages.0.data={HOTPOT}"], ["stages[0].data=", "retrieval.corpus=None"]),
    (["eval.data=" + HOTPOT], ["eval.data=", "retrieval.corpus=None"]),
    ([f"retrieval.corpus={CORPUS}", "stages.0.data=/no/such/file.jsonl"], ["stages[0].data[0]='/no/such/file.jsonl'",
                                                                              "no such file"]),
    ([f"retrieval.corpus={CORPUS}", "stages.0.data=[]"], ["stages[0].data=[]"]),
    ([f"retrieval.corpus={CORPUS}", f"stages.0.data={HOTPOT}", "stages.0.format=squad"], ["stages[0].format='squad'"]),
    (["eval.format=csv"], ["eval.format='csv'"]),
    ([f"retrieval.corpus={CORPUS}", f"stages.0.data={HOTPOT}", "stages.0.kind=sft"],
     ["stages[0].kind='sft'", "stages[0].data=", "gold search plan"]),
])
def test_bad_data_settings_name_the_field_and_value(overrides, fields):
    with pytest.raises(ValueError) as e:
        load_config([], overrides)
    for f in fields:
        assert f in str(e.value), (f, str(e.value))


def test_stage_data_of_the_wrong_type_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="data"):
        load_config([], ["stages.0.data={a: 1}"])


def test_the_broadcast_timeout_defaults_to_the_step_timeout_and_can_be_set_apart():
    from sonar.cluster.wire.config import load_config

    assert load_config([], ["cluster.step_timeout_s=123"]).cluster.broadcast_timeout() == 123.0
    cfg = load_config([], ["cluster.step_timeout_s=123", "cluster.broadcast_timeout_s=7.5"])
    assert cfg.cluster.broadcast_timeout() == 7.5 and cfg.cluster.step_timeout_s == 123.0


@pytest.mark.parametrize("name", ["../..", "..", ".", "a/b", "", "x\\y"])
def test_run_name_must_be_one_path_component(name):
    with pytest.raises(ValueError, match="run.name=.*must be one path component"):
        load_config([], [f"run.name={name}"])


@pytest.mark.parametrize("override", ["cluster.step_timeout_s=1e308", "retrieval.timeout_s=1e9"])
def test_a_duration_past_thirty_days_is_refused_at_load(override):
    """Issue 54, finding 8: ``cluster.step_timeout_s=1e308`` loaded and overflowed at the first ray.get."""
    with pytest.raises(ValueError, match=override.split("=")[0].replace(".", r"\.") + r"=.* past 2592000"):
        load_config([], [override])
    load_config([], [override.split("=")[0] + "=86400"])  # a day is fine


@pytest.mark.parametrize("override, sonar", [("rollout.n=8", "rollout.group_size"), ("learner.lr=1e-6", "stages.N.lr"),
                                             ("n_samples_per_prompt=4", "rollout.group_size"),
                                             ("algorithm.adv_estimator=grpo", "stages.N.algo.name")])
def test_a_veRL_or_OpenRLHF_name_is_answered_with_sonars(override, sonar):
    """Issue 55: ``rollout.n`` got a bare "Key 'n' not in 'RolloutConfig'"; one table (``PEER_NAMES``) answers."""
    from sonar.cluster.wire.config import PEER_NAMES

    with pytest.raises(ConfigError, match=rf"\(Sonar's name: {re.escape(sonar)}"):
        load_config([], [override])
    from sonar.cluster.wire.config import describe_fields

    fields = {row[0] for row in describe_fields()}
    assert {v.split(" ")[0] for v in PEER_NAMES.values()} <= fields  # every answer is a real field
