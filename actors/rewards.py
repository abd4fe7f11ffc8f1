"""Answer metrics and trajectory rewards. Pure: standard library + ``cluster.protocol`` constants.

Answer metrics
--------------
``normalize_answer`` is the SQuAD v1.1 / HotpotQA function, unchanged: lowercase, delete ASCII
punctuation (``string.punctuation``), delete the words a/an/the, collapse whitespace. Consequences
worth knowing (each pinned by a test): "1,000" == "1000"; accents are kept ("Zürich" != "Zurich");
non-ASCII punctuation such as curly quotes is *kept* (“Paris” != Paris), as in the official
scripts, so numbers stay comparable with published results.

* ``exact_match``: normalised strings equal.
* ``f1``: token F1 over the normalised tokens with ``Counter`` overlap, plus HotpotQA's rule: if the
  normalised prediction or gold is yes / no / noanswer and they differ, F1 = 0. When either side
  normalises to no tokens, F1 = 1 if both do, else 0 (SQuAD v2; consistent with EM).
* ``cover_em`` (R1-Searcher's ACC_R, "cover exact match": the gold answer is contained in the
  prediction). The paper's wording allows two readings; the R1-Searcher reward/eval code
  (``cover_exact_match_score_1``: "order and adjacency are not considered") uses **token
  containment**: every token of the normalised gold occurs among the normalised prediction's
  tokens. That is what ``cover_em`` implements. ``cover_em_substring`` is the other reading
  (normalised gold is a substring of the normalised prediction, as in FlashRAG's ``acc``); it
  differs on e.g. gold "art" / prediction "party" (substring hit, token miss) and gold
  "paris france" / prediction "france paris" (token hit, substring miss). A gold that normalises to
  nothing covers nothing (0), otherwise every prediction would score.

Several golds: every metric takes the max over golds. No golds or a ``None`` prediction: 0.

Trajectory rewards (``trajectory_reward``)
-------------------------------------------
Format validity comes from ``traj.finish_reason``: ``answered`` is well-formed; ``malformed``,
``max_turns`` and ``max_tokens`` are a broken format; ``retrieval_error`` is neither (the
trajectory ended through no fault of the model: no answer credit, no format credit, no penalty;
the driver should rather drop such trajectories). ``parts`` always holds every key of ``PARTS``:
the raw metrics em, f1, cover_em in [0, 1]; format and retrieval as 0/1 indicators; penalty as the
amount actually added (0 or ``cfg.format_penalty``); num_searches and failed_searches as counts.
``total`` combines them by ``cfg.name``:

=============  =====================================================================
answer_em      em       + format_weight * format
answer_f1      f1       + format_weight * format
cover_em       cover_em + format_weight * format
r1_stage1      0.5 * retrieval + 0.5 * format              (R1-Searcher stage 1)
r1_stage2      f1 + penalty, penalty = format_penalty if the format is broken else 0
rag_r1         em if format else 0                          (RAG-R1)
=============  =====================================================================

R1-Searcher (arXiv 2503.05592, Sec. "Reward Design"; equation numbers as I recall them, the paper
was not available offline): stage 1 is R = R_retrieval + R_format with R_retrieval = 0.5 if the
number of retrieval invocations n >= 1 else 0 (Eq. 1) and R_format = 0.5 if the format is correct
else 0 (Eq. 2). Stage 2 drops the retrieval reward: R = R'_format + R_answer with R'_format = 0 if
the format is correct else -2 (Eq. 3; here ``cfg.format_penalty``) and R_answer the word-level F1
2*IN/(PN+RN) (Eq. 4). The penalty is *added* to F1, as in the paper and its README ("a penalty of
2 points is subtracted from the answer reward"); a trajectory with a broken format normally has no
prediction (F1 = 0), so this equals "format_penalty if broken else F1" except when the rollout
keeps a prediction of a malformed trajectory (e.g. an answer followed by trailing text).
A search call counts for R_retrieval whether or not the backend failed: a ``SearchCall`` exists
only for a parsed ``Search`` (correct query format), and a backend failure is not the model's fault.

RAG-R1 (arXiv 2507.02962) trains with a rule-based outcome reward, exact match of the final answer
(following Search-R1), with no separate format term; a trajectory only scores if it ended with a
well-formed answer.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional

from sonar.cluster.wire.protocol import FinishReason

if TYPE_CHECKING:  # config imports omegaconf; rewards only reads three fields
    from sonar.cluster.wire.config import RewardConfig
    from sonar.cluster.wire.protocol import Trajectory

PARTS = ("em", "f1", "cover_em", "format", "retrieval", "penalty", "num_searches", "failed_searches")
REWARD_NAMES = ("answer_em", "answer_f1", "cover_em", "r1_stage1", "r1_stage2", "rag_r1")
BROKEN_FORMAT = (FinishReason.MALFORMED, FinishReason.MAX_TURNS, FinishReason.MAX_TOKENS)
R1_STAGE1_RETRIEVAL = 0.5
R1_STAGE1_FORMAT = 0.5

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")


# ---------------------------------------------------------------- answer metrics
def normalize_answer(s: str) -> str:
    """SQuAD/HotpotQA normalisation: lower, drop punctuation, drop articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(golds: Iterable[str] | str) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def exact_match(pred: Optional[str], golds: Iterable[str] | str) -> float:
    golds = _golds(golds)
    if pred is None or not golds:
        return 0.0
    p = normalize_answer(pred)
    return max(float(p == normalize_answer(g)) for g in golds)


def _f1_one(p: str, g: str) -> float:
    if (p in _YES_NO or g in _YES_NO) and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    if not pt or not gt:
        return float(pt == gt)
    same = sum((Counter(pt) & Counter(gt)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pt), same / len(gt)
    return 2 * precision * recall / (precision + recall)


def f1(pred: Optional[str], golds: Iterable[str] | str) -> float:
    golds = _golds(golds)
    if pred is None or not golds:
        return 0.0
    p = normalize_answer(pred)
    return max(_f1_one(p, normalize_answer(g)) for g in golds)


def cover_em(pred: Optional[str], golds: Iterable[str] | str) -> float:
    """Token containment: every normalised gold token occurs among the prediction's tokens."""
    golds = _golds(golds)
    if pred is None or not golds:
        return 0.0
    ptoks = set(normalize_answer(pred).split())
    best = 0.0
    for g in golds:
        gtoks = normalize_answer(g).split()
        if gtoks and all(t in ptoks for t in gtoks):
            best = 1.0
    return best


def cover_em_substring(pred: Optional[str], golds: Iterable[str] | str) -> float:
    """The substring reading of cover-EM (FlashRAG ``acc``); not what R1-Searcher's code does."""
    golds = _golds(golds)
    if pred is None or not golds:
        return 0.0
    p = normalize_answer(pred)
    return max(float(bool(normalize_answer(g)) and normalize_answer(g) in p) for g in golds)


# ---------------------------------------------------------------- trajectory reward
@dataclass(frozen=True)
class RewardBreakdown:
    total: float
    parts: dict[str, float] = field(default_factory=dict)
    """Every key of ``PARTS``; logged separately (``rollout/reward/<part>``)."""


def trajectory_reward(cfg: "RewardConfig", traj: "Trajectory") -> RewardBreakdown:
    """Reward of one finished trajectory (see the module docstring for the table and the papers).

    Reads ``cfg.name``, ``cfg.format_weight``, ``cfg.format_penalty`` and ``traj.prediction``,
    ``traj.golds``, ``traj.searches``, ``traj.finish_reason``. Raises ``ValueError`` for an unknown
    reward name or finish reason, and for an ``answered`` trajectory without a prediction.
    """
    finish = traj.finish_reason
    if finish not in FinishReason.ALL:
        raise ValueError(f"trajectory {traj.traj_id!r}: finish_reason={finish!r} is not one of {list(FinishReason.ALL)}")
    pred = traj.prediction
    if finish == FinishReason.ANSWERED and pred is None:
        raise ValueError(f"trajectory {traj.traj_id!r}: finish_reason='answered' but prediction is None")
    fmt = 1.0 if finish == FinishReason.ANSWERED else 0.0
    broken = finish in BROKEN_FORMAT
    n_search = len(traj.searches)
    parts = {
        "em": exact_match(pred, traj.golds),
        "f1": f1(pred, traj.golds),
        "cover_em": cover_em(pred, traj.golds),
        "format": fmt,
        "retrieval": 1.0 if n_search >= 1 else 0.0,
        "penalty": 0.0,
        "num_searches": float(n_search),
        "failed_searches": float(sum(1 for c in traj.searches if c.error is not None)),
    }
    name = cfg.name
    if name == "answer_em":
        total = parts["em"] + cfg.format_weight * fmt
    elif name == "answer_f1":
        total = parts["f1"] + cfg.format_weight * fmt
    elif name == "cover_em":
        total = parts["cover_em"] + cfg.format_weight * fmt
    elif name == "r1_stage1":
        total = R1_STAGE1_RETRIEVAL * parts["retrieval"] + R1_STAGE1_FORMAT * fmt
    elif name == "r1_stage2":
        parts["penalty"] = float(cfg.format_penalty) if broken else 0.0
        total = parts["f1"] + parts["penalty"]
    elif name == "rag_r1":
        total = parts["em"] * fmt
    else:
        raise ValueError(f"reward.name={name!r} is not one of {list(REWARD_NAMES)}")
    return RewardBreakdown(float(total), parts)
