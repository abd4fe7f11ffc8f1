"""Sonar: search-agent RL (R1-Searcher, RAG-R1) on Ray actors, a DeepSpeed learner and vLLM rollouts.

The repository's top-level folders are the subpackages of this one namespace (``pyproject.toml``
maps ``sonar`` to the repository root): ``sonar.actors``, ``sonar.learner``, ``sonar.retrieval``,
``sonar.cluster`` and ``sonar.bench``. Nothing else of Sonar lands at the top of site-packages.
"""
__version__ = "0.2.0"
