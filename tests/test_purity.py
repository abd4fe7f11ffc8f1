"""The pure core (parsing, rewards, advantages, losses, masks, codec, config) imports neither Ray nor
DeepSpeed, so it runs and is tested without a cluster."""
import subprocess
import sys

import pytest

PURE = ["cluster.protocol", "cluster.config", "cluster.replay", "cluster.weights", "actors.parsing",
        "actors.rewards", "actors.prompts", "actors.world", "learner.algo.advantages", "learner.algo.losses",
        "learner.algo.staleness", "learner.batching", "learner.deepspeed_config", "retrieval.base",
        "retrieval.resilient"]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_ray_or_deepspeed(module):
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "bad = [m for m in ('ray', 'deepspeed', 'vllm', 'mlflow', 'elasticsearch') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"
