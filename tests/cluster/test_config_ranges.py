"""Every numeric config field has its valid range checked at load (issue 14, "refuse at load"), and the
range lives in one place: the field's metadata, declared beside it (``ranged(1, ge=1)`` in
``cluster/wire/config.py``; issue 25).

The cases are derived from that metadata: for every ranged field, values just outside each bound (and
NaN and inf for a float) must be refused by ``load_config`` naming the dotted field and the value, and
each inclusive bound must pass the range check. A numeric field (found by this file's own walk of the
dataclasses) without a declared range fails ``test_every_numeric_field_declares_a_range``, so a new
field cannot land without one. ``EXACT`` pins the whole message users see for several fields.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest

from sonar.cluster.wire import config as C
from sonar.cluster.wire.config import Config, load_config


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
RANGES = {key: rng for key, _, _, rng, _ in C.describe_fields() if rng is not None}
DEFAULTS = {key: default for key, _, default, _, _ in C.describe_fields()}


def test_the_walk_finds_the_schema_numeric_fields():
    assert len(NUMERIC) > 80
    assert NUMERIC["run.log_every"] is int and NUMERIC["stages.N.lr"] is float
    assert NUMERIC["learner.betas"] is float and NUMERIC["cluster.num_cpus"] is int  # list, Optional
    assert "model.tie_word_embeddings" not in NUMERIC  # a bool is not a number here


def test_every_numeric_field_declares_a_range():
    missing = sorted(set(NUMERIC) - set(RANGES))
    assert not missing, f"numeric config fields without a range (declare it: `= ranged(default, ge=...)`): {missing}"
    stray = sorted(set(RANGES) - set(NUMERIC))
    assert not stray, f"ranges on fields that are not numbers: {stray}"


def _outside(key: str) -> list:
    """Values just outside each finite bound of ``key``'s range (an open bound itself), NaN and inf."""
    rng, typ = RANGES[key], NUMERIC[key]
    step = 1 if typ is int else 0.01
    out = []
    if math.isfinite(rng.lo):
        out.append(rng.lo if rng.lo_open else rng.lo - step)
    if math.isfinite(rng.hi):
        out.append(rng.hi if rng.hi_open else rng.hi + step)
    out = [typ(v) for v in out]
    return out + ([math.nan, math.inf, -math.inf] if typ is float else [])


def _override(key: str, value) -> tuple[str, str]:
    """(``key=value`` override, the dotted path the error names) for ``value`` in ``key``; a list field
    gets its default with the first element replaced."""
    at = key.replace("stages.N.", "stages.0.")
    path = key.replace("stages.N.", "stages[0].")
    raw = repr(value) if math.isfinite(value) else str(value)  # nan / inf / -inf: OmegaConf reads them
    if isinstance(DEFAULTS[key], list):
        rest = ", ".join(repr(v) for v in DEFAULTS[key][1:])
        return f"{at}=[{raw}, {rest}]", f"{path}[0]"
    return f"{at}={raw}", path


def _cases():
    for key in RANGES:
        for v in _outside(key):
            yield pytest.param(key, v, id=f"{key}={v}")


def test_the_derived_cases_cover_both_kinds_of_bound():
    assert _outside("run.log_every") == [0]
    assert _outside("rollout.top_p")[:2] == [0.0, 1.01] and math.isnan(_outside("rollout.top_p")[2])
    assert _outside("learner.zero_stage") == [-1, 4]
    assert _outside("stages.N.reward.format_penalty")[0] == 0.01
    assert _override("learner.betas", 1.0) == ("learner.betas=[1.0, 0.99]", "learner.betas[0]")
    assert _override("stages.N.lr", math.nan) == ("stages.0.lr=nan", "stages[0].lr")


@pytest.mark.parametrize("key, value", list(_cases()))
def test_an_out_of_range_value_is_refused_naming_the_field_and_value(key, value):
    override, path = _override(key, value)
    with pytest.raises(ValueError) as e:
        load_config([], [override])
    msg = str(e.value)
    assert msg.startswith(f"{path}={value} must be ") and msg.endswith(str(RANGES[key])), (override, msg)


@pytest.mark.parametrize("key", list(RANGES))
def test_each_inclusive_bound_passes_the_range_check(key):
    rng, typ = RANGES[key], NUMERIC[key]
    bounds = [b for b, is_open in ((rng.lo, rng.lo_open), (rng.hi, rng.hi_open)) if math.isfinite(b) and not is_open]
    for b in bounds:
        C._check_range(key, rng, typ(b))


EXACT = [  # (overrides, the whole message): the wording users see
    (["run.log_every=0"], "run.log_every=0 must be >= 1"),
    (["world.num_entities=17"], "world.num_entities=17 must be >= 18"),
    (["world.heldout_fraction=1"], "world.heldout_fraction=1.0 must be in (0, 1)"),
    (["rollout.top_p=0"], "rollout.top_p=0.0 must be in (0, 1]"),
    (["retrieval.replicas=0"], "retrieval.replicas=0 must be >= 1"),
    (["learner.zero_stage=4"], "learner.zero_stage=4 must be in [0, 3]"),
    (["replay.max_inflight_groups=-2"], "replay.max_inflight_groups=-2 must be >= -1"),
    (["stages.0.lr=nan"], "stages[0].lr=nan must be a finite number > 0"),
    (["stages.0.reward.format_penalty=0.5"], "stages[0].reward.format_penalty=0.5 must be <= 0"),
    (["stages.0.algo.dual_clip=1"], "stages[0].algo.dual_clip=1.0 must be > 1"),
    (["learner.betas=[0.9, 1.0]"], "learner.betas[1]=1.0 must be in [0, 1)"),
    (["stages.0.difficulty=[0.0, 1.5]"], "stages[0].difficulty[1]=1.5 must be in [0, 1]"),
    (["cluster.gpu_memory_gib=inf"], "cluster.gpu_memory_gib=inf must be a finite number > 0"),
]


@pytest.mark.parametrize("overrides, message", EXACT, ids=[o[0] for o, _ in EXACT])
def test_the_refusal_is_the_message_users_know(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config([], overrides)
    assert str(e.value) == message


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


@pytest.mark.parametrize("overrides, message", [
    # what a range cannot say: a relation between two values, checked after the ranges
    (["stages.0.difficulty=[0.8, 0.2]"], "stages[0].difficulty=[0.8, 0.2] must be [lo, hi] with 0 <= lo <= hi <= 1"),
    (["replay.stale_policy=downweight", "replay.stale_downweight=0"],
     "replay.stale_downweight=0.0 must be in (0, 1] with replay.stale_policy='downweight'"),
    (["learner.num_gpus=2"], "learner.num_gpus=2.0 is per rank and at most 1"),
    (["model.hidden_size=130"], "model.hidden_size=130 must be a multiple of model.num_heads=4"),
])
def test_the_checks_a_range_cannot_make_still_run(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config([], overrides)
    assert str(e.value).startswith(message), str(e.value)


def test_world_minimum_matches_the_world_builder():
    """``world.num_entities`` >= 18 is the world's own minimum (the wire imports no actors)."""
    from sonar.actors.world import _MIN_PER_KIND

    rng = RANGES["world.num_entities"]
    assert (rng.lo, rng.lo_open) == (sum(_MIN_PER_KIND.values()), False)


def test_a_float_without_a_declared_range_must_still_be_finite():
    @dataclasses.dataclass(frozen=True)
    class X:
        a: float = 1.0
        n: int = -5  # no range declared: any integer

    C._check_ranges(X())
    with pytest.raises(ValueError, match=r"^a=nan must be a finite number$"):
        C._check_ranges(X(a=math.nan))


@pytest.mark.parametrize("bounds, spec, ok, bad", [
    ({"ge": 1}, ">= 1", [1, 2.5], [0.999, 0]),
    ({"gt": 0}, "> 0", [1e-12], [0, -1]),
    ({"le": 0}, "<= 0", [0, -3], [1e-9]),
    ({"ge": 0, "lt": 1}, "[0, 1)", [0, 0.5], [1, -1e-9]),
    ({"gt": 0, "le": 1}, "(0, 1]", [1, 1e-9], [0, 1.1]),
    ({"ge": 0, "le": 3}, "[0, 3]", [0, 3], [-1, 4]),
    ({"ge": -1}, ">= -1", [-1, 0], [-2]),
])
def test_a_declared_range_is_checked_and_said_as_declared(bounds, spec, ok, bad):
    @dataclasses.dataclass(frozen=True)
    class X:
        x: float = C.ranged(0.0, **bounds)

    rng = dataclasses.fields(X)[0].metadata["range"]
    assert str(rng) == spec
    for v in ok:
        C._check_ranges(X(x=v))
    for v in bad:
        with pytest.raises(ValueError, match=rf"^x={v} must be (in )?{re.escape(spec)}$"):
            C._check_ranges(X(x=v))


def test_a_range_is_declared_with_one_bound_per_side():
    with pytest.raises(TypeError):
        C.ranged(1, ge=0, gt=0)
    with pytest.raises(ValueError, match="need lo < hi"):
        C.ranged(1, ge=2, le=1)
    with pytest.raises(ValueError, match="at least one finite bound"):
        C.ranged(1)


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
