"""Training and evaluating on dataset files (``stages.N.data``, ``eval.data``) without Ray: which
questions a stage trains on, the replay cursor across question sets and resumes, the tiny policy's
vocabulary, and the rollout worker's prompt lookup."""
import json
import types
from pathlib import Path

import pytest

from sonar.actors.datasets import load_dataset
from sonar.cluster.driver.data import (cursor_prompts, eval_questions, extra_vocab, stage_questions,
                                       write_stage_prompts)
from sonar.cluster.driver.run import world_of
from sonar.cluster.wire.config import CONFIG_DIR, load_config
from sonar.cluster.replay.queue import QueuedGroup, ReplayCore

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"
OWN = Path(__file__).resolve().parents[2] / "examples" / "own_data"  # the "your own data" example
HOTPOT, DEV, CORPUS = OWN / "hotpot_mini.json", OWN / "hotpot_mini_dev.json", OWN / "hotpot_mini_corpus.jsonl"
R1 = FIX / "r1_searcher" / "training_set" / "stage_2.jsonl"


def files_cfg(*extra):
    """smoke.yaml's stages: 0 sft (world), 1 rl on hotpot_mini, 2 rl on R1-Searcher's stage-2 layout; the
    held-out evaluation stays the world's (world.force: these tests pin that fallback)."""
    return load_config([CONFIG_DIR / "smoke.yaml"], [f"stages.1.data={HOTPOT}", f"stages.2.data=[{R1}]",
                                                    f"retrieval.corpus={CORPUS}", "world.force=true", *extra])


def test_stage_questions_come_from_the_files_else_the_world():
    cfg = files_cfg()
    world = world_of(cfg)
    assert stage_questions(cfg, cfg.stages[0]) is world.train
    assert [q.qid for q in stage_questions(cfg, cfg.stages[1])] == [f"hm0{i}" for i in range(1, 9)]
    assert [q.question for q in stage_questions(cfg, cfg.stages[2])] == [i.question for i in load_dataset(R1)]
    assert stage_questions(cfg, cfg.stages[1])[4].golds == ["Velmora"]


def test_eval_questions_from_eval_data_else_the_worlds_heldout():
    cfg = files_cfg(f"eval.data={DEV}")
    got = eval_questions(cfg)
    assert [{k: q[k] for k in ("qid", "question", "golds")} for q in got] == [
        {"qid": "hd01", "question": "Who is the mayor of Velmora?", "golds": ["Ada Pell"]},
        {"qid": "hd02", "question": "In what year did the founder of Brightloom found it?", "golds": ["1921"]},
        {"qid": "hd03", "question": "Where was Odile Marr born?", "golds": ["Velmora"]}]
    assert all(isinstance(q["meta"], dict) for q in got)  # the records' small fields, for reward plug-ins
    plain = load_config([CONFIG_DIR / "smoke.yaml"])
    qs = eval_questions(plain)
    held = world_of(plain).heldout[:plain.world.num_heldout_eval]
    assert len(qs) == plain.world.num_heldout_eval == 16 and [q["qid"] for q in qs] == [q.qid for q in held]


@pytest.mark.parametrize("resume_stage, resume_step, source", [
    (0, 0, "world"), (0, 7, "world"),   # inside SFT: no RL stage has walked the cursor yet
    (1, 0, "world"),                    # the checkpoint after SFT: stage 1 has not started
    (1, 2, 1), (2, 0, 1),               # inside stage 1, and the checkpoint at its end
    (2, 1, 2), (3, 0, 2),               # inside stage 2, and after it (before the final evaluation)
])
def test_cursor_prompts_names_the_set_the_saved_cursor_walked(resume_stage, resume_step, source):
    cfg = files_cfg()
    want = len(world_of(cfg).train) if source == "world" else len(stage_questions(cfg, cfg.stages[source]))
    assert cursor_prompts(cfg, resume_stage, resume_step) == want
    assert len({cursor_prompts(cfg, 1, 2), cursor_prompts(cfg, 2, 1), cursor_prompts(cfg, 0, 0)}) == 3  # 8, 3, world


def test_replay_cursor_is_resized_between_stages_and_refused_mid_stage():
    core = ReplayCore(8, 1, "drop", 300, seed=5)
    assert core.set_num_prompts(300) is False          # same set size: the permutation continues
    before = core.cursor
    assert core.set_num_prompts(8) is True and core.cursor is not before
    idx = core.claim(0, 8)
    assert sorted(idx) == list(range(8))               # one epoch over the file's 8 questions
    with pytest.raises(ValueError, match="only between stages"):
        core.set_num_prompts(3)                        # claims outstanding
    core.add(QueuedGroup(b"x", 0, 1, idx[0], 0))
    core.release_worker(0)
    with pytest.raises(ValueError, match="1 queued groups"):
        core.set_num_prompts(3)
    core.drain()                                       # stage end: the queued prompt goes back to the cursor
    assert core.set_num_prompts(3) is True
    assert sorted(core.claim(0, 3)) == [0, 1, 2]       # the old set's requeued index did not carry over
    assert core.balance()["balanced"]


def test_resumed_cursor_of_a_file_stage_loads_after_resizing():
    """What maybe_resume does: size the cursor to the checkpoint's question set, then load its state."""
    core = ReplayCore(8, 1, "drop", 8, seed=1)
    core.claim(0, 3)
    core.release_worker(0)
    state = core.state_dict()
    fresh = ReplayCore(8, 1, "drop", 300, seed=1)      # a new run starts on the world's count
    with pytest.raises(ValueError, match="num_prompts=8"):
        fresh.load_state_dict(state)
    fresh = ReplayCore(8, 1, "drop", 300, seed=1)
    fresh.set_num_prompts(8)
    fresh.load_state_dict(state)
    assert fresh.claim(1, 8) == core.claim(1, 8)


def test_extra_vocab_covers_the_files_and_the_corpus_and_the_policy_has_no_unknown_word(tmp_path):
    from sonar.actors.model import materialise_policy
    from sonar.cluster.wire.policy import load_tokenizer

    cfg = files_cfg(f"eval.data={DEV}")
    words = extra_vocab(cfg)
    assert {"brightloom", "velmora", "oskan", "odile", "marr", "1921", "filmmaker", "4", ",", "210"} <= set(words)
    assert words == sorted(set(words))
    assert extra_vocab(load_config([CONFIG_DIR / "smoke.yaml"])) == []        # the world alone: nothing extra
    assert extra_vocab(files_cfg("model.path=org/hf-model")) == []             # a real model's tokenizer covers it
    world = world_of(cfg)
    plain = load_tokenizer(materialise_policy(cfg.model, world, tmp_path / "plain"))
    wide = load_tokenizer(materialise_policy(cfg.model, world, tmp_path / "wide", extra_vocab=words))
    texts = [q.question for q in stage_questions(cfg, cfg.stages[1])] + [q["golds"][0] for q in eval_questions(cfg)]
    texts += [json.loads(l)["text"] for l in open(CORPUS)]
    unk = wide.unk_token_id
    assert all(unk not in wide.encode(t, add_special_tokens=False) for t in texts)
    assert any(plain.unk_token_id in plain.encode(t, add_special_tokens=False) for t in texts)  # the gap it closes
    assert set(plain.get_vocab()) <= set(wide.get_vocab())  # the world's words are all still there
    for t in plain.all_special_tokens:                      # tags keep their ids: specials come first
        assert wide.convert_tokens_to_ids(t) == plain.convert_tokens_to_ids(t)


def test_stage_prompts_file_lists_what_the_indices_mean(tmp_path):
    cfg = files_cfg()
    qs = stage_questions(cfg, cfg.stages[1])
    path = write_stage_prompts(tmp_path, 1, qs)
    rows = [json.loads(l) for l in open(path)]
    assert path.name == "prompts-stage1.jsonl"
    assert [r["index"] for r in rows] == list(range(8)) and rows[7] == {
        "index": 7, "qid": "hm08", "question": "In which republic is the mountain where the Sarn River starts?",
        "golds": ["Tesk"]}


def test_worker_prompt_items_come_from_the_stage_files():
    """RolloutWorker._prompt_item without Ray or a policy: index i of a file stage is the driver's
    question i; a world stage (or none) is the world's; the files are read once per worker."""
    from sonar.actors.worker import RolloutWorker

    cfg = files_cfg()
    w = types.SimpleNamespace(world=world_of(cfg), _data_cache={})
    w._train_questions = lambda stage: RolloutWorker._train_questions(w, stage)
    for i, q in enumerate(stage_questions(cfg, cfg.stages[1])):
        item = RolloutWorker._prompt_item(w, i, cfg.stages[1])
        assert (item.prompt_id, item.question, item.golds) == (q.qid, q.question, q.golds)
    assert RolloutWorker._prompt_item(w, 2, cfg.stages[2]).prompt_id == "stage_2-3"
    assert RolloutWorker._prompt_item(w, 0, cfg.stages[0]).prompt_id == world_of(cfg).train[0].qid
    assert RolloutWorker._prompt_item(w, 0).prompt_id == world_of(cfg).train[0].qid
    assert len(w._data_cache) == 2
