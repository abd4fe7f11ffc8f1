"""JSONL passage corpora, query normalisation and a deterministic synthetic corpus.

Corpus format (Search-R1 / FlashRAG): one JSON object per line, either ``{"id", "title", "text"}``
or ``{"id", "contents"}`` where ``contents`` is ``"title\\ntext"`` as FlashRAG writes it (one pair
of surrounding double quotes around the title, as in FlashRAG's wiki-18 dump, is removed).
``.gz`` files are read transparently. Line numbers below are 1-based physical lines of the file.

Decisions on bad input (each error names the file and the line):

- a line that is not valid JSON, not an object, or has a missing/empty ``id`` or neither ``text``
  nor ``contents``: :class:`CorpusError` (``on_error="raise"``, the default). With
  ``on_error="skip"`` the line is skipped, counted in ``CorpusStats.skipped`` and logged as a
  warning; nothing is ever dropped silently.
- bytes that are not UTF-8: decoded with ``errors="replace"`` (U+FFFD), counted in
  ``CorpusStats.bad_utf8`` and warned about with file and line (the first few lines individually,
  then a summary at the end of the pass). A passage with one broken byte is still worth indexing.
- blank lines are skipped and counted (``CorpusStats.blank``).
- control characters (C0 except tab and newline, DEL, C1) are stripped from id, title and text;
  the number of passages touched is counted (``CorpusStats.control_stripped``).
- integer ids are accepted and converted to ``str``.
- duplicate ids are refused, in both ``on_error`` modes: a full pass ends with :class:`CorpusError`
  naming the id and both lines (an index would hold the passage twice, or an Elasticsearch index
  would keep only the last, and a hit's id would no longer name one passage). Deduplicating would
  have to choose which text is right; the corpus' author can. The check keeps 16 bytes per passage
  (a 64-bit hash of the id and its line) and runs when the pass ends.
- a corpus without a single passage (an empty file, only blank or skipped lines) is refused with
  :class:`CorpusError` naming the file, when the pass ends.

Queries (:func:`normalise_query`): control characters become spaces, whitespace runs collapse to
one space, the result is stripped and cut at ``max_chars`` (on a word boundary when one is close).
An empty query after normalisation is not an error: backends answer it with an empty hit list and
count it (``empty_queries``), because model-written queries are data, not crashes.

Pure module: standard library and numpy (only for the synthetic generator).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import re
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from sonar.cluster.wire.text import clean_text

log = logging.getLogger(__name__)

_WARN_FIRST = 5
"""Individual warnings per pass and kind before only the summary is logged."""

# C0 controls except \t (0x09) and \n (0x0a), DEL, and C1 controls.
_CTRL_PASSAGE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CTRL_ANY = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_WS = re.compile(r"\s+")


class CorpusError(ValueError):
    """A corpus line that cannot be read; the message names the file and the 1-based line."""

    def __init__(self, path: str | os.PathLike, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path = str(path)
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Passage:
    doc_id: str
    title: str
    text: str


@dataclass
class CorpusStats:
    """Counters of one pass over a corpus."""

    lines: int = 0
    passages: int = 0
    blank: int = 0
    skipped: int = 0
    bad_utf8: int = 0
    control_stripped: int = 0
    bad_utf8_lines: list[int] = field(default_factory=list)
    """The first few lines with replaced bytes (for the report)."""

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "bad_utf8_lines"}


def _open_binary(path: Path):
    if path.suffix == ".gz":
        return _GzipLines(path)
    if path.suffix.lower() == ".parquet":
        return _ParquetLines(path)
    return open(path, "rb", buffering=1 << 20)


def is_parquet(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() == ".parquet"


class _ParquetLines:
    """The rows of a parquet corpus (veRL / Search-R1 ship parquet), each as one JSON line, so that every
    check of the JSONL reader applies unchanged and "line" N is row N (1-based). Read in record
    batches (pyarrow), never the whole table at once."""

    def __init__(self, path: Path, batch_rows: int = 8192):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise CorpusError(path, 0, "reading a parquet corpus needs pyarrow (pip install pyarrow)") from None
        try:
            self._f = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - ArrowInvalid / OSError for a file that is not parquet
            raise CorpusError(path, 0, f"cannot read parquet ({type(e).__name__}: {e})") from None
        self.path = path
        self.batch_rows = batch_rows

    def __enter__(self) -> "_ParquetLines":
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def __iter__(self) -> Iterator[bytes]:
        for batch in self._f.iter_batches(batch_size=self.batch_rows):
            for row in batch.to_pylist():
                yield json.dumps(row, ensure_ascii=False, default=str).encode("utf-8") + b"\n"


def count_records(path: str | os.PathLike) -> int:
    """Passages a corpus holds when every line is valid: the row count of a parquet file (from its
    metadata), else the non-blank lines of the JSONL (one pass over the bytes, no JSON parsing). What an
    index manifest records as the expected document count."""
    p = Path(path)
    if is_parquet(p):
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(p).metadata.num_rows)
    n = 0
    with _open_binary(p) as f:
        for raw in f:
            if raw.strip():
                n += 1
    return n


class _GzipLines:
    """The lines of a ``.gz`` corpus; a truncated or corrupt archive raises :class:`CorpusError` naming
    the file and the line being read when it broke (in either ``on_error`` mode: the rest is unreadable)."""

    def __init__(self, path: Path):
        self.path = path
        self._f = gzip.open(path, "rb")

    def __enter__(self) -> "_GzipLines":
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def __iter__(self) -> Iterator[bytes]:
        line = 0
        while True:
            try:
                raw = self._f.readline()
            except (EOFError, OSError, zlib.error) as e:  # truncated (EOFError), not gzip / bad CRC (OSError)
                raise CorpusError(self.path, line + 1, f"truncated or corrupt gzip archive ({e})") from None
            if not raw:
                return
            line += 1
            yield raw


def strip_controls(s: str) -> tuple[str, bool]:
    """Remove control characters except tab and newline, and repair lone surrogates (``clean_text``: a
    truncated emoji's ``\\ud83d`` escape would crash the index and every tokenizer). Returns (clean, changed)."""
    clean = _CTRL_PASSAGE.sub("", clean_text(s))
    return clean, clean != s


def split_contents(contents: str) -> tuple[str, str]:
    """FlashRAG ``contents`` -> (title, text): the first line is the title, possibly quoted."""
    title, sep, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text if sep else ""


class CorpusReader:
    """Iterates the passages of one JSONL corpus file with validation and counters.

    ``for p in CorpusReader(path)`` yields :class:`Passage`; :meth:`records` also yields the line
    number and can start after a given line (used by the resumable index build). ``stats`` holds the
    counters of the most recent pass.
    """

    def __init__(self, path: str | os.PathLike, on_error: str = "raise"):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r} is not one of ['raise', 'skip']")
        self.path = Path(path)
        if not self.path.is_file():
            raise CorpusError(self.path, 0, "corpus file does not exist")
        self.on_error = on_error
        self.stats = CorpusStats()
        self.bytes_read = 0
        """Bytes consumed by the current pass (uncompressed for .gz), for progress bars."""

    def __iter__(self) -> Iterator[Passage]:
        for _, p in self.records():
            yield p

    def records(self, after_line: int = 0) -> Iterator[tuple[int, Passage]]:
        """Yield ``(line_no, passage)`` for every valid line with ``line_no > after_line``. When the
        pass ends, duplicate ids (lines before ``after_line`` included) and a corpus with no passage
        raise :class:`CorpusError`."""
        st = self.stats = CorpusStats()
        self.bytes_read = 0
        path = self.path
        hashes, lines = array("Q"), array("Q")
        before = 0  # valid passages at or before after_line (a resumed pass still checks their ids)
        with _open_binary(path) as f:
            for line_no, raw in enumerate(f, start=1):
                st.lines += 1
                self.bytes_read += len(raw)
                if line_no <= after_line:
                    try:
                        p, _ = self._parse(raw.decode("utf-8", errors="replace"), line_no)
                    except CorpusError:
                        continue
                    hashes.append(_id_hash(p.doc_id))
                    lines.append(line_no)
                    before += 1
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    line = raw.decode("utf-8", errors="replace")
                    st.bad_utf8 += 1
                    if len(st.bad_utf8_lines) < _WARN_FIRST:
                        st.bad_utf8_lines.append(line_no)
                        log.warning("%s:%d: invalid UTF-8 (%s); bytes replaced by U+FFFD", path, line_no, e.reason)
                if not line.strip():
                    st.blank += 1
                    continue
                try:
                    passage, touched = self._parse(line, line_no)
                except CorpusError as e:
                    if self.on_error == "raise":
                        raise
                    st.skipped += 1
                    if st.skipped <= _WARN_FIRST:
                        log.warning("skipping %s", e)
                    continue
                st.control_stripped += touched
                st.passages += 1
                hashes.append(_id_hash(passage.doc_id))
                lines.append(line_no)
                yield line_no, passage
        if st.bad_utf8 > _WARN_FIRST or st.skipped > _WARN_FIRST:
            log.warning("%s: %d lines with invalid UTF-8 (first: %s), %d lines skipped",
                        path, st.bad_utf8, st.bad_utf8_lines, st.skipped)
        if st.passages + before == 0:
            raise CorpusError(path, 0, f"the corpus has no passages ({st.lines} lines, {st.blank} blank, "
                                       f"{st.skipped} skipped)")
        self._check_unique(hashes, lines)

    def _check_unique(self, hashes: array, lines: array) -> None:
        import numpy as np

        h = np.frombuffer(hashes, dtype=np.uint64)
        if len(h) < 2:
            return
        order = np.argsort(h, kind="stable")
        same = np.flatnonzero(h[order][1:] == h[order][:-1])
        if not len(same):
            return
        ln = np.frombuffer(lines, dtype=np.uint64)
        pairs = sorted((int(ln[order[i]]), int(ln[order[i + 1]])) for i in same)
        ids = self._ids_at({x for pair in pairs for x in pair})
        dups = [(a, b) for a, b in pairs if ids.get(a) == ids.get(b)]  # a 64-bit collision is not a duplicate
        if dups:
            a, b = min(dups, key=lambda pair: pair[1])
            more = f" ({len(dups)} duplicate ids in all)" if len(dups) > 1 else ""
            raise CorpusError(self.path, b, f"duplicate id {ids[b]!r}, first at line {a}{more}: ids must be unique")

    def _ids_at(self, wanted: set[int]) -> dict[int, str]:
        out: dict[int, str] = {}
        last = max(wanted)
        with _open_binary(self.path) as f:
            for line_no, raw in enumerate(f, start=1):
                if line_no in wanted:
                    out[line_no] = self._parse(raw.decode("utf-8", errors="replace"), line_no)[0].doc_id
                if line_no >= last:
                    break
        return out

    def _parse(self, line: str, line_no: int) -> tuple[Passage, bool]:
        path = self.path
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(path, line_no, f"not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise CorpusError(path, line_no, "not valid JSON (nested too deeply)") from None
        except ValueError as e:  # an integer over the interpreter's digit limit (4,300 by default)
            raise CorpusError(path, line_no, f"not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise CorpusError(path, line_no, f"expected a JSON object, got {type(obj).__name__}")
        doc_id = obj.get("id")
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
            raise CorpusError(path, line_no, "missing 'id' (a non-empty string or integer is required)"
                              if doc_id is None else f"'id' must be a string or integer, got {type(doc_id).__name__}")
        doc_id, t0 = strip_controls(str(doc_id).strip())
        if not doc_id:
            raise CorpusError(path, line_no, "empty 'id'")
        if "text" in obj or "title" in obj:
            title, text = obj.get("title") or "", obj.get("text")
            if text is None and "contents" in obj:
                title, text = split_contents(str(obj["contents"]))
        elif "contents" in obj:
            if not isinstance(obj["contents"], str):
                raise CorpusError(path, line_no, f"'contents' must be a string (id {doc_id!r})")
            title, text = split_contents(obj["contents"])
        else:
            raise CorpusError(path, line_no, f"neither 'text' nor 'contents' (id {doc_id!r})")
        if text is None:
            text = ""
        if not isinstance(title, str) or not isinstance(text, str):
            raise CorpusError(path, line_no, f"'title' and 'text' must be strings (id {doc_id!r})")
        title, t1 = strip_controls(title)
        text, t2 = strip_controls(text)
        return Passage(doc_id, title, text), (t0 or t1 or t2)


def _id_hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def iter_corpus(path: str | os.PathLike, on_error: str = "raise") -> Iterator[Passage]:
    """Shorthand for ``iter(CorpusReader(path, on_error))``."""
    return iter(CorpusReader(path, on_error))


def corpus_fingerprint(path: str | os.PathLike, head_bytes: int = 1 << 20) -> str:
    """A 16-hex-digit name for a corpus file: sha1 of (size, mtime_ns, first ``head_bytes``).

    Cheap on a 14 GB file; any rewrite (size or mtime change) gives a new name, so an index named
    after it is never silently reused for another corpus. Copying the file elsewhere (new mtime)
    also gives a new name: an unnecessary rebuild, never a wrong index.
    """
    p = Path(path)
    st = p.stat()
    h = hashlib.sha1()
    h.update(f"{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(p, "rb") as f:
        h.update(f.read(head_bytes))
    return h.hexdigest()[:16]


def normalise_query(q: str, max_chars: int | None = 512) -> tuple[str, bool]:
    """Clean one model/user-written query. Returns ``(query, truncated)``.

    Control characters become spaces, whitespace collapses to single spaces, the ends are
    stripped, and the result is cut to at most ``max_chars`` characters (``None`` or ``0``: no
    limit); the cut goes back to the last space when that loses fewer than 32 characters, so a
    word is not split. ``""`` is a legal result: callers answer it with no hits and count it.
    """
    if not isinstance(q, str):
        raise TypeError(f"query must be str, got {type(q).__name__}")
    if max_chars and len(q) > 4 * max_chars + 64:
        # Bound the regex work on a pathological 1 MB query; the cut below is exact anyway.
        q = q[: 4 * max_chars + 64]
        long_input = True
    else:
        long_input = False
    q = _WS.sub(" ", _CTRL_ANY.sub(" ", q)).strip()
    truncated = False
    if max_chars and len(q) > max_chars:
        cut = q[:max_chars]
        space = cut.rfind(" ")
        if space >= max_chars - 32 and space > 0:
            cut = cut[:space]
        q = cut.rstrip()
        truncated = True
    return q, truncated or (long_input and bool(max_chars))


# ---------------------------------------------------------------------------------------------
# Synthetic corpus for tests and benchmarks (deterministic; nothing is downloaded).

_SYLLABLES = ("ka", "lo", "mi", "nu", "re", "sa", "to", "vi", "ze", "an", "bel", "cor", "dun", "el",
              "fir", "gar", "hol", "ist", "jor", "kel", "lun", "mar", "nor", "ost", "pel", "quin",
              "ros", "sil", "tor", "ul", "ver", "wen", "xan", "yor", "zul")


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """``size`` distinct pseudo-words built from syllables (deterministic in ``seed``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words: list[str] = []
    seen: set[str] = set()
    syl = np.array(_SYLLABLES)
    while len(words) < size:
        n = int(rng.integers(2, 5))
        w = "".join(syl[rng.integers(0, len(syl), n)])
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def write_synthetic_corpus(path: str | os.PathLike, n_passages: int, seed: int = 0,
                           words_per_passage: int = 100, vocab_size: int = 50_000) -> Path:
    """Write a deterministic JSONL corpus ``{id, title, text}`` with Zipf-distributed words.

    Passages are about 100 words like the Search-R1 wiki-18 chunks; titles are 2-3 rarer words.
    The same arguments always produce byte-identical files.
    """
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = np.array(synthetic_vocab(vocab_size, seed))
    rng = np.random.default_rng(seed + 1)
    ranks = np.arange(1, vocab_size + 1, dtype=np.float64)
    p = 1.0 / ranks ** 1.07
    p /= p.sum()
    chunk = 4096
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for start in range(0, n_passages, chunk):
            m = min(chunk, n_passages - start)
            words = vocab[rng.choice(vocab_size, size=(m, words_per_passage), p=p)]
            titles = vocab[rng.integers(vocab_size // 10, vocab_size, size=(m, 3))]
            tlen = rng.integers(2, 4, size=m)
            buf = io.StringIO()
            for i in range(m):
                title = " ".join(titles[i, : tlen[i]]).title()
                text = " ".join(words[i])
                buf.write(json.dumps({"id": str(start + i), "title": title, "text": f"{title} is {text}."}))
                buf.write("\n")
            f.write(buf.getvalue())
    return path
