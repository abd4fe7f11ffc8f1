"""A new advantage estimator is one file named in the config (issue 55; the example of learner/README.md): it carries its ``AlgoSpec``, the config
checks it at load and reads its defaults, and the learner's step trains with it through ``ALGOS``, the door
the built-ins use. No Ray, a tiny model."""
import re
from pathlib import Path

import pytest
import torch

from sonar.cluster.wire.algos import BUILTIN_SPECS, spec_of
from sonar.cluster.wire.config import LearnerConfig, ReplayConfig, algo_loss_agg, algo_std_normalize, load_config
from sonar.cluster.wire.plugins import BUILTIN_NAMES, PluginError
from sonar.learner.algo.advantages import ALGOS, compute_advantages
from sonar.learner.train_step import TorchStepper, rl_step
from tests.learner.test_train_step import groups, tiny_model

README = Path(__file__).resolve().parents[2] / "learner" / "README.md"
EXAMPLE = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
"""The estimator learner/README.md shows: the test trains with exactly that text."""
PLUGIN = EXAMPLE + '''

def no_spec(rewards, group_index, mask, *, std_normalize, kl, kl_coef):
    return torch.zeros_like(mask)
'''


def test_every_builtin_estimator_is_registered_with_the_spec_the_config_reads():
    assert ALGOS.names() == BUILTIN_NAMES["algorithm"] == tuple(BUILTIN_SPECS)
    for name in ALGOS.names():
        assert ALGOS.get(name, "algo.name").spec == BUILTIN_SPECS[name] == spec_of(name), name


def test_a_new_estimator_is_one_file_named_in_the_config_and_the_learner_trains_with_it(tmp_path):
    path = tmp_path / "my_algo.py"
    path.write_text(PLUGIN)
    name = f"{path}:above_mean"
    cfg = load_config([], [f"stages.0.algo.name={name}", "rollout.group_size=1", "stages.0.algo.dynamic_sampling=false"])
    algo = cfg.stages[0].algo
    assert str(path) in cfg.plugins  # its source travels with the config to every actor
    assert algo_loss_agg(algo) == "seq_mean_token_mean" and algo_std_normalize(algo) is False  # its spec's defaults
    mask = torch.ones(3, 2)
    adv = compute_advantages(name, torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 1, 2]), mask)
    assert torch.equal(adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]]))

    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    m = rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.1), 0.0), groups(), [0, 0, 0], algo,
                LearnerConfig(), ReplayConfig(), 1.0, 0)
    assert m["learner/trajectories"] == 12 and m["learner/pg_loss"] != 0.0  # rewards 1, 0, 0, 1: advantages +-1
    assert any(not torch.equal(p, q) for p, q in zip(before, model.parameters()))  # it trained


def test_an_estimator_without_its_spec_or_with_a_wrong_signature_is_refused_at_load(tmp_path):
    path = tmp_path / "my_algo.py"
    path.write_text(PLUGIN + "\n\ndef two(rewards, mask):\n    return mask\n")
    with pytest.raises(PluginError, match=r"stages\[0\]\.algo\.name=.*no_spec.*AlgoSpec"):
        load_config([], [f"stages.0.algo.name={path}:no_spec"])
    with pytest.raises(PluginError, match=r"stages\[0\]\.algo\.name=.*3 positional"):
        load_config([], [f"stages.0.algo.name={path}:two"])
    path.write_text(PLUGIN.replace("AlgoSpec(groups=False", "AlgoSpec(groups=True"))  # a group baseline
    with pytest.raises(ValueError, match=r"stages\[0\]\.algo\.name=.*needs rollout.group_size >= 2"):
        load_config([], [f"stages.0.algo.name={path}:above_mean", "rollout.group_size=1",
                         "stages.0.algo.dynamic_sampling=false"])
