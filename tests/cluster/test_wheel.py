"""A wheel built from the repository ships the presets: installed outside the checkout, `sonar` finds
`--config smoke` by name and its default config with no --config (about 15 s: build, install, two CLI calls).

The wheel goes into a throwaway venv whose only link to the project venv is a ``.pth`` line naming its
site-packages (the dependencies, no download); the project's editable install is not seen there (its
``.pth`` hook runs only in the project venv's own site dir), so ``sonar`` is imported from the wheel."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from tests.checkout import copy_tracked


def _run(cmd, timeout=300, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(python, sonar, env, a folder outside the checkout) of a venv holding the wheel."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    # The tracked files only (what a clean checkout holds), so the wheel is the repository's, not the tree's litter.
    src = copy_tracked(tmp_path / "src")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    # a quiet install: setuptools has nothing to warn about (license string, every package listed)
    assert "Warning" not in built.stderr, built.stderr[-4000:]
    wheel = next((tmp_path / "dist").glob("sonar_rl-*.whl"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site / "_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    env.pop("SONAR_RUN_ROOT", None)
    where = _run([str(py), "-c", "import sonar.cluster.wire.paths as p; print(p.CONFIG_DIR)"], cwd=tmp_path, env=env)
    assert Path(where.strip()).is_relative_to(site), f"sonar imported from {where}, not the wheel in {site}"
    return py, str(venv / "bin" / "sonar"), env, tmp_path


@pytest.mark.slow
def test_wheel_runs_config_commands_with_presets_from_outside_the_checkout(wheel_env, tmp_path):
    py, sonar, env, _ = wheel_env
    away = tmp_path / "away"
    away.mkdir()
    shown = yaml.safe_load(_run([sonar, "config", "show", "--config", "smoke"], cwd=away, env=env))
    assert shown["run"]["name"] == "smoke" and shown["run"]["root"] == str(away / "runs")
    # the README's `--config configs/smoke.yaml` where no configs/ folder exists
    assert yaml.safe_load(_run([sonar, "config", "show", "--config", "configs/smoke.yaml"], cwd=away, env=env)) == shown
    assert "config ok (tiny)" in _run([sonar, "config", "validate"], cwd=away, env=env)  # the default, from the wheel
    listed = _run([sonar, "config", "list"], cwd=away, env=env)
    assert {"tiny", "smoke"} <= {ln.split()[0] for ln in listed.splitlines() if ln.strip()}
    assert "plug-in fields" in listed
    assert not (away / "runs").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_wheel_trains_the_smoke_preset_from_outside_the_checkout(wheel_env, tmp_path):
    """`sonar train --config smoke` from the wheel, in a folder with no configs/: every stage (SFT and
    both RL stages, one or two steps each), evaluation and export; the run lands under ./runs."""
    _, sonar, env, _ = wheel_env
    away = tmp_path / "away"
    away.mkdir()
    _run([sonar, "train", "--config", "smoke", "stages.0.steps=2", "stages.1.steps=1", "stages.2.steps=1",
          "world.num_heldout_eval=4", "eval.before=false", "rollout.num_workers=1"], cwd=away, env=env, timeout=900)
    (run_dir,) = [p for p in (away / "runs").iterdir() if p.is_dir() and (p / "summary.json").exists()]
    assert (run_dir / "model" / "model.safetensors").is_file() and (run_dir / "config.yaml").is_file()
