"""Plug-ins (cluster/wire/plugins.py): a reward, a dataset loader, a field mapping, a tool and a
retriever named by dotted or file path, resolved at load with errors that name the field, the path and
what is missing; a file plug-in's source travels in the config (it resolves after the file is gone);
built-ins are entries of the same registries; the wire's schema 1 messages still decode."""
from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from sonar.cluster.wire import plugins
from sonar.cluster.wire.config import BUILTIN_NAMES, DATA_FORMATS, load_config

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "my_plugins.py"


def test_each_registry_holds_exactly_the_builtin_names_the_config_validates():
    from sonar.actors.datasets import ALIASES, DATASETS
    from sonar.actors.rewards import REWARDS
    from sonar.actors.tools import TOOLS

    assert REWARDS.names() == BUILTIN_NAMES["reward"]
    assert TOOLS.names() == BUILTIN_NAMES["tool"]
    assert set(DATASETS.names()) | set(ALIASES) | {"auto"} == set(DATA_FORMATS)
    pytest.importorskip("sonar.retrieval.factory")
    from sonar.retrieval.factory import RETRIEVERS

    assert RETRIEVERS.names() == BUILTIN_NAMES["retriever"]


@pytest.mark.parametrize("override,match", [
    ("stages.0.reward.name=/nowhere/r.py:fn", r"stages\[0\]\.reward\.name='/nowhere/r.py:fn': file '/nowhere/r.py' does not exist"),
    (f"stages.0.reward.name={PLUGINS}:nope", r"has no attribute 'nope' \(it has: \["),
    (f"stages.0.reward.name={PLUGINS}:make_echo_retriever", r"called with 1 or 2 positional argument.*takes 3 required"),
    ("stages.0.reward.name=no_such_pkg.mod:fn", r"module 'no_such_pkg' not found"),
    ("stages.0.reward.name=answer_emm", r"stages\[0\]\.reward\.name='answer_emm' is not one of .* nor a plug-in"),
    ("retrieval.backend=sonar.actors.rewards:BUILTIN_REWARDS", r"'BUILTIN_REWARDS' is a tuple, not a callable"),
    ("stages.0.reward.name=:fn", r"a plug-in is 'module.path:attr'"),
])
def test_a_bad_plugin_is_refused_at_load_naming_the_field_and_what_is_missing(override, match):
    with pytest.raises(ValueError, match=match):
        load_config([], [override])


@pytest.mark.slow
def test_a_file_plugin_travels_in_the_config_and_resolves_where_the_file_is_absent(tmp_path):
    copy = tmp_path / "mine.py"
    shutil.copy(PLUGINS, copy)
    cfg = load_config([], [f"stages.0.reward.name={copy}:short_answer_reward"])
    assert cfg.plugins == {str(copy): PLUGINS.read_text()}
    blob = pickle.dumps(cfg)
    copy.unlink()  # the file is gone, as on another node: the config carries the code
    code = ("import pickle,sys\n"
            "from sonar.cluster.wire import plugins\n"
            "cfg = pickle.loads(sys.stdin.buffer.read())\n"
            "plugins.remember(cfg.plugins)\n"
            "from sonar.actors.rewards import REWARDS\n"
            "fn = REWARDS.get(cfg.stages[0].reward.name, 'reward.name')\n"
            "print(fn.__name__, fn.__module__.startswith('sonar_plugin_mine_'))\n")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == ["short_answer_reward", "True"]


def test_an_edited_file_is_a_new_module_never_a_stale_one(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def reward(sample):\n    return 1.0\n")
    one = plugins.load(f"{f}:reward", "reward.name")
    f.write_text("def reward(sample):\n    return 2.0\n")
    two = plugins.load(f"{f}:reward", "reward.name")
    assert (one(None), two(None)) == (1.0, 2.0)


def _traj(pred="paris", searches=2):
    from sonar.cluster.wire.protocol import SearchCall, Segment, SegmentKind, Trajectory

    segs = [Segment(SegmentKind.PROMPT, np.arange(3, dtype=np.int32)),
            Segment(SegmentKind.MODEL, np.arange(4, dtype=np.int32), np.zeros(4, np.float32), 1)]
    return Trajectory("t", "g", "p", 0, segs, finish_reason="answered", question="q?", golds=["Paris"],
                      prediction=pred, searches=[SearchCall(i, ["q"], [["d"]], 1.0) for i in range(searches)],
                      meta={"level": "hard"})


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def test_a_reward_plugin_gets_the_sample_and_its_breakdown_is_logged_beside_sonars():
    from sonar.actors.prompts import get_protocol
    from sonar.actors.rewards import make_reward_fn
    from sonar.cluster.wire.config import RewardConfig

    fn = make_reward_fn(RewardConfig(name=f"{PLUGINS}:short_answer_reward"), _Tok(), get_protocol("search_r1"))
    rb = fn(_traj())
    assert rb.total == pytest.approx(0.9)  # EM 1, one search beyond the first
    assert rb.parts["extra_searches"] == 1.0 and rb.parts["em"] == 1.0 and rb.parts["reward_error"] == 0.0


def test_a_reward_plugin_that_raises_is_a_counted_error_not_a_crash(tmp_path, caplog):
    from sonar.actors.prompts import get_protocol
    from sonar.actors.rewards import make_reward_fn
    from sonar.cluster.wire.config import RewardConfig

    f = tmp_path / "bad.py"
    f.write_text("def reward(sample):\n    return sample.metadata['missing']\n")
    fn = make_reward_fn(RewardConfig(name=f"{f}:reward"), _Tok(), get_protocol("search_r1"))
    with caplog.at_level("WARNING", logger="sonar"):
        rb = fn(_traj())
    assert rb.total == 0.0 and rb.parts["reward_error"] == 1.0
    assert "reward plug-in" in caplog.text and "KeyError" in caplog.text
    f.write_text("def reward(sample):\n    return 'high'\n")
    fn = make_reward_fn(RewardConfig(name=f"{f}:reward"), _Tok(), get_protocol("search_r1"))
    assert fn(_traj()).parts["reward_error"] == 1.0  # not a number: an error too


def test_the_reward_input_carries_text_parts_golds_and_metadata():
    from sonar.actors.prompts import get_protocol
    from sonar.actors.rewards import RewardInput

    s = RewardInput(_traj(), _Tok(), get_protocol("search_r1"))
    assert (s.prediction, s.golds, s.metadata, s.searches) == ("paris", ["Paris"], {"level": "hard"}, [["q"], ["q"]])
    assert s.response == "0 1 2 3" and s.model_text == "0 1 2 3" and s.finish_reason == "answered"


def test_a_dataset_plugin_and_a_field_mapping_load_any_file(tmp_path):
    from sonar.actors.datasets import DatasetError, load_datasets

    tsv = tmp_path / "qa.tsv"
    tsv.write_text("who wrote it\tann|anne\nwhere is it\tparis\n")
    items = load_datasets([tsv], fmt=f"{PLUGINS}:load_my_data")
    assert [(i.qid, i.question, i.golds, i.meta) for i in items] == [
        ("tsv-0", "who wrote it", ["ann", "anne"], {"line": 0}), ("tsv-1", "where is it", ["paris"], {"line": 1})]
    js = tmp_path / "mine.jsonl"
    js.write_text(json.dumps({"uid": "a", "query": "q one", "answers": {"text": ["x", "y"]}, "level": 3}) + "\n"
                  + json.dumps({"uid": "b", "query": "q two", "answers": {"text": "z"}, "level": 1}) + "\n")
    items = load_datasets([js], fields={"question": "query", "golds": "answers.text", "qid": "uid"})
    assert [(i.qid, i.question, i.golds, i.meta) for i in items] == [
        ("a", "q one", ["x", "y"], {"level": 3}), ("b", "q two", ["z"], {"level": 1})]
    with pytest.raises(DatasetError, match=r"mine.jsonl: line 1: field 'answer' \(fields.golds\): missing"):
        load_datasets([js], fields={"question": "query", "golds": "answer"})


def test_field_mappings_are_checked_at_load(tmp_path):
    with pytest.raises(ValueError, match=r"eval.fields: unknown key\(s\) \['answer'\]"):
        load_config([], ["eval.fields={question: q, answer: a}"])
    with pytest.raises(ValueError, match=r"names no record key for \['golds'\]"):
        load_config([], ["eval.fields={question: q}"])


def test_plugins_is_filled_at_load_not_by_hand():
    with pytest.raises(ValueError, match="no plug-in field of this config names"):
        load_config([], ["plugins={/x.py: 'print(1)'}"])


def test_schema_1_messages_still_decode():
    """A group encoded by the previous release (schema 1: SearchCall.cache_hits, no tool_calls/meta)."""
    from sonar.cluster.wire.protocol import SCHEMA_VERSION, _default, decode_group

    assert SCHEMA_VERSION == 2
    t = _traj()
    old = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in ("segments", "searches",
                                                                                        "tool_calls", "meta")}
    old["segments"] = [[int(s.kind), s.token_ids, s.logprobs, s.version] for s in t.segments]
    old["searches"] = [dict(dataclasses.asdict(c), cache_hits=0) for c in t.searches]
    blob = msgpack.packb({"v": 1, "t": "group", "p": [old]}, default=_default, use_bin_type=True)
    (back,) = decode_group(blob)
    assert back.tool_calls == [] and back.meta == {} and back.searches == t.searches
    assert back.prediction == "paris" and np.array_equal(back.token_ids(), t.token_ids())


def test_the_plugins_example_loads_with_its_own_command_and_names_every_plugin(monkeypatch):
    """examples/plugins: its config.yaml, loaded from the repository root with the command its header
    gives, resolves every plug-in (the file's source into ``plugins``) and builds its tools."""
    import re

    root = Path(__file__).resolve().parents[2]
    path = root / "examples" / "plugins" / "config.yaml"
    text = path.read_text()
    monkeypatch.chdir(root)
    command = re.search(r"#   sonar train (.*?)\n(?!#)", text, re.S).group(1).replace("\\\n#", "").split()
    assert command[:4] == ["--config", "smoke", "--config", "examples/plugins/config.yaml"]
    assert command[4:] == ["stages.1.reward.name=examples/plugins/my_plugins.py:short_answer_reward"]
    assert f"sonar train {' '.join(command[:4])}" in (path.parent / "README.md").read_text()  # its README's
    cfg = load_config(["smoke", path], command[4:])
    rel = "examples/plugins/my_plugins.py"
    assert cfg.plugins == {rel: PLUGINS.read_text()}
    assert cfg.protocol.tools[-1] == f"{rel}:make_calculator" and cfg.stages[1].reward.name.endswith(":short_answer_reward")
    assert cfg.retrieval.backend == f"{rel}:make_echo_retriever"
    from sonar.actors.tools import build_tools

    assert [t.name for t in build_tools(cfg)] == ["search", "visit", "calc"]


def test_sonar_config_list_names_the_plugin_fields_and_their_builtins(capsys):
    from sonar.cluster.driver.cli import main

    assert main(["config", "list"]) == 0
    out = capsys.readouterr().out
    for kind, (fld, signature) in plugins.FIELDS.items():
        assert f"{fld}" in out and signature in out
    assert "built-in: search, visit" in out and "built-in: tantivy, elasticsearch, dense, http" in out


def test_a_reward_plugin_that_hangs_times_out_as_a_reward_error(tmp_path, caplog):
    """Issue 54, finding 5: a hung reward plug-in had no timeout (unlike tools): the worker's stop timed out
    and failed the run. Now the call is abandoned after reward.timeout_s and scores as a reward error."""
    import threading

    from sonar.actors.prompts import get_protocol
    from sonar.actors.rewards import make_reward_fn
    from sonar.cluster.wire.config import RewardConfig

    f = tmp_path / "hangs.py"
    f.write_text("import threading\nGATE = threading.Event()\n\ndef reward(sample):\n    GATE.wait()\n    return 1.0\n")
    fn = make_reward_fn(RewardConfig(name=f"{f}:reward", timeout_s=0.2), _Tok(), get_protocol("search_r1"))
    from sonar.cluster.wire.plugins import load

    gate = load(f"{f}:reward", "reward.name").__globals__["GATE"]  # the module the reward function runs in
    try:
        with caplog.at_level("WARNING", logger="sonar"):
            rb = fn(_traj())
        assert rb.total == 0.0 and rb.parts["reward_error"] == 1.0
        assert "reward.timeout_s=0.2" in caplog.text
    finally:
        gate.set()  # the abandoned thread ends
    assert isinstance(gate, threading.Event)
