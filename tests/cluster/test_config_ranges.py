"""Every numeric config field has its valid range checked at load (issue 14, "refuse at load").

``BAD`` holds, for each numeric field of the schema, values outside its range; each must be refused by
``load_config`` with a ValueError naming the dotted field and the value. The table is complete: a
numeric field (found by walking the dataclasses) without a row fails ``test_the_table_covers_every_numeric_field``,
so a new field cannot land without a range check.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest

from sonar.cluster.wire import config as C
from sonar.cluster.wire.config import Config, load_config

# field -> bad values: a raw override value (the message must hold ``<field>=<value as the field's type>``),
# or (raw, expected substring) for list fields, whose message names the element.
BAD: dict[str, list] = {
    "run.seed": ["-1"],
    "run.checkpoint_every": ["-1"],
    "run.keep_checkpoints": ["-1"],
    "run.log_every": ["0", "-3"],
    "world.seed": ["-1"],
    "world.num_entities": ["0", "17"],
    "world.heldout_fraction": ["0", "1", "nan", "-0.1"],
    "world.num_heldout_eval": ["-1"],
    "world.parallel_share": ["1", "-0.1", "nan"],
    "model.hidden_size": ["0"],
    "model.num_layers": ["0"],
    "model.num_heads": ["0", "-4"],
    "model.intermediate_size": ["0"],
    "model.max_position_embeddings": ["0"],
    "model.seed": ["-1"],
    "protocol.max_turns": ["-1"],
    "protocol.max_queries_per_step": ["0"],
    "protocol.docs_per_query": ["0"],
    "protocol.max_new_tokens_per_turn": ["0"],
    "protocol.max_total_tokens": ["0", "-512"],
    "protocol.max_doc_tokens": ["0"],
    "protocol.visit_max_calls": ["0"], "protocol.visit_max_tokens": ["0"],
    "retrieval.http.timeout_s": ["0"], "retrieval.http.max_batch": ["0"],
    "retrieval.k": ["0"],
    "retrieval.rerank_candidates": ["0"],
    "retrieval.cache_size": ["-1"],
    "retrieval.max_query_chars": ["0"],
    "retrieval.timeout_s": ["0", "-1", "nan", "inf"],
    "retrieval.max_retries": ["-1"],
    "retrieval.backoff_s": ["-0.1", "nan"],
    "retrieval.breaker_failures": ["0"],
    "retrieval.breaker_reset_s": ["-1", "inf"],
    "retrieval.replicas": ["0"], "retrieval.num_cpus_per_replica": ["-1"],
    "retrieval.batch_window_ms": ["-1", "nan"],
    "retrieval.max_batch": ["0"],
    "retrieval.max_concurrency": ["0"],
    "retrieval.elastic.request_timeout_s": ["0", "nan"],
    "retrieval.elastic.bm25_k1": ["-0.5", "inf"],
    "retrieval.elastic.bm25_b": ["-0.1", "1.5", "nan"],
    "retrieval.elastic.title_boost": ["0", "nan"],
    "retrieval.elastic.shards": ["0"],
    "retrieval.elastic.replicas": ["-1"],
    "retrieval.elastic.bulk_batch_size": ["0"],
    "rollout.num_workers": ["0"],
    "rollout.group_size": ["0"],
    "rollout.groups_per_request": ["0"],
    "rollout.batches_in_flight": ["0"],
    "rollout.temperature": ["-1", "nan", "inf"],
    "rollout.top_p": ["0", "1.01", "nan"],
    "rollout.max_batch_rows": ["0"],
    "rollout.num_cpus_per_worker": ["-1", "nan"],
    "rollout.num_gpus_per_worker": ["-1", "inf"],
    "rollout.tensor_parallel_size": ["0"],
    "rollout.vllm_kv_cache_gib": ["-1", "inf"],
    "rollout.vllm_gpu_memory_utilization": ["0", "1.5", "nan"],
    "learner.weight_decay": ["-0.01", "nan"],
    "learner.betas": [("[0.9, 1.0]", "learner.betas[1]=1.0"), ("[-0.1, 0.99]", "learner.betas[0]=-0.1"),
                      ("[nan, 0.99]", "learner.betas[0]=nan")],
    "learner.warmup_steps": ["-1"],
    "learner.grad_clip": ["-1", "nan", "inf"],
    "learner.zero_stage": ["-1", "4"],
    "learner.groups_per_step": ["0"],
    "learner.micro_batch_tokens": ["0", "-8192"],
    "learner.logits_chunk_tokens": ["-1"],
    "learner.broadcast_every": ["0"],
    "learner.num_gpus": ["-1", "nan"],
    "learner.num_cpus": ["-1", "inf"],
    "learner.num_ranks": ["0", "-2"],
    "critic.lr": ["0", "-1", "nan"],
    "critic.gamma": ["-0.1", "1.1", "nan"],
    "critic.lam": ["-0.1", "1.1", "nan"],
    "critic.value_clip": ["-0.5", "nan"],
    "critic.warmup_steps": ["-1"],
    "replay.capacity_groups": ["0"],
    "replay.max_policy_lag": ["-1"],
    "replay.stale_downweight": ["-0.5", "1.5", "nan"],
    "replay.max_inflight_groups": ["-2"],
    "stages.N.steps": ["-1"],
    "stages.N.lr": ["0", "-1", "nan", "inf"],
    "stages.N.batch_size": ["0"],
    "stages.N.difficulty": [("[-0.1, 1.0]", "stages[0].difficulty[0]=-0.1"),
                            ("[0.0, 1.5]", "stages[0].difficulty[1]=1.5"),
                            ("[0.0, nan]", "stages[0].difficulty[1]=nan")],
    "stages.N.reward.format_weight": ["-0.1", "nan"],
    "stages.N.reward.format_penalty": ["0.5", "-inf"],
    "stages.N.algo.clip_low": ["-0.1", "1", "nan"],
    "stages.N.algo.clip_high": ["-0.1", "nan"],
    "stages.N.algo.loss_norm_const": ["0", "nan"],
    "stages.N.algo.kl_coef": ["-0.001", "nan"],
    "stages.N.algo.entropy_coef": ["-0.001", "nan"],
    "stages.N.algo.kl_clamp": ["0", "-10", "nan"],
    "stages.N.algo.dual_clip": ["1", "0.5", "nan"],
    "stages.N.algo.tis_cap": ["0", "nan"],
    "stages.N.algo.vtrace_rho_bar": ["0", "inf"],
    "stages.N.algo.vtrace_c_bar": ["0", "nan"],
    "stages.N.algo.ppo_epochs": ["0"],
    "stages.N.algo.mini_batches": ["0"],
    "eval.batch_size": ["0", "-1"],
    "rollout.min_workers": ["0"],
    "rollout.max_workers": ["0"],
    "rollout.pool_window_s": ["0", "nan"],
    "rollout.pool_grow_wait_share": ["0", "1.5"],
    "rollout.pool_shrink_full_share": ["0", "1.5"],
    "rollout.pool_cooldown_s": ["-1", "inf"],
    "cluster.num_cpus": ["0"],
    "cluster.max_worker_restarts": ["-1"],
    "cluster.max_replica_restarts": ["-1"],
    "cluster.max_replica_replacements": ["-1"],
    "cluster.retrieval_wait_s": ["0", "nan"],
    "cluster.auto_resume": ["-1"],
    "cluster.health_timeout_s": ["0", "nan"],
    "cluster.step_timeout_s": ["0", "-1", "inf"],
    "cluster.broadcast_timeout_s": ["0", "-5", "inf"],
    "cluster.gpu_memory_gib": ["0", "-80", "nan", "inf"],
}


def _numeric_fields(cls=Config, prefix: str = "") -> dict[str, type]:
    """Dotted key -> scalar type (int or float) of every numeric field: int, float, Optional of one,
    or a list of one; a list of dataclasses (``stages``) is walked as ``stages.N.``."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if dataclasses.is_dataclass(t):
            out.update(_numeric_fields(t, f"{prefix}{f.name}."))
        elif typing.get_origin(t) in (list, typing.List) and args and dataclasses.is_dataclass(args[0]):
            out.update(_numeric_fields(args[0], f"{prefix}{f.name}.N."))
        elif t in (int, float):
            out[prefix + f.name] = t
        elif typing.get_origin(t) is typing.Union and len(args) == 1 and args[0] in (int, float):
            out[prefix + f.name] = args[0]
        elif typing.get_origin(t) in (list, typing.List) and args and args[0] in (int, float):
            out[prefix + f.name] = args[0]
    return out


NUMERIC = _numeric_fields()


def test_the_walk_finds_the_schema_numeric_fields():
    assert len(NUMERIC) > 80
    assert NUMERIC["run.log_every"] is int and NUMERIC["stages.N.lr"] is float
    assert NUMERIC["learner.betas"] is float and NUMERIC["cluster.num_cpus"] is int  # list, Optional
    assert "model.tie_word_embeddings" not in NUMERIC  # a bool is not a number here


def test_the_table_covers_every_numeric_field():
    missing = sorted(set(NUMERIC) - set(BAD))
    assert not missing, (f"numeric config fields without a bad-value row in {__file__}::BAD (add the field's "
                         f"range to config.RANGES and a row here): {missing}")
    stale = sorted(set(BAD) - set(NUMERIC))
    assert not stale, f"rows for fields the schema no longer has: {stale}"


def test_every_numeric_field_has_a_declared_range():
    assert sorted(set(NUMERIC) - set(C.RANGES)) == [], "numeric fields without a range in config.RANGES"
    assert sorted(set(C.RANGES) - set(NUMERIC)) == [], "config.RANGES rows for fields the schema lacks"


def _cases():
    for key, values in BAD.items():
        for v in values:
            raw, expected = v if isinstance(v, tuple) else (v, None)
            yield pytest.param(key, raw, expected, id=f"{key}={raw}")


def _shown(key: str, raw: str) -> str:
    """``<dotted field>=<value>`` as the error prints it (stage fields as ``stages[0].x``)."""
    path = key.replace("stages.N.", "stages[0].")
    value = float(raw) if NUMERIC[key] is float else int(raw)
    return f"{path}={value}"


@pytest.mark.parametrize("key, raw, expected", list(_cases()))
def test_an_out_of_range_value_is_refused_naming_the_field_and_value(key, raw, expected):
    override = f"{key.replace('stages.N.', 'stages.0.')}={raw}"
    with pytest.raises(ValueError) as e:
        load_config([], [override])
    assert (expected or _shown(key, raw)) in str(e.value), (override, str(e.value))


@pytest.mark.parametrize("overrides", [
    ["run.checkpoint_every=0"], ["retrieval.cache_size=0"], ["learner.grad_clip=0"], ["learner.weight_decay=0"],
    ["learner.warmup_steps=0"], ["learner.zero_stage=3"], ["critic.gamma=1", "critic.lam=0"],
    ["rollout.top_p=1"], ["rollout.vllm_gpu_memory_utilization=1"], ["retrieval.elastic.bm25_b=1"],
    ["cluster.num_cpus=null"], ["cluster.num_cpus=1"], ["world.num_entities=18"], ["protocol.max_turns=0"],
    ["replay.max_inflight_groups=-1"], ["stages.0.reward.format_penalty=0"], ["stages.0.algo.clip_low=0"],
    ["stages.0.difficulty=[0.0, 0.0]"], ["learner.betas=[0.0, 0.999]"], ["retrieval.backoff_s=0"],
])
def test_values_on_the_boundary_of_their_range_load(overrides):
    load_config([], overrides)


def test_world_minimum_matches_the_world_builder():
    """``world.num_entities`` >= 18 in RANGES is the world's own minimum (the wire imports no actors)."""
    from sonar.actors.world import _MIN_PER_KIND

    assert C.RANGES["world.num_entities"] == f">= {sum(_MIN_PER_KIND.values())}"


def test_a_float_without_a_declared_range_must_still_be_finite():
    @dataclasses.dataclass(frozen=True)
    class X:
        a: float = 1.0
        n: int = -5  # no range declared: any integer

    C._check_ranges(X())
    with pytest.raises(ValueError, match=r"^a=nan must be a finite number$"):
        C._check_ranges(X(a=math.nan))


@pytest.mark.parametrize("spec, ok, bad", [
    (">= 1", [1, 2.5], [0.999, 0]),
    ("> 0", [1e-12], [0, -1]),
    ("<= 0", [0, -3], [1e-9]),
    ("[0, 1)", [0, 0.5], [1, -1e-9]),
    ("(0, 1]", [1, 1e-9], [0, 1.1]),
    ("[0, 3]", [0, 3], [-1, 4]),
])
def test_range_specs_parse_to_their_intervals(monkeypatch, spec, ok, bad):
    monkeypatch.setitem(C.RANGES, "x", spec)
    monkeypatch.setitem(C._PARSED_RANGES, "x", C._parse_range(spec))
    for v in ok:
        C._check_range("x", "x", v)
    for v in bad:
        with pytest.raises(ValueError, match=rf"^x={v} must be (in )?{re.escape(spec)}$"):
            C._check_range("x", "x", v)


# -- YAML files: every way a file can be wrong is one line of ConfigError naming the file ----------------

def _bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name, text, expected", [
    ("object.yaml", "learner: !!python/object/apply:os.system ['echo pwned']\n", "python/object"),
    ("syntax.yaml", "learner: [1, 2\n  x: :\n", "invalid YAML (line 2"),
    ("list.yaml", "- run\n- learner\n", "top level must be a mapping"),
    ("bomb.yaml", _bomb(), "alias"),
    ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000 + "\n", "invalid YAML"),
    ("binary.yaml", b"run:\n  name: \xff\xfe\n", "cannot read"),
])
def test_a_bad_yaml_file_is_one_line_naming_the_file(tmp_path, monkeypatch, name, text, expected):
    monkeypatch.setenv("OMEGACONF_MAX_YAML_EXPANDED_NODES", "none")  # the bound is Sonar's, not the env's
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(C.ConfigError) as e:
        load_config([p])
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and expected in msg and "\n" not in msg, msg


def test_a_missing_file_is_one_line_naming_it(tmp_path):
    with pytest.raises(C.ConfigError) as e:
        load_config([tmp_path / "nope.yaml"])
    msg = str(e.value)
    assert msg.startswith(f"config '{tmp_path / 'nope.yaml'}': no such file") and "\n" not in msg, msg


def test_a_python_tag_runs_no_code(tmp_path):
    marker = tmp_path / "ran"
    p = tmp_path / "evil.yaml"
    p.write_text(f"run:\n  name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(C.ConfigError):
        load_config([p])
    assert not marker.exists()


def test_an_empty_file_is_no_override(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert load_config([p]) == load_config([])


@pytest.mark.parametrize("name, text, overrides, expected", [
    ("bomb.yaml", _bomb(), [], "alias"),
    ("list.yaml", "- 1\n", [], "top level must be a mapping"),
    ("ok.yaml", "run:\n  log_every: 1\n", ["run.log_every=0"], "run.log_every=0 must be >= 1"),
    ("ok.yaml", "run:\n  log_every: 1\n", ["stages.0.lr=[1, 2"], "not valid YAML"),
])
def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys, monkeypatch, name, text, overrides, expected):
    from sonar.cluster.driver import cli

    monkeypatch.setattr(cli, "_sigterm_as_interrupt", lambda: None)  # keep pytest's own signal handling
    monkeypatch.setattr(cli, "_env_defaults", lambda: None)  # and its environment
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--config", str(p), *overrides])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sonar: config error: ") and expected in err, err
