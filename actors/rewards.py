"""Answer metrics and trajectory rewards. Pure: standard library, ``cluster.wire`` and ``actors.prompts``.

Two normalisations, each as its upstream code has it (every rule pinned by tests/actors/test_rewards.py)
----------------------------------------------------------------------------------------------------------
``normalize_answer`` (SQuAD v1.1 / HotpotQA ``hotpot_evaluate_v1.py``, also Search-R1's and RAG-R1's
``qa_em.py``): lowercase, *delete* ASCII punctuation (``string.punctuation``, ``_`` included), delete
the words a/an/the, collapse whitespace. "1,000" == "1000", "Saint-Denis" -> "saintdenis"; accents and
non-ASCII punctuation (curly quotes) are kept.

``normalize_answer_r1`` (R1-Searcher ``evaluation/metric_calc_rule.py``, copied into its reward
servers): ``_`` becomes a space, lowercase, ASCII punctuation *and* the characters ‘ ’ ´ ` become
spaces, then articles and whitespace as above. "Saint-Denis" -> "saint denis", "1,000" -> "1 000",
"O’Brien" -> "o brien". The curly double quotes “ ” are not in its set and are kept. Before
normalising, R1-Searcher maps the exact strings "True" / "False" (case-sensitive, whole string) to
"yes" / "no" (``bool_mapping``), on both prediction and gold.

Metrics (max over golds; no golds or a ``None`` prediction: 0, where upstream would crash)
------------------------------------------------------------------------------------------
* ``exact_match`` / ``f1``: HotpotQA's official EM and F1 (F1 = token F1 with ``Counter`` overlap; if
  either side normalises to yes / no / noanswer and they differ, 0; no common token, 0 -- so two
  strings that both normalise to nothing have EM 1 and **F1 0**, exactly as the official script).
* ``exact_match_r1`` / ``f1_r1``: the same two formulas over ``bool_mapping`` + ``normalize_answer_r1``
  (R1-Searcher's EM and F1).
* ``acc_r``: R1-Searcher's cover-EM (``cover_exact_match_score_1``, reported as ACC_R / "Cover-EM"):
  every token of the normalised gold occurs among the normalised prediction's tokens, order and
  adjacency ignored. Tokens come from ``str.split(" ")`` as upstream, so a gold that normalises to
  nothing is covered only by a prediction that does too (gold "a", prediction "the": 1).

Trajectory rewards (``trajectory_reward``)
-------------------------------------------
Sonar's own format validity comes from ``traj.finish_reason``: ``answered`` is well-formed;
``malformed``, ``max_turns`` and ``max_tokens`` are a broken format; ``retrieval_error`` is neither
(the trajectory ended through no fault of the model: no answer credit, no format credit, no
penalty; the code variants score it 0 outright; the driver should rather drop such trajectories). ``parts`` always holds
every key of ``PARTS``: the metrics em, f1 (HotpotQA), acc_r, f1_r1 (R1-Searcher) in [0, 1]; format
and retrieval as 0/1 indicators (as the chosen variant judges them); penalty as the amount actually
added (0 or ``cfg.format_penalty``); num_searches and failed_searches as counts. ``total`` by
``cfg.name`` (and ``cfg.variant`` for R1-Searcher):

==========================  ======================================================================
answer_em / answer_f1       em / f1 + format_weight * format
cover_em                    acc_r + format_weight * format
search_r1, rag_r1           em if answered else 0 (Search-R1 ``qa_em.compute_score_em``, format_score
                            0; RAG-R1 ships the same file unchanged): no format term
r1_stage1, paper            0.5 * retrieval + 0.5 * format; retrieval = at least one search call
r1_stage1, code_llama       (+1 if the servers' answer covers a gold else -1) + 0.5 * retrieval + 0.5 *
                            format, with the Llama stage-1 server's rules (below)
r1_stage2, paper            f1_r1 + penalty, penalty = format_penalty if the finish reason is broken
r1_stage2, code_qwen        f1_r1 of the servers' answer (0 without one) + penalty if any Qwen-server
                            rule fails
r1_stage2, code_llama       the same with the Llama stage-2 server's rules
==========================  ======================================================================

The code variants read the decoded response (``ResponseText``), as R1-Searcher's reward servers read
the ``solution`` string: ``full`` is everything after the prompt (model text and injected documents),
``model`` the model's own text (the servers' solution with the document blocks cut out). The answer is
the servers' too (``server_answer``): the last answer_open's text in the whole response, whichever turn
wrote it, so an answer written before a later search still scores, where ``traj.prediction`` is the
last turn's; the answer metrics in ``parts`` are recomputed on it. Rules:

* documents (all three servers): the counts of query_open, query_close, docs_open, docs_close and of
  search calls that brought at least one document back are equal (the servers count
  ``<|begin_of_documents|>\\n(1)``, a block whose first document exists). A failed search (Sonar
  injects "no results") therefore breaks it, as a block without "(1)" did upstream. Stage 1 also
  needs the count >= 1: that is its ``retrieval``.
* think/answer: no think_open after the prompt when the prompt prefills it (R1-Searcher's templates end
  in ``<think>``; one think_open otherwise), exactly one think_close, exactly one answer_open and
  answer_close (Llama: one condition; Qwen: the same conditions checked separately).
* Qwen only: neither "Assistant" nor "assistant" anywhere in ``full`` (documents included, as the
  server does); the answer holds neither substring "begin_of_query" nor "begin_of_documents" (the
  server's test: plain substrings, not the tags); the answer has at most ``R1_MAX_ANSWER_WORDS``
  whitespace words.
* Qwen and Llama stage 2: no CJK character (U+4E00..U+9FFF) in ``model``.

The finish reason is not read (but ``retrieval_error``, scored 0): a response without an answer fails
the answer-count rule, so it is broken in every code variant, as on the servers. What the paper says and what each server does differ; README.md ("Rewards and metrics:
paper vs released code") tabulates every difference.
"""
from __future__ import annotations

import logging
import math
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from sonar.cluster.wire.plugins import Registry, is_plugin, positional_arity
from sonar.cluster.wire.protocol import FinishReason, SegmentKind

log = logging.getLogger("sonar")

if TYPE_CHECKING:  # config imports omegaconf; rewards only reads a few fields
    from sonar.actors.prompts import TagSet
    from sonar.cluster.wire.config import RewardConfig
    from sonar.cluster.wire.protocol import Trajectory

PARTS = ("em", "f1", "acc_r", "f1_r1", "format", "retrieval", "penalty", "num_searches", "failed_searches")
VARIANTS = ("paper", "code_qwen", "code_llama")
"""``RewardConfig.variant``: the paper's formulas, or R1-Searcher's released Qwen / Llama reward server."""
BROKEN_FORMAT = (FinishReason.MALFORMED, FinishReason.MAX_TURNS, FinishReason.MAX_TOKENS)
R1_STAGE1_RETRIEVAL = 0.5
R1_STAGE1_FORMAT = 0.5
R1_MAX_ANSWER_WORDS = 10
"""Qwen server: an answer of more than 10 whitespace-separated words is a broken format."""

_PUNCT = frozenset(string.punctuation)
_PUNCT_R1 = frozenset(string.punctuation + "‘’´`")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")


# ---------------------------------------------------------------- normalisations
def normalize_answer(s: str) -> str:
    """SQuAD/HotpotQA: lower, delete ASCII punctuation, delete articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def normalize_answer_r1(s: str) -> str:
    """R1-Searcher: ``_`` -> space, lower, punctuation and ‘ ’ ´ ` -> space, delete articles, collapse."""
    s = s.replace("_", " ").lower()
    s = "".join(" " if ch in _PUNCT_R1 else ch for ch in s)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def bool_mapping(s: str) -> str:
    """R1-Searcher: the exact strings "True" / "False" become "yes" / "no"; anything else unchanged."""
    return {"True": "yes", "False": "no"}.get(s, s)


def _r1(s: str) -> str:
    return normalize_answer_r1(bool_mapping(s))


def _golds(golds: Iterable[str] | str) -> list[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def _max_over(fn: Callable[[str, str], float], norm: Callable[[str], str],
              pred: Optional[str], golds: Iterable[str] | str) -> float:
    golds = _golds(golds)
    if pred is None or not golds:
        return 0.0
    p = norm(pred)
    return max(fn(p, norm(g)) for g in golds)


# ---------------------------------------------------------------- metrics on normalised strings
def _em_one(p: str, g: str) -> float:
    return float(p == g)


def _f1_one(p: str, g: str) -> float:
    """HotpotQA's f1_score on normalised strings (R1-Searcher's is the same formula)."""
    if (p in _YES_NO or g in _YES_NO) and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    same = sum((Counter(pt) & Counter(gt)).values())
    if same == 0:  # also when both are empty: the official script returns 0
        return 0.0
    precision, recall = same / len(pt), same / len(gt)
    return 2 * precision * recall / (precision + recall)


def _cover_one(p: str, g: str) -> float:
    ptoks = p.split(" ")
    return float(all(t in ptoks for t in g.split(" ")))


def exact_match(pred: Optional[str], golds: Iterable[str] | str) -> float:
    """HotpotQA/SQuAD EM."""
    return _max_over(_em_one, normalize_answer, pred, golds)


def f1(pred: Optional[str], golds: Iterable[str] | str) -> float:
    """HotpotQA F1 (official script, including 0 for two empty normalised strings)."""
    return _max_over(_f1_one, normalize_answer, pred, golds)


def exact_match_r1(pred: Optional[str], golds: Iterable[str] | str) -> float:
    """R1-Searcher's EM (``metric_calc_rule.exact_match_score``)."""
    return _max_over(_em_one, _r1, pred, golds)


def f1_r1(pred: Optional[str], golds: Iterable[str] | str) -> float:
    """R1-Searcher's F1 (``metric_calc_rule.f1_score``), the answer reward of its stage 2."""
    return _max_over(_f1_one, _r1, pred, golds)


def acc_r(pred: Optional[str], golds: Iterable[str] | str) -> float:
    """R1-Searcher's cover-EM, ACC_R (``metric_calc_rule.cover_exact_match_score_1``)."""
    return _max_over(_cover_one, _r1, pred, golds)


# ---------------------------------------------------------------- the response as the servers read it
@dataclass(frozen=True)
class ResponseText:
    """The decoded response of a trajectory, what R1-Searcher's reward servers read."""

    full: str
    """Everything after the prompt: model text and injected documents (the servers' ``solution``)."""
    model: str
    """The MODEL segments only (the solution with its document blocks cut out)."""
    think_prefilled: bool = True
    """The prompt ends with think_open (R1-Searcher's templates end ``Assistant: <think>``)."""


def response_text(traj: "Trajectory", tokenizer: Any, tags: "TagSet") -> ResponseText:
    """Decode ``traj`` (special tokens kept) into a ``ResponseText``. ``tokenizer.decode(ids,
    skip_special_tokens=False)`` is all it needs (any Hugging Face tokenizer, or Sonar's)."""
    def dec(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    prompt = [int(t) for s in traj.segments if s.kind == SegmentKind.PROMPT for t in s.token_ids]
    rest = [int(t) for s in traj.segments if s.kind != SegmentKind.PROMPT for t in s.token_ids]
    model = "".join(dec([int(t) for t in s.token_ids]) for s in traj.segments if s.kind == SegmentKind.MODEL)
    return ResponseText(full=dec(rest), model=model, think_prefilled=dec(prompt).rstrip().endswith(tags.think_open))


def _documents_ok(traj: "Trajectory", text: ResponseText, tags: "TagSet") -> tuple[bool, int]:
    """Every query block answered by a documents block whose first document exists; and the count."""
    f = text.full
    with_docs = sum(1 for c in traj.searches if any(c.doc_ids))
    counts = {f.count(tags.query_open), f.count(tags.query_close), f.count(tags.docs_open),
              f.count(tags.docs_close), with_docs}
    return len(counts) == 1, with_docs


def _think_answer_ok(text: ResponseText, tags: "TagSet") -> bool:
    f = text.full
    return (f.count(tags.think_open) == (0 if text.think_prefilled else 1)
            and f.count(tags.think_close) == f.count(tags.answer_open) == f.count(tags.answer_close) == 1)


def _has_cjk(s: str) -> bool:
    return any("\u4e00" <= ch <= "\u9fff" for ch in s)


def server_answer(text: ResponseText, tags: "TagSet") -> str | None:
    """The answer R1-Searcher's reward servers read in the whole response, whichever turn wrote it: the
    text after the *last* answer_open up to the next answer_close, stripped (``extract_answer_math``,
    ``train/reward_server_qwen_zero.py:109-110``, the Llama servers' lines 81-82 / 108-109); None unless
    both tags occur somewhere in the response (the servers then score 0, or -1 in stage 1: qwen_zero.py:192-193,
    llama_stage1.py:164-165, llama_stage2.py:191-192)."""
    f = text.full
    if tags.answer_open not in f or tags.answer_close not in f:
        return None
    return f.split(tags.answer_open)[-1].split(tags.answer_close)[0].strip()


def r1_format_failures(variant: str, traj: "Trajectory", text: ResponseText, tags: "TagSet") -> list[str]:
    """The R1-Searcher reward-server rules that ``traj`` breaks (stage 2 servers), by name; [] = none.

    ``variant``: code_qwen (``train/reward_server_qwen_zero.py``) or code_llama
    (``train/reward_server_llama_stage2.py``). Only the response text and the search calls are read, not
    the finish reason: a response without an answer breaks the answer-count rule, and one whose answer
    was written in an earlier turn (a turn that then searched) passes it, as on the servers."""
    out = []
    if not _documents_ok(traj, text, tags)[0]:
        out.append("documents")
    if not _think_answer_ok(text, tags):
        out.append("think/answer tags")
    if _has_cjk(text.model):
        out.append("cjk")
    if variant == "code_qwen":
        if "Assistant" in text.full or "assistant" in text.full:
            out.append("assistant")
        # the server's answer_text (qwen_zero.py:233): the last opener's text even without both tags
        pred = text.full.split(tags.answer_open)[-1].split(tags.answer_close)[0].strip()
        # The server's rule is on the plain substrings (reward_server_qwen_zero.py:233-237), so it also
        # fires on an answer that names them without the tag's delimiters.
        if "begin_of_query" in pred or "begin_of_documents" in pred:
            out.append("tag in answer")
        if len(pred.split()) > R1_MAX_ANSWER_WORDS:
            out.append("long answer")
    return out


# ---------------------------------------------------------------- trajectory reward
@dataclass(frozen=True)
class RewardBreakdown:
    total: float
    parts: dict[str, float] = field(default_factory=dict)
    """Every key of ``PARTS``; logged separately (``rollout/reward/<part>``)."""


def answer_parts(traj: "Trajectory") -> dict[str, float]:
    """Every key of ``PARTS`` before a reward formula sets its own: the answer metrics, format (1 when
    answered), retrieval (1 when it searched), penalty 0, the search counts. Visits and other tools'
    calls are not searches (reward-neutral)."""
    pred = traj.prediction
    n_search = len(traj.searches)
    return {
        "em": exact_match(pred, traj.golds),
        "f1": f1(pred, traj.golds),
        "acc_r": acc_r(pred, traj.golds),
        "f1_r1": f1_r1(pred, traj.golds),
        "format": 1.0 if traj.finish_reason == FinishReason.ANSWERED else 0.0,
        "retrieval": 1.0 if n_search >= 1 else 0.0,
        "penalty": 0.0,
        "num_searches": float(n_search),
        "failed_searches": float(sum(1 for c in traj.searches if c.error is not None)),
    }


def _scored(cfg: "RewardConfig", traj: "Trajectory") -> dict[str, float]:
    """The checks every built-in makes, then the answer parts (``answer_parts``). Raises ``ValueError`` for an
    unknown variant or finish reason and an ``answered`` trajectory without a prediction."""
    finish = traj.finish_reason
    if finish not in FinishReason.ALL:
        raise ValueError(f"trajectory {traj.traj_id!r}: finish_reason={finish!r} is not one of {list(FinishReason.ALL)}")
    if finish == FinishReason.ANSWERED and traj.prediction is None:
        raise ValueError(f"trajectory {traj.traj_id!r}: finish_reason='answered' but prediction is None")
    if cfg.variant not in VARIANTS:
        raise ValueError(f"reward.variant={cfg.variant!r} is not one of {list(VARIANTS)}")
    return answer_parts(traj)


def _fmt(traj: "Trajectory") -> float:
    """The format term: 1 for a trajectory that answered, else 0."""
    return 1.0 if traj.finish_reason == FinishReason.ANSWERED else 0.0


def trajectory_reward(cfg: "RewardConfig", traj: "Trajectory", text: ResponseText | None = None,
                      tags: "TagSet | None" = None) -> RewardBreakdown:
    """Reward of one finished trajectory by the built-in ``cfg.name`` (see the module docstring for the table
    and the papers), for callers that hold the decoded ``text`` rather than a tokenizer: the same
    registered function ``make_reward_fn`` calls. The R1-Searcher code variants read ``text`` and
    ``tags``; the others never decode. Raises ``ValueError`` for a name that is no built-in reward."""
    if cfg.name not in BUILTIN_REWARDS:
        raise ValueError(f"reward.name={cfg.name!r} is not one of {list(BUILTIN_REWARDS)}")
    sample = RewardInput(traj, None, tags)
    sample._text = text
    return REWARDS.get(cfg.name, "reward.name")(sample, cfg)


def _r1_code(cfg: "RewardConfig", traj: "Trajectory", text: ResponseText, tags: "TagSet",
             parts: dict[str, float]) -> float:
    """The servers' score, read off the whole response (``server_answer``), not the last turn's parse: the
    answer metrics in ``parts`` are recomputed on the servers' answer (0 without one)."""
    pred = server_answer(text, tags)
    parts.update(em=exact_match(pred, traj.golds), f1=f1(pred, traj.golds), acc_r=acc_r(pred, traj.golds),
                 f1_r1=f1_r1(pred, traj.golds))
    if cfg.name == "r1_stage1":  # reward_server_llama_stage1.py
        docs_ok, n_docs = _documents_ok(traj, text, tags)
        parts["retrieval"] = 1.0 if docs_ok and n_docs >= 1 else 0.0
        parts["format"] = 1.0 if _think_answer_ok(text, tags) else 0.0
        base = 1.0 if pred is not None and parts["acc_r"] else -1.0
        return base + R1_STAGE1_RETRIEVAL * parts["retrieval"] + R1_STAGE1_FORMAT * parts["format"]
    failures = r1_format_failures(cfg.variant, traj, text, tags)
    parts["format"] = 0.0 if failures else 1.0
    parts["penalty"] = float(cfg.format_penalty) if failures else 0.0
    return parts["f1_r1"] + parts["penalty"]


# ---------------------------------------------------------------- the registry (built-ins and plug-ins)
REWARDS = Registry("reward")
"""``reward.name`` -> ``fn(sample: RewardInput, config: RewardConfig) -> float | RewardBreakdown``. The
built-ins below and a user's plug-in (``module:attr`` / ``file.py:attr``, ``cluster/wire/plugins.py``)
are served by the same ``REWARDS.get``; a plug-in may also take ``sample`` alone."""


class RewardInput:
    """What a reward function reads about one finished trajectory (the plug-in signature's ``sample``).

    ``response``: the decoded response, everything after the prompt (model turns and the tools' outputs,
    special tokens kept), as R1-Searcher's reward servers read it; ``model_text``: the model turns only;
    ``prediction``: the parsed answer (None without one); ``finish_reason`` (``FinishReason``);
    ``searches``: the queries of each search step; ``tool_calls``: (tool name, arguments) of every other
    tool call; ``golds``, ``question``; ``metadata``: the example's metadata from its dataset record;
    ``trajectory``: the typed trajectory itself (segments, token ids, logprobs, versions). Text is
    decoded on first use only."""

    def __init__(self, traj: "Trajectory", tokenizer: Any, tags: "TagSet"):
        self.trajectory = traj
        self._tokenizer, self._tags, self._text = tokenizer, tags, None
        self.prediction = traj.prediction
        self.finish_reason = traj.finish_reason
        self.golds = list(traj.golds)
        self.question = traj.question
        self.metadata = dict(getattr(traj, "meta", {}) or {})
        self.searches = [list(c.queries) for c in traj.searches]
        self.tool_calls = [(c.tool, list(c.args)) for c in getattr(traj, "tool_calls", [])]

    @property
    def text(self) -> ResponseText:
        if self._text is None:
            self._text = response_text(self.trajectory, self._tokenizer, self._tags)
        return self._text

    @property
    def response(self) -> str:
        return self.text.full

    @property
    def model_text(self) -> str:
        """The policy's own tokens decoded (no retrieved documents). No built-in reward reads it: it is
        the plug-in reward API (actors/README.md, "Your own reward, tool, retriever and data"), which tests exercise."""
        return self.text.model


    def decoded(self, cfg: "RewardConfig") -> ResponseText:
        """The decoded response, for a reward that reads it (the R1-Searcher code variants)."""
        if self._tags is None or (self._text is None and self._tokenizer is None):
            raise ValueError(f"reward.name={cfg.name!r} with reward.variant={cfg.variant!r} reads the decoded "
                             "response: pass text= and tags= (make_reward_fn does)")
        return self.text


# ---------------------------------------------------------------- the built-ins, through the same door
@REWARDS.register("answer_em")
def answer_em(sample: RewardInput, config: "RewardConfig") -> RewardBreakdown:
    """EM of the answer plus ``format_weight`` x the format term."""
    parts = _scored(config, sample.trajectory)
    return RewardBreakdown(parts["em"] + config.format_weight * _fmt(sample.trajectory), parts)


@REWARDS.register("answer_f1")
def answer_f1(sample: RewardInput, config: "RewardConfig") -> RewardBreakdown:
    """Token F1 of the answer plus ``format_weight`` x the format term."""
    parts = _scored(config, sample.trajectory)
    return RewardBreakdown(parts["f1"] + config.format_weight * _fmt(sample.trajectory), parts)


@REWARDS.register("cover_em")
def cover_em(sample: RewardInput, config: "RewardConfig") -> RewardBreakdown:
    """R1-Searcher's ACC_R (a gold contained in the answer) plus ``format_weight`` x the format term."""
    parts = _scored(config, sample.trajectory)
    return RewardBreakdown(parts["acc_r"] + config.format_weight * _fmt(sample.trajectory), parts)


def _em_if_answered(sample: RewardInput, config: "RewardConfig") -> RewardBreakdown:
    """EM of the answer, 0 without one, no format term (Search-R1's and RAG-R1's ``qa_em.py``)."""
    parts = _scored(config, sample.trajectory)
    return RewardBreakdown(parts["em"] * _fmt(sample.trajectory), parts)


REWARDS.register("search_r1")(_em_if_answered)
REWARDS.register("rag_r1")(_em_if_answered)


def _r1_searcher(sample: RewardInput, config: "RewardConfig") -> tuple[dict[str, float], float | None]:
    """R1-Searcher's checks; with a released variant, the servers' score (None: the paper's formula)."""
    parts = _scored(config, sample.trajectory)
    if config.variant == "paper":
        return parts, None
    text = sample.decoded(config)
    if sample.finish_reason == FinishReason.RETRIEVAL_ERROR:  # Sonar's rule: not the model's fault, no score
        parts.update(format=0.0, retrieval=0.0)
        return parts, 0.0
    return parts, _r1_code(config, sample.trajectory, text, sample._tags, parts)


@REWARDS.register("r1_stage1")
def r1_stage1(sample: RewardInput, config: "RewardConfig") -> RewardBreakdown:
    """R1-Searcher stage 1: 0.5 x retrieval (searched and got documents) + 0.5 x format."""
    parts, code = _r1_searcher(sample, config)
    if code is None:
        code = R1_STAGE1_RETRIEVAL * parts["retrieval"] + R1_STAGE1_FORMAT * _fmt(sample.trajectory)
    return RewardBreakdown(float(code), parts)


@REWARDS.register("r1_stage2")
def r1_stage2(sample: RewardInput, config: "RewardConfig") -> RewardBreakdown:
    """R1-Searcher stage 2: F1 of the answer (R1's normalisation) plus ``format_penalty`` for a broken format."""
    parts, code = _r1_searcher(sample, config)
    if code is None:
        parts["penalty"] = float(config.format_penalty) if sample.finish_reason in BROKEN_FORMAT else 0.0
        code = parts["f1_r1"] + parts["penalty"]
    return RewardBreakdown(float(code), parts)


BUILTIN_REWARDS = REWARDS.names()
"""The built-in rewards, as registered above (the config's list, ``plugins.BUILTIN_NAMES``, is pinned to it
by tests/cluster/test_plugins.py)."""

REWARD_ERROR = "reward_error"
"""The part a plug-in reward's breakdown carries: 1 when the plug-in raised (the reward is then 0 and
the error is logged), else 0; logged as ``rollout/reward/reward_error`` (the share of failed calls)."""
_errors_logged = [0]


def _plugin_breakdown(out: Any, traj: "Trajectory", name: str) -> RewardBreakdown:
    """A plug-in's float or ``RewardBreakdown`` as a breakdown with Sonar's answer parts beside its own."""
    base = dict(answer_parts(traj))
    base[REWARD_ERROR] = 0.0
    if isinstance(out, RewardBreakdown):
        base.update({str(k): float(v) for k, v in dict(out.parts).items()})
        total = out.total
    elif isinstance(out, (int, float)) and not isinstance(out, bool):
        total = out
    else:
        raise TypeError(f"reward plug-in {name!r} returned {type(out).__name__}; expected a float or a RewardBreakdown")
    total = float(total)
    if not math.isfinite(total):
        raise ValueError(f"reward plug-in {name!r} returned {total}")
    return RewardBreakdown(total, base)


def make_reward_fn(cfg: "RewardConfig", tokenizer: Any, tags: "TagSet") -> Callable[["Trajectory"], RewardBreakdown]:
    """``reward_fn(traj)`` for the rollout loop, through ``REWARDS`` (a built-in or a plug-in alike). A
    plug-in that raises, or returns something else than a finite float or a ``RewardBreakdown``, gives
    reward 0 with ``reward_error`` 1 and a logged warning (the first 10 per process), never a crashed
    worker; a built-in's error is a bug of Sonar and raises."""
    fn = REWARDS.get(cfg.name, "reward.name")
    if not is_plugin(cfg.name):
        return lambda t: fn(RewardInput(t, tokenizer, tags), cfg)
    import concurrent.futures as cf

    with_config = positional_arity(fn)[1] >= 2
    # The user's code runs in these threads, each call at most reward.timeout_s: a hung call is abandoned
    # (its thread stays busy; four hung at once make every later call wait its timeout, never forever).
    pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward-plugin")

    def call(sample):
        return fn(sample, cfg) if with_config else fn(sample)

    def reward(t: "Trajectory") -> RewardBreakdown:
        sample = RewardInput(t, tokenizer, tags)
        try:
            try:
                out = pool.submit(call, sample).result(timeout=cfg.timeout_s)
            except cf.TimeoutError:
                raise TimeoutError(f"no result within reward.timeout_s={cfg.timeout_s} s (abandoned)") from None
            return _plugin_breakdown(out, t, cfg.name)
        except Exception as e:  # the user's code: data, not a crash
            if _errors_logged[0] < 10:
                _errors_logged[0] += 1
                log.warning("reward plug-in %s failed on trajectory %s: %s: %s", cfg.name, t.traj_id,
                            type(e).__name__, e)
            parts = dict(answer_parts(t))
            parts[REWARD_ERROR] = 1.0
            return RewardBreakdown(0.0, parts)
    return reward
