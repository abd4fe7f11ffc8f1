"""Score prediction files: EM, F1 and cover-EM per file, as a Markdown table (``sonar score``).

Input: JSONL (one record per line) or a JSON list (e.g. FlashRAG's ``intermediate_data.json``).
Each record holds a prediction under ``pred_field`` and the gold answer(s) under ``gold_field``;
field names may be dotted paths into nested objects (``output.pred``; a list index is a number,
``answers.0``). A literal top-level key containing dots wins over the nested reading. Gold may be a
string or a list of strings; a ``null`` prediction is scored as "no answer" (0 on every metric).
A missing field, a non-string gold or an empty gold list raises ``ScoreError`` naming the file,
the line (JSONL) or record index (JSON) and the field.

Metrics are those of every Sonar evaluation (``actors.evaluation.question_scores`` over
``actors.rewards``: SQuAD/HotpotQA normalisation, HotpotQA's yes/no rule for F1, R1-Searcher's
token-containment cover-EM), averaged over records, reported in percent.

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

from sonar.actors.evaluation import question_scores

_MISSING = object()
_SPLIT_STEMS = {"train", "dev", "test", "val", "valid", "validation", "predictions", "preds"}


class ScoreError(ValueError):
    """A predictions file that cannot be scored; the message names file, line/record and field."""


@dataclass(frozen=True)
class ScoreReport:
    n: int
    em: float
    f1: float
    cover_em: float
    """Means over the n records, in [0, 1]."""
    path: str = ""


def _get(rec: Any, dotted: str) -> Any:
    if isinstance(rec, dict) and dotted in rec:
        return rec[dotted]
    cur = rec
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return _MISSING
    return cur


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
        return [(f"record {i}", r) for i, r in enumerate(data)]
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ScoreError(f"{path}: line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    return out


def _as_text(path: Path, loc: str, key: str, v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ScoreError(f"{path}: {loc}: field {key!r}: expected a string, got {type(v).__name__}")
    return str(v)


def score_predictions(path: str | Path, pred_field: str = "prediction",
                      gold_field: str = "golden_answers") -> ScoreReport:
    """Mean EM / F1 / cover-EM over the records of one predictions file. Raises ``ScoreError``."""
    path = Path(path)
    records = _records(path)
    if not records:
        raise ScoreError(f"{path}: no records")
    em_sum = f1_sum = cem_sum = 0.0
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
        em_sum += scores["em"]
        f1_sum += scores["f1"]
        cem_sum += scores["cover_em"]
    n = len(records)
    return ScoreReport(n=n, em=em_sum / n, f1=f1_sum / n, cover_em=cem_sum / n, path=str(path))


def markdown_table(reports: dict[str, ScoreReport]) -> str:
    """One row per dataset (EM / F1 / cover-EM in percent, one decimal) and, for several datasets,
    a macro average row (the unweighted mean of the rows, as papers report "Avg.")."""
    lines = ["| dataset | n | EM | F1 | cover-EM |", "|---|---:|---:|---:|---:|"]
    for name, r in reports.items():
        lines.append(f"| {name} | {r.n} | {100 * r.em:.1f} | {100 * r.f1:.1f} | {100 * r.cover_em:.1f} |")
    if len(reports) > 1:
        k = len(reports)
        rs = list(reports.values())
        lines.append(f"| average (macro) | {sum(r.n for r in rs)} | {100 * sum(r.em for r in rs) / k:.1f} | "
                     f"{100 * sum(r.f1 for r in rs) / k:.1f} | {100 * sum(r.cover_em for r in rs) / k:.1f} |")
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


def main(argv: Sequence[str] | None = None) -> int:
    """``sonar score FILE [FILE ...] [--pred-field F] [--gold-field G]``: print the Markdown table.

    Returns the exit status (0, or 2 on an unreadable/malformed file, reported on stderr).
    """
    ap = argparse.ArgumentParser(prog="sonar score", description="EM / F1 / cover-EM of prediction files")
    ap.add_argument("files", nargs="+", type=Path, help="predictions JSONL (or JSON list), one per dataset")
    ap.add_argument("--pred-field", default="prediction", help="prediction field, dotted for nested (default: prediction)")
    ap.add_argument("--gold-field", default="golden_answers", help="gold field(s), string or list (default: golden_answers)")
    args = ap.parse_args(argv)
    reports: dict[str, ScoreReport] = {}
    try:
        for name, p in zip(_row_names(args.files), args.files):
            reports[name] = score_predictions(p, args.pred_field, args.gold_field)
    except ScoreError as e:
        print(f"sonar score: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table(reports))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
