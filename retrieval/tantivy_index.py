"""Embedded BM25 over a JSONL corpus with tantivy: an idempotent, resumable build and a batched searcher.

Layout of an index directory::

    <index_dir>/sonar_index.json   the marker: corpus fingerprint, status, last committed line
    <index_dir>/tantivy/           tantivy's own files
    <index_dir>/vectors-*          passage vectors written by ``rerank.build_passage_vectors``

Schema: ``id`` (raw, stored), ``title`` and ``text`` (``en_stem``: simple tokenizer, tokens over
40 chars dropped, lowercase, English Porter stemmer; stored), ``line`` (u64, stored, fast: the
corpus line a document came from, which is what makes the build resumable).

Build (:func:`build_index`): documents are committed every ``batch_size`` passages; after each
commit the marker records the last committed line. A finished index whose marker matches the
corpus fingerprint is reused at once. After a crash the build resumes after the largest ``line``
actually in the index (a crash between a commit and the marker write is thus harmless). A marker
for another corpus, an index without a marker, or an index with fewer documents than its marker
says raise :class:`IndexBuildError` explaining what was found and what to do (``overwrite=True``
deletes an index this module built; a foreign directory is never deleted). A file lock serialises
concurrent builders of one directory (several workers starting at once): the second waits and then
reuses the finished index. A corpus with a duplicate id or no passage at all is refused
(``corpus.CorpusError`` from the reader, raised before the last commit): the index stays incomplete, so a
rerun refuses it again rather than reusing it.

Search (:class:`TantivyRetriever`): queries are never given to tantivy's query parser. Each query is
normalised (``corpus.normalise_query``), tokenised with an analyzer equal to ``en_stem``, English
stop words are dropped (unless nothing else is left), and a boolean SHOULD query over
``title^title_boost`` and ``text`` is built from the unique terms (at most ``max_terms``). This is the
same BM25 score tantivy's parser gives for ``title^b text`` (checked in the tests), and punctuation,
quotes, colons, ``AND``/``OR``/``NOT``, brackets or ``^`` in a query cannot raise. One searcher is
taken per batch and reused for all its queries.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import tantivy

from sonar.retrieval.base import Hit, RetrievalError, check_search_args
from sonar.retrieval.corpus import CorpusReader, corpus_fingerprint, normalise_query

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MARKER = "sonar_index.json"
TANTIVY_SUBDIR = "tantivy"
LOCK = ".build.lock"
_TOKENIZER = "en_stem"


class IndexBuildError(RuntimeError):
    """An index directory that cannot be built or reused as it is; the message says why and what to do."""


class PartialIndexError(IndexBuildError):
    """An interrupted build found by a caller that must not resume it (training): the message names the
    index, the documents it holds and the documents the corpus has; ``sonar index --resume`` finishes it."""

    def __init__(self, where: str, count: int, expected: int | None, hint: str = ""):
        self.where, self.count, self.expected = where, count, expected
        exp = "an unknown number of" if expected is None else str(expected)
        super().__init__(f"index {where} is incomplete: it holds {count} documents, the corpus has {exp} "
                         f"(an interrupted build); finish it with `sonar index --config <C> --resume`"
                         f"{hint}, or delete it")


@dataclass(frozen=True)
class IndexInfo:
    index_dir: str
    fingerprint: str
    num_docs: int
    reused: bool
    """True when a finished index was found and nothing was indexed."""
    resumed_after_line: int
    """0 for a fresh build; the line after which a resumed build continued."""
    seconds: float
    corpus_stats: dict


def make_schema() -> "tantivy.Schema":
    sb = tantivy.SchemaBuilder()
    sb.add_text_field("id", stored=True, tokenizer_name="raw")
    sb.add_text_field("title", stored=True, tokenizer_name=_TOKENIZER)
    sb.add_text_field("text", stored=True, tokenizer_name=_TOKENIZER)
    sb.add_unsigned_field("line", stored=True, indexed=True, fast=True)
    return sb.build()


def query_analyzer(stopwords: bool) -> "tantivy.TextAnalyzer":
    """The ``en_stem`` pipeline, optionally with the English stop-word filter before stemming."""
    b = tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple()).filter(tantivy.Filter.remove_long(40))
    b = b.filter(tantivy.Filter.lowercase())
    if stopwords:
        b = b.filter(tantivy.Filter.stopword("english"))
    return b.filter(tantivy.Filter.stemmer("english")).build()


# ------------------------------------------------------------------------------------------ build

def _read_marker(index_dir: Path) -> dict | None:
    p = index_dir / MARKER
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IndexBuildError(f"{p}: unreadable marker ({e}); delete {index_dir} or pass overwrite=True") from None


def _write_marker(index_dir: Path, marker: dict) -> None:
    tmp = index_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True))
    os.replace(tmp, index_dir / MARKER)


@contextmanager
def _build_lock(index_dir: Path):
    index_dir.mkdir(parents=True, exist_ok=True)
    with open(index_dir / LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _max_line(index: "tantivy.Index") -> int:
    searcher = index.searcher()
    if searcher.num_docs == 0:
        return 0
    res = searcher.search(tantivy.Query.all_query(), limit=1, count=False,
                          order_by_field="line", order=tantivy.Order.Desc)
    return int(searcher.doc(res.hits[0][1]).get_first("line"))


def index_is_complete(index_dir: str | os.PathLike, corpus_path: str | os.PathLike | None = None) -> bool:
    """True when ``index_dir`` holds a finished index (for ``corpus_path``'s fingerprint if given)."""
    try:
        m = _read_marker(Path(index_dir))
    except IndexBuildError:
        return False
    if not m or m.get("status") != "complete" or m.get("schema_version") != SCHEMA_VERSION:
        return False
    return corpus_path is None or m.get("fingerprint") == corpus_fingerprint(corpus_path)


def build_index(corpus_path: str | os.PathLike, index_dir: str | os.PathLike, batch_size: int = 50_000,
                progress: bool = True, *, on_error: str = "raise", overwrite: bool = False,
                heap_size: int = 256_000_000, num_threads: int = 1, resume: bool = True) -> IndexInfo:
    """Index ``corpus_path`` into ``index_dir`` (idempotent, resumable); see the module docstring.

    ``batch_size``: passages per commit (the resume granularity). ``on_error``: passed to
    :class:`CorpusReader` ("raise" or "skip"). ``num_threads``: tantivy indexing threads; 1 leaves
    the second core of a 2-core machine to the Python side that parses the JSON. ``resume=False``: an
    interrupted build raises :class:`PartialIndexError` instead of being continued (the training side;
    ``sonar index --resume`` continues it). ``progress``: a bar on stderr counting documents
    (``retrieval/progress.py``).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    corpus_path, index_dir = Path(corpus_path), Path(index_dir)
    t0 = time.perf_counter()
    fp = corpus_fingerprint(corpus_path)
    with _build_lock(index_dir):
        tdir = index_dir / TANTIVY_SUBDIR
        marker = _read_marker(index_dir)
        if marker is not None and (marker.get("fingerprint") != fp or marker.get("schema_version") != SCHEMA_VERSION):
            why = (f"{index_dir} holds an index of corpus {marker.get('corpus_path')!r} (fingerprint "
                   f"{marker.get('fingerprint')}, schema v{marker.get('schema_version')}, status {marker.get('status')}), "
                   f"but {corpus_path} has fingerprint {fp} (schema v{SCHEMA_VERSION}): the corpus changed or this is "
                   f"another corpus' index")
            if not overwrite:
                raise IndexBuildError(why + "; use another index_dir, delete this one, or pass overwrite=True")
            log.warning("%s; overwriting", why)
            shutil.rmtree(tdir, ignore_errors=True)
            (index_dir / MARKER).unlink()
            marker = None
        if marker is None and tdir.exists() and any(tdir.iterdir()):
            if not overwrite:
                raise IndexBuildError(
                    f"{tdir} contains files but {index_dir / MARKER} is missing: not an index built by build_index, or "
                    f"its marker was lost, so its completeness is unknown; delete it or pass overwrite=True")
            shutil.rmtree(tdir)
        tdir.mkdir(parents=True, exist_ok=True)
        schema = make_schema()
        index = tantivy.Index(schema, path=str(tdir), reuse=True)
        index.reload()
        num_docs = index.searcher().num_docs

        if marker is not None and marker.get("status") == "complete":
            if num_docs != marker.get("committed_docs"):
                raise IndexBuildError(
                    f"{index_dir}: marker says complete with {marker.get('committed_docs')} documents but the index "
                    f"holds {num_docs}: the index was modified or damaged; delete it or pass overwrite=True")
            return IndexInfo(str(index_dir), fp, num_docs, True, 0, time.perf_counter() - t0,
                             marker.get("corpus_stats", {}))

        after_line = 0
        if marker is not None and not resume:
            raise PartialIndexError(str(index_dir), num_docs, marker.get("expected_docs"))
        if marker is not None:  # a partial build: resume after the last line really in the index
            if num_docs < marker.get("committed_docs", 0):
                raise IndexBuildError(
                    f"{index_dir}: marker records {marker['committed_docs']} committed documents (up to line "
                    f"{marker['committed_line']}) but the index holds only {num_docs}: a partial or damaged index; "
                    f"delete it or pass overwrite=True")
            after_line = _max_line(index)
            if after_line != marker.get("committed_line"):
                log.warning("%s: marker says line %s, index holds lines up to %d (crash between commit and marker "
                            "write); resuming after line %d", index_dir, marker.get("committed_line"), after_line, after_line)
            log.info("resuming %s after line %d (%d documents already indexed)", index_dir, after_line, num_docs)
        elif num_docs:
            raise IndexBuildError(f"{tdir}: {num_docs} documents but no marker; delete it or pass overwrite=True")

        expected = marker.get("expected_docs") if marker is not None else None
        if expected is None:
            from sonar.retrieval.corpus import count_records

            expected = count_records(corpus_path)
        marker = {"schema_version": SCHEMA_VERSION, "fingerprint": fp, "corpus_path": str(corpus_path.resolve()),
                  "status": "building", "committed_line": after_line, "committed_docs": num_docs,
                  "expected_docs": expected, "started": time.time()}
        _write_marker(index_dir, marker)

        reader = CorpusReader(corpus_path, on_error=on_error)
        writer = index.writer(heap_size=heap_size, num_threads=num_threads)
        bar = None
        if progress:
            from sonar.retrieval.progress import progress_bar

            bar = progress_bar(expected, f"indexing {corpus_path.name}", "doc", initial=num_docs)
        pending, last_line, docs, added = 0, after_line, num_docs, 0
        Document = tantivy.Document
        try:
            for line_no, p in reader.records(after_line=after_line):
                doc = Document()
                doc.add_text("id", p.doc_id)
                doc.add_text("title", p.title)
                doc.add_text("text", p.text)
                doc.add_unsigned("line", line_no)
                writer.add_document(doc)
                pending += 1
                added += 1
                last_line = line_no
                if bar is not None and added % 256 == 0:
                    bar.update(256)
                if pending >= batch_size:
                    writer.commit()
                    docs += pending
                    pending = 0
                    marker.update(committed_line=last_line, committed_docs=docs, updated=time.time())
                    _write_marker(index_dir, marker)
            writer.commit()
            docs += pending
            writer.wait_merging_threads()
        except BaseException:
            # Uncommitted documents are discarded by tantivy; the marker still names the last commit.
            if bar is not None:
                bar.close()
            raise
        if bar is not None:
            bar.update(added % 256)
            bar.close()
        index.reload()
        num_docs = index.searcher().num_docs
        if num_docs != docs:
            raise IndexBuildError(f"{index_dir}: indexed {docs} documents but the index reports {num_docs}")
        secs = time.perf_counter() - t0
        marker.update(status="complete", committed_line=last_line, committed_docs=docs, updated=time.time(),
                      build_seconds=round(secs, 3), corpus_stats=reader.stats.as_dict())
        _write_marker(index_dir, marker)
        log.info("indexed %d documents into %s in %.1f s", docs, index_dir, secs)
        return IndexInfo(str(index_dir), fp, docs, False, after_line, secs, reader.stats.as_dict())


# ----------------------------------------------------------------------------------------- search

class TantivyRetriever:
    """BM25 over ``title^title_boost`` + ``text`` of a finished index built by :func:`build_index`.

    Thread-safe: tantivy searchers are safe to share; the counters are guarded by a lock.
    """

    def __init__(self, index_dir: str | os.PathLike, *, title_boost: float = 2.0, max_query_chars: int = 512,
                 max_terms: int = 64, stopwords: bool = True):
        index_dir = Path(index_dir)
        marker = _read_marker(index_dir)
        if marker is None or marker.get("status") != "complete":
            state = "no marker" if marker is None else f"status {marker.get('status')!r}"
            raise IndexBuildError(f"{index_dir}: not a finished index ({state}); run build_index(corpus, {index_dir!s}) first")
        if marker.get("schema_version") != SCHEMA_VERSION:
            raise IndexBuildError(f"{index_dir}: schema v{marker.get('schema_version')}, this code reads v{SCHEMA_VERSION}; rebuild")
        if title_boost <= 0 or max_terms < 1:
            raise ValueError(f"title_boost={title_boost} must be > 0 and max_terms={max_terms} >= 1")
        self.index_dir = index_dir
        self.fingerprint = marker["fingerprint"]
        self.name = f"tantivy:{index_dir.resolve()}"
        self.title_boost = float(title_boost)
        self.max_query_chars = max_query_chars
        self.max_terms = max_terms
        self._index = tantivy.Index.open(str(index_dir / TANTIVY_SUBDIR))
        self._schema = self._index.schema
        self._analyzer = query_analyzer(stopwords=stopwords)
        self._analyzer_all = query_analyzer(stopwords=False)
        self._lock = threading.Lock()
        self._counts = {"queries": 0, "batches": 0, "empty_queries": 0, "truncated": 0, "search_s": 0.0}
        self.num_docs = self._index.searcher().num_docs

    def terms(self, query: str) -> list[str]:
        """The unique index terms a (normalised) query is searched with, in first-seen order."""
        toks = self._analyzer.analyze(query) or self._analyzer_all.analyze(query)
        return list(dict.fromkeys(toks))[: self.max_terms]

    def build_query(self, query: str) -> "tantivy.Query | None":
        terms = self.terms(query)
        if not terms:
            return None
        Q, should, schema, b = tantivy.Query, tantivy.Occur.Should, self._schema, self.title_boost
        clauses = []
        for t in terms:
            clauses.append((should, Q.boost_query(Q.term_query(schema, "title", t, index_option="freq"), b)))
            clauses.append((should, Q.term_query(schema, "text", t, index_option="freq")))
        return Q.boolean_query(clauses)

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        check_search_args(queries, k)
        t0 = time.perf_counter()
        empty = truncated = 0
        out: list[list[Hit]] = []
        try:
            searcher = self._index.searcher()
            for q in queries:
                q, cut = normalise_query(q, self.max_query_chars)
                truncated += cut
                query = self.build_query(q) if q else None
                if query is None:
                    empty += 1
                    out.append([])
                    continue
                hits = []
                for score, addr in searcher.search(query, limit=k, count=False).hits:
                    d = searcher.doc(addr)
                    hits.append(Hit(d.get_first("id"), d.get_first("title") or "", d.get_first("text") or "", float(score)))
                out.append(hits)
        except (ValueError, OSError, RuntimeError) as e:
            raise RetrievalError("internal", f"tantivy search in {self.index_dir} failed: {e}") from e
        with self._lock:
            c = self._counts
            c["queries"] += len(queries)
            c["batches"] += 1
            c["empty_queries"] += empty
            c["truncated"] += truncated
            c["search_s"] += time.perf_counter() - t0
        return out

    def fetch(self, doc_ids: Sequence[str]) -> list[Hit | None]:
        """The stored passages of ``doc_ids`` (score 0; None for an id the index does not hold): the dense
        backend's document store, looked up by the raw ``id`` term."""
        searcher = self._index.searcher()
        out: list[Hit | None] = []
        for i in doc_ids:
            found = searcher.search(tantivy.Query.term_query(self._schema, "id", i), limit=1, count=False).hits
            if not found:
                out.append(None)
                continue
            d = searcher.doc(found[0][1])
            out.append(Hit(d.get_first("id"), d.get_first("title") or "", d.get_first("text") or "", 0.0))
        return out

    def stats(self) -> dict:
        with self._lock:
            return dict(self._counts, num_docs=self.num_docs)
