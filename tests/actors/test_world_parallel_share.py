"""``world.parallel_share`` (issue 11): a world whose training and held-out questions are that share
parallel (RAG-R1's multi-query case), yes/no balanced per type, split by entity without leaks, and
learnable through demonstrations under both RAG-R1 protocols; None leaves today's world untouched."""
import hashlib
import json
from collections import Counter

import pytest

from sonar.actors import world as W
from sonar.actors.demos import make_demonstrations
from sonar.actors.parsing import Answer, Search, parse_turn
from sonar.actors.prompts import get_protocol
from sonar.actors.tokenizer import build_tokenizer
from sonar.cluster.wire.config import ProtocolConfig, WorldConfig
from sonar.cluster.wire.protocol import SegmentKind
from tests.actors.test_world import TinyBM25

HOTPOT = 1487 / 7405  # HotpotQA distractor dev: 1,487 comparison of 7,405 questions


def _fingerprint(w):
    d = json.dumps([w.corpus, [q.__dict__ for q in w.train], [q.__dict__ for q in w.heldout]],
                   default=list, sort_keys=True)
    return hashlib.sha256(d.encode()).hexdigest(), hashlib.sha256(" ".join(w.vocab()).encode()).hexdigest()


def _par(qs):
    return [q for q in qs if W.QTYPE_BY_NAME[q.qtype].parallel]


@pytest.fixture(scope="module")
def share_world():
    return W.build_world(WorldConfig(seed=3, num_entities=120, parallel_share=HOTPOT))


@pytest.fixture(scope="module")
def share_default():
    return W.build_world(WorldConfig(parallel_share=HOTPOT))


def test_unset_share_is_todays_world_exactly():
    """Corpus, questions (ids, plans, thoughts) and vocabulary hashed as they were before the knob
    existed (checked against the previous commit's world.py when pinned)."""
    assert _fingerprint(W.build_world(WorldConfig())) == (
        "90bfec2ff6e209479da492c809e0ebe74ad25084f9e3e2535f1ea3b5ee86dc48",
        "8bd5f33e507adda00ba3c9524900a4295a653f1c6bc0a7a6e08291d34ae228d1")
    assert _fingerprint(W.build_world(WorldConfig(seed=3, num_entities=120))) == (
        "a7fdc319a492533afbcb09f62a9c46364817ecabef8d874c78477b9229c3e05a",
        "da60d4f7e3f32d9d2362a28ab4a0075384c90d3e9078b8872632017d85857f12")
    assert W.build_world(WorldConfig()).parallel == {}


@pytest.mark.parametrize("n, share", [(120, HOTPOT), (120, 0.5), (520, 0.5), (120, 0.0)])
def test_share_is_hit_in_both_splits_with_yes_no_balanced_per_type(n, share):
    w = W.build_world(WorldConfig(seed=3, num_entities=n, parallel_share=share))
    for name, qs in (("train", w.train), ("heldout", w.heldout)):
        par = _par(qs)
        # within rounding: the parallel count is even (balanced) and the kept sequential count rounded
        assert abs(len(par) / len(qs) - share) <= 1.5 / len(qs), (name, len(par), len(qs))
        info = w.parallel[name]
        assert info["parallel"] == len(par) and info["sequential"] == len(qs) - len(par)
        for qtype, k in Counter(q.qtype for q in par).items():
            golds = Counter(q.golds[0] for q in par if q.qtype == qtype)
            assert golds[W.YES] == golds[W.NO] == k // 2, (name, qtype, golds)
        assert len({q.question for q in par}) == len(par)  # distinct pairs
    if share:
        assert len(_par(w.heldout)) >= 4


def test_default_size_world_at_hotpot_share(share_default):
    """The bench's world: the share holds on both splits; the held-out "yes" pairs run out, so held-out
    sequential questions are dropped (recorded), training keeps all of them; the added types make
    most of the held-out parallel questions."""
    w = share_default
    for name, qs in (("train", w.train), ("heldout", w.heldout)):
        assert abs(len(_par(qs)) / len(qs) - HOTPOT) <= 1.5 / len(qs)
    assert w.parallel["train"]["dropped_sequential"] == 0
    assert w.parallel["heldout"]["dropped_sequential"] > 0
    assert len(_par(w.heldout)) >= 40
    shared = {t.name for t in W.SHARE_QTYPES}
    assert sum(q.qtype in shared for q in _par(w.heldout)) > len(_par(w.heldout)) / 2
    # the sequential questions kept are today's questions (same plans), a subset of them
    base = W.build_world(WorldConfig())
    plans = {(q.question, q.golds[0]) for q in base.train + base.heldout}
    assert all((q.question, q.golds[0]) in plans for q in w.train + w.heldout
               if not W.QTYPE_BY_NAME[q.qtype].parallel)


def test_no_fact_leaks_across_the_split(share_default):
    w = share_default
    held = w.heldout_entities
    train_facts = {f for q in w.train for f in q.facts}
    assert not {e for e, _ in train_facts} & held  # no training question uses a held-out entity
    assert not {n for q in w.train for n in q.entities} & held
    for q in w.heldout:
        assert set(q.plan[0]) <= held
        assert not set(q.facts[:len(q.plan[0])]) & train_facts  # the first step is unknowable without search


def test_parallel_answers_plans_and_quotes_follow_the_passages(share_world):
    w = share_world
    ents, by_id = w.by_name(), {d["id"]: d for d in w.corpus}
    seen = set()
    for q in _par(w.train + w.heldout):
        qt = W.QTYPE_BY_NAME[q.qtype]
        seen.add(q.qtype)
        assert q.hops == len(q.plan) == len(qt.path) and len(q.thoughts) == len(q.plan) + 1
        chains = list(zip(*q.plan))  # the two entities' chains
        for chain in chains:
            for rel, a, b in zip(qt.path, chain, chain[1:]):
                assert ents[a].facts[rel] == b
        va, vb = (ents[c[-1]].facts[qt.path[-1]] for c in chains)
        assert q.golds == [W.YES if va == vb else W.NO]
        for step, (queries, docs) in enumerate(zip(q.plan, q.gold_docs)):
            rel = qt.path[step]
            assert [by_id[d]["title"] for d in docs] == queries
            assert ents[queries[0]].wording[rel] != ents[queries[1]].wording[rel]
            quotes = [W.quote(ents[n], rel) for n in queries]
            assert q.thoughts[step + 1] == " ".join(quotes)
            for quote, d in zip(quotes, docs):
                assert f" {quote} ." in by_id[d]["text"]
    assert {"same_birth_country", "same_employer"} <= seen


def test_plan_queries_hit_their_gold_doc_top1(share_world):
    bm25 = TinyBM25(share_world.corpus)
    for q in _par(share_world.train + share_world.heldout):
        for queries, docs in zip(q.plan, q.gold_docs):
            assert [h[0].doc_id for h in bm25.batch_search(queries, 1)] == docs, q.question


@pytest.mark.parametrize("name", ["rag_r1_multi", "rag_r1"])
def test_demonstrations_of_every_parallel_type_parse(share_world, name):
    """One demonstration per parallel type: multi-query searches both entities in one step, single-query
    in two consecutive steps; every MODEL turn parses back to the planned queries, then the gold."""
    w = share_world
    tok = build_tokenizer(w.vocab())
    tags, proto = get_protocol(name), ProtocolConfig(name=name, max_turns=5)
    qs = list({q.qtype: q for q in _par(w.train + w.heldout)}.values())
    demos = make_demonstrations(qs, tags, tok, TinyBM25(w.corpus), proto, 1)
    for q, d in zip(qs, demos):
        turns = [tok.decode(s.token_ids.tolist()) for s in d.segments if s.kind == SegmentKind.MODEL]
        want = q.plan if name == "rag_r1_multi" else [[x] for step in q.plan for x in step]
        acts = [parse_turn(t, tags, proto.max_queries_per_step) for t in turns]
        assert acts[:-1] == [Search(x) for x in want], (q.question, turns)
        assert acts[-1] == Answer(q.golds[0])
        assert [c.doc_ids for c in d.searches] == [[[x] for x in step] for step in
                                                   (q.gold_docs if name == "rag_r1_multi" else
                                                    [[x] for s in q.gold_docs for x in s])]
        assert tok.unk_token_id not in d.token_ids().tolist()


def test_bad_share_is_refused():
    from sonar.cluster.wire.config import load_config

    with pytest.raises(ValueError, match=r"world.parallel_share=1"):
        load_config([], ["world.parallel_share=1.0"])
    load_config([], ["world.parallel_share=0.2"])
