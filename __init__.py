"""Sonar: search-agent RL (R1-Searcher, RAG-R1) on Ray actors, a DeepSpeed learner and vLLM rollouts.

The repository's top-level folders are the subpackages of this one namespace (``pyproject.toml``
maps ``sonar`` to the repository root): ``sonar.actors``, ``sonar.learner``, ``sonar.retrieval``,
``sonar.cluster`` and ``sonar.bench``. Nothing else of Sonar lands at the top of site-packages.
"""
__version__ = "0.2.0"

import sys as _sys


class _TransformersWithoutSklearn:
    """Every Sonar process (driver, actors, CLI) imports transformers' model classes; that import runs
    ``transformers.generation.candidate_generator``, which imports scikit-learn (and SciPy) when it is
    installed, for one thing only: the ``roc_curve`` of assisted generation's confidence-threshold tuning,
    which Sonar never runs. scikit-learn is installed (MLflow needs it), and importing it costs each process
    about 1 s of CPU on a 2-core CPU machine, out of the start-up of every role of every run (measured: a
    rollout actor's imports and policy load 6.5-7.5 s -> 5.7-6.2 s of CPU).

    So, once, just before that module loads: transformers' cached ``is_sklearn_available()`` is computed
    while ``sklearn`` is hidden (``sys.modules["sklearn"] = None``, which ``importlib.util.find_spec``
    reports as absent), so it stays False for the process and the module skips the import; the entry is
    removed at once, so ``import sklearn`` works as usual afterwards (MLflow's flavours, a user's reward).
    Nothing changes if sklearn is already imported or transformers already answered the question, and
    ``SONAR_TRANSFORMERS_SKLEARN=1`` leaves transformers alone (a plug-in that uses transformers' own
    sklearn-backed utilities)."""

    TRIGGER = "transformers.generation.candidate_generator"

    def find_spec(self, name, path=None, target=None):
        if name != self.TRIGGER:
            return None
        if self in _sys.meta_path:
            _sys.meta_path.remove(self)
        utils = _sys.modules.get("transformers.utils.import_utils")
        probe = getattr(utils, "is_sklearn_available", None)
        if probe is not None and "sklearn" not in _sys.modules and probe.cache_info().currsize == 0:
            _sys.modules["sklearn"] = None
            try:
                probe()
            finally:
                if _sys.modules.get("sklearn", 0) is None:
                    del _sys.modules["sklearn"]
        return None  # the usual finders load the module


def _install_import_hooks():
    import os

    if os.environ.get("SONAR_TRANSFORMERS_SKLEARN") == "1" or "transformers.generation" in _sys.modules:
        return
    if not any(isinstance(f, _TransformersWithoutSklearn) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _TransformersWithoutSklearn())


_install_import_hooks()
