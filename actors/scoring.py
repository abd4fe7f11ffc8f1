"""Score prediction files: ACC_R, EM, F1 (and R1-Searcher's EM/F1) per file, as a Markdown table (``sonar score``).

Input: JSONL (one record per line) or a JSON list (e.g. FlashRAG's ``intermediate_data.json``).
Each record holds a prediction under ``pred_field`` and the gold answer(s) under ``gold_field``
(defaults: ``prediction`` / ``golden_answers`` as Sonar and FlashRAG write them, or, when a file's first
record has not those but has R1-Searcher's ``pred_ans`` / ``answer``, those, so its result files score as
they are);
field names may be dotted paths into nested objects (``output.pred``; a list index is a number,
``answers.0``). A literal top-level key containing dots wins over the nested reading. Gold may be a
string or a list of strings; a ``null`` prediction is scored as "no answer" (0 on every metric).
A missing field, a non-string gold or an empty gold list raises ``ScoreError`` naming the file,
the line (JSONL) or record index (JSON) and the field.

Metrics are those of every Sonar evaluation (``actors.evaluation.question_scores`` over
``actors.rewards``), each under a name that says whose normalisation it uses: ``acc_r`` (R1-Searcher's
cover-EM), ``em_r1`` and ``f1_r1`` (R1-Searcher's ``metric_calc_rule.py``), ``em`` and ``f1`` (HotpotQA's
official script). The default table shows ``acc_r``, ``em``, ``f1`` (``--metrics`` picks others). Each is
computed as ``metric_calc_rule.py`` does: per-record scores summed in file order, divided by n, times 100,
``round(., 1)``; so ``acc_r`` is R1-Searcher's ACC_R of the same file digit for digit. (Its script reads
only a file's first 2000 records; Sonar scores all of them. R1-Searcher's eval sets have 500.)

``main(argv)`` implements ``sonar score PREDICTIONS.jsonl [more files] [--pred-field F] [--gold-field G]``;
the row name is the file's stem (parent folder + stem when two stems collide, or for FlashRAG-style
``<dataset>/<split>.jsonl``). The ``cluster/cli.py`` wiring only has to call ``main``.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from sonar.actors.datasets import dotted_field
from sonar.actors.evaluation import SCORES, percent, question_scores

_MISSING = object()
DEFAULT_METRICS = ("acc_r", "em", "f1")
"""Columns of the default table: R1-Searcher's ACC_R first, then HotpotQA's EM and F1."""
PAPER_METRICS = {
    "r1_searcher": ("em_r1", "acc_r", "f1_r1"),
    "search_r1": ("em",),
    "rag_r1": ("em",),
}
"""``sonar score --paper NAME``: the columns that paper's own evaluation prints, in its order. R1-Searcher's
``evaluation/metric_calc_rule.py:200-205`` prints EM, Cover-EM and F1 under its own normalisation;
Search-R1 and RAG-R1 report the EM of ``qa_em.py`` (SQuAD normalisation, HotpotQA's ``em``)."""
_FIELD_FALLBACKS = {"prediction": "pred_ans", "golden_answers": "answer"}
_SPLIT_STEMS = {"train", "dev", "test", "val", "valid", "validation", "predictions", "preds"}


class ScoreError(ValueError):
    """A predictions file that cannot be scored; the message names file, line/record and field."""


@dataclass(frozen=True)
class ScoreReport:
    n: int
    em: float
    f1: float
    """Means over the n records, in [0, 1]: HotpotQA EM and F1, R1-Searcher's cover-EM (ACC_R)."""
    acc_r: float
    em_r1: float = 0.0
    f1_r1: float = 0.0
    """R1-Searcher's EM and F1, means in [0, 1]."""
    path: str = ""

    def percent(self, metric: str) -> float:
        """``round(100 * mean, 1)``, as ``metric_calc_rule.py`` reports it (:func:`~sonar.actors.evaluation.percent`)."""
        return float(percent(getattr(self, metric)))


def _get(rec: Any, dotted: str) -> Any:
    try:
        return dotted_field(rec, dotted)
    except KeyError:
        return _MISSING


def _json_limit(e: Exception) -> str:
    """What ``json.loads`` raised past a limit of the interpreter (nesting depth, integer digits)."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _records(path: Path) -> list[tuple[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScoreError(f"{path}: no such file") from None
    except (UnicodeDecodeError, OSError) as e:
        raise ScoreError(f"{path}: cannot read ({e})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if path.suffix.lower() != ".jsonl" and text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScoreError(f"{path}: invalid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        except (RecursionError, ValueError) as e:  # past the interpreter's nesting or integer-digit limit
            raise ScoreError(f"{path}: invalid JSON ({_json_limit(e)})") from None
        return [(f"record {i}", r) for i, r in enumerate(data)]
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ScoreError(f"{path}: line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        except (RecursionError, ValueError) as e:
            raise ScoreError(f"{path}: line {lineno}: invalid JSON ({_json_limit(e)})") from None
    return out


def _as_text(path: Path, loc: str, key: str, v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ScoreError(f"{path}: {loc}: field {key!r}: expected a string, got {type(v).__name__}")
    return str(v)


def _field(first: Any, given: str | None, default: str) -> str:
    """The field to read: the one given, else the default, else its R1-Searcher name if the first record
    has that and not the default."""
    if given is not None:
        return given
    alt = _FIELD_FALLBACKS[default]
    if isinstance(first, dict) and _get(first, default) is _MISSING and _get(first, alt) is not _MISSING:
        return alt
    return default


def score_predictions(path: str | Path, pred_field: str | None = None,
                      gold_field: str | None = None) -> ScoreReport:
    """Mean scores (``SCORES``) over the records of one predictions file. Raises ``ScoreError``.

    ``pred_field`` / ``gold_field``: None reads ``prediction`` / ``golden_answers``, or R1-Searcher's
    ``pred_ans`` / ``answer`` when the first record has those instead."""
    path = Path(path)
    records = _records(path)
    if not records:
        raise ScoreError(f"{path}: no records")
    pred_field = _field(records[0][1], pred_field, "prediction")
    gold_field = _field(records[0][1], gold_field, "golden_answers")
    sums = {m: 0.0 for m in SCORES}
    for loc, rec in records:
        if not isinstance(rec, dict):
            raise ScoreError(f"{path}: {loc}: expected a JSON object, got {type(rec).__name__}")
        pred = _get(rec, pred_field)
        if pred is _MISSING:
            raise ScoreError(f"{path}: {loc}: field {pred_field!r}: missing (fields: {sorted(rec)})")
        gold = _get(rec, gold_field)
        if gold is _MISSING:
            raise ScoreError(f"{path}: {loc}: field {gold_field!r}: missing (fields: {sorted(rec)})")
        pred = None if pred is None else _as_text(path, loc, pred_field, pred)
        golds = [gold] if not isinstance(gold, list) else gold
        golds = [_as_text(path, loc, f"{gold_field}[{i}]", g) for i, g in enumerate(golds)]
        if not golds:
            raise ScoreError(f"{path}: {loc}: field {gold_field!r}: empty list")
        scores = question_scores(pred, golds)
        for m in SCORES:  # summed in file order, as metric_calc_rule.py
            sums[m] += scores[m]
    n = len(records)
    return ScoreReport(n=n, **{m: sums[m] / n for m in SCORES}, path=str(path))


def markdown_table(reports: dict[str, ScoreReport], metrics: Sequence[str] = DEFAULT_METRICS) -> str:
    """One row per dataset (each metric in percent, ``round(., 1)``) and, for several datasets, a macro
    average row (the unweighted mean of the rows' means, as papers report "Avg."). The column headers
    are the metric names (``acc_r``, ``em``, ``f1``, ``em_r1``, ``f1_r1``)."""
    bad = [m for m in metrics if m not in SCORES]
    if bad or not metrics:
        raise ValueError(f"metrics={list(metrics)}: each must be one of {list(SCORES)}")
    lines = ["| dataset | n | " + " | ".join(metrics) + " |", "|---|---:|" + "---:|" * len(metrics)]
    for name, r in reports.items():
        lines.append(f"| {name} | {r.n} | " + " | ".join(percent(getattr(r, m)) for m in metrics) + " |")
    if len(reports) > 1:
        rs = list(reports.values())
        avg = [sum(getattr(r, m) for r in rs) / len(rs) for m in metrics]
        lines.append(f"| average (macro) | {sum(r.n for r in rs)} | " + " | ".join(percent(a) for a in avg) + " |")
    return "\n".join(lines) + "\n"


def _row_names(paths: Sequence[Path]) -> list[str]:
    def short(p: Path) -> str:
        return f"{p.parent.name}/{p.stem}" if p.stem.lower() in _SPLIT_STEMS and p.parent.name else p.stem

    names = [short(p) for p in paths]
    out: list[str] = []
    for p, n in zip(paths, names):
        if names.count(n) > 1:
            n = str(p)
        base, k = n, 2
        while n in out:  # the same file given twice
            n, k = f"{base} ({k})", k + 1
        out.append(n)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``sonar score`` command line (its own: ``sonar`` hands it the arguments after ``score``)."""
    ap = argparse.ArgumentParser(prog="sonar score", description="ACC_R / EM / F1 of prediction files")
    ap.add_argument("files", nargs="+", type=Path, help="predictions JSONL (or JSON list), one per dataset")
    ap.add_argument("--pred-field", default=None,
                    help="prediction field, dotted for nested (default: prediction, or R1-Searcher's pred_ans)")
    ap.add_argument("--gold-field", default=None,
                    help="gold field(s), string or list (default: golden_answers, or R1-Searcher's answer)")
    ap.add_argument("--metrics", default=None,
                    help=f"comma-separated columns among {','.join(SCORES)} (default: {','.join(DEFAULT_METRICS)}): "
                         "acc_r/em_r1/f1_r1 are R1-Searcher's (its normalisation), em/f1 HotpotQA's official ones")
    ap.add_argument("--paper", choices=sorted(PAPER_METRICS), default=None,
                    help="the columns that paper's own evaluation prints (r1_searcher: em_r1,acc_r,f1_r1 as its "
                         "metric_calc_rule.py; search_r1 / rag_r1: em as their qa_em.py)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``sonar score FILE [FILE ...] [--pred-field F] [--gold-field G] [--metrics M,...]``: print the table.

    Returns the exit status (0, or 2 on an unreadable/malformed file, reported on stderr).
    """
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.paper and args.metrics:
        ap.error(f"--paper {args.paper} chooses the columns; drop --metrics {args.metrics!r} (or --paper)")
    chosen = args.metrics or ",".join(PAPER_METRICS[args.paper] if args.paper else DEFAULT_METRICS)
    args.metrics = chosen
    metrics = [m.strip() for m in chosen.split(",") if m.strip()]
    if not metrics or any(m not in SCORES for m in metrics):
        ap.error(f"--metrics {args.metrics!r}: each must be one of {','.join(SCORES)}")
    reports: dict[str, ScoreReport] = {}
    try:
        for name, p in zip(_row_names(args.files), args.files):
            reports[name] = score_predictions(p, args.pred_field, args.gold_field)
    except ScoreError as e:
        print(f"sonar score: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table(reports, metrics))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
