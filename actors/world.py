"""The embedded synthetic world: made-up entities, one passage each, 1-hop, 2-hop and parallel questions.

Why a synthetic world: the default run trains a ~0.6M-parameter policy on 2 CPU cores in minutes.
Real QA needs world knowledge such a model cannot hold; here every answer is a made-up name or a
year that exists *only* in the corpus, so a policy cannot answer without searching, and searching
the entity name with BM25 finds the right passage (measured top-1 hit rate >= 98 %).

What was simplified, and why:

- Every name is two made-up syllable words ("kre vos"), a first and a last syllable from two small
  disjoint inventories, so every token of a held-out name was trained and the first syllable does
  not predict the last: the policy must copy names, it cannot recall them (see ``make_names``).
  Syllables never collide with template words or common English words.
- Text is lowercase words and space-separated punctuation, so ``text.split()`` and the tokenizer's
  whitespace/punctuation pre-tokenizer agree and the vocabulary is closed (no ``<unk>`` in the world).
- Each passage states an entity's facts with one of two sentence templates per relation (chosen per
  entity), in a fixed relation order (see SHUFFLE_SENTENCES for why not shuffled).
- After each retrieval the demonstrations think a short quote of the evidence ("native of tul stes")
  before searching the bridge entity or answering (QUOTE_EVIDENCE): copying what follows a phrase
  is what a 2-layer model learns fast and for unseen entities.
- The gold plan's queries are bare entity names: the entity's own passage mentions it most often
  (title + every sentence) and is short, so BM25 ranks it first (100 % top-1 in the default world,
  with a plain BM25 over title+text and with tantivy over text alone).

What learns (scratch SFT check, default config, batch 64, AdamW 3e-3, 1 thread, 2 seeds):
held-out greedy EM with retrieval in the loop ~60-70 % after 200 steps and 85-87 % after 400 steps
(~0.3 s per step on an idle core). Each design rule below records the variant it beat.

Split by entity (``heldout_fraction`` of each entity kind): a question is held out iff every
entity looked up in its first search step is held out, and it is a training question iff *every*
entity whose fact it uses is a training entity; questions that mix (a training subject whose chain
passes through a held-out entity) are dropped. Hence no fact (entity, relation) of a held-out entity
is ever used by a training question, and the fact that starts each held-out chain is unknowable
without search. (A held-out 2-hop chain may pass through a training entity in its second hop; that
fact alone does not reveal the answer.)

Parallel share (``world.parallel_share``): unset, parallel questions are ~3 % of the held-out set
(the "yes" pairs of two types are scarce); set, ``SHARE_QTYPES`` join and the share holds in both
splits (``_share_parallel``), so a multi-query comparison sees a HotpotQA-like mix.

Pure module: standard library + numpy (and the stdlib-only ``actors.prompts`` for its fixed words).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from sonar.actors import prompts

KINDS = ("country", "city", "company", "person")
_KIND_SHARE = {"country": 0.05, "city": 0.17, "company": 0.23, "person": 0.55}
_MIN_PER_KIND = {"country": 2, "city": 4, "company": 4, "person": 8}
YEARS = tuple(range(1940, 2000))
"""Birth and founding years. 60 year tokens keep the vocabulary small (tokens cost time on 2 cores)."""

# ---------------------------------------------------------------- templates (the closed vocabulary)

INTRO = {
    "city": "{s} is a city .",
    "country": "{s} is a country .",
}
"""Cities and countries get an intro sentence so their name occurs twice in their own passage
(they are mentioned once in many other passages: birthplaces, headquarters, capitals)."""

SENTENCES = {
    "born_in": ("{s} was born in {o} .", "{s} is a native of {o} ."),
    "birth_year": ("{s} has the birth year {o} .", "{s} has the birth date {o} ."),
    "works_for": ("{s} works for {o} .", "{s} is employed by {o} ."),
    "headquartered_in": ("{s} is headquartered in {o} .", "{s} has its head office in {o} ."),
    "founded_year": ("{s} has the founding year {o} .", "{s} dates from {o} ."),
    "founder": ("{s} was created by {o} .", "{s} was started by {o} ."),
    "in_country": ("{s} lies in {o} .", "{s} is part of {o} ."),
    "capital": ("{s} has its capital at {o} .", "{s} has the capital city {o} ."),
}
"""Two wordings per relation; each entity's passage picks one per relation.

Every sentence has the form "<subject> <relation phrase> <object> .". Of the two words before the
object (the quoted evidence, see QUOTE_EVIDENCE), neither occurs in another relation's wordings for
the same entity kind: the first picks the sentence, and the second then has a single continuation
(measured: "has a birth date of <year>" next to "is a native of <city>" made the policy copy the
city after "of"; held-out year quotes were 67-81 % right instead of ~100 %). Wordings such as
"the founder of <s> is <o>", with the subject between the relation words and the object, made the
policy memorise training facts instead of reading (held-out years 0 % teacher-forced)."""

SHUFFLE_SENTENCES = False
"""Shuffle the sentence order within each passage. Off: with shuffled order the same policy reached
18 % held-out greedy EM after 300 SFT steps against 59 % in fixed order (the wording still varies)."""

RELATIONS = {
    "person": ("born_in", "birth_year", "works_for"),
    "company": ("headquartered_in", "founded_year", "founder"),
    "city": ("in_country",),
    "country": ("capital",),
}

KEYWORD = {
    "born_in": "birthplace",
    "birth_year": "birth year",
    "works_for": "employer",
    "headquartered_in": "headquarters",
    "founded_year": "founding year",
    "founder": "founder",
    "in_country": "country",
    "capital": "capital",
}
"""Short reasoning words of a search step: the relation to read in the passage it retrieves."""


@dataclass(frozen=True)
class QType:
    name: str
    template: str
    kind: str
    """Entity kind of the subject(s)."""
    path: tuple[str, ...]
    """Relations followed from the subject; len(path) = hops for chains."""
    parallel: bool = False


QTYPES: tuple[QType, ...] = (
    # one hop
    QType("birthplace", "where was {a} born ?", "person", ("born_in",)),
    QType("birth_year", "in which year was {a} born ?", "person", ("birth_year",)),
    QType("employer", "which company does {a} work for ?", "person", ("works_for",)),
    QType("headquarters", "where is {a} headquartered ?", "company", ("headquartered_in",)),
    QType("founding_year", "in which year was {a} founded ?", "company", ("founded_year",)),
    QType("founder", "who founded {a} ?", "company", ("founder",)),
    QType("city_country", "in which country is the city {a} ?", "city", ("in_country",)),
    QType("capital", "what is the capital of {a} ?", "country", ("capital",)),
    # two hops
    QType("birth_country", "in which country was {a} born ?", "person", ("born_in", "in_country")),
    QType("employer_headquarters", "where is the company that {a} works for headquartered ?", "person",
          ("works_for", "headquartered_in")),
    QType("employer_founder", "who founded the company that {a} works for ?", "person",
          ("works_for", "founder")),
    QType("headquarters_country", "in which country is {a} headquartered ?", "company",
          ("headquartered_in", "in_country")),
    QType("founder_birthplace", "where was the founder of {a} born ?", "company", ("founder", "born_in")),
    # parallel (two entities searched in one step, RAG-R1 multi-query)
    QType("same_birthplace", "were {a} and {b} born in the same city ?", "person", ("born_in",), True),
    QType("same_headquarters", "are {a} and {b} headquartered in the same city ?", "company",
          ("headquartered_in",), True),
)
SHARE_QTYPES: tuple[QType, ...] = (
    QType("same_birth_year", "were {a} and {b} born in the same year ?", "person", ("birth_year",), True),
    QType("same_employer", "do {a} and {b} work for the same company ?", "person", ("works_for",), True),
    QType("same_founding_year", "were {a} and {b} founded in the same year ?", "company", ("founded_year",), True),
    QType("same_founder", "were {a} and {b} founded by the same person ?", "company", ("founder",), True),
    QType("same_city_country", "are the cities {a} and {b} in the same country ?", "city", ("in_country",), True),
    QType("same_birth_country", "were {a} and {b} born in the same country ?", "person",
          ("born_in", "in_country"), True),
)
"""Parallel types used only when ``world.parallel_share`` is set (with the two parallel QTYPES).

Why more types: a "yes" needs two entities of one split sharing a fact, and the held-out split is
small (43 persons, 18 companies at 520 entities): the two default types give ~5 held-out "yes"
pairs, so a balanced yes/no set of parallel questions cannot reach HotpotQA's ~20 % comparison share
from them. These add the other equality checks of every relation, and one two-step comparison
(birth country: birthplaces in one step, their countries in the next, two queries per step), which
has the most "yes" pairs (few countries). Kept apart from QTYPES so the default world, and its
vocabulary, stay exactly as they were."""
QTYPE_BY_NAME = {t.name: t for t in QTYPES + SHARE_QTYPES}

QUOTE_EVIDENCE = True
"""After each retrieval the policy thinks a short quote of the evidence it will use: the two words
before the object in the passage, then the object ("native of tul stes"). Why: copying the token
that follows a phrase it has just written is an induction pattern a 2-layer model learns quickly
and for any entity; without the quote it must map the question to a position in the passage, and
it memorised the training entities' facts instead (held-out years: 16 % vs 90 % for cities)."""
FINAL_THOUGHT = "answer"
"""Thought before the answer when QUOTE_EVIDENCE is off."""
YES, NO = "yes", "no"

# ---------------------------------------------------------------- data types


@dataclass
class Entity:
    name: str
    kind: str
    doc_id: str
    facts: dict[str, str] = field(default_factory=dict)
    """relation -> object (an entity name or a year as text)."""
    wording: dict[str, int] = field(default_factory=dict)
    """relation -> which of the two SENTENCES templates the passage uses."""


@dataclass
class Question:
    qid: str
    question: str
    golds: list[str]
    qtype: str
    hops: int
    """Search steps of the gold plan (parallel questions: 2 queries per step, 1 step or 2 for
    ``same_birth_country``)."""
    entities: list[str]
    """Every entity whose fact the answer uses, first-step subjects first."""
    plan: list[list[str]]
    """Gold search plan: step -> queries. Each query retrieves its gold doc at BM25 top-1."""
    gold_docs: list[list[str]] = field(default_factory=list)
    """Doc ids aligned with ``plan`` (step -> one doc id per query)."""
    thoughts: list[str] = field(default_factory=list)
    """Reasoning words, one per plan step plus one before the answer (len(plan) + 1)."""
    facts: list[tuple[str, str]] = field(default_factory=list)
    """(entity, relation) pairs the answer depends on; the split guarantees these never cross."""

    @property
    def meta(self) -> dict:
        """The question's metadata as a dataset record's (``QAItem.meta``): what reward plug-ins read."""
        return {"qtype": self.qtype, "hops": self.hops}


@dataclass
class World:
    corpus: list[dict]
    """{id, title, text}; one passage per entity, in entity order."""
    train: list[Question]
    heldout: list[Question]
    entities: list[Entity]
    heldout_entities: frozenset[str]
    seed: int = 0
    parallel: dict = field(default_factory=dict)
    """With ``world.parallel_share`` set: the share, the parallel questions per split and type, and the
    sequential questions dropped to reach the share where "yes" pairs ran out (empty otherwise)."""

    def vocab(self) -> list[str]:
        """Sorted words of the corpus, questions, answers, reasoning words and every template.

        Tag strings are excluded (they become special tokens). The words of ``actors.prompts``'
        fixed texts (prompt prefix, instructions, "no results") are included, so every token the
        rollout loop or the demonstrations can produce is in the vocabulary.
        """
        words: set[str] = set()
        for d in self.corpus:
            words.update(words_of(d["title"]))
            words.update(words_of(d["text"]))
        for q in self.train + self.heldout:
            words.update(words_of(q.question))
            for g in q.golds:
                words.update(words_of(g))
            for t in q.thoughts:
                words.update(words_of(t))
        words.update(template_words())
        return sorted(words)

    def doc(self, doc_id: str) -> dict:
        return self.corpus[int(doc_id[1:])]

    def by_name(self) -> dict[str, Entity]:
        return {e.name: e for e in self.entities}


_WORD_RE = re.compile(r"\w+|[^\w\s]+")


def words_of(text: str) -> list[str]:
    """Split like the tokenizer's pre-tokenizer (``\\w+|[^\\w\\s]+``), tag strings removed."""
    for tag in prompts.all_special_tokens():
        text = text.replace(tag, " ")
    return _WORD_RE.findall(text.lower())


def template_words() -> set[str]:
    texts: list[str] = list(INTRO.values()) + [s for pair in SENTENCES.values() for s in pair]
    texts += [t.template for t in QTYPES] + list(KEYWORD.values()) + [FINAL_THOUGHT, YES, NO]
    texts += [" ".join(t.split("{o}")[0].split()[-2:]) for pair in SENTENCES.values() for t in pair]
    # Fixed words of the prompt and document rendering (actors.prompts).
    texts += ["question :", "no results", "title : text"]
    texts += [prompts.instruction(ts) for ts in prompts.PROTOCOLS.values()]
    out: set[str] = set()
    for t in texts:
        out.update(w for w in words_of(t.replace("{s}", " ").replace("{o}", " ")
                                       .replace("{a}", " ").replace("{b}", " ")))
    return out


# ---------------------------------------------------------------- names

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr", "st")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "l", "s", "k", "m")
NAME_FILL = 0.87
"""Share of all first x last syllable combinations that are used as names (sets the inventory size)."""
_COMMON = {
    # English words (and the years' and templates' look-alikes) the syllable grammar can produce
    "bar", "bas", "bel", "ben", "bin", "bit", "bon", "bum", "bun", "bus", "dam", "den", "dim", "din", "dis",
    "don", "dun", "fan", "fen", "fin", "fir", "for", "fun", "fur", "gal", "gas", "gel", "gem", "gin", "gum",
    "gun", "gus", "kin", "kim", "lam", "lim", "lob", "log", "man", "mar", "mas", "mel", "men", "mis", "mob",
    "mom", "mum", "mun", "nan", "nil", "nor", "nun", "nus", "pal", "pam", "pan", "par", "pas", "pen", "per",
    "pin", "pol", "pom", "pun", "pus", "ram", "ran", "ren", "rim", "rom", "rum", "run", "sal", "sam", "sin",
    "sir", "sol", "son", "sum", "sun", "sus", "tan", "tar", "ten", "tin", "tom", "ton", "tum", "tun", "van",
    "vim", "zen", "zin", "ban", "far", "bran", "gen", "bros", "bra", "bro", "dre", "kro", "tre", "tri", "tro", "sta", "ste", "sto", "stu", "bras",
    "brim", "bren", "drum", "dram", "drum", "trim", "tram", "stem", "star", "stun", "stir", "brun", "tril",
    "ba", "be", "bo", "bu", "da", "de", "do", "fa", "fe", "go", "ka", "la", "lo", "ma", "me", "mi", "mo", "mu",
    "na", "ne", "no", "nu", "pa", "pe", "pi", "po", "re", "so", "ta", "te", "ti", "to", "va", "ve", "yo",
    "bak", "dek", "dik", "duk", "fak", "lek", "lik", "luk", "mak", "nak", "pak", "rak", "rok", "sak", "sek",
    "tak", "tik", "tok", "kal", "kar", "kas", "kel", "kik", "kos", "mil", "nil", "pil", "ril", "sil", "til",
    "bis", "bos", "das", "des", "dos", "fas", "fes", "gas", "kis", "las", "les", "los", "mas", "nos", "pos",
    "ras", "res", "ros", "tas", "tes", "vas", "zas", "del", "dal", "dol", "gol", "mol", "val", "vol", "zal",
}


def make_syllables(n: int, rng: np.random.Generator, forbidden: set[str]) -> list[str]:
    """``n`` distinct made-up syllables (onset + vowel + coda), none an English or template word."""
    pool = sorted({o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS} - _COMMON - set(forbidden))
    if n > len(pool):
        raise ValueError(f"{n} name syllables requested but only {len(pool)} exist")
    return [pool[j] for j in sorted(rng.permutation(len(pool))[:n])]


def name_side(n: int) -> int:
    """Syllables per name position: the smallest inventory with ``n <= NAME_FILL * side**2`` (>= 8)."""
    return max(8, math.ceil(math.sqrt(n / NAME_FILL)))


def make_names(n: int, rng: np.random.Generator, forbidden: set[str]) -> list[str]:
    """``n`` unique names "<first> <last>" from two disjoint syllable inventories of ``name_side(n)``.

    Why two words, from small disjoint inventories (24 + 24 syllables for 520 names):
    - a one-word name is one token, and a held-out entity's name then never occurs in any training
      sequence: its embedding stays at random init and the tiny policy cannot copy it (measured:
      57 % teacher-forced held-out answers after 150 s);
    - with a large inventory each first syllable starts only ~3 names, so the policy learns the
      training names' bigrams ("kre" -> "vos") and miscopies held-out names (held-out greedy EM
      52 % with 160 shared syllables vs 85 % with 48, after 400 steps). With most combinations used,
      the first syllable says nothing about the last, so only copying works;
    - disjoint inventories mean no two names are the same bag of words (BM25 cannot tell "a b"
      from "b a").
    """
    side = name_side(n)
    syl = make_syllables(2 * side, rng, forbidden)
    order = rng.permutation(2 * side)
    first, last = [syl[j] for j in order[:side]], [syl[j] for j in order[side:]]
    combos = rng.permutation(side * side)[:n]
    return [f"{first[c // side]} {last[c % side]}" for c in combos]


# ---------------------------------------------------------------- building


def _counts(num_entities: int) -> dict[str, int]:
    counts = {k: max(_MIN_PER_KIND[k], int(round(_KIND_SHARE[k] * num_entities))) for k in KINDS}
    counts["person"] += num_entities - sum(counts.values())
    if counts["person"] < _MIN_PER_KIND["person"]:
        raise ValueError(f"world.num_entities={num_entities} is too small (need >= {sum(_MIN_PER_KIND.values())})")
    return counts


def build_world(cfg) -> World:
    """Deterministic in ``cfg.seed`` and ``cfg.num_entities``/``cfg.heldout_fraction`` (a WorldConfig).

    The question set scales with ``num_entities`` (~5.8 questions per entity: ~3000 at 520).
    """
    if not 0.0 < cfg.heldout_fraction < 1.0:
        raise ValueError(f"world.heldout_fraction={cfg.heldout_fraction} must be in (0, 1)")
    rng = np.random.default_rng([cfg.seed, 0x50A4])
    counts = _counts(cfg.num_entities)
    names = make_names(cfg.num_entities, rng, template_words())
    ents: dict[str, list[Entity]] = {}
    i = 0
    for kind in KINDS:
        ents[kind] = []
        for _ in range(counts[kind]):
            ents[kind].append(Entity(names[i], kind, f"d{i}"))
            i += 1
    countries, cities, companies, persons = (ents[k] for k in KINDS)

    # Facts. Every country gets at least one city; its capital is one of its cities.
    for j, c in enumerate(cities):
        country = countries[j] if j < len(countries) else countries[rng.integers(len(countries))]
        c.facts["in_country"] = country.name
    for k in countries:
        own = [c for c in cities if c.facts["in_country"] == k.name]
        k.facts["capital"] = own[rng.integers(len(own))].name
    # Birthplaces and headquarters follow a skewed distribution so "same city" pairs exist in both splits.
    city_w = 1.0 / np.arange(1, len(cities) + 1) ** 0.7
    city_w /= city_w.sum()
    city_order = rng.permutation(len(cities))
    for p in persons:
        p.facts["born_in"] = cities[city_order[rng.choice(len(cities), p=city_w)]].name
        p.facts["birth_year"] = str(YEARS[rng.integers(len(YEARS))])
        p.facts["works_for"] = companies[rng.integers(len(companies))].name
    hq_order = rng.permutation(len(cities))
    for m in companies:
        m.facts["headquartered_in"] = cities[hq_order[rng.choice(len(cities), p=city_w)]].name
        m.facts["founded_year"] = str(YEARS[rng.integers(len(YEARS))])
        m.facts["founder"] = persons[rng.integers(len(persons))].name

    entities = countries + cities + companies + persons
    corpus = [_passage(e, rng) for e in entities]

    # Entity split, stratified by kind.
    heldout: set[str] = set()
    for kind in KINDS:
        group = ents[kind]
        n_out = max(1, int(round(cfg.heldout_fraction * len(group))))
        for j in rng.permutation(len(group))[:n_out]:
            heldout.add(group[j].name)

    by_name = {e.name: e for e in entities}
    train_q: list[Question] = []
    held_q: list[Question] = []
    for qt in QTYPES:
        if qt.parallel:
            continue
        for e in ents[qt.kind]:
            q = _chain_question(qt, e, by_name)
            _assign(q, heldout, train_q, held_q)
    parallel_info: dict = {}
    share = cfg.parallel_share
    if share is None:  # today's world, drawn exactly as before
        n_pairs = max(1, cfg.num_entities * 2 // 3)
        for qt in QTYPES:
            if not qt.parallel:
                continue
            for split_out, target in ((False, train_q), (True, held_q)):
                group = [e for e in ents[qt.kind] if (e.name in heldout) == split_out]
                share = cfg.heldout_fraction if split_out else 1 - cfg.heldout_fraction
                target.extend(_parallel_questions(qt, group, int(round(n_pairs * share)), rng))
    else:
        srng = np.random.default_rng([cfg.seed, 0x50A4, 0x5A4E])
        parallel_info = {"share": float(share)}
        for split_out, name in ((False, "train"), (True, "heldout")):
            seq = train_q if not split_out else held_q
            par, info = _share_parallel(float(share), seq, ents, heldout, split_out, by_name, srng)
            seq[:] = [seq[j] for j in sorted(srng.permutation(len(seq))[:info["sequential"]])] + par
            parallel_info[name] = info

    order_t = rng.permutation(len(train_q))
    order_h = rng.permutation(len(held_q))
    train_q = [train_q[j] for j in order_t]
    held_q = [held_q[j] for j in order_h]
    for j, q in enumerate(train_q):
        q.qid = f"w{cfg.seed}-t{j:05d}"
    for j, q in enumerate(held_q):
        q.qid = f"w{cfg.seed}-h{j:05d}"
    return World(corpus, train_q, held_q, entities, frozenset(heldout), cfg.seed, parallel_info)


def _passage(e: Entity, rng: np.random.Generator) -> dict:
    e.wording = {r: int(rng.integers(2)) for r in RELATIONS[e.kind]}
    sentences = [SENTENCES[r][e.wording[r]].format(s=e.name, o=e.facts[r]) for r in RELATIONS[e.kind]]
    order = rng.permutation(len(sentences))
    if SHUFFLE_SENTENCES:
        sentences = [sentences[j] for j in order]
    if e.kind in INTRO:
        sentences.insert(0, INTRO[e.kind].format(s=e.name))
    return {"id": e.doc_id, "title": e.name, "text": " ".join(sentences)}


def _chain_question(qt: QType, subject: Entity, by_name: dict[str, Entity]) -> Question:
    chain = [subject]
    for rel in qt.path[:-1]:
        chain.append(by_name[chain[-1].facts[rel]])
    answer = chain[-1].facts[qt.path[-1]]
    return Question(
        qid="", question=qt.template.format(a=subject.name), golds=[answer], qtype=qt.name,
        hops=len(qt.path), entities=[e.name for e in chain], plan=[[e.name] for e in chain],
        gold_docs=[[e.doc_id] for e in chain],
        thoughts=_chain_thoughts(qt, chain),
        facts=[(e.name, r) for e, r in zip(chain, qt.path)])


def quote(e: Entity, rel: str) -> str:
    """"<two words before the object> <object>" exactly as in ``e``'s passage."""
    before = SENTENCES[rel][e.wording[rel]].split("{o}")[0].split()[-2:]
    return " ".join(before + [e.facts[rel]])


def _chain_thoughts(qt: QType, chain: list[Entity]) -> list[str]:
    """Step 0: the first relation's keyword; after each retrieval: the quote of the fact read there."""
    if not QUOTE_EVIDENCE:
        return [KEYWORD[r] for r in qt.path] + [FINAL_THOUGHT]
    return [KEYWORD[qt.path[0]]] + [quote(e, r) for e, r in zip(chain, qt.path)]


def _assign(q: Question, heldout: set[str], train: list[Question], held: list[Question]) -> None:
    if all(n not in heldout for n in q.entities):
        train.append(q)
    elif all(n in heldout for n in q.plan[0]):
        held.append(q)
    # else: a training subject whose chain passes through a held-out entity -> dropped (would leak)


def _parallel_questions(qt: QType, group: Sequence[Entity], n: int, rng: np.random.Generator) -> list[Question]:
    """``n`` (or fewer) distinct unordered pairs from ``group`` with balanced yes/no answers.

    Half are "yes" pairs (same object) if that many exist, else as many "yes" as exist and the same
    number of "no", so no split rewards always answering one word. (A "which was founded first"
    comparison of two years was tried and dropped: after 400 SFT steps the tiny policy answered it
    26 % right teacher-forced, i.e. no better than chance, while equality checks reached 83 %.)
    """
    rel = qt.path[0]
    m = len(group)
    if m < 2 or n <= 0:
        return []
    # The two passages word the fact differently, so each quoted phrase occurs in one passage only
    # (with "born in" in both, the policy quoted the wrong passage; teacher-forced 85 %).
    all_pairs = [(a, b) for a in range(m) for b in range(a + 1, m)
                 if group[a].wording[rel] != group[b].wording[rel]]
    same = [p for p in all_pairs if group[p[0]].facts[rel] == group[p[1]].facts[rel]]
    diff = [p for p in all_pairs if group[p[0]].facts[rel] != group[p[1]].facts[rel]]
    n_yes = min(n // 2, len(same))
    pick = [same[j] for j in rng.permutation(len(same))[:n_yes]]
    pick += [diff[j] for j in rng.permutation(len(diff))[:n_yes]]
    out = []
    for a, b in pick:
        ea, eb = group[a], group[b]
        if rng.random() < 0.5:
            ea, eb = eb, ea
        va, vb = ea.facts[rel], eb.facts[rel]
        gold = YES if va == vb else NO
        out.append(Question(
            qid="", question=qt.template.format(a=ea.name, b=eb.name), golds=[gold], qtype=qt.name,
            hops=1, entities=[ea.name, eb.name], plan=[[ea.name, eb.name]],
            gold_docs=[[ea.doc_id, eb.doc_id]],
            thoughts=[KEYWORD[rel], f"{quote(ea, rel)} {quote(eb, rel)}" if QUOTE_EVIDENCE else f"{va} {vb}"],
            facts=[(ea.name, rel), (eb.name, rel)]))
    return out


def _pair_chains(qt: QType, ea: Entity, eb: Entity, by_name: dict[str, Entity]) -> tuple[list, list] | None:
    """The two chains of a parallel question (subject, then each entity its path leads to), or None
    when a step would put two passages with the same wording side by side (the policy then quoted the
    wrong passage, see ``_parallel_questions``) or the chains meet before their last relation (a step
    would search one entity twice)."""
    ca, cb = [ea], [eb]
    for rel in qt.path[:-1]:
        ca.append(by_name[ca[-1].facts[rel]])
        cb.append(by_name[cb[-1].facts[rel]])
    for x, y, rel in zip(ca, cb, qt.path):
        if x is y or x.wording[rel] == y.wording[rel]:
            return None
    return ca, cb


def _pair_question(qt: QType, ca: list[Entity], cb: list[Entity]) -> Question:
    """"Do a and b share the fact at the end of ``qt.path``?": one search step per relation, each with
    both chains' entities (multi-query: one step of two queries; single-query: two steps)."""
    va, vb = ca[-1].facts[qt.path[-1]], cb[-1].facts[qt.path[-1]]
    if QUOTE_EVIDENCE:
        thoughts = [KEYWORD[qt.path[0]]] + [f"{quote(x, r)} {quote(y, r)}" for x, y, r in zip(ca, cb, qt.path)]
    else:
        thoughts = [KEYWORD[r] for r in qt.path] + [f"{va} {vb}"]
    return Question(
        qid="", question=qt.template.format(a=ca[0].name, b=cb[0].name), golds=[YES if va == vb else NO],
        qtype=qt.name, hops=len(qt.path), entities=[ca[0].name, cb[0].name] + [e.name for x, y in
                                                                             zip(ca[1:], cb[1:]) for e in (x, y)],
        plan=[[x.name, y.name] for x, y in zip(ca, cb)], gold_docs=[[x.doc_id, y.doc_id] for x, y in zip(ca, cb)],
        thoughts=thoughts, facts=[(e.name, r) for x, y, r in zip(ca, cb, qt.path) for e in (x, y)])


def _share_parallel(share: float, seq: list[Question], ents: dict[str, list[Entity]], heldout: set[str],
                    split_out: bool, by_name: dict[str, Entity], rng: np.random.Generator
                    ) -> tuple[list[Question], dict]:
    """Parallel questions of one split forming ``share`` of it with the split's ``seq`` sequential ones.

    Target: ``share / (1 - share) * len(seq)`` parallel questions, rounded to an even count. Each type
    gets as many "yes" as "no" (so neither the split nor a type rewards answering one word), the
    "yes" quota spread evenly over the types that have "yes" pairs (water-filling, capped by each
    type's pairs). Where the "yes" pairs run out before the target, the sequential questions are
    subsampled instead (``info["sequential"]`` of them are kept), so the share still holds.
    Held-out pairs: both subjects held out; training pairs: every entity of both chains a training one.
    """
    cands: dict[str, tuple[list, list]] = {}
    for qt in QTYPES + SHARE_QTYPES:
        if not qt.parallel:
            continue
        group = [e for e in ents[qt.kind] if (e.name in heldout) == split_out]
        yes, no = [], []
        for a in range(len(group)):
            for b in range(a + 1, len(group)):
                chains = _pair_chains(qt, group[a], group[b], by_name)
                if chains is None or (not split_out and any(e.name in heldout for c in chains for e in c)):
                    continue
                (yes if chains[0][-1].facts[qt.path[-1]] == chains[1][-1].facts[qt.path[-1]] else no).append(chains)
        cands[qt.name] = (yes, no)
    caps = {t: min(len(y), len(n)) for t, (y, n) in cands.items()}
    want = 0 if share <= 0 else int(round(share / (1.0 - share) * len(seq) / 2.0))
    quota = {t: 0 for t in caps}
    left = min(want, sum(caps.values()))
    while left > 0:  # water-filling: an even share per open type, capped by its pairs
        open_ = [t for t in caps if quota[t] < caps[t]]
        each = max(1, left // len(open_))
        for t in open_:
            add = min(each, caps[t] - quota[t], left)
            quota[t] += add
            left -= add
            if left == 0:
                break
    out: list[Question] = []
    for qt in QTYPES + SHARE_QTYPES:
        if qt.name not in quota or not quota[qt.name]:
            continue
        for pool in cands[qt.name]:
            for j in sorted(rng.permutation(len(pool))[:quota[qt.name]]):
                ca, cb = pool[j]
                if rng.random() < 0.5:
                    ca, cb = cb, ca
                out.append(_pair_question(qt, ca, cb))
    n_seq = len(seq)
    if share > 0 and len(out) < 2 * want:
        if not out:
            raise ValueError(f"world.parallel_share={share}: the {'held-out' if split_out else 'training'} split has "
                             f"no pair of entities with a shared fact to ask about (world.num_entities too small)")
        n_seq = min(len(seq), int(round(len(out) * (1.0 - share) / share)))
    return out, {"parallel": len(out), "sequential": n_seq, "dropped_sequential": len(seq) - n_seq,
                 "yes": sum(q.golds[0] == YES for q in out), "by_type": {t: 2 * k for t, k in quota.items() if k}}


# ---------------------------------------------------------------- files (Search-R1 / FlashRAG format)


def write_corpus_jsonl(world: World, path: str | Path) -> Path:
    """One ``{"id", "title", "text"}`` line per passage (the retrieval backends' corpus format)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for d in world.corpus:
            f.write(json.dumps({"id": d["id"], "title": d["title"], "text": d["text"]}) + "\n")
    return path


def write_questions_jsonl(questions: Iterable[Question], path: str | Path) -> Path:
    """FlashRAG/Search-R1 lines ``{"id", "question", "golden_answers", "metadata"}``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for q in questions:
            f.write(json.dumps({"id": q.qid, "question": q.question, "golden_answers": list(q.golds),
                                "metadata": {"qtype": q.qtype, "hops": q.hops, "plan": q.plan}}) + "\n")
    return path
