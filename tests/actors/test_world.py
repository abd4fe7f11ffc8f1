"""The synthetic world: determinism, the entity split (no fact leaks), answerability and BM25 plans."""
import json
import math
import re
from collections import Counter, defaultdict

import numpy as np
import pytest

from sonar.actors import world as W
from sonar.cluster.wire.config import WorldConfig

SMALL = WorldConfig(seed=3, num_entities=120)


class TinyBM25:
    """Okapi BM25 (k1=1.2, b=0.75) over "title text" with the world's word split.

    Test-only reference retriever implementing retrieval.base's ``batch_search(queries, k)``.
    """

    name = "tiny-bm25"

    def __init__(self, corpus, k1=1.2, b=0.75):
        from sonar.retrieval.base import Hit
        self._hit = Hit
        self.docs = corpus
        toks = [W.words_of(f"{d['title']} {d['text']}") for d in corpus]
        self.tf = [Counter(t) for t in toks]
        self.len = np.array([len(t) for t in toks], dtype=np.float64)
        df = Counter(w for t in toks for w in set(t))
        n = len(corpus)
        self.idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}
        self.post = defaultdict(list)
        for i, tf in enumerate(self.tf):
            for w in tf:
                self.post[w].append(i)
        self.k1, self.b, self.avg = k1, b, self.len.mean()

    def search(self, query, k):
        scores = np.zeros(len(self.docs))
        for w in set(W.words_of(query)):
            for i in self.post.get(w, ()):
                f = self.tf[i][w]
                scores[i] += self.idf[w] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * self.len[i] / self.avg))
        order = [i for i in np.argsort(-scores, kind="stable")[:k] if scores[i] > 0]
        return [self._hit(self.docs[i]["id"], self.docs[i]["title"], self.docs[i]["text"], float(scores[i]))
                for i in order]

    def batch_search(self, queries, k):
        return [self.search(q, k) for q in queries]


@pytest.fixture(scope="module")
def small():
    return W.build_world(SMALL)


@pytest.fixture(scope="module")
def default():
    return W.build_world(WorldConfig())


def _dump(w):
    return json.dumps([w.corpus, [q.__dict__ for q in w.train], [q.__dict__ for q in w.heldout]], default=list)


def test_deterministic_by_seed(small):
    assert _dump(W.build_world(SMALL)) == _dump(small)
    other = W.build_world(WorldConfig(seed=4, num_entities=120))
    assert _dump(other) != _dump(small)


def test_default_size(default):
    n = len(default.train) + len(default.heldout)
    assert len(default.corpus) == 520
    assert 2600 <= n <= 3400, n
    assert 0.10 <= len(default.heldout) / n <= 0.22
    types = Counter(q.qtype for q in default.train)
    assert set(types) == {t.name for t in W.QTYPES}
    assert len({q.qid for q in default.train + default.heldout}) == n
    # yes/no questions are balanced in both splits
    for qs in (default.train, default.heldout):
        for qtype in ("same_birthplace", "same_headquarters"):
            yn = Counter(q.golds[0] for q in qs if q.qtype == qtype)
            assert yn["yes"] == yn["no"] > 0, (qtype, yn)


def test_names_unique_made_up(default):
    names = [e.name for e in default.entities]
    assert len(set(names)) == len(names)
    syllables = {s for n in names for s in n.split()}
    assert not syllables & W.template_words()
    assert all(re.fullmatch(r"[a-z]+ [a-z]+", n) for n in names)
    side = W.name_side(len(names))
    firsts, lasts = {n.split()[0] for n in names}, {n.split()[1] for n in names}
    assert not firsts & lasts and len(firsts) <= side and len(lasts) <= side
    assert len({frozenset(n.split()) for n in names}) == len(names)  # BM25 sees bags of words
    assert [d["title"] for d in default.corpus] == names


def test_text_is_closed_lowercase_spaced(small):
    vocab = set(small.vocab())
    assert small.vocab() == sorted(vocab)
    for d in small.corpus:
        for field in ("title", "text"):
            assert d[field] == d[field].lower()
            assert d[field].split() == W.words_of(d[field])  # punctuation is space-separated
            assert set(d[field].split()) <= vocab
    for q in small.train + small.heldout:
        assert q.question.split() == W.words_of(q.question)
        assert set(q.question.split()) <= vocab


def test_split_by_entity_no_fact_leak(default):
    held = default.heldout_entities
    train_subjects = {n for q in default.train for n in q.plan[0]}
    held_subjects = {n for q in default.heldout for n in q.plan[0]}
    assert train_subjects and held_subjects
    assert not train_subjects & held_subjects
    assert held_subjects <= held
    train_facts = {f for q in default.train for f in q.facts}
    # no training question uses any fact of a held-out entity
    assert not {e for e, _ in train_facts} & held
    # the fact that starts every held-out chain is never seen in training
    for q in default.heldout:
        assert not set(q.facts[:len(q.plan[0])]) & train_facts
    # every kind has held-out entities
    kinds = {e.kind for e in default.entities if e.name in held}
    assert kinds == set(W.KINDS)


def test_gold_answers_in_gold_docs(small):
    by_id = {d["id"]: d for d in small.corpus}
    ents = small.by_name()
    for q in small.train + small.heldout:
        assert len(q.gold_docs) == len(q.plan) == q.hops
        assert [len(s) for s in q.plan] == [len(s) for s in q.gold_docs]
        assert len(q.thoughts) == len(q.plan) + 1
        for step_q, step_d in zip(q.plan, q.gold_docs):
            for query, doc_id in zip(step_q, step_d):
                assert by_id[doc_id]["title"] == query
        # every fact the answer uses is stated in that entity's passage
        for name, rel in q.facts:
            text = by_id[ents[name].doc_id]["text"]
            assert f" {ents[name].facts[rel]} ." in text
        gold = q.golds[0]
        if gold in ("yes", "no"):
            rel = W.QTYPE_BY_NAME[q.qtype].path[0]
            a, b = (ents[n].facts[rel] for n in q.entities)
            assert gold == ("yes" if a == b else "no")
        else:
            last_docs = [f' {by_id[d]["title"]} {by_id[d]["text"]} ' for d in q.gold_docs[-1]]
            assert any(f" {gold} " in t for t in last_docs), (q, last_docs)


def test_chain_answers_follow_the_facts(small):
    ents = small.by_name()
    qt = W.QTYPE_BY_NAME
    for q in small.train + small.heldout:
        t = qt[q.qtype]
        if t.parallel:
            continue
        cur = q.entities[0]
        for rel in t.path:
            cur = ents[cur].facts[rel]
        assert q.golds == [cur]


def _hit_rate(w):
    bm = TinyBM25(w.corpus)
    total = hits = 0
    for q in w.train + w.heldout:
        for step_q, step_d in zip(q.plan, q.gold_docs):
            res = bm.batch_search(step_q, 1)
            for r, d in zip(res, step_d):
                total += 1
                hits += bool(r) and r[0].doc_id == d
    return hits / total


def test_plan_queries_hit_gold_doc_top1_small(small):
    assert _hit_rate(small) >= 0.98


def test_plan_queries_hit_gold_doc_top1_default(default, capsys):
    rate = _hit_rate(default)
    with capsys.disabled():
        print(f"\n[world] default world BM25 top-1 hit rate of gold plan queries: {rate:.4f}")
    assert rate >= 0.98


def test_jsonl_writers(small, tmp_path):
    p = W.write_corpus_jsonl(small, tmp_path / "corpus.jsonl")
    rows = [json.loads(l) for l in p.read_text().splitlines()]
    assert rows == [{"id": d["id"], "title": d["title"], "text": d["text"]} for d in small.corpus]
    p = W.write_questions_jsonl(small.heldout, tmp_path / "q" / "test.jsonl")
    rows = [json.loads(l) for l in p.read_text().splitlines()]
    assert [(r["id"], r["question"], r["golden_answers"]) for r in rows] == \
        [(q.qid, q.question, q.golds) for q in small.heldout]


def test_bad_config():
    with pytest.raises(ValueError, match="heldout_fraction"):
        W.build_world(WorldConfig(heldout_fraction=0.0))
    with pytest.raises(ValueError, match="num_entities"):
        W.build_world(WorldConfig(num_entities=10))


def test_quoted_evidence_is_in_the_passage(small):
    """After each retrieval the thought quotes the passage: its first word occurs once there."""
    by_id = {d["id"]: d for d in small.corpus}
    for q in small.train + small.heldout:
        if W.QTYPE_BY_NAME[q.qtype].parallel:
            ents = small.by_name()
            quotes = [W.quote(ents[n], r) for n, r in q.facts]
            assert q.thoughts[1] == " ".join(quotes)
            docs = q.gold_docs[0]
        else:
            quotes, docs = q.thoughts[1:], [d[0] for d in q.gold_docs]
        for quote, doc_id in zip(quotes, docs):
            text = by_id[doc_id]["text"]
            assert f" {quote} ." in text, (quote, text)
            assert text.split().count(quote.split()[0]) == 1, (quote, text)


def test_sentence_cue_words_unique_per_kind():
    """The two quoted words of a wording occur in no other relation's wordings of that kind."""
    for kind, rels in W.RELATIONS.items():
        for r in rels:
            for t in W.SENTENCES[r]:
                others = [o for rr in rels if rr != r for o in W.SENTENCES[rr]] + [W.INTRO.get(kind, "")]
                for word in t.split("{o}")[0].split()[-2:]:
                    assert all(word not in o.split() for o in others), (kind, r, word)


def test_parallel_pairs_word_the_fact_differently(small):
    ents = small.by_name()
    qs = [q for q in small.train + small.heldout if W.QTYPE_BY_NAME[q.qtype].parallel]
    assert qs
    for q in qs:
        (a, rel), (b, _) = q.facts
        assert ents[a].wording[rel] != ents[b].wording[rel]
