"""``sonar index``: build the retrieval index a config names, without Ray and without training.

    sonar index --config C [--resume] [key=value ...]

The corpus is ``retrieval.corpus`` (JSONL, ``.jsonl.gz`` or parquet; unset: the synthetic world's, written
under ``run.root`` as training does). The index is the one training opens: ``retrieval.index_dir`` or
``<run.root>/index/<corpus fingerprint>`` for tantivy, ``retrieval.elastic.index`` for Elasticsearch.
With ``retrieval.rerank=dense`` the MiniLM passage vectors are computed too (stored in Elasticsearch
when ``retrieval.elastic.store_vectors``). An interrupted build is refused unless ``--resume`` is given,
which continues it from the last committed batch. Progress goes to stderr; one summary line to stdout.
"""
from __future__ import annotations

import sys

from sonar.cluster.wire.config import Config


def run_index(cfg: Config, *, resume: bool = False, progress: bool = True):
    """Build (or check, or finish) the index of ``cfg``; returns the ``IndexReport``."""
    from sonar.cluster.driver.roles import indexes_dir, prepare_corpus
    from sonar.retrieval.indexer import ensure_index

    corpus = prepare_corpus(cfg, None)
    return ensure_index(cfg.retrieval, corpus, indexes_dir(cfg), resume=resume, progress=progress)


def main(cfg: Config, resume: bool) -> int:
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
        rep = run_index(cfg, resume=resume)
    except (IndexBuildError, CorpusError, FileNotFoundError) as e:
        print(f"sonar: index error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    what = "complete, reused" if rep.reused else ("resumed and completed" if rep.resumed else "built")
    exp = f" of {rep.expected_docs} expected" if rep.expected_docs is not None else ""
    vec = f"; vectors {rep.vectors_dir}" if rep.vectors_dir else (
        "; vectors stored in the index" if cfg.retrieval.backend == "elasticsearch" and cfg.retrieval.elastic.store_vectors
        else "")
    print(f"sonar: index {rep.location} ({rep.backend}) {what}: {rep.num_docs} documents{exp} in "
          f"{rep.seconds:.1f} s{vec}")
    return 0
