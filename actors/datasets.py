"""Loaders for the QA datasets users keep on disk -> ``list[QAItem]``. Standard library only.

Formats (``fmt``) and where the real files come from
----------------------------------------------------
``flashrag``  Search-R1 / FlashRAG JSONL, one record per line:
              ``{"id": ..., "question": ..., "golden_answers": [...], "metadata": {...}}``
              (``id`` optional; ``golden_answers`` may also be a single string). The Hugging Face
              dataset ``RUC-NLPIR/FlashRAG_datasets`` ships every benchmark in this format as
              ``<dataset>/<split>.jsonl`` (nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa,
              musique, bamboogle, ...); Search-R1's data scripts start from these files.
``hotpotqa``  HotpotQA JSON, a list of ``{"_id", "question", "answer", "type", "level", ...}``:
              hotpot_train_v1.1.json, hotpot_dev_distractor_v1.json, hotpot_dev_fullwiki_v1.json
              from the project page hotpotqa.github.io (HF: ``hotpotqa/hotpot_qa``).
``2wiki``     2WikiMultiHopQA JSON, a list of ``{"_id", "type", "question", "answer", "evidences", ...}``:
              train.json / dev.json from github.com/Alab-NII/2wikimultihop (data link in its README).
``musique``   MuSiQue JSONL, ``{"id", "question", "answer", "answer_aliases", "answerable", ...}``:
              musique_ans_v1.0_{train,dev}.jsonl and musique_full_v1.0_*.jsonl from
              github.com/StonyBrookNLP/musique (download script in its README). Golds are
              ``[answer] + answer_aliases``.
``bamboogle`` Bamboogle ``{"Question", "Answer"}`` as CSV (the sheet linked from
              github.com/ofirpress/self-ask, exported as CSV), JSON list or JSONL
              (HF: ``chiayewken/bamboogle``; FlashRAG's copy is in the ``flashrag`` format).

Test files without answers (HotpotQA fullwiki test, MuSiQue test) cannot be loaded: there is
nothing to score against.

Pointing Sonar at them: evaluate a checkpoint on the file (``sonar eval --data /data/hotpotqa/dev.jsonl``)
or score predictions with ``sonar score`` (training reads the synthetic world's questions only);
``fmt="auto"`` detects the format from the content (``golden_answers`` -> flashrag,
``answer_aliases``/``question_decomposition``/``paragraphs`` -> musique, ``Question``/``Answer`` or a
``.csv`` -> bamboogle, ``evidences`` -> 2wiki, ``level`` -> hotpotqa) and, for a JSON list with only
``_id/question/answer``, from the file name ("2wiki" -> 2wiki, else hotpotqa). ``.gz`` files are read
transparently.

Every item gets ``source``: the dataset name (the ``source=`` argument, else the parent folder for
FlashRAG-style ``<dataset>/<split>.jsonl`` paths, else the format name). ``qid`` is the record's id,
or ``<source>-<index>`` when the format has none. Duplicate qids in one file are an error (Sonar keys
retrieval and scoring by qid). ``meta`` keeps the record's small scalar fields (type, level,
answerable, ...) and FlashRAG's ``metadata`` scalars; large fields (context, paragraphs,
supporting_facts, evidences, question_decomposition) are not kept.

A malformed record raises ``DatasetError`` naming the file, the line (JSONL, CSV) or the record
index (JSON list) and the field.
"""
from __future__ import annotations

import csv
import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

FORMATS = ("flashrag", "hotpotqa", "2wiki", "musique", "bamboogle")
_ALIASES = {"search_r1": "flashrag", "jsonl": "flashrag", "hotpot": "hotpotqa", "2wikimultihopqa": "2wiki"}
_SPLIT_STEMS = {"train", "dev", "test", "val", "valid", "validation"}
_BIG_FIELDS = {"context", "paragraphs", "supporting_facts", "evidences", "question_decomposition"}


class DatasetError(ValueError):
    """A dataset file that cannot be loaded; the message names file, line/record and field."""


@dataclass(frozen=True)
class QAItem:
    qid: str
    question: str
    golds: list[str]
    source: str
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------- reading records
def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _base_suffix(path: Path) -> str:
    return Path(path.stem).suffix.lower() if path.suffix == ".gz" else path.suffix.lower()


def _iter_jsonl(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        yield f"line {lineno}", rec


def _records(path: Path) -> tuple[str, list[tuple[str, Any]]]:
    """(container kind 'jsonl' | 'json' | 'csv', [(location, record)])."""
    try:
        with _open_text(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except (UnicodeDecodeError, OSError) as e:
        raise DatasetError(f"{path}: cannot read ({e})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    suffix = _base_suffix(path)
    if suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            # line_num after a row is the file line where that record ends (quoted fields may span lines)
            return "csv", [(f"line {reader.line_num}", row) for row in reader]
        except csv.Error as e:
            raise DatasetError(f"{path}: line {reader.line_num}: invalid CSV ({e})") from None
    stripped = text.lstrip()
    if suffix != ".jsonl" and stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        return "json", [(f"record {i}", rec) for i, rec in enumerate(data)]
    if suffix == ".json" and stripped.startswith("{"):
        # a single JSON object holding a list (e.g. {"data": [...]}) or a JSONL file named .json
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return "jsonl", list(_iter_jsonl(path, text))
        for key in ("data", "examples", "records"):
            if isinstance(data.get(key), list):
                return "json", [(f"record {i}", rec) for i, rec in enumerate(data[key])]
        return "json", [("record 0", data)]
    return "jsonl", list(_iter_jsonl(path, text))


# ---------------------------------------------------------------- detection
def _detect(path: Path, kind: str, first: Any) -> str:
    name = path.name.lower()
    if kind == "csv":
        return "bamboogle"
    if not isinstance(first, dict):
        raise DatasetError(f"{path}: cannot detect the format: the first record is a {type(first).__name__}, not an object")
    keys = set(first)
    if "golden_answers" in keys:
        return "flashrag"
    if keys & {"answer_aliases", "question_decomposition", "paragraphs"}:
        return "musique"
    if {"Question", "Answer"} <= keys:
        return "bamboogle"
    if "evidences" in keys:
        return "2wiki"
    if "level" in keys:
        return "hotpotqa"
    if "_id" in keys:
        return "2wiki" if "2wiki" in name else "hotpotqa"
    if "musique" in name:
        return "musique"
    if "bamboogle" in name:
        return "bamboogle"
    raise DatasetError(
        f"{path}: cannot detect the format from fields {sorted(keys)}; pass fmt= one of {list(FORMATS)}")


def _source_name(path: Path, fmt: str) -> str:
    stem = Path(path.stem).stem if path.suffix == ".gz" else path.stem
    if fmt == "flashrag":
        return path.parent.name if stem.lower() in _SPLIT_STEMS and path.parent.name else stem
    return fmt


# ---------------------------------------------------------------- field checks
def _field(path: Path, loc: str, rec: dict, key: str) -> Any:
    if key not in rec:
        raise DatasetError(f"{path}: {loc}: field {key!r}: missing (fields: {sorted(rec)})")
    return rec[key]


def _text(path: Path, loc: str, key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{path}: {loc}: field {key!r}: expected a string, got {type(value).__name__}")
    value = str(value).strip()
    if not value:
        raise DatasetError(f"{path}: {loc}: field {key!r}: empty")
    return value


def _text_list(path: Path, loc: str, key: str, value: Any, allow_empty: bool = False) -> list[str]:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise DatasetError(f"{path}: {loc}: field {key!r}: expected a list of strings, got {type(value).__name__}")
    out = [_text(path, loc, f"{key}[{i}]", v) for i, v in enumerate(value)]
    if not out and not allow_empty:
        raise DatasetError(f"{path}: {loc}: field {key!r}: empty list")
    return out


def _small(rec: dict, used: set[str]) -> dict:
    meta = {}
    for k, v in rec.items():
        if k in used or k in _BIG_FIELDS:
            continue
        if v is None or isinstance(v, (str, int, float, bool)):
            meta[k] = v
        elif k == "metadata" and isinstance(v, dict):
            meta.update({f"metadata.{mk}": mv for mk, mv in v.items()
                         if mk not in _BIG_FIELDS and (mv is None or isinstance(mv, (str, int, float, bool)))})
    return meta


def _item(path: Path, loc: str, rec: Any, fmt: str, index: int, source: str) -> QAItem:
    if not isinstance(rec, dict):
        raise DatasetError(f"{path}: {loc}: expected a JSON object, got {type(rec).__name__}")
    if fmt == "flashrag":
        q = _text(path, loc, "question", _field(path, loc, rec, "question"))
        golds = _text_list(path, loc, "golden_answers", _field(path, loc, rec, "golden_answers"))
        qid = _text(path, loc, "id", rec["id"]) if rec.get("id") is not None else f"{source}-{index}"
        used = {"id", "question", "golden_answers"}
    elif fmt in ("hotpotqa", "2wiki"):
        qid = _text(path, loc, "_id", _field(path, loc, rec, "_id"))
        q = _text(path, loc, "question", _field(path, loc, rec, "question"))
        golds = [_text(path, loc, "answer", _field(path, loc, rec, "answer"))]
        used = {"_id", "question", "answer"}
    elif fmt == "musique":
        qid = _text(path, loc, "id", _field(path, loc, rec, "id"))
        q = _text(path, loc, "question", _field(path, loc, rec, "question"))
        golds = [_text(path, loc, "answer", _field(path, loc, rec, "answer"))]
        golds += _text_list(path, loc, "answer_aliases", rec.get("answer_aliases", []), allow_empty=True)
        golds = list(dict.fromkeys(golds))
        used = {"id", "question", "answer", "answer_aliases"}
    elif fmt == "bamboogle":
        # column names as distributed ("Question", "Answer"); lower-case copies are accepted too
        qkey = "Question" if "Question" in rec or "question" not in rec else "question"
        akey = "Answer" if "Answer" in rec or "answer" not in rec else "answer"
        q = _text(path, loc, qkey, _field(path, loc, rec, qkey))
        golds = [_text(path, loc, akey, _field(path, loc, rec, akey))]
        qid = f"{source}-{index}"
        used = {qkey, akey}
    else:  # pragma: no cover - fmt is validated by load_dataset
        raise AssertionError(fmt)
    return QAItem(qid=qid, question=q, golds=golds, source=source, meta=_small(rec, used))


# ---------------------------------------------------------------- public API
def load_dataset(path: str | Path, fmt: str = "auto", source: str | None = None) -> list[QAItem]:
    """Load every record of ``path``. ``fmt``: "auto" or one of ``FORMATS`` (aliases: search_r1).

    ``source`` overrides the dataset name stored in each item. Raises ``DatasetError``.
    """
    path = Path(path)
    fmt = _ALIASES.get(fmt, fmt)
    if fmt != "auto" and fmt not in FORMATS:
        raise DatasetError(f"{path}: fmt={fmt!r} is not 'auto' or one of {list(FORMATS)}")
    kind, records = _records(path)
    if not records:
        raise DatasetError(f"{path}: no records")
    if fmt == "auto":
        fmt = _detect(path, kind, records[0][1])
    src = source or _source_name(path, fmt)
    items: list[QAItem] = []
    seen: dict[str, str] = {}
    for index, (loc, rec) in enumerate(records):
        item = _item(path, loc, rec, fmt, index, src)
        if item.qid in seen:
            key = "_id" if fmt in ("hotpotqa", "2wiki") else "id"
            raise DatasetError(f"{path}: {loc}: field {key!r}: duplicate id {item.qid!r} (first at {seen[item.qid]})")
        seen[item.qid] = loc
        items.append(item)
    return items
