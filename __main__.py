"""``python -m sonar`` is the ``sonar`` command.

The guard matters: vLLM starts its engine core with ``spawn``, which re-imports ``__main__``.
"""
from sonar.cluster.driver.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
