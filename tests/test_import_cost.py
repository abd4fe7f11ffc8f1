"""What every Sonar process pays at start-up (``__init__.py``): transformers' model classes load without
scikit-learn, which only assisted generation's confidence-threshold tuning uses; scikit-learn still
imports afterwards, and ``SONAR_TRANSFORMERS_SKLEARN=1`` leaves transformers as it is. Fresh processes:
nothing may be loaded before."""
import os
import subprocess
import sys

import pytest

CODE = ("import sys\n"
        "import sonar\n"
        "from transformers import AutoModelForCausalLM\n"
        "AutoModelForCausalLM.__name__\n"
        "from transformers.utils.import_utils import is_sklearn_available\n"
        "print('loaded', 'sklearn' in sys.modules, 'scipy' in sys.modules, is_sklearn_available())\n"
        "import sklearn.metrics\n"
        "from sklearn.metrics import roc_curve\n"
        "print('after', sys.modules['sklearn'] is not None, callable(roc_curve))\n")


def _run(code: str, **env) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")


def test_transformers_model_classes_load_without_sklearn_which_still_imports_afterwards():
    loaded, after = _run(CODE)[:2]
    assert loaded == "loaded False False False", loaded
    assert after == "after True True", after


def test_the_opt_out_leaves_transformers_its_sklearn():
    loaded, after = _run(CODE, SONAR_TRANSFORMERS_SKLEARN="1")[:2]
    assert loaded == "loaded True True True", loaded
    assert after == "after True True", after


@pytest.mark.parametrize("first", ["import sklearn", "from transformers.utils.import_utils import is_sklearn_available as f; f()"])
def test_nothing_changes_once_sklearn_or_transformers_answered_first(first):
    loaded, _ = _run(first + "\n" + CODE)[:2]
    assert loaded == "loaded True True True", loaded


def test_a_role_module_imports_nothing_of_sklearn():
    """The rollout actor's module and its policy load (what a Ray actor process runs first)."""
    code = ("import sys\n"
            "from sonar.actors.worker import RolloutWorker\n"
            "from sonar.cluster.wire.policy import load_policy\n"
            "from transformers import AutoModelForCausalLM, DynamicCache\n"
            "from sonar.actors.model import build_policy\n"
            "print('sklearn' in sys.modules)\n")
    assert _run(code)[0] == "False"
