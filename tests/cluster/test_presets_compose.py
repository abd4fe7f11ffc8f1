"""Presets that are what they say (issue 21, item 5 and 6's composition half).

- Composing two files that both set ``stages`` is refused, naming both: a later list replaces the
  earlier whole, which used to drop R1-Searcher's algorithms silently (``--config r1_searcher --config gpu``).
- RL or evaluation on the synthetic world's toy questions with a real corpus or a pretrained model is
  refused unless ``world.force`` (configs/gpu.yaml without its data used to train on "in which country is
  the city kruk du ?" while searching wiki18).
- ``sonar config`` on a laptop: files that live on the cluster's storage become notes, not errors;
  ``sonar train`` (no notes) still fails on them.
"""
from __future__ import annotations

import json

import pytest

from sonar.cluster.wire.config import CONFIG_DIR, ConfigError, load_config

from tests.sizing import smoke_sizing


def test_two_files_that_both_set_stages_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"r1_searcher\.yaml and .*gpu\.yaml both set stages") as e:
        load_config(["r1_searcher", "gpu"], notes=[])
    assert "stages.N.key=value" in str(e.value)


def test_a_sizing_overlay_without_stages_keeps_the_recipes_algorithms(tmp_path):
    cfg = load_config([smoke_sizing(tmp_path), "r1_searcher_tiny"])
    assert [s.algo.name for s in cfg.stages if s.kind == "rl"] == ["group_norm", "reinforce_pp_baseline"]
    assert cfg.world.num_entities == 120  # smoke's sizing arrived


def test_gpu_preset_on_a_laptop_names_what_it_could_not_check():
    notes: list = []
    cfg = load_config(["gpu"], [], notes=notes)
    joined = "\n".join(notes)
    assert "/data/train.jsonl" in joined and "/data/dev.jsonl" in joined and "/models/policy" in joined
    assert cfg.run.checkpoint_every > 0  # a 7B run is checkpointed by default
    assert [s.algo.name for s in cfg.stages] == ["group_norm", "reinforce_pp_baseline"]
    assert all(s.data == "/data/train.jsonl" for s in cfg.stages) and cfg.eval.data == "/data/dev.jsonl"


def test_without_notes_a_missing_model_or_dataset_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"model.path='/models/policy': no such directory here, where the run starts"):
        load_config(["gpu"])
    model = _model_dir(tmp_path, 151_936)
    with pytest.raises(ValueError, match=r"stages\[0\]\.data\[0\]='/data/train.jsonl': no such file"):
        load_config(["gpu"], [f"model.path={model}"])


@pytest.mark.parametrize("overrides", [
    ["stages.0.data=null", "stages.1.data=null"],  # the preset without its data: the toy world's questions
    ["eval.data=null"],
])
def test_gpu_preset_refuses_the_toy_world_with_a_real_corpus(overrides):
    with pytest.raises(ValueError, match=r"synthetic world's toy questions .*retrieval.corpus='/data/wiki18.jsonl'"):
        load_config(["gpu"], overrides, notes=[])
    assert load_config(["gpu"], [*overrides, "world.force=true"], notes=[]).world.force


def _model_dir(tmp_path, vocab: int):
    d = tmp_path / f"model-{vocab}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab}))
    (d / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
    return d


def test_a_pretrained_model_on_the_toy_world_is_refused_a_sonar_word_policy_is_not(tmp_path):
    big = _model_dir(tmp_path, 151_936)
    with pytest.raises(ValueError, match=r"stages\[1\], stages\[2\], eval would use .*vocabulary 151,936"):
        load_config(["smoke"], [f"model.path={big}"])
    assert load_config(["smoke"], [f"model.path={big}", "world.force=true"]).model.path == str(big)
    small = _model_dir(tmp_path, 563)  # the tiny policy's export (benchmarks start RL from one)
    assert load_config(["smoke"], [f"model.path={small}"]).model.path == str(small)


def test_the_tiny_default_and_files_with_a_corpus_pass(tmp_path):
    assert load_config([]).world.force is False
    fix = CONFIG_DIR.parent / "examples" / "own_data"
    cfg = load_config(["smoke"], [f"retrieval.corpus={fix / 'hotpot_mini_corpus.jsonl'}",
                                  f"eval.data={fix / 'hotpot_mini_dev.json'}", "stages.0.steps=0",
                                  *(f"stages.{i}.data={fix / 'hotpot_mini_dev.json'}" for i in (1, 2))])
    assert cfg.eval.data.endswith("hotpot_mini_dev.json")


def test_index_and_eval_are_not_refused_for_stages_they_do_not_train(tmp_path, monkeypatch):
    """``sonar index`` / ``sonar eval`` with a real corpus and a preset whose RL stages use the world:
    nothing is trained on those stages, so the toy-world refusal does not apply (train still refuses)."""
    from types import SimpleNamespace

    from sonar.cluster.driver.cli import _load

    corpus = CONFIG_DIR.parent / "examples" / "own_data" / "hotpot_mini_corpus.jsonl"
    for cmd in ("index", "eval"):
        cfg = _load(SimpleNamespace(cmd=cmd, config=["smoke"], overrides=[f"retrieval.corpus={corpus}"]))
        assert cfg.retrieval.corpus == str(corpus)
    with pytest.raises(SystemExit):
        _load(SimpleNamespace(cmd="train", config=["smoke"], overrides=[f"retrieval.corpus={corpus}"]))


@pytest.mark.parametrize("recipe", ["tiny", "smoke", "r1_searcher_tiny", "rag_r1_tiny", "search_r1_tiny"])
def test_the_lora_overlay_turns_a_recipe_into_its_lora_version_and_changes_nothing_else(recipe):
    import dataclasses

    full, lora = load_config([recipe], notes=[]), load_config([recipe, "lora"], notes=[])
    assert full.learner.lora.rank == 0 and lora.learner.lora.rank == 16 and lora.learner.lora.alpha == 32
    same = dataclasses.replace(lora, learner=dataclasses.replace(lora.learner, lora=full.learner.lora))
    assert same == full  # the stages (lr included: LoraConfig.lr_scale applies it), engines, data: all as before


def test_the_lora_overlay_on_a_vllm_recipe_serves_adapters_and_bad_settings_are_refused():
    cfg = load_config(["r1_searcher", "lora"], notes=[])
    assert cfg.rollout.engine == "vllm" and cfg.learner.lora.rank == 16
    with pytest.raises(ValueError, match=r"learner\.lora\.rank=1024 with rollout\.engine='vllm'.*<= 512"):
        load_config(["r1_searcher", "lora"], ["learner.lora.rank=1024"], notes=[])
    with pytest.raises(ValueError, match=r"learner\.lora\.target_modules=\[\].*name the modules"):
        load_config(["tiny", "lora"], ["learner.lora.target_modules=[]"], notes=[])
