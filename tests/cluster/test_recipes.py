"""The paper recipes (configs/r1_searcher.yaml, search_r1.yaml, rag_r1.yaml) pinned against the upstream
table of ``cluster/wire/recipes.py`` (each row cited by file and line of the released scripts), sized by
the memory plan for the papers' model shapes, on-policy unless configs/async.yaml is added, and the
README's recipe tables equal to what ``sonar config recipes`` prints."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sonar.cluster.wire import recipes as R
from sonar.cluster.wire.config import load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "tests" / "fixtures" / "model_shapes"
PAPER_SHAPE = {"r1_searcher": "llama-3.1-8b", "search_r1": "qwen2.5-3b", "rag_r1": "qwen2.5-7b"}
"""The model each paper's script trains (``recipes.MODELS``), by its config.json numbers."""
BEGIN, END = "<!-- recipes:begin (sonar config recipes) -->", "<!-- recipes:end -->"


def recipe(name: str, *extra: str, overrides=()):
    return load_config([name, *extra], list(overrides), notes=[])


@pytest.mark.parametrize("name", list(R.RECIPES))
def test_each_recipe_holds_every_upstream_value_it_does_not_say_it_changes(name):
    assert R.mismatches(name, recipe(name)) == []


def test_a_changed_field_is_named_with_the_upstream_value_and_its_source():
    got = R.mismatches("search_r1", recipe("search_r1", overrides=["rollout.top_p=1.0"]))
    assert got == [f"rollout.top_p: recipe has 1.0, upstream 0.95 ({R.SR1} verl/trainer/config/ppo_trainer.yaml:71)"]
    # a row that says it differs must really differ, or its reason has outlived the deviation
    got = R.mismatches("rag_r1", recipe("rag_r1", overrides=["protocol.max_doc_tokens=1000"]))
    assert len(got) == 1 and got[0].startswith("protocol.max_doc_tokens: marked as differing")


def test_every_row_names_a_real_field_and_a_pinned_source():
    for name, rows in R.RECIPES.items():
        cfg = recipe(name)
        assert len({r.field for r in rows}) == len(rows), name  # one row per field
        for r in rows:
            R.get_field(cfg, r.field)  # raises on a section or a typo
            assert r.source.split(" ")[0] in (R.R1, R.SR1, R.RAG) and ":" in r.source.split(" ", 1)[1], r


@pytest.mark.parametrize("name", list(R.RECIPES))
def test_recipes_fit_their_gpus_with_the_papers_model(name):
    """``sonar config validate --config NAME model.path=<the paper's model>`` passes the memory plan
    (16 GPUs of 80 GB; the learner's ranks and every vLLM engine)."""
    from sonar.cluster.wire import memory as M

    cfg = recipe(name, overrides=[f"model.path={SHAPES / PAPER_SHAPE[name]}"])
    plan, why = M.plan_for(cfg, environ={})
    assert why is None and plan.fits and plan.learner is not None and plan.engine is not None, plan.format()
    assert all(g.total <= g.capacity for g in (plan.learner, plan.engine))
    with pytest.raises(ValueError, match="memory plan: learner rank 0 needs"):  # not vacuous: a 24 GiB GPU is refused
        recipe(name, overrides=[f"model.path={SHAPES / PAPER_SHAPE[name]}", "cluster.gpu_memory_gib=24"])


@pytest.mark.parametrize("name", list(R.RECIPES))
def test_recipes_are_on_policy_and_async_yaml_changes_only_the_mode_the_lag_and_the_correction(name):
    sync, asyn = recipe(name), recipe(name, "async")
    assert (sync.cluster.mode, sync.replay.max_policy_lag) == ("sync", 0)
    assert {st.algo.off_policy for st in sync.stages} == {"none"}
    assert (asyn.cluster.mode, asyn.replay.max_policy_lag) == ("async", 2)
    assert {st.algo.off_policy for st in asyn.stages} == {"tis"}
    a, b = to_dict(sync), to_dict(asyn)
    for d in (a, b):
        d["cluster"].pop("mode"), d["replay"].pop("max_policy_lag")
        for st in d["stages"]:
            st["algo"].pop("off_policy")
    assert a == b


def test_off_policy_auto_is_resolved_at_load_and_an_explicit_choice_is_kept():
    cfg = load_config([], ["cluster.mode=sync", "stages.0.algo.off_policy=auto"])
    assert cfg.stages[0].algo.off_policy == "none"
    cfg = load_config([], ["cluster.mode=async", "stages.0.algo.off_policy=auto"])
    assert cfg.stages[0].algo.off_policy == "tis"
    assert load_config([], ["cluster.mode=sync"]).stages[0].algo.off_policy == "tis"  # the default stays explicit


def test_config_show_prints_the_upstream_values(capsys):
    from sonar.cluster.driver.cli import main

    assert main(["config", "show", "--config", "r1_searcher"]) == 0
    out = capsys.readouterr().out
    for line in ("top_p: 0.95", "group_size: 16", "rules: upstream", "lr: 2.0e-06", "off_policy: none", "mode: sync"):
        assert line in out, line
    assert "- 0.9\n  - 0.95" in out  # learner.betas


def test_readme_recipe_tables_are_what_sonar_config_recipes_prints(capsys):
    from sonar.cluster.driver.cli import main

    assert main(["config", "recipes"]) == 0
    printed = capsys.readouterr().out
    text = (ROOT / "README.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    block = text.split(BEGIN)[1].split(END)[0].strip("\n")
    assert block == printed.strip("\n"), "README's recipe tables are stale: paste `sonar config recipes`"


def test_the_tiny_cpu_versions_keep_the_recipes_protocol_and_algorithms():
    """r1_searcher_tiny / search_r1_tiny / rag_r1_tiny: the same protocol and algorithms on the embedded
    world, Sonar's own rules, sized for 2 cores; the recipes' models and GPUs are not theirs."""
    for name in R.RECIPES:
        big, tiny = recipe(name), recipe(f"{name}_tiny")
        assert tiny.protocol.name == big.protocol.name and tiny.model.path is None
        assert [s.algo.name for s in tiny.stages if s.kind == "rl"] == [s.algo.name for s in big.stages]
        assert dataclasses.replace(tiny.protocol).rules == "sonar"
