"""Run-root resolution (never Ray's temporary package folder) and presets found by name."""
from pathlib import Path

import pytest

from sonar.cluster.wire.config import ConfigError, load_config, resolve_paths
from sonar.cluster.wire.paths import (CONFIG_DIR, PresetError, find_config, in_ray_package_dir, preset_summary,
                                      presets, resolve_run_root)

RAY_PKG = "/tmp/ray/session_2026-11-30_10-00-00_1_1/runtime_resources/working_dir_files/_ray_pkg_0123abcd"
HOME = str(Path("~").expanduser())


def test_ray_package_folder_is_recognised_and_ordinary_folders_are_not():
    assert in_ray_package_dir(RAY_PKG)
    assert in_ray_package_dir(RAY_PKG + "/sub")
    assert not in_ray_package_dir("/home/u/project")
    assert not in_ray_package_dir("/home/u/runtime_resources")  # the name alone is not enough


@pytest.mark.parametrize("root,env,cwd,expected,noted", [
    ("", {}, "/home/u/proj", "/home/u/proj/runs", False),                       # default: ./runs made explicit
    ("", {"SONAR_RUN_ROOT": "/data/runs"}, "/home/u/proj", "/data/runs", False),  # env beats the default
    ("", {"SONAR_RUN_ROOT": "rel"}, "/home/u/proj", "/home/u/proj/rel", False),
    ("/abs", {"SONAR_RUN_ROOT": "/data/runs"}, "/home/u/proj", "/abs", False),  # the config beats env
    ("mine", {"SONAR_RUN_ROOT": "/data/runs"}, "/home/u/proj", "/home/u/proj/mine", False),
    ("", {}, RAY_PKG, HOME + "/sonar-runs", True),                              # in a job: never the package
    ("", {"SONAR_RUN_ROOT": "/data/runs"}, RAY_PKG, "/data/runs", True),
    ("runs", {}, RAY_PKG, HOME + "/sonar-runs/runs", True),
    ("runs", {"SONAR_RUN_ROOT": "/data/runs"}, RAY_PKG, "/data/runs/runs", True),
    ("/abs", {}, RAY_PKG, "/abs", False),
])
def test_run_root_resolution(root, env, cwd, expected, noted):
    got, note = resolve_run_root(root, env, cwd)
    assert str(got) == expected
    assert (note is not None) == noted
    if noted:
        assert "temporary package folder" in note and expected.split("/runs")[0] in note


def test_load_config_resolves_root_run_dir_and_index_dir_and_is_idempotent(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SONAR_RUN_ROOT", raising=False)
    cfg = load_config([], ["run.run_dir=r1", "retrieval.index_dir=idx"])
    assert cfg.run.root == str(tmp_path / "runs")
    assert cfg.run.run_dir == str(tmp_path / "r1") and cfg.retrieval.index_dir == str(tmp_path / "idx")
    assert resolve_paths(cfg, {}, "/elsewhere") == cfg


def test_load_config_inside_a_ray_package_folder_uses_the_env_root(monkeypatch, tmp_path):
    pkg = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    pkg.mkdir(parents=True)
    monkeypatch.chdir(pkg)
    monkeypatch.setenv("SONAR_RUN_ROOT", str(tmp_path / "persist"))
    cfg = load_config([], ["run.run_dir=r1"])
    assert cfg.run.root == str(tmp_path / "persist")
    assert cfg.run.run_dir == str(tmp_path / "persist" / "r1")


def test_presets_by_name_by_repo_path_and_by_file(tmp_path):
    assert {"tiny", "smoke"} <= set(presets())
    assert find_config("smoke", cwd=tmp_path) == CONFIG_DIR / "smoke.yaml"
    assert find_config("smoke.yaml", cwd=tmp_path) == CONFIG_DIR / "smoke.yaml"
    # the README's `--config configs/smoke.yaml`, run where that relative path does not exist
    assert find_config("configs/smoke.yaml", cwd=tmp_path) == CONFIG_DIR / "smoke.yaml"
    own = tmp_path / "smoke"  # a file of that name here wins over the preset
    own.write_text("run: {name: mine}\n")
    assert find_config("smoke", cwd=tmp_path) == own
    with pytest.raises(PresetError, match=r"'nope'.*presets: .*smoke.*tiny"):
        find_config("nope", cwd=tmp_path)
    with pytest.raises(PresetError):
        find_config("other/smoke.yaml", cwd=tmp_path)  # only configs/<name>.yaml maps to a preset


def test_load_config_takes_a_preset_name_and_names_a_missing_one():
    assert load_config(["smoke"]).run.name == load_config([CONFIG_DIR / "smoke.yaml"]).run.name
    with pytest.raises(ConfigError, match="no such file, and not a preset name"):
        load_config(["no-such-preset"])


def test_preset_summary_is_the_first_comment_line_without_the_file_name(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("# x.yaml — the thing it does.\n# more\nrun: {}\n")
    assert preset_summary(p) == "the thing it does."
    p.write_text("run: {}\n")
    assert preset_summary(p) == ""
    assert preset_summary(CONFIG_DIR / "tiny.yaml").startswith("the embedded default")
    # a sentence that wraps is joined to its end; an ellipsis does not end it; a command line stops it
    p.write_text("# x.yaml — it does a (<a> ...\n# </a>) thing. And more.\n#   sonar train\nrun: {}\n")
    assert preset_summary(p) == "it does a (<a> ... </a>) thing."
    p.write_text("# x.yaml — no end\n#   sonar train --config x\n")
    assert preset_summary(p) == "no end"
    # every shipped preset's description is a whole sentence (`sonar config list`)
    for name, path in presets().items():
        assert preset_summary(path).endswith("."), (name, preset_summary(path))
