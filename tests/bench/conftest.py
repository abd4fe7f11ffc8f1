"""The benchmark smoke tests write results from whatever tree they run in (a developer's tree is often
dirty): they are told so, as a user would be with ``--allow-dirty``, and the JSON records it.
``test_provenance.py`` unsets this to check the refusal itself."""
import pytest

from sonar.bench.common import ALLOW_DIRTY_ENV


@pytest.fixture(autouse=True)
def _allow_dirty_results(monkeypatch):
    monkeypatch.setenv(ALLOW_DIRTY_ENV, "1")
