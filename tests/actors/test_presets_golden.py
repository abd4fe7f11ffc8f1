"""The papers' presets render and reward exactly what they did before tools and plug-ins (issue 23):
prompts, documents blocks, the invalid-action message and stage rewards on fixed inputs, compared with
tests/fixtures/golden/presets.json, written by tests/golden_presets.py on 48811cc (the commit before)."""
import json
from pathlib import Path

import pytest

from tests.golden_presets import PRESETS, compute

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "presets.json"


@pytest.fixture(scope="module")
def now():
    return compute()


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_renders_and_rewards_as_before(now, preset):
    before = json.loads(GOLDEN.read_text())[preset]
    assert now[preset] == before
    assert before["rewards"], "a preset with RL stages pins their rewards"
