"""Test helper: smoke.yaml's sizing without its stages, to compose under a recipe preset.

Two config files may not both set ``stages`` (``load_config`` refuses it: the later list would drop the
earlier one's stages whole), so a test that wants the smoke run's small world and roles with another
preset's stages writes this overlay and loads ``[overlay, preset]``."""
from __future__ import annotations

from pathlib import Path

import yaml

from sonar.cluster.wire.config import CONFIG_DIR


def smoke_sizing(dirpath: Path) -> Path:
    raw = yaml.safe_load((CONFIG_DIR / "smoke.yaml").read_text())
    raw.pop("stages")
    out = Path(dirpath) / "smoke-sizing.yaml"
    out.write_text(yaml.safe_dump(raw))
    return out
