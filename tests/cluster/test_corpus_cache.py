from dataclasses import replace

from sonar.cluster.wire.config import load_config
from sonar.cluster.driver.roles import prepare_corpus


def test_world_corpus_file_is_named_by_content(tmp_path):
    cfg = load_config([], [f"run.root={tmp_path}", "world.num_entities=60"])
    a = prepare_corpus(cfg, None)
    assert prepare_corpus(cfg, None) == a  # reused
    other = prepare_corpus(replace(cfg, world=replace(cfg.world, seed=1)), None)
    assert other != a  # a different world never reuses the file (or the index built from it)
