"""The algorithm section of the config: per-algorithm defaults (std normalisation, dynamic sampling,
aggregation), the update-loop fields, and the presets that follow the papers' scripts."""
import pytest

from sonar.cluster.wire.config import (CONFIG_DIR, AlgoConfig, algo_dynamic_sampling, algo_loss_agg,
                                       algo_std_normalize, load_config)


@pytest.mark.parametrize("name, std, dynamic, agg", [
    ("grpo", True, True, "token_mean"),
    ("dr_grpo", False, True, "seq_sum_norm"),
    ("reinforce_pp", False, False, "token_mean"),
    ("reinforce_pp_baseline", False, False, "token_mean"),
    ("group_norm", False, False, "token_mean"),
    ("ppo", True, False, "token_mean"),
])
def test_unset_fields_resolve_to_the_algorithms_default(name, std, dynamic, agg):
    a = AlgoConfig(name=name)
    assert (algo_std_normalize(a), algo_dynamic_sampling(a), algo_loss_agg(a)) == (std, dynamic, agg)


def test_explicit_values_win():
    a = AlgoConfig(name="dr_grpo", loss_agg="token_mean", dynamic_sampling=False)
    assert algo_loss_agg(a) == "token_mean" and algo_dynamic_sampling(a) is False
    assert algo_dynamic_sampling(AlgoConfig(name="reinforce_pp", dynamic_sampling=True)) is True
    assert algo_std_normalize(AlgoConfig(name="grpo", std_normalize=False)) is False


@pytest.mark.parametrize("overrides, fields", [
    (["stages.0.algo.ppo_epochs=0"], ["stages[0].algo.ppo_epochs=0"]),
    (["stages.0.algo.mini_batches=0"], ["stages[0].algo.mini_batches=0"]),
    (["stages.0.algo.mini_batches=65"], ["stages[0].algo.mini_batches=65", "rollout.group_size=64"]),
    (["stages.0.algo.name=reinforce_pp_baseline", "stages.0.algo.std_normalize=true"],
     ["reinforce_pp_baseline", "std_normalize=True"]),
    (["stages.0.algo.name=group_norm", "rollout.group_size=1"], ["group_norm", "rollout.group_size >= 2"]),
    (["stages.0.algo.name=reinforce_pp_baseline", "rollout.group_size=1"], ["reinforce_pp_baseline"]),
    (["stages.0.algo.name=a2c"], ["stages[0].algo.name='a2c'"]),
    (["stages.0.algo.loss_agg=sum"], ["stages[0].algo.loss_agg='sum'"]),
])
def test_bad_algo_values_name_the_field_and_value(overrides, fields):
    with pytest.raises(ValueError) as e:
        load_config([], overrides)
    for f in fields:
        assert f in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["stages.0.algo.mini_batches=64"],  # groups_per_step 8 x group_size 8
    ["stages.0.algo.ppo_epochs=4", "stages.0.algo.mini_batches=4"],
    ["stages.0.algo.name=reinforce_pp", "rollout.group_size=1"],  # no group baseline: a group of one is fine
    ["stages.0.algo.name=dr_grpo", "stages.0.algo.loss_agg=token_mean"],
])
def test_good_algo_values_load(overrides):
    load_config([], overrides)


def test_r1_searcher_preset_runs_reinforce_pp_as_its_scripts():
    """R1-Searcher's OpenRLHF scripts: Llama stage 1 group_norm, stage 2 reinforce_baseline; train_batch_size is
    a quarter of rollout_batch_size x n_samples_per_prompt (4 optimizer steps), eps_clip 0.2, init_kl_coef 1e-4
    (k1, in the reward); no dynamic sampling."""
    cfg = load_config([CONFIG_DIR / "r1_searcher_tiny.yaml"])
    rl = [s for s in cfg.stages if s.kind == "rl"]
    assert [s.algo.name for s in rl] == ["group_norm", "reinforce_pp_baseline"]
    for s in rl:
        a = s.algo
        assert (a.mini_batches, a.ppo_epochs, a.clip_low, a.clip_high) == (4, 1, 0.2, 0.2)
        assert (a.kl_coef, a.kl_mode, a.kl_estimator) == (1e-4, "reward", "k1")
        assert algo_dynamic_sampling(a) is False and algo_loss_agg(a) == "seq_mean_token_mean"


def test_grpo_default_divides_by_the_std():
    cfg = load_config([CONFIG_DIR / "tiny.yaml"])
    assert cfg.stages[-1].algo.name == "grpo" and algo_std_normalize(cfg.stages[-1].algo) is True
