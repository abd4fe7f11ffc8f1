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


PLACEMENT = {"r1_searcher": "split", "search_r1": "colocated", "rag_r1": "colocated"}
"""How each paper's script places its roles: OpenRLHF's learner and vLLM GPUs apart (R1-Searcher), veRL's
hybrid engine (Search-R1, RAG-R1)."""


@pytest.mark.parametrize("name", list(R.RECIPES))
def test_recipes_fit_their_gpus_with_the_papers_model(name):
    """``sonar config validate --config NAME model.path=<the paper's model>`` passes the memory plan on
    GPUs of 80 GB (and of 79.1 GiB, what torch reports for them): split, the learner's ranks and every
    vLLM engine; colocated, each GPU a learner rank and its engine, every phase."""
    from sonar.cluster.wire import memory as M

    for gib in ("80", "79.1"):
        cfg = recipe(name, overrides=[f"model.path={SHAPES / PAPER_SHAPE[name]}", f"cluster.gpu_memory_gib={gib}"])
        plan, why = M.plan_for(cfg, environ={})
        assert why is None and plan.fits, plan.format()
        if PLACEMENT[name] == "colocated":
            assert plan.learner is None and plan.engine is None and plan.colocated is not None
            assert [g.title.split(":")[0] for g in plan.colocated.phases] == ["generation", "training", "hand-over"]
        else:
            assert plan.colocated is None and plan.learner is not None and plan.engine is not None
        assert plan.gpus and all(g.total <= g.capacity for g in plan.gpus)
    refused = "colocated GPU .* does not fit the GPU's 24.0 GiB" if PLACEMENT[name] == "colocated" else \
        "learner rank 0 needs"
    with pytest.raises(ValueError, match=f"memory plan: {refused}"):  # not vacuous: a 24 GiB GPU is refused
        recipe(name, overrides=[f"model.path={SHAPES / PAPER_SHAPE[name]}", "cluster.gpu_memory_gib=24"])


@pytest.mark.parametrize("name", list(R.RECIPES))
def test_recipes_ask_for_upstreams_gpus_placed_as_upstream_places_them(name):
    """The preset's GPU count (colocated: one per learner rank; split: the learner's plus every engine's)
    is the script's, its placement the script's, and the recipe's table says both beside upstream's."""
    cfg = recipe(name)
    assert R.preset_gpus(cfg) == R.GPUS[name][0]
    assert cfg.cluster.placement == PLACEMENT[name]
    fields = {r.field for r in R.RECIPES[name]}
    assert {"cluster.placement", "learner.num_ranks", "rollout.num_workers", "rollout.tensor_parallel_size",
            "rollout.num_gpus_per_worker", "rollout.vllm_gpu_memory_utilization", "retrieval.backend"} <= fields
    head = R.markdown(name, cfg).splitlines()[0]
    assert f"on {R.GPUS[name][0]} GPUs: " in head and head.endswith(f"The preset: {R.GPUS[name][0]} GPUs, "
                                                                    f"{PLACEMENT[name]}.")
    if PLACEMENT[name] == "colocated":  # veRL's hybrid engine: the engine drops its weights, the optimizer on host
        assert (cfg.rollout.sleep_level, cfg.learner.offload_while_generating) == (2, True)
        assert cfg.rollout.num_workers == cfg.learner.num_ranks == 8 and cfg.rollout.vllm_gpu_memory_utilization == 0.6


@pytest.mark.parametrize("name", list(R.RECIPES))
def test_the_retriever_row_says_how_to_reach_upstreams_server(name):
    """Upstream retrieves from a dense index behind a server; the presets search Elasticsearch BM25 with a
    dense rerank, and say so. Search-R1's and RAG-R1's servers speak the /retrieve API that
    ``retrieval.backend=http`` sends: that override alone makes the row agree."""
    (row,) = [r for r in R.RECIPES[name] if r.field == "retrieval.backend"]
    assert row.differs.startswith("Sonar's preset searches Elasticsearch BM25 with a dense (MiniLM) rerank")
    cfg = recipe(name)
    assert (cfg.retrieval.backend, cfg.retrieval.rerank) == ("elasticsearch", "dense")
    if row.upstream == "http":
        got = R.mismatches(name, recipe(name, overrides=["retrieval.backend=http", "retrieval.rerank=none"]))
        assert got == [f"retrieval.backend: marked as differing ({row.differs}) but equals upstream 'http'"]


@pytest.mark.parametrize("name", list(R.RECIPES))
def test_recipes_are_on_policy_and_async_yaml_changes_only_the_mode_the_lag_and_the_correction(name):
    sync, asyn = recipe(name), recipe(name, "async")
    assert (sync.cluster.mode, sync.replay.max_policy_lag) == ("sync", 0)
    assert {st.algo.off_policy for st in sync.stages} == {"none"}
    assert (asyn.cluster.mode, asyn.replay.max_policy_lag) == ("async", 2)
    assert {st.algo.off_policy for st in asyn.stages} == {"tis"}
    # overlap needs GPUs of its own: a colocated recipe becomes split (twice the GPUs), its learner resident
    assert (asyn.cluster.placement, asyn.learner.offload_while_generating) == ("split", False)
    # a push in async mode finds rows in flight: they continue under the new weights (partial rollouts)
    assert (sync.rollout.weight_update, asyn.rollout.weight_update) == ("pause", "interrupt")
    a, b = to_dict(sync), to_dict(asyn)
    for d in (a, b):
        d["cluster"].pop("mode"), d["replay"].pop("max_policy_lag"), d["rollout"].pop("weight_update")
        d["cluster"].pop("placement"), d["learner"].pop("offload_while_generating")
        for st in d["stages"]:
            st["algo"].pop("off_policy")
    assert a == b


def test_off_policy_auto_is_resolved_at_load_and_an_explicit_choice_is_kept():
    cfg = load_config([], ["cluster.mode=sync", "stages.0.algo.off_policy=auto"])
    assert cfg.stages[0].algo.off_policy == "none"
    cfg = load_config([], ["cluster.mode=async", "stages.0.algo.off_policy=auto"])
    assert cfg.stages[0].algo.off_policy == "tis"
    assert load_config([], ["cluster.mode=sync"]).stages[0].algo.off_policy == "tis"  # the default stays explicit


def test_weight_update_auto_is_interrupt_in_async_mode_and_pause_in_sync():
    assert load_config([], ["cluster.mode=async"]).rollout.weight_update == "interrupt"
    assert load_config([], ["cluster.mode=sync"]).rollout.weight_update == "pause"
    assert load_config([], ["cluster.mode=async", "rollout.weight_update=pause"]).rollout.weight_update == "pause"


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
    text = (ROOT / "actors" / "README.md").read_text()
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
