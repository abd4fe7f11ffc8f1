"""``sonar index``: build the retrieval index a config names, without training (and without Ray unless
``retrieval.dense.build_workers`` spreads a dense build over Ray actors).

    sonar index --config C [--resume] [--dense] [key=value ...]

The corpus is ``retrieval.corpus`` (JSONL, ``.jsonl.gz`` or parquet; unset: the synthetic world's, written
under ``run.root`` as training does). The index is the one training opens: ``retrieval.index_dir`` or
``<run.root>/index/<corpus fingerprint>`` for tantivy, ``retrieval.elastic.index`` for Elasticsearch.
``--dense`` (implied by ``retrieval.backend=dense``) also encodes every passage with ``retrieval.dense``'s
encoder beside the BM25 index, in checksummed shards of ``retrieval.dense.shard_rows`` (spread over
``retrieval.dense.build_workers`` Ray actors, a GPU each where the cluster has them): run again after a
kill, it continues from its last finished shard. That is the only corpus-wide encode in Sonar (the dense
reranker encodes its candidates at query time); with ``retrieval.elastic.store_vectors`` the bulk load
stores vectors in Elasticsearch instead. An interrupted BM25 build is refused unless ``--resume`` is given,
which continues it from the last committed batch. Progress (with an ETA) goes to stderr; one summary line
to stdout.
"""
from __future__ import annotations

import sys

from sonar.cluster.wire.config import Config


def run_index(cfg: Config, *, resume: bool = False, progress: bool = True, dense: bool = False):
    """Build (or check, or finish) the index of ``cfg``, and with ``dense`` its passage vectors; returns
    (the ``IndexReport``, the ``PassageVectors`` or None)."""
    from sonar.cluster.driver.roles import indexes_dir, prepare_corpus
    from sonar.retrieval.indexer import build_dense, ensure_index, index_dir_for

    corpus = prepare_corpus(cfg, None)
    rep = ensure_index(cfg.retrieval, corpus, indexes_dir(cfg), resume=resume, progress=progress)
    if not (dense or cfg.retrieval.backend == "dense"):
        return rep, None
    where = rep.index_dir or str(index_dir_for(cfg.retrieval, corpus, indexes_dir(cfg)))
    n = cfg.retrieval.dense.build_workers
    if n == 0:
        return rep, build_dense(cfg.retrieval, corpus, where, progress=progress)
    import ray

    from sonar.cluster.driver.roles import init_ray
    from sonar.retrieval.indexer import RayEncodePool

    owns = init_ray(cfg)  # retrieval.dense.build_workers actors encode the shards (a GPU each where there are)
    pool = RayEncodePool(cfg.retrieval, n)
    try:
        return rep, build_dense(cfg.retrieval, corpus, where, progress=progress, pool=pool)
    finally:
        pool.close()
        if owns:
            ray.shutdown()


def main(cfg: Config, resume: bool, dense: bool = False) -> int:
    """Exit 0 with a summary line on stdout; 2 with one line on stderr for a partial index, a missing
    corpus or an unreadable corpus line."""
    from sonar.retrieval.corpus import CorpusError
    from sonar.retrieval.indexer import IndexBuildError

    from sonar.cluster.wire.plugins import INDEXED_RETRIEVERS

    backend = cfg.retrieval.backend
    if backend not in INDEXED_RETRIEVERS:
        where = (f"the retrieval server at retrieval.http.url={cfg.retrieval.http.url!r} searches its own (build "
                 "its index with the server's tools, e.g. Search-R1's index_builder.py)" if backend == "http"
                 else "the service or code behind it holds its own")
        print(f"sonar: index error: retrieval.backend={backend!r} has no index Sonar builds (only "
              f"{' and '.join(INDEXED_RETRIEVERS)} do): {where}; nothing to do here", file=sys.stderr)
        return 2
    try:
        rep, vectors = run_index(cfg, resume=resume, dense=dense)
    except (IndexBuildError, CorpusError, FileNotFoundError) as e:
        print(f"sonar: index error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    what = "complete, reused" if rep.reused else ("resumed and completed" if rep.resumed else "built")
    exp = f" of {rep.expected_docs} expected" if rep.expected_docs is not None else ""
    vec = (f"; {len(vectors)} dense vectors ({vectors.model}) in {vectors.directory}" if vectors is not None else
           "; vectors stored in the index" if cfg.retrieval.backend == "elasticsearch" and cfg.retrieval.elastic.store_vectors
           else "")
    print(f"sonar: index {rep.location} ({rep.backend}) {what}: {rep.num_docs} documents{exp} in "
          f"{rep.seconds:.1f} s{vec}")
    return 0
