"""The pure core (parsing, rewards, advantages, losses, masks, codec, config) imports neither Ray nor
DeepSpeed, so it runs and is tested without a cluster."""
import subprocess
import sys

import pytest

PURE = ["sonar.cluster.wire.protocol", "sonar.cluster.wire.config", "sonar.cluster.wire.replay",
        "sonar.cluster.wire.weights", "sonar.cluster.wire.metrics", "sonar.actors.parsing", "sonar.actors.rewards",
        "sonar.actors.prompts", "sonar.actors.world", "sonar.learner.algo.advantages", "sonar.learner.algo.losses",
        "sonar.learner.algo.staleness", "sonar.learner.batching", "sonar.learner.deepspeed_config",
        "sonar.retrieval.base", "sonar.retrieval.resilient"]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_ray_or_deepspeed(module):
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "bad = [m for m in ('ray', 'deepspeed', 'vllm', 'mlflow', 'elasticsearch') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"
