"""What every Sonar process pays at start-up (``__init__.py``): transformers' model classes load without
scikit-learn, which only assisted generation's confidence-threshold tuning uses; scikit-learn still
imports afterwards, and ``SONAR_TRANSFORMERS_SKLEARN=1`` leaves transformers as it is. Fresh processes:
nothing may be loaded before."""
import os
import subprocess
import sys

CODE = ("import sys\n"
        "import sonar\n"
        "from sonar.actors.worker import RolloutWorker\n"  # what a rollout actor's process runs first
        "from sonar.actors.model import build_policy\n"
        "from transformers import AutoModelForCausalLM, DynamicCache\n"
        "AutoModelForCausalLM.__name__\n"
        "from transformers.utils.import_utils import is_sklearn_available\n"
        "print('loaded', 'sklearn' in sys.modules, is_sklearn_available())\n"
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
    assert loaded == "loaded False False", loaded
    assert after == "after True True", after


def test_the_opt_out_leaves_transformers_its_sklearn():
    loaded, after = _run(CODE, SONAR_TRANSFORMERS_SKLEARN="1")[:2]
    assert loaded == "loaded True True", loaded
    assert after == "after True True", after


def test_nothing_changes_once_transformers_has_answered_first():
    """transformers' cached answer was True before the hook's turn: hiding sklearn then would break the
    module that imports it, so the hook leaves it (``import sklearn`` first takes the simpler branch)."""
    first = "from transformers.utils.import_utils import is_sklearn_available as f; f()\n"
    loaded, _ = _run(first + CODE)[:2]
    assert loaded == "loaded True True", loaded
