"""The checkout as a clean clone holds it: the tracked files, copied to a folder of the test's own.

Tests that build a wheel, ship the code to a Ray job or edit a copy of the package work on such a copy,
never in the checkout: a build writes ``build/`` and ``*.egg-info`` where it runs, and a stale
``build/lib`` (modules since deleted or renamed) would be packed into the next wheel built there; two
suite runs in one checkout would share it."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def copy_tracked(dest: Path) -> Path:
    """Copy every file git tracks (``git ls-files``; a deleted but tracked path is skipped) from the
    checkout to ``dest``, with its mode and times; returns ``dest``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in files)):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest
