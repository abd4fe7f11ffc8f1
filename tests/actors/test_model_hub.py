"""model.path as a local folder or a Hugging Face Hub id (actors/model.py:resolve_model_path), with a fake hub."""
import pytest



def test_model_path_hub_id_resolution_with_a_fake_hub(tmp_path):
    from sonar.actors.model import resolve_model_path

    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_model_path(str(local), download=lambda **kw: pytest.fail("no download")) == local
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "config.json").write_text("{}")
    seen = []

    def fake(repo_id, local_files_only):
        seen.append((repo_id, local_files_only))
        if local_files_only:
            raise FileNotFoundError("not cached")
        return str(snap)

    assert resolve_model_path("Qwen/Qwen2.5-0.5B", env={"HF_HUB_OFFLINE": "0"}, download=fake) == snap
    with pytest.raises(ValueError, match=r"model.path='Qwen/Qwen2.5-0.5B' is a Hugging Face Hub id, but HF_HUB_OFFLINE=1"):
        resolve_model_path("Qwen/Qwen2.5-0.5B", env={"HF_HUB_OFFLINE": "1"}, download=fake)
    assert seen == [("Qwen/Qwen2.5-0.5B", False), ("Qwen/Qwen2.5-0.5B", True)]
    for bad in (str(tmp_path / "missing" / "dir"), "not-an-id", "a/b/c"):
        with pytest.raises(ValueError, match="not a Hugging Face model directory"):
            resolve_model_path(bad, env={}, download=fake)
