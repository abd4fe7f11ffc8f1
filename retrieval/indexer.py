"""The one index builder: ``sonar index`` and training both go through :func:`ensure_index`.

``ensure_index(cfg, corpus_path, index_root, resume=...)`` makes sure the index ``cfg`` (a
``RetrievalConfig``) names is complete, building it when it does not exist, and returns an
:class:`IndexReport`. Every index carries a manifest (tantivy: ``<index_dir>/sonar_index.json``;
Elasticsearch: the mapping's ``_meta.sonar_manifest``) with the corpus fingerprint, the expected
document count (``corpus.count_records``), the committed documents and the last committed corpus line.

- Complete (manifest ``complete`` and the index holds its documents): used as it is; the corpus file is
  not needed (tantivy: found by the manifest's ``corpus_path`` under ``index_root`` when the file is gone).
- Interrupted (manifest ``building``): ``resume=True`` (``sonar index --resume``) continues after the last
  committed batch; ``resume=False`` (training) raises :class:`PartialIndexError` naming the index, its
  document count and the expected count. It is never reused silently.
- Absent: built from the corpus (JSONL, ``.jsonl.gz`` or parquet), with a progress bar on stderr.
- An Elasticsearch index without a manifest (made by someone else) is used as it is unless it holds
  fewer documents than the corpus has lines/rows, which is refused like a partial one (``--resume``
  fills it: documents are indexed by id, so re-sending one is harmless).

Dense vectors are never built here on a run's path: the dense reranker encodes its candidates at query
time, and the passage vectors of the ``dense`` backend (or any backend, to save the reranker's encoding)
are built by ``build_dense`` (``sonar index --dense``) beside the BM25 index, in resumable, checksummed
shards. With ``elastic.store_vectors`` the bulk load encodes each batch and stores it in the index as
``dense_vector`` (then the search path reranks server-side, ``elastic.ServerDenseReranker``).
"""
from __future__ import annotations

from sonar.cluster.wire.bootstrap import role_process

role_process()  # first: in an actor's process, its thread and hub settings before torch and transformers load

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sonar.retrieval.corpus import CorpusReader, corpus_fingerprint, count_records
from sonar.retrieval.tantivy_index import MARKER, IndexBuildError, PartialIndexError

log = logging.getLogger(__name__)

__all__ = ["IndexReport", "PartialIndexError", "IndexBuildError", "ensure_index", "locate_tantivy_index"]


@dataclass(frozen=True)
class IndexReport:
    backend: str
    location: str
    """tantivy: the index directory; elasticsearch: ``<host>/<index>``."""
    num_docs: int
    expected_docs: int | None
    reused: bool
    """True when a complete index was found and nothing was indexed."""
    resumed: bool
    seconds: float
    index_dir: str | None = None
    """The directory of the index and/or its vectors (tantivy; elasticsearch with client-side vectors)."""


def index_dir_for(cfg, corpus_path: str, index_root: str) -> Path:
    """``retrieval.index_dir``, or ``<index_root>/<fingerprint of corpus_path>``: where the index is built."""
    if cfg.index_dir:
        return Path(cfg.index_dir)
    return Path(index_root) / corpus_fingerprint(corpus_path)


def locate_tantivy_index(cfg, corpus_path: str, index_root: str) -> Path | None:
    """With the corpus file gone: the directory of a complete index built from ``corpus_path``
    (``cfg.index_dir`` if its manifest is complete, else the newest complete one under ``index_root``
    whose manifest names that corpus path), or None."""
    import json

    from sonar.retrieval.tantivy_index import index_is_complete

    if cfg.index_dir:
        return Path(cfg.index_dir) if index_is_complete(cfg.index_dir) else None
    want = str(Path(corpus_path).resolve())
    found: list[tuple[float, Path]] = []
    for marker in Path(index_root).glob(f"*/{MARKER}"):
        try:
            m = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if m.get("corpus_path") == want and index_is_complete(marker.parent):
            found.append((float(m.get("updated", 0)), marker.parent))
    return max(found)[1] if found else None


def _need_corpus(cfg, corpus_path: str, why: str) -> None:
    if not Path(corpus_path).is_file():
        raise FileNotFoundError(f"corpus {corpus_path!r} does not exist (retrieval.corpus={cfg.corpus!r}) and {why}")


def ensure_index(cfg, corpus_path: str, index_root: str, *, resume: bool = False, progress: bool = False,
                 encoder: Any = None) -> IndexReport:
    """Make the index of ``cfg`` complete (see the module docstring). ``encoder``: the ``DenseEncoder`` to
    use when vectors must be built (created from ``cfg.rerank_model`` when needed and not given)."""
    t0 = time.perf_counter()
    if cfg.backend in ("tantivy", "dense"):  # dense: its passages' text lives in the BM25 index beside the vectors
        rep = _tantivy(cfg, corpus_path, index_root, resume, progress)
    elif cfg.backend == "elasticsearch":
        rep = _elastic(cfg, corpus_path, resume, progress, encoder)
    else:
        raise ValueError(f"retrieval.backend={cfg.backend!r} is not one of ['tantivy', 'elasticsearch', 'dense']")
    return replace(rep, seconds=time.perf_counter() - t0)


def build_dense(cfg, corpus_path: str, index_dir: str | Path, *, progress: bool = False, pool=None):
    """``sonar index --dense``: the passage vectors of ``corpus_path`` with ``retrieval.dense``'s encoder and
    passage prefix, in ``index_dir`` beside its BM25 index; resumes a build killed part-way from its last
    verified shard. ``pool``: a ``RayEncodePool`` spreading the shards over actors (None: this process).
    Returns the ``PassageVectors``."""
    from sonar.retrieval.rerank import DenseEncoder, build_passage_vectors

    import torch

    _need_corpus(cfg, corpus_path, f"the dense vectors of {index_dir} must be built from it")
    # on a GPU node the encoder runs there (21 M MiniLM passages: minutes on GPUs, weeks on one CPU)
    encoder = DenseEncoder(cfg.dense.model, device="cuda" if torch.cuda.is_available() else "cpu")
    return build_passage_vectors(corpus_path, index_dir, encoder, progress=progress, chunk=cfg.dense.shard_rows,
                                 prefix=cfg.dense.passage_prefix, pool=pool)


class RayEncodePool:
    """``workers`` Ray actors, each with the dense encoder (on one GPU each when the cluster has GPUs), that
    encode the shards of a vector build side by side: ``submit`` hands a shard to the next actor (round
    robin), ``get`` waits for it; ``in_flight`` = 2 per actor keeps each busy while the driver writes.
    ``close`` kills the actors it started (their handles, never by name)."""

    def __init__(self, cfg, workers: int, batch_size: int = 64):
        import ray

        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0

        @ray.remote(num_cpus=1, num_gpus=gpus)
        class ShardEncoder:
            def __init__(self, model, device):
                from sonar.retrieval.rerank import DenseEncoder

                self.encoder = DenseEncoder(model, device=device)

            def encode(self, texts, batch_size):
                from sonar.retrieval.rerank import encode_sorted

                return encode_sorted(self.encoder, texts, batch_size)

        device = "cuda" if gpus else "cpu"
        self.actors = [ShardEncoder.remote(cfg.dense.model, device) for _ in range(workers)]
        self.batch_size, self.in_flight, self._next = batch_size, 2 * workers, 0
        self._ray = ray

    def submit(self, texts: list[str]):
        actor = self.actors[self._next % len(self.actors)]
        self._next += 1
        return actor.encode.remote(texts, self.batch_size)

    def get(self, ref):
        return self._ray.get(ref)

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)


# ------------------------------------------------------------------------------------------ tantivy

def _tantivy(cfg, corpus_path: str, index_root: str, resume: bool, progress: bool) -> IndexReport:
    from sonar.retrieval.tantivy_index import build_index

    if not Path(corpus_path).is_file():
        found = locate_tantivy_index(cfg, corpus_path, index_root)
        if found is None:
            where = cfg.index_dir or f"{index_root}/*"
            _need_corpus(cfg, corpus_path, f"no complete index of it was found in {where}")
        import json

        m = json.loads((found / MARKER).read_text())
        log.info("corpus %s is absent; using its complete index %s (%d documents)", corpus_path, found,
                 m["committed_docs"])
        return IndexReport("tantivy", str(found), int(m["committed_docs"]), m.get("expected_docs"), True, False, 0.0,
                           index_dir=str(found))
    import json

    idx_dir = index_dir_for(cfg, corpus_path, index_root)
    try:
        was_partial = json.loads((idx_dir / MARKER).read_text()).get("status") == "building"
    except (OSError, ValueError):
        was_partial = False
    info = build_index(corpus_path, idx_dir, progress=progress, resume=resume)
    m = json.loads((idx_dir / MARKER).read_text())
    return IndexReport("tantivy", str(idx_dir), info.num_docs, m.get("expected_docs"), info.reused,
                       was_partial and not info.reused, info.seconds, index_dir=str(idx_dir))


# ------------------------------------------------------------------------------------ elasticsearch

def _elastic(cfg, corpus_path: str, resume: bool, progress: bool, encoder: Any) -> IndexReport:
    from sonar.retrieval.elastic import ElasticRetriever

    r = ElasticRetriever.from_config(cfg.elastic)
    try:
        return elastic_load(r, cfg, corpus_path, resume=resume, progress=progress, encoder=encoder)
    finally:
        r.close()


def elastic_load(r, cfg, corpus_path: str, *, resume: bool, progress: bool, encoder: Any = None) -> IndexReport:
    """Check, resume or bulk-load the Elasticsearch index of retriever ``r`` (see the module docstring)."""
    from sonar.retrieval.elastic import bulk_index, read_manifest, write_manifest

    t0 = time.perf_counter()
    client, index = r.client, r.index
    where = f"{r.hosts[0] if r.hosts else '?'}/{index}"
    try:
        exists = bool(client.indices.exists(index=index))
    except Exception as e:  # noqa: BLE001 - report which server and index failed
        raise RuntimeError(f"cannot reach Elasticsearch {r.hosts} to check index {index!r}: {e}") from e
    store = bool(cfg.elastic.store_vectors)
    after_line, manifest = 0, None
    if exists:
        manifest = read_manifest(client, index)
        client.indices.refresh(index=index)  # an interrupted load did not refresh: count what it committed
        count = int(client.count(index=index)["count"])
        if manifest is not None and manifest.get("status") == "complete":
            if count < int(manifest.get("committed_docs", 0)):
                raise PartialIndexError(where, count, manifest.get("committed_docs"),
                                        " (the index lost documents since it was completed)")
            if store and not manifest.get("store_vectors"):
                raise IndexBuildError(f"index {where} holds no passage vectors but retrieval.elastic.store_vectors="
                                      f"true: delete it and run `sonar index` again, or set store_vectors=false")
            return IndexReport("elasticsearch", where, count, manifest.get("expected_docs"), True, False,
                               time.perf_counter() - t0)
        if manifest is None:
            expected = count_records(corpus_path) if Path(corpus_path).is_file() else None
            if expected is None or count >= expected:
                log.warning("Elasticsearch index %s has no Sonar manifest (not built by `sonar index`); using it as it "
                            "is (%d documents)", where, count)
                return IndexReport("elasticsearch", where, count, expected, True, False, time.perf_counter() - t0)
            if not resume:
                raise PartialIndexError(where, count, expected)
        elif not resume:
            raise PartialIndexError(where, count, manifest.get("expected_docs"))
        else:
            after_line = int(manifest.get("committed_line", 0))
            _need_corpus(cfg, corpus_path, f"index {where} is incomplete")
            if manifest.get("fingerprint") != corpus_fingerprint(corpus_path):
                raise IndexBuildError(f"index {where} was being built from another corpus (fingerprint "
                                      f"{manifest.get('fingerprint')}, {manifest.get('corpus_path')!r}) than "
                                      f"{corpus_path!r}: delete it or point retrieval.corpus at that file")
    _need_corpus(cfg, corpus_path, f"index {where} must be built from it")
    if not exists:
        log.info("creating Elasticsearch index %s (shards %d, replicas %d) from %s", where, r.shards, r.replicas,
                 corpus_path)
        r.create_index()
    if store and encoder is None:
        from sonar.retrieval.rerank import DenseEncoder

        encoder = DenseEncoder(cfg.rerank_model)
    expected = (manifest or {}).get("expected_docs") or count_records(corpus_path)
    done = int((manifest or {}).get("committed_docs", 0))
    manifest = {"status": "building", "fingerprint": corpus_fingerprint(corpus_path),
                "corpus_path": str(Path(corpus_path).resolve()), "expected_docs": int(expected),
                "committed_docs": done, "committed_line": after_line, "store_vectors": store,
                "vector_model": encoder.tag if store else None, "started": time.time()}
    write_manifest(client, index, manifest)
    from sonar.retrieval.progress import progress_bar

    bar = progress_bar(expected, f"indexing {where}", "doc", initial=done, enabled=progress)
    reader = CorpusReader(corpus_path)
    batch: list[tuple[int, Any]] = []

    def flush() -> None:
        nonlocal done
        docs = [{"id": p.doc_id, "title": p.title, "text": p.text} for _, p in batch]
        vectors = None
        if store:
            from sonar.retrieval.rerank import passage_text

            vectors = encoder.encode([passage_text(p) for _, p in batch])
        bulk_index(client, index, docs, batch_size=len(docs), progress=False, vectors=vectors, refresh=False)
        done += len(docs)
        manifest.update(committed_docs=done, committed_line=batch[-1][0], updated=time.time())
        write_manifest(client, index, manifest)  # after the batch is acknowledged: the resume point
        bar.update(len(docs))
        batch.clear()

    try:
        for line_no, p in reader.records(after_line=after_line):
            batch.append((line_no, p))
            if len(batch) >= cfg.elastic.bulk_batch_size:
                flush()
        if batch:
            flush()
    finally:
        bar.close()
    client.indices.refresh(index=index)
    count = int(client.count(index=index)["count"])
    manifest.update(status="complete", committed_docs=count, updated=time.time(),
                    corpus_stats=reader.stats.as_dict())
    write_manifest(client, index, manifest)
    log.info("indexed %d documents into %s in %.1f s", count, where, time.perf_counter() - t0)
    return IndexReport("elasticsearch", where, count, int(expected), False, after_line > 0, time.perf_counter() - t0)
