"""Loaders for the QA datasets users keep on disk -> ``list[QAItem]``. Standard library only (and the
plug-in registry of ``cluster/wire/plugins.py``).

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
``r1_searcher`` R1-Searcher's JSONL ``{"idx", "question", "answer", ...}`` (github.com/RUCAIBox/R1-Searcher):
              ``data/eval_set/{hotpotqa_500,2wiki_500,musique_500,bamboogle}.jsonl`` (plus an empty
              ``gen_text_store``) and ``data/training_set/stage_{1,2}.jsonl`` (stage 1 adds
              ``pred_anses``, the sampled answers it was filtered with; not kept). ``answer`` is one
              string (a list is accepted). ``qid`` is ``<source>-<idx>`` (``idx`` counts from 1 in each
              file, so it is not unique across files); ``idx`` is optional with ``fmt="r1_searcher"``.
``verl``      The parquet files Search-R1 (``scripts/data_process/nq_search.py``,
              ``qa_search_{train,test}_merge.py``) and RAG-R1 (``scripts/data_process/hotpotqa_search*.py``)
              write for veRL: ``data_source``, ``prompt`` (chat messages; the question is embedded in
              the template after ``Question:``), ``reward_model.ground_truth.target`` (the golds),
              ``extra_info.index``; Search-R1's files also keep FlashRAG's ``id``/``question``/
              ``golden_answers`` columns. Golds come from ``reward_model.ground_truth.target`` (what the
              upstream reward scores against), else ``golden_answers``; the question from the
              ``question`` column, else from the prompt; ``qid`` is ``<data_source>-<extra_info.index>``
              (unique in merged files, where FlashRAG ids repeat across sources), else ``id``;
              ``source`` is the row's ``data_source``. Read with pyarrow.

RAG-R1's own JSON (``data/RL/hotpotqa_train_filter{,_mq}/{train,test}_data.json`` in
inclusionAI/AWorld-RL: a list of ``{"question", "golden_answers": "<one string>"}``) is the ``flashrag``
format (alias ``rag_r1``); its source is the folder name.

Test files without answers (HotpotQA fullwiki test, MuSiQue test) cannot be loaded: there is
nothing to score against.

Pointing Sonar at them: evaluate a checkpoint on the file (``sonar eval --data /data/hotpotqa/dev.jsonl``),
train on it (``stages.N.data``, with ``retrieval.corpus``) or score predictions with ``sonar score``.
``fmt="auto"`` detects the format from the first record (``reward_model``/``prompt`` in a parquet
file -> verl, ``golden_answers`` -> flashrag, ``answer_aliases``/``question_decomposition``/
``paragraphs`` -> musique, ``Question``/``Answer`` or a ``.csv`` -> bamboogle, ``evidences`` -> 2wiki,
``level`` -> hotpotqa, ``idx`` with ``question``/``answer`` -> r1_searcher) and, for a JSON list with
only ``_id/question/answer``, from the file name ("2wiki" -> 2wiki, else hotpotqa: both read the same
fields, only the source name differs). Content decides before the file name, so R1-Searcher's
``musique_500.jsonl`` is r1_searcher, not MuSiQue. What cannot be told apart is an error that asks for
the format (``sonar eval --format``, ``stages.N.format``, ``eval.format`` or ``fmt=``). ``.gz`` files
are read transparently.

Gold answers keep their original text (case, punctuation, whitespace inside); only surrounding
whitespace is stripped. Scoring normalises; loading does not.

Every item gets ``source``: the dataset name (the ``source=`` argument, else the parent folder for
FlashRAG-style ``<dataset>/<split>.jsonl`` paths, else the format name). ``qid`` is the record's id,
or ``<source>-<index>`` when the format has none. Duplicate qids in one file are an error (Sonar keys
retrieval and scoring by qid). ``meta`` keeps the record's small scalar fields (type, level,
answerable, ...) and FlashRAG's ``metadata`` scalars; large fields (context, paragraphs,
supporting_facts, evidences, question_decomposition) are not kept.

A malformed record raises ``DatasetError`` naming the file, the line (JSONL, CSV), the record
index (JSON list) or the row (parquet) and the field. ``load_datasets`` reads several files as one
training set and refuses a qid that two files share.
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from sonar.cluster.wire.plugins import Registry, is_plugin
from sonar.cluster.wire.text import clean_text

FORMATS = ("flashrag", "hotpotqa", "2wiki", "musique", "bamboogle", "r1_searcher", "verl")
ALIASES = {"search_r1": "flashrag", "jsonl": "flashrag", "rag_r1": "flashrag", "hotpot": "hotpotqa",
           "2wikimultihopqa": "2wiki", "search_r1_parquet": "verl", "parquet": "verl"}
"""Other names accepted for a format (``sonar eval --format``, ``stages.N.format``)."""
_SPLIT_STEMS = {"train", "dev", "test", "val", "valid", "validation", "train_data", "test_data", "dev_data"}
_BIG_FIELDS = {"context", "paragraphs", "supporting_facts", "evidences", "question_decomposition",
               "gen_text_store", "pred_anses", "prompt", "reward_model"}
_ASK_FORMAT = ("pass the format: sonar eval --format, stages.N.format or eval.format in a config, "
               "fmt= in Python; one of")


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


def _json_limit(e: Exception) -> str:
    """What ``json.loads`` raised past a limit of the interpreter, not of the JSON grammar."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _iter_jsonl(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        except (RecursionError, ValueError) as e:
            raise DatasetError(f"{path}: line {lineno}: invalid JSON ({_json_limit(e)})") from None
        yield f"line {lineno}", rec


def _parquet_records(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise DatasetError(f"{path}: cannot read parquet ({type(e).__name__}: {e})") from None
    return [(f"row {i}", rec) for i, rec in enumerate(rows)]


def _records(path: Path) -> tuple[str, list[tuple[str, Any]]]:
    """(container kind 'jsonl' | 'json' | 'csv' | 'parquet', [(location, record)])."""
    if path.suffix.lower() == ".parquet":
        return "parquet", _parquet_records(path)
    try:
        with _open_text(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except (UnicodeDecodeError, OSError) as e:
        raise DatasetError(f"{path}: cannot read ({e})") from None
    except (EOFError, zlib.error) as e:  # a .gz cut short or corrupt (a bad header or CRC is an OSError)
        raise DatasetError(f"{path}: truncated or corrupt gzip archive ({e})") from None
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
        except (RecursionError, ValueError) as e:
            raise DatasetError(f"{path}: invalid JSON ({_json_limit(e)})") from None
        return "json", [(f"record {i}", rec) for i, rec in enumerate(data)]
    if suffix == ".json" and stripped.startswith("{"):
        # a single JSON object holding a list (e.g. {"data": [...]}) or a JSONL file named .json
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return "jsonl", list(_iter_jsonl(path, text))
        except (RecursionError, ValueError) as e:
            raise DatasetError(f"{path}: invalid JSON ({_json_limit(e)})") from None
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
    if kind == "parquet" and keys & {"reward_model", "prompt"}:
        return "verl"
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
    if {"idx", "question", "answer"} <= keys:
        return "r1_searcher"
    if "musique" in name:
        return "musique"
    if "bamboogle" in name:
        return "bamboogle"
    raise DatasetError(f"{path}: cannot detect the format from fields {sorted(keys)}; {_ASK_FORMAT} {list(FORMATS)}")


def _source_name(path: Path, fmt: str) -> str:
    stem = Path(path.stem).stem if path.suffix == ".gz" else path.stem
    if fmt in ("flashrag", "r1_searcher", "verl"):
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
    elif fmt == "r1_searcher":
        q = _text(path, loc, "question", _field(path, loc, rec, "question"))
        golds = _text_list(path, loc, "answer", _field(path, loc, rec, "answer"))
        idx = rec.get("idx")
        qid = f"{source}-{_text(path, loc, 'idx', idx)}" if idx is not None else f"{source}-{index}"
        used = {"idx", "question", "answer"}
    elif fmt == "verl":
        return _verl_item(path, loc, rec, index, source)
    else:  # pragma: no cover - fmt is validated by load_dataset
        raise AssertionError(fmt)
    return QAItem(qid=qid, question=q, golds=golds, source=source, meta=_small(rec, used))


def _verl_question(path: Path, loc: str, prompt: Any) -> str:
    """The question inside a Search-R1 / RAG-R1 prompt: the text after the last ``Question:`` of the
    last user message (both templates end with ``Question: {question}\\n``)."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        raise DatasetError(f"{path}: {loc}: field 'prompt': expected a list of chat messages, "
                           f"got {type(prompt).__name__}")
    users = [m.get("content") for m in prompt if m.get("role") == "user"]
    text = users[-1] if users and isinstance(users[-1], str) else None
    if text is None or "Question:" not in text:
        raise DatasetError(f"{path}: {loc}: field 'prompt': no user message with 'Question:' to take the "
                           "question from (and no 'question' column)")
    return _text(path, loc, "prompt", text.rsplit("Question:", 1)[1])


def _verl_item(path: Path, loc: str, rec: dict, index: int, source: str) -> QAItem:
    if rec.get("question") is not None:
        q = _text(path, loc, "question", rec["question"])
    else:
        q = _verl_question(path, loc, _field(path, loc, rec, "prompt"))
    rm = rec.get("reward_model")
    gt = rm.get("ground_truth") if isinstance(rm, dict) else None
    if isinstance(gt, dict) and gt.get("target") is not None:
        golds = _text_list(path, loc, "reward_model.ground_truth.target", gt["target"])
    elif rec.get("golden_answers") is not None:
        golds = _text_list(path, loc, "golden_answers", rec["golden_answers"])
    else:
        raise DatasetError(f"{path}: {loc}: field 'reward_model.ground_truth.target': missing "
                           f"(and no 'golden_answers'; fields: {sorted(rec)})")
    src = rec.get("data_source") if isinstance(rec.get("data_source"), str) and rec["data_source"] else source
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    if extra.get("index") is not None and rec.get("data_source"):
        qid = f"{src}-{_text(path, loc, 'extra_info.index', extra['index'])}"
    elif rec.get("id") is not None:
        qid = _text(path, loc, "id", rec["id"])
    else:
        qid = f"{source}-{index}"
    meta = _small(rec, {"id", "question", "golden_answers", "data_source", "extra_info"})
    meta.update({f"extra_info.{k}": v for k, v in extra.items()
                 if k != "index" and (v is None or isinstance(v, (str, int, float, bool)))})
    return QAItem(qid=qid, question=q, golds=golds, source=src, meta=meta)


# ---------------------------------------------------------------- public API
def load_dataset(path: str | Path, fmt: str = "auto", source: str | None = None) -> list[QAItem]:
    """Load every record of ``path``. ``fmt``: "auto" or one of ``FORMATS`` (aliases: search_r1).

    ``source`` overrides the dataset name stored in each item. Raises ``DatasetError``.
    """
    path = Path(path)
    fmt = ALIASES.get(fmt, fmt)
    if fmt != "auto" and fmt not in FORMATS:
        raise DatasetError(f"{path}: format {fmt!r} is not 'auto' or one of {list(FORMATS)} "
                           f"(aliases {sorted(ALIASES)})")
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
            key = {"hotpotqa": "_id", "2wiki": "_id", "r1_searcher": "idx",
                   "verl": "extra_info.index"}.get(fmt, "id")
            raise DatasetError(f"{path}: {loc}: field {key!r}: duplicate id {item.qid!r} (first at {seen[item.qid]})")
        seen[item.qid] = loc
        items.append(item)
    return items


def dotted_field(rec: Any, key: str) -> Any:
    """``rec[a][b]`` for ``key`` "a.b" (a list index where a part is a number; a literal key "a.b" of
    ``rec`` wins); KeyError if absent. The one reader of dotted record keys (``stages.N.fields``,
    ``sonar score --pred-field``)."""
    if isinstance(rec, dict) and key in rec:
        return rec[key]
    cur = rec
    for part in key.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise KeyError(key)
    return cur


def load_mapped(path: str | Path, fields: dict, source: str | None = None) -> list[QAItem]:
    """Any JSONL / JSON list / parquet file through a field mapping (``stages.N.fields``): Sonar's key ->
    the record's (dotted) key, ``question`` and ``golds`` required, ``qid`` optional (else
    ``<source>-<index>``). Every other small scalar field of the record becomes the item's ``meta``."""
    path = Path(path)
    _, records = _records(path)
    if not records:
        raise DatasetError(f"{path}: no records")
    src = source or _source_name(path, "mapped")
    items, seen = [], {}
    for index, (loc, rec) in enumerate(records):
        if not isinstance(rec, dict):
            raise DatasetError(f"{path}: {loc}: expected a JSON object, got {type(rec).__name__}")
        got = {}
        for ours, theirs in fields.items():
            try:
                got[ours] = dotted_field(rec, theirs)
            except KeyError:
                if ours == "qid":
                    continue
                raise DatasetError(f"{path}: {loc}: field {theirs!r} (fields.{ours}): missing "
                                   f"(fields: {sorted(rec)})") from None
        q = _text(path, loc, fields["question"], got["question"])
        golds = _text_list(path, loc, fields["golds"], got["golds"])
        qid = _text(path, loc, fields["qid"], got["qid"]) if got.get("qid") is not None else f"{src}-{index}"
        if qid in seen:
            raise DatasetError(f"{path}: {loc}: field {fields.get('qid', 'qid')!r}: duplicate id {qid!r} "
                               f"(first at {seen[qid]})")
        seen[qid] = loc
        used = {str(v).split(".")[0] for v in fields.values()}
        items.append(QAItem(qid=qid, question=q, golds=golds, source=src, meta=_small(rec, used)))
    return items


DATASETS = Registry("dataset")
"""``stages.N.format`` -> ``load(path) -> iterable``: every built-in format (``FORMATS``) and a user's
plug-in (``module:attr`` / ``file.py:attr``) are served by ``DATASETS.get``. A loader yields
``QAItem`` or dicts with ``question``, ``golds`` (a string or a list) and optionally ``qid``, ``meta``."""
for _fmt in FORMATS:
    DATASETS.register(_fmt)(lambda path, _f=_fmt: load_dataset(path, fmt=_f))


def _plugin_items(path: Path, fmt: str) -> list[QAItem]:
    """The items a dataset plug-in yields for ``path``, checked as the built-in loaders check theirs."""
    loader = DATASETS.get(fmt, "format")
    try:
        rows = list(loader(str(path)))
    except DatasetError:
        raise
    except Exception as e:
        raise DatasetError(f"{path}: dataset plug-in {fmt!r} failed: {type(e).__name__}: {e}") from e
    src, items, seen = path.parent.name or path.stem, [], set()
    for i, row in enumerate(rows):
        loc = f"item {i} of {fmt!r}"
        if isinstance(row, QAItem):
            item = row
        elif isinstance(row, dict):
            q = _text(path, loc, "question", _field(path, loc, row, "question"))
            golds = _text_list(path, loc, "golds", _field(path, loc, row, "golds"))
            qid = _text(path, loc, "qid", row["qid"]) if row.get("qid") is not None else f"{src}-{i}"
            meta = row.get("meta") or {}
            if not isinstance(meta, dict):
                raise DatasetError(f"{path}: {loc}: field 'meta': expected a dict, got {type(meta).__name__}")
            item = QAItem(qid=qid, question=q, golds=golds, source=str(row.get("source") or src), meta=dict(meta))
        else:
            raise DatasetError(f"{path}: {loc}: expected a QAItem or a dict, got {type(row).__name__}")
        if item.qid in seen:
            raise DatasetError(f"{path}: {loc}: duplicate id {item.qid!r}")
        seen.add(item.qid)
        items.append(item)
    if not items:
        raise DatasetError(f"{path}: dataset plug-in {fmt!r} yielded no items")
    return items


def _cleaned(item: QAItem) -> QAItem:
    """The item's question, answers and id through ``clean_text`` (a lone surrogate in a data file would stop
    the tokenizer, or the tiny policy's vocabulary, at start-up)."""
    from dataclasses import replace

    return replace(item, qid=clean_text(item.qid), question=clean_text(item.question),
                   golds=[clean_text(g) for g in item.golds])


def load_datasets(paths: str | Path | list, fmt: str = "auto", fields: dict | None = None) -> list[QAItem]:
    """Several files as one question set, in the order given (one path: ``load_dataset``).

    ``fmt`` applies to every file: a format, "auto", or a dataset plug-in (``DATASETS``); ``fields`` (a
    field mapping, ``load_mapped``) replaces the format's loader. A qid that two files share raises
    ``DatasetError`` naming both (training keys prompts by qid)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    items: list[QAItem] = []
    seen: dict[str, str] = {}
    for path in paths:
        if fields:
            loaded = load_mapped(path, dict(fields))
        elif is_plugin(fmt):
            loaded = _plugin_items(Path(path), fmt)
        else:
            loaded = load_dataset(path, fmt=fmt)
        for item in loaded:
            item = _cleaned(item)
            if item.qid in seen:
                raise DatasetError(f"{path}: qid {item.qid!r} is also in {seen[item.qid]}: files trained or "
                                   "evaluated together need distinct ids")
            seen[item.qid] = str(path)
            items.append(item)
    return items
